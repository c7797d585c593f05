"""What the console's buttons do: the command line's own operations on runs, nothing else.

Each action is the call ``relayr runs`` makes (:mod:`relayr.ops.runs`) with the same enqueue, so
a retry from the browser is ``relayr runs retry`` (ADR-0034). Retrying a filter's dead runs is a
preview (``--dead --dry-run``) then a confirmation that retries only the runs the preview named
and still dead.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import RunRow, list_runs
from relayr.ops.runs import EnqueueRun, OperatorResult, cancel, find_runs, retry, skip
from relayr.runtime.process import Runtime

from .queries import RunQuery

BULK_RETRY_MAX: Final = 500
"""The most runs one confirmation retries: the preview lists them all in one page, and the
confirmation's form carries each id. More wait for the next preview."""

DEFAULT_CANCEL_REASON: Final = "cancelled by ops"
"""The reason a cancel records when none is given: the command line's default."""


@dataclass(frozen=True)
class RunRef:
    """A run named by its workspace and id, as the confirmation form carries it."""

    workspace: WorkspaceKey
    run_id: str

    def __str__(self) -> str:
        return f"{self.workspace}/{self.run_id}"


@dataclass(frozen=True)
class Preview:
    """What retrying the dead runs of a filter would do (``runs retry --dead --dry-run``)."""

    query: RunQuery
    results: list[OperatorResult]
    more: int
    """Dead runs of the filter past :data:`BULK_RETRY_MAX`, left for the next preview."""

    @property
    def retried(self) -> list[OperatorResult]:
        """The runs a confirmation would retry."""
        return [result for result in self.results if result.ok]


async def retry_one(
    runtime: Runtime, enqueue: EnqueueRun, run_id: str, workspace: WorkspaceKey | None
) -> list[OperatorResult]:
    """``relayr runs retry RUN``: reflexr's operator retry, then an enqueue."""
    rules = runtime.application.rules
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [*missing, *await retry(rules, found, enqueue)]


async def cancel_one(
    runtime: Runtime, run_id: str, workspace: WorkspaceKey | None, *, reason: str
) -> list[OperatorResult]:
    """``relayr runs cancel RUN --reason R``."""
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [*missing, *await cancel(runtime.application.rules, found, reason=reason)]


async def skip_one(
    runtime: Runtime, run_id: str, workspace: WorkspaceKey | None, *, reason: str
) -> list[OperatorResult]:
    """``relayr runs skip RUN --reason R``."""
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [*missing, *await skip(runtime.application.rules, found, reason=reason)]


async def preview_retry(runtime: Runtime, enqueue: EnqueueRun, query: RunQuery) -> Preview:
    """``relayr runs retry --dead [--rule] [--workspace] [--since] --dry-run``: nothing changes."""
    rules = runtime.application.rules
    dead = await list_runs(rules, query.run_filter(rules.clock(), limit=None))
    taken = dead[:BULK_RETRY_MAX]
    results = await retry(rules, taken, enqueue, dry_run=True)
    return Preview(query=query, results=results, more=len(dead) - len(taken))


async def confirm_retry(
    runtime: Runtime, enqueue: EnqueueRun, refs: Sequence[RunRef]
) -> list[OperatorResult]:
    """Retry the runs a preview listed that are still dead, as ``relayr runs retry RUN...``."""
    found, missing = await _find(runtime, [(ref.workspace, ref.run_id) for ref in refs])
    dead = [row for row in found if row.status == "dead"]
    moved = [
        OperatorResult(
            row.id, str(row.workspace), False, f"no longer dead ({row.status}): not retried"
        )
        for row in found
        if row.status != "dead"
    ]
    return [*missing, *moved, *await retry(runtime.application.rules, dead, enqueue)]


async def _find(
    runtime: Runtime, named: Sequence[tuple[WorkspaceKey | None, str]]
) -> tuple[list[RunRow], list[OperatorResult]]:
    """The runs named, and a refusal for each that does not exist
    (:func:`relayr.ops.runs.find_runs`).

    A page shows each refusal next to the other runs' results; the command line refuses them
    all before acting instead, since it was typed (a typo), where a page's form names what a
    page showed (a run that may have gone since)."""
    return await find_runs(runtime.application.rules, named)
