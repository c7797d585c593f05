"""An application for the embedded broker's worker tests: one rule whose run waits on a gate.

``RELAYR_APP=tests.broker.broker_app:create_gated_app``: publishing :class:`Gated` fires the rule
``test:gated``, whose action waits until the file :data:`GATE_FILE` exists in ``RELAYR_HOME``
(at most :data:`GATE_MAX_WAIT_S`). While it waits, its worker holds the run's message
unacknowledged (late acks): the test kills the worker at that known point, not on a timer.
"""

import asyncio
from pathlib import Path
from typing import Any, Final

from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, RetryPolicy, Rule, on, run
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings

GATE_FILE: Final = "gate-open"
GATE_MAX_WAIT_S: Final = 120.0
"""Far longer than a test waits with the gate shut; a run never waits forever."""

GATE_POLL_S: Final = 0.1


class GateEvent(Event, abstract=True, event_namespace="brokertest"):
    """Events of the gated application."""


class Gated(GateEvent, name="gated"):
    """Makes the rule ``test:gated`` fire."""

    label: str


GATED_RULE = Rule(
    name="test:gated",
    when=on(Gated),
    then=run("wait_for_gate"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(max_attempts=5),
)


def gate_path(settings: Settings) -> Path:
    return settings.home.absolute() / GATE_FILE


def _wait_for_gate(gate: Path) -> Any:
    async def action(reaction: Reaction[Any]) -> dict[str, bool]:
        for _ in range(int(GATE_MAX_WAIT_S / GATE_POLL_S)):
            if await asyncio.to_thread(gate.exists):
                return {"gate_opened": True}
            await asyncio.sleep(GATE_POLL_S)
        return {"gate_opened": False}

    return action


async def create_gated_app(settings: Settings) -> Application:
    """``test:gated``, whose run waits until the test opens the gate."""
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=[Gated], rules=[GATED_RULE]),
        actions={"wait_for_gate": _wait_for_gate(gate_path(settings))},
        engines=storage.engines,
    )
