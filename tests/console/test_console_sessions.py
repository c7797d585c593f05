"""The console's sessions over HTTP, on a real ``relayr console`` process.

A script talks to the console as a forger would (no browser, no JavaScript): without the token
every page reads and every POST is refused; with it, every POST needs a session, the session's
CSRF token and this site's origin; a login takes the token and the form's CSRF token, rotates
it, never leads to another site, and ends :data:`SESSION_MAX_AGE_S` after it was made, however
fresh its cookie. The consoles are :mod:`tests.console.console_http`'s; the browser tests on real
workers are in ``tests/console/test_console_browser.py``.
"""

import html
import re
import time
from urllib.parse import urlencode

import pytest

from relayr.console.security import LOGGED_IN_AT, SESSION_COOKIE, SESSION_MAX_AGE_S
from tests.console.console_http import TOKEN
from tests.console.consoles import Client, Console, signed_session

pytestmark = pytest.mark.process

PAGES = ("/runs", "/runs?status=dead", "/allowlist", "/health", "/login")
ACTIONS = (
    "/run/retry",
    "/run/cancel",
    "/run/skip",
    "/retry-dead",
    "/dead-letters/replay",
    "/runs/act",
    "/logout",
    "/login",
)


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
    assert "Logged in as console" in html.unescape(re.sub(r"<[^>]+>", "", page))
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
        cookie = {"Cookie": f"{SESSION_COOKIE}={signed_session(TOKEN, session)}"}
        status, page, headers = Client().get(token_console.at("/runs"), cookie)
        assert status == 200, name
        posted, answer, _ = Client().post(token_console.at("/run/skip"), form, cookie)
        if name == "current":
            assert "Logged in as" in html.unescape(page), name
            assert posted == 303, (name, answer)  # refused run: on the result page
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
    status, page, headers = client.post(
        token_console.at("/run/skip"),
        {**form, "csrf": csrf},
        {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
    )
    assert status == 303, page
    _, page, _ = client.get(token_console.at(headers["location"]))
    assert "no run fir_0000000000000000" in page
    status, _, _ = client.post(token_console.at("/logout"), {"csrf": csrf})
    assert status == 303
    assert client.post(token_console.at("/run/skip"), {**form, "csrf": csrf})[0] == 403
