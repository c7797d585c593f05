"""Followers: each workspace's artifactr log becomes reflexr events, once each.

For every workspace relayr serves (:class:`relayr.follow.config.Inbound`), a follower reads the
artifactr log after its cursor, projects each envelope into a bridged event
(:mod:`relayr.follow.projections`), publishes the batch into the same workspace's reflexr log
with each envelope's id as the event's id, and only then moves its cursor. So:

- **once each**: an envelope published twice (the process died between the publish and the
  cursor, or two followers overlapped) is found by its id and appended once, as reflexr's own
  ``publish`` does with an id already in the log;
- **one follower per workspace at a time**: a lease kept with the cursor
  (:mod:`relayr.follow.store`), taken or renewed every third of ``lease_ttl_s``; a follower
  that lost it writes no cursor;
- **causal chains continue**: an envelope a rule's run wrote (its author is
  ``external_agent:reflexr:<rule>``) continues that run's chain one step deeper, found in the
  ledger under the write's id (a direct write to an artifact: the revision it made, ADR-0065),
  where ADR-0023 commits it no later than the write itself; an envelope a turn of the agent
  wrote continues the chain of the newest message its turn carried out that a run posted
  (:func:`relayr.turns.newest_cause`, ADR-0026). Rules that answer each other so stop at
  reflexr's depth limit. Anything else starts a chain of its own;
- **a bad envelope does not stop the log**: one whose projection raises, that a rule wrote
  without a recorded cause (it would escape the depth limit), or that would go past the depth
  limit is dead-lettered with its reason, and the cursor moves past it. ``relayr follow
  dead-letters replay`` projects it again and publishes it under the same id.

A batch is published in one reflexr transaction, whatever chains its envelopes belong to:
``Workspace.publish_many`` stamps one causation on all its events, which would cost a
transaction per rule run in a burst of rules' notices. The batch is appended through reflexr's
storage ``Transaction`` the way ``publish_many`` appends (an id already in the log is skipped,
a new workspace's rules start at its first event, the depth limit holds), after reflexr's
``authorize`` allowed the follower to publish (ADR-0065).

A pass over a workspace with nothing new costs one read of artifactr's log (and, every third of
the lease, one statement that renews it); with new envelopes: the read, one read of the ledger
for the batch's causes when it has rules' writes or turns, one reflexr transaction, and one
that moves the cursor (with the lease and the batch's dead letters).
"""

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Final, Self

import structlog
from artifactr import SystemActor as ArtifactSystemActor
from artifactr import Workspace as ArtifactWorkspace
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import ArtifactArchived, ArtifactChanged, ArtifactCreated, Rejection, RunStarted
from artifactr.core import Envelope as ArtifactrEnvelope
from reflexr import Event
from reflexr.core import Causation
from reflexr.workspace import Access, Entry, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces
from reflexr.workspace.workspace import meet_rules

from relayr import telemetry
from relayr.application import Application
from relayr.follow.config import Inbound
from relayr.follow.events import FOLLOWER
from relayr.follow.projections import PROJECTIONS, Projection, Source, event_type
from relayr.follow.store import (
    DeadLetter,
    FollowStore,
    InMemoryFollowStore,
    Position,
    SqlFollowStore,
)
from relayr.ledger.port import Cause, Ledger, WorkspaceKey, WriteKind, revision_key
from relayr.turns import newest_cause

if TYPE_CHECKING:
    from opentelemetry.trace import Span

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

TURNS_KEPT: Final = 10_000
"""How many turns' message ids a follower keeps from the ``run_started`` it read: the turn's
later envelopes (the reply, its end) usually follow in the same or the next batch."""

TURN_LOOKUP_PAGE: Final = 200
TURN_LOOKUP_PAGES: Final = 10
"""When a turn's ``run_started`` is not kept (a restarted follower, a very long turn), its
thread is read backwards for it, this many envelopes at a time, at most this many times; a
turn whose start is further back continues no chain."""

ARTIFACTR_FOLLOWER: Final = ArtifactSystemActor(name="relayr-follower")
"""Who lists artifactr's workspaces and reads their logs for the followers."""

RULE_CLIENT_PREFIX: Final = "reflexr:"
"""The client id of a rule's participant in artifactr: ``reflexr:<rule>`` (relayr.actions)."""

PROJECTION_FAILED: Final = "projection_failed"
"""A dead letter's reason: the projection raised (or returned something else than an event)."""

CAUSE_MISSING: Final = "cause_missing"
"""A dead letter's reason: a rule wrote the envelope but the ledger holds no cause for it;
bridged as a chain of its own, it would escape the depth limit."""

DEPTH_EXCEEDED: Final = "depth_exceeded"
"""A dead letter's reason: the envelope would continue its chain past reflexr's depth limit,
which reflexr refuses to publish."""


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Followed:
    """What following did, summed over workspaces and batches.

    Attributes:
        workspaces: Workspaces followed (their lease held).
        elsewhere: Workspaces another follower holds.
        failed: Workspaces whose pass raised (logged; the next pass starts over).
        read: Envelopes read from artifactr.
        bridged: Events appended to reflexr.
        duplicates: Events already in reflexr's log (published before the cursor moved).
        skipped: Envelopes no projection bridges (threads, turn starts, tool calls, ...).
        dead: Envelopes dead-lettered.
        batches: Batches published.
        behind: Workspaces left with more to bridge after :data:`BATCHES_PER_PASS` batches.
    """

    workspaces: int = 0
    elsewhere: int = 0
    failed: int = 0
    read: int = 0
    bridged: int = 0
    duplicates: int = 0
    skipped: int = 0
    dead: int = 0
    batches: int = 0
    behind: int = 0

    def __iadd__(self, other: "Followed") -> Self:
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


@dataclass(frozen=True)
class WorkspaceStatus:
    """Where a workspace's follower stands.

    Attributes:
        workspace: The workspace.
        cursor: The last artifactr seq bridged (0: none yet).
        head: artifactr's last seq: ``head - cursor`` envelopes wait.
        holder: Who holds its lease (maybe lapsed), or None.
        held_until: When that lease lapses.
        dead_letters: Its dead letters waiting for a replay.
    """

    workspace: WorkspaceKey
    cursor: int
    head: int
    holder: str | None
    held_until: datetime | None
    dead_letters: int

    @property
    def lag(self) -> int:
        return max(self.head - self.cursor, 0)


@dataclass(frozen=True)
class Replayed:
    """What a replay of dead letters did.

    Attributes:
        bridged: Envelope ids bridged now (appended, or found in reflexr's log already).
        failed: Dead letters that failed again, with their new reason and error.
        unknown: Envelope ids asked for that are not waiting dead letters of the workspace.
    """

    bridged: tuple[str, ...]
    failed: tuple[DeadLetter, ...]
    unknown: tuple[str, ...]


@dataclass
class _Prepared:
    """A batch made ready to publish: the entries, and what was left out."""

    entries: list[Entry] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    skipped: int = 0
    spans: list["Span"] = field(default_factory=list)
    """With tracing on, a ``relayr.bridge`` span per entry, ended once the batch is published."""


@dataclass
class _Held:
    """A workspace whose lease this follower holds: its cursor, and when the lease was renewed
    (on the monotonic clock)."""

    cursor: int
    renewed_at: float


class _CauseMissing:
    """A rule's write whose cause the ledger does not hold."""


_MISSING: Final = _CauseMissing()


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
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._artifacts = artifacts
        self._rules = rules
        self._ledger = ledger
        self.store: Final = store
        self._holder = holder
        self._lease_ttl_s = lease_ttl_s
        self._inbound = inbound or Inbound()
        self._projections: Mapping[str, Projection] = {
            **PROJECTIONS,
            **self._inbound.projections,
        }
        self._clock = clock
        self._monotonic = monotonic
        self._held: dict[WorkspaceKey, _Held] = {}
        self._handles: dict[WorkspaceKey, ArtifactWorkspace] = {}
        self._turns: OrderedDict[tuple[WorkspaceKey, str], tuple[str, ...]] = OrderedDict()
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
            return sorted(configured, key=_order)
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
            prepared = await self._prepare(key, handle, envelopes)
            try:
                bridged, duplicates = await self._publish(key, prepared.entries)
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
        keys = sorted({*positions, *await self.workspaces()}, key=_order)
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
        prepared = await self._prepare(key, handle, envelopes)
        await self._publish(key, prepared.entries)
        failed_ids = {letter.envelope_id for letter in prepared.dead}
        bridged = tuple(
            letter.envelope_id for letter in chosen if letter.envelope_id not in failed_ids
        )
        await self.store.replayed(key, bridged, at=self._clock())
        for letter in prepared.dead:
            await self.store.failed_again(letter)
        logger.info(
            "dead letters replayed",
            workspace=str(key),
            bridged=len(bridged),
            failed=len(prepared.dead),
            unknown=len(unknown),
        )
        return Replayed(bridged=bridged, failed=tuple(prepared.dead), unknown=unknown)

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

    async def _prepare(
        self,
        key: WorkspaceKey,
        handle: ArtifactWorkspace,
        envelopes: Sequence[ArtifactrEnvelope],
    ) -> _Prepared:
        """Project each envelope and find the chain it continues; what fails is dead."""
        for envelope in envelopes:
            if isinstance(envelope.event, RunStarted):
                self._keep_turn(key, envelope.event.run_id, envelope.event.message_ids)
        turns = await self._turn_messages(key, handle, envelopes)
        causes = await self._causes(key, envelopes, turns)
        messages = {write: cause for (kind, write), cause in causes.items() if kind == "message"}
        prepared = _Prepared()
        for envelope in envelopes:
            projection = self._projections.get(event_type(envelope))
            if projection is None:
                prepared.skipped += 1
                continue
            source = Source(envelope, None if envelope.run_id is None else turns[envelope.run_id])
            try:
                event = projection(source)
                if event is not None and not isinstance(event, Event):
                    raise TypeError(f"the projection returned a {type(event).__name__}")
            except Exception as error:
                prepared.dead.append(
                    self._dead(key, envelope, PROJECTION_FAILED, f"{type(error).__name__}: {error}")
                )
                continue
            if event is None:
                prepared.skipped += 1
                continue
            cause = _cause_of(envelope, causes, messages, turns)
            if isinstance(cause, _CauseMissing):
                prepared.dead.append(
                    self._dead(
                        key,
                        envelope,
                        CAUSE_MISSING,
                        f"{envelope.actor.participant} wrote envelope {envelope.id}, "
                        "and the ledger holds no cause for it",
                    )
                )
                continue
            causation = None
            if cause is not None:
                causation = Causation(
                    firing_id=cause.firing_id, run_id=cause.run_id, depth=cause.depth + 1
                )
                if causation.depth > self._rules.max_depth:
                    prepared.dead.append(
                        self._dead(
                            key,
                            envelope,
                            DEPTH_EXCEEDED,
                            f"it continues run {cause.run_id}'s chain at depth "
                            f"{causation.depth}, beyond the limit of {self._rules.max_depth}",
                        )
                    )
                    continue
            # the bridged event continues the envelope's trace, through a span of the follower
            span = telemetry.bridge_span(
                key.tenant_id, key.workspace_id, envelope, event.event_type
            )
            if span is not None:
                prepared.spans.append(span)
            prepared.entries.append(
                Entry(
                    id=envelope.id,
                    actor=FOLLOWER,
                    event=event,
                    causation=causation,
                    correlation_id=None if cause is None else cause.correlation_id,
                    traceparent=telemetry.traceparent_of(span),
                )
            )
        return prepared

    async def _publish(self, key: WorkspaceKey, entries: Sequence[Entry]) -> tuple[int, int]:
        """Append the entries whose ids are not in reflexr's log yet, in one transaction, as
        ``Workspace.publish_many`` appends; return how many were appended and found."""
        if not entries:
            return 0, 0
        rules = await self._rules.open(key.tenant_id, key.workspace_id, actor=FOLLOWER)
        await rules.check(Access(action="reflexr:publish"))
        ref = WorkspaceRef(key.tenant_id, key.workspace_id)
        async with self._rules.storage.transaction(ref) as transaction:
            await meet_rules(transaction, self._rules.rules.values())
            fresh = [entry for entry in entries if await transaction.envelope(entry.id) is None]
            if fresh:
                await transaction.append(fresh)
        return len(fresh), len(entries) - len(fresh)

    async def _turn_messages(
        self,
        key: WorkspaceKey,
        handle: ArtifactWorkspace,
        envelopes: Iterable[ArtifactrEnvelope],
    ) -> dict[str, tuple[str, ...]]:
        """The message ids of the turn of every envelope a turn wrote, by turn id."""
        found: dict[str, tuple[str, ...]] = {}
        for envelope in envelopes:
            turn = envelope.run_id
            if turn is None or turn in found:
                continue
            kept = self._turns.get((key, turn))
            if kept is None:
                thread_id = envelope.thread_id or await _thread_of(handle, turn)
                if thread_id is not None:
                    kept = await self._find_turn(handle, thread_id, turn, envelope.seq)
                    self._keep_turn(key, turn, kept)
            found[turn] = kept or ()
        return found

    async def _find_turn(
        self, handle: ArtifactWorkspace, thread_id: str, turn: str, before_seq: int
    ) -> tuple[str, ...]:
        """Read a thread backwards from ``before_seq`` for the ``run_started`` of ``turn``."""
        for _ in range(TURN_LOOKUP_PAGES):
            page = await handle.read(
                threads={thread_id}, before_seq=before_seq, last=TURN_LOOKUP_PAGE
            )
            for envelope in reversed(page):
                event = envelope.event
                if isinstance(event, RunStarted) and event.run_id == turn:
                    return tuple(event.message_ids)
            if len(page) < TURN_LOOKUP_PAGE:
                break
            before_seq = page[0].seq
        logger.warning(
            "a turn's start was not found: its envelopes start chains of their own",
            thread_id=thread_id,
            turn_id=turn,
        )
        return ()

    def _keep_turn(self, key: WorkspaceKey, turn: str, message_ids: Sequence[str]) -> None:
        self._turns[(key, turn)] = tuple(message_ids)
        self._turns.move_to_end((key, turn))
        while len(self._turns) > TURNS_KEPT:
            self._turns.popitem(last=False)

    async def _causes(
        self,
        key: WorkspaceKey,
        envelopes: Iterable[ArtifactrEnvelope],
        turns: Mapping[str, Sequence[str]],
    ) -> dict[tuple[WriteKind, str], Cause]:
        """The causes of the batch's rules' writes and of its turns' messages: one read."""
        wanted: set[tuple[WriteKind, str]] = set()
        for envelope in envelopes:
            wanted.update(_rule_write(envelope))
        for message_ids in turns.values():
            wanted.update(("message", message_id) for message_id in message_ids)
        if not wanted:
            return {}
        return await self._ledger.causes(key, wanted)

    def _dead(
        self, key: WorkspaceKey, envelope: ArtifactrEnvelope, reason: str, error: str
    ) -> DeadLetter:
        return DeadLetter(
            workspace=key,
            envelope_id=envelope.id,
            seq=envelope.seq,
            event_type=event_type(envelope),
            reason=reason,
            error=error,
            dead_at=self._clock(),
        )


_RULE_WRITES: Final[Mapping[str, tuple[WriteKind, str]]] = {
    "message_posted": ("message", "message_id"),
    "thread_created": ("thread", "thread_id"),
    "proposal_created": ("proposal", "proposal_id"),
}
"""Under which key the ledger holds the cause of each kind of write a rule makes by an id derived
from its run (:mod:`relayr.actions`): the kind of write and the event's field that names it. A
direct write to an artifact is found by the revision it made (:func:`_rule_write`)."""


def is_rule_author(envelope: ArtifactrEnvelope) -> bool:
    """Whether a rule's run wrote the envelope: its author is ``external_agent:reflexr:<rule>``."""
    actor = envelope.actor
    return actor.kind == "external_agent" and actor.client_id.startswith(RULE_CLIENT_PREFIX)


def _rule_write(envelope: ArtifactrEnvelope) -> tuple[tuple[WriteKind, str], ...]:
    """The ledger keys of a rule's write, in the order to look them up; none when a rule did
    not write the envelope (or wrote something the ledger keeps no cause for).

    A direct write to an artifact is found by the revision it made, which one write alone makes
    (ADR-0065); then by the artifact's id, under which relayr recorded such a write before, so a
    write made then is still found (in the chain of the artifact's first writer, as then).
    """
    if not is_rule_author(envelope):
        return ()
    event = envelope.event
    if isinstance(event, ArtifactCreated | ArtifactChanged | ArtifactArchived):
        return (
            ("revision", revision_key(event.artifact_id, event.version)),
            ("artifact", event.artifact_id),
        )
    found = _RULE_WRITES.get(event_type(envelope))
    if found is None:
        return ()
    kind, attribute = found
    return ((kind, str(getattr(event, attribute))),)


def _cause_of(
    envelope: ArtifactrEnvelope,
    causes: Mapping[tuple[WriteKind, str], Cause],
    messages: Mapping[str, Cause],
    turns: Mapping[str, Sequence[str]],
) -> Cause | _CauseMissing | None:
    """The run whose chain the envelope continues; None for a chain of its own.

    ``causes`` are the batch's causes by ledger key, ``messages`` those of messages by id.
    """
    if is_rule_author(envelope):
        found = next((causes[key] for key in _rule_write(envelope) if key in causes), None)
        return _MISSING if found is None else found
    if envelope.run_id is not None:
        return newest_cause(turns.get(envelope.run_id, ()), messages)
    return None


async def _thread_of(handle: ArtifactWorkspace, turn: str) -> str | None:
    """The thread of a turn, for an envelope of it that names none (an artifact's change)."""
    try:
        return (await handle.run(turn)).thread_id
    except Rejection:
        return None


def _order(key: WorkspaceKey) -> tuple[str, str]:
    return (key.tenant_id, key.workspace_id)
