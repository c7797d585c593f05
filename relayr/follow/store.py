"""Where followers keep their place: a cursor and a lease per workspace, and dead letters.

Cursor and lease share one row, so taking the lease returns the cursor and moving the cursor
renews the lease. A cursor only moves forward, and only its lease holder moves it (ADR-0065).
:class:`InMemoryFollowStore` and :class:`SqlFollowStore` keep one contract; the SQL tables are
made and changed by relayr's migrations, as the ledger's are. Times are the caller's clock in
UTC: every following process must keep its clock in step.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    MetaData,
    Table,
    Text,
    case,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.ledger.port import WorkspaceKey
from relayr.ledger.sql import SqlStore, in_workspace


@dataclass(frozen=True)
class DeadLetter:
    """An envelope a follower could not bridge, and why.

    Attributes:
        workspace: Where it is.
        envelope_id: Its artifactr id (the id it is published under once replayed).
        seq: Its position in artifactr's log.
        event_type: artifactr's event type.
        reason: A stable code: ``projection_failed``, ``cause_missing`` or ``depth_exceeded``.
        error: What went wrong, for people.
        dead_at: When it was first dead-lettered.
        tries: How many times it failed: once, plus each replay that failed again.
        replayed_at: When a replay bridged it; None while it waits.
    """

    workspace: WorkspaceKey
    envelope_id: str
    seq: int
    event_type: str
    reason: str
    error: str
    dead_at: datetime
    tries: int = 1
    replayed_at: datetime | None = None

    def details(self) -> dict[str, Any]:
        """Every field but the workspace, by name, in order: what a row of the store holds, and
        ``relayr follow dead-letters list`` prints, beside the workspace."""
        return {
            "envelope_id": self.envelope_id,
            "seq": self.seq,
            "event_type": self.event_type,
            "reason": self.reason,
            "error": self.error,
            "dead_at": self.dead_at,
            "tries": self.tries,
            "replayed_at": self.replayed_at,
        }


@dataclass(frozen=True)
class Position:
    """A followed workspace: how far its follower got, and who holds its lease until when."""

    workspace: WorkspaceKey
    cursor: int
    holder: str | None
    held_until: datetime | None


class FollowStore(Protocol):
    """Cursors, leases and dead letters of the followers. Adapters: in memory and SQL."""

    async def take(
        self, workspace: WorkspaceKey, holder: str, *, until: datetime, now: datetime
    ) -> int | None:
        """Take or renew the workspace's lease for ``holder`` up to ``until``; return the cursor.

        None when another holder's lease runs past ``now``: this holder must not follow.
        """
        ...

    async def advance(
        self,
        workspace: WorkspaceKey,
        holder: str,
        cursor: int,
        *,
        until: datetime,
        dead: Sequence[DeadLetter] = (),
    ) -> bool:
        """In one transaction: move the cursor forward to ``cursor`` (never back), renew the
        lease up to ``until`` and keep ``dead`` (an envelope dead already keeps its letter).

        False, and nothing written, when ``holder`` no longer holds the lease.
        """
        ...

    async def release(self, workspace: WorkspaceKey, holder: str) -> None:
        """Give the lease up, if ``holder`` has it, so another follower may start at once."""
        ...

    async def positions(self) -> list[Position]:
        """Every followed workspace, by tenant and workspace."""
        ...

    async def dead_letters(
        self, workspace: WorkspaceKey | None = None, *, replayed: bool = False
    ) -> list[DeadLetter]:
        """The dead letters waiting (with ``replayed``, also those replayed), oldest first."""
        ...

    async def replayed(
        self, workspace: WorkspaceKey, envelope_ids: Collection[str], *, at: datetime
    ) -> None:
        """Mark dead letters as bridged by a replay."""
        ...

    async def failed_again(self, letter: DeadLetter) -> None:
        """Count one more failure of a dead letter, with its new reason and error."""
        ...


class InMemoryFollowStore:
    """The contract in one process's memory; lost when it ends."""

    def __init__(self) -> None:
        self._positions: dict[WorkspaceKey, Position] = {}
        self._dead: dict[tuple[WorkspaceKey, str], DeadLetter] = {}

    async def take(
        self, workspace: WorkspaceKey, holder: str, *, until: datetime, now: datetime
    ) -> int | None:
        found = self._positions.get(workspace) or Position(workspace, 0, None, None)
        if not _free(found, holder, now):
            return None
        self._positions[workspace] = replace(found, holder=holder, held_until=until)
        return found.cursor

    async def advance(
        self,
        workspace: WorkspaceKey,
        holder: str,
        cursor: int,
        *,
        until: datetime,
        dead: Sequence[DeadLetter] = (),
    ) -> bool:
        found = self._positions.get(workspace)
        if found is None or found.holder != holder:
            return False
        self._positions[workspace] = replace(
            found, cursor=max(found.cursor, cursor), held_until=until
        )
        for letter in dead:
            self._dead.setdefault((letter.workspace, letter.envelope_id), letter)
        return True

    async def release(self, workspace: WorkspaceKey, holder: str) -> None:
        found = self._positions.get(workspace)
        if found is not None and found.holder == holder:
            self._positions[workspace] = replace(found, holder=None, held_until=None)

    async def positions(self) -> list[Position]:
        return [self._positions[key] for key in sorted(self._positions, key=workspace_order)]

    async def dead_letters(
        self, workspace: WorkspaceKey | None = None, *, replayed: bool = False
    ) -> list[DeadLetter]:
        found = [
            letter
            for letter in self._dead.values()
            if (workspace is None or letter.workspace == workspace)
            and (replayed or letter.replayed_at is None)
        ]
        return sorted(found, key=lambda letter: (workspace_order(letter.workspace), letter.seq))

    async def replayed(
        self, workspace: WorkspaceKey, envelope_ids: Collection[str], *, at: datetime
    ) -> None:
        for envelope_id in envelope_ids:
            letter = self._dead.get((workspace, envelope_id))
            if letter is not None:
                self._dead[(workspace, envelope_id)] = replace(letter, replayed_at=at)

    async def failed_again(self, letter: DeadLetter) -> None:
        found = self._dead.get((letter.workspace, letter.envelope_id))
        if found is not None:
            self._dead[(letter.workspace, letter.envelope_id)] = replace(
                found, reason=letter.reason, error=letter.error, tries=found.tries + 1
            )


def _free(position: Position, holder: str, now: datetime) -> bool:
    return (
        position.holder is None
        or position.holder == holder
        or position.held_until is None
        or position.held_until <= now
    )


def workspace_order(key: WorkspaceKey) -> tuple[str, str]:
    """The order workspaces are listed and followed in: by tenant, then workspace."""
    return (key.tenant_id, key.workspace_id)


metadata = MetaData()
"""The followers' tables as the code reads and writes them. relayr's migrations make them: a
change here is a new migration too (the migration tests compare the two)."""

cursors_table = Table(
    "relayr_follow_cursors",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("cursor", BigInteger, nullable=False),
    Column("holder", Text, nullable=True),
    Column("held_until", DateTime(timezone=True), nullable=True),
)

dead_letters_table = Table(
    "relayr_follow_dead_letters",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("envelope_id", Text, primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("dead_at", DateTime(timezone=True), nullable=False),
    Column("tries", Integer, nullable=False),
    Column("replayed_at", DateTime(timezone=True), nullable=True),
)

_WORKSPACE_KEY: Final = ("tenant_id", "workspace_id")
_LETTER_KEY: Final = ("tenant_id", "workspace_id", "envelope_id")


class SqlFollowStore(SqlStore):
    """The contract in SQLite or PostgreSQL: one short transaction per call.

    It borrows an engine (usually the one both libraries and the ledger use) and never disposes
    of it. On SQLite that engine has one connection: never call the store while holding one.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine, refusal="followers store")

    async def take(
        self, workspace: WorkspaceKey, holder: str, *, until: datetime, now: datetime
    ) -> int | None:
        table = cursors_table
        insert = self._insert(table).values(
            tenant_id=workspace.tenant_id,
            workspace_id=workspace.workspace_id,
            cursor=0,
            holder=holder,
            held_until=until,
        )
        taken = insert.on_conflict_do_update(
            index_elements=_WORKSPACE_KEY,
            set_={"holder": holder, "held_until": until},
            where=or_(
                table.c.holder.is_(None),
                table.c.holder == holder,
                table.c.held_until.is_(None),
                table.c.held_until <= now,
            ),
        ).returning(table.c.cursor)
        async with self._transaction() as connection:
            cursor = (await connection.execute(taken)).scalar()
        return None if cursor is None else int(cursor)

    async def advance(
        self,
        workspace: WorkspaceKey,
        holder: str,
        cursor: int,
        *,
        until: datetime,
        dead: Sequence[DeadLetter] = (),
    ) -> bool:
        table = cursors_table
        moved = (
            update(table)
            .where(in_workspace(table, workspace), table.c.holder == holder)
            .values(
                cursor=case((table.c.cursor < cursor, cursor), else_=table.c.cursor),
                held_until=until,
            )
        )
        async with self._transaction() as connection:
            if (await connection.execute(moved)).rowcount != 1:
                return False
            if dead:
                letters = self._insert(dead_letters_table).on_conflict_do_nothing(
                    index_elements=_LETTER_KEY
                )
                await connection.execute(letters, [_letter_row(letter) for letter in dead])
        return True

    async def release(self, workspace: WorkspaceKey, holder: str) -> None:
        table = cursors_table
        released = (
            update(table)
            .where(in_workspace(table, workspace), table.c.holder == holder)
            .values(holder=None, held_until=None)
        )
        async with self._transaction() as connection:
            await connection.execute(released)

    async def positions(self) -> list[Position]:
        table = cursors_table
        query = select(table).order_by(table.c.tenant_id, table.c.workspace_id)
        async with self._transaction() as connection:
            rows = (await connection.execute(query)).all()
        return [
            Position(
                WorkspaceKey(row.tenant_id, row.workspace_id),
                int(row.cursor),
                row.holder,
                _utc(row.held_until),
            )
            for row in rows
        ]

    async def dead_letters(
        self, workspace: WorkspaceKey | None = None, *, replayed: bool = False
    ) -> list[DeadLetter]:
        table = dead_letters_table
        query = select(table).order_by(table.c.tenant_id, table.c.workspace_id, table.c.seq)
        if workspace is not None:
            query = query.where(in_workspace(table, workspace))
        if not replayed:
            query = query.where(table.c.replayed_at.is_(None))
        async with self._transaction() as connection:
            rows = (await connection.execute(query)).all()
        return [_letter(row) for row in rows]

    async def replayed(
        self, workspace: WorkspaceKey, envelope_ids: Collection[str], *, at: datetime
    ) -> None:
        if not envelope_ids:
            return
        table = dead_letters_table
        marked = (
            update(table)
            .where(in_workspace(table, workspace), table.c.envelope_id.in_(list(envelope_ids)))
            .values(replayed_at=at)
        )
        async with self._transaction() as connection:
            await connection.execute(marked)

    async def failed_again(self, letter: DeadLetter) -> None:
        table = dead_letters_table
        counted = (
            update(table)
            .where(in_workspace(table, letter.workspace), table.c.envelope_id == letter.envelope_id)
            .values(reason=letter.reason, error=letter.error, tries=table.c.tries + 1)
        )
        async with self._transaction() as connection:
            await connection.execute(counted)


def _letter_row(letter: DeadLetter) -> dict[str, Any]:
    return {
        "tenant_id": letter.workspace.tenant_id,
        "workspace_id": letter.workspace.workspace_id,
        **letter.details(),
    }


def _letter(row: Any) -> DeadLetter:
    dead_at = _utc(row.dead_at)
    assert dead_at is not None, "dead_at is not nullable"
    return DeadLetter(
        workspace=WorkspaceKey(row.tenant_id, row.workspace_id),
        envelope_id=row.envelope_id,
        seq=int(row.seq),
        event_type=row.event_type,
        reason=row.reason,
        error=row.error,
        dead_at=dead_at,
        tries=int(row.tries),
        replayed_at=_utc(row.replayed_at),
    )


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands times back without their zone; every time stored here is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
