"""An application for the ops tests on real workers, named by ``RELAYR_APP``.

- ``ops:backup-check`` posts a notice, then fails (``backup_down``) until the file ``fixed``
  exists in the home directory: it dead-letters after its retry policy, and succeeds once ops
  fixed the backup and retried it.
- ``ops:crash-send`` sends a message as ``RunActions.send`` would, but until ``fixed`` exists
  it commits the message and kills its own pool process before asking for the turn: the crash
  window of ADR-0026, made real.
- ``ops:send-then-die`` sends its message with ``RunActions.send`` (the real ``Runner.send``),
  then kills its own pool process, on every attempt: the send is in artifactr, and its run
  never completes.
"""

import os
import signal
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import InvalidState, PostMessage
from reflexr import Event, RetryPolicy, Rule, on, run
from reflexr.workspace import Reaction, RunFailure
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.core.ids import IdDeriver, digest
from relayr.execution.actions import acting
from relayr.runtime.application import Application, open_storage
from relayr.settings import Settings
from rules.example import TriageNote, triage_agent

FIXED = "fixed"
"""The file in the home directory that says the backup is fixed."""

CRASH_CONTENT = "Triage incident: backup host unreachable"


class OpsTestEvent(Event, abstract=True, event_namespace="opsw"):
    """Events of the ops test application."""


class BackupDue(OpsTestEvent, name="backup"):
    thread_id: str


class BackupLost(OpsTestEvent, name="lost"):
    thread_id: str


class DiskFull(OpsTestEvent, name="disk_full"):
    thread_id: str


def _fixed(reaction: Reaction[Any]) -> bool:
    home: Path = reaction.deps.app
    return (home / FIXED).exists()


async def backup_check(reaction: Reaction[Any]) -> None:
    await acting(reaction).notice("checking the nightly backup")
    if not _fixed(reaction):
        raise RunFailure("the backup host is down", reason="backup_down")


async def crash_send(reaction: Reaction[Any]) -> None:
    actions = acting(reaction)
    if not _fixed(reaction):
        thread = actions.threads[0]
        message_id = IdDeriver(reaction.run_id).next(
            "msg", segment=0, operation="post_message", subject=(thread, digest(CRASH_CONTENT))
        )
        handle = await reaction.deps.artifacts.open(
            actions.workspace.tenant_id, actions.workspace.workspace_id, actor=actions.actor
        )
        with suppress(InvalidState):  # committed by the attempt this one redelivers
            await handle.commit(
                PostMessage(thread_id=thread, content=CRASH_CONTENT, message_id=message_id)
            )
        os.kill(os.getpid(), signal.SIGKILL)
    await actions.send(CRASH_CONTENT)


DIE_CONTENT = "Triage incident: the disk of db-2 is full"


async def send_then_die(reaction: Reaction[Any]) -> None:
    await acting(reaction).send(DIE_CONTENT)
    os.kill(os.getpid(), signal.SIGKILL)


RULES = [
    Rule(
        name="ops:backup-check",
        when=on(BackupDue),
        then=run("backup_check"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(milliseconds=200)),
    ),
    Rule(
        name="ops:crash-send",
        when=on(BackupLost),
        then=run("crash_send"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(milliseconds=200)),
    ),
    Rule(
        name="ops:send-then-die",
        when=on(DiskFull),
        then=run("send_then_die"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(milliseconds=200)),
    ),
]


async def create_ops_app(settings: Settings) -> Application:
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(storage.rules, events=[BackupDue, BackupLost, DiskFull], rules=RULES),
        actions={
            "backup_check": backup_check,
            "crash_send": crash_send,
            "send_then_die": send_then_die,
        },
        agent=triage_agent(0.0),
        app_deps=settings.home.resolve(),
        engines=storage.engines,
    )
