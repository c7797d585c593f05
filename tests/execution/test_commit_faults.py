"""The executor's steps when a fault hides what happened, on real storage (SQLite and
PostgreSQL).

A COMMIT takes effect and then the step raises, as a connection lost while PostgreSQL committed
would (:class:`LostAfterCommit`, a wrapper around the dialect's ``do_commit``): relayr tries the
step again, which must find its own work, not take it for another executor's. A step whose
first try rolled back counts what it committed once. And the wait between tries, a plain
table. Runs are made and read through :mod:`tests.execution.retries_harness`.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import AsyncRetrying, RetryCallState

from relayr.execution.executor import execute_runs, fail_run
from relayr.runtime import transient
from tests.execution.retries_harness import (
    RUNS_SAVED,
    SQL,
    TENANT,
    WORKSPACE,
    FailingStatements,
    Harness,
    Once,
    Ordered,
)
from tests.execution.retries_harness import database_url as database_url  # the storage, a fixture
from tests.execution.retries_harness import harness as harness  # the fixture, on every storage
from tests.execution.retries_harness import sample as _sample


@dataclass
class LostAfterCommit:
    """Lets the COMMIT of a transaction that ran a matching statement take effect, then raises
    the driver's ``OperationalError``, once, as a connection lost during COMMIT would."""

    pattern: re.Pattern[str]
    skip: int = 0
    """Matching transactions to let through before the one that fails."""
    fired: int = 0
    _marked: set[int] = field(default_factory=set)

    def before(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.pattern.search(statement):
            self._marked.add(id(connection.connection))

    @contextmanager
    def attached(self, engine: AsyncEngine) -> Iterator["LostAfterCommit"]:
        dialect: Any = engine.sync_engine.dialect
        commit = dialect.do_commit

        def do_commit(dbapi_connection: Any) -> None:
            commit(dbapi_connection)
            if id(dbapi_connection) not in self._marked:
                return
            self._marked.discard(id(dbapi_connection))
            if self.skip:
                self.skip -= 1
            elif not self.fired:
                self.fired += 1
                raise dialect.loaded_dbapi.OperationalError("connection lost in commit (injected)")

        dialect.do_commit = do_commit
        event.listen(engine.sync_engine, "before_cursor_execute", self.before)
        try:
            yield self
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", self.before)
            del dialect.do_commit


@SQL
@pytest.mark.parametrize(("step", "skip"), [("claim", 0), ("completion", 1)])
async def test_a_step_whose_commit_took_effect_behind_a_fault_is_not_done_twice(
    harness: Harness, step: str, skip: int
) -> None:
    """The rule allows one attempt: a claim that took its own attempt for an abandoned one
    would leave the run dead without running it; a completion that found its run finished
    would report it dropped."""
    run_id = await harness.fire(Once())

    with LostAfterCommit(RUNS_SAVED, skip=skip).attached(harness.storage_engine()) as fault:
        [executed] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [run_id])

    assert fault.fired == 1
    assert executed.outcome == "succeeded", executed.detail
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("succeeded", 1, 1)
    assert await harness.facts(run_id) == ["run_started", "run_succeeded"]
    assert harness.gates.calls == 1


@SQL
async def test_a_completion_that_started_the_next_run_behind_a_fault_does_not_abandon_it(
    harness: Harness,
) -> None:
    first = await harness.fire(Ordered(key="api"))
    second = await harness.fire(Ordered(key="api"))

    with LostAfterCommit(RUNS_SAVED, skip=1).attached(harness.storage_engine()) as fault:
        executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert fault.fired == 1
    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
    ]
    for run_id in (first, second):
        assert await harness.facts(run_id) == ["run_started", "run_succeeded"]
    assert harness.gates.calls == 2


@SQL
async def test_fail_run_whose_commit_took_effect_behind_a_fault_says_dead(
    harness: Harness,
) -> None:
    run_id = await harness.fire(Once())

    with LostAfterCommit(RUNS_SAVED).attached(harness.storage_engine()) as fault:
        failed = await fail_run(
            harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
        )

    assert fault.fired == 1
    assert failed.outcome == "dead"
    assert await harness.facts(run_id) == ["run_started", "run_dead_lettered"]


@SQL
async def test_a_claim_tried_again_counts_its_dispatch_lag_once(harness: Harness) -> None:
    """The first try rolled back: only the start that committed is counted."""
    run_id = await harness.fire(Once())
    lags = _sample("relayr_dispatch_lag_seconds_count")
    facts_appended = re.compile(r"INSERT INTO reflexr_events")

    with FailingStatements(facts_appended, times=1).attached(harness.storage_engine()) as fault:
        [executed] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [run_id])

    assert (fault.fired, executed.outcome) == (1, "succeeded")
    assert _sample("relayr_dispatch_lag_seconds_count") == lags + 1


@pytest.mark.parametrize(("tries", "wait_s"), [(1, 0.05), (2, 0.1), (3, 0.2), (5, 0.5), (60, 0.5)])
def test_the_wait_after_a_try_doubles_from_the_first_up_to_the_bound(
    tries: int, wait_s: float
) -> None:
    """Three tries wait 0.05 s, then 0.1 s (the bound, 0.5 s, only after more tries)."""
    state = RetryCallState(retry_object=AsyncRetrying(), fn=None, args=(), kwargs={})
    state.attempt_number = tries
    assert transient.WAIT(state) == pytest.approx(wait_s)
    assert transient.BACKOFF_S == (0.05, 0.5)
