"""``relayr console``: the ops console in the browser (:mod:`relayr.console`), served by uvicorn.

Same settings and storage as every command; a retry from the browser is ``relayr runs retry``'s.
It binds to loopback unless ``--host`` says otherwise, acts only with ``RELAYR_CONSOLE_TOKEN``
set, and answers only IP addresses, ``localhost`` and ``--allowed-host`` names (ADR-0070).
Invalid settings, a malformed ``--allowed-host``, a port in use or an application that cannot
load are bad input (exit 2), and so is a missing ``console`` extra, named (ADR-0111).
``--port 0`` takes a free port and prints it; ``--probe`` asks a running console's
``/healthz``.
"""

import re
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import click

from relayr.cli.helpers import EXIT_UNHEALTHY, fail, in_runtime, load_settings

if TYPE_CHECKING:
    from relayr.runtime.process import Runtime
    from relayr.settings import Settings

DEFAULT_HOST: Final = "127.0.0.1"
"""Loopback: a console reachable from elsewhere is a decision its operator makes (--host)."""

DEFAULT_PORT: Final = 8787

PROBE_TIMEOUT_S: Final = 3.0
"""How long ``--probe`` waits for ``/healthz``: inside a health check's usual 5-10 s."""

WILDCARDS: Final = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
"""Where ``--probe`` looks for a console bound to every address: its loopback."""

ANY_HOST: Final = "*"
"""``--allowed-host``'s value that answers every host name (a proxy in front checks them)."""

CONSOLE_EXTRA: Final = {
    "starlette": "starlette",
    "jinja2": "jinja2",
    "uvicorn": "uvicorn",
    "python_multipart": "python-multipart",
    "itsdangerous": "itsdangerous",
}
"""What the console imports from the ``console`` extra, by module, with the distribution that
provides each: a worker installs relayr without them (ADR-0111)."""

HOST_NAME: Final = re.compile(
    r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)
"""A DNS name as a ``Host`` header carries it (lower case, no port, no trailing dot)."""

HEADER_NAME: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,99}")
"""An HTTP header's name, as ``--operator-header`` takes it."""


@click.command("console")
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="The address to listen on; anything but loopback lets other hosts reach the console.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="The port to listen on (0: a free one, named in the line printed at start).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name the console answers to, as browsers reach it (a proxy's, a Service's); "
    "repeat for more. IP addresses and localhost are always answered; '*' answers every name, "
    "for a proxy that checks them itself.",
)
@click.option(
    "--https-only",
    is_flag=True,
    help="The console is reached over HTTPS only (a proxy terminates TLS): its session cookie "
    "is Secure, so a browser never sends it in clear.",
)
@click.option(
    "--operator-header",
    metavar="HEADER",
    help="A request header a trusted proxy in front names the person in (X-Forwarded-User): "
    "actions are recorded under that name, and refused without it. Only behind a proxy that "
    "sets it and strips it from clients; unset, actions are recorded under the token's name.",
)
@click.option(
    "--probe",
    is_flag=True,
    help="Do not serve: exit 0 if the console at --host/--port answers /healthz, else 1.",
)
def console(
    host: str,
    port: int,
    allowed_hosts: tuple[str, ...],
    https_only: bool,
    operator_header: str | None,
    probe: bool,
) -> None:
    """Serve the ops console: runs, a run, threads, the allowlist, health; actions with a token.

    Read-only unless RELAYR_CONSOLE_TOKEN (or RELAYR_CONSOLE_TOKENS, a file of operators' own
    tokens) is set; then a person logs in with a token to retry, cancel and skip runs. Ctrl-C or
    SIGTERM stops it.
    """
    if probe:
        _probe(host, port)
        return
    require_the_extra()
    hosts = parse_allowed_hosts(allowed_hosts)
    header = parse_operator_header(operator_header)
    settings = load_settings(log_level="INFO")
    operators = operators_of(settings)
    if settings.console_token is None and not operators:
        access = "read-only: RELAYR_CONSOLE_TOKEN is not set"
    elif not operators:
        access = "actions for whoever logs in with RELAYR_CONSOLE_TOKEN"
    else:
        access = f"actions for {len(operators)} operators with their own tokens"
        access += " and RELAYR_CONSOLE_TOKEN's holder" if settings.console_token else ""
    listener = _listen(host, port)
    try:
        _serve(settings, listener, access, hosts, https_only, header, operators)
    finally:
        listener.close()


def require_the_extra() -> None:
    """Import the console's web stack, or stop: bad input naming the extra to install.

    Raises:
        BadInput: Naming the ``console`` extra and the distributions that are missing.
    """
    import importlib

    missing = []
    for module, distribution in CONSOLE_EXTRA.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    if missing:
        fail(
            f"relayr console needs the console extra ({', '.join(missing)} not installed): "
            "pip install 'relayr-bridge[console]'"
        )


def parse_allowed_hosts(values: Sequence[str]) -> frozenset[str] | None:
    """``--allowed-host``'s names, lower case; None when one is ``*`` (every name).

    Raises:
        BadInput: Naming the first value that is no host name (a port, a scheme, a path).
    """
    names: set[str] = set()
    for value in values:
        name = value.strip().lower()
        if name == ANY_HOST:
            return None
        if not HOST_NAME.fullmatch(name) or len(name) > 253:
            fail(
                f"--allowed-host {value!r} is not a host name: give the name a browser "
                "reaches the console by, without scheme, port or path (console.example.com)"
            )
        names.add(name)
    return frozenset(names)


def parse_operator_header(value: str | None) -> str | None:
    """``--operator-header``'s name, lower case; None when not given.

    Raises:
        BadInput: When it is not a header's name.
    """
    if value is None:
        return None
    name = value.strip().lower()
    if not HEADER_NAME.fullmatch(name):
        fail(f"--operator-header {value!r} is not a header name (X-Forwarded-User)")
    return name


def operators_of(settings: "Settings") -> dict[str, str]:
    """The operators' own tokens (``RELAYR_CONSOLE_TOKENS``), by name; none without the file.

    Raises:
        BadInput: Naming the file and what is wrong with it, or a token that is also
            ``RELAYR_CONSOLE_TOKEN``.
    """
    if settings.console_tokens is None:
        return {}
    from relayr.console.operators import InvalidTokens, load_tokens

    try:
        operators = load_tokens(settings.console_tokens)
    except InvalidTokens as error:
        fail(f"RELAYR_CONSOLE_TOKENS {error}")
    shared = settings.console_token
    for name, token in operators.items():
        if shared is not None and token == shared.get_secret_value():
            fail(
                f"RELAYR_CONSOLE_TOKENS {settings.console_tokens}: operator {name!r}: the token "
                "is RELAYR_CONSOLE_TOKEN too; give each its own"
            )
    return operators


def _serve(
    settings: "Settings",
    listener: socket.socket,
    access: str,
    hosts: frozenset[str] | None,
    https_only: bool,
    operator_header: str | None = None,
    operators: dict[str, str] | None = None,
) -> None:
    """Serve the console on ``listener`` until Ctrl-C or SIGTERM."""
    loopback = _is_loopback(listener)
    bound_host, bound_port = listener.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    from relayr.cli.runs import enqueuer

    enqueue = enqueuer(settings)

    async def serve(runtime: "Runtime") -> None:
        import asyncio
        import contextlib
        import signal
        from collections.abc import Iterator

        import uvicorn

        from relayr.console.app import Console, create_app

        class Server(uvicorn.Server):
            """uvicorn's server, stopped by this command's signal handlers: uvicorn's own raise
            the signal again once the server stopped, which would end the process before its
            runtime closes."""

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        app = create_app(
            Console(
                runtime,
                enqueue,
                allowed_hosts=hosts,
                https_only=https_only,
                operator_header=operator_header,
                operators=operators or {},
            )
        )
        config = uvicorn.Config(
            app,
            lifespan="on",  # the app's: it reads the runs at start (the runtime is this command's)
            log_config=None,  # relayr's logging (stderr, RELAYR_LOG_FORMAT) carries its lines
            server_header=False,
            proxy_headers=False,
        )
        server = Server(config)

        def stop() -> None:
            # a second Ctrl-C or SIGTERM stops waiting for open connections
            server.force_exit = server.should_exit
            server.should_exit = True

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop)
        click.echo(f"relayr console on http://{shown}:{bound_port}/ ({access})")
        if not loopback:
            click.echo(
                f"warning: listening on {bound_host}, not loopback: whoever reaches this port "
                "can read runs and threads; serve it behind TLS and your access control",
                err=True,
            )
        if hosts is None:
            click.echo(
                "warning: --allowed-host '*' answers every host name: a page on another site "
                "can read this console through a name of its own (DNS rebinding) unless a "
                "proxy in front checks the names",
                err=True,
            )
        await server.serve(sockets=[listener])

    in_runtime(settings, serve)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening.

    Raises:
        BadInput: When the address cannot be resolved or bound (in use, not this host's).
    """
    try:
        (family, kind, protocol, _, address), *_ = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        fail(f"--host {host!r} cannot be resolved: {(error.strerror or str(error)).lower()}")
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen()
    except OSError as error:
        listener.close()
        reason = (error.strerror or type(error).__name__).lower()
        fail(f"cannot listen on {host} port {port}: {reason}")
    return listener


def _is_loopback(listener: socket.socket) -> bool:
    import ipaddress

    return ipaddress.ip_address(listener.getsockname()[0]).is_loopback


def _probe(host: str, port: int) -> None:
    """Exit 0 when the console at ``host:port`` answers ``/healthz``, else 1 with the reason."""
    import urllib.request

    target = WILDCARDS.get(host, host)
    shown = f"[{target}]" if ":" in target else target
    url = f"http://{shown}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as answer:
            body = answer.read(64)
    except OSError as error:
        click.echo(f"console unhealthy: {url}: {error}", err=True)
        raise SystemExit(EXIT_UNHEALTHY) from None
    if body.strip() != b"ok":
        click.echo(f"console unhealthy: {url} answered {body!r}", err=True)
        raise SystemExit(EXIT_UNHEALTHY)
    click.echo(f"console healthy: {url}")
