"""Chains: which run's causal chain each envelope a follower bridges continues (ADR-0065).

A rule's write continues its run's chain, found in the ledger under the write's own key (ADR-0023;
:data:`MISSING` when the ledger lacks it). A turn's envelope continues the chain of the newest
run-posted message the turn carried out (ADR-0026): the follower that reads the turn's
``run_started`` keeps that cause in the ledger under the turn's id, with the batch, so every
later envelope of the turn finds it there, after any follower's restart; nobody reads a thread
back (ADR-0104). Anything else (a person's writes) starts a chain of its own (None). A whole
batch's causes are read in one ledger read.
"""

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog
from artifactr.core import ArtifactArchived, ArtifactChanged, ArtifactCreated, RunStarted
from artifactr.core import Envelope as ArtifactrEnvelope

from relayr.follow.projections import event_type
from relayr.ledger.port import Cause, Ledger, LedgerWrites, WorkspaceKey, WriteKind, revision_key
from relayr.ledger.turns import newest_cause

logger = structlog.get_logger("relayr.follow")

TURNS_KEPT: Final = 10_000
"""How many turns' message ids a follower keeps in memory from the ``run_started`` it read, for
the ``message_ids`` a bridged ``turn_ended`` carries: its end usually follows in the same or the
next batch. What is not kept (a restarted follower) is bridged with none; a turn's chain never
depends on it (the ledger keeps the turn's cause)."""

RULE_CLIENT_PREFIX: Final = "reflexr:"
"""The client id of a rule's participant in artifactr: ``reflexr:<rule>``
(relayr.execution.actions)."""

_RULE_WRITES: Final[Mapping[str, tuple[WriteKind, str]]] = {
    "message_posted": ("message", "message_id"),
    "thread_created": ("thread", "thread_id"),
    "proposal_created": ("proposal", "proposal_id"),
}
"""Under which key the ledger holds the cause of each kind of write a rule makes by an id derived
from its run (:mod:`relayr.execution.actions`): the kind of write and the event's field that
names it. A direct write to an artifact is found by the revision it made (:func:`rule_write`)."""


class CauseMissing:
    """A rule's write whose cause the ledger does not hold."""


MISSING: Final = CauseMissing()


@dataclass(frozen=True)
class BatchChains:
    """What the chains of one batch's envelopes are found from.

    Attributes:
        turns: The messages each turn of the batch started with, by turn id, as far as known.
        causes: The causes of the batch's rules' writes, by ledger key.
        turn_causes: The cause of each of the batch's turns that a run's message started.
        kept: The causes of the turns that start in the batch, to commit with it, before the
            follower's cursor moves past their start.
    """

    turns: Mapping[str, tuple[str, ...]]
    causes: Mapping[tuple[WriteKind, str], Cause]
    turn_causes: Mapping[str, Cause]
    kept: LedgerWrites = field(default_factory=LedgerWrites)

    def turn_messages(self, envelope: ArtifactrEnvelope) -> tuple[str, ...] | None:
        """The messages the turn that wrote ``envelope`` carried out; None when no turn did."""
        return None if envelope.run_id is None else self.turns.get(envelope.run_id, ())

    def cause_of(self, envelope: ArtifactrEnvelope) -> Cause | CauseMissing | None:
        """The run whose chain ``envelope`` continues; None for a chain of its own, and
        :data:`MISSING` for a rule's write without a cause."""
        if is_rule_author(envelope):
            keys = rule_write(envelope)
            found = next((self.causes[key] for key in keys if key in self.causes), None)
            return MISSING if found is None else found
        if envelope.run_id is not None:
            return self.turn_causes.get(envelope.run_id)
        return None


class Chains:
    """The chains of one follower's batches, from the ledger alone."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._turns: OrderedDict[tuple[WorkspaceKey, str], tuple[str, ...]] = OrderedDict()

    async def of_batch(
        self, key: WorkspaceKey, envelopes: Sequence[ArtifactrEnvelope]
    ) -> BatchChains:
        """The chains of a batch of ``key``'s envelopes, in one read of the ledger.

        A turn that starts in the batch gets its cause from its messages' (ADR-0026), to keep
        under its id (:attr:`BatchChains.kept`); a turn that started before gets the one kept
        then.
        """
        started: dict[str, tuple[str, ...]] = {}
        for envelope in envelopes:
            if isinstance(envelope.event, RunStarted):
                started[envelope.event.run_id] = tuple(envelope.event.message_ids)
                self._keep_turn(key, envelope.event.run_id, envelope.event.message_ids)
        wanted: set[tuple[WriteKind, str]] = set()
        turns: dict[str, tuple[str, ...]] = {}
        for envelope in envelopes:
            wanted.update(rule_write(envelope))
            turn = envelope.run_id
            if turn is not None and turn not in turns:
                turns[turn] = started.get(turn) or self._turns.get((key, turn), ())
                if turn not in started:
                    wanted.add(("turn", turn))
        for message_ids in started.values():
            wanted.update(("message", message_id) for message_id in message_ids)
        causes = await self._ledger.causes(key, wanted) if wanted else {}
        messages = {write: cause for (kind, write), cause in causes.items() if kind == "message"}
        turn_causes = {write: cause for (kind, write), cause in causes.items() if kind == "turn"}
        kept = LedgerWrites()
        for turn, message_ids in started.items():
            cause = newest_cause(message_ids, messages)
            if cause is not None:
                turn_causes[turn] = cause
                kept.cause(key, "turn", turn, cause)
        return BatchChains(turns, causes, turn_causes, kept)

    def _keep_turn(self, key: WorkspaceKey, turn: str, message_ids: Sequence[str]) -> None:
        self._turns[(key, turn)] = tuple(message_ids)
        self._turns.move_to_end((key, turn))
        while len(self._turns) > TURNS_KEPT:
            self._turns.popitem(last=False)


def is_rule_author(envelope: ArtifactrEnvelope) -> bool:
    """Whether a rule's run wrote the envelope: its author is ``external_agent:reflexr:<rule>``."""
    actor = envelope.actor
    return actor.kind == "external_agent" and actor.client_id.startswith(RULE_CLIENT_PREFIX)


def rule_write(envelope: ArtifactrEnvelope) -> tuple[tuple[WriteKind, str], ...]:
    """The ledger keys of a rule's write, in the order to look them up; none when a rule did
    not write the envelope (or wrote something the ledger keeps no cause for).

    A direct write to an artifact is found by the revision it made, which one write alone makes
    (ADR-0065); then by the artifact's id, under which relayr recorded such a write before, so a
    write made then is still found (in the chain of the artifact's first writer, as then).
    """
    if not is_rule_author(envelope):
        return ()
    event = envelope.event
    if isinstance(event, ArtifactCreated | ArtifactChanged | ArtifactArchived):
        return (
            ("revision", revision_key(event.artifact_id, event.version)),
            ("artifact", event.artifact_id),
        )
    found = _RULE_WRITES.get(event_type(envelope))
    if found is None:
        return ()
    kind, attribute = found
    return ((kind, str(getattr(event, attribute))),)
