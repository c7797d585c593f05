"""The dispatcher on real reflexr storage (memory, SQLite, PostgreSQL): which runs are due, and
how they go in messages.

Each due run is enqueued once per attempt; a workspace's burst shares a few messages; a run
whose attempt was abandoned goes alone; a retry is enqueued once its backoff passed; a run
running under its lease is not due, one whose lease lapsed is; an ordered scope is enqueued one
run at a time. The harness (its queue a list of messages, its clocks moved by the test) is
:mod:`tests.dispatch.dispatch_harness`.
"""

import asyncio
from datetime import timedelta

import pytest
from reflexr import SourceActor
from reflexr.core import start
from reflexr.workspace import run_lease

from relayr.dispatch.dispatcher import DispatchPass
from relayr.execution.executor import execute_run, execute_runs
from tests.dispatch.dispatch_harness import (
    BACKOFF,
    FAIR_BATCH,
    REF,
    REQUEUE_AFTER_S,
    TENANT,
    WORKSPACE,
    Harness,
    Ping,
    Step,
)


async def test_each_due_run_is_enqueued_once(harness: Harness) -> None:
    await harness.publish(Ping(), Ping(), Ping())

    first, enqueued = await harness.dispatch()
    second, again = await harness.dispatch()

    assert first == DispatchPass(firings=3, due=3, enqueued=3, messages=3)
    assert sorted(enqueued) == sorted(await harness.runs())
    assert second == DispatchPass(due=3, waiting=3)
    assert again == []


@pytest.mark.parametrize(
    ("runs", "sizes"),
    [(2, [1, 1]), (10, [3, 3, 3, 1]), (40, [FAIR_BATCH] * 8), (100, [FAIR_BATCH] * 20)],
)
async def test_the_due_runs_of_a_workspace_share_messages(
    harness: Harness, runs: int, sizes: list[int]
) -> None:
    """A burst goes in few messages, yet in several, so several workers share it."""
    await harness.publish(*(Ping() for _ in range(runs)))

    done, enqueued = await harness.dispatch_caught_up()

    assert [len(batch.run_ids) for batch in harness.queue] == sizes
    assert (done.enqueued, done.messages) == (runs, len(sizes))
    assert len(set(enqueued)) == runs


async def test_a_run_whose_attempt_was_abandoned_goes_alone(harness: Harness) -> None:
    """It may be what killed its worker: it must not take other runs with it again."""
    await harness.publish(Ping(), Ping(), Ping())
    _, [suspect, *_] = await harness.dispatch()
    storage = harness.rules.storage
    async with storage.transaction(REF) as transaction:
        pending = await transaction.run(suspect)
        assert pending is not None
        await transaction.save_runs([start(pending, now=harness.rules.clock())[0]])
    [abandoned] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [suspect])
    assert abandoned.outcome == "abandoned"
    harness.later.ahead += BACKOFF
    await harness.publish(Ping(), Ping(), Ping(), Ping())

    await harness.dispatch()

    alone = [batch.run_ids for batch in harness.queue if suspect in batch.run_ids]
    assert alone == [(suspect,)]


async def test_a_run_at_its_next_attempt_is_enqueued_at_once(harness: Harness) -> None:
    await harness.publish(Ping(mode="fail"))
    _, [run_id] = await harness.dispatch()
    executed = await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)
    assert executed.outcome == "retrying"

    _, waiting = await harness.dispatch()
    harness.later.ahead += BACKOFF
    _, due_again = await harness.dispatch()

    assert waiting == []
    assert due_again == [run_id]


async def test_a_running_run_under_its_lease_is_not_enqueued(harness: Harness) -> None:
    await harness.publish(Ping(mode="wait"))
    _, [run_id] = await harness.dispatch()
    executing = asyncio.create_task(execute_run(harness.runtime, TENANT, WORKSPACE, run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    harness.clock.now += REQUEUE_AFTER_S * 2
    done, enqueued = await harness.dispatch()
    harness.gates.release.set()
    executed = await asyncio.wait_for(executing, 5)

    assert done.due == 0
    assert enqueued == []
    assert executed.outcome == "succeeded"


async def test_a_running_run_whose_lease_lapsed_is_found(harness: Harness) -> None:
    """A worker killed mid-action leaves its run running under a lease no one renews."""
    await harness.publish(Ping())
    _, [run_id] = await harness.dispatch()
    storage = harness.rules.storage
    ttl = timedelta(seconds=1.5)
    assert await storage.acquire_lease(REF, run_lease(run_id), "killed-worker", ttl)
    async with storage.transaction(REF) as transaction:
        pending = await transaction.run(run_id)
        assert pending is not None
        await transaction.save_runs([start(pending, now=harness.rules.clock())[0]])

    _, held = await harness.dispatch()
    await asyncio.sleep(ttl.total_seconds() * 1.5)
    _, lapsed = await harness.dispatch()
    executed = await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)

    assert held == []
    assert lapsed == [run_id]  # a new attempt of the same run: (running, 1, 1), not (pending, 0, 0)
    assert executed.outcome == "abandoned"


async def test_an_ordered_scope_is_enqueued_one_run_at_a_time(harness: Harness) -> None:
    """Only each scope's head is due; the worker that runs it goes on with the scope."""
    await harness.publish(Step(key="a"), Step(key="a"), Step(key="a"), Step(key="b"))

    done, enqueued = await harness.dispatch()
    [head] = [r for r in enqueued if r in await _scope(harness, "a")]
    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [head])
    _, following = await harness.dispatch()

    assert done.firings == 4
    assert len(enqueued) == 2  # the head of each scope
    assert [e.outcome for e in executed] == ["succeeded"] * 3
    assert following == []
    statuses = await harness.runs()
    assert [statuses[run_id] for run_id in await _scope(harness, "a")] == ["succeeded"] * 3


async def _scope(harness: Harness, key: str) -> set[str]:
    source = await harness.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
    return {r.id for r in await source.runs(rule="dispatch:step") if r.scope == {"key": key}}
