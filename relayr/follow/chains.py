"""Chains: which run's causal chain each envelope a follower bridges continues (ADR-0065).

A rule's write continues its run's chain, found in the ledger under the write's own key (ADR-0023;
:data:`MISSING` when the ledger lacks it). A turn's envelope continues the chain of the newest
run-posted message the turn carried out (ADR-0026). Anything else (a person's writes) starts a
chain of its own (None). A whole batch's causes are read in one ledger read.
"""

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import structlog
from artifactr import Workspace as ArtifactWorkspace
from artifactr.core import ArtifactArchived, ArtifactChanged, ArtifactCreated, Rejection, RunStarted
from artifactr.core import Envelope as ArtifactrEnvelope

from relayr.follow.projections import event_type
from relayr.ledger.port import Cause, Ledger, WorkspaceKey, WriteKind, revision_key
from relayr.ledger.turns import newest_cause

logger = structlog.get_logger("relayr.follow")

TURNS_KEPT: Final = 10_000
"""How many turns' message ids a follower keeps from the ``run_started`` it read: the turn's
later envelopes (the reply, its end) usually follow in the same or the next batch."""

TURN_LOOKUP_PAGE: Final = 200
TURN_LOOKUP_PAGES: Final = 10
"""When a turn's ``run_started`` is not kept (a restarted follower, a very long turn), its
thread is read backwards for it, this many envelopes at a time, at most this many times; a
turn whose start is further back continues no chain."""

RULE_CLIENT_PREFIX: Final = "reflexr:"
"""The client id of a rule's participant in artifactr: ``reflexr:<rule>``
(relayr.execution.participant)."""

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
        turns: The messages each turn of the batch carried out, by turn id.
        causes: The causes of the batch's rules' writes and turns' messages, by ledger key.
        messages: The causes of messages, by message id.
    """

    turns: Mapping[str, tuple[str, ...]]
    causes: Mapping[tuple[WriteKind, str], Cause]
    messages: Mapping[str, Cause]

    def turn_messages(self, envelope: ArtifactrEnvelope) -> tuple[str, ...] | None:
        """The messages the turn that wrote ``envelope`` carried out; None when no turn did."""
        return None if envelope.run_id is None else self.turns[envelope.run_id]

    def cause_of(self, envelope: ArtifactrEnvelope) -> Cause | CauseMissing | None:
        """The run whose chain ``envelope`` continues; None for a chain of its own, and
        :data:`MISSING` for a rule's write without a cause."""
        if is_rule_author(envelope):
            keys = rule_write(envelope)
            found = next((self.causes[key] for key in keys if key in self.causes), None)
            return MISSING if found is None else found
        if envelope.run_id is not None:
            return newest_cause(self.turns.get(envelope.run_id, ()), self.messages)
        return None


class Chains:
    """The chains of one follower's batches: the ledger, and the turns' messages seen so far."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._turns: OrderedDict[tuple[WorkspaceKey, str], tuple[str, ...]] = OrderedDict()

    async def of_batch(
        self,
        key: WorkspaceKey,
        handle: ArtifactWorkspace,
        envelopes: Sequence[ArtifactrEnvelope],
    ) -> BatchChains:
        """The chains of a batch of ``key``'s envelopes: its turns' messages (kept, or read back
        through ``handle``) and the causes it needs, in one read of the ledger."""
        for envelope in envelopes:
            if isinstance(envelope.event, RunStarted):
                self._keep_turn(key, envelope.event.run_id, envelope.event.message_ids)
        turns = await self._turn_messages(key, handle, envelopes)
        causes = await self._causes(key, envelopes, turns)
        messages = {write: cause for (kind, write), cause in causes.items() if kind == "message"}
        return BatchChains(turns, causes, messages)

    async def _turn_messages(
        self,
        key: WorkspaceKey,
        handle: ArtifactWorkspace,
        envelopes: Iterable[ArtifactrEnvelope],
    ) -> dict[str, tuple[str, ...]]:
        """The message ids of the turn of every envelope a turn wrote, by turn id."""
        found: dict[str, tuple[str, ...]] = {}
        for envelope in envelopes:
            turn = envelope.run_id
            if turn is None or turn in found:
                continue
            kept = self._turns.get((key, turn))
            if kept is None:
                thread_id = envelope.thread_id or await _thread_of(handle, turn)
                if thread_id is not None:
                    kept = await self._find_turn(handle, thread_id, turn, envelope.seq)
                    self._keep_turn(key, turn, kept)
            found[turn] = kept or ()
        return found

    async def _find_turn(
        self, handle: ArtifactWorkspace, thread_id: str, turn: str, before_seq: int
    ) -> tuple[str, ...]:
        """Read a thread backwards from ``before_seq`` for the ``run_started`` of ``turn``."""
        for _ in range(TURN_LOOKUP_PAGES):
            page = await handle.read(
                threads={thread_id}, before_seq=before_seq, last=TURN_LOOKUP_PAGE
            )
            for envelope in reversed(page):
                event = envelope.event
                if isinstance(event, RunStarted) and event.run_id == turn:
                    return tuple(event.message_ids)
            if len(page) < TURN_LOOKUP_PAGE:
                break
            before_seq = page[0].seq
        logger.warning(
            "a turn's start was not found: its envelopes start chains of their own",
            thread_id=thread_id,
            turn_id=turn,
        )
        return ()

    def _keep_turn(self, key: WorkspaceKey, turn: str, message_ids: Sequence[str]) -> None:
        self._turns[(key, turn)] = tuple(message_ids)
        self._turns.move_to_end((key, turn))
        while len(self._turns) > TURNS_KEPT:
            self._turns.popitem(last=False)

    async def _causes(
        self,
        key: WorkspaceKey,
        envelopes: Iterable[ArtifactrEnvelope],
        turns: Mapping[str, Sequence[str]],
    ) -> dict[tuple[WriteKind, str], Cause]:
        """The causes of the batch's rules' writes and of its turns' messages: one read."""
        wanted: set[tuple[WriteKind, str]] = set()
        for envelope in envelopes:
            wanted.update(rule_write(envelope))
        for message_ids in turns.values():
            wanted.update(("message", message_id) for message_id in message_ids)
        if not wanted:
            return {}
        return await self._ledger.causes(key, wanted)


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


async def _thread_of(handle: ArtifactWorkspace, turn: str) -> str | None:
    """The thread of a turn, for an envelope of it that names none (an artifact's change)."""
    try:
        return (await handle.run(turn)).thread_id
    except Rejection:
        return None
