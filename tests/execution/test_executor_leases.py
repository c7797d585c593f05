"""One attempt at a time, on real reflexr storage: in memory, SQLite and PostgreSQL.

A run's lease keeps a second execution out, in this process or another; an attempt whose worker
stopped is recorded abandoned once its lease lapses, and a run whose attempts keep losing their
worker dies ``worker_lost``; an operator's cancel interrupts an attempt or drops its outcome; an
executor cancelled by its caller releases its lease at once; ``fail_run`` fails a run for good
from outside its attempt. And what a successful run costs: three transactions (ADR-0002).
Runs are made and read through :mod:`tests.execution.executor_harness`.
"""

import asyncio
from collections.abc import Callable
from datetime import timedelta

import pytest
from reflexr import SourceActor
from reflexr.core import start
from reflexr.workspace import run_lease
from sqlalchemy import event

from relayr.execution.executor import fail_run
from tests.execution.executor_harness import (
    BACKOFF,
    REF,
    TENANT,
    WORKSPACE,
    Asked,
    Harness,
    Timed,
)
from tests.execution.executor_harness import database_url as database_url  # the storage, a fixture
from tests.execution.executor_harness import harness as harness  # the fixture, on every storage
from tests.services import SQL_STORAGES


async def test_a_run_executed_twice_at_once_makes_one_attempt(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="wait"))
    first = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    same_process = await harness.execute(run_id)
    other_process = await harness.execute(run_id, harness.other_worker())
    harness.gates.release.set()
    executed = await first
    after = await harness.execute(run_id, harness.other_worker())

    assert same_process.outcome == "contended"
    assert "in this process" in same_process.detail
    assert other_process.outcome == "contended"
    assert executed.outcome == "succeeded"
    assert after.outcome in ("contended", "not_due")
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("succeeded", 1)
    assert harness.gates.calls == 1
    assert await harness.facts(run_id) == ["run_started", "run_succeeded"]


async def test_an_attempt_whose_executor_stopped_is_recorded_abandoned(harness: Harness) -> None:
    """A worker killed mid-action leaves the run running, under a lease it no longer renews."""
    run_id = await harness.fire(Asked(mode="ok"))
    storage = harness.rules.storage
    ttl = timedelta(seconds=1.5)
    assert await storage.acquire_lease(REF, run_lease(run_id), "killed-worker", ttl)
    async with storage.transaction(REF) as transaction:
        pending = await transaction.run(run_id)
        assert pending is not None
        started, _ = start(pending, now=harness.rules.clock())
        await transaction.save_runs([started])

    while_held = await harness.execute(run_id)
    await asyncio.sleep(ttl.total_seconds() * 1.5)
    lapsed = await harness.execute(run_id)
    await asyncio.sleep(BACKOFF.total_seconds() * 1.5)
    retried = await harness.execute(run_id)

    assert while_held.outcome == "contended"
    assert lapsed.outcome == "abandoned"
    assert lapsed.run is not None
    assert (lapsed.run.status, lapsed.run.reason) == ("retrying", "abandoned")
    assert retried.outcome == "succeeded"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("succeeded", 2, 2)
    assert harness.gates.calls == 1


async def test_a_run_whose_attempts_keep_losing_their_worker_dies_worker_lost(
    harness: Harness,
) -> None:
    """An action that kills its worker: each claim finds its attempt abandoned; past the bound
    the run is failed for good, before its retry policy (3 attempts) would let it kill more."""
    run_id = await harness.fire(Timed())
    worker = harness.other_worker(max_redeliveries=1)
    storage = harness.rules.storage
    outcomes = []
    for _ in range(2):
        async with storage.transaction(REF) as transaction:
            waiting = await transaction.run(run_id)
            assert waiting is not None
            started, _ = start(waiting, now=harness.rules.clock())  # then its worker dies
            await transaction.save_runs([started])
        executed = await harness.execute(run_id, worker)
        assert executed.run is not None
        outcomes.append((executed.outcome, executed.run.status, executed.run.reason))

    assert outcomes == [
        ("abandoned", "retrying", "abandoned"),
        ("abandoned", "dead", "worker_lost"),
    ]
    stored = await harness.run(run_id)
    assert stored.error is not None
    assert "(2 attempts lost in a row)" in stored.error
    assert harness.gates.calls == 0


async def test_an_attempt_cancelled_by_an_operator_mid_action_is_interrupted(
    harness: Harness,
) -> None:
    """A short lease: the renewal finds the attempt cancelled and stops the action."""
    run_id = await harness.fire(Asked(mode="wait"))
    worker = harness.other_worker(lease_ttl_s=0.3)
    executing = asyncio.create_task(harness.execute(run_id, worker))
    await asyncio.wait_for(harness.gates.started.wait(), 5)
    operator = await harness.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    await operator.cancel_run(run_id, reason="not needed")
    executed = await asyncio.wait_for(executing, 5)

    assert executed.outcome == "interrupted"
    assert not harness.gates.release.is_set()
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("cancelled", 1)
    assert await harness.facts(run_id) == ["run_started", "run_cancelled"]


async def test_an_outcome_after_an_operator_cancel_is_dropped(harness: Harness) -> None:
    """A long lease: the action ends before any renewal, and its outcome is not recorded."""
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)
    operator = await harness.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    await operator.cancel_run(run_id)
    harness.gates.release.set()
    executed = await asyncio.wait_for(executing, 5)

    assert executed.outcome == "dropped"
    assert "no longer current (the run is cancelled)" in executed.detail
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("cancelled", 1)
    assert await harness.facts(run_id) == ["run_started", "run_cancelled"]


async def test_an_executor_cancelled_by_its_caller_lets_the_next_claim_recover(
    harness: Harness,
) -> None:
    """A time limit or a shutdown cancels the executor: its lease is released at once."""
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    executing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await executing
    recovered = await harness.execute(run_id, harness.other_worker())

    assert recovered.outcome == "abandoned"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.reason) == ("retrying", 1, "abandoned")


async def test_fail_run_kills_a_running_attempt_for_good(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    failed = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed 3 times"
    )
    harness.gates.release.set()
    late = await asyncio.wait_for(executing, 5)

    assert failed.outcome == "dead"
    assert late.outcome == "dropped"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.reason) == ("dead", 1, "worker_lost")
    assert stored.error == "killed 3 times"


async def test_fail_run_counts_the_attempt_of_a_due_run(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    failed = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
    )
    finished = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
    )

    assert failed.outcome == "dead"
    assert finished.outcome == "not_due"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("dead", 1)
    assert harness.gates.calls == 0
    assert await harness.facts(run_id) == ["run_started", "run_dead_lettered"]


async def test_fail_run_of_a_missing_run(harness: Harness) -> None:
    executed = await fail_run(harness.runtime, TENANT, WORKSPACE, "fir_x", reason="r", error="e")

    assert executed.outcome == "missing"


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_a_successful_run_costs_three_transactions(harness: Harness) -> None:
    """Take the lease, claim, complete: a succeeded run's lease is left to lapse (ADR-0002)."""
    run_id = await harness.fire(Asked(mode="ok"))
    [engine] = harness.application.engines
    begun: list[object] = []
    listener: Callable[..., None] = lambda connection: begun.append(connection)  # noqa: E731
    event.listen(engine.sync_engine, "begin", listener)
    try:
        executed = await harness.execute(run_id)
    finally:
        event.remove(engine.sync_engine, "begin", listener)

    assert executed.outcome == "succeeded"
    assert len(begun) == 3
