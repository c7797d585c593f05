"""What a test of ``relayr run`` cleans up: the worker it supervised, whatever became of it.

``relayr run`` starts its worker in a session of its own (:mod:`relayr.cli.processes`), so
stopping or killing ``relayr run`` itself does not reach the worker when ``relayr run`` could
not stop it first (killed, or a test that failed while it was starting the worker). The
supervisor's status file (:func:`relayr.supervisor.status_path`) names the worker it runs:
:func:`kill_left_worker` kills that worker's session, so no test leaves a worker behind.
"""

import os
import signal
from contextlib import suppress
from pathlib import Path

from relayr.supervisor import read_status, status_path


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
