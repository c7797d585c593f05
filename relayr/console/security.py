"""Who may do what in the console: anyone who reaches it reads; only holders of the token act.

Enforced here and nowhere else (ADR-0070):

- without ``RELAYR_CONSOLE_TOKEN`` every POST is refused (403); with it, logging in with the token
  gives a signed session that lasts :data:`SESSION_MAX_AGE_S` from the login
  (:func:`login_current`);
- every change is a POST carrying the session's CSRF token; a cross-site POST is refused first;
- a request is answered only when its ``Host`` is an IP address, ``localhost`` or an
  ``--allowed-host`` name (:func:`answers_to`: DNS rebinding);
- nothing stored is trusted: templates escape everything and :data:`SECURITY_HEADERS` forbid
  scripts, frames and foreign resources.
"""

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Iterable, Mapping
from typing import Final
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE: Final = "relayr_console"
"""The session cookie's name: one of its own, so another app on the same host keeps its own."""

SESSION_MAX_AGE_S: Final = 8 * 60 * 60
"""How long a login lasts, from the moment it was made: an on-call shift. A stolen cookie is good
for at most this long, or until the token changes."""

LOGGED_IN_AT: Final = "logged_in_at"
"""The session's key for when its login was made (seconds since the epoch)."""

SESSION_KEY_LABEL: Final = b"relayr console session v1"
"""What the session's signing key is derived from, with the token: the key is never the token
itself, so a leaked signing key (it never leaves the process) would not let anyone log in."""

CSRF_FIELD: Final = "csrf"
"""The hidden form field that carries the session's CSRF token."""

CSRF_BYTES: Final = 32
"""Random bytes in a CSRF token: not guessable by a page on another site."""

MAX_BODY_BYTES: Final = 1024 * 1024
"""The largest request body the console reads: a bulk retry's form of 500 runs is some 40 KiB.
A form is parsed before its CSRF token can be checked, so anyone who reaches the port could
otherwise make the console hold any amount of memory."""

ALWAYS_ANSWERED: Final = frozenset({"localhost"})
"""The host names a console answers to without ``--allowed-host`` (and every IP address): no
other site can have a browser send them, since DNS rebinding needs a name the attacker's DNS
answers for."""

SECURITY_HEADERS: Final = (
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        b"frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)
"""Sent with every response. The policy allows the console's own stylesheet and nothing else:
no script at all (the console has none), so even markup that escaped the templates could not
run; no frames (clickjacking of the action buttons); no caching of pages that show runs. The
referrer stays on this site: ``same-origin``, not ``no-referrer``, under which a browser sends
its own form posts with ``Origin: null``, which :func:`cross_site` must refuse."""


def session_secret(tokens: Mapping[str, str]) -> str:
    """The key that signs session cookies: derived from every token with its holder's name
    (HMAC-SHA256), so a token changed or taken away ends every session."""
    material = "\n".join(f"{name}={tokens[name]}" for name in sorted(tokens))
    return hmac.new(material.encode(), SESSION_KEY_LABEL, hashlib.sha256).hexdigest()


def new_csrf_token() -> str:
    """A fresh CSRF token for a session."""
    return secrets.token_urlsafe(CSRF_BYTES)


def same_secret(given: str | None, expected: str | None) -> bool:
    """Whether ``given`` is ``expected``, compared in constant time; never when either is
    missing or empty."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def login_current(logged_in_at: object, now_s: float) -> bool:
    """Whether a login made at ``logged_in_at`` (the session's :data:`LOGGED_IN_AT`; anything
    else, a session from before it was recorded included, is no login) still holds at
    ``now_s``."""
    if not isinstance(logged_in_at, int | float) or isinstance(logged_in_at, bool):
        return False
    return now_s - logged_in_at <= SESSION_MAX_AGE_S


def answers_to(name: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a console answers a request whose ``Host`` is ``name`` (:func:`host_name`): any
    IP address, :data:`ALWAYS_ANSWERED`, and the names ``allowed`` (None: every name)."""
    if allowed is None:
        return True
    if name is None:
        return False
    if name in ALWAYS_ANSWERED or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(host_header: str) -> str | None:
    """The name in a ``Host`` header (``[::1]:8787`` is ``::1``), lower case; None if malformed."""
    try:
        name = urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None
    return name.lower() if name else None


def cross_site(connection: HTTPConnection) -> str | None:
    """Why a request comes from another site, or None when nothing says it does.

    A browser names where a request comes from in ``Origin`` (every POST) and in
    ``Sec-Fetch-Site``; a script that is not a browser sends neither, and is stopped by the
    session and CSRF checks instead.
    """
    headers = connection.headers
    if headers.get("sec-fetch-site") == "cross-site":
        return "the browser says the request comes from another site"
    origin = headers.get("origin")
    if origin is None:
        return None
    if origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower():
        return f"origin {origin!r} is not this console"
    return None


class SecurityHeaders:
    """ASGI middleware: :data:`SECURITY_HEADERS` on every response, and a 400 for a ``Host`` the
    console does not answer to (:func:`answers_to`; ``allowed_hosts`` None: every one)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] | None) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in message.get("headers", [])}
                extra = [header for header in SECURITY_HEADERS if header[0] not in names]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        name = host_name(Headers(scope=scope).get("host", ""))
        if not answers_to(name, self.allowed_hosts):
            refused = PlainTextResponse(
                f"this console does not answer to the host name {name!r}: it answers to IP "
                "addresses, localhost and the names given with --allowed-host (start it with "
                "--allowed-host NAME to serve another)\n",
                status_code=400,
            )
            await refused(scope, receive, with_headers)
            return
        await self.app(scope, receive, with_headers)


class BodyLimit:
    """ASGI middleware: a request whose body is larger than ``max_bytes`` is refused (413),
    whether its ``Content-Length`` says so or its chunks add up to it."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_large = PlainTextResponse(self._message(), status_code=413)
            await too_large(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request's body is larger than {self.max_bytes} bytes"
