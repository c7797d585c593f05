"""Every run of every workspace, kept in one process and brought up to date from reflexr's logs.

Guarantee: after :meth:`RunIndex.refreshed`, the index holds every run as it was committed
before the refresh began, or later; it reads every run once, then only the runs the facts
appended since name (and those a limit holds waiting, whose due time moves with no fact). On a
database, a refresh learns which workspaces moved from one read of every workspace's head.
Its counts and its runs in both orders of the runs list are kept as runs change, so a page
costs what it shows, not what the store holds. Runs are read through reflexr's storage API
only (ADR-0001); why and at what cost: ADR-0109.
"""

import asyncio
import bisect
import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Final

from reflexr.core import (
    WAITING,
    RuleFired,
    Run,
    RunCancelled,
    RunDeadLettered,
    RunProgressed,
    RunRequeued,
    RunRetrying,
    RunSkipped,
    RunStarted,
    RunSucceeded,
)
from reflexr.workspace import WorkspaceRef, Workspaces
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.dispatch.changes import read_heads
from relayr.ledger.limits import LimitStore
from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import ORDER_KEYS, OrderKey, RunFilter, RunRow

RUN_CHANGES: Final = (
    RunStarted,
    RunProgressed,
    RunRetrying,
    RunSucceeded,
    RunDeadLettered,
    RunCancelled,
    RunRequeued,
    RunSkipped,
)
"""The facts reflexr appends with every change of a run it saves (archiving a rule included:
it appends each cancelled run's ``run_cancelled``)."""

RUN_FACTS: Final = tuple(fact.event_type for fact in (RuleFired, *RUN_CHANGES))
"""What the index reads of a log: a run's creation (its firing) and its changes."""

READ_BATCH: Final = 1000
"""Facts read per read of a log."""

RELOAD_ABOVE: Final = 500
"""A workspace with more changed runs than this since the last refresh is read whole again: one
read of every run costs less than as many reads by id."""

type Tally = Counter[tuple[str, str, WorkspaceKey]]
"""How many runs have each status, rule and workspace."""


def hour_of(moment: datetime) -> datetime:
    """The whole hour a moment falls in."""
    return moment.replace(minute=0, second=0, microsecond=0)


@dataclass
class _Workspace:
    """One workspace's runs, read to its log's ``head``."""

    ref: WorkspaceRef
    head: int
    rows: dict[str, RunRow] = field(default_factory=dict)


class _Order:
    """Every run of the index in one order, kept sorted as runs change, so a page reads its
    runs from the top instead of comparing every run; sorted again whole after a workspace was
    read whole."""

    def __init__(self, key: "attrgetter[OrderKey]") -> None:
        self.key = key
        self.keys: list[OrderKey] = []
        self.rows: list[RunRow] = []
        self.stale = False

    def add(self, row: RunRow) -> None:
        if not self.stale:
            key = self.key(row)
            at = bisect.bisect_left(self.keys, key)
            self.keys.insert(at, key)
            self.rows.insert(at, row)

    def remove(self, row: RunRow) -> None:
        if not self.stale:
            at = bisect.bisect_left(self.keys, self.key(row))
            del self.keys[at]
            del self.rows[at]

    def sort(self, every: Iterable[RunRow]) -> None:
        """Sort ``every`` run of the index anew, if the order is stale."""
        if self.stale:
            self.rows = sorted(every, key=self.key)
            self.keys = [self.key(row) for row in self.rows]
            self.stale = False

    def newest(self, before: OrderKey | None) -> Iterator[RunRow]:
        """The runs newest first, from the last before ``before`` (None: from the newest)."""
        end = len(self.keys) if before is None else bisect.bisect_left(self.keys, before)
        return (self.rows[at] for at in range(end - 1, -1, -1))


class RunIndex:
    """Every run of every workspace, as of the last :meth:`refreshed` (see the module).

    Attributes:
        tally: How many runs have each ``(status, rule, workspace)``.
        hours: How many runs last changed in each ``(hour, status)``.
        pending: The pending runs, by workspace and id.
    """

    def __init__(
        self,
        rules: Workspaces,
        limits: LimitStore | None = None,
        *,
        engine: AsyncEngine | None = None,
    ) -> None:
        """``engine``: the database of ``rules``' storage, whose workspace heads a refresh
        reads in one statement; None (in memory) asks each workspace for its head."""
        self.rules = rules
        self.limits = limits
        self.engine = engine
        self.tally: Tally = Counter()
        self.hours: Counter[tuple[datetime, str]] = Counter()
        self.pending: dict[tuple[WorkspaceKey, str], RunRow] = {}
        self._workspaces: dict[WorkspaceKey, _Workspace] = {}
        self._orders = {order: _Order(key) for order, key in ORDER_KEYS.items()}
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return sum(len(workspace.rows) for workspace in self._workspaces.values())

    async def refreshed(self) -> "RunIndex":
        """The index, once every run committed before this call is in it."""
        async with self._lock:
            for ref, head in await self._heads():
                known = self._workspaces.get(_key(ref))
                if known is None:
                    await self._load(ref, head)
                elif head > known.head:
                    await self._follow(known, head)
            await self._read_waiting()
            for order in self._orders.values():
                order.sort(self.rows())
        return self

    async def _heads(self) -> list[tuple[WorkspaceRef, int]]:
        """Every workspace with its log's head."""
        if self.engine is not None:
            heads = (await read_heads(self.engine)).rules
            return [(WorkspaceRef(*workspace), head) for workspace, head in heads.items()]
        storage = self.rules.storage
        return [(ref, await storage.head_seq(ref)) for ref in await storage.workspaces()]

    def workspaces(self) -> list[WorkspaceRef]:
        """The workspaces that hold runs, by name."""
        held = (workspace.ref for workspace in self._workspaces.values() if workspace.rows)
        return sorted(held, key=attrgetter("tenant_id", "workspace_id"))

    def with_id(self, run_id: str) -> list[RunRow]:
        """Every workspace's run of this id (run ids are unique within a workspace only), by
        workspace."""
        found = (workspace.rows.get(run_id) for workspace in self._workspaces.values())
        return sorted(
            (row for row in found if row is not None),
            key=attrgetter("tenant_id", "workspace_id"),
        )

    def rows(self) -> Iterator[RunRow]:
        for workspace in self._workspaces.values():
            yield from workspace.rows.values()

    def select(self, query: RunFilter) -> list[RunRow]:
        """The runs :func:`relayr.ops.rows.list_runs` lists for ``query``, in its order, read
        from the newest (or the cursor) down until enough pass the filters."""
        names: set[str] | None = None
        if query.rules is not None:
            names = set(query.rules) & ({query.rule} if query.rule else set(query.rules))
        elif query.rule is not None:
            names = {query.rule}
        before = None if query.after is None else query.after.key()
        kept = self._orders[query.order].newest(before)
        if query.order == "changed" and query.since is not None:
            since = query.since
            kept = itertools.takewhile(lambda row: row.updated_at >= since, kept)
        if query.workspace is not None:
            where = query.workspace
            kept = (row for row in kept if row.workspace == where)
        elif query.tenant is not None:
            tenant = query.tenant
            kept = (row for row in kept if row.tenant_id == tenant)
        if query.status is not None:
            status = query.status
            kept = (row for row in kept if row.status == status)
        if names is not None:
            kept = (row for row in kept if row.rule in names)
        if (query.since, query.until, query.reason) != (None, None, None):
            kept = filter(query.keeps, kept)
        return list(kept if query.limit is None else itertools.islice(kept, query.limit))

    async def _load(self, ref: WorkspaceRef, head: int) -> None:
        """Read every run of the workspace, its log's ``head`` read first: what commits after
        it, the facts after it name."""
        runs = await self.rules.storage.runs(ref)
        old = self._workspaces.get(_key(ref))
        for order in self._orders.values():
            order.stale = True
        if old is not None:
            for run_id in list(old.rows):
                self._drop(old, run_id)
        workspace = _Workspace(ref, head)
        self._workspaces[_key(ref)] = workspace
        for run in runs:
            self._put(workspace, run)

    async def _follow(self, workspace: _Workspace, head: int) -> None:
        """Read again the runs the facts after the workspace's head name."""
        storage = self.rules.storage
        changed: set[str] = set()
        after = workspace.head
        while after < head:
            facts = await storage.read(
                workspace.ref,
                after_seq=after,
                before_seq=head + 1,
                types=RUN_FACTS,
                limit=READ_BATCH,
            )
            for envelope in facts:
                event = envelope.event
                if isinstance(event, RuleFired):
                    changed.add(event.firing_id)
                elif isinstance(event, RUN_CHANGES):
                    changed.add(event.run_id)
            if len(facts) < READ_BATCH:
                break
            after = facts[-1].seq
        if len(changed) > RELOAD_ABOVE:
            await self._load(workspace.ref, head)
            return
        await self._read_again(workspace, changed)
        workspace.head = head

    async def _read_again(self, workspace: _Workspace, run_ids: Collection[str]) -> None:
        for run_id in run_ids:
            run = await self.rules.storage.run(workspace.ref, run_id)
            if run is None:
                self._drop(workspace, run_id)
            else:
                self._put(workspace, run)

    async def _read_waiting(self) -> None:
        """Read again each run the limit store holds waiting that the index holds due: a limit
        may have moved its due time (the one change of a run without a fact)."""
        if self.limits is None:
            return
        now = self.rules.clock()
        for wait in await self.limits.waiting():
            key = WorkspaceKey(wait.run.tenant_id, wait.run.workspace_id)
            workspace = self._workspaces.get(key)
            row = None if workspace is None else workspace.rows.get(wait.run.run_id)
            if workspace and row and row.status in WAITING and row.next_attempt_at <= now:
                await self._read_again(workspace, [row.id])

    def _put(self, workspace: _Workspace, run: Run) -> None:
        self._drop(workspace, run.id)
        row = RunRow.of(workspace.ref, run)
        workspace.rows[run.id] = row
        self._count(row, 1)
        for order in self._orders.values():
            order.add(row)

    def _drop(self, workspace: _Workspace, run_id: str) -> None:
        row = workspace.rows.pop(run_id, None)
        if row is not None:
            self._count(row, -1)
            for order in self._orders.values():
                order.remove(row)

    def _count(self, row: RunRow, change: int) -> None:
        where = row.workspace
        _add(self.tally, (row.status, row.rule, where), change)
        _add(self.hours, (hour_of(row.updated_at), row.status), change)
        if row.status == "pending":
            if change > 0:
                self.pending[(where, row.id)] = row
            else:
                self.pending.pop((where, row.id), None)


def _add[K](counter: Counter[K], key: K, change: int) -> None:
    counter[key] += change
    if counter[key] <= 0:
        del counter[key]


def _key(ref: WorkspaceRef) -> WorkspaceKey:
    return WorkspaceKey(ref.tenant_id, ref.workspace_id)
