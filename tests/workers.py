"""Real ``celery worker`` processes for tests: started, waited for, and always stopped.

The processes themselves are :class:`relayr.cli.processes.RelayrProcess`, the one wrapper the
command line and the benchmarks use too. This module adds what tests share: each worker is
``python -m celery -A tasks.app worker`` run from the repository, configured only by the
``RELAYR_*`` environment the test gives it (a queue of the test's own, so concurrent test runs
on one Redis never take each other's messages), logging to a file the test can read. The
context manager stops it with SIGTERM (a warm shutdown), and kills its whole process group if
it is still there after the timeout, even when the test failed.
"""

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from relayr.cli import processes
from relayr.cli.processes import READY_TIMEOUT_S, STOP_TIMEOUT_S, RelayrProcess

REPO = Path(__file__).resolve().parent.parent
ALLOWLIST = REPO / "rules" / "allowlist.toml"

__all__ = [
    "ALLOWLIST",
    "READY_TIMEOUT_S",
    "REPO",
    "STOP_TIMEOUT_S",
    "RelayrProcess",
    "relayr_environment",
    "running_worker",
    "start_worker",
]


def relayr_environment(home: Path, **settings: object) -> dict[str, str]:
    """This process's environment without its ``RELAYR_*``, plus a test's own settings.

    ``settings`` are ``Settings`` field names (``broker_url="redis://..."``). Every test gets a
    home and a queue of its own, the repository's allowlist, JSON logs and a quick dispatcher.
    """
    defaults: dict[str, object] = {
        "home": home,
        "queue": f"relayr.test.{uuid.uuid4().hex[:12]}",
        "allowlist": ALLOWLIST,
        "log_format": "json",
        "dispatch_interval_s": 0.5,
    }
    return processes.settings_environment(**{**defaults, **settings})


def start_worker(
    environment: Mapping[str, str], log_dir: Path, *, concurrency: int = 2
) -> RelayrProcess:
    """Start a worker on the environment's ``RELAYR_QUEUE`` and wait until it is ready."""
    return processes.start_worker(environment, log_dir, concurrency=concurrency, cwd=REPO)


@contextmanager
def running_worker(
    environment: Mapping[str, str], log_dir: Path, *, concurrency: int = 2
) -> Iterator[RelayrProcess]:
    """A worker for the duration of the block; stopped (or killed) however the block ends."""
    with processes.running_worker(environment, log_dir, concurrency=concurrency, cwd=REPO) as w:
        yield w
