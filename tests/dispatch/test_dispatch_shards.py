"""Dispatchers sharing the shards, on real stores (memory, SQLite, PostgreSQL): each holds its
share, every shard has exactly one holder, a dispatcher that stops renewing (as a SIGKILLed one)
loses its shards to another once their leases lapse, and one that comes back gets its share.

Time is a clock the test moves: a lease lapses when the test says, not when seconds passed.
"""

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from relayr.dispatch.shards import InMemoryShardStore, Shards, ShardStore, SqlShardStore, shard_of
from relayr.runtime.application import create_engine
from tests.services import STORAGES, storage_url

SHARDS = 64
TTL_S = 30.0


class WallClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Monotonic:
    def __init__(self, wall: WallClock) -> None:
        self.wall = wall

    def __call__(self) -> float:
        return (self.wall.now - datetime(2026, 1, 1, tzinfo=UTC)).total_seconds()


@pytest.fixture(params=STORAGES)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ShardStore]:
    url = storage_url(request, tmp_path)
    if url == "memory://":
        yield InMemoryShardStore()
        return
    engine = create_engine(url)
    try:
        yield SqlShardStore(engine)
    finally:
        await engine.dispose()


def dispatcher(store: ShardStore, name: str, clock: WallClock) -> Shards:
    return Shards(
        store,
        holder=name,
        shards=SHARDS,
        lease_ttl_s=TTL_S,
        clock=clock,
        monotonic=Monotonic(clock),
    )


async def settle(clock: WallClock, *dispatchers: Shards, rounds: int = 4) -> None:
    """Each dispatcher keeps its shards, a third of the lease apart, a few times."""
    for _ in range(rounds):
        for shards in dispatchers:
            await shards.keep()
        clock.now += timedelta(seconds=TTL_S / 3)


def owners(*dispatchers: Shards) -> list[int]:
    """How many dispatchers decide each shard."""
    return [sum(shard in d.held for d in dispatchers) for shard in range(SHARDS)]


async def test_a_lone_dispatcher_holds_every_shard(store: ShardStore) -> None:
    clock = WallClock()
    alone = dispatcher(store, "a", clock)

    gained = await alone.keep()

    assert gained == set(range(SHARDS))
    assert alone.owns("acme", "ops")


async def test_two_dispatchers_split_the_shards_and_never_both_decide_one(
    store: ShardStore,
) -> None:
    clock = WallClock()
    first, second = dispatcher(store, "a", clock), dispatcher(store, "b", clock)
    await first.keep()
    await second.keep()

    assert owners(first, second) == [1] * SHARDS  # b took nothing yet: a holds them all
    await settle(clock, first, second)

    assert owners(first, second) == [1] * SHARDS
    assert len(first.held) == len(second.held) == SHARDS // 2


async def test_a_dispatcher_that_stops_renewing_loses_its_shards_within_the_lease(
    store: ShardStore,
) -> None:
    """As a SIGKILLed dispatcher: no release, its rows stay until their leases lapse."""
    clock = WallClock()
    first, second = dispatcher(store, "a", clock), dispatcher(store, "b", clock)
    await settle(clock, first, second)
    orphaned = set(first.held)

    clock.now += timedelta(seconds=TTL_S / 3)
    await second.keep()
    assert orphaned.isdisjoint(second.held)  # their leases still run: no one else takes them
    clock.now += timedelta(seconds=TTL_S)
    gained = await second.keep()

    assert orphaned <= gained
    assert second.held == frozenset(range(SHARDS))
    assert not first.held  # its leases ran low: it would decide nothing if it woke up


async def test_a_dispatcher_that_comes_back_gets_its_share(store: ShardStore) -> None:
    clock = WallClock()
    first = dispatcher(store, "a", clock)
    await settle(clock, first)
    again = dispatcher(store, "a2", clock)

    await settle(clock, first, again)

    assert owners(first, again) == [1] * SHARDS
    assert len(again.held) == SHARDS // 2


async def test_a_released_dispatcher_hands_over_at_once(store: ShardStore) -> None:
    clock = WallClock()
    first, second = dispatcher(store, "a", clock), dispatcher(store, "b", clock)
    await settle(clock, first, second)

    await first.release()
    await second.keep()

    assert second.held == frozenset(range(SHARDS))


def test_a_workspaces_shard_is_stable_and_spread() -> None:
    assert shard_of("acme", "ops", SHARDS) == shard_of("acme", "ops", SHARDS)
    spread = {shard_of("acme", f"w{index}", SHARDS) for index in range(1000)}
    assert len(spread) == SHARDS


async def test_a_dead_dispatchers_shards_are_taken_within_a_second_of_their_lapse(
    store: ShardStore,
) -> None:
    """Between its beats, a dispatcher looks at the leases every second: a shard that lapsed
    is not left undecided until its next beat."""
    clock = WallClock()
    first, second = dispatcher(store, "a", clock), dispatcher(store, "b", clock)
    await settle(clock, first, second)  # first's last renewal: a third of the lease ago
    orphaned = set(first.held)
    lapse = clock.now + timedelta(seconds=TTL_S * 2 / 3)
    clock.now += timedelta(seconds=1)
    await second.keep()
    clock.now += timedelta(seconds=TTL_S / 3)
    await second.keep()  # its last beat before the lapse; the next comes a second after it

    clock.now = lapse - timedelta(seconds=0.5)
    before = await second.due()
    clock.now = lapse + timedelta(seconds=0.5)
    after = await second.due()
    gained = await second.keep()

    assert (before, after) == (False, True)
    assert orphaned <= gained
