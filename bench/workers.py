"""The benchmarks' workers: real ``celery worker`` processes running a case's application.

The processes are :class:`relayr.cli.processes.RelayrProcess`, the wrapper the command line and
the tests use too; this module adds a case's settings (the example's allowlist, JSON logs, which
:func:`bench.cases.count_outcomes` reads) and starts workers from the repository, where
``RELAYR_APP=bench.common:...`` is importable.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Final

from relayr.cli import processes
from relayr.cli.processes import RelayrProcess

REPO: Final = Path(__file__).resolve().parent.parent
ALLOWLIST: Final = REPO / "rules" / "allowlist.toml"

__all__ = ["ALLOWLIST", "REPO", "RelayrProcess", "relayr_environment", "start_worker"]


def relayr_environment(home: Path, **settings: object) -> dict[str, str]:
    """This process's environment without its ``RELAYR_*``, plus a case's settings.

    ``settings`` are ``Settings`` field names; the home, the example's allowlist and JSON logs
    are every case's.
    """
    defaults: dict[str, object] = {"home": home, "allowlist": ALLOWLIST, "log_format": "json"}
    return processes.settings_environment(**{**defaults, **settings})


def start_worker(
    environment: Mapping[str, str], log_dir: Path, *, concurrency: int = 2
) -> RelayrProcess:
    """Start a worker on the environment's ``RELAYR_QUEUE`` and wait until it is ready."""
    return processes.start_worker(environment, log_dir, concurrency=concurrency, cwd=REPO)
