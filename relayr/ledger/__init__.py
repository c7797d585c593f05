"""The ledger: which run is behind each write relayr makes, and what each run emitted.

One port (:class:`Ledger`) and two adapters that keep the same contract, checked by one test
suite: :class:`InMemoryLedger` for tests and :class:`SqlLedger` for SQLite and PostgreSQL.
"""

from relayr.ledger.memory import InMemoryLedger
from relayr.ledger.port import Cause, CauseRecord, Ledger, LedgerWrites, WorkspaceKey, WriteKind
from relayr.ledger.sql import SqlLedger

__all__ = [
    "Cause",
    "CauseRecord",
    "InMemoryLedger",
    "Ledger",
    "LedgerWrites",
    "SqlLedger",
    "WorkspaceKey",
    "WriteKind",
]
