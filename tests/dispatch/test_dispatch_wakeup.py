"""The dispatcher is woken by the store and works in proportion to what changed (memory, SQLite,
PostgreSQL).

A pass given the workspaces that moved touches only those (its reads of heads and its
evaluation transactions are counted on the real storage); a timed pass with nothing moved
touches none; a burst across more workspaces than a pass evaluates is decided over the next
passes; and ``serve``, whose sweep is an hour away, still enqueues an event's run: the feed woke
it. A workspace just decided settles, its further changes decided together, while another
workspace's change passes at once. On SQLite a backlog pauses between its transactions.
"""

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from reflexr import SourceActor
from reflexr.workspace import WorkspaceRef

from relayr.core.run_messages import RunMessage
from relayr.dispatch import dispatcher as dispatcher_module
from relayr.dispatch.changes import Changes
from relayr.dispatch.dispatcher import EVALUATION_BATCH, LONE_BATCH_ENVELOPES, ONE_WRITER_PAUSE_S
from relayr.dispatch.evaluation import BATCH_ENVELOPES
from relayr.execution.executor import execute_runs
from relayr.settings import Settings
from tests.dispatch.dispatch_harness import FAIR_OFF, RULES, Harness, Ping, opened

WAIT_S = 30.0
"""A bound on a run's hand-out once its event committed (milliseconds); it only ends a failing
test."""


@asynccontextmanager
async def woken(database_url: str, tmp_path: Path, **settings: Any) -> AsyncIterator[Harness]:
    """A harness whose sweep is an hour away, with ``settings`` besides."""
    async with opened(
        Settings(
            home=tmp_path,
            database_url=database_url,
            turn_grace_s=0,
            dispatch_sweep_s=3600,
            **{"fair_messages": FAIR_OFF, **settings},
        ),
        RULES[:1],
    ) as harness:
        yield harness


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async with woken(database_url, tmp_path, dispatch_interval_s=0.05) as harness:
        yield harness


class Touched:
    """The workspaces whose head was read or that a transaction locked, on the real storage."""

    def __init__(self) -> None:
        self.workspaces: list[WorkspaceRef] = []


@asynccontextmanager
async def touched(harness: Harness) -> AsyncIterator[Touched]:
    storage: Any = harness.rules.storage
    seen = Touched()
    head_seq, transaction = storage.head_seq, storage.transaction

    async def counted_head(ref: WorkspaceRef) -> int:
        seen.workspaces.append(ref)
        return int(await head_seq(ref))

    def counted_transaction(ref: WorkspaceRef) -> Any:
        seen.workspaces.append(ref)
        return transaction(ref)

    storage.head_seq, storage.transaction = counted_head, counted_transaction
    try:
        yield seen
    finally:
        del storage.head_seq, storage.transaction


async def publish(harness: Harness, workspace: str, count: int = 1) -> None:
    source = await harness.rules.open("acme", workspace, actor=SourceActor(name="test"))
    for _ in range(count):
        await source.publish(Ping())


class Queue:
    def __init__(self) -> None:
        self.sent: list[RunMessage] = []

    async def enqueue(self, batch: RunMessage) -> None:
        self.sent.append(batch)

    def workspaces(self) -> set[str]:
        return {batch.workspace_id for batch in self.sent}


async def test_a_pass_touches_only_the_workspaces_that_moved(harness: Harness) -> None:
    queue = Queue()
    for index in range(20):
        await publish(harness, f"w{index}")
    await harness.dispatcher.pass_once(queue.enqueue)  # the first: a sweep
    await publish(harness, "w7")
    queue.sent.clear()

    async with touched(harness) as seen:
        await harness.dispatcher.pass_once(queue.enqueue, Changes(rules={("acme", "w7")}))
        moved = {ref.workspace_id for ref in seen.workspaces}
        seen.workspaces.clear()
        await harness.dispatcher.pass_once(queue.enqueue, Changes())
        idle = list(seen.workspaces)

    assert moved == {"w7"}
    assert queue.workspaces() == {"w7"}
    assert idle == []


async def test_a_burst_across_many_workspaces_is_decided_in_bounded_passes(
    harness: Harness,
) -> None:
    queue = Queue()
    count = EVALUATION_BATCH + EVALUATION_BATCH // 2
    await harness.dispatcher.pass_once(queue.enqueue)
    for index in range(count):
        await publish(harness, f"b{index}")
    changes = Changes(rules={("acme", f"b{index}") for index in range(count)})

    first = await harness.dispatcher.pass_once(queue.enqueue, changes)
    behind = harness.dispatcher.behind
    second = await harness.dispatcher.pass_once(queue.enqueue, Changes())

    assert (first.firings, second.firings) == (EVALUATION_BATCH, count - EVALUATION_BATCH)
    assert behind
    assert not harness.dispatcher.behind
    assert len(queue.workspaces()) == count


async def test_serve_is_woken_by_the_store_not_by_its_sweep(harness: Harness) -> None:
    """The sweep is an hour away and timed passes evaluate nothing: only the feed can tell the
    dispatcher that the events were published."""
    stop = asyncio.Event()
    queue = Queue()

    async def enqueue(batch: RunMessage) -> None:
        await queue.enqueue(batch)
        if queue.workspaces() >= {"late"}:
            stop.set()

    dispatcher = harness.dispatcher
    passes = 0
    passed = asyncio.Event()
    pass_once = dispatcher.pass_once

    async def counted(enqueue: Any, changes: Changes | None = None) -> Any:
        nonlocal passes
        done = await pass_once(enqueue, changes)
        passes += 1
        if passes >= 2:  # the first pass's sweep is over, and a timed pass after it
            passed.set()
        return done

    dispatcher.pass_once = counted  # type: ignore[method-assign]
    serving = asyncio.create_task(dispatcher.serve(enqueue, stop))
    try:
        await asyncio.wait_for(passed.wait(), WAIT_S)
        await publish(harness, "late")
        await asyncio.wait_for(asyncio.shield(serving), WAIT_S)
    finally:
        stop.set()
        await serving

    assert "late" in queue.workspaces()


class Passes:
    """Counts the passes ``dispatcher`` ends, and says when one did (``ended``)."""

    def __init__(self, dispatcher: Any) -> None:
        self.count = 0
        self.ended = asyncio.Event()
        self._pass_once = dispatcher.pass_once
        dispatcher.pass_once = self._counted

    async def _counted(self, enqueue: Any, changes: Changes | None = None) -> Any:
        done = await self._pass_once(enqueue, changes)
        self.count += 1
        self.ended.set()
        return done


@pytest.fixture
async def held(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness whose dispatcher passes only when woken (no timed pass nor sweep comes during
    a test), settling for no time."""
    async with woken(
        database_url, tmp_path, dispatch_interval_s=3600, dispatch_settle_s=0
    ) as harness:
        yield harness


@dataclass
class Held:
    """A pass held handing out workspace ``busy``'s run (:func:`busy_held`): its counter, and
    the gate that lets the run go."""

    passes: Passes
    gate: asyncio.Event


@asynccontextmanager
async def busy_held(
    harness: Harness, enqueued: Callable[[RunMessage], Awaitable[None]]
) -> AsyncIterator[Held]:
    """``serve`` for the block, its enqueue held on a gate for workspace ``busy`` (the broker
    does not answer) and passing every other message, and busy's once the gate opens, to
    ``enqueued``. Entered once the first pass's sweep is over and busy's run is held; the gate
    opens and ``serve`` stops when the block ends."""
    stop = asyncio.Event()
    gate = asyncio.Event()
    holding = asyncio.Event()

    async def enqueue(batch: RunMessage) -> None:
        if batch.workspace_id == "busy":
            holding.set()
            await gate.wait()
        await enqueued(batch)

    passes = Passes(harness.dispatcher)
    serving = asyncio.create_task(harness.dispatcher.serve(enqueue, stop))
    try:
        async with asyncio.timeout(WAIT_S):
            await passes.ended.wait()  # the first pass's sweep is over
            await publish(harness, "busy")
            await holding.wait()
        yield Held(passes, gate)
    finally:
        gate.set()
        stop.set()
        await serving


async def test_a_new_event_is_decided_while_a_pass_under_way_is_held(held: Harness) -> None:
    """A pass is held handing out one workspace's run (its broker does not answer); an event
    of another workspace, published meanwhile, is decided and its run handed out before the
    held pass ends: a pass under way does not hold a workspace that has nothing waiting."""
    harness = held
    queue = Queue()
    arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def enqueued(batch: RunMessage) -> None:
        await queue.enqueue(batch)
        arrived[batch.workspace_id].set()

    async with busy_held(harness, enqueued) as busy:
        async with asyncio.timeout(WAIT_S):
            await publish(harness, "quiet")
            await arrived["quiet"].wait()
        assert "busy" not in queue.workspaces()
        assert busy.passes.count == 1  # the pass that took "busy" is still held
        busy.gate.set()
        async with asyncio.timeout(WAIT_S):
            await arrived["busy"].wait()
    assert sorted(batch.workspace_id for batch in queue.sent) == ["busy", "quiet"]


async def test_a_workspace_whose_message_is_on_its_way_is_left_to_the_next_pass(
    held: Harness,
) -> None:
    """While a pass is held handing out a workspace's run, that workspace's next event is not
    decided beside the pass (its run's message would overtake the one on its way); another
    workspace's is. The held workspace's next run goes out in the next pass, after the first."""
    harness = held
    queue = Queue()
    quiet = asyncio.Event()
    both = asyncio.Event()

    async def enqueued(batch: RunMessage) -> None:
        await queue.enqueue(batch)
        if batch.workspace_id == "quiet":
            quiet.set()
        if [b.workspace_id for b in queue.sent].count("busy") == 2:
            both.set()

    async with busy_held(harness, enqueued) as busy:
        async with asyncio.timeout(WAIT_S):
            await publish(harness, "busy")
            await publish(harness, "quiet")
            await quiet.wait()
        assert [batch.workspace_id for batch in queue.sent] == ["quiet"]
        busy.gate.set()
        async with asyncio.timeout(WAIT_S):
            await both.wait()
    first, second = [batch.run_ids for batch in queue.sent if batch.workspace_id == "busy"]
    runs = {run.id: run for run in await harness.rules.storage.runs(WorkspaceRef("acme", "busy"))}
    assert runs[first[0]].fired_seq < runs[second[0]].fired_seq  # the log's order


async def test_a_workspace_whose_message_was_taken_goes_ahead_again_beside_a_pass(
    database_url: str, tmp_path: Path
) -> None:
    """Fairness on (two messages of a workspace in the broker at once): while a pass is held,
    a quiet workspace's run goes out ahead, a worker takes it, and the workspace's next run,
    decided beside the same pass, goes out ahead too: the dispatcher learns of the take from
    the workspace's log, not from a pass that has not come (else it would count the first
    message waiting, and send the next behind a backlog's)."""
    quiet: list[RunMessage] = []
    arrived = asyncio.Condition()

    async def enqueued(batch: RunMessage) -> None:
        async with arrived:
            quiet.append(batch)
            arrived.notify_all()

    async with (
        woken(
            database_url,
            tmp_path,
            dispatch_interval_s=3600,
            dispatch_settle_s=0,
            fair_messages=2,
        ) as harness,
        busy_held(harness, enqueued) as busy,
    ):
        async with asyncio.timeout(WAIT_S):
            for sent in (1, 2):
                await publish(harness, "quiet")
                async with arrived:
                    await arrived.wait_for(lambda sent=sent: len(quiet) == sent)
                await execute_runs(harness.runtime, "acme", "quiet", quiet[-1].run_ids)
        assert busy.passes.count == 1  # the pass that took "busy" is still held
    assert [(batch.workspace_id, batch.behind) for batch in quiet[:2]] == [
        ("quiet", False),
        ("quiet", False),
    ]


async def test_a_pass_learns_a_workspaces_message_was_taken_before_it_sends_the_next(
    database_url: str, tmp_path: Path
) -> None:
    """The same within a pass: a change that says a worker took a workspace's message and one
    that fired its next run, given to one pass, send that run ahead, not behind the first."""
    workspace = ("acme", "quiet")
    sent: list[RunMessage] = []

    async def enqueue(batch: RunMessage) -> None:
        sent.append(batch)

    async with woken(database_url, tmp_path, fair_messages=2) as harness:
        harness.depth = 1  # another workspace's message waits: the broker is not past this one
        for _ in range(2):
            await publish(harness, "quiet")
            await harness.dispatcher.pass_once(enqueue, Changes(rules={workspace}))
            await execute_runs(harness.runtime, *workspace, sent[-1].run_ids)
    assert [batch.behind for batch in sent] == [False, False]


@pytest.fixture
async def settling(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness whose dispatcher passes only when woken: no timed pass nor sweep comes during
    a test, and a workspace it decided settles for 0.2 s on the test's clock."""
    async with woken(
        database_url, tmp_path, dispatch_interval_s=3600, dispatch_settle_s=0.2
    ) as harness:
        yield harness


async def test_a_workspace_just_decided_settles_while_another_passes_at_once(
    settling: Harness,
) -> None:
    """A burst's workspace is decided once per ``dispatch_settle_s``, its changes meanwhile
    gathered into one pass; a change of another workspace is decided at once, alone."""
    harness = settling
    stop = asyncio.Event()
    queue = Queue()
    passes: list[set[str]] = []
    passed = asyncio.Event()
    pass_once = harness.dispatcher.pass_once

    async def recorded(enqueue: Any, changes: Changes | None = None) -> Any:
        done = await pass_once(enqueue, changes)
        passes.append({w for _, w in changes.rules} if changes is not None else set())
        passed.set()
        return done

    async def runs_of(workspace: str, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while sum(len(b.run_ids) for b in queue.sent if b.workspace_id == workspace) < count:
                passed.clear()
                await passed.wait()

    harness.dispatcher.pass_once = recorded  # type: ignore[method-assign]
    serving = asyncio.create_task(harness.dispatcher.serve(queue.enqueue, stop))
    try:
        async with asyncio.timeout(WAIT_S):
            await passed.wait()  # the first pass: a sweep
        await publish(harness, "busy")
        await runs_of("busy", 1)
        await publish(harness, "busy", count=2)  # the clock stands: busy has not settled
        await publish(harness, "quiet")
        await runs_of("quiet", 1)
        held = sum(len(b.run_ids) for b in queue.sent if b.workspace_id == "busy")
        decided = len(passes)
        harness.clock.now += 0.2
        await runs_of("busy", 3)
    finally:
        stop.set()
        await serving

    assert held == 1
    assert passes[1:decided] == [{"busy"}, {"quiet"}]
    # busy's two events in one pass, with what the passes' own commits moved meanwhile
    assert passes[decided] >= {"busy"}
    assert len(passes) == decided + 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_a_backlog_pauses_between_its_transactions_for_the_workers(
    held: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite lets one process write at a time, and a worker waiting for the lock sleeps up to
    100 ms between tries: ``serve`` leaves ONE_WRITER_PAUSE_S at least between a backlog's
    evaluation transactions, so the workers get the lock between them; every run still goes
    out once."""
    flood = BATCH_ENVELOPES + LONE_BATCH_ENVELOPES + 1
    spans: list[tuple[float, float]] = []
    evaluate_each = dispatcher_module.evaluate_each

    async def timed(rules: Any, refs: list[WorkspaceRef], **options: Any) -> Any:
        began = time.monotonic()
        evaluated = await evaluate_each(rules, refs, **options)
        if any(ref.workspace_id == "flood" for ref in refs):
            spans.append((began, time.monotonic()))
        return evaluated

    monkeypatch.setattr(dispatcher_module, "evaluate_each", timed)
    await publish(held, "flood", flood)
    stop = asyncio.Event()
    queue = Queue()

    async def enqueue(batch: RunMessage) -> None:
        await queue.enqueue(batch)
        if sum(len(sent.run_ids) for sent in queue.sent) >= flood:
            stop.set()

    serving = asyncio.create_task(held.dispatcher.serve(enqueue, stop))
    try:
        await asyncio.wait_for(asyncio.shield(serving), WAIT_S)
    finally:
        stop.set()
        await serving

    handed = [run_id for sent in queue.sent for run_id in sent.run_ids]
    assert len(handed) == len(set(handed)) == flood
    assert len(spans) >= 2  # a transaction reads LONE_BATCH_ENVELOPES envelopes at most
    gaps = [began - ended for (_, ended), (began, _) in itertools.pairwise(spans)]
    assert min(gaps) >= ONE_WRITER_PAUSE_S, gaps


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_stopping_ends_a_backlogs_pause(
    held: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dispatcher told to stop during the pause between a backlog's transactions stops then,
    not when the pause would have ended (an hour here)."""
    stop = asyncio.Event()
    evaluate_each = dispatcher_module.evaluate_each

    async def stopping(rules: Any, refs: list[WorkspaceRef], **options: Any) -> Any:
        evaluated = await evaluate_each(rules, refs, **options)
        if evaluated.behind:
            stop.set()
        return evaluated

    monkeypatch.setattr(dispatcher_module, "evaluate_each", stopping)
    monkeypatch.setattr(dispatcher_module, "ONE_WRITER_PAUSE_S", 3600.0)
    await publish(held, "flood", LONE_BATCH_ENVELOPES + 1)
    serving = asyncio.create_task(held.dispatcher.serve(Queue().enqueue, stop))
    await asyncio.wait_for(serving, WAIT_S)

    assert stop.is_set()
