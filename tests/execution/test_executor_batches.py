"""The runs of one message, executed together by ``execute_runs``, on real reflexr storage: in
memory, SQLite and PostgreSQL.

An ordered scope goes on with its next runs in the same execution, and stops at a failure; an
unordered run is executed alone; a message's runs are claimed together, whatever each one's
state. Runs are made and read through :mod:`tests.execution.executor_harness`; the assertions
read the runs and the order of their facts in the store.
"""

from relayr.execution.executor import execute_runs
from tests.execution.executor_harness import REF, TENANT, WORKSPACE, Asked, Harness, Keyed
from tests.execution.executor_harness import database_url as database_url  # the storage, a fixture
from tests.execution.executor_harness import harness as harness  # the fixture, on every storage


async def test_an_ordered_scope_goes_on_with_its_next_runs_in_one_execution(
    harness: Harness,
) -> None:
    first = await harness.fire(Keyed(key="api"))
    second = await harness.fire(Keyed(key="api"))
    third = await harness.fire(Keyed(key="api"))
    other_scope = await harness.fire(Keyed(key="db"))

    too_early = await harness.execute(second)
    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert too_early.outcome == "not_due"
    assert too_early.detail == f"run {second} waits: it is not first in its scope"
    assert [(e.outcome, e.run.id if e.run else None) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
        ("succeeded", third),
    ]
    envelopes = await harness.rules.storage.read(REF)
    order = [
        (e.event.run_id, e.event_type.removeprefix("reflexr:"))
        for e in envelopes
        if getattr(e.event, "run_id", None) in (first, second, third)
    ]
    assert order == [
        (run_id, fact)
        for run_id in (first, second, third)
        for fact in ("run_started", "run_succeeded")
    ]
    assert (await harness.run(other_scope)).status == "pending"


async def test_a_scope_whose_run_fails_goes_no_further(harness: Harness) -> None:
    first = await harness.fire(Keyed(key="api", mode="fail"))
    second = await harness.fire(Keyed(key="api"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert [e.outcome for e in executed] == ["retrying"]
    assert (await harness.run(second)).status == "pending"


async def test_an_unordered_run_is_executed_alone(harness: Harness) -> None:
    first = await harness.fire(Asked(mode="ok"))
    other = await harness.fire(Asked(mode="ok"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert [e.outcome for e in executed] == ["succeeded"]
    assert (await harness.run(other)).status == "pending"


async def test_the_runs_of_one_message_are_claimed_and_executed_together(
    harness: Harness,
) -> None:
    ok = [await harness.fire(Asked(mode="ok")) for _ in range(3)]
    failing = await harness.fire(Asked(mode="fail"))
    finished = await harness.fire(Asked(mode="ok"))
    await harness.execute(finished)

    executed = await execute_runs(
        harness.runtime, TENANT, WORKSPACE, [*ok, failing, finished, "fir_missing", ok[0]]
    )

    assert [e.outcome for e in executed] == [
        "succeeded",
        "succeeded",
        "succeeded",
        "retrying",
        "not_due",
        "missing",
    ]
    for run_id in ok:
        assert (await harness.run(run_id)).status == "succeeded"
    assert (await harness.run(failing)).status == "retrying"
    assert harness.runtime.executing == set()
