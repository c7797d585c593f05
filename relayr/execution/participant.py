"""RunParticipant: what the actions of one attempt share, as its rule's participant in artifactr.

Who the attempt acts as (``ExternalAgentActor(client_id="reflexr:<rule>")``, in the run's own
workspace), the ids it derives (:mod:`relayr.core.ids`, counted across the whole attempt), its
chain of threads, the allowlist in force when it acts, and the
:class:`~relayr.execution.writes.Writes` every write goes through.
:class:`relayr.execution.actions.RunActions` builds on it.
"""

from typing import Any, Final

import structlog
from artifactr import ExternalAgentActor
from reflexr.workspace import Reaction

from relayr.core.allowlist import Allowlist
from relayr.core.ids import IdDeriver
from relayr.core.refusals import Refusal
from relayr.core.routing import Writer
from relayr.execution.writes import Writes
from relayr.ledger.port import Cause, LedgerWrites, WorkspaceKey
from relayr.runtime.bridge import Bridge

logger = structlog.get_logger("relayr.actions")


def chain_threads(reaction: Reaction[Any]) -> tuple[str, ...]:
    """The threads of the events that made the rule fire, in order, without repeats."""
    threads: dict[str, None] = {}
    for envelope in reaction.events:
        thread_id = envelope.data.get("thread_id")
        if isinstance(thread_id, str) and thread_id:
            threads[thread_id] = None
    return tuple(threads)


class RunParticipant:
    """One attempt of one run in artifactr, as its rule's participant: what its actions share."""

    def __init__(self, bridge: Bridge, reaction: Reaction[Any]) -> None:
        run, rule = reaction.run, reaction.rule
        self._bridge = bridge
        self._run = run
        self.rule: Final = rule.name
        self.workspace: Final = WorkspaceKey(
            reaction.workspace.tenant_id, reaction.workspace.workspace_id
        )
        self.actor: Final = ExternalAgentActor(client_id=f"reflexr:{rule.name}", name=rule.name)
        self._writer = Writer(rule=rule.name, run_id=run.id)
        self._ids = IdDeriver(run.id)
        self._chain: list[str] = list(chain_threads(reaction))
        self._log = logger.bind(
            run_id=run.id,
            rule=rule.name,
            attempt=run.attempts,
            tenant=self.workspace.tenant_id,
            workspace=self.workspace.workspace_id,
        )
        cause = Cause(
            correlation_id=run.correlation_id,
            firing_id=run.causation.firing_id,
            run_id=run.id,
            depth=run.depth,
        )
        self._writes = Writes(bridge, self.workspace, self.actor, cause, self._log)

    @property
    def pending(self) -> LedgerWrites:
        """What the run's completion commits: rows known only after their write."""
        return self._writes.pending

    @property
    def threads(self) -> tuple[str, ...]:
        """The run's chain: its events' threads, then the threads it created."""
        return tuple(self._chain)

    @property
    def allowlist(self) -> Allowlist:
        """The rule's permissions as the allowlist in force says now."""
        return self._bridge.allowlists().for_rule(self.rule)

    @property
    def _segment(self) -> int:
        return self._run.checkpoints

    def _decided[T](self, decision: T | Refusal, operation: str, **where: str) -> T:
        """The core's decision, or its refusal raised as the attempt's failure."""
        if isinstance(decision, Refusal):
            raise self._writes.refused(decision, operation, **where)
        return decision
