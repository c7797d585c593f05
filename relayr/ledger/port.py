"""The ledger port: which run is behind each write, and what each run emitted.

Before relayr writes anything into artifactr, it records the run behind the write under a key
that write alone is found by (a message id, a proposal id, an artifact's revision, ...). The
first record is kept: a retried attempt records the same cause again and changes nothing, so the
ledger answers "which run made this?" for every write, even one whose attempt died right after
it (ADR-0026).
"""

from collections.abc import Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from relayr.core.emissions import EmissionRecord

type WriteKind = Literal["message", "thread", "proposal", "revision", "artifact", "edit", "turn"]
"""What a cause's key names (ADR-0023): a message, a thread or a proposal by its id, derived from
the run; a direct write to an artifact by the revision it made (:func:`revision_key`), since an
artifact's id is shared by every run that writes it. ``artifact`` (a direct write by its
artifact's id) is what relayr recorded before revisions, read only for writes made then.
``edit`` is a direct edit by the edit's own key (:func:`edit_key`), a row that rides only the
edit's write, so a retry finds the edit made (ADR-0102); ``turn`` an agent's turn by its id: the
cause the follower found from the turn's messages, kept so that every later envelope of the turn
finds it in the ledger alone (ADR-0104)."""

MADE_WITH_THEIR_WRITE: frozenset[WriteKind] = frozenset({"revision", "edit"})
"""The kinds of row that say their write was made: committed with it or not at all, never on
their own (a revision may be another run's, an edit's row would make a retry skip it)."""


def edit_key(edit_id: str, value_digest: str) -> str:
    """The key of a direct edit: its derived id (the run, the artifact and path, and how many
    such edits the attempt made before) and the digest of the value it set, so a retry that
    sets the same value finds the edit, and one that sets another value makes its own."""
    return f"{edit_id}/{value_digest}"


def revision_key(artifact_id: str, version: int) -> str:
    """The key of the write that made ``version`` of an artifact: one write makes each version,
    so the key is that write's alone, whoever else writes the artifact (ADR-0065)."""
    return f"{artifact_id}@{version}"


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


@dataclass(frozen=True)
class CauseRecord:
    """A cause to record under the key its write is found by."""

    workspace: WorkspaceKey
    kind: WriteKind
    key: str
    cause: Cause


@dataclass
class LedgerWrites:
    """Causes and emission records to commit together, in one transaction.

    ``committed`` says whether they were: a writer that makes them ride another transaction
    (:meth:`Ledger.alongside`) sets it once that transaction committed.
    """

    causes: list[CauseRecord] = field(default_factory=list)
    emissions: list[EmissionRecord] = field(default_factory=list)
    committed: bool = False

    def __bool__(self) -> bool:
        return bool(self.causes or self.emissions)

    def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause) -> None:
        self.causes.append(CauseRecord(workspace, kind, key, cause))

    def emission(self, record: EmissionRecord) -> None:
        self.emissions.append(record)

    @classmethod
    def merged(cls, many: Sequence["LedgerWrites"]) -> "LedgerWrites":
        """One set of writes holding what ``many`` hold and have not committed."""
        pending = [writes for writes in many if not writes.committed]
        return cls(
            causes=[cause for writes in pending for cause in writes.causes],
            emissions=[record for writes in pending for record in writes.emissions],
        )


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

    async def causes(
        self, workspace: WorkspaceKey, keys: Collection[tuple[WriteKind, str]]
    ) -> dict[tuple[WriteKind, str], Cause]:
        """Return the causes recorded under ``keys`` (kind and key each), in one read; keys with
        none are left out."""
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

    async def write(self, writes: LedgerWrites) -> None:
        """Commit ``writes`` in one transaction of the ledger's own (first cause kept, an
        emission already there left as it is), and mark them committed.

        Raises:
            InvalidEmission: If a record does not validate; nothing is stored.
        """
        ...

    def alongside(self, writes: LedgerWrites) -> AbstractAsyncContextManager[None]:
        """Commit ``writes`` with the storage write the block makes, in the same transaction.

        The causes are committed no later than the block's first commit: in that very
        transaction when the ledger shares the storage's engine (relayr's own wiring); the
        in-memory ledger keeps them before the block runs. A SQL ledger on an engine of its own
        has no transaction to ride and writes them after a block that raised nothing, so a
        reader may meet the write before its cause (the follower dead-letters it
        ``cause_missing``, to replay). The emission records are committed with that transaction,
        or after a block that raised nothing. After a block that raised, what did not commit is
        left for the caller (``writes.committed`` says which) and is not in the ledger: so a
        block that completed keeps its causes even where one that raised recorded first under
        the same key (two runs' edits of one artifact from one version, ADR-0065).

        Raises:
            InvalidEmission: If a record does not validate, before the block runs.
        """
        ...

    async def aclose(self) -> None:
        """Release connections. The ledger is unusable after."""
        ...
