"""relayr's own tables, changed only by the Alembic migrations in ``versions/``.

:func:`upgrade` brings them to the newest revision (head), a no-op when they are there; it is
safe at every start and from processes that start together (one at a time: a PostgreSQL
advisory lock, SQLite's write lock). relayr's SQL stores call it before their first statement,
``relayr db upgrade`` ahead of a release. The revision is kept in ``relayr_alembic_version``,
beside the libraries' own version tables (:data:`SCHEMAS`), so the three schemas in one
database move apart (ADR-0110). Alembic is imported when a migration runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncEngine


class ForwardOnly(RuntimeError):
    """Raised when a downgrade is asked for: relayr's migrations only go forward (ADR-0110)."""


def refuse_downgrade() -> None:
    """Every revision's ``downgrade``: restoring a backup is the way back."""
    raise ForwardOnly(
        "relayr's migrations only go forward: restore a backup made before the upgrade"
    )


@dataclass(frozen=True)
class Schema:
    """One set of tables in relayr's database and where its migrations and revision live.

    Attributes:
        name: Who owns the tables: ``relayr``, ``artifactr`` or ``reflexr``.
        migrations: The Alembic script location, ``package:folder``.
        version_table: The table that holds the revision the database is at.
    """

    name: str
    migrations: str
    version_table: str


RELAYR: Final = Schema("relayr", "relayr:migrations", "relayr_alembic_version")
"""relayr's own tables: the ledger's and the followers'."""

SCHEMAS: Final = (
    Schema("artifactr", "artifactr.sql:migrations", "artifactr_alembic_version"),
    Schema("reflexr", "reflexr.sql:migrations", "reflexr_alembic_version"),
    RELAYR,
)
"""Every schema of the database, in the order ``relayr db upgrade`` migrates them."""

UPGRADE_LOCK: Final = 0x72656C74
"""The PostgreSQL advisory lock a transaction holds while it upgrades relayr's tables ("relt"
in ASCII), apart from the libraries' migration lock, so neither waits on the other."""

UPGRADE_LOCK_TIMEOUT_MS: Final = 120_000
"""How long an upgrade waits for another process's before it fails (the lock, or SQLite's
write lock through the engine's own wait)."""


@dataclass(frozen=True)
class Revision:
    """Where one schema of a database is, and where its migrations end.

    Attributes:
        schema: Whose tables.
        current: The revision the database is at; None before its first migration.
        head: The newest revision of the installed migrations.
    """

    schema: Schema
    current: str | None
    head: str

    @property
    def at_head(self) -> bool:
        return self.current == self.head


async def upgrade(engine: AsyncEngine) -> str:
    """Bring relayr's tables on ``engine`` to head, in one transaction; return the revision.

    On PostgreSQL the transaction takes :data:`UPGRADE_LOCK` first; on SQLite relayr's engines
    begin each transaction with the file's write lock. A process that loses a race it was not
    locked out of (an engine of another kind) finds the tables at head and carries on. On
    PostgreSQL, tables already at head, as at almost every start, are found so with one read
    of the revision, without the lock or loading the migrations (ADR-0124); on SQLite, with
    one read in the transaction, without loading the migrations (ADR-0126).
    """
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    if engine.dialect.name == "postgresql":
        [found] = await revisions(engine, (RELAYR,))
        if found.at_head:
            return found.head
    try:
        async with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                await connection.execute(
                    text(f"SET LOCAL lock_timeout = {UPGRADE_LOCK_TIMEOUT_MS}")
                )
                await connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK}
                )
            return await connection.run_sync(_upgrade_to_head)
    except DBAPIError:
        [found] = await revisions(engine, (RELAYR,))
        if not found.at_head:
            raise
        return found.head


async def revisions(engine: AsyncEngine, schemas: tuple[Schema, ...] = SCHEMAS) -> list[Revision]:
    """Where each of ``schemas`` (all by default) is on ``engine``, and its head."""
    async with engine.connect() as connection:
        return await connection.run_sync(_revisions, schemas)


@functools.cache
def head(schema: Schema = RELAYR) -> str:
    """The newest revision of ``schema``'s installed migrations (read once per process: they
    are the installed package's files)."""
    from alembic.script import ScriptDirectory

    found = ScriptDirectory.from_config(_config(schema)).get_current_head()
    if found is None:
        raise LookupError(f"{schema.name} has no migrations at {schema.migrations}")
    return found


def _revisions(connection: Connection, schemas: tuple[Schema, ...]) -> list[Revision]:
    from alembic.runtime.migration import MigrationContext

    found = []
    for schema in schemas:
        context = MigrationContext.configure(
            connection, opts={"version_table": schema.version_table}
        )
        found.append(Revision(schema, context.get_current_revision(), head(schema)))
    return found


def upgrade_behind(connection: Connection, schemas: tuple[Schema, ...]) -> list[Revision]:
    """Upgrade to head each of ``schemas`` that is behind, on ``connection``, in its
    transaction; where each is now. A schema at head is found so with one read of its version
    table, without loading its migrations (ADR-0126)."""
    from alembic import command

    found = _revisions(connection, schemas)
    behind = tuple(revision.schema for revision in found if not revision.at_head)
    for schema in behind:
        command.upgrade(_config(schema, connection), "head")
    return _revisions(connection, schemas) if behind else found


def _upgrade_to_head(connection: Connection) -> str:
    [revision] = upgrade_behind(connection, (RELAYR,))
    return revision.current or revision.head


def _config(schema: Schema, connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", schema.migrations)
    config.attributes["connection"] = connection
    return config
