"""The fault application: the example's rules, whose actions can be held, and a poison rule.

``RELAYR_APP=tests.faults.app:create_fault_app``. Every scenario runs it, in its workers and in
the test's dispatcher:

- the example's ``deploy_notice`` and ``incident_triage``, each wrapped so that a run can be
  held before and after its write when the test asks (:mod:`tests.faults.holds`): that is how a
  fault lands while a run is known to be inside its action. Their rules are the example's but
  for the action timeout, raised above the longest hold
  (:data:`~tests.faults.constants.HELD_ACTION_TIMEOUT`): a held action is never cancelled;
- rule ``faults:poison``, whose action kills the pool process running it, as an out-of-memory
  kill would; before it does, it leaves a mark, so the test counts the processes it killed.
"""

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, RetryPolicy, Rule, on
from reflexr import run as action
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings
from rules.example import (
    ACTIONS,
    RULES,
    DeployFinished,
    IncidentOpened,
    TriageNote,
    triage_agent,
)
from tests.faults.constants import HELD_ACTION_TIMEOUT
from tests.faults.holds import AFTER, BEFORE, Holds

FAULT_APP: Final = "tests.faults.app:create_fault_app"

POISON_MARKS: Final = "poisoned"
"""The folder under ``RELAYR_HOME`` where each poison action leaves a mark before it kills."""


class FaultEvent(Event, abstract=True, event_namespace="faults"):
    """Events of the fault application's own rule."""


class Poisoned(FaultEvent, name="poisoned"):
    """Makes rule ``faults:poison`` fire: its action kills the pool process running it."""

    label: str


POISON_RULE: Final = Rule(
    name="faults:poison",
    when=on(Poisoned),
    then=action("poison"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(
        max_attempts=10,
        backoff=timedelta(milliseconds=200),
        max_backoff=timedelta(seconds=1),
    ),
    description="Kill the process that runs it, as an out-of-memory kill would.",
)
"""More attempts than ``max_redeliveries`` allows deliveries, so what stops it is relayr's
bound on a task that keeps killing its worker, not the rule's retry policy."""

type Action = Callable[[Reaction[Any]], Coroutine[Any, Any, Any]]


def holdable(act: Action, holds: Holds) -> Action:
    """``act``, held before and after its write when the test wants a hold there."""

    async def held_action(reaction: Reaction[Any]) -> Any:
        await holds.hold_if_wanted(reaction.run, reaction.rule.name, BEFORE)
        result = await act(reaction)
        await holds.hold_if_wanted(reaction.run, reaction.rule.name, AFTER)
        return result

    return held_action


def held_rule(rule: Rule) -> Rule:
    """``rule`` with :data:`~tests.faults.constants.HELD_ACTION_TIMEOUT` as its timeout."""
    return rule.model_copy(update={"timeout": HELD_ACTION_TIMEOUT})


def poison_action(marks: Path) -> Action:
    async def poison(reaction: Reaction[Any]) -> None:
        mark = marks / f"{reaction.run_id}-{reaction.attempt}-{os.getpid()}"
        await asyncio.to_thread(_touch, mark)
        os.kill(os.getpid(), signal.SIGKILL)

    return poison


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def poison_kills(home: Path) -> int:
    """How many pool processes the poison action killed in ``home``."""
    marks = home.absolute() / POISON_MARKS
    return len(list(marks.iterdir())) if marks.is_dir() else 0


async def create_fault_app(settings: Settings) -> Application:
    """The example's rules with holdable actions, plus the poison rule."""
    storage = await open_storage(settings)
    holds = Holds(settings.home)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(
            storage.rules,
            events=[DeployFinished, IncidentOpened, Poisoned],
            rules=[*(held_rule(rule) for rule in RULES), POISON_RULE],
        ),
        actions={
            **{name: holdable(act, holds) for name, act in ACTIONS.items()},
            "poison": poison_action(settings.home.absolute() / POISON_MARKS),
        },
        agent=triage_agent(),
        engines=storage.engines,
    )
