"""Batches: one workspace's artifactr envelopes made into reflexr entries, and appended at once.

Each envelope is projected and its chain found; one whose projection raises, that lacks a
recorded cause, or that would pass the depth limit becomes a dead letter and the rest goes on.
The batch is appended in one reflexr transaction through the storage ``Transaction``, as
``publish_many`` appends, after ``authorize`` allowed the follower (ADR-0065).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from artifactr.core import Envelope as ArtifactrEnvelope
from artifactr.core import RunEnded
from reflexr import Event
from reflexr.core import Causation
from reflexr.workspace import Access, Entry, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces
from reflexr.workspace.workspace import meet_rules

from relayr.follow.chains import CauseMissing, Chains
from relayr.follow.events import FOLLOWER
from relayr.follow.projections import Projection, Source, event_type
from relayr.follow.reports import CAUSE_MISSING, DEPTH_EXCEEDED, PROJECTION_FAILED
from relayr.follow.store import DeadLetter
from relayr.ledger.port import Cause, Ledger, LedgerWrites, WorkspaceKey
from relayr.observe import telemetry

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass(frozen=True)
class TurnEnd:
    """A turn that ended (artifactr's ``run_ended``), the run whose message started it (the
    ledger's cause of its newest message a run sent), and the tokens its ``usage`` counts."""

    run_id: str
    turn_id: str
    tokens: int


@dataclass
class Prepared:
    """A batch made ready to publish: the entries, and what was left out."""

    entries: list[Entry] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    skipped: int = 0
    spans: list["Span"] = field(default_factory=list)
    """With tracing on, a ``relayr.bridge`` span per entry, ended once the batch is published."""
    turn_ends: list[TurnEnd] = field(default_factory=list)
    """The batch's turns that ended and the run whose message started each, for the limits."""
    kept: LedgerWrites = field(default_factory=LedgerWrites)
    """The causes of the turns that start in the batch, committed with it (ADR-0104)."""


class Batches:
    """Prepares and publishes the batches of one process's followers.

    Args:
        rules: reflexr's workspaces, where the bridged events go.
        ledger: Where the causes of rules' writes are found.
        projections: How each artifactr event type is bridged.
        clock: The wall clock dead letters are stamped with.
    """

    def __init__(
        self,
        rules: RuleWorkspaces,
        ledger: Ledger,
        projections: Mapping[str, Projection],
        clock: Callable[[], datetime],
    ) -> None:
        self._rules = rules
        self._ledger = ledger
        self._chains = Chains(ledger)
        self._projections = projections
        self._clock = clock

    async def prepare(
        self,
        key: WorkspaceKey,
        envelopes: Sequence[ArtifactrEnvelope],
    ) -> Prepared:
        """Project each envelope and find the chain it continues; what fails is dead."""
        chains = await self._chains.of_batch(key, envelopes)
        prepared = Prepared(kept=chains.kept)
        for envelope in envelopes:
            if isinstance(envelope.event, RunEnded):
                started_by = chains.cause_of(envelope)
                if isinstance(started_by, Cause):
                    usage = envelope.event.usage
                    tokens = 0 if usage is None else usage.input_tokens + usage.output_tokens
                    prepared.turn_ends.append(
                        TurnEnd(started_by.run_id, envelope.event.run_id, tokens)
                    )
            projection = self._projections.get(event_type(envelope))
            if projection is None:
                prepared.skipped += 1
                continue
            source = Source(envelope, chains.turn_messages(envelope))
            try:
                event = projection(source)
                if event is not None and not isinstance(event, Event):
                    raise TypeError(f"the projection returned a {type(event).__name__}")
            except Exception as error:
                prepared.dead.append(
                    self._dead(key, envelope, PROJECTION_FAILED, f"{type(error).__name__}: {error}")
                )
                continue
            if event is None:
                prepared.skipped += 1
                continue
            cause = chains.cause_of(envelope)
            if isinstance(cause, CauseMissing):
                prepared.dead.append(
                    self._dead(
                        key,
                        envelope,
                        CAUSE_MISSING,
                        f"{envelope.actor.participant} wrote envelope {envelope.id}, "
                        "and the ledger holds no cause for it",
                    )
                )
                continue
            causation = None
            if cause is not None:
                causation = Causation(
                    firing_id=cause.firing_id, run_id=cause.run_id, depth=cause.depth + 1
                )
                if causation.depth > self._rules.max_depth:
                    prepared.dead.append(
                        self._dead(
                            key,
                            envelope,
                            DEPTH_EXCEEDED,
                            f"it continues run {cause.run_id}'s chain at depth "
                            f"{causation.depth}, beyond the limit of {self._rules.max_depth}",
                        )
                    )
                    continue
            # the bridged event continues the envelope's trace, through a span of the follower
            span = telemetry.bridge_span(
                key.tenant_id, key.workspace_id, envelope, event.event_type
            )
            if span is not None:
                prepared.spans.append(span)
            prepared.entries.append(
                Entry(
                    id=envelope.id,
                    actor=FOLLOWER,
                    event=event,
                    causation=causation,
                    correlation_id=None if cause is None else cause.correlation_id,
                    traceparent=telemetry.traceparent_of(span),
                )
            )
        return prepared

    async def publish(self, key: WorkspaceKey, prepared: Prepared) -> tuple[int, int]:
        """Append the entries whose ids are not in reflexr's log yet, in one transaction, as
        ``Workspace.publish_many`` appends, with the causes of the batch's turns riding it;
        return how many were appended and found."""
        entries = prepared.entries
        async with self._ledger.alongside(prepared.kept):
            if not entries:
                return 0, 0
            rules = await self._rules.open(key.tenant_id, key.workspace_id, actor=FOLLOWER)
            await rules.check(Access(action="reflexr:publish"))
            ref = WorkspaceRef(key.tenant_id, key.workspace_id)
            async with self._rules.storage.transaction(ref) as transaction:
                await meet_rules(transaction, self._rules.rules.values())
                fresh = [e for e in entries if await transaction.envelope(e.id) is None]
                if fresh:
                    await transaction.append(fresh)
        return len(fresh), len(entries) - len(fresh)

    def _dead(
        self, key: WorkspaceKey, envelope: ArtifactrEnvelope, reason: str, error: str
    ) -> DeadLetter:
        return DeadLetter(
            workspace=key,
            envelope_id=envelope.id,
            seq=envelope.seq,
            event_type=event_type(envelope),
            reason=reason,
            error=error,
            dead_at=self._clock(),
        )
