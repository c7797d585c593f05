"""The runs ops read: listed across every workspace, or found by id.

Runs are read through reflexr's own storage (ADR-0001), across every workspace unless one is
named, newest created first (:func:`list_runs`). A run named without its workspace is found only
when one workspace holds it (:class:`AmbiguousRun`). The command line and the console both read
runs here, so they read alike.
"""

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from reflexr.core import Run
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.ledger.port import WorkspaceKey


@dataclass(frozen=True)
class RunRow:
    """One run as ``runs list`` shows it."""

    tenant_id: str
    workspace_id: str
    id: str
    rule: str
    status: str
    attempts: int
    reason: str | None
    error: str | None
    next_attempt_at: datetime
    created_at: datetime
    updated_at: datetime
    fired_seq: int
    """The seq of the event that made the run's rule fire: its facts come after it."""

    @classmethod
    def of(cls, ref: WorkspaceRef, run: Run) -> "RunRow":
        return cls(
            tenant_id=ref.tenant_id,
            workspace_id=ref.workspace_id,
            id=run.id,
            rule=run.rule,
            status=run.status,
            attempts=run.attempts,
            reason=run.reason,
            error=run.error,
            next_attempt_at=run.next_attempt_at,
            created_at=run.created_at,
            updated_at=run.updated_at,
            fired_seq=run.fired_seq,
        )

    @property
    def workspace(self) -> WorkspaceKey:
        return WorkspaceKey(self.tenant_id, self.workspace_id)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for moment in ("next_attempt_at", "created_at", "updated_at"):
            data[moment] = getattr(self, moment).isoformat()
        return data


@dataclass
class RunFilter:
    """Which runs ``runs list`` and ``runs retry --dead`` take."""

    status: str | None = None
    rule: str | None = None
    workspace: WorkspaceKey | None = None
    since: datetime | None = None
    limit: int | None = 100


async def list_runs(rules: Workspaces, query: RunFilter) -> list[RunRow]:
    """Runs across every workspace (or the one named), newest created first, filtered.

    reflexr's storage returns a workspace's runs newest created first and cuts them there
    (``runs(limit=N)`` keeps the N created last), so the workspaces' lists are merged in that
    order: the first N of the merge are the runs created last across every workspace, whatever
    limit another read used, and a page never skips a run another page would show. An order by
    last change would need every run of every workspace (one created long ago may have changed
    just now); ``since`` reads them all, and keeps those that changed within it.
    """
    lists: list[list[RunRow]] = []
    storage = rules.storage
    for ref in await _refs(rules, query.workspace):
        runs = await storage.runs(
            ref,
            rule=query.rule,
            status=query.status,  # type: ignore[arg-type]
            limit=None if query.since else query.limit,
        )
        lists.append(
            [
                RunRow.of(ref, run)
                for run in runs
                if query.since is None or run.updated_at >= query.since
            ]
        )
    merged = heapq.merge(*lists, key=lambda row: row.created_at, reverse=True)
    return list(itertools.islice(merged, query.limit))


class AmbiguousRun(ValueError):
    """A run id that several workspaces hold, named without its workspace.

    reflexr's run ids are unique within a workspace only (the same event id fired in two
    workspaces makes the same run id), so acting on "the first that has it" could change a
    run the operator did not mean.
    """

    def __init__(self, run_id: str, workspaces: Sequence[WorkspaceKey]) -> None:
        names = ", ".join(sorted(str(workspace) for workspace in workspaces))
        super().__init__(
            f"run {run_id} is in {len(workspaces)} workspaces ({names}): name one with --workspace"
        )


async def find_run(
    rules: Workspaces, run_id: str, workspace: WorkspaceKey | None = None
) -> RunRow | None:
    """The run with this id in the workspace named, or in the one workspace that has it.

    Raises:
        AmbiguousRun: No workspace named, and more than one has a run of this id.
    """
    rows = []
    for ref in await _refs(rules, workspace):
        run = await rules.storage.run(ref, run_id)
        if run is not None:
            rows.append(RunRow.of(ref, run))
    if len(rows) > 1:
        raise AmbiguousRun(run_id, [row.workspace for row in rows])
    return rows[0] if rows else None


async def _refs(rules: Workspaces, workspace: WorkspaceKey | None) -> list[WorkspaceRef]:
    if workspace is not None:
        return [WorkspaceRef(workspace.tenant_id, workspace.workspace_id)]
    return await rules.storage.workspaces()
