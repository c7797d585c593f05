"""The follower on real storage (in memory, SQLite, PostgreSQL), with runs executed in-process.

Each test drives the whole loop in one process (:class:`tests.follow.follow_world.World`), as the
dispatcher and a worker would. What it checks is what the stores hold afterwards: the bridged
events in reflexr's log (once each, with their kind, chain and depth), the runs the rules made,
the notices they posted, the followers' cursors and dead letters.
"""

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import ExternalAgentActor
from artifactr.core import MessagePosted as ArtifactrMessagePosted
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import event

from relayr.core.run_messages import RunMessage
from relayr.dispatch.changes import Changes, feed_for
from relayr.dispatch.dispatcher import EVALUATION_BATCH, Dispatcher
from relayr.follow.events import FOLLOWER, MessagePosted, TurnEnded
from relayr.follow.follower import Followers
from relayr.follow.projections import PROJECTIONS, Projection, Source
from relayr.follow.reports import CAUSE_MISSING, PROJECTION_FAILED, Followed
from relayr.ledger.port import WorkspaceKey
from relayr.observe import telemetry
from tests.follow.follow_app import MAX_DEPTH, Asked, Looped
from tests.follow.follow_world import KEY, PERSON, TENANT, WORKSPACE, World, opened
from tests.services import SQL_STORAGES, STORAGES, storage_url

BRIDGED_BY_A_QUESTION_AND_THANKS = 6
"""What :class:`Asked` and a person's reply bridge: the rule's question, the agent's answer, its
turn's end, the two notices the rules post about them, and the person's message."""


@pytest.fixture(params=STORAGES)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    async with opened(storage_url(request, tmp_path), tmp_path) as world:
        yield world


# ─── once each, with the kind ─────────────────────────────────────────────────


async def test_an_agent_reply_reaches_a_rule_once_as_a_message(world: World) -> None:
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="is the api up?"))

    await world.settle()

    replies = [
        envelope
        for envelope in await world.bridged()
        if isinstance(envelope.event, MessagePosted) and envelope.event.author_kind == "agent"
    ]
    assert [(e.event.kind, e.event.content) for e in replies] == [
        ("message", "answer: is the api up?")
    ]
    assert replies[0].actor == FOLLOWER
    assert await world.notices("follow:answered") == ["answered: answer: is the api up?"]
    runs = await (await world.rules()).runs(rule="follow:answered")
    assert [run.status for run in runs] == ["succeeded"]


async def test_a_turn_started_by_a_rule_continues_its_chain(world: World) -> None:
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="status?"))

    await world.settle()

    rules = await world.rules()
    [ask] = await rules.runs(rule="follow:ask")
    [question] = [
        e
        for e in await world.bridged()
        if isinstance(e.event, MessagePosted) and e.event.content == "question: status?"
    ]
    [ended] = [e for e in await world.bridged() if isinstance(e.event, TurnEnded)]
    assert isinstance(ended.event, TurnEnded)
    assert ended.event.outcome == "completed"
    assert ended.event.message_ids == (ask.output["message_id"],)  # type: ignore[index]
    for envelope in (question, ended):
        assert envelope.causation is not None
        assert (envelope.causation.run_id, envelope.depth) == (ask.id, 1)
        assert envelope.correlation_id == ask.correlation_id
    [answered] = await rules.runs(rule="follow:answered")
    [turn_ended] = await rules.runs(rule="follow:turn-ended")
    assert (answered.correlation_id, answered.depth) == (ask.correlation_id, 1)
    assert (turn_ended.correlation_id, turn_ended.depth) == (ask.correlation_id, 1)


async def test_a_rule_that_answers_its_own_notices_stops_at_the_depth_limit(
    world: World,
) -> None:
    thread = await world.thread()
    await world.publish(Looped(thread_id=thread))

    await world.settle()

    echoes = await world.notices("loop:start") + await world.notices("loop:echo")
    assert echoes == [f"echo at depth {depth}" for depth in range(MAX_DEPTH)]
    dead = await (await world.rules()).dead_letters(rule="loop:echo")
    assert len(dead) == 1
    assert f"beyond the limit of {MAX_DEPTH}" in dead[0].error


async def test_what_people_write_starts_chains_of_its_own(world: World) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "hello")
    unnamed = world.follower(holder="follower-2", tenants=())

    assert (await unnamed.follow_all()).workspaces == 0  # a tenant reflexr does not know yet
    await world.settle()

    [posted] = await world.bridged()
    assert isinstance(posted.event, MessagePosted)
    assert (posted.event.author, posted.event.kind) == ("user:alice", "message")
    assert posted.causation is None
    assert posted.correlation_id == posted.id


async def empty_queue() -> int:
    """A broker queue that holds nothing."""
    return 0


async def test_the_dispatcher_follows_at_the_start_of_each_pass(world: World) -> None:
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="ping"))
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "hello")

    dispatcher = Dispatcher(world.runtime, queue_depth=empty_queue)
    queue: list[RunMessage] = []

    async def enqueue(batch: RunMessage) -> None:
        queue.append(batch)

    done = await dispatcher.pass_once(enqueue)

    assert (done.bridged, done.firings) == (1, 1)
    assert [e.event.content for e in await world.bridged()] == ["hello"]  # type: ignore[attr-defined]


# ─── a follower stopped between its publish and its cursor ───────────────────


async def test_a_batch_published_again_after_a_crash_is_published_once(world: World) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    for text in ("one", "two", "three"):
        await handle.post_message(thread, text)

    async def crash(workspace: WorkspaceKey, seqs: Sequence[int]) -> None:
        raise RuntimeError("the follower died after its publish")

    world.hooks.append(crash)
    first = await world.followers.follow_all()
    world.hooks.clear()
    restarted = world.follower(holder="follower-1")
    second = await restarted.follow_all()

    assert (first.failed, first.bridged) == (1, 0)
    assert (second.bridged, second.duplicates) == (0, 3)
    assert [e.event.content for e in await world.bridged()] == ["one", "two", "three"]  # type: ignore[attr-defined]
    assert (await restarted.follow_all()).read == 0


# ─── dead letters ─────────────────────────────────────────────────────────────


def _refusing(content: str) -> Projection:
    def project(source: Source) -> Any:
        event = source.envelope.event
        if isinstance(event, ArtifactrMessagePosted) and event.content == content:
            raise ValueError(f"cannot bridge {content!r}")
        return PROJECTIONS["message_posted"](source)

    return project


async def test_a_projection_that_fails_dead_letters_its_envelope_and_the_log_goes_on(
    world: World,
) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "boom")
    await handle.post_message(thread, "fine")
    failing = world.follower(holder="follower-2", projections={"message_posted": _refusing("boom")})

    done = await failing.follow_all()

    assert (done.bridged, done.dead) == (1, 1)
    [letter] = await world.store.dead_letters(KEY)
    assert (letter.reason, letter.event_type, letter.tries) == (
        PROJECTION_FAILED,
        "message_posted",
        1,
    )
    assert "cannot bridge 'boom'" in letter.error
    [position] = await world.store.positions()
    assert position.cursor == await handle.head_seq()

    again = await failing.replay(KEY)
    assert (again.bridged, [f.reason for f in again.failed]) == ((), [PROJECTION_FAILED])
    fixed = await world.follower(holder="follower-2").replay(KEY, [letter.envelope_id])

    assert fixed.bridged == (letter.envelope_id,)
    assert [e.event.content for e in await world.bridged()] == ["fine", "boom"]  # type: ignore[attr-defined]
    assert await world.store.dead_letters(KEY) == []
    [replayed] = await world.store.dead_letters(KEY, replayed=True)
    assert replayed.tries == 2
    assert replayed.replayed_at is not None
    assert (await failing.replay(KEY, [letter.envelope_id])).unknown == (letter.envelope_id,)


def _nothing(source: Source) -> None:
    """A projection that bridges nothing (as one does for what it does not care about)."""
    return None


async def test_a_replay_that_publishes_nothing_leaves_its_letters_waiting(world: World) -> None:
    """A letter whose projection now returns nothing, and one whose envelope artifactr's log
    does not give back, are reported apart and stay waiting; only what was published is
    marked replayed."""
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "boom")
    failing = world.follower(holder="follower-2", projections={"message_posted": _refusing("boom")})
    assert (await failing.follow_all()).dead == 1
    [letter] = await world.store.dead_letters(KEY)
    # a letter whose seq holds another envelope: its own is not there to read back
    ghost = replace(letter, envelope_id="env-not-in-the-log", seq=1)
    assert await world.store.advance(
        KEY, "follower-2", letter.seq, until=datetime.now(UTC) + timedelta(hours=1), dead=[ghost]
    )

    replayed = await world.follower(
        holder="follower-3", projections={"message_posted": _nothing}
    ).replay(KEY)

    assert (replayed.bridged, replayed.failed, replayed.unknown) == ((), (), ())
    assert replayed.skipped == (letter.envelope_id,)
    assert replayed.not_found == (ghost.envelope_id,)
    assert {d.envelope_id for d in await world.store.dead_letters(KEY)} == {
        letter.envelope_id,
        ghost.envelope_id,
    }
    assert await world.bridged() == []

    fixed = await world.follower(holder="follower-3").replay(KEY)

    assert fixed.bridged == (letter.envelope_id,)
    assert fixed.not_found == (ghost.envelope_id,)
    assert [d.envelope_id for d in await world.store.dead_letters(KEY)] == [ghost.envelope_id]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """relayr's spans on, exported to memory by a provider of the test's own."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.enable(provider)
    try:
        yield exporter
    finally:
        telemetry.disable()
        provider.shutdown()


async def test_a_replay_ends_the_spans_of_what_it_bridged(
    world: World, spans: InMemorySpanExporter
) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "boom")
    failing = world.follower(holder="follower-2", projections={"message_posted": _refusing("boom")})
    assert (await failing.follow_all()).dead == 1
    [letter] = await world.store.dead_letters(KEY)
    spans.clear()

    fixed = await world.follower(holder="follower-3").replay(KEY)

    assert fixed.bridged == (letter.envelope_id,)
    ended = [span for span in spans.get_finished_spans() if span.name == "relayr.bridge"]
    assert [(span.attributes or {}).get(telemetry.EVENT_ID) for span in ended] == [
        letter.envelope_id
    ]


async def test_a_rule_write_without_a_cause_is_dead_lettered(world: World) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    ghost = handle.as_actor(ExternalAgentActor(client_id="reflexr:ops:ghost", name="ops:ghost"))
    await ghost.post_message(thread, "who wrote this?", kind="notice")

    done = await world.followers.follow_all()

    assert (done.bridged, done.dead) == (0, 1)
    [letter] = await world.store.dead_letters(KEY)
    assert letter.reason == CAUSE_MISSING
    assert await world.bridged() == []


# ─── one follower per workspace ───────────────────────────────────────────────


async def test_one_follower_per_workspace_at_a_time(world: World) -> None:
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "first")
    other = world.follower(holder="follower-2")

    held = await world.followers.follow_all()
    await handle.post_message(thread, "second")
    refused = await other.follow_all()
    await world.followers.release()
    taken = await other.follow_all()

    assert (held.workspaces, held.bridged) == (1, 1)
    assert (refused.workspaces, refused.elsewhere, refused.read) == (0, 1, 0)
    assert (taken.workspaces, taken.bridged) == (1, 1)
    [position] = await world.store.positions()
    assert position.holder == "follower-2"


# ─── what a pass costs ────────────────────────────────────────────────────────


async def ignore(batch: RunMessage) -> None:
    """An enqueue that drops what it is given: these tests count what a pass reads."""


@pytest.mark.parametrize("world", SQL_STORAGES, indirect=True)
async def test_a_pass_costs_a_handful_of_transactions(world: World) -> None:
    engines = world.runtime.application.engines
    # a still clock: no pass lists the workspaces again or renews a lease, however slow
    followers = world.follower(monotonic=lambda: 1000.0)
    thread = await world.thread()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await followers.follow_all()
    begun: list[object] = []
    event.listen(engines[0].sync_engine, "begin", lambda connection: begun.append(connection))

    quiet = await followers.follow_all()
    quiet_count = len(begun)
    for index in range(20):
        await handle.post_message(thread, f"message {index}")
    begun.clear()
    busy = await followers.follow_all()

    assert (quiet.read, quiet_count) == (0, 1)
    assert busy.bridged == 20
    assert len(begun) <= 4, begun  # the read, the publish, the cursor (+ a lease)


@pytest.mark.parametrize("world", SQL_STORAGES, indirect=True)
async def test_a_sweep_follows_no_workspace_again_that_a_later_pass_followed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep queues every artifactr workspace whose head it has not seen followed; those past
    the first batch are followed in the next passes, and the next sweep, with nothing new,
    follows none of them again."""
    application = world.runtime.application
    workspaces = [f"w{number}" for number in range(EVALUATION_BATCH + 3)]
    for workspace in workspaces:
        handle = await application.artifacts.open(TENANT, workspace, actor=PERSON)
        await handle.create_thread("quiet")
    await world.publish(Asked(thread_id=await world.thread(), text="ping"))
    followed: list[WorkspaceKey] = []
    follow = Followers.follow

    async def counted(self: Followers, key: WorkspaceKey) -> Followed:
        followed.append(key)
        return await follow(self, key)

    monkeypatch.setattr(Followers, "follow", counted)
    feed = feed_for(application.engines, application.rules.storage)
    await feed.start()
    try:
        dispatcher = Dispatcher(world.runtime, queue_depth=empty_queue, feed=feed)
        await dispatcher.pass_once(ignore)  # a sweep: the first batch
        while dispatcher.behind:
            await dispatcher.pass_once(ignore, Changes())
        assert {key.workspace_id for key in followed} >= set(workspaces)
        followed.clear()
        await dispatcher.pass_once(ignore)  # a sweep, nothing new anywhere
    finally:
        await feed.aclose()
    assert followed == []


@pytest.mark.parametrize("world", SQL_STORAGES, indirect=True)
async def test_a_pass_over_rules_writes_and_turns_reads_their_causes_at_once(
    world: World,
) -> None:
    engines = world.runtime.application.engines
    # a still clock: no pass lists the workspaces again or renews a lease, however slow
    followers = world.follower(monotonic=lambda: 1000.0)
    threads = [await world.thread() for _ in range(5)]
    await followers.follow_all()
    await world.publish(*(Asked(thread_id=thread, text="status?") for thread in threads))
    await world.settle(follow=False)  # five questions sent, five turns ended, nothing bridged
    begun: list[object] = []
    event.listen(engines[0].sync_engine, "begin", lambda connection: begun.append(connection))

    busy = await followers.follow_all()

    assert busy.bridged == 15  # each thread: the question, the answer, the turn's end
    assert busy.dead == 0
    assert len(begun) <= 5, begun  # the read, the causes, the publish, the cursor (+ a lease)


# ─── the follower appends as reflexr's publish does ──────────────────────────


async def test_a_batch_is_logged_as_publish_would_log_its_events(world: World) -> None:
    """The follower's append and reflexr's ``publish`` (with the same causation, as
    ``caused_by`` stamps it) log the same envelope: for an event that starts a chain and for
    one that continues a rule's."""
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="status?"))
    await world.settle()
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    await handle.post_message(thread, "thanks")
    await world.settle()
    bridged = await world.bridged()
    rules = world.runtime.application.rules
    copy = await rules.open(TENANT, "copy", actor=FOLLOWER)

    assert len(bridged) == BRIDGED_BY_A_QUESTION_AND_THANKS, bridged
    assert {envelope.causation is None for envelope in bridged} == {True, False}
    for envelope in bridged:
        publisher = (
            copy
            if envelope.causation is None
            else copy.caused_by(envelope.causation, correlation_id=envelope.correlation_id)
        )
        published = await publisher.publish(envelope.event, id=envelope.id)
        again = published.envelope
        assert (again.id, again.actor, again.causation, again.event) == (
            envelope.id,
            envelope.actor,
            envelope.causation,
            envelope.event,
        )
        if envelope.causation is None:
            assert again.correlation_id == envelope.correlation_id == envelope.id


async def test_a_new_workspace_s_rules_start_at_its_first_bridged_event(world: World) -> None:
    handle = await world.runtime.application.artifacts.open(TENANT, "fresh", actor=PERSON)
    thread = (await handle.create_thread("new")).id
    await handle.post_message(thread, "first words")

    done = await world.followers.follow(WorkspaceKey(TENANT, "fresh"))

    fresh = await world.runtime.application.rules.open(TENANT, "fresh", actor=FOLLOWER)
    progress = await fresh.rule_progress()
    assert done.bridged == 1
    assert {name: p.cursor for name, p in progress.items()} == {
        name: 0 for name in world.runtime.application.rules.rules
    }
