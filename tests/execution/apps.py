"""Applications of the tests' own, named by ``RELAYR_APP`` in worker subprocesses.

- :func:`create_slow_app`: the example application, with an offline agent that answers only
  once the test created :data:`TURN_RELEASE_FILE` in the home, so a test can stop a worker
  while turns are known to run.
- :func:`create_crashing_app`: one rule whose action kills the pool process running it, as an
  out-of-memory kill would, to drive the bounded redelivery (ADR-0011); and one whose action
  sleeps as long as its event says, to meet the task's soft time limit.
"""

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from artifactr import MarkdownArtifact
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent, ModelResponse, TextPart
from reflexr import Event, RetryPolicy, Rule, on, run
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings

TURN_RELEASE_FILE = "release-turns"
"""Created in ``RELAYR_HOME`` by the test when the slow agent's turns may answer."""

SLOW_TURN_MAX_S = 60.0
"""The longest a slow turn waits for its release before it answers anyway."""

RELEASE_POLL_S = 0.1


class SlowNote(MarkdownArtifact):
    """The artifact kind the slow agent's workspace capability knows (it writes none)."""


def _answer_when_released(release: Path) -> Any:
    async def answer(messages: Any, info: Any) -> ModelResponse:
        deadline = time.monotonic() + SLOW_TURN_MAX_S
        while time.monotonic() < deadline:
            if await asyncio.to_thread(release.exists):
                break
            await asyncio.sleep(RELEASE_POLL_S)
        return ModelResponse(parts=[TextPart("triaged, slowly")])

    return answer


async def create_slow_app(settings: Settings) -> Application:
    """The example application with an agent that answers once the test released it."""
    from rules.example import create_app

    application = await create_app(settings)
    agent = Agent(
        function_model(_answer_when_released(settings.home.absolute() / TURN_RELEASE_FILE)),
        deps_type=Session[Any],
        capabilities=[ArtifactWorkspace(types=[SlowNote])],
    )
    return dataclasses.replace(application, agent=agent)


class CrashEvent(Event, abstract=True, event_namespace="crashtest"):
    """Events of the crashing application."""


class Crash(CrashEvent, name="crash"):
    """Makes the rule ``test:crash`` fire."""

    label: str


class Sleep(CrashEvent, name="sleep"):
    """Makes the rule ``test:sleep`` fire: its action sleeps ``seconds``."""

    seconds: float


async def _crash(reaction: Reaction[Any]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


CRASH_RULE = Rule(
    name="test:crash",
    when=on(Crash),
    then=run("crash"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(max_attempts=5),
)


async def _sleep(reaction: Reaction[Any]) -> dict[str, float]:
    event = reaction.events[-1].event
    assert isinstance(event, Sleep)
    await asyncio.sleep(event.seconds)
    return {"slept_s": event.seconds}


SLEEP_RULE = Rule(
    name="test:sleep",
    when=on(Sleep),
    then=run("sleep"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(max_attempts=5),
)


async def create_crashing_app(settings: Settings) -> Application:
    """``test:crash``, whose action kills its own process, and ``test:sleep``."""
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=[Crash, Sleep], rules=[CRASH_RULE, SLEEP_RULE]),
        actions={"crash": _crash, "sleep": _sleep},
        engines=storage.engines,
    )
