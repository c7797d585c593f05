"""What tests of ``relayr run`` share: the worker it supervised cleaned up, and a bounded wait.

``relayr run`` starts its worker in a session of its own (:mod:`relayr.cli.processes`), so
stopping or killing ``relayr run`` itself does not reach the worker when ``relayr run`` could
not stop it first (killed, or a test that failed while it was starting the worker). The
supervisor's status file (:func:`relayr.runtime.supervisor.status_path`) names the worker it runs:
:func:`kill_left_worker` kills that worker's session, so no test leaves a worker behind.
:func:`wait_for` waits, within :data:`WAIT_S`, for the state a supervisor's step reaches.
"""

import os
import signal
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from relayr.observe.health import read_status, status_path

WAIT_S = 90.0
"""How long a step may take to reach the state it waits for: far above what it needs."""


def kill_left_worker(home: Path) -> None:
    """Kill the worker, and its pool processes, that a ``relayr run`` of ``home`` left running.

    Only the process the status names that still leads a session of its own and runs on this
    home (its ``RELAYR_HOME``) is killed: a pid the system gave to another process since, another
    test's worker included, is left alone.
    """
    found = read_status(status_path(home))
    if found is None:
        return
    pid = found[0].worker_pid
    homes = {f"RELAYR_HOME={home}".encode(), f"RELAYR_HOME={home.absolute()}".encode()}
    with suppress(ProcessLookupError, PermissionError, FileNotFoundError):
        if pid <= 0 or os.getsid(pid) != pid:
            return
        environment = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        if environment & homes:
            os.killpg(pid, signal.SIGKILL)


def wait_for[T](probe: Callable[[], T | None], what: str, timeout_s: float = WAIT_S) -> T:
    """Poll ``probe`` every 0.1 s until it returns something true; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
