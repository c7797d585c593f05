"""What the console refuses of a request before any page, and what every response carries, on
a real ``relayr console`` process.

A body over :data:`MAX_BODY_BYTES` is refused before it is read, declared or chunked; every
response carries headers that forbid scripts and frames; wherever it listens, the console
answers IP addresses, ``localhost`` and the names it was given only (DNS rebinding), and an
``--allowed-host`` that is no host name is bad input. The consoles are
:mod:`tests.console.console_http`'s.
"""

import socket
from pathlib import Path

import pytest

from relayr.console.security import (
    MAX_BODY_BYTES,
)
from tests.console.console_http import TOKEN, environment_of
from tests.console.consoles import Client, Console, running_console
from tests.workers import relayr_output

pytestmark = pytest.mark.process


def raw_post(console: Console, head: str, body: bytes) -> str:
    """Send a POST's ``head`` lines and ``body`` as they are; the status line of the answer."""
    host, port = console.url.split("/")[2].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        request = f"POST /login HTTP/1.1\r\nHost: {host}:{port}\r\n{head}\r\n"
        connection.sendall(request.encode() + body)
        return connection.makefile("rb").readline().decode()


def test_a_body_too_large_is_refused_before_it_is_read(token_console: Console) -> None:
    form = "Content-Type: application/x-www-form-urlencoded\r\n"
    declared = raw_post(token_console, f"{form}Content-Length: {MAX_BODY_BYTES + 1}\r\n", b"")
    assert declared.startswith("HTTP/1.1 413"), declared
    # a chunked body carries no length: the console counts what it reads, and stops there
    # (fields each within the form's own limits, so that the count is what refuses them; one
    # byte over, so that the console has read all of it when it answers)
    fields = "&".join(f"field{index}={'t' * 15_000}" for index in range(69))
    chunk = (fields + "&last=").encode()
    chunk += b"t" * (MAX_BODY_BYTES + 1 - len(chunk))
    assert len(chunk) == MAX_BODY_BYTES + 1
    chunked = raw_post(
        token_console,
        f"{form}Transfer-Encoding: chunked\r\n",
        f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n",
    )
    assert chunked.startswith("HTTP/1.1 413"), chunked


def test_every_response_forbids_scripts_and_frames_and_known_host_names_only(
    token_console: Console,
) -> None:
    client = Client()
    for path in ("/runs", "/static/console.css", "/nowhere", "/run?id=fir_x"):
        _, _, headers = client.get(token_console.at(path))
        policy = headers["content-security-policy"]
        assert "default-src 'none'" in policy
        assert "script-src" not in policy  # default-src 'none': no script at all
        assert "frame-ancestors 'none'" in policy
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
    port = token_console.url.rstrip("/").rsplit(":", 1)[1]
    for host, status in (
        (f"localhost:{port}", 200),
        (f"127.0.0.1:{port}", 200),
        (f"[::1]:{port}", 200),
        (f"attacker.example:{port}", 400),
        (f"127.0.0.1.nip.io:{port}", 400),
    ):
        assert client.get(token_console.at("/runs"), {"Host": host})[0] == status, host


def test_bound_to_every_address_it_answers_the_names_it_was_given_only(tmp_path: Path) -> None:
    """As compose and Kubernetes run it: on 0.0.0.0, reached through the host's loopback or a
    port-forward, or by the names of a proxy in front (--allowed-host)."""
    environment = environment_of(tmp_path, console_token=TOKEN)
    arguments = ("--host", "0.0.0.0", "--allowed-host", "Console.Example", "--https-only")
    with running_console(environment, tmp_path, *arguments) as console:
        port = console.url.rstrip("/").rsplit(":", 1)[1]
        client = Client()
        for host, status in (
            (f"localhost:{port}", 200),
            (f"127.0.0.1:{port}", 200),
            (f"10.1.2.3:{port}", 200),  # an address: no other site's name
            (f"console.example:{port}", 200),
            ("console.example", 200),
            (f"attacker.example:{port}", 400),
            (f"console.example.attacker.example:{port}", 400),
            (f"127.0.0.1.nip.io:{port}", 400),
        ):
            answered, page, _ = client.get(console.at("/runs"), {"Host": host})
            assert answered == status, (host, page)
        refused = client.get(console.at("/healthz"), {"Host": f"attacker.example:{port}"})
        assert refused[0] == 400
        assert "does not answer to the host name 'attacker.example'" in refused[1]
        # behind TLS, the session cookie is never sent in clear
        _, _, headers = client.get(console.at("/login"))
        assert "; secure" in headers["set-cookie"].lower()
    log = console.process.log()
    assert "warning: listening on 0.0.0.0, not loopback" in log


@pytest.mark.parametrize("value", ["console.example:8787", "https://console.example", "a b"])
def test_an_allowed_host_that_is_no_host_name_is_bad_input(tmp_path: Path, value: str) -> None:
    done = relayr_output(
        environment_of(tmp_path),
        "console",
        "--port",
        "0",
        "--allowed-host",
        value,
        check=False,
        timeout_s=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: --allowed-host {value!r} is not a host name: give the name a browser reaches "
        "the console by, without scheme, port or path (console.example.com)"
    ]
    assert not (tmp_path / "relayr.db").exists()
