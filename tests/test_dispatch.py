"""The dispatcher on real reflexr storage: each due run enqueued once per attempt.

The queue here is a list of messages: what the dispatcher promises is which ids it hands over,
together, and when. A worker taking a message is a run executed (so it leaves the due list), as
it would be. ``requeue_after_s`` is measured on a clock the test moves, so "the message was
lost" needs no waiting, and so is the rules' time (:class:`Later`), so a retry comes due when
the test says, not when a second has passed.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.core import start
from reflexr.workspace import Reaction, WorkspaceRef, run_lease
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.application import Application, open_storage
from relayr.batch import MAX_BATCH_RUNS, RunBatch
from relayr.bridge import Bridge
from relayr.core.allowlist import Allowlists
from relayr.dispatch import DUE_READ_INTERVAL_S, Dispatcher, DispatchPass
from relayr.executor import execute_run, execute_runs
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import STORAGES, storage_url

TENANT, WORKSPACE = "acme", "ops"
REF = WorkspaceRef(TENANT, WORKSPACE)
REQUEUE_AFTER_S = 60.0
BACKOFF = timedelta(hours=1)
"""A retry's wait: no pass takes that long, so a retry is due only once the test moves
:class:`Later` past it."""


class DispatchTestEvent(Event, abstract=True, event_namespace="dispatchtest"):
    pass


class Ping(DispatchTestEvent, name="ping"):
    mode: str = "ok"


class Step(DispatchTestEvent, name="step"):
    key: str


RULES = [
    Rule(
        name="dispatch:ping",
        when=on(Ping),
        then=run("act"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=3, backoff=BACKOFF),
    ),
    Rule(
        name="dispatch:step",
        when=on(Step),
        scope=by(F.key),
        then=run("act"),
        ordering="scope",
        start="beginning",
    ),
]


async def act(reaction: Reaction[Bridge]) -> None:
    mode = reaction.events[-1].data.get("mode", "ok")
    if mode == "fail":
        raise RuntimeError("flaky")
    if mode == "wait":
        gates = reaction.deps.app
        assert isinstance(gates, Gates)
        gates.started.set()
        await gates.release.wait()


class Clock:
    """The monotonic clock ``requeue_after_s`` is measured on, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Later:
    """The rules' clock: the time now, plus what the test moved it by."""

    def __init__(self) -> None:
        self.ahead = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.ahead


class Harness:
    def __init__(self, runtime: Runtime, later: Later) -> None:
        self.runtime = runtime
        self.rules = runtime.application.rules
        self.later = later
        self.clock = Clock()
        self.depth: int | None = None
        """What the broker says waits in the queue; None: it cannot say."""
        self.dispatcher = Dispatcher(runtime, monotonic=self.clock, queue_depth=self.queue_depth)
        self.queue: list[RunBatch] = []
        gates = runtime.application.app_deps
        assert isinstance(gates, Gates)
        self.gates = gates

    async def queue_depth(self) -> int | None:
        return self.depth

    async def enqueue(self, batch: RunBatch) -> None:
        assert (batch.tenant_id, batch.workspace_id) == (TENANT, WORKSPACE)
        self.queue.append(batch)

    async def publish(self, *events: Event) -> None:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        for event in events:
            await source.publish(event)

    async def dispatch(self) -> tuple[DispatchPass, list[str]]:
        """One pass; returns it and the ids it enqueued."""
        self.queue.clear()
        done = await self.dispatcher.pass_once(self.enqueue)
        return done, [run_id for batch in self.queue for run_id in batch.run_ids]

    async def take(self, run_ids: list[str]) -> None:
        """What a worker does with a message it takes: execute its runs."""
        await execute_runs(self.runtime, TENANT, WORKSPACE, run_ids)

    async def runs(self) -> dict[str, str]:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        return {r.id: r.status for r in await source.runs(limit=1000)}


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@asynccontextmanager
async def opened(settings: Settings, rules: list[Rule]) -> AsyncIterator[Harness]:
    """A dispatcher's runtime on ``settings``' storage, running ``rules`` on the test's clock;
    closed after the block."""
    storage = await open_storage(settings)
    later = Later()
    application = Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=[Ping, Step], rules=rules, clock=later),
        actions={"act": act},
        app_deps=Gates(),
        engines=storage.engines,
    )
    runtime = await Runtime.start(
        settings, role="dispatcher", application=application, allowlists=Allowlists.empty
    )
    try:
        yield Harness(runtime, later)
    finally:
        await runtime.aclose()


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    settings = Settings(
        home=tmp_path,
        database_url=database_url,
        requeue_after_s=REQUEUE_AFTER_S,
        dispatch_interval_s=0.05,
        turn_grace_s=0,
    )
    async with opened(settings, RULES) as harness:
        yield harness


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
    [(2, [1, 1]), (10, [3, 3, 3, 1]), (40, [10] * 4), (100, [MAX_BATCH_RUNS] * 5)],
)
async def test_the_due_runs_of_a_workspace_share_messages(
    harness: Harness, runs: int, sizes: list[int]
) -> None:
    """A burst goes in few messages, yet in several, so several workers share it."""
    await harness.publish(*(Ping() for _ in range(runs)))

    done, enqueued = await harness.dispatch()

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


async def test_a_message_the_queue_went_past_is_sent_again_after_requeue_after_s(
    harness: Harness,
) -> None:
    """A worker took a later message, yet this one's run is still due: the broker lost it."""
    await harness.publish(Ping())
    _, [lost] = await harness.dispatch()
    await harness.publish(Ping())
    _, [later] = await harness.dispatch()
    await harness.take([later])

    noticed, _ = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S - 1
    _, early = await harness.dispatch()
    harness.clock.now += 1
    done, late = await harness.dispatch()
    _, after = await harness.dispatch()

    assert noticed.waiting == 1
    assert early == []
    assert late == [lost]
    assert (done.enqueued, done.again) == (1, 1)
    assert after == []


async def test_a_message_waiting_behind_others_is_never_copied(harness: Harness) -> None:
    """However long the queue is, and however long a run waits in it."""
    await harness.publish(*(Ping() for _ in range(30)))
    _, enqueued = await harness.dispatch()
    harness.depth = len(harness.queue)

    copies = []
    for _ in range(20):
        harness.clock.now += REQUEUE_AFTER_S
        _, again = await harness.dispatch()
        copies += again
    await harness.take(enqueued[:8])
    harness.depth -= 1
    for _ in range(5):
        harness.clock.now += REQUEUE_AFTER_S
        _, again = await harness.dispatch()
        copies += again

    assert copies == []


async def test_the_oldest_message_of_an_empty_queue_is_sent_again(harness: Harness) -> None:
    """Nothing was sent after it, and the broker holds nothing: it is gone."""
    await harness.publish(Ping())
    _, [run_id] = await harness.dispatch()
    harness.depth = 1
    harness.clock.now += REQUEUE_AFTER_S * 5
    _, waiting = await harness.dispatch()
    harness.depth = 0

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S
    _, late = await harness.dispatch()

    assert waiting == []
    assert noticed == []
    assert late == [run_id]


async def test_without_a_queue_depth_the_oldest_message_is_sent_again(harness: Harness) -> None:
    await harness.publish(Ping())
    _, [run_id] = await harness.dispatch()

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S - 1
    _, early = await harness.dispatch()
    harness.clock.now += 1
    _, late = await harness.dispatch()

    assert noticed == early == []
    assert late == [run_id]


async def test_a_run_of_a_taken_message_still_due_is_sent_again(harness: Harness) -> None:
    """A worker took the message but did not claim this run (its storage failed)."""
    await harness.publish(*(Ping() for _ in range(5)))
    await harness.dispatch()
    [(first, second), *waiting] = [batch.run_ids for batch in harness.queue]
    harness.depth = len(waiting)
    await harness.take([first])

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S
    _, late = await harness.dispatch()

    assert noticed == []
    assert late == [second]


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


async def test_a_run_the_queue_refused_is_enqueued_by_the_next_pass(harness: Harness) -> None:
    await harness.publish(Ping())
    refused: list[str] = []

    async def broken(batch: RunBatch) -> None:
        refused.extend(batch.run_ids)
        raise ConnectionError("broker down")

    failed = await harness.dispatcher.pass_once(broken)
    done, enqueued = await harness.dispatch()

    assert failed.failed == 1
    assert failed.enqueued == 0
    assert enqueued == refused
    assert done.enqueued == 1


async def test_serve_dispatches_until_stopped(harness: Harness) -> None:
    stop = asyncio.Event()

    async def enqueue(batch: RunBatch) -> None:
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

    async def enqueue_then_stop(batch: RunBatch) -> None:
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
    DUE_READ_INTERVAL_S later: the queue drains as fast as workers take the runs."""
    harness = unordered
    dispatcher = Dispatcher(
        harness.runtime, monotonic=harness.clock, limit=2, queue_depth=harness.queue_depth
    )
    await harness.publish(*(Ping() for _ in range(5)))

    enqueued: list[list[str]] = []
    for _ in range(3):
        harness.queue.clear()
        await dispatcher.pass_once(harness.enqueue)
        enqueued.append([run_id for batch in harness.queue for run_id in batch.run_ids])
        await harness.take(enqueued[-1])

    assert [len(run_ids) for run_ids in enqueued] == [2, 2, 1]
    assert sorted(r for run_ids in enqueued for r in run_ids) == sorted(await harness.runs())
