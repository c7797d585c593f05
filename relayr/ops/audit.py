"""The audit trail: what people did to runs (retry, cancel, skip), who, when and why.

reflexr records each operator operation as a fact in the run's workspace log, under the actor
who made it (``reflexr:run_requeued`` for a retry, ``run_cancelled`` and ``run_skipped`` with
their reason), so the trail needs no store of its own and cannot disagree with what happened:
it is read back from those facts. The command line acts as ``relayr ops``; the console as the
operator it names (:func:`relayr.ops.runs.operator`).
"""

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.ledger.port import WorkspaceKey
from relayr.ops.report import OPERATOR_FACTS, OperatorAction, operator_actions

FACT_TYPES: Final = (
    "reflexr:run_requeued",
    "reflexr:run_cancelled",
    "reflexr:run_skipped",
)
"""The facts an operator operation appends (:data:`relayr.ops.report.OPERATOR_FACTS`)."""


@dataclass(frozen=True)
class AuditEntry:
    """One operator action on one run."""

    workspace: WorkspaceKey
    run_id: str
    rule: str
    action: OperatorAction


async def audit_trail(
    rules: Workspaces, *, limit: int, workspaces: Iterable[WorkspaceRef] | None = None
) -> list[AuditEntry]:
    """The last ``limit`` operator actions across ``workspaces`` (None: every workspace),
    newest first. An operator acts on runs, so the workspaces that hold runs are enough."""
    lists = []
    for ref in await rules.storage.workspaces() if workspaces is None else workspaces:
        key = WorkspaceKey(ref.tenant_id, ref.workspace_id)
        facts = await rules.storage.read(ref, types=FACT_TYPES, last=limit)
        entries = []
        for envelope in reversed(facts):
            if type(envelope.event) not in OPERATOR_FACTS:
                continue
            [action] = operator_actions([(envelope.event, envelope.ts, envelope.actor)])
            event = envelope.event
            entries.append(
                AuditEntry(key, getattr(event, "run_id", ""), getattr(event, "rule", ""), action)
            )
        lists.append(entries)
    merged = heapq.merge(*lists, key=lambda entry: entry.action.at, reverse=True)
    return list(itertools.islice(merged, limit))
