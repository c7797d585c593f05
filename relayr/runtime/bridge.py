"""The bridge: what a run's actions act through, one per worker process and event loop.

Its storage, ledger and artifactr ``Runner`` belong to the loop that made them, so a worker
builds one on its own long-lived loop after it forks and hands it to every run as ``deps``.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import structlog
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import RunHandle, Runner

from relayr.core.allowlist import Allowlists
from relayr.ledger.limits import InMemoryLimitStore, LimitStore
from relayr.ledger.port import Ledger
from relayr.observe import hooks
from relayr.observe.hooks import TurnStarted
from relayr.runtime.transient import BACKOFF_S, TRIES, is_transient, retried

type Ask = Callable[[], Awaitable[RunHandle | None]]
"""Asks for a thread's next turn again (``Runner.ask`` on the turn's workspace and thread)."""

ASK_AGAIN_TRIES: Final = TRIES
"""How often a turn that failed to start on a transient storage fault is asked for again."""

logger = structlog.get_logger("relayr.bridge")


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class StartedTurns:
    """The agent turns this process started, and the turns they hand their threads over to, so
    a shutdown can give them a grace period (:meth:`settled`).

    A turn that ends with a message left for the next hands its thread over: artifactr's Runner
    starts the thread's next turn itself, in the background, and ``Runner.drain`` waits for
    that turn to start, not to end. So when a tracked turn ends, the turn its thread was
    handed to, if any, is tracked too (``runner``).

    A turn that fails on a transient storage fault (a dropped connection) before it took its
    message leaves the message untaken: artifactr's Runner leaves it to the thread's next
    command, and a rule's message may have no next command. So such a turn is asked for again,
    a few times (``ask_again``): ``Runner.ask`` starts the turn the message still waits for, or
    does nothing if a turn took it.
    """

    runner: Runner[Any] | None = None
    handles: set[RunHandle] = field(default_factory=set)
    asking: set["asyncio.Task[None]"] = field(default_factory=set)
    following: set["asyncio.Task[None]"] = field(default_factory=set)

    def started(self, handle: RunHandle | None, *, ask_again: Ask | None = None) -> None:
        self._track(handle, ask_again, ASK_AGAIN_TRIES)

    def _track(
        self, handle: RunHandle | None, ask_again: Ask | None, tries: int, *, ours: bool = True
    ) -> None:
        """Track ``handle``; ``ours`` unless the Runner started it (a hand-over), which the
        count of turns started by runs leaves out."""
        if handle is None or handle in self.handles:
            return
        if ours:
            hooks.emit(TurnStarted())
        self.handles.add(handle)

        def ended(task: "asyncio.Task[Any]") -> None:
            self.handles.discard(handle)
            if self.runner is not None:
                self._background(self.following, self._follow(self.runner, handle.thread_id))
            failure = None if task.cancelled() else task.exception()
            if ask_again is None or tries <= 0 or failure is None or not is_transient(failure):
                return
            logger.warning(
                "turn failed on a transient fault; asking for it again",
                turn_id=handle.run_id,
                thread_id=handle.thread_id,
                error=f"{type(failure).__name__}: {failure}",
            )
            self._background(self.asking, self._ask(ask_again, tries - 1))

        handle.task.add_done_callback(ended)

    @staticmethod
    def _background(tasks: set["asyncio.Task[None]"], work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _follow(self, runner: Runner[Any], thread_id: str) -> None:
        """Track the turn an ended turn's thread was handed over to, once it started."""
        await runner.drain()
        self._track(runner.running(thread_id), None, 0, ours=False)

    async def _ask(self, ask_again: Ask, tries: int) -> None:
        await asyncio.sleep(BACKOFF_S[0])
        try:
            self._track(await retried(ask_again), ask_again, tries)
        except Exception:
            logger.exception(
                "asking again for a failed turn failed; the thread's next command takes it"
            )

    def running(self) -> list[RunHandle]:
        """The turns still running."""
        return [handle for handle in self.handles if not handle.task.done()]

    def pending(self) -> list["asyncio.Future[Any]"]:
        """What a wait for this process's turns waits on: the turns running, the turns being
        asked for again, and the hand-overs being looked for."""
        return [*(handle.task for handle in self.running()), *self.asking, *self.following]

    async def settled(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` until nothing is :meth:`pending`; how many turns are still
        running then, and how many are still being asked for again."""
        deadline = time.monotonic() + timeout_s
        while (pending := self.pending()) and (remaining := deadline - time.monotonic()) > 0:
            await asyncio.wait(pending, timeout=remaining)
        return len(self.running()), len(self.asking)

    async def aclose(self) -> None:
        """Stop looking for hand-overs (after the Runner closed, none is coming)."""
        for task in self.following:
            task.cancel()
        await asyncio.gather(*self.following, return_exceptions=True)


@dataclass
class Bridge:
    """What :class:`relayr.execution.actions.RunActions` act through.

    Attributes:
        artifacts: artifactr's workspaces, where runs write.
        ledger: where causes and emission records are kept.
        allowlists: returns the allowlist in force now. It is called when a run acts, not when
            it was queued, so a revoked permission stops the next write of a queued run.
        runner: the artifactr Runner that carries out turns, or None: then no rule may start
            a turn, whatever the allowlist says.
        clock: the time emission records are stamped with.
        app: the application's own dependencies, for its actions.
        limits: the counts behind the operators' limits, shared by every worker (in the
            application's database; in memory for an application with none).
    """

    artifacts: ArtifactWorkspaces
    ledger: Ledger
    allowlists: Callable[[], Allowlists]
    runner: Runner[Any] | None = None
    clock: Callable[[], datetime] = utc_now
    app: Any = None
    turns: StartedTurns = field(default_factory=StartedTurns)
    limits: LimitStore = field(default_factory=InMemoryLimitStore)

    def __post_init__(self) -> None:
        if self.turns.runner is None:
            self.turns.runner = self.runner  # the turns' hand-overs are this Runner's
