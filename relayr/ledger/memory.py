"""The in-memory ledger: the contract of :mod:`relayr.ledger.port` in one process's memory.

For tests and for a worker that needs no durable ledger. It keeps the same guarantees as the SQL
adapter, which the shared contract suite checks: the first cause under a key is kept (asyncio runs
one task at a time and ``record_cause`` does not await, so contenders cannot interleave), and an
emission record is stored as the JSON it was validated into and validated again when read.
"""

import json

from relayr.emissions import EmissionRecord, validate_emission
from relayr.ledger.port import Cause, WorkspaceKey, WriteKind

type _CauseKey = tuple[WorkspaceKey, WriteKind, str]
type _EmissionKey = tuple[int, str]


class InMemoryLedger:
    """Causes and emission records in dicts; lost when the process ends."""

    def __init__(self) -> None:
        self._causes: dict[_CauseKey, Cause] = {}
        self._emissions: dict[tuple[WorkspaceKey, str], dict[_EmissionKey, str]] = {}

    async def record_cause(
        self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause
    ) -> Cause:
        return self._causes.setdefault((workspace, kind, key), cause)

    async def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str) -> Cause | None:
        return self._causes.get((workspace, kind, key))

    async def record_emission(self, record: EmissionRecord) -> None:
        data = validate_emission(record.to_json()).to_json()
        run = (WorkspaceKey(record.tenant_id, record.workspace_id), record.run_id)
        stored = self._emissions.setdefault(run, {})
        stored.setdefault((record.epoch, record.message_id), json.dumps(data))

    async def emissions(self, workspace: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        stored = self._emissions.get((workspace, run_id), {})
        return [validate_emission(json.loads(text)) for text in stored.values()]

    async def aclose(self) -> None:
        """Nothing to release: the records live as long as this object."""
