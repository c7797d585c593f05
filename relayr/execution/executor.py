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

from collections.abc import Sequence

import structlog
from reflexr.workspace import WorkspaceRef

from relayr.execution import attempts, outcomes
from relayr.execution.attempts import NoRunFound
from relayr.execution.hidden_commits import HiddenCommits
from relayr.execution.outcomes import Executed, RunOutcome
from relayr.execution.runs import Batch
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import RunEnded
from relayr.runtime.process import Runtime
from relayr.runtime.transient import is_transient, retried

__all__ = [
    "Executed",
    "RunOutcome",
    "execute_run",
    "execute_runs",
    "fail_run",
    "is_transient",
]

logger = structlog.get_logger("relayr.executor")


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
        executed = outcomes.missing(ref, run_id)
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
