"""What every ``relayr`` command shares: exit codes, bad input, settings, ids, JSON, the loop.

:class:`BadInput` ends a command with one ``Error: ...`` line and exit code 2 before anything is
written; :func:`load_settings` reads the settings once (and configures tracing for the role);
:func:`parse_workspace` and :func:`parse_id` check ids typed on the command line;
:func:`echo_json` prints JSON; :func:`run_async` and :func:`in_runtime` run a command on the
process's one loop. Every command module imports this one, so it imports click and relayr's
errors only (ADR-0050).
"""

import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final, NamedTuple, NoReturn

import click

from relayr.core import parsing
from relayr.core.errors import InvalidAllowlist, InvalidApplication, InvalidSettings, RelayrError

if TYPE_CHECKING:
    import socket

    from relayr.runtime.process import Role, Runtime
    from relayr.settings import Settings

EXIT_OK: Final = 0
EXIT_NOT_ALL_DONE: Final = 1
"""``relayr runs``: some runs were refused, or retried but not enqueued (the broker is down)."""

EXIT_UNHEALTHY: Final = 1
"""``relayr health``: a check failed."""

EXIT_PROBLEMS: Final = 1
"""``relayr allowlist check``: the file has problems (what the check is for, not bad input)."""

EXIT_BAD_INPUT: Final = 2
"""Every command: arguments, settings, allowlist or application that cannot be used; nothing
was written. A worker exits with it too, which ``relayr run`` reads as "cannot start"."""

REFUSED_INPUTS: Final = (InvalidSettings, InvalidApplication, InvalidAllowlist)
"""relayr's refusals of what a command was given to work with: bad input, wherever raised."""


class BadInput(click.ClickException):
    """Raised when a command's input or settings cannot be used: one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


WORKER_STOP_MARGIN_S: Final = 15.0
"""Beyond the turns' grace, how long a worker subprocess (``relayr run``'s, the demo's) may take
to stop before it is killed (its pool processes close their runtimes one after the other)."""


DEFAULT_RESERVE: Final = 1
"""A worker's pool processes beyond ``--concurrency`` that a backlog never fills (ADR-0128), on
a database that takes several writers at once."""


def reserve_option(function: Callable[..., Any]) -> Callable[..., Any]:
    """``--reserve``: pool processes beside ``--concurrency`` that never run a backlog's
    messages (``worker``, ``run``; ADR-0128); None when not given (:func:`reserve_for`)."""
    return click.option(
        "--reserve",
        type=click.IntRange(min=0),
        default=None,
        help="More pool processes, kept for a workspace's only message: a backlog's messages "
        "fill at most --concurrency processes, so a quiet workspace's run does not wait for "
        "them (Redis and the embedded broker).  [default: 1; 0 on SQLite]",
    )(function)


def reserve_for(settings: "Settings", reserve: int | None) -> int:
    """``--reserve`` as given, else its default: :data:`DEFAULT_RESERVE`, and 0 on SQLite,
    whose one writer a process more only waits for (ADR-0128)."""
    if reserve is not None:
        return reserve
    return 0 if settings.database_url.startswith("sqlite") else DEFAULT_RESERVE


def concurrency_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--concurrency/-c``: how many pool processes a worker runs (``worker``, ``run``,
    ``demo``), at least one, two by default."""
    return click.option(
        "--concurrency",
        "-c",
        type=click.IntRange(min=1),
        default=2,
        show_default=True,
        help=help,
    )


def fail(message: str) -> NoReturn:
    """Stop the command: ``message`` is bad input."""
    raise BadInput(message)


class Where(NamedTuple):
    """A workspace named on the command line as ``TENANT/WORKSPACE``."""

    tenant_id: str
    workspace_id: str

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.workspace_id}"


def parse_workspace(value: str, *, what: str = "TENANT/WORKSPACE") -> Where:
    """Split ``TENANT/WORKSPACE`` (``what`` names it in the error, e.g. ``--workspace``).

    Raises:
        BadInput: Naming the value, when it is not two ids joined by one ``/``.
    """
    try:
        return Where(*parsing.parse_workspace(what, value))
    except parsing.Unreadable as unreadable:
        fail(unreadable.message)


def parse_optional_workspace(value: str | None, *, what: str = "--workspace") -> Where | None:
    """:func:`parse_workspace` for an option that may be left out."""
    return None if value is None else parse_workspace(value, what=what)


def parse_id(kind: str, value: str) -> str:
    """Check an id typed on the command line; ``kind`` names it in the error (``THREAD``).

    Raises:
        BadInput: Naming the value, when it is not an id.
    """
    try:
        return parsing.parse_id(kind, value)
    except parsing.Unreadable as unreadable:
        fail(unreadable.message)


def load_settings(*, log_level: str | None = "WARNING", role: "Role | None" = "cli") -> "Settings":
    """Read the settings once; invalid ones stop the command as bad input.

    With ``log_level``, logs go to stderr at that level and above, in the settings' format, so
    stdout carries only what the command prints. None leaves logging as it is (a worker's
    is Celery's). When the settings turn tracing on, the process's providers are configured for
    ``role`` (None: a worker's, which Celery's signals configure, :mod:`tasks.worker`).
    """
    try:
        from relayr.settings import Settings  # pydantic-settings: not for --help (ADR-0050)

        settings = Settings.from_env()
    except RelayrError as error:
        raise BadInput(error.message) from None
    if settings.tracing and role is not None:
        configure_tracing(settings, role)
    if log_level is not None:
        from relayr.observe.logging import configure_logging

        configure_logging(settings.log_format, level=log_level, traced=settings.tracing)
    return settings


def configure_tracing(settings: "Settings", role: "Role") -> None:
    """Configure this process's OpenTelemetry providers (:func:`relayr.observe.otel.configure`).

    Raises:
        BadInput: When tracing is on and the ``otel`` extra is not installed.
    """
    try:
        from relayr.observe.otel import configure  # the SDK: only when tracing is on (ADR-0080)
    except ImportError as missing:
        raise BadInput(
            f"tracing is on (RELAYR_OTEL or OTEL_EXPORTER_OTLP_ENDPOINT) but {missing.name} "
            "is not installed: pip install 'relayr-bridge[otel]'"
        ) from None
    configure(settings, role)


def echo_json(value: object) -> None:
    """Print ``value`` as one line of JSON (dates and other objects as their strings)."""
    click.echo(json.dumps(value, ensure_ascii=False, default=str))


def run_async[T](main: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine on this process's loop, until it ends.

    Raises:
        BadInput: When relayr refuses the settings, allowlist or application
            (:data:`REFUSED_INPUTS`) while the coroutine runs.
    """
    import asyncio

    try:
        return asyncio.run(_woken_by_signals(main))
    except REFUSED_INPUTS as error:
        raise BadInput(error.message) from None


async def _woken_by_signals[T](main: Coroutine[Any, Any, T]) -> T:
    """Await ``main`` on a loop that wakes for every signal, whichever thread gets it.

    Python runs a signal's handler (``asyncio.run``'s Ctrl-C, which cancels ``main``) only in
    the main thread, and the kernel may hand the signal to another one (a thread blocked reading
    a terminal, the database driver's): a loop asleep with no timer would never run it. A byte
    written to a socket the loop watches (``signal.set_wakeup_fd``) wakes it.
    """
    import asyncio
    import signal
    import socket
    import threading

    if threading.current_thread() is not threading.main_thread():
        return await main  # only the main thread can set the wakeup fd, or run handlers
    loop = asyncio.get_running_loop()
    woken, waker = socket.socketpair()
    with woken, waker:
        woken.setblocking(False)
        waker.setblocking(False)
        loop.add_reader(woken.fileno(), _drain, woken)
        previous = signal.set_wakeup_fd(waker.fileno(), warn_on_full_buffer=False)
        try:
            return await main
        finally:
            replaced = signal.set_wakeup_fd(previous)
            if replaced != waker.fileno():  # the loop's own signal handlers took it over
                signal.set_wakeup_fd(replaced)
            loop.remove_reader(woken.fileno())


def _drain(woken: "socket.socket") -> None:
    """Read the bytes a signal wrote: the loop woke, and the handler runs."""
    with contextlib.suppress(BlockingIOError):
        while woken.recv(256):
            pass


def in_runtime[T](
    settings: "Settings", work: Callable[["Runtime"], Awaitable[T]], *, role: "Role" = "cli"
) -> T:
    """Run ``work`` on a runtime of this process (:func:`run_async`), then close the runtime."""

    async def main() -> T:
        from relayr.runtime.process import Runtime

        runtime = await Runtime.start(settings, role=role)
        async with runtime:
            return await work(runtime)

    return run_async(main())
