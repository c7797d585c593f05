"""relayr's process wrapper (:mod:`relayr.cli.processes`): ready by its log, stopped whole.

Real processes of a few lines of Python each: one that says it is ready, one that exits first,
one that ignores SIGTERM and leaves a child in its session.
"""

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relayr.cli.processes import ProcessNotReady, RelayrProcess, relayr_command

READY = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("worker@host ready.", flush=True)
    time.sleep(600)
    """
)

STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"child {child.pid} ready.", flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.process
def test_a_process_is_ready_by_its_log_and_stops_warm(tmp_path: Path) -> None:
    process = RelayrProcess.start(
        [sys.executable, "-c", READY], name="ready", log_path=tmp_path / "ready.log"
    )
    assert process.ready(timeout_s=60) is process
    assert process.alive()
    assert process.stop(timeout_s=60) == 0
    assert "ready." in process.log()


@pytest.mark.process
def test_a_process_that_exits_first_is_not_ready_and_says_why(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('no settings here'); raise SystemExit(2)"]
    process = RelayrProcess.start(command, name="quitter", log_path=tmp_path / "quit.log")
    with pytest.raises(ProcessNotReady, match="quitter exited before it was ready") as refused:
        process.ready(timeout_s=60)
    assert "no settings here" in refused.value.message
    assert process.wait(60) == 2


@pytest.mark.process
def test_a_process_that_ignores_sigterm_is_killed_with_its_session(tmp_path: Path) -> None:
    process = RelayrProcess.start(
        [sys.executable, "-c", STUBBORN], name="stubborn", log_path=tmp_path / "stubborn.log"
    )
    process.ready(timeout_s=60)
    child = int(process.log().split()[1])
    assert alive(child)
    assert process.stop(timeout_s=0.5) == -signal.SIGKILL
    deadline = time.monotonic() + 60  # SIGKILL is sent: the child ends as soon as it runs
    while alive(child):
        assert time.monotonic() < deadline, f"child {child} outlived its session"
        time.sleep(0.05)


def test_relayr_runs_in_this_interpreter() -> None:
    assert relayr_command("worker", "-c", "1") == [
        sys.executable,
        "-m",
        "relayr.cli",
        "worker",
        "-c",
        "1",
    ]
