"""Which workspaces' logs moved, as the store says, whoever wrote them (ADR-0091).

A :class:`ChangeFeed` gathers the workspaces whose reflexr log (rules to evaluate) or artifactr
log (envelopes to follow) grew; the dispatcher takes what gathered and waits on it otherwise.
PostgreSQL: a trigger on both libraries' workspace rows sends ``NOTIFY`` on :data:`CHANNEL`,
heard on a connection of the feed's own. SQLite: the trigger writes into
:data:`CHANGES_TABLE`, read when ``PRAGMA data_version`` moved, asked when the database's files
are written (inotify) and every :data:`SQLITE_QUIET_POLL_S` besides. In memory: reflexr's
storage signals as it commits. A notification may be lost; the feed then says so
(:attr:`Changes.everything`), and :meth:`ChangeFeed.heads` is the one read the dispatcher's
sweep compares. :func:`install` brings relayr's migrations (which create the triggers) to head
at start.
"""

import asyncio
import contextlib
import json
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import structlog
from sqlalchemy import BigInteger, Column, Index, MetaData, Table, Text, text
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.migrations import upgrade

logger = structlog.get_logger("relayr.dispatch")

type Source = Literal["reflexr", "artifactr"]
type Workspace = tuple[str, str]
"""A workspace, as ``(tenant_id, workspace_id)``."""

SOURCES: Final[dict[Source, str]] = {
    "reflexr": "reflexr_workspaces",
    "artifactr": "artifactr_workspaces",
}
"""Each library's workspace table: one row per workspace, its ``head_seq`` the log's last seq,
updated in the transaction that appends."""

CHANNEL: Final = "relayr_changes"
"""The PostgreSQL notification channel; a payload is ``["reflexr"|"artifactr", tenant,
workspace]`` as JSON."""

metadata = MetaData()

changes_table = Table(
    "relayr_changes",
    metadata,
    Column("source", Text, primary_key=True),
    Column("tenant_id", Text, primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Index("ix_relayr_changes_version", "version"),
)
"""The workspaces whose logs moved, each with the version of its latest move: written by
SQLite's triggers (PostgreSQL's notify instead), created by relayr's migrations."""

CHANGES_TABLE: Final = changes_table.name

SQLITE_POLL_S: Final = 0.01
"""How often the SQLite feed asks whether another connection committed while the database's
files are being written (a pragma answered from shared memory), and always where inotify is
unavailable."""

SQLITE_BUSY_S: Final = 0.1
"""How long after a write to the database's files the feed goes on asking every
:data:`SQLITE_POLL_S`: a commit's writes come before the commit shows (an fsync, then the WAL
index in shared memory, which inotify does not see)."""

SQLITE_QUIET_POLL_S: Final = 1.0
"""How often the feed asks when nothing wrote the database's files: what a commit whose writes
it missed waits at most (a change noted by the sweep costs more)."""

SUFFIXES: Final = ("-wal", "-journal")
"""The files beside a SQLite database that a commit writes (WAL mode, or a rollback journal)."""

RECONNECT_S: Final = 1.0
"""How long the PostgreSQL feed waits before it listens again after losing its connection."""


@dataclass
class Changes:
    """What moved since the last :meth:`ChangeFeed.take`.

    Attributes:
        rules: Workspaces whose reflexr log grew.
        artifacts: Workspaces whose artifactr log grew.
        everything: Notifications may have been lost: compare every workspace (sweep).
    """

    rules: set[Workspace] = field(default_factory=set)
    artifacts: set[Workspace] = field(default_factory=set)
    everything: bool = False

    def __bool__(self) -> bool:
        return bool(self.rules or self.artifacts or self.everything)


@dataclass(frozen=True)
class Heads:
    """Every workspace's head, as the sweep compares them: reflexr's and artifactr's (None when
    artifactr's tables are not in this database: its logs are then followed every pass)."""

    rules: dict[Workspace, int]
    artifacts: dict[Workspace, int] | None


class ChangeFeed(ABC):
    """Gathers moved workspaces; the dispatcher waits on it and takes what gathered."""

    sees_artifacts: bool = True
    """Whether artifactr's logs are seen moving too (else every pass follows them all)."""

    def __init__(self) -> None:
        self._changes = Changes()
        self._woken = asyncio.Event()

    @abstractmethod
    async def start(self) -> None:
        """Begin gathering (install what the store needs, listen)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop gathering and close what was opened."""

    @abstractmethod
    async def heads(self) -> Heads | None:
        """Every workspace's head, in one read per library; None where the store cannot say
        cheaply (the sweep then asks each workspace)."""

    def take(self) -> Changes:
        """What gathered since the last call; the feed starts afresh."""
        taken, self._changes = self._changes, Changes()
        self._woken.clear()
        return taken

    async def wait(self, timeout_s: float) -> None:
        """Return when something gathered, or after ``timeout_s``."""
        await set_within(self._woken, timeout_s)

    @property
    def woken(self) -> bool:
        """Whether something gathered since the last :meth:`take`."""
        return self._woken.is_set()

    def noted(self, source: Source, tenant_id: str, workspace_id: str) -> None:
        """A workspace's log moved."""
        found = self._changes.rules if source == "reflexr" else self._changes.artifacts
        found.add((tenant_id, workspace_id))
        self._woken.set()

    def lost(self) -> None:
        """Notifications may have been lost: the next pass sweeps."""
        self._changes.everything = True
        self._woken.set()


class PostgresFeed(ChangeFeed):
    """``LISTEN`` on :data:`CHANNEL`, on an asyncpg connection of its own.

    A lost connection counts as lost notifications (a sweep), and is opened again every
    :data:`RECONNECT_S` until it listens.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__()
        self._engine = engine
        self._dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._connection: Any = None
        self._keeper: asyncio.Task[None] | None = None
        self._closed = False
        self._dropped = asyncio.Event()

    async def start(self) -> None:
        self.sees_artifacts = "artifactr" in await install(self._engine)
        await self._listen()
        self._keeper = asyncio.create_task(self._keep_listening())

    async def aclose(self) -> None:
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()

    async def heads(self) -> Heads:
        return await read_heads(self._engine)

    async def _listen(self) -> None:
        import asyncpg  # type: ignore[import-untyped]

        connection = await asyncpg.connect(self._dsn)
        await connection.add_listener(CHANNEL, self._notified)
        connection.add_termination_listener(lambda _: self._dropped.set())
        self._connection = connection

    def _notified(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            source, tenant_id, workspace_id = json.loads(payload)
        except (ValueError, TypeError):
            logger.warning("change notification not understood", payload=payload[:200])
            self.lost()
            return
        self.noted(source, tenant_id, workspace_id)

    async def _keep_listening(self) -> None:
        while not self._closed:
            await self._dropped.wait()
            self._dropped.clear()
            self.lost()
            logger.warning("change notifications lost: the listening connection closed")
            while not self._closed:
                await asyncio.sleep(RECONNECT_S)
                try:
                    await self._listen()
                except Exception:
                    logger.warning("listening for changes again failed", exc_info=True)
                    continue
                self.lost()  # what committed while no one listened
                break


class SqliteFeed(ChangeFeed):
    """Asks ``PRAGMA data_version`` on a read-only connection of its own, and reads
    :data:`CHANGES_TABLE` past the last version seen when it moved.

    It asks when the database's files are written (inotify on their folder, whichever process
    wrote them), every :data:`SQLITE_POLL_S` for :data:`SQLITE_BUSY_S` after, and every
    :data:`SQLITE_QUIET_POLL_S` otherwise: an idle database costs nothing. Without inotify it
    asks every ``poll_s``.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        poll_s: float = SQLITE_POLL_S,
        quiet_poll_s: float = SQLITE_QUIET_POLL_S,
    ) -> None:
        super().__init__()
        self._engine = engine
        self._path = Path(str(engine.url.database)).absolute()
        self._uri = f"{self._path.as_uri()}?mode=ro"
        self._poll_s = poll_s
        self._quiet_poll_s = quiet_poll_s
        self._connection: sqlite3.Connection | None = None
        self._writes: FileWrites | None = None
        self._poller: asyncio.Task[None] | None = None
        self._seen = 0

    async def start(self) -> None:
        self.sees_artifacts = "artifactr" in await install(self._engine)
        connection = sqlite3.connect(
            self._uri,
            uri=True,
            timeout=1.0,
            check_same_thread=False,
        )
        connection.isolation_level = None
        self._connection = connection
        (self._seen,) = connection.execute(
            f"SELECT coalesce(max(version), 0) FROM {CHANGES_TABLE}"
        ).fetchone()
        self._writes = FileWrites.watching(self._path)
        self._poller = asyncio.create_task(self._poll())

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._writes is not None:
            self._writes.close()
        if self._connection is not None:
            self._connection.close()

    async def heads(self) -> Heads:
        return await read_heads(self._engine)

    async def _poll(self) -> None:
        connection, writes = self._connection, self._writes
        assert connection is not None
        loop = asyncio.get_running_loop()
        version: int | None = None
        busy_until = 0.0
        while True:
            try:
                (now,) = connection.execute("PRAGMA data_version").fetchone()
                if now != version:
                    version = now
                    self._read(connection)
            except sqlite3.Error:
                logger.warning("reading changes failed; the next poll tries again", exc_info=True)
                self.lost()
            if writes is None:
                await asyncio.sleep(self._poll_s)
                continue
            if loop.time() < busy_until:
                await asyncio.sleep(self._poll_s)
                written = writes.take()
            else:
                written = await writes.wait(self._quiet_poll_s)
            if written:
                busy_until = loop.time() + SQLITE_BUSY_S

    def _read(self, connection: sqlite3.Connection) -> None:
        rows = connection.execute(
            f"SELECT source, tenant_id, workspace_id, version FROM {CHANGES_TABLE} "
            "WHERE version > ? ORDER BY version",
            (self._seen,),
        ).fetchall()
        for source, tenant_id, workspace_id, version in rows:
            self.noted(source, tenant_id, workspace_id)
            self._seen = max(self._seen, version)


class FileWrites:
    """Whether a SQLite database's files (the database, its WAL, its journal) were written,
    told by inotify on their folder, on the running event loop."""

    def __init__(self, inotify: Any, names: frozenset[str], overflow: int) -> None:
        self._inotify = inotify
        self._names = names
        self._overflow = overflow
        self._written = asyncio.Event()
        asyncio.get_running_loop().add_reader(inotify.fileno(), self._read)

    @classmethod
    def watching(cls, database: Path) -> "FileWrites | None":
        """Watching ``database``'s files; None (with one log line) where inotify cannot be had:
        the feed then polls."""
        try:
            from inotify_simple import INotify, flags

            inotify = INotify(nonblocking=True)
        except (ImportError, OSError, AttributeError) as error:
            logger.warning("the SQLite change feed polls: inotify is unavailable", error=str(error))
            return None
        try:
            inotify.add_watch(
                database.parent, flags.MODIFY | flags.CREATE | flags.MOVED_TO | flags.ONLYDIR
            )
        except OSError as error:
            inotify.close()
            logger.warning(
                "the SQLite change feed polls: its folder cannot be watched",
                folder=str(database.parent),
                error=str(error),
            )
            return None
        names = frozenset({database.name, *(database.name + suffix for suffix in SUFFIXES)})
        return cls(inotify, names, flags.Q_OVERFLOW)

    def _read(self) -> None:
        # an overflowed queue dropped events: any of them may have been a commit's
        if any(
            event.name in self._names or event.mask & self._overflow
            for event in self._inotify.read(timeout=0)
        ):
            self._written.set()

    def take(self) -> bool:
        """Whether the files were written since the last call."""
        written = self._written.is_set()
        self._written.clear()
        return written

    async def wait(self, timeout_s: float) -> bool:
        """Whether the files were written, waiting for it up to ``timeout_s``."""
        await set_within(self._written, timeout_s)
        return self.take()

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self._inotify.fileno())
        self._inotify.close()


class MemoryFeed(ChangeFeed):
    """reflexr's in-memory storage signals the feed as each transaction commits.

    Its ``transaction`` is wrapped on the instance given (a process-local store has no other
    way to say it changed). artifactr's in-memory logs are not seen: the dispatcher follows
    every workspace each pass instead (:attr:`sees_artifacts`).
    """

    sees_artifacts = False

    def __init__(self, rules: Any) -> None:
        super().__init__()
        opened = rules.transaction

        @asynccontextmanager
        async def transaction(ref: Any) -> AsyncIterator[Any]:
            async with opened(ref) as begun:
                yield begun
            self.noted("reflexr", ref.tenant_id, ref.workspace_id)

        rules.transaction = transaction

    async def start(self) -> None:
        """Nothing to install: the storage signals as it commits."""

    async def aclose(self) -> None:
        """Nothing to close."""

    async def heads(self) -> None:
        return None


async def set_within(event: asyncio.Event, timeout_s: float) -> None:
    """Return when ``event`` is set, or after ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


def feed_for(engines: tuple[AsyncEngine, ...], rules: Any) -> ChangeFeed:
    """The feed for an application's store: its first engine's database, else reflexr's
    in-memory storage ``rules``."""
    if engines:
        engine = engines[0]
        if engine.dialect.name == "postgresql":
            return PostgresFeed(engine)
        if engine.dialect.name == "sqlite":
            return SqliteFeed(engine)
    return MemoryFeed(rules)


async def install(engine: AsyncEngine) -> set[Source]:
    """Bring relayr's tables to head (their migrations create the triggers and the changes
    table, ADR-0091); return the libraries whose workspace tables the triggers watch."""
    await upgrade(engine)
    async with engine.connect() as connection:
        return set(await _tables(connection))


async def _tables(connection: Any) -> dict[Source, str]:
    def present(sync: Any) -> set[str]:
        from sqlalchemy import inspect

        return set(inspect(sync).get_table_names())

    found = await connection.run_sync(present)
    return {source: table for source, table in SOURCES.items() if table in found}


async def read_heads(engine: AsyncEngine) -> Heads:
    """Every workspace's head on ``engine``'s database, in one read per library (workspaces
    whose log is empty left out)."""
    found: dict[Source, dict[Workspace, int]] = {}
    async with engine.connect() as connection:
        for source, table in (await _tables(connection)).items():
            rows = await connection.execute(
                text(f"SELECT tenant_id, workspace_id, head_seq FROM {table} WHERE head_seq > 0")
            )
            found[source] = {(row[0], row[1]): int(row[2]) for row in rows}
    return Heads(rules=found.get("reflexr", {}), artifacts=found.get("artifactr"))
