"""Executing reflexr runs by id: claim them, run their actions as their rules, record outcomes.

At least once, under leases, for the runs one queue message names (one workspace). The message
is only a hint; reflexr's store is the truth: a run another executor holds is ``contended``, one
not due is ``not_due``, a lapsed ``running`` one is ``abandoned``. Claims and completions are one
transaction each for all the runs (:mod:`relayr.execution.attempts`), and a completion counts
only if its attempt is still current (``dropped`` otherwise), so a late executor never overwrites
a cancel or a retry. An attempt that stops being current has its action cancelled
(``interrupted``). So a duplicated, lost or redelivered message repeats and loses nothing
(ADR-0001, ADR-0002, ADR-0024).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

import structlog
from pydantic import BaseModel, JsonValue, TypeAdapter, ValidationError
from reflexr import AgentActor as RuleAgentActor
from reflexr.core import Forbidden, InvalidRule, Rule, Run, load_params
from reflexr.workspace import Action, Reaction, RunFailure, WorkspaceRef, run_lease

from relayr.core import reasons
from relayr.execution import attempts
from relayr.execution.actions import pending_writes, started_turns
from relayr.execution.attempts import (
    Claimed,
    Completion,
    Ended,
    Executed,
    Finished,
    HiddenCommits,
    NoRunFound,
)
from relayr.execution.limiting import Limiter
from relayr.ledger.port import LedgerWrites
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import RunEnded
from relayr.runtime.process import Runtime
from relayr.runtime.transient import retried

if TYPE_CHECKING:
    from opentelemetry.trace import Span
from collections.abc import Sequence

from relayr.execution.attempts import RunOutcome
from relayr.runtime.transient import is_transient

_JSON: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)


def resolve(actions: Mapping[str, Action[Any]], rule: Rule) -> tuple[Action[Any], Any]:
    """Return the rule's action and its params, validated as the action's params model.

    Raises:
        RunFailure: Permanently, ``unknown_action`` if no action has the name (a deploy removed
            it), or ``invalid_params`` if the params do not validate: a retry would fail again.
    """
    action = actions.get(rule.then.action)
    if action is None:
        raise RunFailure(
            f"rule {rule.name} runs {rule.then.action!r}, which is not among the actions",
            reason=reasons.UNKNOWN_ACTION,
            permanent=True,
        )
    model = getattr(action, "params", None)
    declared = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    try:
        return action, load_params(rule, declared)
    except InvalidRule as invalid:
        message = f"rule {rule.name}: " + "; ".join(invalid.problems)
        raise RunFailure(message, reason=reasons.INVALID_PARAMS, permanent=True) from None


async def call(action: Action[Any], reaction: Reaction[Any]) -> Ended:
    """Call the action under the rule's timeout and turn what it did into an outcome."""
    limit = reaction.rule.timeout
    deadline = asyncio.timeout(limit.total_seconds() if limit else None)
    try:
        async with deadline:
            output = await action(reaction)
    except TimeoutError as error:
        if not deadline.expired():  # the action's own, as from a client it called: its failure
            return Ended("failed", error=f"{type(error).__name__}: {error}")
        return Ended("failed", error=f"the action timed out after {limit}", reason=reasons.TIMEOUT)
    except RunFailure as failure:
        return Ended.failed(failure)
    except Forbidden as refused:  # authorize refused the rule what it did: so would a retry
        return Ended("failed", error=refused.message, reason=reasons.FORBIDDEN, permanent=True)
    except Exception as error:  # an action's failure is the run's, to retry
        return Ended("failed", error=f"{type(error).__name__}: {error}")
    try:
        value = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
        return Ended("succeeded", output=_JSON.validate_python(value))
    except ValidationError:
        return Ended("failed", error="the action returned a value that is not JSON")


SCOPE_BUDGET_RUNS: Final = 500
"""How many runs of one scope a message may go on with after the run it names. Bounded so one
busy scope cannot hold a pool process for good while other workspaces' messages wait."""

SCOPE_BUDGET_S: Final = 10.0
"""How long a message may go on with one scope's runs, for the same reason; the dispatcher's
next pass hands the scope's next run to the queue when the budget ends."""

GROUP_LINGER_S: Final = 0.1
"""How long the outcome of an action that ended waits for the others of its message to end
too, so they are recorded in one transaction: a message's notices end within tens of
milliseconds of each other; an action that takes longer is recorded in a later group."""

logger = structlog.get_logger("relayr.executor")  # one logger for the whole executor


@dataclass
class _Budget:
    """What a message may still spend going on with one scope."""

    runs: int = SCOPE_BUDGET_RUNS
    until: float = field(default_factory=lambda: time.monotonic() + SCOPE_BUDGET_S)

    def take(self) -> bool:
        if self.runs <= 0 or time.monotonic() >= self.until:
            return False
        self.runs -= 1
        return True


@dataclass
class _Running:
    """An attempt whose action runs: when it began, and its reaction (for its ledger rows)."""

    claimed: Claimed
    reaction: Reaction[Any] | None
    began: float


class Batch:
    """The runs of one message, in one workspace, and the leases this executor holds on them."""

    def __init__(self, runtime: Runtime, ref: WorkspaceRef) -> None:
        self.runtime = runtime
        self.ref = ref
        self.rules = runtime.application.rules
        self.storage = self.rules.storage
        self.ttl = timedelta(seconds=runtime.settings.lease_ttl_s)
        self.max_lost = runtime.settings.max_redeliveries
        self.results: dict[str, Executed] = {}
        self.held: set[str] = set()
        self.succeeded: set[str] = set()
        self.here: set[tuple[str, str, str]] = set()
        self.budgets: dict[tuple[str, str], _Budget] = {}
        self.spans: dict[str, Span] = {}
        self.limiter = Limiter(
            self.rules,
            runtime.bridge.limits,
            runtime.bridge.allowlists,
            self.ttl,
            runtime.requeue,
            runtime.bridge,
        )
        self.bound: set[str] = set()
        """Runs admitted under a limit: they hold its slots until their attempt is done."""

    async def execute(self, run_ids: list[str]) -> list[Executed]:
        running: dict[asyncio.Task[Ended], _Running] = {}
        try:
            leased = [run_id for run_id in run_ids if await self._lease(run_id)]
            if leased and self.limiter.active():
                leased = await self._admit(leased)
            if leased:
                for claimed in await self._claim(leased):
                    self._start(claimed, running)
            await self._finish(running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await self._release(self.held - self.succeeded)
            await self._unbind(dict.fromkeys(self.bound))  # attempts cut short: slots go back
            self.runtime.executing.difference_update(self.here)
            for span in self.spans.values():  # cancelled with their message: nothing recorded
                telemetry.end(span, {telemetry.OUTCOME: "interrupted"})
        return [self.results[run_id] for run_id in run_ids] + [
            executed for run_id, executed in self.results.items() if run_id not in run_ids
        ]

    async def _lease(self, run_id: str) -> bool:
        """Take a named run's lease; record it ``contended`` if another executor has it."""
        refused = await self._take(run_id)
        if refused is not None:
            self._ended(run_id, Executed("contended", None, f"{refused}: left alone"))
        return refused is None

    async def _take(self, run_id: str) -> str | None:
        """Take the run's lease; say why not if this process or another executor has it."""
        here = (self.ref.tenant_id, self.ref.workspace_id, run_id)
        if here in self.runtime.executing:
            # Our own lease would be renewed, not refused: tell this process's executors apart.
            return f"run {run_id} is being executed in this process"
        self.runtime.executing.add(here)
        self.here.add(here)
        key, holder = run_lease(run_id), self.runtime.holder
        if not await retried(lambda: self.storage.acquire_lease(self.ref, key, holder, self.ttl)):
            self.here.discard(here)
            self.runtime.executing.discard(here)
            return f"run {run_id} is held by another executor"
        self.held.add(run_id)
        return None

    async def _admit(self, run_ids: list[str]) -> list[str]:
        """Check the leased runs against the limits; those over one wait, not attempted
        (:mod:`relayr.execution.limiting`), and their leases are released at once."""
        admitted = await self.limiter.admit(self.ref, run_ids)
        self.bound |= admitted.bound
        for run_id, why in admitted.refused.items():
            self._ended(run_id, Executed("limited", None, f"run {run_id} {why}"))
        for run_id, why in admitted.not_due.items():
            self._ended(run_id, Executed("not_due", None, f"run {run_id} {why}"))
        left = {*admitted.refused, *admitted.not_due}
        await self._release(left)
        return [run_id for run_id in run_ids if run_id not in left]

    async def _claim(self, run_ids: list[str]) -> list[Claimed]:
        """Claim the leased runs; release at once the leases of those that did not start."""
        tries: HiddenCommits[dict[str, Claimed | Executed]] = HiddenCommits()
        try:
            with telemetry.span("relayr.claim", {telemetry.RUNS: len(run_ids)}):
                claims = await retried(
                    lambda: attempts.claim(
                        self.rules, self.ref, run_ids, max_lost=self.max_lost, tries=tries
                    )
                )
        except NoRunFound:
            claims = {run_id: attempts.missing(self.ref, run_id) for run_id in run_ids}
        started: list[Claimed] = []
        for run_id, claim in claims.items():
            if isinstance(claim, Claimed):
                started.append(claim)
            else:
                self._ended(run_id, claim)
        await self._release(
            run_id for run_id, claim in claims.items() if isinstance(claim, Executed)
        )
        await self._unbind(
            {run_id: None for run_id, claim in claims.items() if isinstance(claim, Executed)}
        )
        return started

    def _start(self, claimed: Claimed, running: dict[asyncio.Task[Ended], _Running]) -> None:
        run, rule = claimed.run, claimed.rule
        span = telemetry.run_span(
            self.ref.tenant_id, self.ref.workspace_id, run, rule.name, claimed.events
        )
        if span is not None:
            self.spans[run.id] = span
        with telemetry.using(span):
            logger.info(
                "attempt started",
                run_id=run.id,
                rule=rule.name,
                attempt=run.attempts,
                epoch=run.epoch,
                action=rule.then.action,
            )
        entry = _Running(claimed, None, perf_counter())
        task = asyncio.create_task(telemetry.traced(span, self._attempt(entry)))
        running[task] = entry

    async def _attempt(self, entry: _Running) -> Ended:
        """Run the rule's action as the run's agent, keeping the lease; say how it ended."""
        run, rule = entry.claimed.run, entry.claimed.rule
        try:
            action, params = resolve(self.runtime.application.actions, rule)
        except RunFailure as failure:
            return Ended.failed(failure)
        try:
            workspace = await self.rules.open(
                self.ref.tenant_id,
                self.ref.workspace_id,
                actor=RuleAgentActor(rule=rule.name, run_id=run.id, name=rule.then.action),
            )
        except Forbidden as refused:  # the rule may not act in its workspace: so would a retry
            return Ended("failed", error=refused.message, reason=reasons.FORBIDDEN, permanent=True)
        except Exception as error:  # the application's on_open failed: the attempt's, to retry
            return Ended("failed", error=f"{type(error).__name__}: {error}")
        entry.reaction = Reaction(
            workspace=workspace.caused_by(run.causation, correlation_id=run.correlation_id),
            run=run,
            rule=rule,
            events=entry.claimed.events,
            deps=self.runtime.bridge,
            params=params,
        )
        return await self._supervise(run, call(action, entry.reaction))

    async def _supervise(self, run: Run, attempt: Coroutine[Any, Any, Ended]) -> Ended:
        """Run an attempt while renewing its lease; cancel it if the attempt stops being current."""
        task = asyncio.create_task(attempt)
        keeper = asyncio.create_task(self._keep(run, task))
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the caller cancels us (a time limit, a shutdown): the lease is released
            return Ended("interrupted")
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    async def _keep(self, run: Run, task: "asyncio.Task[Ended]") -> None:
        """Renew the run's lease while its action runs; stop the action if the attempt is lost.

        A storage error that outlasts its retries ends the renewals (logged), so the lease
        lapses and the run is taken over.
        """
        key, holder = run_lease(run.id), self.runtime.holder
        try:
            while True:
                await asyncio.sleep(self.ttl.total_seconds() / 3)
                kept = await retried(
                    lambda: self.storage.acquire_lease(self.ref, key, holder, self.ttl)
                )
                if run.id in self.bound:
                    await self.limiter.renew(self.ref, run.id)
                current = await retried(lambda: self.storage.run(self.ref, run.id))
                if not kept or current is None or not current.is_running(run.epoch):
                    task.cancel()
                    return
        except Exception:
            logger.exception("renewing a run's lease failed; it will lapse", run_id=run.id)

    async def _finish(self, running: dict[asyncio.Task[Ended], _Running]) -> None:
        """Record outcomes as actions end, a group per transaction, and start the runs that
        their scopes go on with."""
        while running:
            done, pending = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if pending:  # what ends meanwhile joins this group's transaction
                await asyncio.wait(pending, timeout=GROUP_LINGER_S)
                done = {task for task in running if task.done()}
            finished: list[Finished] = []
            writes: list[LedgerWrites] = []
            began: dict[str, float] = {}
            reactions: dict[str, Reaction[Any] | None] = {}
            interrupted: dict[str, Reaction[Any] | None] = {}
            for task in done:
                entry = running.pop(task)
                reactions[entry.claimed.run.id] = entry.reaction
                run = entry.claimed.run
                ended = task.result()
                if entry.reaction is not None and (left := pending_writes(entry.reaction)):
                    writes.append(left)  # written in artifactr, whatever became of the attempt
                if ended.kind == "interrupted":
                    self._ended(
                        run.id,
                        Executed(
                            "interrupted",
                            run,
                            f"attempt {run.attempts} of run {run.id} stopped being current "
                            "while its action ran: the action was cancelled and nothing was "
                            "recorded",
                        ),
                        seconds=perf_counter() - entry.began,
                    )
                    interrupted[run.id] = entry.reaction
                    continue
                successor = await self._successor(entry.claimed)
                finished.append(Finished(entry.claimed, ended, successor))
                began[run.id] = entry.began
            merged = LedgerWrites.merged(writes)
            if not finished:
                if merged:
                    await self._write_left(merged)
                await self._unbind(interrupted)
                continue
            completion = await self._complete(finished, merged, reactions)
            for run_id, outcome in completion.executed.items():
                self._ended(run_id, outcome, seconds=perf_counter() - began[run_id])
            await self._unbind(interrupted)
            for run_id, outcome in completion.abandoned.items():
                self._ended(run_id, outcome)
            claimed_next = {claimed.run.id for claimed in completion.started}
            unclaimed = {d.successor for d in finished if d.successor not in (None, *claimed_next)}
            await self._release({run_id for run_id in unclaimed if run_id is not None})
            for claimed in completion.started:
                self._start(claimed, running)

    async def _complete(
        self,
        finished: list[Finished],
        writes: LedgerWrites,
        reactions: Mapping[str, Reaction[Any] | None],
    ) -> Completion:
        """Record the group's outcomes with the ledger rows its actions left, and give back
        what their attempts held under limits, in the same transaction.

        If that fails for good, the rows are written once more on their own: the writes they
        describe are in artifactr whatever becomes of the completion.
        """
        held = {
            run_id: started_turns(reactions.get(run_id))
            for run_id in (done.claimed.run.id for done in finished)
            if run_id in self.bound
        }
        ledger = self.runtime.bridge.ledger
        tries: HiddenCommits[Completion] = HiddenCommits()

        async def step() -> Completion:
            async with ledger.alongside(writes):
                return await attempts.complete(
                    self.rules, self.ref, finished, max_lost=self.max_lost, tries=tries
                )

        try:
            with telemetry.span("relayr.complete", {telemetry.RUNS: len(finished)}):
                async with self.limiter.releasing(self.ref, held):
                    completion = await retried(step)
            self.bound.difference_update(held)
            return completion
        finally:
            if writes and not writes.committed:
                await self._write_left(writes, once=True)

    async def _write_left(self, writes: LedgerWrites, *, once: bool = False) -> None:
        """Write ledger rows that no completion carries, in a transaction of their own (tried
        ``once`` after a completion that failed for good); a failure is logged, as the rows
        cannot be written anywhere else."""
        ledger = self.runtime.bridge.ledger
        try:
            await (ledger.write(writes) if once else retried(lambda: ledger.write(writes)))
        except Exception:
            logger.exception(
                "ledger rows of writes made in artifactr could not be written",
                workspace=f"{self.ref.tenant_id}/{self.ref.workspace_id}",
                causes=[c.key for c in writes.causes],
                emissions=[e.message_id for e in writes.emissions],
            )

    async def _successor(self, claimed: Claimed) -> str | None:
        """The run its scope may go on with after ``claimed``, leased; None if there is none,
        the budget is spent, or another executor holds it."""
        order = claimed.order
        if order is None:
            return None
        run_id = order.after(claimed.run.id)
        if run_id is None:
            return None
        if self.limiter.active() and self.limiter.binds(self.ref, claimed.rule.name):
            return None  # its limits are checked before a claim: the queue brings it
        budget = self.budgets.setdefault((claimed.rule.name, claimed.run.scope_key), _Budget())
        if not budget.take() or await self._take(run_id) is not None:
            return None  # the dispatcher hands it to the queue
        return run_id

    async def _release(self, run_ids: Iterable[str]) -> None:
        """Release the leases this executor holds on ``run_ids``, and forget them here."""
        for run_id in sorted(run_ids):
            if run_id in self.held:
                self.held.discard(run_id)
                await retried(_releasing(self.storage, self.ref, run_id, self.runtime.holder))
            here = (self.ref.tenant_id, self.ref.workspace_id, run_id)
            self.here.discard(here)
            self.runtime.executing.discard(here)

    async def _unbind(self, runs: Mapping[str, Reaction[Any] | None]) -> None:
        """Give back, in one transaction, what the runs' attempts held under their limits (a
        turn a message started keeps its slot until it ends:
        :meth:`relayr.execution.limiting.Limiter.release`)."""
        bound = {
            run_id: started_turns(reaction)
            for run_id, reaction in runs.items()
            if run_id in self.bound
        }
        self.bound.difference_update(bound)
        await self.limiter.release(self.ref, bound)

    def _ended(self, run_id: str, executed: Executed, *, seconds: float | None = None) -> None:
        self.results[run_id] = replace(executed, run_id=run_id)
        if run_id in self.spans:
            telemetry.run_ended(self.spans.pop(run_id), executed.outcome, executed.run)
        if executed.outcome == "succeeded":
            self.succeeded.add(run_id)
        run = executed.run
        hooks.emit(RunEnded(None if run is None else run.rule, executed.outcome, seconds))


def _releasing(
    storage: Any, ref: WorkspaceRef, run_id: str, holder: str
) -> Callable[[], Awaitable[None]]:
    async def release() -> None:
        await storage.release_lease(ref, run_lease(run_id), holder)

    return release


__all__ = [
    "Executed",
    "RunOutcome",
    "execute_run",
    "execute_runs",
    "fail_run",
    "is_transient",
]


async def execute_run(runtime: Runtime, tenant_id: str, workspace_id: str, run_id: str) -> Executed:
    """Execute one attempt of a run, if it is due and no other executor holds it; return what
    happened to it (runs of its scope that went on after it are executed too, not returned)."""
    return (await execute_runs(runtime, tenant_id, workspace_id, [run_id]))[0]


async def execute_runs(
    runtime: Runtime, tenant_id: str, workspace_id: str, run_ids: Sequence[str]
) -> list[Executed]:
    """Execute one attempt of each of ``run_ids`` that is due and that no other executor holds.

    Returns what happened to each named run, in order, then to each run of a scope that went on
    after them. Never raises for a run's own failure: that is recorded on the run and returned
    as its outcome. It raises only if storage keeps failing, when nothing was recorded that a
    later delivery cannot finish, or if the caller cancels it; then the leases it holds are
    released, so the attempts are recorded ``abandoned`` by the next claim.
    """
    batch = Batch(runtime, WorkspaceRef(tenant_id, workspace_id))
    attributes = {telemetry.TENANT_ID: tenant_id, telemetry.WORKSPACE_ID: workspace_id}
    with telemetry.span("relayr.execute_runs", {**attributes, telemetry.RUNS: len(run_ids)}):
        return await batch.execute(list(dict.fromkeys(run_ids)))


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
    tries: HiddenCommits[Executed] = HiddenCommits()
    try:
        executed = await retried(
            lambda: attempts.fail_for_good(
                rules, ref, run_id, reason=reason, error=error, tries=tries
            )
        )
    except NoRunFound:
        executed = attempts.missing(ref, run_id)
    hooks.emit(RunEnded(None if executed.run is None else executed.run.rule, executed.outcome))
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
