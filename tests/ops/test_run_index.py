"""The console's run index says what reflexr's store says, as runs change, on real storage
(SQLite and PostgreSQL).

After each change (runs created, executed to dead, succeeded, cancelled, retried, a due time
moved by a limit without a fact), the index refreshed lists what :func:`list_runs` reads from
the store, filter by filter and in both orders, and its counts are the store's. Given the
database, a refresh reads every workspace's head in one statement.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from reflexr.workspace import WorkspaceRef
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.ledger import WorkspaceKey
from relayr.ledger.limits import Check, RunKey
from relayr.ops import index as index_module
from relayr.ops.index import RunIndex, hour_of
from relayr.ops.rows import Cursor, RunFilter, find_run, list_runs
from relayr.ops.runs import cancel, retry
from tests.ops.ops_harness import KEY, TENANT, WORKSPACE, WORLD, Flaked, Ops

FILTERS = [
    RunFilter(limit=None),
    RunFilter(limit=None, order="changed"),
    RunFilter(limit=2),
    RunFilter(limit=2, order="changed"),
    RunFilter(status="dead", limit=None),
    RunFilter(status="pending", limit=None, order="changed"),
    RunFilter(rule="ops:flaky", limit=None, order="changed"),
    RunFilter(rules=("ops:crash",), limit=None),
    RunFilter(workspace=KEY, limit=None, order="changed"),
    RunFilter(tenant=TENANT, limit=3),
    RunFilter(reason="backup_down", limit=None),
]


async def same_as_the_store(index: RunIndex, ops: Ops) -> None:
    await index.refreshed()
    every = await list_runs(ops.rules, RunFilter(limit=None))
    queries = list(FILTERS)
    if every:
        middle = sorted(row.updated_at for row in every)[len(every) // 2]
        queries += [
            RunFilter(since=middle, limit=None, order="changed"),
            RunFilter(since=middle, limit=None),
        ]
    for order in ("created", "changed"):
        first = index.select(RunFilter(limit=2, order=order))
        if first:  # the next page, from its cursor
            queries.append(RunFilter(limit=None, order=order, after=Cursor.after(first[-1], order)))
    for query in queries:
        assert index.select(query) == await list_runs(ops.rules, query), query
    assert index.tally == Counter((row.status, row.rule, row.workspace) for row in every)
    assert index.hours == Counter((hour_of(row.updated_at), row.status) for row in every)
    assert set(index.pending) == {
        (row.workspace, row.id) for row in every if row.status == "pending"
    }
    assert len(index) == len(every)


def engine_of(ops: Ops) -> AsyncEngine:
    [engine] = ops.runtime.application.engines
    return engine


@contextmanager
def statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """The SQL statements ``engine`` runs within the block."""
    seen: list[str] = []

    def note(_connection: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", note)


@pytest.mark.parametrize("reads_heads", [True, False], ids=["heads-at-once", "each-head"])
async def test_the_index_follows_every_change_of_a_run(ops: Ops, reads_heads: bool) -> None:
    engine = engine_of(ops) if reads_heads else None
    index = RunIndex(ops.rules, ops.runtime.bridge.limits, engine=engine)
    await same_as_the_store(index, ops)  # nothing yet
    thread = await ops.thread()
    first = [await ops.fire(Flaked(thread_id=thread), where) for where in (WORKSPACE, "billing")]
    await same_as_the_store(index, ops)  # created, in a workspace it knew of and a new one
    assert await ops.until_ended(first[0]) == "dead"
    await same_as_the_store(index, ops)
    WORLD.fixed = True
    later = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(later) == "succeeded"
    await same_as_the_store(index, ops)
    dead = await find_run(ops.rules, first[0], KEY)
    assert dead is not None
    [retried] = await retry(ops.rules, [dead], ops.enqueue)
    assert retried.ok
    await same_as_the_store(index, ops)  # pending again
    pending = await find_run(ops.rules, first[1], WorkspaceKey(TENANT, "billing"))
    assert pending is not None
    [cancelled] = await cancel(ops.rules, [pending], reason="not needed")
    assert cancelled.ok
    await same_as_the_store(index, ops)
    assert index.tally[("cancelled", "ops:flaky", WorkspaceKey(TENANT, "billing"))] == 1


async def test_many_changes_read_the_workspace_again(
    ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = RunIndex(ops.rules)
    thread = await ops.thread()
    first = await ops.fire(Flaked(thread_id=thread))
    await same_as_the_store(index, ops)
    monkeypatch.setattr(index_module, "RELOAD_ABOVE", 1)
    for _ in range(3):
        await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(first) == "dead"
    await same_as_the_store(index, ops)


async def test_a_due_time_a_limit_moved_is_read_again(ops: Ops) -> None:
    """A limit that holds a run back moves its due time and its change time with no fact in
    the log (as the limiter's deferral does); the limit store records the run waiting."""
    index = RunIndex(ops.rules, ops.runtime.bridge.limits)
    thread = await ops.thread()
    run_id = await ops.fire(Flaked(thread_id=thread))
    await same_as_the_store(index, ops)
    now = ops.rules.clock()
    check = Check("triage", "runs_in_flight", "triage/runs_in_flight", 0, None)
    key = RunKey(TENANT, WORKSPACE, run_id)
    limits = ops.runtime.bridge.limits
    assert await limits.admit(key, [check], now=now, lease_until=now) is not None
    async with ops.rules.storage.transaction(WorkspaceRef(TENANT, WORKSPACE)) as transaction:
        run = await transaction.run(run_id)
        assert run is not None
        assert run.status == "pending"
        until = now + timedelta(seconds=30)
        await transaction.save_runs(
            [run.model_copy(update={"next_attempt_at": until, "updated_at": now})]
        )
    await same_as_the_store(index, ops)
    [row] = [row for row in index.rows() if row.id == run_id]
    assert row.next_attempt_at == until


async def test_a_refresh_reads_every_workspace_head_in_one_statement(ops: Ops) -> None:
    """However many workspaces there are, a refresh with nothing new reads reflexr's workspace
    table once; a run made meanwhile in one of them is in the next refresh."""
    engine = engine_of(ops)
    index = RunIndex(ops.rules, engine=engine)
    thread = await ops.thread()
    workspaces = [f"w{number}" for number in range(12)]
    for where in workspaces:
        await ops.fire(Flaked(thread_id=thread), where)
    await same_as_the_store(index, ops)
    with statements(engine) as idle:
        await index.refreshed()
    assert sum("reflexr_workspaces" in statement for statement in idle) == 1, idle
    assert not [statement for statement in idle if "reflexr_runs" in statement], idle
    later = await ops.fire(Flaked(thread_id=thread), workspaces[5])
    await index.refreshed()
    assert [row.workspace_id for row in index.with_id(later)] == [workspaces[5]]
    await same_as_the_store(index, ops)
