"""The ledger contract, one suite over every adapter: in memory, SQLite and PostgreSQL.

The blocks of :meth:`relayr.ledger.Ledger.alongside` make real artifactr writes, as relayr's
executor does: on SQL, on the ledger's own engine (as relayr wires them, one engine for
artifactr's tables and the ledger's), so their causes ride the write's commit
(:mod:`relayr.ledger.with_the_write`); in memory, on artifactr's in-memory storage.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import (
    InMemoryStorage,
    JsonPatch,
    MarkdownArtifact,
    UserActor,
    VersionConflict,
    Versioned,
    Workspace,
    Workspaces,
)
from artifactr.core import EditArtifact, create_artifact
from artifactr.sql import SqlStorage, create_sqlite_engine
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relayr.core.errors import InvalidEmission
from relayr.ledger import Cause, InMemoryLedger, Ledger, LedgerWrites, SqlLedger, WorkspaceKey
from relayr.runtime import application
from tests.builders import NOW, emission

WORKSPACE = WorkspaceKey("tenant-1", "ws-1")
FIRST = Cause(correlation_id="cor-1", firing_id="fir-1", run_id="fir-1", depth=0)
SECOND = Cause(correlation_id="cor-2", firing_id="fir-2", run_id="fir-2", depth=1)

SQL_DATABASES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def database_url(request: pytest.FixtureRequest, tmp_path: Path, database: str) -> str:
    if database == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


def create_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        return create_sqlite_engine(url)
    return create_async_engine(url)


@pytest.fixture(params=SQL_DATABASES)
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty database, SQLite or PostgreSQL."""
    return database_url(request, tmp_path, request.param)


@pytest.fixture(params=["memory", *SQL_DATABASES])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """None for the in-memory adapter, else a URL of an empty database."""
    if request.param == "memory":
        return None
    return database_url(request, tmp_path, request.param)


@pytest.fixture
async def ledger(storage_url: str | None) -> AsyncIterator[Ledger]:
    if storage_url is None:
        yield InMemoryLedger()
        return
    engine = create_engine(storage_url)
    ledger = SqlLedger(engine)
    try:
        yield ledger
    finally:
        await ledger.aclose()
        await engine.dispose()


class LedgerNote(MarkdownArtifact):
    """The artifact the blocks edit (kind ``ledger_note``)."""


@dataclass(frozen=True)
class Store:
    """A ledger and an artifactr workspace on one storage, as relayr wires them."""

    ledger: Ledger
    artifacts: Workspace

    async def note(self) -> Versioned[LedgerNote]:
        """A new note, at version 1."""
        created = await self.artifacts.commit(create_artifact(LedgerNote(text="v1")))
        return await self.artifacts.get(LedgerNote, created.artifact_id)

    async def edit(self, note: Versioned[LedgerNote], text: str) -> None:
        """Commit an edit of ``note`` from its version (refused if the note moved on)."""
        patch = JsonPatch(ops=({"op": "replace", "path": "/text", "value": text},))
        await self.artifacts.commit(
            EditArtifact(artifact_id=note.id, base_version=note.version, patch=patch)
        )


@asynccontextmanager
async def opened_store(url: str | None) -> AsyncIterator[Store]:
    """In memory for None. On SQL, relayr's engine for ``url`` with artifactr's tables, the
    ledger on that engine (``SqlLedger.open``, as relayr's runtime builds it) and artifactr's
    ``SqlStorage`` on it."""
    person = UserActor(id="alice")
    if url is None:
        artifacts = Workspaces(InMemoryStorage(), types=[LedgerNote])
        handle = await artifacts.open(WORKSPACE.tenant_id, WORKSPACE.workspace_id, actor=person)
        yield Store(InMemoryLedger(), handle)
        return
    engine = application.create_engine(url)
    try:
        await application.migrate(engine, ["artifactr"])
        ledger = await SqlLedger.open(engine)
        artifacts = Workspaces(SqlStorage(engine), types=[LedgerNote])
        handle = await artifacts.open(WORKSPACE.tenant_id, WORKSPACE.workspace_id, actor=person)
        yield Store(ledger, handle)
        await ledger.aclose()
    finally:
        await engine.dispose()


@pytest.fixture
async def store(storage_url: str | None) -> AsyncIterator[Store]:
    async with opened_store(storage_url) as opened:
        yield opened


@pytest.fixture
async def sql_store(sql_url: str) -> AsyncIterator[Store]:
    async with opened_store(sql_url) as opened:
        yield opened


@pytest.fixture
async def sql_ledger(sql_url: str) -> AsyncIterator[SqlLedger]:
    ledger = SqlLedger.from_url(sql_url)
    try:
        yield ledger
    finally:
        await ledger.aclose()


async def test_the_first_cause_is_kept(ledger: Ledger) -> None:
    assert await ledger.record_cause(WORKSPACE, "message", "msg-1", FIRST) == FIRST
    assert await ledger.record_cause(WORKSPACE, "message", "msg-1", SECOND) == FIRST
    assert await ledger.cause(WORKSPACE, "message", "msg-1") == FIRST


async def test_no_cause_is_found_under_an_unrecorded_key(ledger: Ledger) -> None:
    await ledger.record_cause(WORKSPACE, "message", "msg-1", FIRST)
    assert await ledger.cause(WORKSPACE, "message", "msg-2") is None


async def test_causes_are_kept_apart_per_workspace_and_kind(ledger: Ledger) -> None:
    other_workspace = WorkspaceKey(WORKSPACE.tenant_id, "ws-2")
    other_tenant = WorkspaceKey("tenant-2", WORKSPACE.workspace_id)
    await ledger.record_cause(WORKSPACE, "message", "id-1", FIRST)

    assert await ledger.record_cause(other_workspace, "message", "id-1", SECOND) == SECOND
    assert await ledger.record_cause(other_tenant, "message", "id-1", SECOND) == SECOND
    assert await ledger.record_cause(WORKSPACE, "proposal", "id-1", SECOND) == SECOND
    assert await ledger.cause(WORKSPACE, "message", "id-1") == FIRST
    assert await ledger.cause(WORKSPACE, "thread", "id-1") is None


async def test_causes_are_read_together_each_under_its_kind(ledger: Ledger) -> None:
    other_workspace = WorkspaceKey(WORKSPACE.tenant_id, "ws-2")
    await ledger.record_cause(WORKSPACE, "message", "id-1", FIRST)
    await ledger.record_cause(WORKSPACE, "proposal", "id-2", SECOND)
    await ledger.record_cause(other_workspace, "message", "id-3", SECOND)

    found = await ledger.causes(
        WORKSPACE,
        {("message", "id-1"), ("proposal", "id-2"), ("message", "id-2"), ("message", "id-3")},
    )

    assert found == {("message", "id-1"): FIRST, ("proposal", "id-2"): SECOND}
    assert await ledger.causes(WORKSPACE, set()) == {}


async def test_concurrent_causes_under_one_key_keep_exactly_one(ledger: Ledger) -> None:
    contenders = [
        Cause(correlation_id=f"cor-{n}", firing_id=f"fir-{n}", run_id=f"fir-{n}", depth=n)
        for n in range(24)
    ]

    kept = await asyncio.gather(
        *(ledger.record_cause(WORKSPACE, "message", "msg-1", cause) for cause in contenders)
    )

    assert len(set(kept)) == 1
    assert kept[0] in contenders
    assert await ledger.cause(WORKSPACE, "message", "msg-1") == kept[0]


async def test_a_block_whose_write_was_refused_leaves_its_causes_to_the_caller(
    store: Store,
) -> None:
    """artifactr refused the block's edit (its note moved on): nothing committed, no cause."""
    note = await store.note()
    await store.edit(note, "v2")
    writes = LedgerWrites()
    writes.cause(WORKSPACE, "revision", f"{note.id}@2", FIRST)

    with pytest.raises(VersionConflict):
        async with store.ledger.alongside(writes):
            await store.edit(note, "v2 again")

    assert not writes.committed
    assert await store.ledger.cause(WORKSPACE, "revision", f"{note.id}@2") is None


async def test_a_block_that_completed_keeps_its_cause_over_one_that_raised(
    store: Store,
) -> None:
    """Two runs edit one artifact from one version: the one that began first is refused after
    the other's write committed, and the revision's cause is the other's."""
    note = await store.note()
    revision = f"{note.id}@2"
    loser, winner = LedgerWrites(), LedgerWrites()
    loser.cause(WORKSPACE, "revision", revision, FIRST)
    winner.cause(WORKSPACE, "revision", revision, SECOND)
    loser_in, winner_done = asyncio.Event(), asyncio.Event()

    async def lose() -> None:
        async with store.ledger.alongside(loser):
            loser_in.set()
            await winner_done.wait()
            await store.edit(note, "the loser's")

    async def win() -> None:
        await loser_in.wait()
        async with store.ledger.alongside(winner):
            await store.edit(note, "the winner's")
        winner_done.set()

    lost, won = await asyncio.gather(lose(), win(), return_exceptions=True)

    assert isinstance(lost, VersionConflict), lost
    assert won is None
    assert (loser.committed, winner.committed) == (False, True)
    assert await store.ledger.cause(WORKSPACE, "revision", revision) == SECOND
    assert (await store.artifacts.get(LedgerNote, note.id)).data.text == "the winner's"


class _Died(Exception):
    """The block ended right after its write, as a process killed then would."""


async def test_causes_ride_the_commit_of_the_block_s_write(sql_store: Store) -> None:
    """On SQL the cause is committed in the write's own transaction, before the block ends: a
    block that dies right after its write still leaves the write's cause. (Memory has no
    transaction to ride: it keeps the causes before the block.)"""
    note = await sql_store.note()
    writes = LedgerWrites()
    writes.cause(WORKSPACE, "revision", f"{note.id}@2", FIRST)
    committed_with_the_write: list[bool] = []

    async def die_after_the_write() -> None:
        async with sql_store.ledger.alongside(writes):
            await sql_store.edit(note, "v2")
            committed_with_the_write.append(writes.committed)
            raise _Died()

    with pytest.raises(_Died):
        await die_after_the_write()

    assert committed_with_the_write == [True]
    assert await sql_store.ledger.cause(WORKSPACE, "revision", f"{note.id}@2") == FIRST


async def test_emission_records_round_trip_oldest_first(ledger: Ledger) -> None:
    records = [
        emission(message_id="msg-1"),
        emission(message_id="msg-2", kind="message", policy="turn", outcome="posted"),
        emission(message_id="msg-1", attempt=2, epoch=2, outcome="already_posted"),
    ]
    for record in records:
        await ledger.record_emission(record)
    await ledger.record_emission(emission(run_id="fir-other"))
    await ledger.record_emission(emission(workspace_id="ws-2"))

    assert await ledger.emissions(WORKSPACE, "fir-1") == records
    assert await ledger.emissions(WORKSPACE, "fir-unknown") == []


async def test_recording_an_emission_again_keeps_the_first(ledger: Ledger) -> None:
    first = emission()
    await ledger.record_emission(first)
    await ledger.record_emission(first)
    await ledger.record_emission(
        emission(outcome="already_posted", emitted_at=NOW + timedelta(minutes=1))
    )

    assert await ledger.emissions(WORKSPACE, "fir-1") == [first]


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"content": "  \n"}, "EMPTY_CONTENT"),
        ({"outcome": "asked"}, "INVALID_OUTCOME"),
        ({"policy": "turn"}, "INVALID_POLICY"),
        ({"attempt": 0}, "INVALID_CONTEXT"),
        ({"message_id": ""}, "INVALID_PATH"),
        ({"emitted_at": NOW.replace(tzinfo=None)}, "INVALID_EMITTED_AT"),
        ({"schema_version": 2}, "INVALID_SCHEMA_VERSION"),
    ],
)
async def test_an_invalid_emission_is_refused_with_its_code_and_not_stored(
    ledger: Ledger, changes: dict[str, Any], code: str
) -> None:
    with pytest.raises(InvalidEmission) as refused:
        await ledger.record_emission(emission(**changes))

    assert refused.value.code == code
    assert await ledger.emissions(WORKSPACE, "fir-1") == []


@pytest.mark.parametrize(
    ("stored", "code"),
    [
        ("not json", "INVALID_JSON"),
        ("[1, 2]", "INVALID_JSON"),
        ('{"kind": "notice"}', "MISSING_FIELD"),
        (json.dumps(emission().to_json() | {"kind": "reply"}), "INVALID_KIND"),
        (json.dumps(emission().to_json() | {"extra": 1}), "UNKNOWN_FIELD"),
    ],
)
async def test_a_record_corrupted_in_storage_is_refused_on_read(
    sql_ledger: SqlLedger, stored: str, code: str
) -> None:
    await sql_ledger.record_emission(emission())
    async with sql_ledger.engine.begin() as connection:
        await connection.execute(
            text("UPDATE relayr_emissions SET record = :record"), {"record": stored}
        )

    with pytest.raises(InvalidEmission) as refused:
        await sql_ledger.emissions(WORKSPACE, "fir-1")

    assert refused.value.code == code


async def test_processes_starting_together_create_the_tables_once(sql_url: str) -> None:
    engines = [create_engine(sql_url) for _ in range(6)]
    try:
        ledgers = await asyncio.gather(*(SqlLedger.open(engine) for engine in engines))
        kept = await asyncio.gather(
            *(ledger.record_cause(WORKSPACE, "message", "msg-1", FIRST) for ledger in ledgers)
        )
        assert kept == [FIRST] * len(ledgers)
    finally:
        for engine in engines:
            await engine.dispose()


async def test_the_ledger_disposes_only_an_engine_it_owns(sql_url: str) -> None:
    borrowed = create_engine(sql_url)
    try:
        ledger = SqlLedger(borrowed)
        await ledger.cause(WORKSPACE, "message", "msg-1")
        assert await _closed_connections_on_aclose(ledger) == 0
    finally:
        await borrowed.dispose()

    owning = SqlLedger.from_url(sql_url)
    await owning.cause(WORKSPACE, "message", "msg-1")
    assert await _closed_connections_on_aclose(owning) >= 1


async def _closed_connections_on_aclose(ledger: SqlLedger) -> int:
    closed: list[object] = []

    def count_close(*_: object) -> None:
        closed.append(None)

    event.listen(ledger.engine.sync_engine, "close", count_close)
    await ledger.aclose()
    return len(closed)
