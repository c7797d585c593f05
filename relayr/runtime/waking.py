"""Waking runs an operator's limit held back: due now, by reflexr's own ``retry``.

A run a limit holds back waits in reflexr's store with a due time in the future
(:mod:`relayr.execution.limiting`); when what it waits for is freed (a slot given back by a run
or by a turn's end, a raised limit), whoever freed it makes it due now with ``retry``, an
operator's operation that keeps its attempts and records ``reflexr:run_requeued``. Whoever
hands runs out then finds it due, as any other.
"""

from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import structlog
from reflexr.core import WAITING, new_event_id, retry
from reflexr.workspace import REACTOR, Entry, WorkspaceRef, Workspaces

from relayr.core.run_messages import MAX_BATCH_RUNS, RunMessage
from relayr.ledger.limits import LimitStore, RunKey
from relayr.runtime.transient import retried

logger = structlog.get_logger("relayr.limits")


async def make_due(rules: Workspaces, store: LimitStore, runs: Sequence[RunKey]) -> list[RunKey]:
    """Make each waiting run of ``runs`` due now; return those that wait (the others finished
    meanwhile, an operator cancelled one, say: they are no longer recorded as waiting)."""
    due: list[RunKey] = []
    gone: list[RunKey] = []
    for key in runs:
        (due if await retried(partial(_due_now, rules, key)) else gone).append(key)
    if gone:
        await retried(lambda: store.forget_waiting(gone))
    return due


async def _due_now(rules: Workspaces, key: RunKey) -> bool:
    async with rules.storage.transaction(WorkspaceRef(key.tenant_id, key.workspace_id)) as tx:
        run = await tx.run(key.run_id)
        now = rules.clock()
        if run is None or run.status not in WAITING:
            return False
        if run.next_attempt_at <= now:
            return True
        requeued, fact = retry(run, now=now)
        await tx.save_runs([requeued])
        entry = Entry(
            id=new_event_id(),
            actor=REACTOR,
            event=fact,
            causation=run.causation,
            correlation_id=run.correlation_id,
        )
        await tx.append([entry])
        return True


type Requeue = Callable[[RunMessage], Awaitable[None]]
"""Hands runs to the queue at once, as the dispatcher does."""


async def queue_woken(requeue: Requeue | None, runs: Sequence[RunKey]) -> None:
    """Queue runs made due, a message per workspace of at most ``MAX_BATCH_RUNS``; a failure
    is logged (they are due in the store: whoever hands runs out finds them)."""
    if requeue is None:
        return
    by_workspace: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        by_workspace.setdefault((run.tenant_id, run.workspace_id), []).append(run.run_id)
    for (tenant_id, workspace_id), run_ids in by_workspace.items():
        for start in range(0, len(run_ids), MAX_BATCH_RUNS):
            chunk = tuple(run_ids[start : start + MAX_BATCH_RUNS])
            try:
                await requeue(
                    RunMessage(tenant_id=tenant_id, workspace_id=workspace_id, run_ids=chunk)
                )
            except Exception:
                logger.warning("queueing woken runs failed", run_ids=list(chunk), exc_info=True)
