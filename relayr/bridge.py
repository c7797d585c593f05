"""The bridge: what a run's actions act through, one per worker process and event loop.

Its storage, ledger and artifactr ``Runner`` belong to the event loop that made them (an async
engine cannot be reused by another loop), so a worker process builds one bridge on its own
long-lived loop after it forks, and hands it to every run as the reaction's ``deps``.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import RunHandle, Runner

from relayr import metrics
from relayr.allowlist import Allowlists
from relayr.ledger.port import Ledger


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Turns:
    """The agent turns this process started, so a shutdown can give them a grace period."""

    handles: set[RunHandle] = field(default_factory=set)

    def started(self, handle: RunHandle | None) -> None:
        if handle is None or handle in self.handles:
            return
        metrics.record_turn_started()
        self.handles.add(handle)
        handle.task.add_done_callback(lambda _: self.handles.discard(handle))

    def running(self) -> list[RunHandle]:
        return [handle for handle in self.handles if not handle.task.done()]

    async def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the running turns; return how many are still running."""
        pending = [handle.task for handle in self.running()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return len(self.running())


@dataclass
class Bridge:
    """What :class:`relayr.actions.RunActions` act through.

    Attributes:
        artifacts: artifactr's workspaces, where runs write.
        ledger: where causes and emission records are kept.
        allowlists: returns the allowlist in force now. It is called when a run acts, not when
            it was queued, so a revoked permission stops the next write of a queued run.
        runner: the artifactr Runner that carries out turns, or None: then no rule may start
            a turn, whatever the allowlist says.
        clock: the time emission records are stamped with.
        app: the application's own dependencies, for its actions.
    """

    artifacts: ArtifactWorkspaces
    ledger: Ledger
    allowlists: Callable[[], Allowlists]
    runner: Runner[Any] | None = None
    clock: Callable[[], datetime] = utc_now
    app: Any = None
    turns: Turns = field(default_factory=Turns)
