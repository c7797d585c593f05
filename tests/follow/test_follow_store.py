"""The followers' store, one contract over every adapter: in memory, SQLite and PostgreSQL."""

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from artifactr.sql import create_sqlite_engine
from sqlalchemy.ext.asyncio import create_async_engine

from relayr.follow.store import DeadLetter, FollowStore, InMemoryFollowStore, SqlFollowStore
from relayr.ledger.port import WorkspaceKey

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TTL = timedelta(seconds=30)
OPS = WorkspaceKey("acme", "ops")
BILLING = WorkspaceKey("acme", "billing")


def letter(envelope_id: str, seq: int, workspace: WorkspaceKey = OPS) -> DeadLetter:
    return DeadLetter(
        workspace=workspace,
        envelope_id=envelope_id,
        seq=seq,
        event_type="message_posted",
        reason="projection_failed",
        error="ValueError: no",
        dead_at=NOW,
    )


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[FollowStore]:
    if request.param == "memory":
        yield InMemoryFollowStore()
        return
    if request.param == "sqlite":
        engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'follow.db'}")
    else:
        engine = create_async_engine(request.getfixturevalue("postgres_url"))
    try:
        yield SqlFollowStore(engine)
    finally:
        await engine.dispose()


async def test_a_new_workspace_starts_at_zero_under_its_first_holder(store: FollowStore) -> None:
    assert await store.take(OPS, "a", until=NOW + TTL, now=NOW) == 0
    assert await store.take(OPS, "b", until=NOW + TTL, now=NOW) is None
    assert await store.take(OPS, "a", until=NOW + 2 * TTL, now=NOW + TTL / 2) == 0
    [position] = await store.positions()
    assert (position.workspace, position.holder, position.held_until) == (OPS, "a", NOW + 2 * TTL)


async def test_a_lapsed_lease_is_taken_with_the_cursor_where_it_was(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    assert await store.advance(OPS, "a", 42, until=NOW + TTL)

    assert await store.take(OPS, "b", until=NOW + 2 * TTL, now=NOW + TTL) == 42
    assert not await store.advance(OPS, "a", 50, until=NOW + 2 * TTL)
    [position] = await store.positions()
    assert (position.cursor, position.holder) == (42, "b")


async def test_a_cursor_only_moves_forward(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    assert await store.advance(OPS, "a", 10, until=NOW + TTL)
    assert await store.advance(OPS, "a", 7, until=NOW + TTL)
    assert await store.take(OPS, "a", until=NOW + TTL, now=NOW) == 10


async def test_a_released_lease_is_free_at_once(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    await store.release(OPS, "b")
    assert await store.take(OPS, "b", until=NOW + TTL, now=NOW) is None
    await store.release(OPS, "a")
    assert await store.take(OPS, "b", until=NOW + TTL, now=NOW) == 0


async def test_workspaces_are_held_apart(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    assert await store.take(BILLING, "b", until=NOW + TTL, now=NOW) == 0
    assert [p.workspace for p in await store.positions()] == [BILLING, OPS]


async def test_dead_letters_are_kept_once_with_the_cursor(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    await store.take(BILLING, "a", until=NOW + TTL, now=NOW)
    assert await store.advance(OPS, "a", 5, until=NOW + TTL, dead=[letter("e-4", 4)])
    assert await store.advance(OPS, "a", 5, until=NOW + TTL, dead=[letter("e-4", 4)])
    assert await store.advance(BILLING, "a", 9, until=NOW + TTL, dead=[letter("e-9", 9, BILLING)])
    assert not await store.advance(OPS, "b", 6, until=NOW + TTL, dead=[letter("e-6", 6)])

    assert [d.envelope_id for d in await store.dead_letters()] == ["e-9", "e-4"]
    [kept] = await store.dead_letters(OPS)
    assert kept == letter("e-4", 4)


async def test_a_replayed_letter_leaves_the_waiting_ones(store: FollowStore) -> None:
    await store.take(OPS, "a", until=NOW + TTL, now=NOW)
    await store.advance(OPS, "a", 5, until=NOW + TTL, dead=[letter("e-3", 3), letter("e-4", 4)])

    await store.failed_again(
        DeadLetter(OPS, "e-3", 3, "message_posted", "cause_missing", "again", NOW)
    )
    await store.replayed(OPS, ["e-4"], at=NOW + TTL)

    [waiting] = await store.dead_letters(OPS)
    assert (waiting.envelope_id, waiting.reason, waiting.error, waiting.tries) == (
        "e-3",
        "cause_missing",
        "again",
        2,
    )
    replayed = [d for d in await store.dead_letters(OPS, replayed=True) if d.replayed_at]
    assert [(d.envelope_id, d.replayed_at) for d in replayed] == [("e-4", NOW + TTL)]


async def test_contenders_for_one_lease_get_one_holder(store: FollowStore) -> None:
    taken = await asyncio.gather(
        *(store.take(OPS, f"h{index}", until=NOW + TTL, now=NOW) for index in range(8))
    )
    assert sorted(taken, key=lambda cursor: cursor is None) == [0] + [None] * 7
