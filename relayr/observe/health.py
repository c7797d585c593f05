"""Health: is this worker or dispatcher alive, and can it reach the broker and the database?

The checks behind ``relayr health`` (ADR-0031). **Alive** is a heartbeat file under
``RELAYR_HOME`` (``health/<role>.heartbeat``) that the process refreshes (:func:`heartbeat_step`
in a worker's consumer loop, the dispatcher after each pass) and, under ``relayr run``, the
supervisor's status file (ADR-0033). **Reaches** is a Redis ``PING`` (or a writable embedded
broker folder) and ``SELECT 1``, run together so the check ends within ``--timeout`` and names
every failure. ``--liveness`` checks aliveness alone: it must not depend on Redis.
"""

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from relayr.broker.layout import queues_folder
from relayr.settings import Settings, redact

type HealthRole = Literal["worker", "dispatcher"]
type SupervisorState = Literal["running", "restarting"]

STATUS_SCHEMA: Final = 1
"""The status file's schema version: a reader refuses a version it does not know."""

HEARTBEAT_INTERVAL_S: Final = 5.0
"""How often a worker's main loop refreshes its heartbeat: well inside the default maximum age,
so a probe never sees a live worker's heartbeat as stale."""

DEFAULT_MAX_AGE_S: Final = 60.0
"""How old a heartbeat may be before its process counts as dead: twelve missed worker beats, or
a dispatcher pass that ran for a minute (a pass normally takes well under a second)."""

DEFAULT_TIMEOUT_S: Final = 5.0
"""How long the broker and the database each get to answer: inside a probe's usual 10 s."""


@dataclass(frozen=True)
class Check:
    """One thing checked: its name, whether it passed, and what was seen."""

    name: str
    ok: bool
    detail: str
    duration_s: float


@dataclass(frozen=True)
class HealthReport:
    """Every check of one ``relayr health``; healthy when all passed."""

    role: HealthRole | None
    checks: tuple[Check, ...]
    supervisor: dict[str, Any] | None = None
    """``relayr run``'s status of its worker (:mod:`relayr.runtime.supervisor`), when it runs
    one."""

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def reason(self) -> str:
        """The failed checks, one clause each; empty when healthy."""
        return "; ".join(f"{check.name}: {check.detail}" for check in self.checks if not check.ok)

    def summary(self) -> str:
        state = "healthy" if self.ok else "unhealthy"
        what = self.role or "dependencies"
        lines = "; ".join(f"{check.name}: {check.detail}" for check in self.checks)
        return f"{what} {state}: {lines}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "role": self.role,
            "reason": self.reason,
            "checks": [asdict(check) for check in self.checks],
            "supervisor": self.supervisor,
        }


def heartbeat_path(home: Path, role: HealthRole) -> Path:
    """Where the process of ``role`` keeps its heartbeat, under ``RELAYR_HOME``."""
    return home.absolute() / "health" / f"{role}.heartbeat"


def touch_heartbeat(path: Path) -> None:
    """Refresh the heartbeat's mtime (creating the file and its folder if missing)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{os.getpid()}\n")


def check_heartbeat(path: Path, *, max_age_s: float, now: float | None = None) -> Check:
    """Whether the heartbeat at ``path`` is at most ``max_age_s`` old."""
    started = time.monotonic()
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return Check(
            "heartbeat",
            False,
            f"no heartbeat at {path}: the process has not started or has stopped, "
            "or it runs with another RELAYR_HOME",
            time.monotonic() - started,
        )
    age_s = max((time.time() if now is None else now) - mtime, 0.0)
    if age_s > max_age_s:
        return Check(
            "heartbeat",
            False,
            f"{path} is {age_s:.1f} s old (limit {max_age_s:g} s): the process is hung or gone",
            time.monotonic() - started,
        )
    return Check("heartbeat", True, f"{age_s:.1f} s old", time.monotonic() - started)


def check_supervisor(home: Path, *, max_age_s: float) -> tuple[Check, dict[str, Any] | None] | None:
    """What ``relayr run`` says of its worker, or None when no ``relayr run`` supervises one.

    Unhealthy while the worker is down and waiting to be started again, naming how it ended. A
    status file older than ``max_age_s`` is left to the heartbeat: its ``relayr run`` is gone
    or hung, and the worker (if any) beats or not on its own.
    """
    started = time.monotonic()
    path = status_path(home)
    try:
        found = read_status(path)
    except ValueError as error:
        return Check("supervisor", False, str(error), time.monotonic() - started), None
    if found is None:
        return None
    status, age_s = found
    data = status.to_json()
    if age_s > max_age_s:
        detail = (
            f"{path} is {age_s:.1f} s old (limit {max_age_s:g} s): relayr run is gone or hung; "
            "ignored, the heartbeat decides"
        )
        return Check("supervisor", True, detail, time.monotonic() - started), data
    ok = status.state == "running"
    detail = status.describe() if ok else f"the worker is down: {status.describe()}"
    return Check("supervisor", ok, detail, time.monotonic() - started), data


async def check_broker(settings: Settings, *, timeout_s: float) -> Check:
    """Whether the broker answers: Redis ``PING``; the embedded broker's queues folder writable."""
    url = settings.broker_url
    if url.startswith(("redis://", "rediss://")):
        return await _timed("broker", redact(url), timeout_s, lambda: _ping_redis(url, timeout_s))
    if url.startswith("filesystem://"):
        return _check_folder(queues_folder(settings.broker_folder))
    return Check("broker", True, "in-process broker: nothing to reach", 0.0)


async def check_database(settings: Settings, *, timeout_s: float) -> Check:
    """Whether the database answers ``SELECT 1``."""
    url = settings.database_url
    if url.startswith("memory://"):
        return Check("database", True, "in-process database: nothing to reach", 0.0)
    missing = _missing_sqlite_file(url)
    if missing is not None:
        # connecting would create an empty file, hiding that the path differs from the workers'
        return Check("database", False, f"SQLite file {missing} does not exist", 0.0)
    return await _timed(
        "database", redact(url), timeout_s, lambda: _select_one(url, timeout_s=timeout_s)
    )


async def acheck_health(
    settings: Settings,
    role: HealthRole | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    dependencies: bool = True,
) -> HealthReport:
    """Check the heartbeat of ``role`` (if any) and, unless told not to, broker and database.

    The broker and database checks run together, each bounded by ``timeout_s``.
    """
    checks: list[Check] = []
    supervisor: dict[str, Any] | None = None
    if role is not None:
        checks.append(check_heartbeat(heartbeat_path(settings.home, role), max_age_s=max_age_s))
    if role == "worker":
        supervised = check_supervisor(settings.home, max_age_s=max_age_s)
        if supervised is not None:
            checks.append(supervised[0])
            supervisor = supervised[1]
    if dependencies:
        checks.extend(
            await asyncio.gather(
                check_broker(settings, timeout_s=timeout_s),
                check_database(settings, timeout_s=timeout_s),
            )
        )
    return HealthReport(role, tuple(checks), supervisor)


def check_health(
    settings: Settings,
    role: HealthRole | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    dependencies: bool = True,
) -> HealthReport:
    """:func:`acheck_health` for a caller without an event loop (the command, a probe)."""
    return asyncio.run(
        acheck_health(
            settings,
            role,
            timeout_s=timeout_s,
            max_age_s=max_age_s,
            dependencies=dependencies,
        )
    )


async def _timed(
    name: str, target: str, timeout_s: float, probe: Callable[[], Awaitable[str]]
) -> Check:
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            seen = await probe()
    except TimeoutError:
        return Check(
            name,
            False,
            f"no answer from {target} within {timeout_s:g} s",
            time.monotonic() - started,
        )
    except Exception as error:  # any failure to reach it is the answer, named
        return Check(
            name,
            False,
            f"cannot reach {target}: {type(error).__name__}: {error}",
            time.monotonic() - started,
        )
    elapsed = time.monotonic() - started
    return Check(name, True, f"{target} {seen} in {elapsed * 1000:.0f} ms", elapsed)


async def _ping_redis(url: str, timeout_s: float) -> str:
    client = Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry_on_timeout=False,
    )
    try:
        await client.ping()
    finally:
        await client.aclose()
    return "answered PING"


def _check_folder(queue: Path) -> Check:
    started = time.monotonic()
    if not queue.is_dir():
        detail = f"{queue} does not exist: no worker or dispatcher has used it"
    elif not os.access(queue, os.W_OK):
        detail = f"{queue} is not writable"
    else:
        return Check("broker", True, f"folder {queue} is writable", time.monotonic() - started)
    return Check("broker", False, detail, time.monotonic() - started)


async def _select_one(url: str, *, timeout_s: float) -> str:
    connect_args: dict[str, Any] = {"timeout": timeout_s}
    if make_url(url).get_backend_name() != "sqlite":
        connect_args["command_timeout"] = timeout_s
    engine = create_async_engine(url, poolclass=NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    return "answered SELECT 1"


def _missing_sqlite_file(url: str) -> str | None:
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database or ""
    if database in ("", ":memory:") or Path(database).exists():
        return None
    return database


def heartbeat_step(path: Path, interval_s: float = HEARTBEAT_INTERVAL_S) -> type:
    """A Celery worker bootstep that keeps the heartbeat at ``path`` fresh from the consumer's
    loop.

    Every ``interval_s`` the worker's timer asks the consumer to beat (``Consumer.call_soon``),
    and the consumer's loop touches the file the next time it turns. On Redis the timer is the
    event loop's own, so that is one more callback of it; on the embedded broker (a transport
    without an event loop) Celery runs the timer in a thread of its own, which would go on
    beating while the loop is stuck, and Celery's blocking loop runs the callback between two
    waits for a message (at most two seconds apart). Either way, a worker whose pool is busy
    still beats; one whose consumer loop is stuck does not. While a beat waits for the loop, the
    timer asks for no other, so a stuck loop piles up nothing.

    Add it with ``app.steps["worker"].add(heartbeat_step(path))``. The file is removed when the
    worker stops, so a stopped worker is never reported alive.
    """
    from celery import bootsteps

    class Heartbeat(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
        requires = ("celery.worker.components:Timer",)

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            super().__init__(worker, **kwargs)
            self._entry: Any = None
            self._asked = threading.Event()
            self._stopped = False

        def start(self, worker: Any) -> None:
            self._stopped = False
            touch_heartbeat(path)
            self._entry = worker.timer.call_repeatedly(
                interval_s, self._ask, (worker,), priority=10
            )

        def _ask(self, worker: Any) -> None:
            consumer = getattr(worker, "consumer", None)
            if consumer is None or self._asked.is_set():
                return
            self._asked.set()
            consumer.call_soon(self._beat)

        def _beat(self) -> None:
            self._asked.clear()
            if not self._stopped:
                touch_heartbeat(path)

        def stop(self, worker: Any) -> None:
            self._stopped = True
            if self._entry is not None:
                self._entry.cancel()
                self._entry = None
            path.unlink(missing_ok=True)

        def terminate(self, worker: Any) -> None:
            self.stop(worker)

    return Heartbeat


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended: its exit code, or the signal that killed it."""

    code: int | None
    signal: str | None
    at: str
    uptime_s: float

    @classmethod
    def of(cls, returncode: int, *, at: datetime, uptime_s: float) -> "WorkerExit":
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            return cls(None, name, at.isoformat(), round(uptime_s, 3))
        return cls(returncode, None, at.isoformat(), round(uptime_s, 3))

    def describe(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exited with code {self.code}"
        return f"{how} after {self.uptime_s:g} s up"


@dataclass(frozen=True)
class SupervisorStatus:
    """What ``health/worker.supervisor.json`` says (times are ISO 8601, UTC).

    Attributes:
        supervisor_pid: The ``relayr run`` process.
        state: ``running`` (a worker process exists) or ``restarting`` (it exited and the
            supervisor waits to start it again).
        worker_pid: The current worker, or the one that exited while ``restarting``.
        since: When the worker started (``running``) or exited (``restarting``).
        restarts: How many times the worker was started again since ``relayr run`` started.
        next_start_at: While ``restarting``, when the next start is due.
        last_exit: How the last worker that exited ended, if one did.
    """

    supervisor_pid: int
    state: SupervisorState
    worker_pid: int
    since: str
    restarts: int = 0
    next_start_at: str | None = None
    last_exit: WorkerExit | None = None
    schema: int = STATUS_SCHEMA

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "SupervisorStatus":
        """Read a status written by :meth:`to_json`.

        Raises:
            ValueError: Naming what is wrong, for anything else.
        """
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema") != STATUS_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r} is not {STATUS_SCHEMA}")
        try:
            last = data.get("last_exit")
            status = cls(
                **{**data, "last_exit": WorkerExit(**last) if isinstance(last, dict) else None}
            )
        except TypeError as error:
            raise ValueError(str(error)) from None
        if status.state not in ("running", "restarting"):
            raise ValueError(f"state {status.state!r} is unknown")
        return status

    def describe(self) -> str:
        """One clause for people: what the worker is doing, and how it last ended."""
        if self.state == "restarting":
            exited = self.last_exit.describe() if self.last_exit else "exited"
            return (
                f"worker pid {self.worker_pid} {exited} at {self.since}; relayr run starts it "
                f"again at {self.next_start_at} (restarts so far: {self.restarts})"
            )
        text = f"worker pid {self.worker_pid} up since {self.since}, restarts: {self.restarts}"
        if self.last_exit is not None:
            text += f"; the last one {self.last_exit.describe()} at {self.last_exit.at}"
        return text


def status_path(home: Path) -> Path:
    """Where ``relayr run`` keeps its worker's status, beside the worker's heartbeat."""
    return home.absolute() / "health" / "worker.supervisor.json"


def write_status(path: Path, status: SupervisorStatus) -> None:
    """Replace the status file whole, so a reader never sees half of it.

    Raises:
        OSError: If it cannot be written (no partial file is left behind).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps(status.to_json()) + "\n")
        os.replace(partial, path)
    except OSError:
        with suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def read_status(path: Path) -> tuple[SupervisorStatus, float] | None:
    """The status at ``path`` and its age in seconds, or None when there is none.

    Raises:
        ValueError: Naming the file, when it is not a status this version wrote.
    """
    try:
        text = path.read_text()
        age_s = max(time.time() - path.stat().st_mtime, 0.0)
    except FileNotFoundError:
        return None
    try:
        return SupervisorStatus.from_json(json.loads(text)), age_s
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a supervisor status: {error}") from None
