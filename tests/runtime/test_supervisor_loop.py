"""The supervisor's loop on real short-lived processes: started again after a wait, or not at all.

A worker that keeps exiting is started again with a growing wait; one that cannot start (it
exits 2) is not; one that could not be started (the command is missing) is tried again after the
back-off; a status file that cannot be written stops nothing; and nothing of an exited worker's
session outlives it. The workers are lines of Python run as ``relayr run`` starts its worker.
"""

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from relayr.cli.processes import RelayrProcess
from relayr.observe.health import read_status, status_path
from relayr.runtime.supervisor import RestartPolicy, WorkerSupervisor
from tests.runtime.supervised import WAIT_S, wait_for

pytestmark = pytest.mark.process

EXITING = "import sys; sys.exit(1)"
STAYING = "import time; time.sleep(600)"
CANNOT_START = None
"""In :func:`starting`: a command that does not exist, so starting it raises ``OSError``."""


def starting(
    *codes: str | None,
) -> tuple[Callable[[], RelayrProcess], list[RelayrProcess]]:
    """Starts a real process per call, running each of ``codes`` (a line of Python) in turn,
    then the last one again, in a session of its own as ``relayr run`` starts its worker."""
    started: list[RelayrProcess] = []
    calls = 0

    def start() -> RelayrProcess:
        nonlocal calls
        code = codes[min(calls, len(codes) - 1)]
        calls += 1
        command = ["/nonexistent/relayr-worker"] if code is None else [sys.executable, "-c", code]
        started.append(RelayrProcess.start(command, name="worker"))
        return started[-1]

    return start, started


def leaving_a_child(pid_file: Path) -> str:
    """A worker whose main process exits and leaves a process of its session behind, whose pid
    it writes to ``pid_file`` first (as a pool process outlives a killed Celery worker)."""
    return (
        "import pathlib, subprocess, sys; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid)); "
        "sys.exit(1)"
    )


def gone(pid: int) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie no one reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@contextmanager
def killed_in_the_end(pid_file: Path) -> Iterator[None]:
    """Whatever the test found, the left-behind process does not outlive it."""
    try:
        yield
    finally:
        if pid_file.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def until(probe: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_worker_that_keeps_exiting_is_started_again_with_a_growing_wait(
    tmp_path: Path,
) -> None:
    start, started = starting(EXITING, EXITING, STAYING)
    path = status_path(tmp_path)
    policy = RestartPolicy(first_s=0.2, max_s=0.4)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    supervisor.start()
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.supervise(stop))

    def running_again() -> bool:
        found = read_status(path)
        return len(started) == 3 and found is not None and found[0].state == "running"

    with capture_logs() as logs:
        try:
            await until(running_again, "the third start, which stays up")
            found = read_status(path)
            assert found is not None
            assert (found[0].restarts, found[0].worker_pid) == (2, started[2].pid)
            assert found[0].last_exit is not None
            assert found[0].last_exit.code == 1
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    assert [process.poll() for process in started[:2]] == [1, 1]
    assert started[2].poll() == -signal.SIGTERM  # stopped by the supervisor
    exits = [e for e in logs if e["event"] == "worker exited; starting it again"]
    assert [(e["pid"], e["exit_code"], e["restart_in_s"]) for e in exits] == [
        (started[0].pid, 1, 0.2),
        (started[1].pid, 1, 0.4),
    ]
    starts = [(e["pid"], e["restarts"]) for e in logs if e["event"] == "worker started"]
    assert starts == [(started[1].pid, 1), (started[2].pid, 2)]  # the first, before capture
    assert not path.exists()


async def test_a_worker_that_cannot_start_is_not_started_again(tmp_path: Path) -> None:
    start, started = starting("import sys; sys.exit(2)")
    path = status_path(tmp_path)
    supervisor = WorkerSupervisor(start, path, policy=RestartPolicy(first_s=0.1), stop_timeout_s=1)
    supervisor.start()
    supervised = await asyncio.wait_for(supervisor.supervise(asyncio.Event()), WAIT_S)
    supervisor.stop()
    assert supervised == "cannot_start"
    assert len(started) == 1
    assert supervisor.last_exit is not None
    assert supervisor.last_exit.code == 2
    assert not path.exists()


async def test_a_worker_that_cannot_be_started_is_tried_again_after_the_back_off(
    tmp_path: Path,
) -> None:
    """Starting it raised (as a fork fails with no memory): one more exit in a row, logged,
    and relayr run goes on."""
    start, started = starting(EXITING, CANNOT_START, STAYING)
    path = status_path(tmp_path)
    policy = RestartPolicy(first_s=0.2, max_s=0.4)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    supervisor.start()
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.supervise(stop))

    def running_again() -> bool:
        found = read_status(path)
        return len(started) == 2 and found is not None and found[0].state == "running"

    with capture_logs() as logs:
        try:
            await until(running_again, "the start after the one that failed")
            found = read_status(path)
            assert found is not None
            assert (found[0].restarts, found[0].worker_pid) == (1, started[1].pid)
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    [failed] = [e for e in logs if e["event"] == "worker could not be started; trying again"]
    assert (failed["restart_in_s"], failed["exits_in_a_row"]) == (0.4, 2)
    assert failed["error"].startswith("FileNotFoundError")
    assert started[1].poll() == -signal.SIGTERM


async def test_a_status_file_that_cannot_be_written_does_not_stop_the_supervisor(
    tmp_path: Path,
) -> None:
    """The status is for health only: a worker that exits is still started again."""
    (tmp_path / "health").write_text("a file where the status folder goes")
    path = status_path(tmp_path)
    start, started = starting(EXITING, STAYING)
    policy = RestartPolicy(first_s=0.1, max_s=0.1)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    stop = asyncio.Event()
    with capture_logs() as logs:
        supervisor.start()
        task = asyncio.create_task(supervisor.supervise(stop))
        try:
            await until(lambda: len(started) == 2, "the worker to be started again")
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    assert [p.poll() for p in started] == [1, -signal.SIGTERM]
    warned = [e for e in logs if e["event"] == "status file not written; supervising goes on"]
    assert len(warned) == 1  # once, not at every poll
    assert "NotADirectoryError" in warned[0]["error"] or "FileExistsError" in warned[0]["error"]


async def test_a_worker_that_exited_leaves_no_process_of_its_session_behind(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    start, _ = starting(leaving_a_child(pid_file))
    path = status_path(tmp_path)
    supervisor = WorkerSupervisor(start, path, policy=RestartPolicy(first_s=600), stop_timeout_s=1)
    stop = asyncio.Event()
    with killed_in_the_end(pid_file):
        supervisor.start()
        task = asyncio.create_task(supervisor.supervise(stop))
        try:
            await until(
                lambda: (found := read_status(path)) is not None and found[0].state == "restarting",
                "the supervisor to see its worker exit",
            )
            child = int(pid_file.read_text())
            await until(lambda: gone(child), "the worker's leftover to be killed", timeout_s=30)
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()


def test_stopping_kills_what_a_worker_that_exited_left_behind(tmp_path: Path) -> None:
    """Stopped before it saw the exit, the supervisor still cleans the worker's session."""
    pid_file = tmp_path / "child.pid"
    start, started = starting(leaving_a_child(pid_file))
    supervisor = WorkerSupervisor(start, status_path(tmp_path), stop_timeout_s=1)
    with killed_in_the_end(pid_file):
        supervisor.start()
        assert started[0].wait(WAIT_S) == 1
        child = int(pid_file.read_text())
        assert not gone(child)

        assert supervisor.stop() is None

        wait_for(lambda: gone(child), "the worker's leftover to be killed", timeout_s=30)
