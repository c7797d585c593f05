"""The bridged events: what happened in artifactr, as reflexr events in the ``artifactr`` namespace.

Rules match them as any event, e.g. ``on(MessagePosted).where(F.author.matches(r"^agent:"))``.
Each carries ``author``, ``author_kind``, ``artifactr_seq`` and, when a turn wrote it,
``turn_id``. An application accepts them and reserves the namespace to the follower, so no client
can publish an ``artifactr:*`` event in an agent's name::

    Workspaces(storage, events=[*EVENTS, *BRIDGED_EVENTS], publishers=PUBLISHERS, rules=...)

This module imports reflexr and pydantic only (ADR-0050).
"""

from typing import Final, Literal

from pydantic import JsonValue
from reflexr import Event, SourceActor

NAMESPACE: Final = "artifactr"
"""The namespace of the bridged events: reserved to the follower (:data:`PUBLISHERS`)."""

FOLLOWER: Final = SourceActor(name="artifactr")
"""Who publishes the bridged events in reflexr: artifactr, as the source of what happened.
Who did it in artifactr is the event's ``author``."""

PUBLISHERS: Final = {NAMESPACE: (FOLLOWER,)}
"""reflexr's ``Workspaces(publishers=...)`` that reserves the namespace to the follower."""


class ArtifactrEvent(Event, abstract=True, event_namespace=NAMESPACE):
    """Something that happened in a workspace's artifactr log.

    Attributes:
        author: Who did it, as artifactr names a participant (``user:alice``, ``agent:thr_...``,
            ``external_agent:reflexr:<rule>``, ``system:runner``).
        author_kind: The kind of participant: ``user``, ``agent``, ``external_agent``,
            ``system`` or ``evaluator``.
        artifactr_seq: The envelope's position in artifactr's log.
    """

    author: str
    author_kind: str
    artifactr_seq: int


class MessagePosted(ArtifactrEvent, name="message_posted"):
    """``artifactr:message_posted``: a message or a notice in a thread.

    ``kind`` tells them apart: a rule that answers messages leaves notices out with
    ``F.kind.eq("message")``, which keeps it from answering its own notices. ``turn_id`` is set
    on the agent's replies: the turn whose output the message is.
    """

    thread_id: str
    message_id: str
    kind: Literal["message", "notice"]
    content: str
    turn_id: str | None = None


class TurnEnded(ArtifactrEvent, name="turn_ended"):
    """``artifactr:turn_ended``: a turn of the thread's agent ended.

    ``message_ids`` are the messages the turn carried out, as its ``run_started`` named them
    (empty when the follower could not find it); ``outcome`` is ``completed``, ``stopped`` or
    ``failed``, with artifactr's ``reason`` and ``error``.
    """

    thread_id: str
    turn_id: str
    outcome: Literal["completed", "stopped", "failed"]
    message_ids: tuple[str, ...] = ()
    reason: str | None = None
    error: str | None = None


class ArtifactCreated(ArtifactrEvent, name="artifact_created"):
    """``artifactr:artifact_created``: an artifact was created (a direct write, or an accepted
    proposal: ``proposal_id``)."""

    artifact_id: str
    artifact_kind: str
    version: int
    data: dict[str, JsonValue]
    thread_id: str | None = None
    proposal_id: str | None = None
    turn_id: str | None = None


class ArtifactChanged(ArtifactrEvent, name="artifact_changed"):
    """``artifactr:artifact_changed``: an artifact was edited; ``patch`` is artifactr's patch
    as JSON."""

    artifact_id: str
    artifact_kind: str
    version: int
    summary: str
    patch: dict[str, JsonValue]
    thread_id: str | None = None
    proposal_id: str | None = None
    turn_id: str | None = None


class ArtifactArchived(ArtifactrEvent, name="artifact_archived"):
    """``artifactr:artifact_archived``: an artifact was archived."""

    artifact_id: str
    artifact_kind: str
    version: int
    thread_id: str | None = None
    proposal_id: str | None = None
    turn_id: str | None = None


class ProposalCreated(ArtifactrEvent, name="proposal_created"):
    """``artifactr:proposal_created``: a change was proposed for someone to accept or reject.

    ``change_type`` is ``create_artifact``, ``edit_artifact`` or ``archive_artifact``, and
    ``change`` the proposed command as JSON.
    """

    proposal_id: str
    change_type: str
    artifact_id: str
    change: dict[str, JsonValue]
    rationale: str | None = None
    thread_id: str | None = None
    turn_id: str | None = None


class ProposalResolved(ArtifactrEvent, name="proposal_resolved"):
    """``artifactr:proposal_resolved``: a proposal was accepted or rejected; ``proposed_by`` is
    the participant who proposed it, ``author`` the one who decided."""

    proposal_id: str
    decision: Literal["accept", "reject"]
    artifact_id: str
    proposed_by: str
    reason: str | None = None
    version: int | None = None
    thread_id: str | None = None
    turn_id: str | None = None


class FeedbackGiven(ArtifactrEvent, name="feedback_given"):
    """``artifactr:feedback_given``: feedback on a message, a turn, an artifact or a thread;
    ``target`` and ``value`` are artifactr's, as JSON."""

    feedback_type: str
    target: dict[str, JsonValue]
    value: dict[str, JsonValue]
    thread_id: str | None = None
    turn_id: str | None = None


BRIDGED_EVENTS: Final = (
    MessagePosted,
    TurnEnded,
    ArtifactCreated,
    ArtifactChanged,
    ArtifactArchived,
    ProposalCreated,
    ProposalResolved,
    FeedbackGiven,
)
"""Every event type the follower publishes by default, for ``Workspaces(events=...)``."""
