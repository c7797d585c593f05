"""The operators' limits, applied where a run is claimed: a run over a limit waits.

Before their claim, a message's leased runs that are due are checked against every limit that
binds them (:mod:`relayr.core.limits`) by the limit store (:mod:`relayr.ledger.limits`), which
also takes what each run uses, in the transaction that reads them; what an attempt held in
flight is given back in the transaction that records its outcome. A run refused is not
attempted: in reflexr's store it stays ``pending`` (or ``retrying``), its due time moved to when
the limit expects to allow it, or to a lease away for a limit on what is in flight, which the
run that frees a slot brings forward by waking the runs waiting on it. So a run over a limit
never fails for it, never runs twice (the claim decides, as ever) and is never lost (it stays
due in the store). The ADRs "limits on what rules spend" and "a limit rides the transactions a
run already has" say why.

Nothing here runs for an application whose allowlist has no limit.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

import structlog
from artifactr import ExternalAgentActor
from artifactr.core import InvalidState
from reflexr.core import WAITING, Run
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.core.allowlist import Allowlists
from relayr.core.ids import derive_id
from relayr.core.limits import TURN_KINDS, Limit, LimitKind, Rate
from relayr.ledger.limits import Admission, Check, LimitStore, Refusal, Release, RunKey
from relayr.ledger.port import Cause, WorkspaceKey
from relayr.observe import hooks
from relayr.runtime.bridge import Bridge
from relayr.runtime.process import Runtime
from relayr.runtime.transient import retried
from relayr.runtime.waking import Requeue, make_due, queue_woken

logger = structlog.get_logger("relayr.limits")

RELOAD_CHECK_S: Final = 1.0
"""How often a worker looks whether the limits in force changed (the allowlist file is looked
at once a second too): a raised limit lets the runs waiting on it go within about a second."""

TURN_SLOT_TTL: Final = timedelta(minutes=10)
"""How long a ``turns_in_flight`` slot outlives the attempt whose message started the turn,
unless the turn's end frees it first: longer than a turn, so it is only the safety net of a turn
whose end no follower sees (a worker killed mid-turn leaves its turn running in artifactr)."""

FIRST_HIT_WINDOW: Final = timedelta(minutes=1)
"""How long after a limit's ``limit hit`` log line its next refusals stay quiet (counted only)."""


@dataclass
class Admitted:
    """What :meth:`Limiter.admit` decided: the runs refused (and why), and those admitted
    under some limit, which hold what they use until released."""

    refused: dict[str, str] = field(default_factory=dict)
    bound: set[str] = field(default_factory=set)
    not_due: dict[str, str] = field(default_factory=dict)
    """Runs bound by a limit that were not due yet: not claimed, not counted."""


@dataclass
class Limiter:
    """Checks runs against the limits in force, defers those over them, and wakes waiters."""

    rules: Workspaces
    store: LimitStore
    allowlists: Callable[[], Allowlists]
    lease_ttl: timedelta
    requeue: Requeue | None = None
    bridge: Bridge | None = None
    """Where a chain's notice is posted (a worker's bridge); None: no notice."""
    _hit_at: dict[str, datetime] = field(default_factory=dict)

    def active(self) -> bool:
        """Whether the allowlist in force has any limit (else nothing here runs)."""
        return bool(self.allowlists().limits)

    def binds(self, ref: WorkspaceRef, rule: str) -> bool:
        """Whether some limit binds runs of ``rule`` in the workspace."""
        return bool(self.allowlists().limits_for(rule, ref.tenant_id, ref.workspace_id))

    async def admit(self, ref: WorkspaceRef, run_ids: Sequence[str]) -> "Admitted":
        """Check the runs against their limits, in the transaction that reads them (the limit
        store's statements ride its commit). Those refused are deferred (in one transaction)
        and said why; those admitted under a limit on what is in flight hold its slots until
        :meth:`releasing`."""
        now = self.rules.clock()
        admission = Admission(now, now + self.lease_ttl)
        admitted = Admitted()
        by_key: dict[RunKey, Run] = {}

        async def read_and_admit() -> None:
            allowlists = self.allowlists()
            admission.asked.clear()
            admitted.not_due.clear()
            async with (
                self.store.admitting(admission),
                self.rules.storage.transaction(ref) as transaction,
            ):
                for run_id in run_ids:
                    run = await transaction.run(run_id)
                    if run is not None and run.status in WAITING:
                        key = RunKey(ref.tenant_id, ref.workspace_id, run.id)
                        by_key[key] = run
                        _ask(admission, admitted, key, run, checks_for(allowlists, ref, run))

        await retried(read_and_admit)
        refusals = admission.refused
        admitted.bound.update(
            key.run_id
            for key, checks in admission.asked.items()
            if key not in refusals and any(isinstance(check.bound, int) for check in checks)
        )  # they hold slots until their attempts are done
        if refusals:
            await self._defer(ref, refusals, now)
        for key, refusal in refusals.items():
            run = by_key[key]
            admitted.refused[run.id] = refusal.describe()
            self._hit(run, refusal, now)
            if refusal.check.kind == "chain_runs_per":
                await self._chain_notice(ref, run, refusal)
        return admitted

    async def _chain_notice(self, ref: WorkspaceRef, run: Run, refusal: Refusal) -> None:
        """Say once, in the thread of the event that made the run's rule fire, that its chain
        was stopped and why: the notice's id is derived from the chain and the limit, so a
        second refusal finds it posted. A notice that cannot be posted is logged, nothing more:
        the run waits all the same."""
        if self.bridge is None or not run.matched:
            return
        try:
            fired = await self.rules.storage.read(ref, after_seq=run.matched[-1] - 1, limit=1)
            thread_id = fired[0].data.get("thread_id") if fired else None
            if not isinstance(thread_id, str) or not thread_id:
                return
            await post_chain_notice(self.bridge, ref, run, refusal, thread_id)
        except Exception:
            logger.warning("the chain's notice could not be posted", run_id=run.id, exc_info=True)

    async def _defer(
        self, ref: WorkspaceRef, refusals: Mapping[RunKey, Refusal], now: datetime
    ) -> None:
        """Move the waiting runs' due times, in one transaction: to when each refusal expects
        it to go, else a lease away (the safety net of a wake that never comes, as from a
        worker that died holding a slot)."""
        until = {
            key.run_id: refusal.next_at if refusal.next_at is not None else now + self.lease_ttl
            for key, refusal in refusals.items()
        }

        async def defer() -> None:
            async with self.rules.storage.transaction(ref) as transaction:
                moved: list[Run] = []
                for run_id, at in until.items():
                    run = await transaction.run(run_id)
                    if run is not None and run.status in WAITING and run.next_attempt_at < at:
                        moved.append(
                            run.model_copy(update={"next_attempt_at": at, "updated_at": now})
                        )
                if moved:
                    await transaction.save_runs(moved)

        await retried(defer)

    def _hit(self, run: Run, refusal: Refusal, now: datetime) -> None:
        check = refusal.check
        hooks.emit(hooks.RunLimited(run.rule, f"{check.limit}/{check.kind}"))
        last = self._hit_at.get(check.bucket)
        if last is None or now - last >= FIRST_HIT_WINDOW:
            self._hit_at[check.bucket] = now
            logger.warning(
                "limit hit: runs wait",
                limit=f"limits.{check.limit}",
                kind=check.kind,
                bound=str(check.bound),
                rule=run.rule,
                run_id=run.id,
                next_at=None if refusal.next_at is None else refusal.next_at.isoformat(),
            )

    async def release(self, ref: WorkspaceRef, runs: Mapping[str, bool]) -> None:
        """:meth:`releasing`, in a transaction of its own (attempts that recorded nothing)."""
        async with self.releasing(ref, runs):
            pass

    @asynccontextmanager
    async def releasing(self, ref: WorkspaceRef, runs: Mapping[str, bool]) -> AsyncIterator[None]:
        """Free what the runs' attempts held in flight with the block's storage transaction
        (the completion that records their outcomes), and wake the runs waiting on those
        limits after it. ``runs`` says whether each attempt sent a message that starts a turn:
        its ``turns_in_flight`` slot is kept until the turn ends (:meth:`LimitStore.turn_ended`,
        as the followers see it), under a lease of :data:`TURN_SLOT_TTL` in case its end is
        never seen. A block that raised frees nothing: the caller still holds the slots."""
        if not runs:
            yield
            return
        until = self.rules.clock() + TURN_SLOT_TTL
        release = Release(
            {
                RunKey(ref.tenant_id, ref.workspace_id, run_id): until if sent else None
                for run_id, sent in runs.items()
            }
        )
        raised = True
        try:
            async with self.store.releasing(release):
                yield
                raised = False
            await self.wake(release.woken)
        except Exception:
            if raised:
                raise
            logger.exception(  # the slots' leases lapse: the waiters go then
                "releasing runs' limits failed; their leases will free them", runs=sorted(runs)
            )

    async def renew(self, ref: WorkspaceRef, run_id: str) -> None:
        key = RunKey(ref.tenant_id, ref.workspace_id, run_id)
        await retried(
            lambda: self.store.renew(key, lease_until=self.rules.clock() + self.lease_ttl)
        )

    async def wake(self, runs: Sequence[RunKey]) -> None:
        """Make waiting runs due now (reflexr's ``retry``), oldest first, and queue them."""
        await queue_woken(self.requeue, await make_due(self.rules, self.store, runs))


async def post_chain_notice(
    bridge: Bridge, ref: WorkspaceRef, run: Run, refusal: Refusal, thread_id: str
) -> bool:
    """Post the chain breaker's notice as the run's rule; False if it was posted already.

    Its cause is recorded first, as for every write of a rule (the run's chain), so the
    followers bridge it like the rule's own notices.
    """
    check = refusal.check
    message_id = derive_id(
        "msg",
        run_id=f"chain:{run.correlation_id}",
        segment=0,
        operation="chain_stopped",
        subject=(check.limit, thread_id),
        ordinal=0,
    )
    when = (
        "" if refusal.next_at is None else f" Its next run waits until {refusal.next_at:%H:%M:%S}."
    )
    content = (
        f"relayr stopped this chain: it reached the chain_runs_per {check.bound} of "
        f"limits.{check.limit} (runs one chain may start per window).{when} An operator may "
        f"cancel the waiting run: relayr runs cancel {run.id}"
    )
    workspace = WorkspaceKey(ref.tenant_id, ref.workspace_id)
    cause = Cause(run.correlation_id, run.id, run.id, run.depth)
    await bridge.ledger.record_cause(workspace, "message", message_id, cause)
    actor = ExternalAgentActor(client_id=f"reflexr:{run.rule}", name=run.rule)
    handle = await bridge.artifacts.open(ref.tenant_id, ref.workspace_id, actor=actor)
    try:
        await handle.post_message(thread_id, content, message_id=message_id, kind="notice")
    except InvalidState:
        return False
    logger.warning(
        "chain stopped: notice posted",
        limit=f"limits.{check.limit}",
        correlation_id=run.correlation_id,
        run_id=run.id,
        thread_id=thread_id,
        message_id=message_id,
    )
    return True


def _ask(
    admission: Admission, admitted: Admitted, key: RunKey, run: Run, checks: list[Check]
) -> None:
    """Ask to admit a waiting run its limits bind, if it is due. One that is not due as the
    limits see it is left alone, so the claim, a moment later, cannot start it unchecked (the
    claim reads the clock again): its due time brings it back. Another run starts nothing and
    counts nothing: the claim says what it is."""
    if not checks:
        return
    if run.next_attempt_at > admission.now:
        admitted.not_due[run.id] = f"is due at {run.next_attempt_at.isoformat()}"
    else:
        admission.asked[key] = checks


def checks_for(allowlists: Allowlists, ref: WorkspaceRef, run: Run) -> list[Check]:
    """What a run must fit in: each bound of each limit that binds it. Limits on turns bind
    only a rule granted turns: another rule's runs start none."""
    limits = allowlists.limits_for(run.rule, ref.tenant_id, ref.workspace_id)
    if not limits:
        return []
    turns = allowlists.for_rule(run.rule).turns
    key = str(RunKey(ref.tenant_id, ref.workspace_id, run.id))
    checks: list[Check] = []
    for limit in limits:
        for kind, bound in limit.bounds():
            if kind in TURN_KINDS and not turns:
                continue
            checks.append(_check(limit, kind, bound, key, run))
    return checks


def _check(limit: Limit, kind: LimitKind, bound: int | Rate, key: str, run: Run) -> Check:
    bucket = f"{limit.name}/{kind}"
    if kind == "chain_runs_per":
        bucket = f"{bucket}/{run.correlation_id}"
    use: str | None = key  # a chain's run, a run's token windows: once, whatever its attempts
    if isinstance(bound, int):
        use = None  # a slot, held by the run
    elif kind == "turns_per":
        # each attempt: one whose worker died before its send left the turn to the next
        # attempt, which may start it in a later window (counted twice at worst, never missed)
        use = f"{key}#{run.epoch + 1}"
    return Check(limit.name, kind, bucket, bound, use, 0 if kind == "tokens_per" else 1)


_watching: set["asyncio.Task[None]"] = set()


def watch_reloads(runtime: Runtime) -> None:
    """Start, on the running loop, what wakes every waiting run when the limits in force
    change (a reload of the allowlist file): those a raised limit lets go start at once, the
    others are checked again and wait on. Once per process; a worker calls it."""
    if _watching:
        return
    limiter = Limiter(
        runtime.application.rules,
        runtime.bridge.limits,
        runtime.bridge.allowlists,
        timedelta(seconds=runtime.settings.lease_ttl_s),
        runtime.requeue,
    )
    task = asyncio.get_running_loop().create_task(_follow_reloads(limiter))
    _watching.add(task)
    task.add_done_callback(_watching.discard)


async def _follow_reloads(limiter: Limiter) -> None:
    last = limiter.allowlists().limits
    while True:
        await asyncio.sleep(RELOAD_CHECK_S)
        try:
            limits = limiter.allowlists().limits
            if limits == last:
                continue
            last = limits
            waiting = await retried(lambda: limiter.store.waiting())
            logger.info("limits changed: waiting runs checked again", runs=len(waiting))
            await limiter.wake([wait.run for wait in waiting])
        except Exception:
            logger.exception("waking runs after the limits changed failed; they wait on")
