"""Followers: each workspace's artifactr log becomes reflexr events, once each (ADR-0065).

A follower reads the artifactr log after its cursor, projects each envelope
(:mod:`relayr.follow.projections`), publishes the batch in one reflexr transaction with each
envelope's id as the event's (so a repeat appends nothing), and only then moves its cursor. One
follower per workspace holds the lease (:mod:`relayr.follow.store`); one that lost it writes no
cursor. An envelope a run or its turn wrote continues that run's chain
(:mod:`relayr.follow.chains`). A bad envelope is dead-lettered and the log goes on; ``relayr
follow dead-letters replay`` publishes it again under the same id.
"""

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Final, Self

import structlog
from artifactr import SystemActor as ArtifactSystemActor
from artifactr import Workspace as ArtifactWorkspace
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.core.errors import InvalidAllowlist
from relayr.follow.batches import Batches, TurnEnd
from relayr.follow.config import Inbound
from relayr.follow.projections import PROJECTIONS
from relayr.follow.reports import Followed, Replayed, WorkspaceStatus
from relayr.follow.store import (
    FollowStore,
    InMemoryFollowStore,
    Position,
    SqlFollowStore,
    workspace_order,
)
from relayr.ledger.limits import LimitStore, RunKey
from relayr.ledger.port import Ledger, WorkspaceKey
from relayr.observe import telemetry
from relayr.runtime.allowlist_file import AllowlistFile
from relayr.runtime.application import Application
from relayr.runtime.transient import retried
from relayr.runtime.waking import Requeue, make_due, queue_woken

if TYPE_CHECKING:
    from relayr.runtime.process import Runtime

logger = structlog.get_logger("relayr.follow")

BATCH_ENVELOPES: Final = 500
"""How many envelopes one read of artifactr's log takes, and one reflexr transaction appends,
as the evaluation's batch (ADR-0028): the transaction holds the workspace's lock meanwhile."""

BATCHES_PER_PASS: Final = 4
"""How many batches a pass bridges per workspace before it goes on to the next workspace and
the evaluation: a workspace far behind catches up over a few passes without holding up the
others, or the runs its bridged events make."""

WORKSPACES_REFRESH_S: Final = 5.0
"""How long the list of workspaces to follow is kept before it is read again: listing costs a
read per tenant, and a new workspace waits at most this long for its first bridged event."""

WORKSPACE_PAGE: Final = 100
"""How many artifactr workspaces of a tenant one listing call returns."""

ARTIFACTR_FOLLOWER: Final = ArtifactSystemActor(name="relayr-follower")
"""Who lists artifactr's workspaces and reads their logs for the followers."""


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Held:
    """A workspace whose lease this follower holds: its cursor, and when the lease was renewed
    (on the monotonic clock)."""

    cursor: int
    renewed_at: float


class Followers:
    """The followers of one process: every workspace's, one pass at a time.

    Args:
        artifacts: artifactr's workspaces, whose logs are read.
        rules: reflexr's workspaces, where the bridged events go.
        ledger: Where the causes of rules' writes are found.
        store: Cursors, leases and dead letters.
        holder: This process's name in the leases.
        lease_ttl_s: How long a lease lasts unless renewed.
        inbound: The application's inbound side: workspaces, projections, hook.
        limits: The operators' limits' counts: a turn that ends gives back its slot and counts
            its tokens (:meth:`relayr.ledger.limits.LimitStore.turn_ended`).
        requeue: Queues the runs a turn's end lets go, at once (else the dispatcher finds them
            due).
        turn_limits: Whether any limit counts turns or tokens now: when none does, a turn's end
            costs the limits nothing.
        clock: The wall clock leases are stamped with.
        monotonic: The clock renewals and the workspace list are timed on.
    """

    def __init__(
        self,
        *,
        artifacts: ArtifactWorkspaces,
        rules: RuleWorkspaces,
        ledger: Ledger,
        store: FollowStore,
        holder: str,
        lease_ttl_s: float,
        inbound: Inbound | None = None,
        limits: LimitStore | None = None,
        requeue: Requeue | None = None,
        turn_limits: Callable[[], bool] = lambda: True,
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._requeue = requeue
        self._turn_limits = turn_limits
        self._artifacts = artifacts
        self._rules = rules
        self.store: Final = store
        self._holder = holder
        self._lease_ttl_s = lease_ttl_s
        self._inbound = inbound or Inbound()
        self._clock = clock
        self._batches = Batches(rules, ledger, {**PROJECTIONS, **self._inbound.projections}, clock)
        self._monotonic = monotonic
        self._held: dict[WorkspaceKey, _Held] = {}
        self._handles: dict[WorkspaceKey, ArtifactWorkspace] = {}
        self._listed: list[WorkspaceKey] | None = None
        self._listed_at = 0.0

    @classmethod
    def of(
        cls,
        application: Application,
        ledger: Ledger,
        *,
        holder: str,
        lease_ttl_s: float,
        store: FollowStore | None = None,
        limits: LimitStore | None = None,
        requeue: Requeue | None = None,
        turn_limits: Callable[[], bool] = lambda: True,
    ) -> Self:
        """The followers of an application.

        Their store is in the application's first engine's database, next to the ledger, or
        in memory for an application without one.
        """
        if store is None:
            engines = application.engines
            store = SqlFollowStore(engines[0]) if engines else InMemoryFollowStore()
        return cls(
            artifacts=application.artifacts,
            rules=application.rules,
            ledger=ledger,
            store=store,
            holder=holder,
            lease_ttl_s=lease_ttl_s,
            inbound=application.inbound,
            limits=limits,
            requeue=requeue,
            turn_limits=turn_limits,
        )

    async def follow_all(self) -> Followed:
        """Follow every workspace served, one after the other.

        A workspace whose pass raises is logged and counted (``failed``); its cursor stays, and
        the next pass starts over from it. So is a failure to list the workspaces: following
        never stops the dispatcher's pass it runs in.
        """
        total = Followed()
        try:
            keys = await self.workspaces()
        except Exception:
            logger.exception("listing the workspaces to follow failed; the next pass tries again")
            return Followed(failed=1)
        for key in keys:
            try:
                total += await self.follow(key)
            except Exception:
                logger.exception(
                    "following a workspace failed; the next pass starts over", workspace=str(key)
                )
                self._held.pop(key, None)
                total.failed += 1
        return total

    async def workspaces(self) -> list[WorkspaceKey]:
        """The workspaces to follow: the application's, or every artifactr workspace of the
        tenants reflexr's storage knows (and the application names), read again every
        :data:`WORKSPACES_REFRESH_S`."""
        configured = self._inbound.workspaces
        if configured is not None:
            return sorted(configured, key=workspace_order)
        now = self._monotonic()
        if self._listed is not None and now - self._listed_at < WORKSPACES_REFRESH_S:
            return self._listed
        known = await self._rules.storage.workspaces()
        tenants = sorted({ref.tenant_id for ref in known} | set(self._inbound.tenants))
        found: list[WorkspaceKey] = []
        for tenant in tenants:
            after: str | None = None
            while True:
                page = await self._artifacts.list(
                    tenant, actor=ARTIFACTR_FOLLOWER, after=after, limit=WORKSPACE_PAGE
                )
                found += [WorkspaceKey(tenant, workspace_id) for workspace_id in page]
                if len(page) < WORKSPACE_PAGE:
                    break
                after = page[-1]
        self._listed, self._listed_at = found, now
        return found

    async def follow(self, key: WorkspaceKey) -> Followed:
        """Bridge what is new in one workspace's artifactr log, batch by batch, under its lease.

        Returns what it did; ``elsewhere`` when another follower holds the workspace.
        """
        held = await self._lease(key)
        if held is None:
            return Followed(elsewhere=1)
        done = Followed(workspaces=1)
        handle = await self._handle(key)
        for batch in range(BATCHES_PER_PASS):
            envelopes = await handle.read(after_seq=held.cursor, limit=BATCH_ENVELOPES)
            if not envelopes:
                break
            done.read += len(envelopes)
            prepared = await self._batches.prepare(key, envelopes)
            try:
                bridged, duplicates = await self._batches.publish(key, prepared)
            finally:
                for span in prepared.spans:
                    telemetry.end(span)
            seqs = [envelope.seq for envelope in envelopes]
            logger.info(
                "follow batch published",
                workspace=str(key),
                first_seq=seqs[0],
                last_seq=seqs[-1],
                bridged=bridged,
                duplicates=duplicates,
                skipped=prepared.skipped,
                dead=len(prepared.dead),
            )
            for letter in prepared.dead:
                logger.warning(
                    "envelope dead-lettered",
                    workspace=str(key),
                    envelope_id=letter.envelope_id,
                    seq=letter.seq,
                    event_type=letter.event_type,
                    reason=letter.reason,
                    error=letter.error,
                )
            if self._inbound.after_publish is not None:
                await self._inbound.after_publish(key, seqs)
            await self._turns_ended(key, prepared.turn_ends)
            renewed_at = self._monotonic()
            moved = await self.store.advance(
                key, self._holder, seqs[-1], until=self._until(), dead=prepared.dead
            )
            if not moved:
                logger.warning(
                    "follow lease lost: another follower took the workspace; its cursor stays",
                    workspace=str(key),
                    holder=self._holder,
                )
                del self._held[key]
                break
            held.cursor, held.renewed_at = seqs[-1], renewed_at
            done.bridged += bridged
            done.duplicates += duplicates
            done.skipped += prepared.skipped
            done.dead += len(prepared.dead)
            done.batches += 1
            if len(envelopes) < BATCH_ENVELOPES:
                break
            if batch == BATCHES_PER_PASS - 1:
                done.behind = 1
        return done

    async def _turns_ended(self, key: WorkspaceKey, ends: Sequence[TurnEnd]) -> None:
        """Give the limits what the batch's ended turns held, and wake the runs that waited
        for it. Done again, it changes nothing: a slot is freed and a turn counted once."""
        if self._limits is None or not ends or not self._turn_limits():
            return
        limits = self._limits
        woken: list[RunKey] = []
        for end in ends:
            run = RunKey(key.tenant_id, key.workspace_id, end.run_id)
            now = self._rules.clock()
            ended = partial(limits.turn_ended, run, end.turn_id, end.tokens, now)
            woken.extend(await retried(ended))
        if not woken:
            return
        due = await make_due(self._rules, limits, list(dict.fromkeys(woken)))
        await queue_woken(self._requeue, due)

    async def serve(self, interval_s: float, stop: asyncio.Event) -> None:
        """Follow every workspace every ``interval_s`` until ``stop`` is set, then release the
        leases. A pass that left a workspace behind is followed at once by the next."""
        try:
            while not stop.is_set():
                done = await self.follow_all()
                if done.bridged or done.dead or done.failed:
                    logger.info("follow pass", **vars(done))
                if done.behind:
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval_s):
                        await stop.wait()
        finally:
            await self.release()

    async def status(self) -> list[WorkspaceStatus]:
        """Every workspace followed or to follow: its cursor, artifactr's head, who holds it,
        and its dead letters waiting."""
        positions = {position.workspace: position for position in await self.store.positions()}
        waiting = Counter(letter.workspace for letter in await self.store.dead_letters())
        keys = sorted({*positions, *await self.workspaces()}, key=workspace_order)
        found = []
        for key in keys:
            position = positions.get(key) or Position(key, 0, None, None)
            head = await (await self._handle(key)).head_seq()
            found.append(
                WorkspaceStatus(
                    workspace=key,
                    cursor=position.cursor,
                    head=head,
                    holder=position.holder,
                    held_until=position.held_until,
                    dead_letters=waiting[key],
                )
            )
        return found

    async def release(self) -> None:
        """Give up every lease this follower holds, so another may follow at once."""
        for key in list(self._held):
            try:
                await self.store.release(key, self._holder)
            except Exception:
                logger.exception("releasing a follow lease failed", workspace=str(key))
            del self._held[key]

    async def replay(
        self, key: WorkspaceKey, envelope_ids: Collection[str] | None = None
    ) -> Replayed:
        """Project and publish a workspace's dead letters again (those named, or every one
        waiting), each under its envelope's id; mark those bridged as replayed.

        Only a letter whose event is in reflexr's log afterwards (appended now, or found there)
        is marked. One whose envelope artifactr's log no longer gives back, or that no
        projection bridges now, stays waiting, reported apart.

        Needs no lease: what it publishes is published once, whoever else publishes it.
        """
        waiting = await self.store.dead_letters(key)
        chosen = [
            letter
            for letter in waiting
            if envelope_ids is None or letter.envelope_id in envelope_ids
        ]
        unknown = tuple(
            sorted(set(envelope_ids or ()) - {letter.envelope_id for letter in waiting})
        )
        handle = await self._handle(key)
        envelopes = [
            envelope
            for letter in chosen
            for envelope in await handle.read(after_seq=letter.seq - 1, limit=1)
            if envelope.id == letter.envelope_id
        ]
        prepared = await self._batches.prepare(key, envelopes)
        try:
            await self._batches.publish(key, prepared)
        finally:
            for span in prepared.spans:
                telemetry.end(span)
        published = {entry.id for entry in prepared.entries}
        read = {envelope.id for envelope in envelopes}
        failed = {letter.envelope_id for letter in prepared.dead}
        bridged = tuple(letter.envelope_id for letter in chosen if letter.envelope_id in published)
        not_found = tuple(letter.envelope_id for letter in chosen if letter.envelope_id not in read)
        skipped = tuple(
            letter.envelope_id
            for letter in chosen
            if letter.envelope_id in read
            and letter.envelope_id not in published
            and letter.envelope_id not in failed
        )
        await self.store.replayed(key, bridged, at=self._clock())
        for letter in prepared.dead:
            await self.store.failed_again(letter)
        logger.info(
            "dead letters replayed",
            workspace=str(key),
            bridged=len(bridged),
            failed=len(prepared.dead),
            skipped=len(skipped),
            not_found=len(not_found),
            unknown=len(unknown),
        )
        return Replayed(
            bridged=bridged,
            failed=tuple(prepared.dead),
            unknown=unknown,
            skipped=skipped,
            not_found=not_found,
        )

    async def _lease(self, key: WorkspaceKey) -> _Held | None:
        """The workspace's lease: kept, renewed every third of its time, or taken."""
        held = self._held.get(key)
        now = self._monotonic()
        if held is not None and now - held.renewed_at < self._lease_ttl_s / 3:
            return held
        cursor = await self.store.take(key, self._holder, until=self._until(), now=self._clock())
        if cursor is None:
            self._held.pop(key, None)
            return None
        held = self._held[key] = _Held(cursor, now)
        return held

    def _until(self) -> datetime:
        return self._clock() + timedelta(seconds=self._lease_ttl_s)

    async def _handle(self, key: WorkspaceKey) -> ArtifactWorkspace:
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = await self._artifacts.open(
                key.tenant_id, key.workspace_id, actor=ARTIFACTR_FOLLOWER
            )
        return handle


def followers_of(runtime: "Runtime") -> "Followers":
    """The followers of the runtime's application, holding leases as the runtime's process
    (``relayr follow``, the console's health page, and the dispatcher when it follows).
    artifactr is imported here, when called: listing and changing runs loads reflexr alone
    (ADR-0050)."""
    return Followers.of(
        runtime.application,
        runtime.bridge.ledger,
        holder=runtime.holder,
        lease_ttl_s=runtime.settings.lease_ttl_s,
        limits=runtime.bridge.limits,
        requeue=runtime.requeue,
        turn_limits=turn_limits_in(runtime.settings.allowlist),
    )


def turn_limits_in(path: "str | os.PathLike[str]") -> Callable[[], bool]:
    """Whether the allowlist file at ``path`` has a limit on turns or tokens, as it is now
    (looked at once a second). A file that cannot be read says yes: counting what no limit
    needs costs a transaction; missing a turn's end would keep its slot for a lease."""
    try:
        file = AllowlistFile.open(path, on_invalid=lambda _: None, on_reload=lambda _: None)
    except InvalidAllowlist:
        return lambda: True

    def any_turn_limit() -> bool:
        limits = file.current().limits
        return file.last_error is not None or any(
            limit.turns_in_flight is not None or limit.tokens_per is not None for limit in limits
        )

    return any_turn_limit
