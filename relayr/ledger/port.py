"""The ledger port: which run is behind each write, and what each run emitted.

Before relayr writes anything into artifactr, it records the run behind the write under the id
the write will be found by (a message id, a proposal id, ...). The first record is kept: a
retried attempt records the same cause again and changes nothing, so the ledger answers "which
run made this?" for every write, even one whose attempt died right after it (ADR-0026).
"""

from dataclasses import dataclass
from typing import Literal, Protocol

from relayr.emissions import EmissionRecord

type WriteKind = Literal["message", "thread", "proposal", "artifact"]


@dataclass(frozen=True)
class WorkspaceKey:
    """A tenant's workspace, as both libraries name it."""

    tenant_id: str
    workspace_id: str

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.workspace_id}"


@dataclass(frozen=True)
class Cause:
    """The run behind a write: its chain, its firing, the run itself and its depth."""

    correlation_id: str
    firing_id: str
    run_id: str
    depth: int


class Ledger(Protocol):
    """Where causes and emission records are kept. Adapters: in-memory and SQL."""

    async def record_cause(
        self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause
    ) -> Cause:
        """Record ``cause`` under ``key`` unless a cause is there; return the one kept."""
        ...

    async def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str) -> Cause | None:
        """Return the cause recorded under ``key``, or None."""
        ...

    async def record_emission(self, record: EmissionRecord) -> None:
        """Store a validated emission record; the same (run, attempt, message) again is a no-op.

        Raises:
            InvalidEmission: If the record does not validate; nothing is stored.
        """
        ...

    async def emissions(self, workspace: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        """Return a run's emission records, oldest first, each validated as it is read.

        Raises:
            InvalidEmission: If a stored record does not validate.
        """
        ...

    async def aclose(self) -> None:
        """Release connections. The ledger is unusable after."""
        ...
