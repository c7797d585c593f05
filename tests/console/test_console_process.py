"""The ``relayr console`` process itself: its probe, a port already in use, a bad tokens file,
and SIGTERM.

``relayr console --probe`` says whether the console answers; a port in use and an operators'
tokens file with any problem are bad input (exit status 2, naming what is wrong); SIGTERM stops
the server, then closes the runtime. Real ``relayr console`` processes
(:mod:`tests.console.console_http`).
"""

import signal
import subprocess
from pathlib import Path

import pytest

from relayr.cli.processes import relayr_command
from tests.console.console_http import environment_of
from tests.console.consoles import Console, running_console
from tests.workers import REPO, relayr_output

pytestmark = pytest.mark.process


def console_command(environment: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``relayr console ARGS`` run to its end (it stops at once on bad input)."""
    return relayr_output(environment, "console", *args, check=False, timeout_s=60)


def test_the_probe_says_whether_the_console_answers(token_console: Console) -> None:
    port = token_console.url.rstrip("/").rsplit(":", 1)[1]
    probe = relayr_command("console", "--probe", "--port", port)
    done = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "console healthy" in done.stdout


def test_a_port_in_use_is_bad_input(token_console: Console, tmp_path: Path) -> None:
    port = token_console.url.rstrip("/").rsplit(":", 1)[1]
    done = console_command(environment_of(tmp_path), "--port", port)
    assert done.returncode == 2
    assert f"Error: cannot listen on 127.0.0.1 port {port}: address already in use" in done.stderr
    probe = relayr_command("console", "--probe", "--port", "1")
    refused = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert "console unhealthy" in refused.stderr


SHARED = "console-process-shared-token-0123"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('alice = "short"\n', "operator 'alice': use a token of at least 16 characters"),
        ("alice = [1]\n", "operator 'alice': give the token as a string"),
        ('alice = "x-0123456789abcdef"\nbob = "x-0123456789abcdef"\n', "is 'alice''s too"),
        ('alice = "x-0123456789abcdef\n', "not TOML"),
        ("", "names no operator"),
        ('console = "x-0123456789abcdef"\n', "the name is RELAYR_CONSOLE_TOKEN's holder's"),
        ('alice = "x-0123456789abcdef"\n" alice" = "y-0123456789abcdef"\n', "given twice"),
        (f'alice = "{SHARED}"\n', "operator 'alice': the token is RELAYR_CONSOLE_TOKEN too"),
        (None, "cannot be read: No such file or directory"),
    ],
)
def test_a_bad_operators_tokens_file_is_bad_input_naming_what_is_wrong(
    tmp_path: Path, text: str | None, said: str
) -> None:
    tokens = tmp_path / "operators.toml"
    if text is not None:
        tokens.write_text(text)
    environment = environment_of(tmp_path, console_token=SHARED, console_tokens=tokens)
    done = console_command(environment, "--port", "0")
    assert done.returncode == 2, done.stderr
    assert f"Error: RELAYR_CONSOLE_TOKENS {tokens}" in done.stderr
    assert said in done.stderr
    assert SHARED not in done.stderr  # a token is a secret: never told back
    assert "x-0123456789abcdef" not in done.stderr


def test_sigterm_stops_the_server_then_closes_the_runtime(tmp_path: Path) -> None:
    with running_console(environment_of(tmp_path), tmp_path) as console:
        console.process.signal(signal.SIGTERM)
        assert console.process.wait(60) == 0, console.process.log()
    log = console.process.log()
    assert log.index("Finished server process") < log.index("runtime closed"), log
