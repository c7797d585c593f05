"""Application wiring: what a user's ``RELAYR_APP`` factory returns, and the helpers it uses.

``RELAYR_APP`` names ``package.module:factory``, an ``async`` function of the
:class:`~relayr.settings.Settings` returning an :class:`Application` (workspaces of both
libraries, rules, actions, and optionally the agent; without one no rule may start a turn). It is
called inside the event loop that will use what it builds. :func:`open_storage` opens and
migrates both libraries' storage on one database. Importing this module imports neither library
(ADR-0050).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from relayr.core.errors import InvalidApplication
from relayr.settings import Settings

if TYPE_CHECKING:
    from artifactr import Workspaces as ArtifactWorkspaces
    from artifactr.agent import Session
    from artifactr.workspace.storage import Storage as ArtifactStorage
    from pydantic_ai import Agent
    from reflexr.workspace import Action
    from reflexr.workspace import Storage as RuleStorage
    from reflexr.workspace import Workspaces as RuleWorkspaces
    from sqlalchemy.ext.asyncio import AsyncEngine

    from relayr.follow.config import Inbound
    from relayr.ledger.port import Ledger
    from relayr.migrations import Schema

type Library = Literal["artifactr", "reflexr"]

BOTH: Final[tuple[Library, ...]] = ("artifactr", "reflexr")
"""Both libraries, in the order they are migrated."""

SQLITE_LOCK_TIMEOUT_S: Final = 30.0
"""How long a SQLite transaction waits for another process's write lock. sqlite3's default
(5 s) fails a commit while a worker and the dispatcher write at once; 30 s outlasts any one
transaction of either library."""

SQLITE_JOURNAL_MODE: Final = "WAL"
SQLITE_SYNCHRONOUS: Final = "NORMAL"
"""The embedded database's durability: write-ahead log, synced at checkpoints (ADR-0025)."""

MIGRATION_LOCK: Final = 0x72656C61
"""The PostgreSQL advisory lock held while migrating, so processes that start together migrate
one after the other instead of racing to create the same tables ("rela" in ASCII)."""

MIGRATION_LOCK_TIMEOUT_S: Final = 120.0
"""How long a process waits for another's migration before giving up."""

type Factory = Callable[[Settings], Awaitable[Application]]


@dataclass(frozen=True)
class Application:
    """The pieces of a user's application that relayr runs.

    Attributes:
        artifacts: artifactr's workspaces, where runs act.
        rules: reflexr's workspaces, with the rules that every workspace evaluates.
        actions: What the rules run, by the name a rule's ``run(...)`` gives.
        agent: The pydantic-ai agent that carries out turns (``deps_type=Session[...]``), or
            None: then no rule may start a turn.
        app_deps: The application's own dependencies: the agent's ``ctx.deps.app``, and the
            bridge's ``app`` for the actions.
        engines: The engines relayr disposes of when it closes the application.
        ledger: Where causes and emission records are kept. None: relayr keeps them in the
            first engine's database (or in memory, without an engine).
        inbound: Which workspaces' artifactr logs are bridged into reflexr, and how
            (:class:`relayr.follow.config.Inbound`). None: every workspace of the tenants
            reflexr knows, with the default projections.
    """

    artifacts: ArtifactWorkspaces
    rules: RuleWorkspaces
    actions: Mapping[str, Action[Any]]
    agent: Agent[Session[Any], Any] | None = None
    app_deps: Any = None
    engines: tuple[AsyncEngine, ...] = ()
    ledger: Ledger | None = None
    inbound: Inbound | None = None

    def check(self) -> None:
        """Refuse an application whose code rules name actions it does not have.

        Raises:
            InvalidApplication: Naming each rule and the action it is missing.
        """
        missing = [
            f"rule {rule.name} runs {rule.then.action!r}, which is not among the actions"
            for rule in self.rules.rules.values()
            if rule.then.action not in self.actions
        ]
        if missing:
            raise InvalidApplication("; ".join(missing))

    async def aclose(self) -> None:
        """Dispose of the engines: no connection, SQLite lock or transaction is left open."""
        for engine in self.engines:
            await engine.dispose()


@dataclass(frozen=True)
class SharedStorage:
    """Both libraries' storage on one database (their tables are prefixed, each library keeps
    its own migration version).

    Attributes:
        artifacts: artifactr's storage.
        rules: reflexr's storage.
        engine: The database's engine, or None for in-memory storage. Put it in
            ``Application.engines`` so relayr disposes of it.
    """

    artifacts: ArtifactStorage
    rules: RuleStorage
    engine: AsyncEngine | None

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        return () if self.engine is None else (self.engine,)


def create_engine(database_url: str, *, libraries: Collection[Library] = BOTH) -> AsyncEngine:
    """Return an engine for a SQLite or PostgreSQL URL, as both libraries need it.

    SQLite goes through the libraries' ``create_sqlite_engine`` (one connection, ``BEGIN
    IMMEDIATE``): a plain engine loses most concurrent writes. Both libraries export the same
    function; it is imported from one of ``libraries``, so a command that uses one library
    imports no other. The file's folder is created if missing, so the embedded default works on
    a fresh clone.
    """
    if database_url.startswith("sqlite"):
        if "reflexr" in libraries:
            from reflexr.sql import create_sqlite_engine
        else:
            from artifactr.sql import create_sqlite_engine
        from sqlalchemy import event

        path = database_url.partition(":///")[2]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_sqlite_engine(database_url, connect_args={"timeout": SQLITE_LOCK_TIMEOUT_S})
        event.listen(engine.sync_engine, "connect", _write_ahead)
        return engine
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine(database_url, pool_pre_ping=True)


def _write_ahead(connection: Any, _record: Any) -> None:
    """Put a SQLite file in write-ahead-log mode, syncing at checkpoints (ADR-0025).

    A commit then appends to the log instead of rewriting pages and flushing the disk twice,
    and readers (the dispatcher, ``relayr runs``, the demo's polls) no longer wait for writers.
    A commit survives a crash of its process; only a crash of the machine may lose the last
    ones, as in PostgreSQL with ``synchronous_commit=off``. The mode is kept in the file.
    """
    cursor = connection.cursor()
    try:
        cursor.execute(f"PRAGMA journal_mode={SQLITE_JOURNAL_MODE}")
        cursor.execute(f"PRAGMA synchronous={SQLITE_SYNCHRONOUS}")
    finally:
        cursor.close()


async def migrate(engine: AsyncEngine, libraries: Collection[Library] = BOTH) -> None:
    """Bring the tables of ``libraries`` (both by default) up to date; a no-op when they are.

    On PostgreSQL an advisory lock, held on a connection of its own, makes processes that start
    together migrate one at a time. SQLite needs none: each migration is a ``BEGIN IMMEDIATE``
    transaction, which takes the file's write lock.

    Tables already up to date, as at almost every start, are found so with one read of each
    library's revision, without loading the migrations: on PostgreSQL before the lock
    (ADR-0124), on SQLite in the migration's own transaction (ADR-0126).
    """
    from relayr.migrations import SCHEMAS, revisions

    schemas = tuple(schema for schema in SCHEMAS if schema.name in libraries)
    if engine.dialect.name != "postgresql":
        await _upgrade_behind(engine, schemas)
        return
    if all(found.at_head for found in await revisions(engine, schemas)):
        return
    from sqlalchemy import text

    async with engine.connect() as lock:
        async with asyncio.timeout(MIGRATION_LOCK_TIMEOUT_S):
            await lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
        await lock.commit()
        try:
            await _upgrade_behind(engine, schemas)
        finally:
            await lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
            await lock.commit()


async def _upgrade_behind(engine: AsyncEngine, schemas: tuple[Schema, ...]) -> None:
    """Upgrade, in one transaction, each of ``schemas`` that is behind its head."""
    from relayr.migrations import upgrade_behind

    async with engine.begin() as connection:
        await connection.run_sync(upgrade_behind, schemas)


async def open_storage(settings: Settings) -> SharedStorage:
    """Open both libraries' storage on ``settings.database_url``, migrated.

    ``memory://`` keeps both in this process: for tests, and for one process that runs the
    dispatcher and its worker together.
    """
    import artifactr.sql
    import reflexr.sql
    from artifactr.workspace import InMemoryStorage as ArtifactMemory
    from reflexr.workspace import InMemoryStorage as RuleMemory

    if settings.database_url.startswith("memory://"):
        return SharedStorage(artifacts=ArtifactMemory(), rules=RuleMemory(), engine=None)
    engine = create_engine(settings.database_url)
    try:
        await migrate(engine)
    except BaseException:
        await engine.dispose()
        raise
    return SharedStorage(
        artifacts=artifactr.sql.SqlStorage(engine),
        rules=reflexr.sql.SqlStorage(engine),
        engine=engine,
    )


def load_factory(reference: str) -> Factory:
    """Return the factory ``package.module:function`` names.

    Raises:
        InvalidApplication: If the module cannot be imported, has no such attribute, or it is
            not an ``async`` function.
    """
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise InvalidApplication(
            f"application {reference!r} is invalid: name it as package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as missing:
        raise InvalidApplication(
            f"application {reference!r} cannot be imported: {missing}"
        ) from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise InvalidApplication(f"application {reference!r}: {module_name} has no {attribute}")
    if not inspect.iscoroutinefunction(factory):
        raise InvalidApplication(
            f"application {reference!r} is not an async function of the settings"
        )
    return cast(Factory, factory)


async def load_application(settings: Settings) -> Application:
    """Build the application ``settings.app`` names, in the running event loop.

    Raises:
        InvalidApplication: If the factory cannot be loaded, returns something else than an
            :class:`Application`, or its rules name actions it does not have.
    """
    built = await load_factory(settings.app)(settings)
    if not isinstance(built, Application):
        raise InvalidApplication(
            f"application {settings.app!r} returned {type(built).__name__}, not an Application"
        )
    try:
        built.check()
    except InvalidApplication:
        await built.aclose()
        raise
    return built
