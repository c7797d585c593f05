"""Projections: an artifactr envelope turned into the reflexr event a follower publishes.

A projection maps a :class:`Source` to the event to publish, or None to bridge nothing.
:data:`PROJECTIONS` holds the defaults by artifactr event type; an application adds or replaces
them (:class:`relayr.follow.config.Inbound`). A projection must be pure: an envelope may be
projected again (a restart, a replay) and is published under its id whatever it returns. One that
raises dead-letters its envelope.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypedDict

from artifactr.core import ArtifactArchived as ArtifactrArtifactArchived
from artifactr.core import ArtifactChanged as ArtifactrArtifactChanged
from artifactr.core import ArtifactCreated as ArtifactrArtifactCreated
from artifactr.core import Envelope as ArtifactrEnvelope
from artifactr.core import FeedbackGiven as ArtifactrFeedbackGiven
from artifactr.core import MessagePosted as ArtifactrMessagePosted
from artifactr.core import ProposalCreated as ArtifactrProposalCreated
from artifactr.core import ProposalResolved as ArtifactrProposalResolved
from artifactr.core import RunEnded
from reflexr import Event

from relayr.follow.events import (
    ArtifactArchived,
    ArtifactChanged,
    ArtifactCreated,
    FeedbackGiven,
    MessagePosted,
    ProposalCreated,
    ProposalResolved,
    TurnEnded,
)


class Origin(TypedDict):
    """The fields of :class:`relayr.follow.events.ArtifactrEvent`, which every bridged event
    takes from its envelope the same way: who wrote it, and where it sits in artifactr's log."""

    author: str
    author_kind: str
    artifactr_seq: int


@dataclass(frozen=True)
class Source:
    """What a projection is given.

    Attributes:
        envelope: The artifactr envelope.
        turn_messages: When a turn of the thread's agent wrote the envelope (its ``run_id`` is
            set), the messages the turn carried out, as its ``run_started`` named them (empty
            when it named none or could not be found); None for any other envelope.
    """

    envelope: ArtifactrEnvelope
    turn_messages: tuple[str, ...] | None = None

    @property
    def author(self) -> str:
        """Who wrote the envelope, as a participant: ``user:alice``, ``agent:thr_...``."""
        return self.envelope.actor.participant

    @property
    def author_kind(self) -> str:
        return self.envelope.actor.kind

    @property
    def seq(self) -> int:
        return self.envelope.seq

    @property
    def turn_id(self) -> str | None:
        return self.envelope.run_id

    @property
    def origin(self) -> Origin:
        """The envelope's author and seq, as every bridged event names them: a projection
        builds its event with ``MessagePosted(**source.origin, ...)``."""
        return Origin(author=self.author, author_kind=self.author_kind, artifactr_seq=self.seq)


type Projection = Callable[[Source], Event | None]
"""Turns an envelope into the event to publish, or None to bridge nothing for it."""


def message_posted(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrMessagePosted)
    return MessagePosted(
        **source.origin,
        thread_id=event.thread_id,
        message_id=event.message_id,
        kind=event.kind,
        content=event.content,
        turn_id=event.run_id or source.turn_id,
    )


def turn_ended(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, RunEnded)
    return TurnEnded(
        **source.origin,
        thread_id=event.thread_id,
        turn_id=event.run_id,
        outcome=event.status,
        message_ids=source.turn_messages or (),
        reason=event.reason,
        error=event.error,
    )


def artifact_created(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrArtifactCreated)
    return ArtifactCreated(
        **source.origin,
        artifact_id=event.artifact_id,
        artifact_kind=event.kind,
        version=event.version,
        data=event.data,
        thread_id=event.thread_id,
        proposal_id=event.proposal_id,
        turn_id=event.run_id or source.turn_id,
    )


def artifact_changed(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrArtifactChanged)
    return ArtifactChanged(
        **source.origin,
        artifact_id=event.artifact_id,
        artifact_kind=event.kind,
        version=event.version,
        summary=event.summary,
        patch=event.patch.model_dump(mode="json"),
        thread_id=event.thread_id,
        proposal_id=event.proposal_id,
        turn_id=event.run_id or source.turn_id,
    )


def artifact_archived(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrArtifactArchived)
    return ArtifactArchived(
        **source.origin,
        artifact_id=event.artifact_id,
        artifact_kind=event.kind,
        version=event.version,
        thread_id=event.thread_id,
        proposal_id=event.proposal_id,
        turn_id=event.run_id or source.turn_id,
    )


def proposal_created(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrProposalCreated)
    return ProposalCreated(
        **source.origin,
        proposal_id=event.proposal_id,
        change_type=event.change.type,
        artifact_id=event.change.artifact_id,
        change=event.change.model_dump(mode="json"),
        rationale=event.rationale,
        thread_id=event.thread_id,
        turn_id=event.run_id or source.turn_id,
    )


def proposal_resolved(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrProposalResolved)
    return ProposalResolved(
        **source.origin,
        proposal_id=event.proposal_id,
        decision=event.decision,
        artifact_id=event.artifact_id,
        proposed_by=event.proposed_by.participant,
        reason=event.reason,
        version=event.version,
        thread_id=event.thread_id,
        turn_id=event.run_id or source.turn_id,
    )


def feedback_given(source: Source) -> Event | None:
    event = source.envelope.event
    assert isinstance(event, ArtifactrFeedbackGiven)
    return FeedbackGiven(
        **source.origin,
        feedback_type=event.feedback_type,
        target=event.target.model_dump(mode="json"),
        value=event.value,
        thread_id=event.thread_id,
        turn_id=event.run_id or source.turn_id,
    )


PROJECTIONS: Final[Mapping[str, Projection]] = {
    "message_posted": message_posted,
    "run_ended": turn_ended,
    "artifact_created": artifact_created,
    "artifact_changed": artifact_changed,
    "artifact_archived": artifact_archived,
    "proposal_created": proposal_created,
    "proposal_resolved": proposal_resolved,
    "feedback_given": feedback_given,
}
"""The default projections, by artifactr's event type."""


def event_type(envelope: ArtifactrEnvelope) -> str:
    """An envelope's artifactr event type, also for an event this artifactr does not know."""
    return str(envelope.event.type)
