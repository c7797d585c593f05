"""Real ``celery worker`` processes for tests: started, waited for, and always stopped.

The processes themselves are :class:`relayr.cli.processes.RelayrProcess`, the one wrapper the
command line and the benchmarks use too. This module adds what tests share: each worker is
``python -m celery -A tasks.app worker`` run from the repository, configured only by the
``RELAYR_*`` environment the test gives it (a queue of the test's own, so concurrent test runs
on one Redis never take each other's messages), logging to a file the test can read. The
context manager stops it with SIGTERM (a warm shutdown), and kills its whole process group if
it is still there after the timeout, even when the test failed.

The same holds for ``relayr dispatch`` (:func:`running_dispatcher`). What the tests read of
these processes is shared too: their JSON log lines (:func:`log_records`), a bounded wait
for a condition that fails at once, with the logs, if a process it needs died
(:func:`until`), and relayr's commands: as a process of their own (:func:`relayr_json`,
:func:`relayr_output`), or in the test's own process (:func:`relayr_here`).
"""

import json
import logging
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Final

import structlog

from relayr.cli import processes
from relayr.cli.processes import READY_TIMEOUT_S, STOP_TIMEOUT_S, RelayrProcess, relayr_command

REPO = Path(__file__).resolve().parent.parent
ALLOWLIST = REPO / "rules" / "allowlist.toml"

__all__ = [
    "ALLOWLIST",
    "DISPATCHER_READY",
    "READY_TIMEOUT_S",
    "REPO",
    "STOP_TIMEOUT_S",
    "TURNS_SETTLE_S",
    "RelayrProcess",
    "log_records",
    "relayr_environment",
    "relayr_here",
    "relayr_json",
    "relayr_output",
    "running_dispatcher",
    "running_worker",
    "start_worker",
    "until",
]

DISPATCHER_READY: Final = '"runtime started"'
"""What a dispatcher's JSON log says once it runs (relayr.runtime.process)."""

COMMAND_TIMEOUT_S: Final = 120.0
"""How long a relayr command run as a process may take: far above what one needs."""

TURNS_SETTLE_S: Final = 60.0
"""How long a test waits for a process's agent turns to end (``StartedTurns.settled``): a
scripted model's turn takes milliseconds."""

POLL_S: Final = 0.2
"""How often :func:`until` looks again: a probe reads a store or a log, cheap at this rate."""


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


def relayr_here(environment: Mapping[str, str], *args: str) -> Any:
    """``relayr ARGS --json`` in this process (click's runner), its last line parsed; it must
    exit 0.

    For what a test makes, publishes and reads with relayr's commands around the processes under
    test, and above all for what it polls: as a process, each command would be a Python start
    (about 2 s of CPU on the 2-core machine, beside the processes under test). A command whose
    exit code or stderr the test checks, or that ops type as an action, runs as a process of its
    own (:func:`relayr_output`, :func:`relayr_json`). The command configures logging as a
    process's main would; this process's is put back.
    """
    from click.testing import CliRunner, Result

    from relayr.cli import cli

    def invoke() -> Result:
        return CliRunner().invoke(cli, [*args, "--json"], env=dict(environment))

    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    try:
        # a thread of its own: the command runs its event loop, and the caller may be in one
        # (Playwright's sync API runs one in the test's thread)
        with ThreadPoolExecutor(max_workers=1) as pool:
            result = pool.submit(invoke).result()
    finally:
        root.handlers, root.level = handlers, level
        structlog.configure(**config)
    assert result.exit_code == 0, f"{result.output}{result.exception!r}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def relayr_output(
    environment: Mapping[str, str],
    *args: str,
    cwd: Path = REPO,
    check: bool = True,
    timeout_s: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """``relayr ARGS`` as a process of its own (a ``relayr-cli``, as an operator runs it), in
    ``cwd``; unless ``check`` is false, it must exit 0."""
    done = subprocess.run(
        relayr_command(*args),
        cwd=cwd,
        env=dict(environment),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if check:
        assert done.returncode == 0, done.stderr + done.stdout
    return done


def relayr_json(environment: Mapping[str, str], *args: str, check: bool = True) -> Any:
    """``relayr ARGS --json`` as a process of its own, its last line parsed (``None`` when it
    printed nothing); unless ``check`` is false, it must exit 0."""
    printed = relayr_output(environment, *args, "--json", check=check).stdout.strip()
    return json.loads(printed.splitlines()[-1]) if printed else None


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


@contextmanager
def running_dispatcher(
    environment: Mapping[str, str], log_dir: Path, *args: str, name: str = "dispatcher"
) -> Iterator[RelayrProcess]:
    """``relayr dispatch ARGS`` for the block, once its log says it runs; stopped (or killed)
    however the block ends. It logs to ``<log_dir>/<name>.log``."""
    process = RelayrProcess.start(
        relayr_command("dispatch", *args),
        name=name,
        environment=environment,
        cwd=REPO,
        log_path=log_dir / f"{name}.log",
    )
    try:
        yield process.ready(DISPATCHER_READY)
    finally:
        process.stop()


def log_records(text: str) -> Iterator[dict[str, Any]]:
    """The JSON lines of a log (``RELAYR_LOG_FORMAT=json``), in order.

    Other lines (Celery's banner, a traceback) are skipped, and so is a last line still being
    written when the log was read.
    """
    for line in text.splitlines():
        if line.startswith("{"):
            with suppress(ValueError):
                yield json.loads(line)


def until[T](
    what: str,
    probe: Callable[[], T | None],
    *processes: RelayrProcess,
    timeout_s: float,
    poll_s: float = POLL_S,
) -> T:
    """Poll ``probe`` until it returns something other than None; return that.

    Fails at once, with its log, if one of ``processes`` died meanwhile, and with their logs'
    ends after ``timeout_s``: a bound that passes fails the test, it never makes anything
    happen.
    """
    deadline = time.monotonic() + timeout_s
    while (found := probe()) is None:
        for process in processes:
            assert process.alive(), f"{process.name} died waiting for {what}:\n{process.log()}"
        if time.monotonic() > deadline:
            logs = "\n".join(f"== {p.name}\n{p.log()[-6000:]}" for p in processes)
            raise AssertionError(f"timed out waiting for {what} ({timeout_s} s)\n{logs}")
        time.sleep(poll_s)
    return found
