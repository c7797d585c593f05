"""What the console's tests share: a real ``relayr console`` process, a browser, the CLI.

- :func:`running_console` starts ``relayr console --port 0`` as a subprocess (the one process
  wrapper, :class:`relayr.cli.processes.RelayrProcess`), reads the address it printed, waits
  until ``/healthz`` answers, and stops it however the test ends.
- :func:`chromium` launches Debian's Chromium through Playwright (never a downloaded browser).
  A test that needs it skips when it is missing and the tests run by hand, and fails when
  ``CI=true``, as a test that needs Redis does (:func:`tests.services.require`).
- :func:`relayr` runs a ``relayr`` command with ``--json`` and parses what it printed; a test
  checks the console against the command line with it.
- :func:`signed_session` makes a session cookie as the console signs it, for a test that needs
  a login older than the browser could make (an expired one).
"""

import base64
import http.cookiejar
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import itsdangerous
import pytest

from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.console.operators import SHARED_TOKEN_NAME
from relayr.console.security import session_secret
from tests.workers import REPO

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium (``apt-get install chromium``; ``.ci/run`` installs it when missing)."""

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
"""A headless browser that talks to nothing but the pages it is sent to."""

WAIT_S = 90.0
"""How long a run may take to reach the state a step waits for; far above what it needs."""

CONSOLE_LINE = re.compile(r"relayr console on (http://\S+/) ")


@dataclass
class Console:
    """A running ``relayr console`` process and its address."""

    process: RelayrProcess
    url: str

    def at(self, path: str) -> str:
        return urllib.parse.urljoin(self.url, path.lstrip("/"))


@contextmanager
def running_console(environment: Mapping[str, str], log_dir: Path, *args: str) -> Iterator[Console]:
    """``relayr console --port 0 ARGS`` for the block, once it answers; stopped however the
    block ends."""
    process = RelayrProcess.start(
        relayr_command("console", "--port", "0", *args),
        name="relayr console",
        environment={**environment, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        log_path=log_dir / f"console-{time.monotonic_ns()}.log",
    )
    try:
        process.ready("relayr console on ")
        found = CONSOLE_LINE.search(process.log())
        assert found is not None, process.log()
        console = Console(process, found[1])
        until(lambda: answers(console.at("/healthz")), "the console to answer", timeout_s=60)
        yield console
    finally:
        process.stop()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def until[T](probe: Callable[[], T | None], what: str, timeout_s: float = WAIT_S) -> T:
    """``probe()`` once it is truthy; polled every 0.3 s, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def dispatching(environment: Mapping[str, str], log_dir: Path) -> Iterator[RelayrProcess]:
    """``relayr dispatch`` for the block; stopped however the block ends."""
    process = RelayrProcess.start(
        relayr_command("dispatch"),
        name="relayr dispatch",
        environment=environment,
        cwd=REPO,
        log_path=log_dir / "dispatcher.log",
    )
    try:
        yield process
    finally:
        process.stop()


def signed_session(token: str, session: Mapping[str, object]) -> str:
    """The value of the console's session cookie holding ``session``, signed now with the key of
    a console whose token is ``token``, as the console signs it (Starlette's SessionMiddleware):
    what a browser holds after a response that renewed the cookie, however long ago the login
    was made."""
    signer = itsdangerous.TimestampSigner(session_secret({SHARED_TOKEN_NAME: token}))
    return signer.sign(base64.b64encode(json.dumps(dict(session)).encode())).decode()


class Client:
    """An HTTP client with cookies, as a script (not a browser) would talk to the console."""

    def __init__(self) -> None:
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.cookies), _NoRedirect()
        )

    def get(self, url: str, headers: Mapping[str, str] | None = None) -> tuple[int, str, Any]:
        return self._send(urllib.request.Request(url, headers=dict(headers or {})))

    def post(
        self,
        url: str,
        form: Mapping[str, str] | Sequence[tuple[str, str]],
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, str, Any]:
        body = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(url, data=body, headers=dict(headers or {}))
        return self._send(request)

    def _send(self, request: urllib.request.Request) -> tuple[int, str, Any]:
        try:
            with self.opener.open(request, timeout=30) as answer:
                return answer.status, answer.read().decode(), answer.headers
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(), error.headers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are returned as they are, so a test sees the 303 and where it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def require_browser() -> None:
    """Skip (by hand) or fail (``CI=true``) when Debian's Chromium or Playwright is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "the playwright package is not installed"
    else:
        missing = "" if os.access(CHROMIUM, os.X_OK) else f"{CHROMIUM} is not installed"
    if not missing:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(missing + " (CI=true: a browser test may not skip)")
    pytest.skip(missing)


@contextmanager
def chromium() -> Iterator["Browser"]:
    """Debian's Chromium, headless, driven by Playwright; closed however the block ends."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=list(CHROMIUM_FLAGS)
        )
        try:
            yield browser
        finally:
            browser.close()
