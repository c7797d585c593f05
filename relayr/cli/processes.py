"""relayr and Celery processes, started, waited for and always stopped whole.

:class:`RelayrProcess` wraps every child relayr starts (``relayr run``'s worker, the tests' and
the benchmarks' workers and dispatchers): it runs in a session of its own, is ready when its log
says so (:meth:`RelayrProcess.ready`), stops with SIGTERM and then has its whole session killed,
leftovers included. :func:`relayr_command`, :func:`celery_worker_command` and
:func:`settings_environment` build a child's command and environment, so a test starts a worker
exactly as ``relayr run`` does.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Self

from relayr.core.errors import RelayrError
from relayr.settings import child_environment

READY_MARKER: Final = " ready."
"""What a Celery worker's log says once it consumes (``celery@host ready.``)."""

READY_TIMEOUT_S: Final = 60.0
"""How long a process may take to report ready: imports and a pool's forks, on a busy host."""

STOP_TIMEOUT_S: Final = 60.0
"""How long a warm shutdown may take before the process is killed: running tasks, then each
pool process's turn grace and runtime close."""

POLL_S: Final = 0.1
"""How often :meth:`RelayrProcess.ready` reads the log."""


class ProcessNotReady(RelayrError):
    """Raised when a started process exited, or did not report ready in time; the message
    carries its log."""

    code = "process_not_ready"


@dataclass
class RelayrProcess:
    """A relayr or Celery process in a session of its own.

    Attributes:
        process: The process.
        name: What it is, for messages (a Celery worker: its node name).
        log_path: Its log file, or None when it writes to this process's output.
    """

    process: "subprocess.Popen[bytes]"
    name: str
    log_path: Path | None = None

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        *,
        name: str | None = None,
        environment: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log_path: Path | None = None,
    ) -> Self:
        """Start ``command``; its output goes to ``log_path`` (appended), else to ours."""
        if log_path is None:
            process = subprocess.Popen(
                list(command),
                cwd=cwd,
                env=None if environment is None else dict(environment),
                start_new_session=True,
            )
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("ab") as log:
                process = subprocess.Popen(
                    list(command),
                    cwd=cwd,
                    env=None if environment is None else dict(environment),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        return cls(process, name or " ".join(command[:4]), log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self.process.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process (not its session), if it still runs."""
        if self.alive():
            self.process.send_signal(signum)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the process to end; its exit code.

        Raises:
            subprocess.TimeoutExpired: If it still runs after ``timeout_s``.
        """
        return self.process.wait(timeout_s)

    def log(self) -> str:
        """What the process wrote so far (empty without a log file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def ready(self, marker: str = READY_MARKER, *, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Wait until the log has ``marker``; the process itself, for chaining.

        Raises:
            ProcessNotReady: If the process exits first, or ``timeout_s`` passes (it is
                killed then); the message carries the log.
        """
        deadline = time.monotonic() + timeout_s
        while marker not in self.log():
            if not self.alive():
                raise ProcessNotReady(f"{self.name} exited before it was ready:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ProcessNotReady(f"{self.name} was not ready in time:\n{self.log()}")
            time.sleep(POLL_S)
        return self

    def kill(self) -> int:
        """Kill the process and its session, whatever state they are in; its exit code."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Warm shutdown (SIGTERM), then SIGKILL after ``timeout_s``; its exit code.

        The exit code is negative when a signal ended it (``-9``: it had to be killed). The
        session's leftovers are killed either way.
        """
        self.signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.wait(timeout_s)
        return self.kill()


def relayr_command(*args: str) -> list[str]:
    """``relayr ARGS`` in this interpreter (``python -m relayr.cli``), wherever it is installed."""
    return [sys.executable, "-m", "relayr.cli", *args]


def celery_worker_command(
    queue: str,
    *,
    hostname: str,
    concurrency: int = 2,
    loglevel: str = "INFO",
    app: str = "tasks.app",
) -> list[str]:
    """``celery -A tasks.app worker`` on ``queue``, as the tests and benchmarks start it."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        f"--queues={queue}",
        f"--concurrency={concurrency}",
        f"--hostname={hostname}",
        "--pool=prefork",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]


def settings_environment(**settings: object) -> dict[str, str]:
    """This process's environment without its ``RELAYR_*``, plus ``settings``.

    ``settings`` are :class:`relayr.settings.Settings` field names (``broker_url="redis://..."``),
    each set as its ``RELAYR_*`` variable, so the child runs on exactly these settings.
    """
    return child_environment(
        {f"RELAYR_{name.upper()}": str(value) for name, value in settings.items()}
    )


def start_worker(
    environment: Mapping[str, str],
    log_dir: Path,
    *,
    concurrency: int = 2,
    cwd: Path | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> RelayrProcess:
    """Start a Celery worker on the environment's ``RELAYR_QUEUE``; return it once ready.

    It has a node name and a log file of its own in ``log_dir``.

    Raises:
        ProcessNotReady: If it exits or stays silent (it is killed then).
    """
    tag = uuid.uuid4().hex[:8]
    name = f"relayr-{tag}@%h"
    command = celery_worker_command(
        environment["RELAYR_QUEUE"], hostname=name, concurrency=concurrency
    )
    worker = RelayrProcess.start(
        command,
        name=name,
        environment=environment,
        cwd=cwd,
        log_path=log_dir / f"worker-{tag}.log",
    )
    return worker.ready(timeout_s=ready_timeout_s)


@contextmanager
def running_worker(
    environment: Mapping[str, str],
    log_dir: Path,
    *,
    concurrency: int = 2,
    cwd: Path | None = None,
) -> Iterator[RelayrProcess]:
    """A worker (:func:`start_worker`) for the block; stopped, or killed, however it ends."""
    worker = start_worker(environment, log_dir, concurrency=concurrency, cwd=cwd)
    try:
        yield worker
    finally:
        worker.stop()
