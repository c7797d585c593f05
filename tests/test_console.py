"""The console's security and pages over HTTP, on a real ``relayr console`` process.

A script talks to the console as a forger would (no browser, no JavaScript): every POST is
refused without the token, without a session, without the session's CSRF token, or from
another site's page; a login ends :data:`SESSION_MAX_AGE_S` after it was made, however fresh
its cookie; a login never leads to another site; wherever it listens, the console answers IP
addresses, ``localhost`` and the names it was given only (DNS rebinding); every response
carries headers that forbid scripts and frames; stored markup comes back escaped; bad
parameters are one line naming them (400), and so is a run id that two workspaces hold,
named without its workspace. The browser tests on real workers are in
``tests/test_console_browser.py``.
"""

import asyncio
import base64
import html
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import itsdangerous
import pytest
from reflexr import SourceActor
from reflexr.workspace import Reactor

from relayr.cli.processes import relayr_command
from relayr.console.security import (
    LOGGED_IN_AT,
    MAX_BODY_BYTES,
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    session_secret,
)
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.consoles import Client, Console, relayr, running_console
from tests.workers import REPO, relayr_environment

TOKEN = "console-test-token-0123456789abcdef"
WHERE = "acme/ops"
SCRIPT = "<script>document.title='pwned'</script>"
PAGES = ("/runs", "/runs?status=dead", "/allowlist", "/health", "/login")
ACTIONS = ("/run/retry", "/run/cancel", "/run/skip", "/retry-dead", "/logout", "/login")


def environment_of(home: Path, **settings: object) -> dict[str, str]:
    return relayr_environment(home, app="tests.console_app:create_console_app", **settings)


@pytest.fixture(scope="module")
def token_console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    home = tmp_path_factory.mktemp("token-console")
    with running_console(environment_of(home, console_token=TOKEN), home) as console:
        yield console


@pytest.fixture(scope="module")
def read_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Console, str]]:
    home = tmp_path_factory.mktemp("read-only-console")
    allowlist = home / "allowlist.toml"
    allowlist.write_text(f'[rules."{SCRIPT}"]\nturns = true\n')
    environment = environment_of(home, allowlist=allowlist)
    thread = relayr(environment, "thread", "create", WHERE, "--title", SCRIPT)["id"]
    with running_console(environment, home) as console:
        yield console, thread


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, page
    return found[1]


def logged_in(console: Console) -> tuple[Client, str]:
    """A client logged in with the token, and its session's CSRF token."""
    client = Client()
    _, page, _ = client.get(console.at("/login"))
    status, _, headers = client.post(
        console.at("/login"), {"csrf": csrf_of(page), "token": TOKEN, "next": "/health"}
    )
    assert (status, headers["location"]) == (303, "/health")
    _, page, _ = client.get(console.at("/runs"))
    return client, csrf_of(page)


def test_without_the_token_every_page_reads_and_every_post_is_refused(
    read_only: tuple[Console, str],
) -> None:
    console, _ = read_only
    client = Client()
    for path in PAGES:
        status, page, headers = client.get(console.at(path))
        assert status == 200, path
        assert "Read-only: RELAYR_CONSOLE_TOKEN is not set" in page, path
        assert 'method="post"' not in page, path
        assert "set-cookie" not in headers, path
    for path in ACTIONS:
        status, page, _ = client.post(console.at(path), {"id": "fir_1", "csrf": "x"})
        assert status == 403, path
        assert "read-only: RELAYR_CONSOLE_TOKEN is not set" in page, path


def test_with_the_token_a_visitor_reads_and_every_post_needs_a_session(
    token_console: Console,
) -> None:
    client = Client()
    for path in PAGES[:-1]:
        status, page, _ = client.get(token_console.at(path))
        assert status == 200, path
        assert "Read-only until you" in page
        assert 'method="post"' not in page, path
    for path in ACTIONS[:-1]:
        status, page, _ = client.post(token_console.at(path), {"id": "fir_1", "csrf": "x"})
        assert status == 403, path
        assert "CSRF token is missing or stale" in page


def test_login_takes_the_token_and_the_forms_csrf_token(token_console: Console) -> None:
    client = Client()
    status, page, headers = client.get(token_console.at("/login"))
    assert status == 200
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    assert "httponly" in cookie.lower()
    assert "samesite=strict" in cookie.lower()
    csrf = csrf_of(page)
    wrong = client.post(token_console.at("/login"), {"csrf": csrf, "token": TOKEN[:-1] + "x"})
    assert wrong[0] == 403
    assert "not the console's token" in html.unescape(wrong[1])
    # another browser's session: the token alone does not log in without this one's CSRF token
    forged = Client().post(token_console.at("/login"), {"csrf": csrf, "token": TOKEN})
    assert forged[0] == 403
    # a login never sends a person to another site
    status, _, headers = client.post(
        token_console.at("/login"), {"csrf": csrf, "token": TOKEN, "next": "//evil.example/"}
    )
    assert (status, headers["location"]) == (303, "/runs")
    status, page, _ = client.get(token_console.at("/runs"))
    assert "Logged in with the console's token" in html.unescape(page)
    assert csrf_of(page) != csrf, "a login must rotate the CSRF token"


# what browsers read as another site's address once they drop tabs and line breaks and read a
# backslash as a slash
ELSEWHERE = (
    "//evil.example/",
    "/\t/evil.example/",
    "/\n/evil.example/",
    "/\r\n/evil.example/",
    "/\\evil.example/",
    "\\/evil.example/",
    " //evil.example/",
    "https://evil.example/",
    "/ /evil.example/",
)


def test_a_login_never_leads_to_another_site(token_console: Console) -> None:
    client, _ = logged_in(token_console)
    for where in ELSEWHERE:
        status, page, _ = client.get(token_console.at("/login?" + urlencode({"next": where})))
        assert status == 200, where
        [link] = re.findall(r'<a href="([^"]*)">Go on</a>', page)
        assert link == "/runs", where
    fresh = Client()
    _, page, _ = fresh.get(token_console.at("/login"))
    for where in ELSEWHERE:
        status, _, headers = fresh.post(
            token_console.at("/login"), {"csrf": csrf_of(page), "token": TOKEN, "next": where}
        )
        assert (status, headers["location"]) == (303, "/runs"), where
        _, page, _ = fresh.get(token_console.at("/login"))
    status, _, headers = fresh.post(
        token_console.at("/login"),
        {"csrf": csrf_of(page), "token": TOKEN, "next": "/runs?status=dead&page=2"},
    )
    assert (status, headers["location"]) == (303, "/runs?status=dead&page=2")


def session_cookie(**session: object) -> dict[str, str]:
    """A ``Cookie`` header with a session signed now with the console's key, as the console
    signs it (Starlette's SessionMiddleware): what a browser holds after a response that renewed
    the cookie, however long ago the login was made."""
    signer = itsdangerous.TimestampSigner(session_secret(TOKEN))
    signed = signer.sign(base64.b64encode(json.dumps(session).encode())).decode()
    return {"Cookie": f"{SESSION_COOKIE}={signed}"}


def test_a_login_ends_when_its_time_is_up_however_fresh_its_cookie(
    token_console: Console,
) -> None:
    now = int(time.time())
    form = {"id": "fir_0000000000000000", "reason": "retired", "csrf": "a-csrf-token"}
    for name, session in {
        "current": {"ops": True, "csrf": "a-csrf-token", LOGGED_IN_AT: now - 60},
        "expired": {
            "ops": True,
            "csrf": "a-csrf-token",
            LOGGED_IN_AT: now - SESSION_MAX_AGE_S - 60,
        },
        "unrecorded": {"ops": True, "csrf": "a-csrf-token"},
    }.items():
        cookie = session_cookie(**session)
        status, page, headers = Client().get(token_console.at("/runs"), cookie)
        assert status == 200, name
        posted, answer, _ = Client().post(token_console.at("/run/skip"), form, cookie)
        if name == "current":
            assert "Logged in with the console's token" in html.unescape(page), name
            assert (posted, "no run fir_0000000000000000" in answer) == (200, True), name
            continue
        assert "Read-only until you" in page, name
        assert headers["set-cookie"].startswith(f"{SESSION_COOKIE}=null;"), name
        assert posted == 403, name
        assert "log in with the console's token to act" in html.unescape(answer), name


def test_a_logged_in_action_needs_its_csrf_token_and_this_sites_origin(
    token_console: Console,
) -> None:
    client, csrf = logged_in(token_console)
    form = {"id": "fir_0000000000000000", "reason": "retired"}
    assert client.post(token_console.at("/run/skip"), form)[0] == 403
    assert client.post(token_console.at("/run/skip"), {**form, "csrf": csrf + "x"})[0] == 403
    host = token_console.url.split("/")[2]
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        status, page, _ = client.post(
            token_console.at("/run/skip"), {**form, "csrf": csrf}, headers
        )
        assert status == 403, headers
        assert "refused" in page
    status, page, _ = client.post(
        token_console.at("/run/skip"),
        {**form, "csrf": csrf},
        {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
    )
    assert status == 200, page
    assert "no run fir_0000000000000000" in page
    status, _, _ = client.post(token_console.at("/logout"), {"csrf": csrf})
    assert status == 303
    assert client.post(token_console.at("/run/skip"), {**form, "csrf": csrf})[0] == 403


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
    done = subprocess.run(
        [sys.executable, "-m", "relayr.cli", "console", "--port", "0", "--allowed-host", value],
        cwd=REPO,
        env=environment_of(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: --allowed-host {value!r} is not a host name: give the name a browser reaches "
        "the console by, without scheme, port or path (console.example.com)"
    ]
    assert not (tmp_path / "relayr.db").exists()


def test_stored_markup_comes_back_as_text(read_only: tuple[Console, str]) -> None:
    console, thread = read_only
    client = Client()
    pages: dict[str, Any] = {
        "thread": client.get(console.at(f"/thread?workspace={WHERE}&id={thread}")),
        "allowlist": client.get(console.at("/allowlist")),
        "rule filter": client.get(console.at("/runs?rule=" + SCRIPT)),
    }
    for name, (status, page, _) in pages.items():
        assert status == 200, name
        assert "<script" not in page, name
        assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in page, name


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/runs?since=yesterday", "since 'yesterday' is not a duration"),
        ("/runs?workspace=acme", "workspace 'acme' is malformed"),
        ("/runs?status=lost", "status 'lost' is not one of dead, failed"),
        ("/runs?page=0", "page '0' is not a page number"),
        ("/run?id=a%20b", "id 'a b' is malformed"),
        ("/thread?workspace=acme/ops", "id '' is malformed"),
        ("/retry-dead?since=2x", "since '2x' is not a duration"),
    ],
)
def test_a_bad_parameter_is_one_line_naming_it(
    token_console: Console, path: str, message: str
) -> None:
    status, page, _ = Client().get(token_console.at(path))
    assert status == 400
    assert message in html.unescape(page)


def test_a_run_or_thread_that_does_not_exist_is_404(token_console: Console) -> None:
    client = Client()
    status, page, _ = client.get(token_console.at("/run?id=fir_0000000000000000"))
    assert (status, "no run fir_0000000000000000" in page) == (404, True)
    status, page, _ = client.get(token_console.at(f"/thread?workspace={WHERE}&id=thr_0"))
    assert (status, "thread thr_0 does not exist in acme/ops" in page) == (404, True)


def test_a_run_id_two_workspaces_hold_is_shown_with_its_workspace_only(tmp_path: Path) -> None:
    """The same rule firing at the same seq in two workspaces makes the same run id: a page
    that names the id alone says so (400), and names both workspaces."""
    environment = environment_of(tmp_path)
    data = json.dumps({"thread_id": "thr_1", "payload": "same"})
    for where in ("acme/ops", "acme/billing"):
        relayr(environment, "publish", where, "consolew:hostile", "--data", data)

    async def fired() -> set[str]:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            rules = runtime.application.rules
            await Reactor(rules, actions=runtime.application.actions).evaluate()
            ids = set()
            for workspace in ("ops", "billing"):
                log = await rules.open("acme", workspace, actor=SourceActor(name="test"))
                ids |= {run.id for run in await log.runs()}
            return ids

    [run_id] = asyncio.run(fired())  # the premise: one id, in both workspaces
    with running_console(environment, tmp_path) as console:
        client = Client()
        status, page, _ = client.get(console.at(f"/run?id={run_id}"))
        assert status == 400
        assert (
            f"run {run_id} is in 2 workspaces (acme/billing, acme/ops): name one with"
            in html.unescape(page)
        )
        status, page, _ = client.get(console.at(f"/run?id={run_id}&workspace=acme/billing"))
        assert status == 200
        assert "acme/billing" in page


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
