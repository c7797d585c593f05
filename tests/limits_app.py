"""The example's outbound rules on a clock the test moves, for the limits' worker tests.

``RELAYR_APP=tests.limits_app:create_clocked_app``: reflexr's time (when runs are due, and
what the limits count windows by) is what the test last wrote into :data:`CLOCK_FILE` in the
home, in every process that loads the application (the dispatcher, each worker), so a test
moves a window by writing a file, never by waiting for one.
"""

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.runtime.application import Application, open_storage
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


async def create_clocked_app(settings: Settings) -> Application:
    """The example's deploy notice and incident triage, its agent, on the file's clock."""
    from rules.example import artifact_workspaces
    from rules.example.actions import ACTIONS
    from rules.example.agent import triage_agent
    from rules.example.events import EVENTS
    from rules.example.rules import RULES

    storage = await open_storage(settings)
    clock = FileClock(settings.home.absolute() / CLOCK_FILE)
    return Application(
        artifacts=artifact_workspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=list(EVENTS), rules=list(RULES), clock=clock),
        actions=ACTIONS,
        agent=triage_agent(),
        engines=storage.engines,
    )
