"""The SQL ledger: the contract of :mod:`relayr.ledger.port` in SQLite or PostgreSQL.

Every call is one short transaction. The first cause under a key is kept by the database
(``INSERT ... ON CONFLICT DO NOTHING``), so concurrent contenders all get the same answer.
Emission records are validated again when read. The tables are made and changed by relayr's
migrations, upgraded to head before a store's first statement (:func:`relayr.migrations.upgrade`,
ADR-0110). The engine is usually shared and not the ledger's to dispose of; on SQLite it has one
connection, so never call the ledger while holding one of its connections. :class:`SqlStore` is
what the ledger shares with the followers' store.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Self

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    DateTime,
    Integer,
    MetaData,
    Select,
    Table,
    Text,
    UniqueConstraint,
    and_,
    make_url,
    or_,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from relayr.core.emissions import EmissionRecord, validate_emission
from relayr.core.errors import InvalidEmission
from relayr.ledger.port import Cause, CauseRecord, LedgerWrites, WorkspaceKey, WriteKind
from relayr.ledger.with_the_write import Statements, with_the_write
from relayr.migrations import upgrade

SUPPORTED_DIALECTS = frozenset({"postgresql", "sqlite"})

metadata = MetaData()
"""The ledger's tables as the code reads and writes them. relayr's migrations make them: a
change here is a new migration too (the migration tests compare the two)."""

causes_table = Table(
    "relayr_causes",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("kind", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    Column("correlation_id", Text, nullable=False),
    Column("firing_id", Text, nullable=False),
    Column("run_id", Text, nullable=False),
    Column("depth", Integer, nullable=False),
)

emissions_table = Table(
    "relayr_emissions",
    metadata,
    Column(
        "position",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("tenant_id", Text, nullable=False),
    Column("workspace_id", Text, nullable=False),
    Column("run_id", Text, nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("message_id", Text, nullable=False),
    Column("record", Text, nullable=False),
    Column("emitted_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint(
        "tenant_id",
        "workspace_id",
        "run_id",
        "epoch",
        "message_id",
        name="relayr_emissions_once",
    ),
)

_CAUSE_KEY = ("tenant_id", "workspace_id", "kind", "key")
_EMISSION_KEY = ("tenant_id", "workspace_id", "run_id", "epoch", "message_id")
_CAUSE_COLUMNS = (
    causes_table.c.correlation_id,
    causes_table.c.firing_id,
    causes_table.c.run_id,
    causes_table.c.depth,
)


def in_workspace(table: Table, workspace: WorkspaceKey) -> ColumnElement[bool]:
    """The rows of ``table`` (keyed by ``tenant_id`` and ``workspace_id``) in ``workspace``."""
    return and_(
        table.c.tenant_id == workspace.tenant_id,
        table.c.workspace_id == workspace.workspace_id,
    )


class SqlStore:
    """What relayr's own SQL stores share (this ledger, the followers'
    :class:`relayr.follow.store.SqlFollowStore`): an engine of a supported dialect, relayr's
    tables upgraded to head once, before the first call (:func:`relayr.migrations.upgrade`),
    one transaction per call, and inserts in the engine's dialect (for its ``ON CONFLICT``).

    ``refusal`` starts the error for an engine of another dialect: ``the ledger stores``.
    """

    def __init__(self, engine: AsyncEngine, *, refusal: str) -> None:
        dialect = engine.dialect.name
        if dialect not in SUPPORTED_DIALECTS:
            raise ValueError(
                f"{refusal} into {' or '.join(sorted(SUPPORTED_DIALECTS))}, not {dialect}"
            )
        self._engine = engine
        self._dialect = dialect
        self._migrated = False
        self._migrating = asyncio.Lock()

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection]:
        await self._ensure_tables()
        async with self._engine.begin() as connection:
            yield connection

    async def _ensure_tables(self) -> None:
        if self._migrated:
            return
        async with self._migrating:
            if not self._migrated:
                await upgrade(self._engine)
                self._migrated = True

    def _insert(self, table: Table) -> postgresql.Insert | sqlite.Insert:
        if self._dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)


class SqlLedger(SqlStore):
    """Causes and emission records in SQLite or PostgreSQL, one transaction per call.

    ``SqlLedger(engine)`` borrows an engine its caller disposes of; :meth:`from_url` builds and
    owns one. Its tables are upgraded on first use; :meth:`open` upgrades them up front instead.
    """

    def __init__(self, engine: AsyncEngine, *, owns_engine: bool = False) -> None:
        super().__init__(engine, refusal="the ledger stores")
        self._owns_engine = owns_engine

    @classmethod
    def from_url(cls, url: str, **engine_options: Any) -> Self:
        """A ledger on its own engine for ``url``, disposed of by :meth:`aclose`.

        SQLite gets artifactr's engine whose transactions take turns (``BEGIN IMMEDIATE``,
        one connection), the only safe way to write one SQLite file from many tasks.
        """
        if make_url(url).get_backend_name() == "sqlite":
            # imported here: `relayr runs` loads this module and must not load artifactr (ADR-0050)
            from artifactr.sql import create_sqlite_engine

            engine = create_sqlite_engine(url, **engine_options)
        else:
            engine = create_async_engine(url, **engine_options)
        return cls(engine, owns_engine=True)

    @classmethod
    async def open(cls, engine: AsyncEngine, *, owns_engine: bool = False) -> Self:
        """A ledger on ``engine`` whose tables are at head before its first call."""
        ledger = cls(engine, owns_engine=owns_engine)
        await ledger._ensure_tables()
        return ledger

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    async def record_cause(
        self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause
    ) -> Cause:
        insert = self._insert_unless_present(causes_table, _CAUSE_KEY).values(
            **_cause_row(CauseRecord(workspace, kind, key, cause))
        )
        async with self._transaction() as connection:
            kept = (await connection.execute(insert.returning(*_CAUSE_COLUMNS))).first()
            if kept is None:
                kept = (await connection.execute(_select_cause(workspace, kind, key))).one()
        return Cause(*kept)

    async def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str) -> Cause | None:
        async with self._transaction() as connection:
            found = (await connection.execute(_select_cause(workspace, kind, key))).first()
        return None if found is None else Cause(*found)

    async def causes(
        self, workspace: WorkspaceKey, keys: Collection[tuple[WriteKind, str]]
    ) -> dict[tuple[WriteKind, str], Cause]:
        by_kind: dict[str, list[str]] = {}
        for kind, key in keys:
            by_kind.setdefault(kind, []).append(key)
        if not by_kind:
            return {}
        table = causes_table
        query = select(table.c.kind, table.c.key, *_CAUSE_COLUMNS).where(
            in_workspace(table, workspace),
            or_(
                *(
                    and_(table.c.kind == kind, table.c.key.in_(named))
                    for kind, named in by_kind.items()
                )
            ),
        )
        async with self._transaction() as connection:
            rows = (await connection.execute(query)).all()
        return {(row[0], row[1]): Cause(*row[2:]) for row in rows}

    async def record_emission(self, record: EmissionRecord) -> None:
        insert = self._insert_unless_present(emissions_table, _EMISSION_KEY).values(
            **_emission_row(record)
        )
        async with self._transaction() as connection:
            await connection.execute(insert)

    async def emissions(self, workspace: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        query = (
            select(emissions_table.c.position, emissions_table.c.record)
            .where(in_workspace(emissions_table, workspace), emissions_table.c.run_id == run_id)
            .order_by(emissions_table.c.position)
        )
        async with self._transaction() as connection:
            stored = (await connection.execute(query)).all()
        return [
            _read_record(row.record, f"#{row.position} of run {run_id} in {workspace}")
            for row in stored
        ]

    async def write(self, writes: LedgerWrites) -> None:
        statements = self._statements(writes)
        async with self._transaction() as connection:
            for statement, rows in statements:
                if rows:
                    await connection.execute(statement, list(rows))
        writes.committed = True

    @asynccontextmanager
    async def alongside(self, writes: LedgerWrites) -> AsyncIterator[None]:
        statements = self._statements(writes)  # validates every record before the block runs
        await self._ensure_tables()
        with with_the_write(self._engine.sync_engine, statements, writes):
            yield
        if writes and not writes.committed:
            await self.write(writes)

    async def aclose(self) -> None:
        if self._owns_engine:
            await self._engine.dispose()

    def _statements(self, writes: LedgerWrites) -> Statements:
        """The inserts that store ``writes``, each with its rows; records validated here."""
        causes = [_cause_row(record) for record in writes.causes]
        emissions = [_emission_row(record) for record in writes.emissions]
        return (
            (self._insert_unless_present(causes_table, _CAUSE_KEY), causes),
            (self._insert_unless_present(emissions_table, _EMISSION_KEY), emissions),
        )

    def _insert_unless_present(
        self, table: Table, key: Sequence[str]
    ) -> postgresql.Insert | sqlite.Insert:
        return self._insert(table).on_conflict_do_nothing(index_elements=key)


def _cause_row(record: CauseRecord) -> Mapping[str, Any]:
    cause = record.cause
    return {
        "tenant_id": record.workspace.tenant_id,
        "workspace_id": record.workspace.workspace_id,
        "kind": record.kind,
        "key": record.key,
        "correlation_id": cause.correlation_id,
        "firing_id": cause.firing_id,
        "run_id": cause.run_id,
        "depth": cause.depth,
    }


def _emission_row(record: EmissionRecord) -> Mapping[str, Any]:
    valid = validate_emission(record.to_json())
    return {
        "tenant_id": valid.tenant_id,
        "workspace_id": valid.workspace_id,
        "run_id": valid.run_id,
        "epoch": valid.epoch,
        "message_id": valid.message_id,
        "record": json.dumps(valid.to_json()),
        "emitted_at": valid.emitted_at,
    }


def _select_cause(workspace: WorkspaceKey, kind: WriteKind, key: str) -> Select[str, str, str, int]:
    return select(*_CAUSE_COLUMNS).where(
        in_workspace(causes_table, workspace),
        causes_table.c.kind == kind,
        causes_table.c.key == key,
    )


def _read_record(text: str, where: str) -> EmissionRecord:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise InvalidEmission("INVALID_JSON", f"emission record {where} is not a JSON object")
    return validate_emission(data)
