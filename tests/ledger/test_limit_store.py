"""The limits' counts, one suite over every store: in memory, SQLite and PostgreSQL.

Admissions that race for one limit, from many tasks at once on one engine (PostgreSQL's pool
gives each its own connection), never take more than the limit; a window says when the next
fits; a slot whose lease lapsed is free; a turn's tokens count once. Times are a fixed ``NOW``.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from relayr.core.limits import parse_rate
from relayr.ledger.limits import (
    Admission,
    Check,
    InMemoryLimitStore,
    LimitStore,
    Release,
    RunKey,
    SqlLimitStore,
)
from tests.ledger.test_ledger import create_engine, storage_url

__all__ = ["storage_url"]

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LEASE = NOW + timedelta(seconds=30)


@pytest.fixture
async def store(storage_url: str | None) -> AsyncIterator[LimitStore]:
    if storage_url is None:
        yield InMemoryLimitStore()
        return
    engine = create_engine(storage_url)
    try:
        yield SqlLimitStore(engine)
    finally:
        await engine.dispose()


def run(number: int) -> RunKey:
    return RunKey("acme", "ops", f"fir_{number:04d}")


IN_FLIGHT = Check("work", "runs_in_flight", "work/runs_in_flight", 3, None)


def per_minute(count: int, key: RunKey) -> Check:
    return Check("work", "turns_per", "work/turns_per", parse_rate(f"{count}/1m"), str(key))


async def test_racing_admissions_never_take_more_slots_than_the_limit(store: LimitStore) -> None:
    refusals = await asyncio.gather(
        *(store.admit(run(n), [IN_FLIGHT], now=NOW, lease_until=LEASE) for n in range(20))
    )
    admitted = [n for n, refusal in enumerate(refusals) if refusal is None]
    assert len(admitted) == 3
    assert len(await store.waiting()) == 17
    again = await store.admit(run(admitted[0]), [IN_FLIGHT], now=NOW, lease_until=LEASE)
    assert again is None  # a run that holds its slot is admitted again, taking nothing more
    woken = await store.release(run(admitted[0]))
    assert len(set(woken)) == 17  # every run waiting on the limit, to be woken
    refused = [n for n in range(20) if n not in admitted]
    assert await store.admit(run(refused[0]), [IN_FLIGHT], now=NOW, lease_until=LEASE) is None
    assert len(await store.waiting()) == 16


async def test_a_slot_whose_lease_lapsed_is_free(store: LimitStore) -> None:
    for n in range(3):
        assert await store.admit(run(n), [IN_FLIGHT], now=NOW, lease_until=LEASE) is None
    later = LEASE + timedelta(seconds=1)
    assert await store.admit(run(9), [IN_FLIGHT], now=NOW, lease_until=LEASE) is not None
    assert await store.admit(run(9), [IN_FLIGHT], now=later, lease_until=later) is None


async def test_a_window_admits_its_count_and_says_when_the_next_fits(store: LimitStore) -> None:
    at = [NOW, NOW + timedelta(seconds=20), NOW + timedelta(seconds=40)]
    for n, now in enumerate(at):
        assert (
            await store.admit(run(n), [per_minute(3, run(n))], now=now, lease_until=LEASE) is None
        )
    refusal = await store.admit(run(3), [per_minute(3, run(3))], now=at[2], lease_until=LEASE)
    assert refusal is not None
    assert refusal.next_at == NOW + timedelta(minutes=1)
    # a run counted once is admitted again (a retried attempt), without counting twice
    assert await store.admit(run(1), [per_minute(3, run(1))], now=at[2], lease_until=LEASE) is None
    fits = NOW + timedelta(minutes=1, microseconds=1)
    assert await store.admit(run(3), [per_minute(3, run(3))], now=fits, lease_until=LEASE) is None
    [use] = await store.usage(now=fits, windows={"work/turns_per": timedelta(minutes=1)})
    assert (use.used, use.waiting) == (3, 0)


async def test_runs_waiting_on_a_window_go_in_turn_not_all_at_its_next_opening(
    store: LimitStore,
) -> None:
    """Each refused run expects the use its place in the line frees (ADR-0118): three a minute,
    so the first three waiting go at the next opening, the next three a minute after."""
    for n in range(3):
        assert (
            await store.admit(run(n), [per_minute(3, run(n))], now=NOW, lease_until=LEASE) is None
        )
    waiting = [run(n) for n in range(10, 17)]
    for key in waiting:
        refusal = await store.admit(key, [per_minute(3, key)], now=NOW, lease_until=LEASE)
        assert refusal is not None
    expected = [NOW + timedelta(minutes=1 + place // 3) for place in range(7)]
    assert [wait.next_at for wait in await store.waiting()] == expected
    assert [wait.run for wait in await store.waiting()] == waiting
    # refused again, a run keeps its place: the runs that came after it stay behind it
    again = await store.admit(waiting[4], [per_minute(3, waiting[4])], now=NOW, lease_until=LEASE)
    assert again is not None
    assert again.next_at == NOW + timedelta(minutes=2)
    # at the next opening the first three go; the fourth is first in line for the minute after
    opening = NOW + timedelta(minutes=1)
    for key in waiting[:3]:
        assert await store.admit(key, [per_minute(3, key)], now=opening, lease_until=LEASE) is None
    later = await store.admit(
        waiting[3], [per_minute(3, waiting[3])], now=opening, lease_until=LEASE
    )
    assert later is not None
    assert later.next_at == NOW + timedelta(minutes=2)


def tokens(key: RunKey) -> Check:
    return Check("work", "tokens_per", "work/tokens_per", parse_rate("100/1h"), str(key), 0)


async def test_a_turns_tokens_count_once_in_its_runs_windows(store: LimitStore) -> None:
    assert await store.admit(run(1), [tokens(run(1))], now=NOW, lease_until=LEASE) is None
    await store.turn_ended(run(1), "run_turn1", 60, NOW)
    await store.turn_ended(run(1), "run_turn1", 60, NOW)  # the same end, seen again
    await store.turn_ended(run(2), "run_turn2", 500, NOW)  # a run bound by no token window
    windows = {"work/tokens_per": timedelta(hours=1)}
    [use] = await store.usage(now=NOW, windows=windows)
    assert use.used == 60
    assert await store.admit(run(3), [tokens(run(3))], now=NOW, lease_until=LEASE) is None
    await store.turn_ended(run(3), "run_turn3", 60, NOW)  # 120 spent of 100
    refusal = await store.admit(run(4), [tokens(run(4))], now=NOW, lease_until=LEASE)
    assert refusal is not None
    assert refusal.next_at == NOW + timedelta(hours=1)


async def test_a_turns_end_frees_its_slot_and_names_the_runs_waiting(store: LimitStore) -> None:
    turns = Check("work", "turns_in_flight", "work/turns_in_flight", 1, None)
    assert await store.admit(run(1), [turns], now=NOW, lease_until=LEASE) is None
    assert await store.admit(run(2), [turns], now=NOW, lease_until=LEASE) is not None
    assert await store.release(run(1), kinds=("runs_in_flight",)) == []  # the turn runs on
    assert await store.admit(run(2), [turns], now=NOW, lease_until=LEASE) is not None
    assert await store.turn_ended(run(1), "run_turn1", 10, NOW) == [run(2)]
    assert await store.admit(run(2), [turns], now=NOW, lease_until=LEASE) is None
    assert await store.waiting() == []


async def test_a_messages_runs_are_admitted_in_one_call_each_with_the_uses_before_it(
    store: LimitStore,
) -> None:
    held = await store.admit(run(0), [IN_FLIGHT], now=NOW, lease_until=LEASE)
    assert held is None
    batch = {run(n): [IN_FLIGHT, per_minute(10, run(n))] for n in range(1, 5)}
    refused = await store.admit_all(batch, now=NOW, lease_until=LEASE)
    assert list(refused) == [run(3), run(4)]  # 0 held a slot; 1 and 2 took the last two
    assert {refusal.check.kind for refusal in refused.values()} == {"runs_in_flight"}
    windows = {"work/turns_per": timedelta(minutes=1)}
    used = {
        use.kind: (use.used, use.waiting) for use in await store.usage(now=NOW, windows=windows)
    }
    assert used == {"runs_in_flight": (3, 2), "turns_per": (2, 0)}  # a refused run took nothing
    assert await store.admit_all(batch, now=NOW, lease_until=LEASE) == refused  # taken once
    assert await store.admit_all({}, now=NOW, lease_until=LEASE) == {}


async def test_a_groups_slots_go_back_in_one_call_and_a_sent_turn_keeps_its_own(
    store: LimitStore,
) -> None:
    turns = Check("work", "turns_in_flight", "work/turns_in_flight", 2, None)
    for n in (1, 2):
        assert await store.admit(run(n), [IN_FLIGHT, turns], now=NOW, lease_until=LEASE) is None
    assert await store.admit(run(3), [turns], now=NOW, lease_until=LEASE) is not None
    turn_ends = NOW + timedelta(minutes=10)
    woken = await store.release_all({run(1): turn_ends, run(2): None})
    assert woken == [run(3)]  # run 2's turn slot was freed: run 3 waits on that limit
    held = {use.kind: use.used for use in await store.usage(now=LEASE, windows={})}
    assert held == {"turns_in_flight": 1}  # run 1's, past its attempt's lease: its turn runs on
    assert await store.admit(run(3), [turns], now=NOW, lease_until=LEASE) is None
    assert await store.release_all({}) == []


async def test_with_no_transaction_to_ride_an_admission_and_a_release_go_after_their_block(
    store: LimitStore,
) -> None:
    admission = Admission(NOW, LEASE)
    async with store.admitting(admission):
        admission.asked = {run(n): [IN_FLIGHT] for n in range(4)}
    assert list(admission.refused) == [run(3)]
    release = Release({run(0): None})
    async with store.releasing(release):
        pass
    assert release.woken == [run(3)]
    assert await store.admit(run(3), [IN_FLIGHT], now=NOW, lease_until=LEASE) is None
