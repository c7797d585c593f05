"""Real ``celery worker`` processes for tests: started, waited for, and always stopped.

Each worker is ``python -m celery -A tasks.app worker`` in a session of its own, configured only
by the ``RELAYR_*`` environment the test gives it (a queue of the test's own, so concurrent test
runs on one Redis never take each other's messages), logging to a file the test can read. The
context manager stops it with SIGTERM (a warm shutdown), and kills its whole process group if it
is still there after the timeout, even when the test failed.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALLOWLIST = REPO / "rules" / "allowlist.toml"

READY_TIMEOUT_S = 60.0
"""How long a worker may take to report ready: imports and the pool's forks, on a busy host."""

STOP_TIMEOUT_S = 60.0
"""How long a warm shutdown may take before the worker is killed: running tasks, then each
pool process's turn grace and runtime close."""


def relayr_environment(home: Path, **settings: object) -> dict[str, str]:
    """This process's environment without its ``RELAYR_*``, plus a test's own settings.

    ``settings`` are ``Settings`` field names (``broker_url="redis://..."``). Every test gets a
    home and a queue of its own, the repository's allowlist, JSON logs and a quick dispatcher.
    """
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RELAYR_")}
    defaults: dict[str, object] = {
        "home": home,
        "queue": f"relayr.test.{uuid.uuid4().hex[:12]}",
        "allowlist": ALLOWLIST,
        "log_format": "json",
        "dispatch_interval_s": 0.5,
    }
    for name, value in {**defaults, **settings}.items():
        environment[f"RELAYR_{name.upper()}"] = str(value)
    return environment


@dataclass
class WorkerProcess:
    """A running worker: its process, name and log file."""

    process: subprocess.Popen[bytes]
    name: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        """Kill the worker and its pool processes, whatever state they are in."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Warm shutdown; returns the exit code, or None if it had to be killed."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        finally:
            self.kill()  # pool processes the main process left behind, if any


def start_worker(
    environment: Mapping[str, str], log_dir: Path, *, concurrency: int = 2
) -> WorkerProcess:
    """Start a worker on the environment's ``RELAYR_QUEUE`` and wait until it is ready."""
    name = f"relayr-test-{uuid.uuid4().hex[:8]}@%h"
    log_path = log_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks.app",
        "worker",
        f"--queues={environment['RELAYR_QUEUE']}",
        f"--concurrency={concurrency}",
        f"--hostname={name}",
        "--pool=prefork",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=dict(environment),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = WorkerProcess(process, name, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while " ready." not in worker.log():
        if not worker.alive():
            raise AssertionError(f"the worker exited before it was ready:\n{worker.log()}")
        if time.monotonic() > deadline:
            worker.kill()
            raise AssertionError(f"the worker was not ready in time:\n{worker.log()}")
        time.sleep(0.1)
    return worker


@contextmanager
def running_worker(
    environment: Mapping[str, str], log_dir: Path, *, concurrency: int = 2
) -> Iterator[WorkerProcess]:
    """A worker for the duration of the block; stopped (or killed) however the block ends."""
    worker = start_worker(environment, log_dir, concurrency=concurrency)
    try:
        yield worker
    finally:
        worker.stop()
