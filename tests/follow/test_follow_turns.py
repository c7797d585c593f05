"""A turn's chain is found from the ledger alone, and survives a follower's restart (ADR-0104).

On real storage (in memory, SQLite, PostgreSQL), with real followers, dispatcher, executor and
Runner (:mod:`tests.follow.follow_world`). A follower restarted is a new ``Followers`` with
nothing in memory, as a new process is; batches of one envelope put a restart between a turn's
start and every later envelope of it.
"""

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from relayr.follow import follower
from relayr.follow.batches import Batches
from relayr.follow.events import MessagePosted, TurnEnded
from relayr.follow.projections import PROJECTIONS
from tests.follow.follow_app import MAX_DEPTH, Asked
from tests.follow.follow_world import KEY, PERSON, TENANT, WORKSPACE, World, opened
from tests.services import STORAGES, storage_url


@pytest.fixture(params=STORAGES)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    async with opened(storage_url(request, tmp_path), tmp_path) as world:
        yield world


@pytest.fixture
def one_envelope_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower, "BATCH_ENVELOPES", 1)


async def test_a_follower_restarted_after_a_turns_start_finds_its_cause_in_the_ledger(
    world: World,
) -> None:
    """The batch that ends with the turn's ``run_started`` keeps the turn's cause; a new
    follower, which never saw the start, continues the rule's chain with the reply and the
    turn's end, reading no thread back."""
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="status?"))
    await world.settle(follow=False)
    handle = await world.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    envelopes = await handle.read()
    [started] = [e for e in envelopes if e.event.type == "run_started"]
    first = Batches(
        world.runtime.application.rules,
        world.runtime.bridge.ledger,
        PROJECTIONS,
        lambda: datetime.now(UTC),
    )
    until = datetime.now(UTC) + timedelta(seconds=30)
    assert await world.store.take(KEY, "follower-2", until=until, now=datetime.now(UTC)) == 0
    prepared = await first.prepare(KEY, [e for e in envelopes if e.seq <= started.seq])
    await first.publish(KEY, prepared)
    assert await world.store.advance(KEY, "follower-2", started.seq, until=until)

    restarted = world.follower(holder="follower-2")
    done = await restarted.follow_all()

    [ask] = await (await world.rules()).runs(rule="follow:ask")
    turn = [e for e in await world.bridged() if e.event.author_kind == "agent"]  # type: ignore[attr-defined]
    assert done.bridged == len(turn) == 2  # the reply and the turn's end
    for envelope in turn:
        assert envelope.causation is not None
        assert (envelope.causation.run_id, envelope.depth) == (ask.id, 1)
    cause = await world.runtime.bridge.ledger.cause(KEY, "turn", started.run_id or "")
    assert cause is not None
    assert cause.run_id == ask.id


async def test_a_rule_and_the_agent_answering_each_other_stop_at_the_depth_limit_across_restarts(
    world: World, one_envelope_batches: None
) -> None:
    thread = await world.thread()
    await world.publish(Asked(thread_id=thread, text="again"))

    for _ in range(200):  # a new follower for every pass, one envelope a batch
        world.followers = world.follower(holder="follower-1")
        if not (await world.settle()).read:
            break

    rules = await world.rules()
    [ask] = await rules.runs(rule="follow:ask")
    again = await rules.runs(rule="converse:again")
    assert sorted(run.depth for run in again) == list(range(1, MAX_DEPTH))
    assert {run.correlation_id for run in again} == {ask.correlation_id}
    replies = [
        e
        for e in await world.bridged()
        if isinstance(e.event, MessagePosted) and e.event.author_kind == "agent"
    ]
    assert sorted(e.depth for e in replies) == list(range(1, MAX_DEPTH + 1))
    ends = [e for e in await world.bridged() if isinstance(e.event, TurnEnded)]
    assert len(ends) == len(replies)
    dead = await rules.dead_letters(rule="converse:again")
    dead += await rules.dead_letters(rule="follow:answered")
    assert dead, "the last reply went past the limit and was refused"
