"""``relayr run`` supervises its worker: a worker that exits is started again, with back-off.

Per ADR-0033: the back-off doubles from ``first_s`` to ``max_s`` with each exit in a row and
resets once a worker stayed up :data:`STABLE_AFTER_S`; a failed start counts as an exit. Exit
code 2 (bad settings, allowlist or application) stops ``relayr run`` with code 2 instead of
looping. An exited worker's leftover pool is killed. While it supervises, a status file
(``health/worker.supervisor.json`` under ``RELAYR_HOME``, written whole, best effort) tells
:mod:`relayr.observe.health` whether the worker is up.
"""

import asyncio
import os
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import structlog

from relayr.observe.health import SupervisorStatus, WorkerExit, write_status

type Supervised = Literal["stopped", "dispatcher_ended", "cannot_start"]

RESTART_DELAY_S: Final = 1.0
"""The first wait before a worker that exited is started again: long enough that a worker
dying at start does not spin, short enough that a one-off death costs about a second."""

RESTART_DELAY_MAX_S: Final = 30.0
"""The longest wait between starts: a worker that keeps dying is tried twice a minute, and comes
back at most this long after its cause (a full disk, a broker that was down) went away."""

STABLE_AFTER_S: Final = 60.0
"""How long a worker must have stayed up for its exit to count as a first one again (the wait
goes back to :data:`RESTART_DELAY_S`): longer than a worker takes to start and fail."""

POLL_S: Final = 0.5
"""How often the supervisor looks at its worker and refreshes the status file."""

EXIT_CANNOT_START: Final = 2
"""A ``relayr worker`` exits with this code when its settings, allowlist or application cannot
be loaded (the command line's code for bad input): starting it again cannot help."""

logger = structlog.get_logger("relayr.run")


class WorkerProcess(Protocol):
    """What the supervisor needs of a worker subprocess (``relayr.cli.processes.RelayrProcess``)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        ...

    def stop(self, timeout_s: float) -> int:
        """Warm shutdown, then a kill after ``timeout_s``; returns the exit code."""
        ...

    def kill(self) -> int:
        """Kill the process and what is left of its session; returns the exit code."""
        ...


@dataclass(frozen=True)
class RestartPolicy:
    """How long to wait before starting a worker again (see the module docstring)."""

    first_s: float = RESTART_DELAY_S
    max_s: float = RESTART_DELAY_MAX_S
    stable_after_s: float = STABLE_AFTER_S

    def delay_s(self, exits_in_a_row: int) -> float:
        """The wait before the next start, after ``exits_in_a_row`` (1 or more) quick exits."""
        doublings = min(max(exits_in_a_row - 1, 0), 64)  # 2**64 s is past any max_s
        return min(self.first_s * 2.0**doublings, self.max_s)

    def exits_in_a_row(self, before: int, uptime_s: float) -> int:
        """The count after one more exit of a worker that was up ``uptime_s``."""
        return 1 if uptime_s >= self.stable_after_s else before + 1


def _now() -> datetime:
    return datetime.now(UTC)


class WorkerSupervisor:
    """Starts a worker, and starts it again when it exits, until told to stop.

    Args:
        start: Starts one worker process.
        path: The status file (:func:`status_path`).
        policy: The back-off between starts.
        stop_timeout_s: How long a stopping worker gets before it is killed.
    """

    def __init__(
        self,
        start: Callable[[], WorkerProcess],
        path: Path,
        *,
        policy: RestartPolicy = RestartPolicy(),  # frozen: one shared default is safe
        stop_timeout_s: float,
    ) -> None:
        self._start = start
        self._path = path
        self._policy = policy
        self._stop_timeout_s = stop_timeout_s
        self._worker: WorkerProcess | None = None
        self._started_at = 0.0
        self._status: SupervisorStatus | None = None
        self._status_failing = False
        self._exits_in_a_row = 0
        self.last_exit: WorkerExit | None = None

    def start(self) -> None:
        """Start the first worker.

        Raises:
            OSError: If it cannot be started: ``relayr run`` has nothing to supervise yet.
        """
        self._launch(restarts=0, last_exit=None)

    async def supervise(
        self, stop: asyncio.Event, *, alongside: "asyncio.Future[Any] | None" = None
    ) -> Supervised:
        """Keep a worker running until ``stop`` is set or ``alongside`` (the dispatcher) ends.

        Returns why it returned; ``cannot_start`` when the worker exited with code 2
        (:attr:`last_exit` says how), and then no worker runs.
        """
        restart_at: float | None = None
        while True:
            if stop.is_set():
                return "stopped"
            if alongside is not None and alongside.done():
                return "dispatcher_ended"
            if restart_at is None:
                ended = self._exited()
                if ended is not None and ended.code == EXIT_CANNOT_START:
                    return "cannot_start"
                if ended is not None:
                    restart_at = time.monotonic() + self._back_off(ended)
            elif time.monotonic() >= restart_at:
                restart_at = self._relaunch()
            self._refresh()
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    def stop(self) -> int | None:
        """Stop the worker (warm shutdown) if one runs, kill what is left of its session either
        way, and remove the status file. Returns the exit code of a worker that was running."""
        try:
            if self._worker is None:
                return None
            if self._worker.poll() is not None:
                self._worker.kill()  # its main process is gone: its session's leftovers
                return None
            logger.info("worker stopping", pid=self._worker.pid)
            return self._worker.stop(self._stop_timeout_s)
        finally:
            try:
                self._path.unlink(missing_ok=True)
            except OSError as error:
                logger.warning("status file not removed", path=str(self._path), error=str(error))

    def _exited(self) -> WorkerExit | None:
        """How the worker ended, logged, or None while it runs."""
        assert self._worker is not None
        assert self._status is not None
        returncode = self._worker.poll()
        if returncode is None:
            return None
        uptime_s = time.monotonic() - self._started_at
        ended = WorkerExit.of(returncode, at=_now(), uptime_s=uptime_s)
        self.last_exit = ended
        self._worker.kill()  # its pool processes, orphaned: they would run on beside the next
        fields = {
            "pid": self._worker.pid,
            "exit_code": ended.code,
            "signal": ended.signal,
            "uptime_s": ended.uptime_s,
            "restarts": self._status.restarts,
        }
        if ended.code == EXIT_CANNOT_START:
            logger.error("worker cannot start: its settings, allowlist or application", **fields)
            return ended
        self._exits_in_a_row = self._policy.exits_in_a_row(self._exits_in_a_row, uptime_s)
        logger.warning(
            "worker exited; starting it again",
            restart_in_s=self._policy.delay_s(self._exits_in_a_row),
            exits_in_a_row=self._exits_in_a_row,
            **fields,
        )
        return ended

    def _back_off(self, ended: WorkerExit) -> float:
        """Record that the worker is down until its next start; return the wait."""
        assert self._status is not None
        delay_s = self._policy.delay_s(self._exits_in_a_row)
        exited_at = datetime.fromisoformat(ended.at)
        next_start = datetime.fromtimestamp(exited_at.timestamp() + delay_s, UTC)
        self._write(
            replace(
                self._status,
                state="restarting",
                since=ended.at,
                next_start_at=next_start.isoformat(),
                last_exit=ended,
            )
        )
        return delay_s

    def _relaunch(self) -> float | None:
        """Start the worker again; if it cannot be started, when to try next (monotonic)."""
        assert self._status is not None
        try:
            self._launch(restarts=self._status.restarts + 1, last_exit=self._status.last_exit)
        except OSError as error:
            self._exits_in_a_row = self._policy.exits_in_a_row(self._exits_in_a_row, 0.0)
            delay_s = self._policy.delay_s(self._exits_in_a_row)
            logger.error(
                "worker could not be started; trying again",
                error=f"{type(error).__name__}: {error}",
                restart_in_s=delay_s,
                exits_in_a_row=self._exits_in_a_row,
                restarts=self._status.restarts,
            )
            next_start = datetime.fromtimestamp(_now().timestamp() + delay_s, UTC)
            self._write(replace(self._status, next_start_at=next_start.isoformat()))
            return time.monotonic() + delay_s
        return None

    def _launch(self, *, restarts: int, last_exit: WorkerExit | None) -> None:
        self._worker = self._start()
        self._started_at = time.monotonic()
        logger.info("worker started", pid=self._worker.pid, restarts=restarts)
        self._write(
            SupervisorStatus(
                supervisor_pid=os.getpid(),
                state="running",
                worker_pid=self._worker.pid,
                since=_now().isoformat(),
                restarts=restarts,
                last_exit=last_exit,
            )
        )

    def _write(self, status: SupervisorStatus) -> None:
        self._status = status
        self._best_effort(lambda: write_status(self._path, status))

    def _refresh(self) -> None:
        """Move the status file's mtime: a reader so sees the supervisor is alive."""

        def refresh() -> None:
            try:
                os.utime(self._path)
            except FileNotFoundError:
                if self._status is not None:
                    write_status(self._path, self._status)

        self._best_effort(refresh)

    def _best_effort(self, write: Callable[[], None]) -> None:
        """Write the status file, or log why not (once until it is written again)."""
        try:
            write()
        except OSError as error:
            if not self._status_failing:
                logger.warning(
                    "status file not written; supervising goes on",
                    path=str(self._path),
                    error=f"{type(error).__name__}: {error}",
                )
            self._status_failing = True
            return
        if self._status_failing:
            logger.info("status file written again", path=str(self._path))
        self._status_failing = False
