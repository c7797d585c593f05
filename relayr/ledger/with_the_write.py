"""relayr's rows that ride in the storage's own transaction (ADR-0023, ADR-0119).

Under :func:`riding`, the first top-level commit of an ORM session bound to the rider's engine
(in this task or one it starts) runs the rider's work on that session's connection first: the
ledger's rows, so a write that exists always has its cause (:func:`with_the_write`); a limit's
admission or release, so it costs no transaction of its own. A savepoint never carries a rider
and a rollback drops it: the caller then sees ``committed`` false and decides. Blocks of one
kind do not nest: an inner one replaces the outer one meanwhile.
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

from relayr.ledger.port import LedgerWrites

type Statements = Sequence[tuple[Executable, Sequence[Mapping[str, Any]]]]


class Rider(Protocol):
    """Work that rides a commit: ``carry`` runs on the committing connection, then
    ``committed`` is set."""

    committed: bool

    def carry(self, connection: Connection) -> None: ...


@dataclass
class _Ride:
    """A rider waiting for a commit on ``engine``, and the session that carries it."""

    engine: Engine
    rider: Rider
    carrier: Session | None = None


_rides: ContextVar[Mapping[str, _Ride] | None] = ContextVar("relayr_rides", default=None)


def _current() -> Mapping[str, _Ride]:
    return _rides.get() or {}


@contextmanager
def riding(engine: Engine, kind: str, rider: Rider) -> Iterator[None]:
    """Let ``rider`` ride the block's first commit on ``engine``; that commit sets its
    ``committed``. An outer block of the same ``kind`` waits meanwhile."""
    token = _rides.set({**_current(), kind: _Ride(engine, rider)})
    try:
        yield
    finally:
        _rides.reset(token)


@dataclass
class _LedgerRows:
    statements: Statements
    writes: LedgerWrites

    @property
    def committed(self) -> bool:
        return self.writes.committed

    @committed.setter
    def committed(self, value: bool) -> None:
        self.writes.committed = value

    def carry(self, connection: Connection) -> None:
        for statement, rows in self.statements:
            if rows:
                connection.execute(statement, list(rows))


def with_the_write(
    engine: Engine, statements: Statements, writes: LedgerWrites
) -> AbstractContextManager[None]:
    """Let the ledger's ``statements`` ride the block's first commit on ``engine``; that commit
    marks ``writes`` committed."""
    return riding(engine, "ledger", _LedgerRows(statements, writes))


def _waiting(session: Session) -> list[_Ride]:
    if session.in_nested_transaction():
        return []
    return [ride for ride in _current().values() if not ride.rider.committed]


@event.listens_for(Session, "before_commit")
def _carry(session: Session) -> None:
    for ride in _waiting(session):
        if ride.carrier is None and session.get_bind() is ride.engine:
            ride.rider.carry(session.connection())
            ride.carrier = session


@event.listens_for(Session, "after_commit")
def _carried(session: Session) -> None:
    for ride in _waiting(session):
        if ride.carrier is session:
            ride.rider.committed = True


@event.listens_for(Session, "after_rollback")
def _dropped(session: Session) -> None:
    for ride in _current().values():
        if ride.carrier is session:
            ride.carrier = None
