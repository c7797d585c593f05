"""The inbound side's test application: rules that answer what the follower bridges.

``RELAYR_APP=tests.follow.follow_app:create_follow_app``, in worker and dispatcher subprocesses
and in the tests' own runtimes:

- ``follow:ask`` (on ``followtest:asked``) sends "question: <text>" in the event's thread, which
  starts a turn of the offline agent (the allowlist must grant it ``turns``:
  :data:`ALLOWLIST`); the agent answers "answer: <text>";
- ``follow:answered`` (on ``artifactr:message_posted`` by ``agent:*``, kind ``message``) posts
  "answered: <reply>": the agent's reply reached a rule;
- ``follow:turn-ended`` (on ``artifactr:turn_ended``) posts "turn <id> <outcome>";
- ``loop:start`` (on ``followtest:looped``) posts "echo at depth 0", and ``loop:echo`` (on
  ``artifactr:message_posted`` by a ``loop:`` rule, notices included) posts "echo at depth N":
  a rule that answers its own notices, which reflexr's depth limit (:data:`MAX_DEPTH`) stops
  after :data:`MAX_DEPTH` notices in all;
- ``edit:note`` (on ``followtest:noted``) sets an artifact's ``note``: directly for a
  ``follow_counter`` (the allowlist's ``direct``), as a proposal for a ``follow_draft``, and as
  a proposal artifactr makes of a direct write for a ``follow_plan`` (its write policy);
- ``loop:count`` (on ``followtest:counted``) sets a ``follow_counter``'s ``count`` to 1, and
  ``loop:recount`` (on ``artifactr:artifact_changed`` by a ``loop:`` rule) sets it to the
  version it saw, directly: rules that edit one artifact in a loop, which the depth limit stops
  after :data:`MAX_DEPTH` edits (:data:`RECOUNT_CAP` bounds a loop that escaped it);
- ``converse:again`` (on ``artifactr:message_posted`` by ``agent:*`` answering ``again``) sends
  "question: again": a rule and the agent answering each other, turn after turn, which the
  depth limit stops after :data:`MAX_DEPTH` sends in all (with ``follow:ask``'s first).

When ``RELAYR_HOME`` holds :data:`GATE_ARMED`, the first batch a follower publishes waits after
its publish, before its cursor moves: it removes the file, writes :data:`GATE_HELD` (its pid)
and waits there for :data:`GATE_HOLD_MAX_S`. A test kills the follower's process there, so the
kill lands between the publish and the cursor, on any machine's speed.
"""

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

from artifactr import Artifact, MarkdownArtifact, WritePolicy
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, F, RetryPolicy, Rule, on, run
from reflexr.core import Condition
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.execution.actions import acting
from relayr.follow.config import Inbound
from relayr.follow.events import (
    BRIDGED_EVENTS,
    PUBLISHERS,
    ArtifactChanged,
    MessagePosted,
    TurnEnded,
)
from relayr.ledger.port import WorkspaceKey
from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings

FOLLOW_APP: Final = "tests.follow.follow_app:create_follow_app"

MAX_DEPTH: Final = 4
"""reflexr's depth limit in this application: a loop of rules stops after this many runs."""

RECOUNT_CAP: Final = 3 * MAX_DEPTH
"""The version past which ``loop:recount`` stops by itself: a loop the depth limit did not stop
ends there, so a test of it fails rather than hangs."""

ALLOWLIST: Final = """
[default]
threads = "chain"

[rules."follow:ask"]
turns = true

[rules."converse:again"]
turns = true

[rules."edit:note"]
direct = ["follow_counter", "follow_plan"]

[rules."loop:count"]
direct = ["follow_counter"]

[rules."loop:recount"]
direct = ["follow_counter"]
"""

GATE_ARMED: Final = "follow-gate-armed"
GATE_HELD: Final = "follow-gate-held"
GATE_HOLD_MAX_S: Final = 120.0
"""How long a held follower waits for the test to kill it before it goes on anyway."""


class FollowTestEvent(Event, abstract=True, event_namespace="followtest"):
    """Events that start the test application's chains."""


class Asked(FollowTestEvent, name="asked"):
    """Makes ``follow:ask`` send a question in ``thread_id``."""

    thread_id: str
    text: str


class Looped(FollowTestEvent, name="looped"):
    """Makes ``loop:echo`` post its first echo in ``thread_id``."""

    thread_id: str


class Noted(FollowTestEvent, name="noted"):
    """Makes ``edit:note`` set the ``note`` of ``artifact_id``."""

    artifact_id: str
    note: str


class Counted(FollowTestEvent, name="counted"):
    """Makes ``loop:count`` start counting on ``artifact_id``."""

    artifact_id: str


class FollowCounter(Artifact):
    """An artifact the rules write directly (the allowlist's ``direct``)."""

    count: int = 0
    note: str = ""


class FollowDraft(FollowCounter):
    """An artifact the rules propose changes to (not ``direct``)."""


class FollowPlan(FollowCounter):
    """An artifact agents must propose changes to, whatever the allowlist says."""

    write_policy: ClassVar[WritePolicy] = "propose"


RETRY: Final = RetryPolicy(max_attempts=5)


def answering(name: str, when: Condition, action: str) -> Rule:
    """A rule that answers every event ``when`` matches, from the log's beginning, in no order
    (each answer stands alone), retried by :data:`RETRY`."""
    return Rule(
        name=name, when=when, then=run(action), ordering="none", start="beginning", retry=RETRY
    )


ASK = answering("follow:ask", on(Asked), "ask")
ANSWERED = answering(
    "follow:answered",
    on(MessagePosted).where(F.author.matches(r"^agent:"), F.kind.eq("message")),
    "answered",
)
TURN_ENDED = answering("follow:turn-ended", on(TurnEnded), "turn_ended")
LOOP_START = answering("loop:start", on(Looped), "echo")
ECHO = answering(
    "loop:echo",
    on(MessagePosted).where(F.author.matches(r"^external_agent:reflexr:loop:")),
    "echo",
)
NOTE = answering("edit:note", on(Noted), "note")
COUNT = answering("loop:count", on(Counted), "count")
RECOUNT = answering(
    "loop:recount",
    on(ArtifactChanged).where(
        F.author.matches(r"^external_agent:reflexr:loop:"), F.artifact_kind.eq("follow_counter")
    ),
    "recount",
)

AGAIN = answering(
    "converse:again",
    on(MessagePosted).where(
        F.author.matches(r"^agent:"), F.kind.eq("message"), F.content.eq("answer: again")
    ),
    "ask_again",
)

RULES: Final = (ASK, ANSWERED, TURN_ENDED, LOOP_START, ECHO, NOTE, COUNT, RECOUNT, AGAIN)


async def ask(reaction: Reaction[Any]) -> dict[str, str]:
    event = reaction.events[-1].event
    assert isinstance(event, Asked)
    return {"message_id": await acting(reaction).send(f"question: {event.text}")}


async def ask_again(reaction: Reaction[Any]) -> dict[str, str]:
    return {"message_id": await acting(reaction).send("question: again")}


async def answered(reaction: Reaction[Any]) -> dict[str, str]:
    event = reaction.events[-1].event
    assert isinstance(event, MessagePosted)
    return {"message_id": await acting(reaction).notice(f"answered: {event.content}")}


async def turn_ended(reaction: Reaction[Any]) -> dict[str, str]:
    event = reaction.events[-1].event
    assert isinstance(event, TurnEnded)
    text = f"turn {event.turn_id} {event.outcome}, for {', '.join(event.message_ids)}"
    return {"message_id": await acting(reaction).notice(text)}


async def echo(reaction: Reaction[Any]) -> dict[str, str]:
    return {"message_id": await acting(reaction).notice(f"echo at depth {reaction.run.depth}")}


async def note(reaction: Reaction[Any]) -> dict[str, str | None]:
    event = reaction.events[-1].event
    assert isinstance(event, Noted)
    return {"written": await acting(reaction).edit(event.artifact_id, "/note", event.note)}


async def count(reaction: Reaction[Any]) -> dict[str, str | None]:
    event = reaction.events[-1].event
    assert isinstance(event, Counted)
    return {"written": await acting(reaction).edit(event.artifact_id, "/count", 1)}


async def recount(reaction: Reaction[Any]) -> dict[str, str | None]:
    event = reaction.events[-1].event
    assert isinstance(event, ArtifactChanged)
    if event.version > RECOUNT_CAP:
        return {"written": None}
    return {"written": await acting(reaction).edit(event.artifact_id, "/count", event.version)}


ACTIONS: Final = {
    "ask": ask,
    "ask_again": ask_again,
    "answered": answered,
    "turn_ended": turn_ended,
    "echo": echo,
    "note": note,
    "count": count,
    "recount": recount,
}


async def _answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    asked = [
        part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, UserPromptPart) and isinstance(part.content, str)
    ]
    question = asked[-1] if asked else ""
    return ModelResponse(parts=[TextPart(f"answer: {question.removeprefix('question: ')}")])


class FollowNote(MarkdownArtifact):
    """The artifact kind the agent's workspace capability knows (it writes none)."""


def agent() -> Agent[Session[None], str]:
    return Agent(
        function_model(_answer),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[FollowNote])],
    )


def rule_workspaces(storage: Any) -> RuleWorkspaces:
    return RuleWorkspaces(
        storage,
        events=[Asked, Looped, Noted, Counted, *BRIDGED_EVENTS],
        publishers=PUBLISHERS,
        rules=RULES,
        max_depth=MAX_DEPTH,
    )


def gate(home: Path) -> Any:
    """The follower's hook (``Inbound.after_publish``): held once, when the test armed it."""

    async def after_publish(workspace: WorkspaceKey, seqs: Sequence[int]) -> None:
        armed = home / GATE_ARMED
        try:
            armed.unlink()
        except FileNotFoundError:
            return
        held = home / GATE_HELD
        held.with_suffix(".tmp").write_text(f"{os.getpid()} {seqs[0]} {seqs[-1]}")
        held.with_suffix(".tmp").rename(held)
        await asyncio.sleep(GATE_HOLD_MAX_S)  # the test kills this process meanwhile

    return after_publish


async def create_follow_app(settings: Settings) -> Application:
    """The application on ``settings.database_url``, its follower gated in ``settings.home``."""
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=rule_workspaces(storage.rules),
        actions=ACTIONS,
        agent=agent(),
        engines=storage.engines,
        inbound=Inbound(after_publish=gate(settings.home.absolute())),
    )
