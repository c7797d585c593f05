"""What a message of several runs must not keep to itself, must say and must not lose, on real
storage (in memory, SQLite and PostgreSQL).

It must not keep the leases of runs it did not start, nor the mark of a run another executor
holds; it must say when it found a run of its scope abandoned; it must not lose the ledger rows
of an attempt that was interrupted, or whose completion failed for good. Every "meanwhile" is
made by the test: a gate the action waits on, a lease or a run the test writes, a statement
failed in the driver (:mod:`tests.execution.retries_harness`).
"""

import asyncio
from datetime import timedelta

import pytest
from reflexr.core import start
from reflexr.workspace import run_lease
from sqlalchemy.exc import OperationalError

from relayr.execution.executor import execute_run, execute_runs
from tests.execution.retries_harness import (
    KEY,
    REF,
    RUNS_SAVED,
    SQL,
    TENANT,
    WAIT_S,
    WORKSPACE,
    FailingStatements,
    Harness,
    Noticed,
    Once,
    Ordered,
)
from tests.execution.retries_harness import database_url as database_url  # the storage, a fixture
from tests.execution.retries_harness import harness as harness  # the fixture, on every storage
from tests.execution.retries_harness import sample as _sample


async def test_a_later_run_of_a_scope_named_in_the_same_message_goes_on(
    harness: Harness,
) -> None:
    """It is not first in its scope when claimed; its lease is released then, so the message
    takes it again when the run before it ends."""
    first = await harness.fire(Ordered(key="api"))
    second = await harness.fire(Ordered(key="api"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first, second])

    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
    ]
    assert harness.runtime.executing == set()


async def test_a_run_the_message_did_not_start_is_free_for_another_delivery(
    harness: Harness,
) -> None:
    holding = await harness.fire(Once(mode="wait"))
    finished = await harness.fire(Once())
    assert (await execute_run(harness.runtime, TENANT, WORKSPACE, finished)).outcome == (
        "succeeded"
    )
    message = asyncio.create_task(
        execute_runs(harness.runtime, TENANT, WORKSPACE, [holding, finished])
    )
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    elsewhere = await execute_run(harness.other_worker(), TENANT, WORKSPACE, finished)
    here = await execute_run(harness.runtime, TENANT, WORKSPACE, finished)
    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert (elsewhere.outcome, here.outcome) == ("not_due", "not_due")
    assert [e.outcome for e in executed] == ["succeeded", "not_due"]


async def test_a_run_another_executor_held_is_not_marked_as_executed_here(
    harness: Harness,
) -> None:
    holding = await harness.fire(Once(mode="wait"))
    contended = await harness.fire(Once())
    storage = harness.rules.storage
    ttl = timedelta(minutes=5)
    assert await storage.acquire_lease(REF, run_lease(contended), "other-worker", ttl)
    message = asyncio.create_task(
        execute_runs(harness.runtime, TENANT, WORKSPACE, [holding, contended])
    )
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    marked = (TENANT, WORKSPACE, contended) in harness.runtime.executing
    await storage.release_lease(REF, run_lease(contended), "other-worker")
    redelivered = await execute_run(harness.runtime, TENANT, WORKSPACE, contended)
    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert not marked
    assert redelivered.outcome == "succeeded", redelivered.detail
    assert [e.outcome for e in executed] == ["succeeded", "contended"]


async def test_the_next_run_of_a_scope_found_abandoned_is_reported(harness: Harness) -> None:
    """Another worker took the scope's next run meanwhile and died: going on with the scope,
    the message takes its lapsed lease and records its attempt abandoned, and says so."""
    first = await harness.fire(Ordered(key="api", mode="wait"))
    second = await harness.fire(Ordered(key="api"))
    message = asyncio.create_task(execute_runs(harness.runtime, TENANT, WORKSPACE, [first]))
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)
    async with harness.rules.storage.transaction(REF) as transaction:
        waiting = await transaction.run(second)
        assert waiting is not None
        await transaction.save_runs([start(waiting, now=harness.rules.clock())[0]])

    abandoned = _sample("relayr_runs_executed_total", rule="retries:ordered", outcome="abandoned")

    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("abandoned", second),
    ]
    assert _sample("relayr_runs_executed_total", rule="retries:ordered", outcome="abandoned") == (
        abandoned + 1
    )
    stored = await harness.run(second)
    assert (stored.status, stored.reason) == ("retrying", "abandoned")
    assert harness.runtime.executing == set()


async def _posted_then_retried(harness: Harness, then: str) -> str:
    """A run whose first attempt posted its notice and failed, made due again by an
    operator: its next attempt finds the notice posted (``already_posted``), a ledger row
    that only the run's completion carries."""
    thread = await harness.thread()
    run_id = await harness.fire(Noticed(thread_id=thread, then=then))
    assert (await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)).outcome == "retrying"
    await (await harness.operator()).retry_run(run_id)
    return run_id


async def test_an_interrupted_attempt_keeps_the_ledger_rows_of_its_writes(
    harness: Harness,
) -> None:
    run_id = await _posted_then_retried(harness, "hold")
    worker = harness.other_worker(lease_ttl_s=0.3)  # a renewal finds the cancel soon
    message = asyncio.create_task(execute_run(worker, TENANT, WORKSPACE, run_id))
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    await (await harness.operator()).cancel_run(run_id)
    executed = await asyncio.wait_for(message, WAIT_S)

    assert executed.outcome == "interrupted"
    records = await harness.runtime.bridge.ledger.emissions(KEY, run_id)
    assert [(r.epoch, r.outcome) for r in records] == [(1, "posted"), (2, "already_posted")]


@SQL
async def test_a_completion_that_fails_for_good_still_writes_the_ledger_rows(
    harness: Harness,
) -> None:
    run_id = await _posted_then_retried(harness, "end")

    failing = FailingStatements(RUNS_SAVED, skip=1)  # the claim's
    with (
        failing.attached(harness.storage_engine()) as fault,
        pytest.raises(OperationalError, match="database is locked"),
    ):
        await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)

    assert fault.fired == 3  # the completion's tries; the rows' own write saves no run
    records = await harness.runtime.bridge.ledger.emissions(KEY, run_id)
    assert [(r.epoch, r.outcome) for r in records] == [(1, "posted"), (2, "already_posted")]
    assert (await harness.run(run_id)).status == "running"  # left to the next claim
