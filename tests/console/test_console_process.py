"""The ``relayr console`` process itself: its probe, a port already in use, and SIGTERM.

``relayr console --probe`` says whether the console answers; a port in use is bad input (exit
status 2); SIGTERM stops the server, then closes the runtime. Real ``relayr console``
processes (:mod:`tests.console.console_http`).
"""

import signal
import subprocess
import sys
from pathlib import Path

from relayr.cli.processes import relayr_command
from tests.console.console_http import environment_of
from tests.consoles import Console, running_console
from tests.workers import REPO


def test_the_probe_says_whether_the_console_answers(token_console: Console) -> None:
    port = token_console.url.rstrip("/").rsplit(":", 1)[1]
    probe = relayr_command("console", "--probe", "--port", port)
    done = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "console healthy" in done.stdout


def test_a_port_in_use_is_bad_input(token_console: Console, tmp_path: Path) -> None:
    port = token_console.url.rstrip("/").rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "relayr.cli", "console", "--port", port],
        cwd=REPO,
        env=environment_of(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"Error: cannot listen on 127.0.0.1 port {port}: address already in use" in done.stderr
    probe = relayr_command("console", "--probe", "--port", "1")
    refused = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert "console unhealthy" in refused.stderr


def test_sigterm_stops_the_server_then_closes_the_runtime(tmp_path: Path) -> None:
    with running_console(environment_of(tmp_path), tmp_path) as console:
        console.process.signal(signal.SIGTERM)
        assert console.process.wait(60) == 0, console.process.log()
    log = console.process.log()
    assert log.index("Finished server process") < log.index("runtime closed"), log
