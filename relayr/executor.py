"""Executing one reflexr run by id: claim it, run its action as its rule, record the outcome.

What reflexr's own executor does (ADR-0005 there: at least once, under leases), with public
names only, for one run a queue message names. reflexr's store is the truth about the run; the
message is only a hint that it may be due (DESIGN contract 7), so:

- the run's lease is taken first: a run another executor holds is left alone (``contended``);
- the claim re-reads the run and its rule in one transaction, and starts an attempt only if the
  run is due and first in its scope; anything else does nothing (``not_due``, ``missing``). A
  ``running`` run whose lease this executor could take was left by an executor that stopped:
  that attempt is recorded as failed, reason ``abandoned``, and retried under the rule's policy;
- the action runs with a ``Reaction`` whose ``deps`` is the runtime's bridge, while the lease is
  renewed every third of its life; if the lease is lost or the attempt stops being the run's
  current one (an operator cancelled or retried it), the action is cancelled (``interrupted``);
- the outcome is recorded only if the attempt is still current (else ``dropped``), so a late
  executor never overwrites a cancel, a retry or a newer attempt.

A duplicated, lost or redelivered message therefore repeats and loses nothing: the second
delivery finds the lease held, or the run finished. The writes a retried attempt repeats are
made once by their derived ids (:mod:`relayr.actions`).

Transactions are few, because each one costs a round trip and, on SQLite, the file's write lock:
take the lease, claim (the run, its rule and its matched events are read in the same
transaction), complete, and release the lease unless the run succeeded. A succeeded run can
never start again, so its lease is left to lapse rather than spending a transaction on it
(ADR-0002). Transient storage faults (a dropped connection, a locked SQLite file) are retried
a few times inside these steps; each step is safe to repeat.
"""

import asyncio
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from time import perf_counter
from typing import Any, Final, Literal

import structlog
from pydantic import BaseModel, JsonValue, TypeAdapter, ValidationError
from reflexr import AgentActor as RuleAgentActor
from reflexr.core import (
    FINISHED,
    WAITING,
    Envelope,
    Forbidden,
    InvalidRule,
    Rule,
    Run,
    RunCancelled,
    RunDeadLettered,
    RunRetrying,
    RunStarted,
    RunSucceeded,
    cancel,
    fail,
    load_params,
    new_event_id,
    runnable,
    start,
    succeed,
)
from reflexr.workspace import (
    REACTOR,
    Action,
    Entry,
    Reaction,
    RunFailure,
    Transaction,
    WorkspaceRef,
    Workspaces,
    run_lease,
)
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from relayr import metrics
from relayr.runtime import Runtime

type Outcome = Literal[
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
]
"""What executing a run did.

``succeeded``, ``retrying`` and ``dead``: an attempt ran and its outcome was recorded.
``abandoned``: a leftover attempt was recorded as failed; none ran. ``cancelled``: the run's
rule is gone, so the run was cancelled. ``missing``, ``not_due``, ``contended``: nothing was
done. ``interrupted``: the attempt stopped being current while its action ran, which was
cancelled; ``dropped``: it stopped being current before its outcome was recorded. In both,
nothing was recorded: whoever made it not current decided.
"""

ABANDONED: Final = "the attempt was abandoned: its executor stopped"
"""The error recorded for an attempt whose executor stopped before it ended."""

WORKER_LOST: Final = "worker_lost"
"""Why a run failed for good after its attempts kept losing their worker."""

_LOST = re.compile(r"\((\d+) attempts? lost in a row\)$")


def lost_in_a_row(run: Run) -> int:
    """How many attempts of ``run`` in a row were abandoned before its current one.

    ``start`` keeps the last failure's reason and error, so the count travels in the error the
    claim wrote when it recorded the previous abandoned attempt.
    """
    if run.reason != "abandoned" or run.error is None:
        return 0
    found = _LOST.search(run.error)
    return int(found.group(1)) if found else 1


RULE_GONE: Final = "rule_gone"
"""The reason a run is cancelled with when its workspace no longer has its rule."""

STORAGE_TRIES: Final = 3
"""How often one storage step is tried when the storage fails transiently. Each step is safe to
repeat, and three tries ride out a dropped connection or a SQLite file locked by another
process, while a database that is down fails the task within about a second."""

STORAGE_BACKOFF_S: Final = (0.05, 0.5)
"""The first and the longest wait between tries of a storage step."""

type _Fact = RunStarted | RunSucceeded | RunRetrying | RunDeadLettered | RunCancelled

_JSON: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)

logger = structlog.get_logger("relayr.executor")


@dataclass(frozen=True)
class Executed:
    """What :func:`execute_run` or :func:`fail_run` did to one run.

    Attributes:
        outcome: What happened (see :data:`Outcome`).
        run: The run as this call left it or found it, or None if it does not exist.
        detail: For people: why, naming the run.
        next_runs: Runs of the same rule and scope that can start now because this one
            finished, for the caller to enqueue at once. Only rules ordered by scope have them:
            their runs start one at a time, so without this a scope would advance one run per
            dispatcher pass.
    """

    outcome: Outcome
    run: Run | None = None
    detail: str = ""
    next_runs: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Ended:
    """How an action ended, before it is recorded."""

    kind: Literal["succeeded", "failed", "interrupted"]
    output: JsonValue = None
    error: str = ""
    reason: str | None = None
    permanent: bool = False

    @classmethod
    def failed(cls, failure: RunFailure) -> "_Ended":
        return cls(
            "failed", error=failure.message, reason=failure.reason, permanent=failure.permanent
        )


def is_transient(error: BaseException) -> bool:
    """Whether a storage error may pass if the same step is tried again.

    A lost or refused connection and SQLite's ``database is locked`` are; a constraint or a
    programming error is not, and neither is anything that is not the database's.
    """
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, OperationalError | InterfaceError | ConnectionError)


async def _retried[T](step: Callable[[], Awaitable[T]]) -> T:
    """Run one storage step, trying it again after a transient failure."""
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(STORAGE_TRIES),
        wait=wait_exponential(min=STORAGE_BACKOFF_S[0], max=STORAGE_BACKOFF_S[1]),
        retry=retry_if_exception(is_transient),
        reraise=True,
    ):
        with attempt:
            return await step()
    raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover


async def execute_run(runtime: Runtime, tenant_id: str, workspace_id: str, run_id: str) -> Executed:
    """Execute one attempt of a run, if it is due and no other executor holds it.

    Never raises for a run's own failure: that is recorded on the run and returned as its
    outcome. It raises only if storage keeps failing, when nothing was recorded that a later
    delivery cannot finish, or if the caller cancels it; then the lease is released, so the
    attempt is recorded ``abandoned`` by the next claim.
    """
    storage = runtime.application.rules.storage
    ref = WorkspaceRef(tenant_id, workspace_id)
    key = run_lease(run_id)
    ttl = timedelta(seconds=runtime.settings.lease_ttl_s)
    log = logger.bind(run_id=run_id, tenant=tenant_id, workspace=workspace_id)
    here = (tenant_id, workspace_id, run_id)
    if here in runtime.executing:
        # Our own lease would be renewed, not refused: tell this process's executors apart.
        return _contended(log, f"run {run_id} is being executed in this process: left alone")
    runtime.executing.add(here)
    try:
        if not await _retried(lambda: storage.acquire_lease(ref, key, runtime.holder, ttl)):
            return _contended(log, f"run {run_id} is held by another executor: left alone")
        return await _execute_leased(runtime, ref, run_id, ttl, log)
    finally:
        runtime.executing.discard(here)


async def _execute_leased(
    runtime: Runtime, ref: WorkspaceRef, run_id: str, ttl: timedelta, log: Any
) -> Executed:
    """Claim, act and complete under the run's lease; release it unless the run succeeded."""
    rules = runtime.application.rules
    storage = rules.storage
    key = run_lease(run_id)
    release = True
    try:
        max_lost = runtime.settings.max_redeliveries
        claimed = await _unless_missing(
            lambda: _retried(lambda: _claim(rules, ref, run_id, max_lost))
        )
        if isinstance(claimed, Executed):
            _log_declined(log, claimed)
            metrics.record_run(None if claimed.run is None else claimed.run.rule, claimed.outcome)
            return claimed
        run, rule, events = claimed
        log = log.bind(rule=rule.name, attempt=run.attempts)
        log.info("attempt started", epoch=run.epoch, action=rule.then.action)
        began = perf_counter()
        ended = await _run_action(runtime, ref, run, rule, events, ttl)
        if ended.kind == "interrupted":
            executed = Executed(
                "interrupted",
                run,
                f"attempt {run.attempts} of run {run.id} stopped being current while its "
                "action ran: the action was cancelled and nothing was recorded",
            )
        else:
            executed = await _retried(lambda: _complete(rules, ref, run, rule, ended))
        release = executed.outcome != "succeeded"
        metrics.record_run(rule.name, executed.outcome, perf_counter() - began)
        log.info(
            "attempt ended",
            outcome=executed.outcome,
            reason=None if executed.run is None else executed.run.reason,
            detail=executed.detail,
            next_runs=list(executed.next_runs),
        )
        return executed
    finally:
        if release:
            await _retried(lambda: storage.release_lease(ref, key, runtime.holder))


async def fail_run(
    runtime: Runtime, tenant_id: str, workspace_id: str, run_id: str, *, reason: str, error: str
) -> Executed:
    """Record a run's current attempt as failed for good, as for a task that keeps killing
    its worker (the bounded-redelivery path).

    A ``running`` run's attempt fails permanently (``dead``); a due run is started and failed
    at once, so the attempt that never got to run is counted. Like an operator's cancel, this
    takes no lease: an executor that still runs the attempt finds it no longer current and
    records nothing. A finished run is left as it is (``not_due``).
    """
    rules = runtime.application.rules
    ref = WorkspaceRef(tenant_id, workspace_id)

    async def record() -> Executed:
        async with rules.storage.transaction(ref) as transaction:
            now = rules.clock()
            loaded = await _run_and_rule(rules, transaction, ref, run_id, now)
            if isinstance(loaded, Executed):
                return loaded
            run, rule = loaded
            if run.status in WAITING:
                run, started = start(run, now=now)
                await _save(transaction, run, started)
            elif run.status != "running":
                return Executed("not_due", run, f"run {run_id} is {run.status}: nothing to fail")
            failed, dead = fail(run, rule, now=now, error=error, reason=reason, permanent=True)
            await _save(transaction, failed, dead)
            return Executed(
                "dead",
                failed,
                f"attempt {failed.attempts} of run {run_id} failed for good: {reason}",
                await _next_runs(transaction, rule, failed, now),
            )

    executed = await _unless_missing(lambda: _retried(record))
    metrics.record_run(None if executed.run is None else executed.run.rule, executed.outcome)
    logger.warning(
        "run failed by its executor",
        run_id=run_id,
        tenant=tenant_id,
        workspace=workspace_id,
        outcome=executed.outcome,
        reason=reason,
        detail=executed.detail,
    )
    return executed


async def _claim(
    rules: Workspaces, ref: WorkspaceRef, run_id: str, max_lost: int
) -> tuple[Run, Rule, tuple[Envelope, ...]] | Executed:
    """Start an attempt of the run if it is due and first in its scope, in one transaction.

    The attempt runs its rule as the claim reads it, with the envelopes that made it fire. A
    leftover ``running`` attempt is recorded as failed (``abandoned``); past ``max_lost`` such
    attempts in a row the run is failed for good (``worker_lost``), since an action that kills
    its worker would otherwise kill one worker per attempt of its retry policy.
    """
    async with rules.storage.transaction(ref) as transaction:
        now = rules.clock()
        loaded = await _run_and_rule(rules, transaction, ref, run_id, now)
        if isinstance(loaded, Executed):
            return loaded
        run, rule = loaded
        if not rule.enabled:
            return Executed("not_due", run, f"run {run_id} waits: rule {rule.name} is disabled")
        if run.status == "running":
            # We hold the lease, so the executor of this attempt stopped renewing it.
            lost = lost_in_a_row(run) + 1
            error = f"{ABANDONED} ({lost} {'attempt' if lost == 1 else 'attempts'} lost in a row)"
            failed, fact = (
                fail(run, rule, now=now, error=error, reason=WORKER_LOST, permanent=True)
                if lost > max_lost
                else fail(run, rule, now=now, error=error, reason="abandoned")
            )
            await _save(transaction, failed, fact)
            return Executed(
                "abandoned",
                failed,
                f"attempt {run.attempts} of run {run_id} was abandoned by its executor: "
                f"recorded as failed, the run is {failed.status}",
                await _next_runs(transaction, rule, failed, now),
            )
        if run.status not in WAITING:
            return Executed("not_due", run, f"run {run_id} is {run.status}")
        if run.next_attempt_at > now:
            return Executed(
                "not_due", run, f"run {run_id} is due at {run.next_attempt_at.isoformat()}"
            )
        # For an unordered rule, runnable() keeps every waiting, due run: what was just checked.
        # Reading the scope then would decode every unfinished run of the rule per claim, which
        # grows with a burst's backlog (docs/performance.md, "What bounds it", 2).
        if rule.ordering == "scope":
            scope_runs = await transaction.scope_runs(run.rule, run.scope_key)
            if run.id not in {r.id for r in runnable(scope_runs, rule, now=now)}:
                return Executed("not_due", run, f"run {run_id} waits: it is not first in its scope")
        started, begun = start(run, now=now)
        await _save(transaction, started, begun)
        events: list[Envelope] = []
        for seq in started.matched:
            events.extend(await transaction.read(after_seq=seq - 1, limit=1))
    metrics.record_dispatch_lag((now - run.next_attempt_at).total_seconds())
    return started, rule, tuple(events)


async def _run_action(
    runtime: Runtime,
    ref: WorkspaceRef,
    run: Run,
    rule: Rule,
    events: tuple[Envelope, ...],
    ttl: timedelta,
) -> _Ended:
    """Run the rule's action as the run's agent, keeping the lease, and say how it ended."""
    rules = runtime.application.rules
    try:
        action, params = _resolve(runtime.application.actions, rule)
    except RunFailure as failure:
        return _Ended.failed(failure)
    try:
        workspace = await rules.open(
            ref.tenant_id,
            ref.workspace_id,
            actor=RuleAgentActor(rule=rule.name, run_id=run.id, name=rule.then.action),
        )
    except Forbidden as refused:  # the rule may not act in its workspace: so would a retry
        return _Ended("failed", error=refused.message, reason="forbidden", permanent=True)
    except Exception as error:  # the application's on_open failed: the attempt's, to retry
        return _Ended("failed", error=f"{type(error).__name__}: {error}")
    reaction = Reaction(
        workspace=workspace.caused_by(run.causation, correlation_id=run.correlation_id),
        run=run,
        rule=rule,
        events=events,
        deps=runtime.bridge,
        params=params,
    )
    return await _supervise(runtime, ref, run, _call(action, reaction), ttl)


def _resolve(actions: Mapping[str, Action[Any]], rule: Rule) -> tuple[Action[Any], Any]:
    """Return the rule's action and its params, validated as the action's params model.

    Raises:
        RunFailure: Permanently, ``unknown_action`` if no action has the name (a deploy removed
            it), or ``invalid_params`` if the params do not validate: a retry would fail again.
    """
    action = actions.get(rule.then.action)
    if action is None:
        raise RunFailure(
            f"rule {rule.name} runs {rule.then.action!r}, which is not among the actions",
            reason="unknown_action",
            permanent=True,
        )
    model = getattr(action, "params", None)
    declared = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    try:
        return action, load_params(rule, declared)
    except InvalidRule as invalid:
        message = f"rule {rule.name}: " + "; ".join(invalid.problems)
        raise RunFailure(message, reason="invalid_params", permanent=True) from None


async def _supervise(
    runtime: Runtime,
    ref: WorkspaceRef,
    run: Run,
    attempt: Coroutine[Any, Any, _Ended],
    ttl: timedelta,
) -> _Ended:
    """Run an attempt while renewing its lease; cancel it if the attempt stops being current."""
    task = asyncio.create_task(attempt)
    keeper = asyncio.create_task(_keep(runtime, ref, run, task, ttl))
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # the caller cancels us (a time limit, a shutdown): the lease is released
        return _Ended("interrupted")
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)


async def _call(action: Action[Any], reaction: Reaction[Any]) -> _Ended:
    """Call the action under the rule's timeout and turn what it did into an outcome."""
    limit = reaction.rule.timeout
    try:
        async with asyncio.timeout(limit.total_seconds() if limit else None):
            output = await action(reaction)
    except TimeoutError:
        return _Ended("failed", error=f"the action timed out after {limit}", reason="timeout")
    except RunFailure as failure:
        return _Ended.failed(failure)
    except Forbidden as refused:  # authorize refused the rule what it did: so would a retry
        return _Ended("failed", error=refused.message, reason="forbidden", permanent=True)
    except Exception as error:  # an action's failure is the run's, to retry
        return _Ended("failed", error=f"{type(error).__name__}: {error}")
    try:
        value = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
        return _Ended("succeeded", output=_JSON.validate_python(value))
    except ValidationError:
        return _Ended("failed", error="the action returned a value that is not JSON")


async def _keep(
    runtime: Runtime, ref: WorkspaceRef, run: Run, task: "asyncio.Task[_Ended]", ttl: timedelta
) -> None:
    """Renew the run's lease while its action runs; stop the action if the attempt is lost.

    A storage error ends the renewals (logged), so the lease lapses and the run is taken over.
    """
    storage = runtime.application.rules.storage
    try:
        while True:
            await asyncio.sleep(ttl.total_seconds() / 3)
            kept = await storage.acquire_lease(ref, run_lease(run.id), runtime.holder, ttl)
            current = await storage.run(ref, run.id)
            if not kept or current is None or not current.is_running(run.epoch):
                task.cancel()
                return
    except Exception:
        logger.exception("renewing a run's lease failed; it will lapse", run_id=run.id)


async def _complete(
    rules: Workspaces, ref: WorkspaceRef, run: Run, rule: Rule, ended: _Ended
) -> Executed:
    """Record the attempt's outcome, unless the attempt is no longer the run's current one."""
    async with rules.storage.transaction(ref) as transaction:
        current = await transaction.run(run.id)
        now = rules.clock()
        if current is None or not current.is_running(run.epoch):
            status = "gone" if current is None else current.status
            return Executed(
                "dropped",
                current,
                f"attempt {run.attempts} of run {run.id} is no longer current (the run is "
                f"{status}): its {ended.kind} outcome was not recorded",
                await _next_runs(transaction, rule, current, now),
            )
        fact: _Fact
        if ended.kind == "succeeded":
            done, fact = succeed(current, now=now, output=ended.output)
        else:
            done, fact = fail(
                current,
                rule,
                now=now,
                error=ended.error,
                reason=ended.reason,
                permanent=ended.permanent,
            )
        await _save(transaction, done, fact)
        outcome: Outcome = "succeeded" if done.status == "succeeded" else _failed(done)
        detail = f"attempt {done.attempts} of run {done.id} {done.status}"
        if ended.kind == "failed":
            detail += f": {ended.error}" + (f" ({ended.reason})" if ended.reason else "")
        return Executed(outcome, done, detail, await _next_runs(transaction, rule, done, now))


def _failed(run: Run) -> Outcome:
    return "dead" if run.status == "dead" else "retrying"


async def _next_runs(
    transaction: Transaction, rule: Rule, run: Run | None, now: datetime
) -> tuple[str, ...]:
    """The run of an ordered rule's scope that can start now, other than ``run`` while it runs.

    Read in the transaction that changed ``run``, so it sees the scope as the change left it.
    Unordered rules have none: all their due runs were due already, and the dispatcher has them.
    """
    if run is None or rule.ordering != "scope":
        return ()
    scope_runs = await transaction.scope_runs(rule.name, run.scope_key)
    return tuple(r.id for r in runnable(scope_runs, rule, now=now))


async def _cancel_orphan(transaction: Transaction, run: Run, now: datetime) -> Executed:
    """Cancel a run whose rule the workspace no longer has, so it stops being due."""
    if run.status in FINISHED:
        return Executed("not_due", run, f"run {run.id} is {run.status}")
    cancelled, fact = cancel(run, now=now, reason=RULE_GONE)
    await _save(transaction, cancelled, fact)
    return Executed(
        "cancelled", cancelled, f"run {run.id} was cancelled: its rule {run.rule} is gone"
    )


async def _run_and_rule(
    rules: Workspaces, transaction: Transaction, ref: WorkspaceRef, run_id: str, now: datetime
) -> tuple[Run, Rule] | Executed:
    """The run and its rule as the transaction reads them.

    A run whose rule the workspace no longer has is cancelled instead, so it stops being due;
    a missing run rolls the transaction back (:class:`_Missing`).
    """
    run = await transaction.run(run_id)
    if run is None:
        raise _Missing(_missing(ref, run_id))
    found = (await rules.rules_in(transaction)).get(run.rule)
    if found is None:
        return await _cancel_orphan(transaction, run, now)
    return run, found.rule


class _Missing(Exception):
    """Raised inside a transaction that found no run, so it rolls back: reflexr's storage
    records a workspace when a transaction on it commits, and a task naming a workspace that
    does not exist must leave nothing behind."""

    def __init__(self, executed: Executed) -> None:
        super().__init__(executed.detail)
        self.executed = executed


async def _unless_missing[T](step: Callable[[], Awaitable[T]]) -> T | Executed:
    try:
        return await step()
    except _Missing as missing:
        return missing.executed


def _missing(ref: WorkspaceRef, run_id: str) -> Executed:
    return Executed(
        "missing", None, f"run {run_id} does not exist in {ref.tenant_id}/{ref.workspace_id}"
    )


async def _save(transaction: Transaction, run: Run, fact: _Fact) -> None:
    """Save the run's new state and append its ``reflexr:*`` fact, in the same transaction."""
    await transaction.save_runs([run])
    await transaction.append(
        [
            Entry(
                id=new_event_id(),
                actor=REACTOR,
                event=fact,
                causation=run.causation,
                correlation_id=run.correlation_id,
            )
        ]
    )


def _contended(log: Any, detail: str) -> Executed:
    executed = Executed("contended", None, detail)
    metrics.record_run(None, executed.outcome)
    log.info("run not executed", outcome=executed.outcome, detail=detail)
    return executed


def _log_declined(log: Any, executed: Executed) -> None:
    method = log.warning if executed.outcome in ("abandoned", "cancelled") else log.info
    method("run not executed", outcome=executed.outcome, detail=executed.detail)
