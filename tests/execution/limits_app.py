"""The example's outbound rules on a clock the test moves, for the limits' worker tests.

``RELAYR_APP=tests.execution.limits_app:create_clocked_app``: reflexr's time (when runs are
due, and what the limits count windows by) is what the test last wrote into :data:`CLOCK_FILE`
in the home, in every process that loads the application (the dispatcher, each worker), so a test
moves a window by writing a file, never by waiting for one.
"""

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent, ModelResponse, TextPart
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo
from reflexr import Rule
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.execution.actions import acting
from relayr.follow.events import MessagePosted
from relayr.runtime.application import Application, open_storage
from relayr.runtime.bridge import Bridge
from relayr.settings import Settings

CLOCK_FILE: Final = "clock"


class FileClock:
    """The time in a file (ISO 8601), read again when the file changes; real time without it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._now = datetime.now(UTC)

    def __call__(self) -> datetime:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return datetime.now(UTC)
        stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
        if stamp != self._stamp:
            self._now = datetime.fromisoformat(self.path.read_text().strip())
            self._stamp = stamp
        return self._now


def set_clock(home: Path, now: datetime) -> None:
    """Move the clock of every process of ``home`` to ``now`` (written whole, then renamed)."""
    partial = home / f"{CLOCK_FILE}.partial"
    partial.write_text(now.isoformat())
    partial.replace(home / CLOCK_FILE)


TURN_S: Final = 0.5
"""How long a turn of the slow agent takes: long enough that turns overlap when nothing bounds
them (two workers, many incidents), which the count of turns in flight then shows."""


def slow_agent() -> Agent[Session[None], str]:
    """An offline agent whose every turn takes :data:`TURN_S` (its usage is pydantic-ai's
    estimate for a streamed offline model: the same for every incident's turn)."""
    from rules.example.agent import REPLY, TriageNote

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        await asyncio.sleep(TURN_S)
        return ModelResponse(parts=[TextPart(REPLY)])

    return Agent(
        function_model(respond),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[TriageNote])],
    )


async def create_clocked_app(settings: Settings) -> Application:
    """The example's deploy notice and incident triage, its agent, on the file's clock."""
    from rules.example.agent import triage_agent

    return await _clocked(settings, triage_agent())


async def create_slow_clocked_app(settings: Settings) -> Application:
    """The same with :func:`slow_agent`."""
    return await _clocked(settings, slow_agent())


LOOP_RULE_NAME: Final = "loop:answer"


async def answer_again(reaction: Reaction[Bridge]) -> dict[str, str]:
    """Answer the agent's reply in its thread with a message to the agent: a rule<->agent
    loop, stopped by nothing but reflexr's depth limit or an operator's chain breaker."""
    reply = reaction.events[-1].event
    assert isinstance(reply, MessagePosted)
    message_id = await acting(reaction).send("and then?", thread_id=reply.thread_id)
    return {"message_id": message_id}


async def create_looping_app(settings: Settings) -> Application:
    """The clocked example with :func:`answer_again` answering every reply of the agent."""
    from reflexr import F, Rule, on, run

    loop = Rule(
        name=LOOP_RULE_NAME,
        when=on(MessagePosted).where(F.author.matches(r"^agent:"), F.kind.eq("message")),
        then=run("answer_again"),
        ordering="none",
        start="beginning",
    )
    from rules.example.agent import triage_agent

    return await _clocked(settings, triage_agent(), (loop,), {"answer_again": answer_again})


async def _clocked(
    settings: Settings,
    agent: Agent[Session[None], str],
    more_rules: tuple[Rule, ...] = (),
    more_actions: dict[str, Any] | None = None,
) -> Application:
    from relayr.follow.events import BRIDGED_EVENTS, PUBLISHERS
    from rules.example import artifact_workspaces
    from rules.example.actions import ACTIONS
    from rules.example.events import EVENTS
    from rules.example.rules import RULES

    storage = await open_storage(settings)
    clock = FileClock(settings.home.absolute() / CLOCK_FILE)
    rules = RuleWorkspaces(
        storage.rules,
        events=[*EVENTS, *BRIDGED_EVENTS],
        publishers=PUBLISHERS,
        rules=[*RULES, *more_rules],
        clock=clock,
    )
    return Application(
        artifacts=artifact_workspaces(storage.artifacts),
        rules=rules,
        actions={**ACTIONS, **(more_actions or {})},
        agent=agent,
        engines=storage.engines,
    )
