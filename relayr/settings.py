"""relayr's settings: read once from ``RELAYR_*`` environment variables into one frozen object.

This is the only module that reads the environment. Everything else is handed a
:class:`Settings`, so a worker, the dispatcher and a test all see one consistent configuration,
and a bad value stops the process at start with the variable named, not an hour later.

The embedded defaults need no server: a SQLite file under ``RELAYR_HOME`` for both libraries and
the ledger, and the ``filesystem://`` broker (relayr's own transport, :mod:`relayr.broker`) in
``RELAYR_HOME/broker``. It keeps a message until a worker acknowledges it, even across a
SIGKILL; and if a message is lost anyway, the dispatcher finds its run again, because reflexr's
store, not the broker, is the truth about a run.

Durations carry their unit in their names (``_s``: seconds) and are validated together: the
soft time limit is below the hard one, which is below the broker's visibility timeout, because
a Redis broker redelivers any message unacknowledged for that long, even to a second worker
while the first is still running it.
"""

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from relayr.core.errors import InvalidSettings

type LogFormat = Literal["json", "console"]

PREFIX = "RELAYR_"

DEFAULT_HOME = Path(".relayr")
DEFAULT_APP = "rules.example:create_app"
DEFAULT_ALLOWLIST = Path("rules/allowlist.toml")
DEFAULT_QUEUE = "relayr.runs"

DATABASE_SCHEMES = ("sqlite+aiosqlite://", "postgresql+asyncpg://", "memory://")
"""The databases relayr can use. ``memory://`` keeps everything in this process: for tests and
for one process that runs the dispatcher and an in-process worker together, never for several
processes."""

BROKER_SCHEMES = ("filesystem://", "redis://", "rediss://", "memory://")
"""The brokers relayr is tested on: filesystem (the embedded default: relayr's own transport on
files, ADR-0013), Redis in production, and memory for a worker inside the same process."""


@dataclass(frozen=True)
class Settings:
    """The whole configuration of a relayr process.

    Attributes:
        home: Where embedded state lives (``RELAYR_HOME``, default ``.relayr``): the SQLite file
            and the embedded broker's folder.
        broker_url: Celery's broker (``RELAYR_BROKER_URL``, default ``filesystem://``).
        database_url: Both libraries' and the ledger's database (``RELAYR_DATABASE_URL``,
            default a SQLite file ``<home>/relayr.db``, as an absolute path).
        app: The application factory, ``package.module:function`` (``RELAYR_APP``).
        allowlist: The operators' allowlist file (``RELAYR_ALLOWLIST``); a relative path is
            taken from the working directory.
        log_format: ``json`` or ``console`` (``RELAYR_LOG_FORMAT``).
        queue: The Celery queue runs go to (``RELAYR_QUEUE``).
        lease_ttl_s: How long a run's lease lasts unless renewed; an executor renews it every
            third of that, so a worker that dies frees its run this long after.
        visibility_timeout_s: How long Redis waits for an acknowledgement before it hands a
            message to another worker.
        soft_time_limit_s: When Celery asks a task to stop.
        time_limit_s: When Celery kills the process running a task.
        max_redeliveries: How many times a task that killed its worker is delivered again
            before its run is failed (``worker_lost``) instead.
        turn_grace_s: How long a stopping worker lets the agent turns it started finish.
        dispatch_interval_s: How long the dispatcher waits between passes.
        requeue_after_s: How long a run the dispatcher enqueued may stay due before it is
            enqueued again, as a message the broker lost. Make it longer than a message
            usually waits in the queue: a duplicate is harmless but costs a claim.
    """

    home: Path = DEFAULT_HOME
    broker_url: str = "filesystem://"
    database_url: str = ""
    app: str = DEFAULT_APP
    allowlist: Path = DEFAULT_ALLOWLIST
    log_format: LogFormat = "console"
    queue: str = DEFAULT_QUEUE
    lease_ttl_s: float = 30.0
    visibility_timeout_s: float = 3600.0
    soft_time_limit_s: float = 300.0
    time_limit_s: float = 360.0
    max_redeliveries: int = 3
    turn_grace_s: float = 30.0
    dispatch_interval_s: float = 1.0
    requeue_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.database_url:
            object.__setattr__(self, "database_url", default_database_url(self.home))
        self.check()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """Read the ``RELAYR_*`` variables; unset or empty ones take their defaults.

        Raises:
            InvalidSettings: Naming the variable and what is wrong with its value, or the
                variables whose values contradict each other.
        """
        values: dict[str, Any] = {}
        for name, parse in _PARSERS.items():
            variable = PREFIX + name.upper()
            raw = environ.get(variable, "").strip()
            if not raw:
                continue
            try:
                values[name] = parse(raw)
            except ValueError as bad:
                raise InvalidSettings(f"{variable}={raw!r} is invalid: {bad}") from None
        return cls(**values)

    def check(self) -> None:
        """Refuse values that cannot work, naming the variables involved.

        Raises:
            InvalidSettings: On the first problem found.
        """
        if not self.database_url.startswith(DATABASE_SCHEMES):
            raise InvalidSettings(
                f"RELAYR_DATABASE_URL={self.database_url!r} is invalid: "
                f"use one of {', '.join(DATABASE_SCHEMES)}"
            )
        if not self.broker_url.startswith(BROKER_SCHEMES):
            raise InvalidSettings(
                f"RELAYR_BROKER_URL={self.broker_url!r} is invalid: "
                f"use one of {', '.join(BROKER_SCHEMES)}"
            )
        module, colon, function = self.app.partition(":")
        if not (module and colon and function):
            raise InvalidSettings(
                f"RELAYR_APP={self.app!r} is invalid: name a factory as package.module:function"
            )
        if self.log_format not in ("json", "console"):
            raise InvalidSettings(
                f"RELAYR_LOG_FORMAT={self.log_format!r} is invalid: use json or console"
            )
        if not self.queue:
            raise InvalidSettings("RELAYR_QUEUE is invalid: a queue needs a name")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise InvalidSettings(
                    f"{PREFIX}{name.upper()}={getattr(self, name)} is invalid: it must be above 0"
                )
        for name in ("max_redeliveries", "turn_grace_s"):
            if getattr(self, name) < 0:
                raise InvalidSettings(
                    f"{PREFIX}{name.upper()}={getattr(self, name)} is invalid: "
                    "it cannot be negative"
                )
        if not self.soft_time_limit_s < self.time_limit_s < self.visibility_timeout_s:
            raise InvalidSettings(
                "the time limits are out of order: RELAYR_SOFT_TIME_LIMIT_S "
                f"({self.soft_time_limit_s}) < RELAYR_TIME_LIMIT_S ({self.time_limit_s}) < "
                f"RELAYR_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must hold, or the "
                "broker hands a task that is still running to a second worker"
            )

    @property
    def broker_folder(self) -> Path:
        """Where the embedded (``filesystem://``) broker keeps its messages."""
        return self.home.absolute() / "broker"

    def broker_transport_options(self) -> dict[str, Any]:
        """Celery's ``broker_transport_options`` for this broker.

        For Redis, the visibility timeout. For the embedded broker, its folder (the transport
        makes its layout there when it first connects; :mod:`relayr.broker.layout`).
        """
        if self.broker_url.startswith(("redis://", "rediss://")):
            return {"visibility_timeout": self.visibility_timeout_s}
        if self.broker_url.startswith("filesystem://"):
            return {"folder": str(self.broker_folder)}
        return {}


def default_database_url(home: Path) -> str:
    """The embedded database: a SQLite file in ``home``, by absolute path (four slashes)."""
    return f"sqlite+aiosqlite:///{home.absolute() / 'relayr.db'}"


def _number(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number of seconds")
    return value


def _count(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None


def _log_format(raw: str) -> LogFormat:
    if raw not in ("json", "console"):
        raise ValueError("use json or console")
    return cast(LogFormat, raw)


_PARSERS: dict[str, Callable[[str], Any]] = {
    "home": Path,
    "broker_url": str,
    "database_url": str,
    "app": str,
    "allowlist": Path,
    "log_format": _log_format,
    "queue": str,
    "lease_ttl_s": _number,
    "visibility_timeout_s": _number,
    "soft_time_limit_s": _number,
    "time_limit_s": _number,
    "max_redeliveries": _count,
    "turn_grace_s": _number,
    "dispatch_interval_s": _number,
    "requeue_after_s": _number,
}

_POSITIVE = (
    "lease_ttl_s",
    "visibility_timeout_s",
    "soft_time_limit_s",
    "time_limit_s",
    "dispatch_interval_s",
    "requeue_after_s",
)


def child_environment(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process (a worker the CLI starts): this one's, with
    ``overrides`` for ``RELAYR_*``.

    With overrides, every other ``RELAYR_*`` variable is left out, so the child runs on exactly
    the settings given (the demo's embedded defaults) and not on the caller's. It lives here
    because this module is the one place that reads the environment.
    """
    environment = dict(os.environ)
    if overrides is not None:
        environment = {k: v for k, v in environment.items() if not k.startswith(PREFIX)}
        environment.update(overrides)
    return environment
