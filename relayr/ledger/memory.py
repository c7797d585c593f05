"""The in-memory ledger: the contract of :mod:`relayr.ledger.port` in one process's memory.

For tests and a worker that needs no durable ledger; the shared contract suite checks it keeps
the SQL ledger's guarantees. :meth:`InMemoryLedger.alongside` keeps causes before the block runs,
takes them back if the block raises, and makes them the ones kept if it completes (ADR-0065).
"""

import json
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager

from relayr.core.emissions import EmissionRecord, validate_emission
from relayr.ledger.port import Cause, LedgerWrites, WorkspaceKey, WriteKind

type _CauseKey = tuple[WorkspaceKey, WriteKind, str]
type _EmissionKey = tuple[int, str]


class InMemoryLedger:
    """Causes and emission records in dicts; lost when the process ends."""

    def __init__(self) -> None:
        self._causes: dict[_CauseKey, Cause] = {}
        self._kept_by: dict[_CauseKey, object] = {}
        """Which block of :meth:`alongside` added or last completed with a cause, so a block
        that raised takes back only its own."""
        self._emissions: dict[tuple[WorkspaceKey, str], dict[_EmissionKey, str]] = {}

    async def record_cause(
        self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause
    ) -> Cause:
        return self._causes.setdefault((workspace, kind, key), cause)

    async def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str) -> Cause | None:
        return self._causes.get((workspace, kind, key))

    async def causes(
        self, workspace: WorkspaceKey, keys: Collection[tuple[WriteKind, str]]
    ) -> dict[tuple[WriteKind, str], Cause]:
        found = ((key, self._causes.get((workspace, *key))) for key in keys)
        return {key: cause for key, cause in found if cause is not None}

    async def record_emission(self, record: EmissionRecord) -> None:
        data = validate_emission(record.to_json()).to_json()
        run = (WorkspaceKey(record.tenant_id, record.workspace_id), record.run_id)
        stored = self._emissions.setdefault(run, {})
        stored.setdefault((record.epoch, record.message_id), json.dumps(data))

    async def emissions(self, workspace: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        stored = self._emissions.get((workspace, run_id), {})
        return [validate_emission(json.loads(text)) for text in stored.values()]

    async def write(self, writes: LedgerWrites) -> None:
        for record in writes.emissions:
            validate_emission(record.to_json())
        for cause in writes.causes:
            await self.record_cause(cause.workspace, cause.kind, cause.key, cause.cause)
        for record in writes.emissions:
            await self.record_emission(record)
        writes.committed = True

    @asynccontextmanager
    async def alongside(self, writes: LedgerWrites) -> AsyncIterator[None]:
        """The causes kept before the block, taken back if it raises and kept over any other
        if it completes; the emission records after it, if it raised nothing."""
        for record in writes.emissions:
            validate_emission(record.to_json())
        block = object()
        added: list[_CauseKey] = []
        for cause in writes.causes:
            key = (cause.workspace, cause.kind, cause.key)
            if key not in self._causes:
                self._causes[key], self._kept_by[key] = cause.cause, block
                added.append(key)
        try:
            yield
        except BaseException:
            for key in added:
                if self._kept_by.get(key) is block:
                    del self._causes[key], self._kept_by[key]
            raise
        for cause in writes.causes:
            key = (cause.workspace, cause.kind, cause.key)
            self._causes[key], self._kept_by[key] = cause.cause, block
        for record in writes.emissions:
            await self.record_emission(record)
        writes.committed = True

    async def aclose(self) -> None:
        """Nothing to release: the records live as long as this object."""
