"""An application for the console's tests on real workers, named by ``RELAYR_APP``.

- The ops tests' rules (:mod:`tests.ops.ops_app`): ``ops:backup-check`` posts a notice, then fails
  (``backup_down``) until the file ``fixed`` exists in the home directory, so it dies after its
  retry policy and succeeds once ops fixed the backup and retried it.
- ``console:hostile`` posts the event's ``payload`` as a notice and fails with it for good, under
  a reason that is markup too: what an attacker who can publish an event would write, for the
  tests that check the console shows it as text.
"""

from typing import Any

from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, Rule, on, run
from reflexr.workspace import Reaction, RunFailure
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.execution.actions import acting
from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings
from rules.example import TriageNote, triage_agent
from tests.ops.ops_app import RULES as OPS_RULES
from tests.ops.ops_app import (
    BackupDue,
    BackupLost,
    DiskFull,
    backup_check,
    crash_send,
    send_then_die,
)

HOSTILE_REASON = "<b>hostile</b>"
"""The reason ``console:hostile`` fails with: markup, which the console must show as text."""


class ConsoleTestEvent(Event, abstract=True, event_namespace="consolew"):
    """Events of the console test application."""


class HostileDue(ConsoleTestEvent, name="hostile"):
    thread_id: str
    payload: str


async def hostile(reaction: Reaction[Any]) -> None:
    event = reaction.events[-1].event
    assert isinstance(event, HostileDue)
    await acting(reaction).notice(event.payload)
    raise RunFailure(event.payload, reason=HOSTILE_REASON, permanent=True)


RULES = [
    *OPS_RULES,
    Rule(
        name="console:hostile",
        when=on(HostileDue),
        then=run("hostile"),
        ordering="none",
        start="beginning",
    ),
]


async def create_console_app(settings: Settings) -> Application:
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(
            storage.rules, events=[BackupDue, BackupLost, DiskFull, HostileDue], rules=RULES
        ),
        actions={
            "backup_check": backup_check,
            "crash_send": crash_send,
            "send_then_die": send_then_die,
            "hostile": hostile,
        },
        agent=triage_agent(0.0),
        app_deps=settings.home.resolve(),
        engines=storage.engines,
    )
