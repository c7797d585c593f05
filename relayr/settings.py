"""relayr's settings: read once from ``RELAYR_*`` environment variables into one frozen object.

The only module that reads the environment; everything else is handed a :class:`Settings`. A bad
value stops the process at start with one line naming the variable
(:class:`~relayr.core.errors.InvalidSettings`; exit code 2 on the command line; ADR-0006). The
defaults need no server: SQLite and the ``filesystem://`` broker under ``RELAYR_HOME``. Durations
end in ``_s`` and must order: soft time limit < hard time limit < the broker's visibility timeout.
"""

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from relayr.core.errors import InvalidSettings
from relayr.core.fairness import parse_weights
from relayr.core.run_messages import MAX_BATCH_RUNS

type LogFormat = Literal["json", "console"]

PREFIX = "RELAYR_"

DEFAULT_HOME = Path(".relayr")
DEFAULT_APP = "rules.example:create_app"
DEFAULT_ALLOWLIST = Path("rules/allowlist.toml")
DEFAULT_QUEUE = "relayr.runs"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4318"
"""Where traces and metrics go when RELAYR_OTEL=1 names no endpoint: an OpenTelemetry
collector's OTLP/HTTP port on this host, OpenTelemetry's own default."""

STANDARD_VARIABLES: Final = {
    "otel_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "otel_service_name": "OTEL_SERVICE_NAME",
}
"""Settings read from OpenTelemetry's standard variables rather than a ``RELAYR_*`` one, by
field: the names every OpenTelemetry deployment already sets (ADR-0080)."""

DATABASE_SCHEMES = ("sqlite+aiosqlite://", "postgresql+asyncpg://", "memory://")
"""The databases relayr can use. ``memory://`` keeps everything in this process: for tests and
for one process that runs the dispatcher and an in-process worker together, never for several
processes."""

BROKER_SCHEMES = ("filesystem://", "redis://", "rediss://", "memory://")
"""The brokers relayr is tested on: filesystem (the embedded default: relayr's own transport on
files, ADR-0013), Redis in production, and memory for a worker inside the same process."""


def _database(value: str) -> str:
    if not value.startswith(DATABASE_SCHEMES):
        raise PydanticCustomError("unusable", f"use one of {', '.join(DATABASE_SCHEMES)}")
    return value


def _broker(value: str) -> str:
    if not value.startswith(BROKER_SCHEMES):
        raise PydanticCustomError("unusable", f"use one of {', '.join(BROKER_SCHEMES)}")
    return value


def _factory(value: str) -> str:
    module, colon, function = value.partition(":")
    if not (module and colon and function):
        raise PydanticCustomError("unusable", "name a factory as package.module:function")
    return value


def _queue(value: str) -> str:
    if not value:
        raise PydanticCustomError("unnamed", "a queue needs a name")
    return value


def _endpoint(value: str) -> str:
    if value and not value.startswith(("http://", "https://")):
        raise PydanticCustomError(
            "unusable", "use an http:// or https:// URL: OTLP over HTTP, such as port 4318"
        )
    return value.rstrip("/")


CONSOLE_TOKEN_MIN_CHARS: Final = 16
"""The shortest token the console accepts for its actions: a guessable one would hand anyone
who reaches the console's port the power to retry, cancel and skip runs (ADR-0070)."""


def _console_token(value: SecretStr) -> SecretStr:
    if len(value.get_secret_value()) < CONSOLE_TOKEN_MIN_CHARS:
        # the error names the variable, never the value: it is a secret
        raise PydanticCustomError(
            "secret", f"use at least {CONSOLE_TOKEN_MIN_CHARS} characters (a random string)"
        )
    return value


def _weights(value: object) -> dict[str, float]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise PydanticCustomError(
                "unusable", 'expected a JSON object of tenants\' weights, {"acme": 2}'
            ) from None
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "unusable", 'expected a JSON object of tenants\' weights, {"acme": 2}'
        )
    try:
        return parse_weights(value)
    except ValueError as wrong:
        raise PydanticCustomError("unusable", str(wrong)) from None


def _trace_url(value: str) -> str:
    if value and ("{trace_id}" not in value or not value.startswith(("http://", "https://"))):
        raise PydanticCustomError(
            "trace_url",
            "give an http(s) URL with {trace_id} where the trace's id goes "
            "(http://localhost:16686/trace/{trace_id})",
        )
    return value


_Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A positive, finite number of seconds."""


class Settings(BaseSettings):
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
        dispatch_interval_s: How often the dispatcher passes at least when nothing changed:
            schedules' ticks, the due list (retries, lapsed leases, lost messages), its
            heartbeat; and how often ``relayr follow`` follows every workspace.
        dispatch_sweep_s: How often the dispatcher compares every workspace's head with what
            it evaluated and followed, in case a change notification was lost.
        dispatch_settle_s: How long the dispatcher lets a workspace it just decided settle:
            the workspace's further changes in that time are decided together, in one pass
            when it ends, while a change of any other workspace passes at once. 0 decides a
            workspace at each of its commits (ADR-0120).
        fair_messages: How many messages of one workspace may wait in the broker at once; the
            rest of its due runs wait in the dispatcher, handed out fairly between workspaces
            and tenants as workers take messages.
        fair_batch: How many due runs one message of a workspace carries at most (up to
            20): a workspace with a backlog holds ``fair_messages`` times this many runs in the
            broker ahead of another workspace's next run (ADR-0108).
        tenant_weights: Tenants' shares of the hand-out (``RELAYR_TENANT_WEIGHTS``, a JSON
            object such as ``{"acme": 2}``); a tenant not named weighs 1.
        dispatch_shards: Into how many shards workspaces are split between dispatchers, each
            held under a lease; every dispatcher of a deployment must use the same number.
        broker_poll_interval_s: How long an idle worker of the embedded broker goes at most
            without looking at its queue (``RELAYR_BROKER_POLL_INTERVAL_S``). It is woken the
            moment a message lands (inotify), so this bounds only what a missed notification
            costs, or, where inotify is unavailable, how long a new message waits.
        requeue_after_s: How long a run the dispatcher enqueued may stay due before it is
            enqueued again, as a message the broker lost. Make it longer than a message
            usually waits in the queue: a duplicate is harmless but costs a claim.
        otel: Whether the process exports traces and metrics over OTLP (``RELAYR_OTEL``);
            unset, it does when ``OTEL_EXPORTER_OTLP_ENDPOINT`` names an endpoint (ADR-0080).
        otel_endpoint: The OTLP/HTTP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``); traces go to
            ``<endpoint>/v1/traces``, metrics to ``<endpoint>/v1/metrics``.
        otel_service_name: The resource's ``service.name`` (``OTEL_SERVICE_NAME``) instead of
            the process's role (``relayr-worker``, ``relayr-dispatcher``, ``relayr-cli``).
        console_token: What ``relayr console`` asks before it lets someone act on runs
            (``RELAYR_CONSOLE_TOKEN``); without it (and without ``console_tokens``) the console
            only reads (ADR-0070). Its holder's actions are recorded as ``console``'s.
        console_tokens: A TOML file of operators' own tokens (``RELAYR_CONSOLE_TOKENS``), one
            ``name = "token"`` line each: whoever logs in with one acts under its name.
        trace_url: Where a trace is shown (``RELAYR_TRACE_URL``), ``{trace_id}`` standing for
            its id (Jaeger: ``http://localhost:16686/trace/{trace_id}``): the console links a
            run's attempts to their traces; empty, it shows their ids only.
    """

    model_config = SettingsConfigDict(env_prefix=PREFIX, frozen=True, extra="forbid")

    home: Path = DEFAULT_HOME
    broker_url: Annotated[str, AfterValidator(_broker)] = "filesystem://"
    database_url: Annotated[str, AfterValidator(_database)] = ""
    app: Annotated[str, AfterValidator(_factory)] = DEFAULT_APP
    allowlist: Path = DEFAULT_ALLOWLIST
    log_format: LogFormat = "console"
    queue: Annotated[str, AfterValidator(_queue)] = DEFAULT_QUEUE
    lease_ttl_s: _Seconds = 30.0
    visibility_timeout_s: _Seconds = 3600.0
    soft_time_limit_s: _Seconds = 300.0
    time_limit_s: _Seconds = 360.0
    max_redeliveries: Annotated[int, Field(ge=0)] = 3
    turn_grace_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 30.0
    dispatch_interval_s: _Seconds = 1.0
    dispatch_sweep_s: _Seconds = 30.0
    dispatch_settle_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.1
    fair_messages: Annotated[int, Field(ge=1)] = 2
    fair_batch: Annotated[int, Field(ge=1, le=MAX_BATCH_RUNS)] = 5
    tenant_weights: Annotated[dict[str, float], NoDecode, BeforeValidator(_weights)] = Field(
        default_factory=dict
    )
    dispatch_shards: Annotated[int, Field(ge=1, le=4096)] = 64
    broker_poll_interval_s: _Seconds = 0.05
    requeue_after_s: _Seconds = 60.0
    otel: bool | None = None
    otel_endpoint: Annotated[str, AfterValidator(_endpoint)] = ""
    otel_service_name: str = ""
    console_token: Annotated[SecretStr, AfterValidator(_console_token)] | None = None
    console_tokens: Path | None = None
    trace_url: Annotated[str, AfterValidator(_trace_url)] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """``Settings(...)`` is its arguments and the defaults; the environment is read by
        :meth:`from_env` alone, once, so a test's ``Settings()`` never depends on it."""
        return (init_settings,)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Self:
        """Read the ``RELAYR_*`` variables, and OpenTelemetry's standard ones
        (:data:`STANDARD_VARIABLES`); unset or empty ones take their defaults.

        pydantic-settings' own environment source reads them (each field's variable is
        ``RELAYR_`` and its name in upper case), from ``environ`` rather than the process's
        when a caller passes one.

        Raises:
            InvalidSettings: Naming the variable and what is wrong with its value, or the
                variables whose values contradict each other.
        """
        source = EnvSettingsSource(cls, env_prefix=PREFIX, case_sensitive=False)
        source.env_vars = {
            name.lower(): value.strip()
            for name, value in environ.items()
            if name.startswith(PREFIX)
            and value.strip()
            and name[len(PREFIX) :].lower() not in STANDARD_VARIABLES
        }
        standard: dict[str, Any] = {
            field: environ[variable].strip()
            for field, variable in STANDARD_VARIABLES.items()
            if environ.get(variable, "").strip()
        }
        return cls(**source(), **standard)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"settings are read once and frozen: {name} cannot change")

    @model_validator(mode="wrap")
    @classmethod
    def _named(cls, data: Any, handler: Any) -> Any:
        """Every refusal as one line naming the variable (:class:`InvalidSettings`)."""
        if isinstance(data, dict) and not data.get("database_url"):
            home = Path(data.get("home") or DEFAULT_HOME)
            data = {**data, "database_url": default_database_url(home)}
        try:
            settings = handler(data)
        except ValidationError as invalid:
            raise InvalidSettings(_problem(invalid.errors()[0])) from None
        settings.check()
        return settings

    def check(self) -> None:
        """Refuse values that each look fine but cannot work together.

        Raises:
            InvalidSettings: Naming the variables involved.
        """
        if not self.soft_time_limit_s < self.time_limit_s < self.visibility_timeout_s:
            raise InvalidSettings(
                "the time limits are out of order: RELAYR_SOFT_TIME_LIMIT_S "
                f"({self.soft_time_limit_s}) < RELAYR_TIME_LIMIT_S ({self.time_limit_s}) < "
                f"RELAYR_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must hold, or the "
                "broker hands a task that is still running to a second worker"
            )

    def changed(self, **values: Any) -> Self:
        """These settings with ``values`` instead, validated as a whole again.

        A new ``home`` moves a database that followed the old one (the default SQLite file in
        it) along with it; a database named otherwise stays where it is.
        """
        current = self.model_dump()
        if (
            "home" in values
            and "database_url" not in values
            and self.database_url == default_database_url(self.home)
        ):
            del current["database_url"]
        return type(self)(**{**current, **values})

    @property
    def tracing(self) -> bool:
        """Whether this process exports traces and metrics: ``RELAYR_OTEL=1``, or an OTLP
        endpoint named while ``RELAYR_OTEL`` is unset (``RELAYR_OTEL=0`` turns it off)."""
        return bool(self.otel_endpoint) if self.otel is None else self.otel

    @property
    def otlp_endpoint(self) -> str:
        """Where OTLP goes: the endpoint named, else :data:`DEFAULT_OTLP_ENDPOINT`."""
        return self.otel_endpoint or DEFAULT_OTLP_ENDPOINT

    @property
    def broker_folder(self) -> Path:
        """Where the embedded (``filesystem://``) broker keeps its messages."""
        return self.home.absolute() / "broker"

    def broker_transport_options(self) -> dict[str, Any]:
        """Celery's ``broker_transport_options`` for this broker.

        For Redis, the visibility timeout. For the embedded broker, its folder (the transport
        makes its layout there when it first connects; :mod:`relayr.broker.layout`) and its
        polling interval.
        """
        if self.broker_url.startswith(("redis://", "rediss://")):
            return {"visibility_timeout": self.visibility_timeout_s}
        if self.broker_url.startswith("filesystem://"):
            return {
                "folder": str(self.broker_folder),
                "polling_interval": self.broker_poll_interval_s,
            }
        return {}


def default_database_url(home: Path) -> str:
    """The embedded database: a SQLite file in ``home``, by absolute path (four slashes)."""
    return f"sqlite+aiosqlite:///{home.absolute() / 'relayr.db'}"


_PROBLEMS: Final = {
    "float_parsing": "expected a number of seconds",
    "float_type": "expected a number of seconds",
    "finite_number": "expected a finite number of seconds",
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number",
    "int_type": "expected a whole number",
    "literal_error": "use json or console",
    "bool_parsing": "use 1 or 0",
    "bool_type": "use 1 or 0",
}
"""What a value that does not parse is told, by pydantic's error type."""


def _problem(error: ErrorDetails) -> str:
    """One line naming the variable, its value and what is wrong with it."""
    field = str(error["loc"][0]) if error["loc"] else "settings"
    variable = STANDARD_VARIABLES.get(field, PREFIX + field.upper())
    given, kind = error.get("input"), error["type"]
    if kind == "extra_forbidden":
        return f"{field} is not a setting"
    if kind in ("unnamed", "secret"):
        return f"{variable} is invalid: {error['msg']}"
    if kind in ("greater_than", "greater_than_equal"):
        whole = ("max_redeliveries", "fair_messages", "fair_batch", "dispatch_shards")
        number = int(given) if field in whole else float(given)
        least = (error.get("ctx") or {}).get("ge", 0)
        limit = (
            "it must be above 0"
            if kind == "greater_than"
            else f"it must be at least {least}"
            if least
            else "it cannot be negative"
        )
        return f"{variable}={number} is invalid: {limit}"
    if kind == "less_than_equal" and field in ("fair_batch", "dispatch_shards"):
        most = (error.get("ctx") or {}).get("le")
        return f"{variable}={int(given)} is invalid: it must be at most {most}"
    problem = error["msg"] if kind == "unusable" else _PROBLEMS.get(kind, error["msg"].lower())
    shown = redact(given) if isinstance(given, str) else given
    return f"{variable}={shown!r} is invalid: {problem}"


_USER_INFO: Final = re.compile(r"^(?P<scheme>[^:/?#]*://)[^@]*@")
"""Everything from a URL's ``://`` to its first ``@``: where a password is, for a URL that
:func:`urllib.parse.urlsplit` cannot take apart."""


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages and logs.

    A URL the standard parser refuses (an invalid port, say) or that it would cut before its
    ``@`` (a ``/`` left unencoded in the password) loses all it has before the ``@`` instead:
    a message may show less than it could, never a password.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USER_INFO.sub(r"\g<scheme>***@", url, count=1)
    user_info, at, host = parts.netloc.rpartition("@")
    if at:
        if ":" not in user_info:
            return url
        user = user_info.partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    port = parts.netloc.rpartition(":")[2]
    if ":" in parts.netloc and not port.isdigit() and "@" in url:
        return _USER_INFO.sub(r"\g<scheme>***@", url, count=1)
    return url


METRICS_DIRECTORY_VARIABLE: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's documented switch to its multiprocess mode: where every process keeps its
values (ADR-0030). relayr sets it, from the settings, in a worker that serves ``/metrics``."""


def export_metrics_directory(directory: Path) -> None:
    """Tell prometheus_client, in this process and those it forks, where values are kept.

    The one environment variable relayr sets, here because this module is the one place that
    touches the environment; :func:`relayr.observe.metrics.enable_multiprocess` calls it.
    """
    os.environ[METRICS_DIRECTORY_VARIABLE] = str(directory)


def child_environment(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process (a worker the CLI starts): this one's, with
    ``overrides`` for ``RELAYR_*``.

    With overrides, every other ``RELAYR_*`` variable is left out, so the child runs on exactly
    the settings given (the demo's embedded defaults) and not on the caller's. This process's
    metrics directory is always left out: a child that serves metrics names its own, and one
    that does not must not write into this process's. It lives here because this module is the
    one place that reads the environment.
    """
    environment = dict(os.environ)
    environment.pop(METRICS_DIRECTORY_VARIABLE, None)
    if overrides is not None:
        environment = {k: v for k, v in environment.items() if not k.startswith(PREFIX)}
        environment.update(overrides)
    return environment
