"""The dispatcher's passes on real reflexr storage: serving them until stopped, and reading the
due list no more often than it must.

``serve`` dispatches until stopped and survives a failing pass (memory, SQLite, PostgreSQL);
a run a pass fired is enqueued without reading every due run, which is read every
``DUE_READ_INTERVAL_S``, and again at once while a backlog is past the due limit (SQLite, rules
without ordered scopes); a run taken while the pass that fired it goes on is not sent again.
The harness (its queue a list of messages, its clocks moved by the test) is
:mod:`tests.dispatch.dispatch_harness`.
"""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relayr.core.run_messages import RunMessage
from relayr.dispatch.changes import Changes
from relayr.dispatch.dispatcher import DUE_READ_INTERVAL_S, Dispatcher
from relayr.execution.executor import execute_runs
from relayr.settings import Settings
from tests.dispatch.dispatch_harness import (
    BACKOFF,
    FAIR_OFF,
    REQUEUE_AFTER_S,
    RULES,
    TENANT,
    WORKSPACE,
    Harness,
    Ping,
    opened,
)


async def test_serve_dispatches_until_stopped(harness: Harness) -> None:
    stop = asyncio.Event()

    async def enqueue(batch: RunMessage) -> None:
        await harness.enqueue(batch)
        if sum(len(b.run_ids) for b in harness.queue) == 2:
            stop.set()

    serving = asyncio.create_task(harness.dispatcher.serve(enqueue, stop))
    await harness.publish(Ping(), Ping())
    await asyncio.wait_for(serving, 5)

    assert sorted(r for b in harness.queue for r in b.run_ids) == sorted(await harness.runs())


async def test_serve_survives_a_failing_pass(harness: Harness) -> None:
    stop = asyncio.Event()
    calls = 0

    async def enqueue_then_stop(batch: RunMessage) -> None:
        nonlocal calls
        calls += 1
        stop.set()

    original = harness.rules.storage.due_runs
    failures = 0

    async def flaky_due_runs(**kwargs: object) -> object:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise ConnectionError("database restarting")
        return await original(**kwargs)  # type: ignore[arg-type]

    await harness.publish(Ping())
    harness.rules.storage.due_runs = flaky_due_runs  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(harness.dispatcher.serve(enqueue_then_stop, stop), 10)
    finally:
        del harness.rules.storage.due_runs

    assert failures == 1
    assert calls == 1


@pytest.fixture
async def unordered(tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness whose application has no rule ordered by scope."""
    settings = Settings(
        home=tmp_path,
        database_url=f"sqlite+aiosqlite:///{tmp_path}/relayr.db",
        requeue_after_s=REQUEUE_AFTER_S,
        fair_messages=FAIR_OFF,
        turn_grace_s=0,
    )
    async with opened(settings, RULES[:1]) as harness:
        yield harness


async def test_runs_it_fired_are_enqueued_without_reading_every_due_run(
    unordered: Harness,
) -> None:
    """The due list is read every DUE_READ_INTERVAL_S; a run that comes due meanwhile waits
    for that read, a run a pass fires does not."""
    harness = unordered
    reads = 0
    original = harness.rules.storage.due_runs

    async def counted(**kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await original(**kwargs)

    harness.rules.storage.due_runs = counted  # type: ignore[method-assign]
    try:
        await harness.publish(Ping(mode="fail"), Ping())
        first, [failing, other] = await harness.dispatch()
        [retrying, done] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [failing, other])
        await harness.publish(Ping(), Ping())
        second, fired = await harness.dispatch()
        harness.later.ahead += BACKOFF
        _, early = await harness.dispatch()
        harness.clock.now += DUE_READ_INTERVAL_S
        fourth, late = await harness.dispatch()
    finally:
        del harness.rules.storage.due_runs

    assert (retrying.outcome, done.outcome) == ("retrying", "succeeded")
    assert (first.enqueued, second.enqueued, len(fired)) == (2, 2, 2)
    assert early == []
    assert late == [failing]
    assert fourth.waiting == 2
    assert reads == 2


async def test_a_backlog_past_the_due_limit_is_read_again_at_once(unordered: Harness) -> None:
    """A pass that read as many due runs as it may reads them again the next pass, not only
    DUE_READ_INTERVAL_S later: the queue drains as fast as workers take the runs. (The runs
    are fired by a pass whose queue refused them: a pass enqueues the runs it fires itself,
    past the list's end.)"""
    harness = unordered
    dispatcher = Dispatcher(
        harness.runtime, monotonic=harness.clock, limit=2, queue_depth=harness.queue_depth
    )
    await harness.publish(*(Ping() for _ in range(5)))

    async def refusing(batch: RunMessage) -> None:
        raise ConnectionError("broker down")

    assert (await dispatcher.pass_once(refusing)).failed == 5
    enqueued: list[list[str]] = []
    for _ in range(3):
        harness.queue.clear()
        await dispatcher.pass_once(harness.enqueue)
        enqueued.append([run_id for batch in harness.queue for run_id in batch.run_ids])
        await harness.take(enqueued[-1])

    assert [len(run_ids) for run_ids in enqueued] == [2, 2, 1]
    assert sorted(r for run_ids in enqueued for r in run_ids) == sorted(await harness.runs())


async def test_a_run_taken_during_the_pass_that_fired_it_is_not_enqueued_again(
    harness: Harness,
) -> None:
    """A pass hands out what it fired before it goes on; a worker that takes the message and
    ends the run before the pass reads the due list leaves the pass's copy of the run stale,
    which must not go out again (every storage; its rules order some runs, so the pass reads
    the due list)."""
    assert await _fired_and_taken_at_once(harness) == 1


async def test_a_run_taken_during_the_pass_that_fired_it_is_not_enqueued_again_unread(
    unordered: Harness,
) -> None:
    """The same where the pass does not read the due list, but learns from the change that
    the message was taken (no rule orders runs)."""
    assert await _fired_and_taken_at_once(unordered) == 1


async def _fired_and_taken_at_once(harness: Harness) -> int:
    """Publish one event and pass once, as a worker so quick that it runs each message as it
    is handed out; how many times the run went out."""
    await harness.dispatch()  # the first pass reads the due list: nothing is due yet
    sent: list[str] = []

    async def taken_at_once(batch: RunMessage) -> None:
        sent.extend(batch.run_ids)
        await harness.take(list(batch.run_ids))

    await harness.publish(Ping())
    await harness.dispatcher.pass_once(taken_at_once, Changes(rules={(TENANT, WORKSPACE)}))
    await harness.dispatcher.pass_once(taken_at_once, Changes(rules={(TENANT, WORKSPACE)}))
    assert list((await harness.runs()).values()) == ["succeeded"]
    return len(sent)
