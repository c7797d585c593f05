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
from operator import attrgetter
from typing import Any, Final, Literal

from reflexr.core import Run
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.ledger.port import WorkspaceKey


@dataclass(frozen=True, slots=True)
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
    waiting: str | None = None
    """Why an operator's limit holds the run back, and when it expects to go; None if none."""

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


type RunOrder = Literal["created", "changed"]
"""How runs are listed: newest created first (reflexr's own order), or last changed first."""

READ_FIRST: Final = 64
"""How many runs a listing first reads of each workspace; it reads twice as many each time a
workspace's runs past the cursor are not enough (:func:`list_runs`)."""


@dataclass(frozen=True)
class Cursor:
    """Where a listing goes on from (keyset paging): the last run a page showed, by the moment it
    is ordered by (created or changed), the seq of the event that fired it (runs one evaluation
    created share their moment), its workspace and its id. The next page holds the runs after it
    in the same order, however many came before it: any run is reachable."""

    moment: datetime
    fired_seq: int
    tenant_id: str
    workspace_id: str
    run_id: str

    def key(self) -> "OrderKey":
        return (self.moment, self.fired_seq, self.tenant_id, self.workspace_id, self.run_id)

    @classmethod
    def after(cls, row: "RunRow", order: RunOrder) -> "Cursor":
        moment = row.created_at if order == "created" else row.updated_at
        return cls(moment, row.fired_seq, row.tenant_id, row.workspace_id, row.id)


type OrderKey = tuple[datetime, int, str, str, str]
"""Where a run is in a listing's order, newest first: its moment, its firing's seq, its
workspace and its id."""


@dataclass
class RunFilter:
    """Which runs ``runs list``, ``runs retry --dead`` and the console take.

    ``rule`` is one rule's exact name; ``rules`` (when not None) any of these names, as the
    console resolves a part of a name to the rules that contain it. ``tenant`` keeps one
    tenant's workspaces; ``since`` and ``until`` the runs that changed within them; ``reason``
    the runs whose last reason is it. ``after`` is a page's cursor (:class:`Cursor`).
    """

    status: str | None = None
    rule: str | None = None
    workspace: WorkspaceKey | None = None
    since: datetime | None = None
    limit: int | None = 100
    rules: tuple[str, ...] | None = None
    tenant: str | None = None
    until: datetime | None = None
    reason: str | None = None
    order: RunOrder = "created"
    after: Cursor | None = None

    def keeps(self, row: "RunRow") -> bool:
        """Whether a run read from storage passes the filters storage does not apply."""
        if self.since is not None and row.updated_at < self.since:
            return False
        if self.until is not None and row.updated_at >= self.until:
            return False
        if self.reason is not None and row.reason != self.reason:
            return False
        return self.after is None or order_key(row, self.order) < self.after.key()

    @property
    def reads_all(self) -> bool:
        """Whether every run of a workspace must be read: ordered by change, or filtered by it
        (a run created long ago may have changed just now)."""
        return self.order == "changed" or self.since is not None or self.until is not None


async def list_runs(rules: Workspaces, query: RunFilter) -> list[RunRow]:
    """Runs across every workspace (or the one, or the tenant's, named), filtered, newest
    created first or last changed first, from a cursor on.

    reflexr's storage returns a workspace's runs newest created first and cuts them there
    (``runs(limit=N)`` keeps the N created last), so for the created order the workspaces'
    lists are merged in that order: the first N of the merge are the runs created last across
    every workspace, and a page never skips a run another page would show. A workspace is read
    :data:`READ_FIRST` runs first, then twice as many until enough runs pass the filters and
    the cursor, or the workspace has no more. An order by last change needs every run of every
    workspace (one created long ago may have changed just now), and so does ``since``.
    """
    lists: list[list[RunRow]] = []
    storage = rules.storage
    wanted = query.limit
    names: Sequence[str | None] = [query.rule]
    if query.rules is not None:
        names = sorted(set(query.rules) & ({query.rule} if query.rule else set(query.rules)))
        if not names:
            return []
    for ref in await _refs(rules, query.workspace, query.tenant):
        for name in names:
            size = None if query.reads_all or wanted is None else max(READ_FIRST, wanted + 1)
            while True:
                runs = await storage.runs(
                    ref,
                    rule=name,
                    status=query.status,  # type: ignore[arg-type]
                    limit=size,
                )
                kept = [row for row in (RunRow.of(ref, run) for run in runs) if query.keeps(row)]
                if size is None or len(runs) < size or wanted is None:
                    break
                # runs created with the last one read may be among those not read yet: keep
                # only what is certainly before them
                last = (runs[-1].created_at, runs[-1].fired_seq)
                kept = [row for row in kept if (row.created_at, row.fired_seq) > last]
                if len(kept) >= wanted:
                    break
                size *= 2
            kept.sort(key=lambda row: order_key(row, query.order), reverse=True)
            lists.append(kept)
    merged = heapq.merge(*lists, key=lambda row: order_key(row, query.order), reverse=True)
    return list(itertools.islice(merged, wanted))


ORDER_KEYS: Final[dict[RunOrder, "attrgetter[OrderKey]"]] = {
    "created": attrgetter("created_at", "fired_seq", "tenant_id", "workspace_id", "id"),
    "changed": attrgetter("updated_at", "fired_seq", "tenant_id", "workspace_id", "id"),
}
"""Where a run is in each order of a listing (compared newest first), as :meth:`Cursor.key`
says it; an ``attrgetter``, read in C, since the console's run index sorts every run by it."""


def order_key(row: "RunRow", order: RunOrder) -> OrderKey:
    """Where ``row`` is in a listing's ``order`` (compared newest first)."""
    return ORDER_KEYS[order](row)


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


async def _refs(
    rules: Workspaces, workspace: WorkspaceKey | None, tenant: str | None = None
) -> list[WorkspaceRef]:
    if workspace is not None:
        return [WorkspaceRef(workspace.tenant_id, workspace.workspace_id)]
    refs = await rules.storage.workspaces()
    return [ref for ref in refs if tenant is None or ref.tenant_id == tenant]
