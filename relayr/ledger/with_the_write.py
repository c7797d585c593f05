"""Ledger rows that ride in the storage's own transaction (ADR-0023).

Under :func:`with_the_write`, the first top-level commit of an ORM session bound to the ledger's
engine (in this task or one it starts) executes the ledger's statements on that session's
connection first, so a write that exists always has its cause. A savepoint never carries them and
a rollback drops them: the caller then sees ``committed`` false and decides
(:meth:`relayr.ledger.Ledger.alongside` writes them itself).
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

from relayr.ledger.port import LedgerWrites

type Statements = Sequence[tuple[Executable, Sequence[Mapping[str, Any]]]]


@dataclass
class _Ride:
    """The ledger's statements waiting for a commit on ``engine``, and who carries them."""

    engine: Engine
    statements: Statements
    writes: LedgerWrites
    carrier: Session | None = None


_ride: ContextVar[_Ride | None] = ContextVar("relayr_ledger_ride", default=None)


@contextmanager
def with_the_write(engine: Engine, statements: Statements, writes: LedgerWrites) -> Iterator[None]:
    """Let ``statements`` ride the block's first commit on ``engine``; that commit marks
    ``writes`` committed. Blocks do not nest: an inner one replaces the outer one meanwhile."""
    token = _ride.set(_Ride(engine, statements, writes))
    try:
        yield
    finally:
        _ride.reset(token)


def _waiting(session: Session) -> _Ride | None:
    ride = _ride.get()
    if ride is None or ride.writes.committed or session.in_nested_transaction():
        return None
    return ride


@event.listens_for(Session, "before_commit")
def _carry(session: Session) -> None:
    ride = _waiting(session)
    if ride is None or ride.carrier is not None or session.get_bind() is not ride.engine:
        return
    connection = session.connection()
    for statement, rows in ride.statements:
        if rows:
            connection.execute(statement, list(rows))
    ride.carrier = session


@event.listens_for(Session, "after_commit")
def _carried(session: Session) -> None:
    ride = _waiting(session)
    if ride is not None and ride.carrier is session:
        ride.writes.committed = True


@event.listens_for(Session, "after_rollback")
def _dropped(session: Session) -> None:
    ride = _ride.get()
    if ride is not None and ride.carrier is session:
        ride.carrier = None
