"""The transactions that start and end attempts of runs, many runs per transaction.

:func:`claim` starts an attempt of each leased run that is due and first in its scope (a lapsed
``running`` run is recorded ``abandoned``); :func:`complete` records the outcomes of attempts
still current (``dropped`` otherwise) and starts the next run of each scope a finished run held
back. Each re-reads what it changes in one transaction on the workspace, and its tries after a
transient fault share a :class:`HiddenCommits`, so a commit a
fault hid is found, not taken for another executor's (ADR-0001, ADR-0024).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pydantic import JsonValue
from reflexr.core import (
    FINISHED,
    WAITING,
    Envelope,
    Rule,
    Run,
    RunCancelled,
    RunDeadLettered,
    RunRetrying,
    RunStarted,
    RunSucceeded,
    cancel,
    fail,
    new_event_id,
    runnable,
    start,
    succeed,
)
from reflexr.workspace import REACTOR, Entry, RunFailure, Transaction, WorkspaceRef, Workspaces

from relayr.core import reasons
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import RunClaimed

type _Mark = tuple[str, int, int, datetime]


def _mark(run: Run) -> _Mark:
    return (run.status, run.epoch, run.attempts, run.updated_at)


@dataclass
class HiddenCommits[T]:
    """The tries of one step, and what the last of them was about to commit.

    Every change a step makes moves a run to another status at that try's own ``now``, which
    no one else writes, so a run that reads back exactly as the last try saved it (status,
    epoch, attempts, ``updated_at``) was saved by that try: its transaction committed whole,
    and its result stands. A try that finds nothing of the last one's in the store acts
    afresh, as that one rolled back.
    """

    saved: dict[str, Run] = field(default_factory=dict)
    result: T | None = None

    def about_to_commit(self, runs: Iterable[Run], result: T) -> None:
        self.saved = {run.id: run for run in runs}  # the last version of each run
        self.result = result

    async def committed(self, transaction: Transaction) -> T | None:
        """The last try's result if its commit took effect, else None."""
        for saved in self.saved.values():
            stored = await transaction.run(saved.id)
            if stored is not None and _mark(stored) == _mark(saved):
                return self.result
        return None


type RunOutcome = Literal[
    "succeeded",
    "retrying",
    "dead",
    "cancelled",
    "missing",
    "not_due",
    "contended",
    "dropped",
    "interrupted",
    "abandoned",
    "limited",
]
"""What executing a run did.

``succeeded``, ``retrying`` and ``dead``: an attempt ran and its outcome was recorded.
``abandoned``: a leftover attempt was recorded as failed; none ran. ``cancelled``: the run's
rule is gone, so the run was cancelled. ``missing``, ``not_due``, ``contended``: nothing was
done. ``interrupted``: the attempt stopped being current while its action ran, which was
cancelled; ``dropped``: it stopped being current before its outcome was recorded. In both,
nothing was recorded: whoever made it not current decided. ``limited``: an operator's limit
held the run back; it was not attempted and waits, due again when the limit expects to allow it.
"""


@dataclass(frozen=True)
class Executed:
    """What executing (or failing) one run did.

    Attributes:
        outcome: What happened (see :data:`RunOutcome`).
        run: The run as this call left it or found it, or None if it was not read.
        detail: For people: why, naming the run.
        run_id: The run's id, which ``run`` also has when it was read.
    """

    outcome: RunOutcome
    run: Run | None = None
    detail: str = ""
    run_id: str = ""


@dataclass(frozen=True)
class Ended:
    """How an action ended, before it is recorded."""

    kind: Literal["succeeded", "failed", "interrupted"]
    output: JsonValue = None
    error: str = ""
    reason: str | None = None
    permanent: bool = False

    @classmethod
    def failed(cls, failure: RunFailure) -> "Ended":
        return cls(
            "failed", error=failure.message, reason=failure.reason, permanent=failure.permanent
        )


@dataclass
class ScopeOrder:
    """The unfinished runs of one scope of a rule ordered by scope, in firing order, as read
    when its first run was claimed, and the runs since known to have succeeded."""

    runs: list[Run]
    succeeded: set[str] = field(default_factory=set)

    def after(self, run_id: str) -> str | None:
        """The run that comes after ``run_id`` in the scope and was waiting when read."""
        ids = [run.id for run in self.runs]
        if run_id not in ids:
            return None
        later = self.runs[ids.index(run_id) + 1 :]
        return next((run.id for run in later if run.status in WAITING), None)

    def before(self, run_id: str) -> list[str]:
        """The runs before ``run_id`` that may still hold it back: every one not known to
        have succeeded."""
        earlier: list[str] = []
        for run in self.runs:
            if run.id == run_id:
                return earlier
            if run.id not in self.succeeded:
                earlier.append(run.id)
        return earlier


@dataclass(frozen=True)
class Claimed:
    """An attempt that started: the run, the rule it runs as the claim read it, the envelopes
    that made it fire, and its scope's order for a rule ordered by scope."""

    run: Run
    rule: Rule
    events: tuple[Envelope, ...]
    order: ScopeOrder | None = None


@dataclass(frozen=True)
class Finished:
    """An attempt whose action ended, and the run the same scope may go on with."""

    claimed: Claimed
    ended: Ended
    successor: str | None = None


@dataclass(frozen=True)
class Completion:
    """What :func:`relayr.execution.attempts.complete` did: each ended attempt's outcome, the
    successors it started, and the successors it found ``running`` under a lease that had lapsed, so
    recorded ``abandoned`` (none of them ran)."""

    executed: dict[str, Executed]
    started: list[Claimed]
    abandoned: dict[str, Executed]


def missing(ref: WorkspaceRef, run_id: str) -> Executed:
    """What executing a run that does not exist did: nothing."""
    return Executed(
        "missing",
        None,
        f"run {run_id} does not exist in {ref.tenant_id}/{ref.workspace_id}",
        run_id,
    )


type _Fact = RunStarted | RunSucceeded | RunRetrying | RunDeadLettered | RunCancelled


class NoRunFound(Exception):
    """Raised inside a transaction that found none of its runs, so it rolls back: reflexr's
    storage records a workspace when a transaction on it commits, and a task naming a workspace
    that does not exist must leave nothing behind."""


class _Changes:
    """The runs a transaction changed and their ``reflexr:*`` facts, saved together at its end."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.facts: list[Entry] = []

    def record(self, run: Run, fact: _Fact) -> None:
        self.runs.append(run)
        self.facts.append(
            Entry(
                id=new_event_id(),
                actor=REACTOR,
                event=fact,
                causation=run.causation,
                correlation_id=run.correlation_id,
            )
        )

    async def save(self, transaction: Transaction) -> None:
        if self.runs:
            await transaction.save_runs(self.runs)
            await transaction.append(self.facts)


async def claim(
    rules: Workspaces,
    ref: WorkspaceRef,
    run_ids: Sequence[str],
    *,
    max_lost: int,
    tries: HiddenCommits[dict[str, Claimed | Executed]] | None = None,
) -> dict[str, Claimed | Executed]:
    """Start an attempt of every run of ``run_ids`` that can start, in one transaction.

    ``tries`` is shared by the tries of one claim (see the module).

    Raises:
        NoRunFound: If no run of ``run_ids`` exists (the transaction rolls back).
    """
    tries = HiddenCommits() if tries is None else tries
    async with rules.storage.transaction(ref) as transaction:
        claims = await tries.committed(transaction)
        if claims is None:
            changes = _Changes()
            claims = await _claim_all(rules, transaction, changes, ref, run_ids, max_lost=max_lost)
            await changes.save(transaction)
            tries.about_to_commit(changes.runs, claims)
    _lagged(claims.values())
    return claims


async def _claim_all(
    rules: Workspaces,
    transaction: Transaction,
    changes: _Changes,
    ref: WorkspaceRef,
    run_ids: Sequence[str],
    *,
    max_lost: int,
) -> dict[str, Claimed | Executed]:
    now = rules.clock()
    found = await rules.rules_in(transaction)
    claims: dict[str, Claimed | Executed] = {}
    orders: dict[tuple[str, str], ScopeOrder] = {}
    for run_id in run_ids:
        run = await transaction.run(run_id)
        if run is None:
            claims[run_id] = missing(ref, run_id)
            continue
        rule = found.get(run.rule)
        if rule is None:
            claims[run_id] = _cancel_orphan(changes, run, now)
            continue
        order = None
        if rule.rule.ordering == "scope" and run.status in WAITING:
            key = (run.rule, run.scope_key)
            if key not in orders:
                scope = await transaction.scope_runs(run.rule, run.scope_key)
                orders[key] = ScopeOrder(scope)
            order = orders[key]
        claims[run_id] = await _claim_one(
            transaction, changes, run, rule.rule, now, order, max_lost=max_lost, fresh=True
        )
    if all(isinstance(c, Executed) and c.outcome == "missing" for c in claims.values()):
        raise NoRunFound(f"none of the runs {', '.join(run_ids)} exists in {ref}")
    return claims


async def complete(
    rules: Workspaces,
    ref: WorkspaceRef,
    finished: Sequence[Finished],
    *,
    max_lost: int,
    tries: HiddenCommits[Completion] | None = None,
) -> Completion:
    """Record each attempt's outcome, and start the successors the scopes may go on with.

    An outcome is recorded only if its attempt is still the run's current one. A successor
    starts only if, with its predecessor's outcome recorded, it is due and first in its scope.
    ``tries`` is shared by the tries of one completion (see the module).
    """
    tries = HiddenCommits() if tries is None else tries
    async with rules.storage.transaction(ref) as transaction:
        completion = await tries.committed(transaction)
        if completion is None:
            now = rules.clock()
            changes, follow = _Changes(), _Changes()
            executed: dict[str, Executed] = {}
            for done in finished:
                executed[done.claimed.run.id] = await _complete_one(transaction, changes, done, now)
            await changes.save(transaction)  # the successors' claims read these outcomes
            started, abandoned = await _successors(
                transaction, follow, finished, executed, now, max_lost=max_lost
            )
            await follow.save(transaction)
            completion = Completion(executed, started, abandoned)
            tries.about_to_commit([*changes.runs, *follow.runs], completion)
    _lagged(completion.started)
    return completion


async def _successors(
    transaction: Transaction,
    follow: _Changes,
    finished: Sequence[Finished],
    executed: dict[str, Executed],
    now: datetime,
    *,
    max_lost: int,
) -> tuple[list[Claimed], dict[str, Executed]]:
    """Start the run each finished one's scope goes on with; say which started, and which
    were found abandoned."""
    started: list[Claimed] = []
    abandoned: dict[str, Executed] = {}
    for done in finished:
        order = done.claimed.order
        if done.successor is None or order is None:
            continue
        outcome = executed[done.claimed.run.id]
        if outcome.run is not None and outcome.run.status == "succeeded":
            order.succeeded.add(outcome.run.id)
        run = await transaction.run(done.successor)
        if run is None:
            continue
        # the rule as the claim read it: only a code rule is ordered by scope (reflexr keeps
        # stored rules unordered and enabled), and a code rule changes only with the process
        claimed = await _claim_one(
            transaction, follow, run, done.claimed.rule, now, order, max_lost=max_lost
        )
        if isinstance(claimed, Claimed):
            started.append(claimed)
        elif claimed.outcome == "abandoned":
            abandoned[run.id] = claimed
    return started, abandoned


def _lagged(claims: Iterable[Claimed | Executed]) -> None:
    """Count how late each started attempt began, once its start committed."""
    for claimed in claims:
        if isinstance(claimed, Claimed):
            run = claimed.run  # started at updated_at; starting leaves next_attempt_at
            hooks.emit(RunClaimed((run.updated_at - run.next_attempt_at).total_seconds()))


async def fail_for_good(
    rules: Workspaces,
    ref: WorkspaceRef,
    run_id: str,
    *,
    reason: str,
    error: str,
    tries: HiddenCommits[Executed] | None = None,
) -> Executed:
    """Record the run's current attempt as failed for good (see
    :func:`relayr.execution.executor.fail_run`).

    Raises:
        NoRunFound: If the run does not exist (the transaction rolls back).
    """
    tries = HiddenCommits() if tries is None else tries
    async with rules.storage.transaction(ref) as transaction:
        executed = await tries.committed(transaction)
        if executed is None:
            changes = _Changes()
            executed = await _fail_one(
                rules, transaction, changes, ref, run_id, reason=reason, error=error
            )
            await changes.save(transaction)
            tries.about_to_commit(changes.runs, executed)
    return executed


async def _fail_one(
    rules: Workspaces,
    transaction: Transaction,
    changes: _Changes,
    ref: WorkspaceRef,
    run_id: str,
    *,
    reason: str,
    error: str,
) -> Executed:
    now = rules.clock()
    run = await transaction.run(run_id)
    if run is None:
        raise NoRunFound(f"run {run_id} does not exist in {ref}")
    found = (await rules.rules_in(transaction)).get(run.rule)
    if found is None:
        return _cancel_orphan(changes, run, now)
    if run.status not in WAITING and run.status != "running":
        return Executed("not_due", run, f"run {run_id} is {run.status}: nothing to fail")
    if run.status in WAITING:
        run, started = start(run, now=now)
        changes.record(run, started)
    failed, dead = fail(run, found.rule, now=now, error=error, reason=reason, permanent=True)
    changes.record(failed, dead)
    return Executed(
        "dead", failed, f"attempt {failed.attempts} of run {run_id} failed for good: {reason}"
    )


async def _claim_one(
    transaction: Transaction,
    changes: _Changes,
    run: Run,
    rule: Rule,
    now: datetime,
    order: ScopeOrder | None,
    *,
    max_lost: int,
    fresh: bool = False,
) -> Claimed | Executed:
    """Start an attempt of ``run`` if it can start now; ``fresh`` when ``order`` was read in
    this transaction (else the runs before ``run`` are read again)."""
    if not rule.enabled:
        return Executed("not_due", run, f"run {run.id} waits: rule {rule.name} is disabled")
    if run.status == "running":
        return _abandon(changes, run, rule, now, max_lost=max_lost)
    if run.status not in WAITING:
        return Executed("not_due", run, f"run {run.id} is {run.status}")
    if run.next_attempt_at > now:
        return Executed("not_due", run, f"run {run.id} is due at {run.next_attempt_at.isoformat()}")
    if order is not None:
        scope = order.runs if fresh else await _scope_before(transaction, order, run)
        if run.id not in {r.id for r in runnable(scope, rule, now=now)}:
            return Executed("not_due", run, f"run {run.id} waits: it is not first in its scope")
    events: list[Envelope] = []
    for seq in run.matched:
        events.extend(await transaction.read(after_seq=seq - 1, limit=1))
    started, begun = start(run, now=now, trace_id=telemetry.run_trace_id(run, events))
    changes.record(started, begun)
    return Claimed(started, rule, tuple(events), order)


async def _scope_before(transaction: Transaction, order: ScopeOrder, run: Run) -> list[Run]:
    """The scope's unfinished runs up to ``run``, read now: ``run`` and every run before it
    that is not known to have succeeded (the rest cannot hold it back, see the module)."""
    scope: list[Run] = []
    for run_id in order.before(run.id):
        earlier = await transaction.run(run_id)
        if earlier is None or earlier.status == "succeeded":
            order.succeeded.add(run_id)
        else:
            scope.append(earlier)
    return [*scope, run]


def _abandon(changes: _Changes, run: Run, rule: Rule, now: datetime, *, max_lost: int) -> Executed:
    """Record a leftover ``running`` attempt as failed: the caller holds the run's lease, so
    the executor of that attempt stopped renewing it. Past ``max_lost`` such attempts in a row
    the run fails for good (``worker_lost``): an action that kills its worker would otherwise
    kill one worker per attempt of its retry policy."""
    lost = reasons.lost_in_a_row(run.reason, run.error) + 1
    error = reasons.abandoned_error(lost)
    failed, fact = (
        fail(run, rule, now=now, error=error, reason=reasons.WORKER_LOST, permanent=True)
        if lost > max_lost
        else fail(run, rule, now=now, error=error, reason=reasons.ABANDONED)
    )
    changes.record(failed, fact)
    return Executed(
        "abandoned",
        failed,
        f"attempt {run.attempts} of run {run.id} was abandoned by its executor: "
        f"recorded as failed, the run is {failed.status}",
    )


async def _complete_one(
    transaction: Transaction, changes: _Changes, done: Finished, now: datetime
) -> Executed:
    run, ended = done.claimed.run, done.ended
    current = await transaction.run(run.id)
    if current is None or not current.is_running(run.epoch):
        status = "gone" if current is None else current.status
        return Executed(
            "dropped",
            current,
            f"attempt {run.attempts} of run {run.id} is no longer current (the run is "
            f"{status}): its {ended.kind} outcome was not recorded",
        )
    fact: _Fact
    if ended.kind == "succeeded":
        finished, fact = succeed(current, now=now, output=ended.output)
    else:
        finished, fact = fail(
            current,
            done.claimed.rule,
            now=now,
            error=ended.error,
            reason=ended.reason,
            permanent=ended.permanent,
        )
    changes.record(finished, fact)
    detail = f"attempt {finished.attempts} of run {finished.id} {finished.status}"
    if ended.kind == "failed":
        detail += f": {ended.error}" + (f" ({ended.reason})" if ended.reason else "")
    outcome: RunOutcome = (
        "succeeded"
        if finished.status == "succeeded"
        else "dead"
        if finished.status == "dead"
        else "retrying"
    )
    return Executed(outcome, finished, detail)


def _cancel_orphan(changes: _Changes, run: Run, now: datetime) -> Executed:
    """Cancel a run whose rule the workspace no longer has, so it stops being due."""
    if run.status in FINISHED:
        return Executed("not_due", run, f"run {run.id} is {run.status}")
    cancelled, fact = cancel(run, now=now, reason=reasons.RULE_GONE)
    changes.record(cancelled, fact)
    return Executed(
        "cancelled", cancelled, f"run {run.id} was cancelled: its rule {run.rule} is gone"
    )
