"""Executing reflexr runs by id: claim them, run their actions as their rules, record outcomes.

What reflexr's own executor does (at least once, under leases), with public names only, for the
runs one queue message names, all of one workspace. reflexr's store is the truth about a run;
the message is only a hint that its runs may be due, so:

- each run's lease is taken first: a run another executor holds is left alone (``contended``);
- one transaction claims every leased run (:func:`relayr.execution.attempts.claim`): it re-reads
each run
  and its rule and starts an attempt only if the run is due and first in its scope; anything
  else does nothing (``not_due``, ``missing``), and a ``running`` run whose lease lapsed is
  recorded ``abandoned``; the leases of the runs that did not start are released at once, so
  another delivery, or this message going on with a scope, can take them;
- the actions run concurrently on this process's loop, each with a ``Reaction`` whose ``deps``
  is the runtime's bridge, while its lease is renewed every third of its life; an attempt that
  stops being the run's current one (an operator cancelled or retried it, the lease was lost)
  has its action cancelled (``interrupted``);
- as actions end, their outcomes are recorded together, in one transaction per group
  (:func:`relayr.execution.attempts.complete`), each only if its attempt is still current
  (``dropped``
  otherwise), so a late executor never overwrites a cancel, a retry or a newer attempt. The
  ledger rows the actions left for later (emission records of sends, and of notices an earlier
  attempt posted) ride in that same transaction (:mod:`relayr.ledger.riding`), those of an
  ``interrupted`` attempt too: its writes committed in artifactr all the same;
- a run of a rule ordered by scope that ends lets the next run of its scope start in that same
  transaction, under a lease taken just before, so a scope goes on without a trip through the
  broker, within :data:`relayr.execution.runs.SCOPE_BUDGET_RUNS` runs and
  :data:`relayr.execution.runs.SCOPE_BUDGET_S` seconds per message (then the dispatcher hands the
  scope's next run to the queue, behind what waits there).

A duplicated, lost or redelivered message therefore repeats and loses nothing: a second
delivery finds the leases held or the runs finished. The writes a retried attempt repeats are
made once by their derived ids (:mod:`relayr.execution.actions`). The lease of a run that succeeded
is
left to lapse: it can never start again (ADR-0002). Transient storage faults are retried a few
times inside each step (:mod:`relayr.runtime.transient`); each step is safe to repeat, and a claim
or a
completion whose commit took effect behind a fault finds its own work on the next try
(:class:`relayr.execution.tries.Tries`).
"""

from collections.abc import Sequence

import structlog
from reflexr.workspace import WorkspaceRef

from relayr.execution import attempts, outcomes
from relayr.execution.attempts import NothingThere
from relayr.execution.outcomes import Executed, RunOutcome
from relayr.execution.runs import Batch
from relayr.execution.tries import Tries
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
    tries: Tries[Executed] = Tries()
    try:
        executed = await retried(
            lambda: attempts.fail_for_good(
                rules, ref, run_id, reason=reason, error=error, tries=tries
            )
        )
    except NothingThere:
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
