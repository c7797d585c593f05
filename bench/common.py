"""What the benchmarks share: storage per case, the counting application, processes' figures.

Each case gets a storage of its own, made for it and removed after it: the embedded pair (the
filesystem broker and a SQLite file in a fresh home) or the production pair (Redis on
127.0.0.1:6379 with a queue of the case's own, and a PostgreSQL database on 127.0.0.1:5432
created with asyncpg and dropped with ``WITH (FORCE)``).

Workers are real ``celery worker`` processes (:mod:`bench.workers`), running the example
application through :func:`create_app` (or :func:`create_app_scope_ordered`, the example's own
factory with every rule ordered by scope), named by ``RELAYR_APP``. It is the example unchanged,
plus a count of every SQL transaction its engine begins, commits and rolls back, which each
process writes to ``<home>/tx-counts/<pid>.json`` every :data:`COUNTS_EVERY_S` and when it
closes: a prefork pool process never runs ``atexit``, and a benchmark reads the counts while
the workers still run. When ``<home>/bench-profile`` exists, each pool process also profiles
its event loop's thread (where every run executes) with cProfile, and writes
``<home>/profile-<pid>.prof`` when it closes.
"""

import asyncio
import contextlib
import cProfile
import json
import math
import os
import platform
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Literal

import asyncpg
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.runtime.application import Application
from relayr.settings import Settings
from rules import example

type StorageKind = Literal["sqlite", "postgres"]
type Ordering = Literal["none", "scope"]

REPO: Final = Path(__file__).resolve().parent.parent

STORAGES: Final[Mapping[StorageKind, tuple[str, str]]] = {
    "sqlite": ("filesystem", "sqlite"),
    "postgres": ("redis", "postgresql"),
}
"""Each storage case's broker and database."""

PG_HOST: Final = "127.0.0.1"
PG_PORT: Final = 5432
PG_ADMIN_DSN: Final = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/postgres"
REDIS_HOST: Final = "127.0.0.1"
REDIS_PORT: Final = 6379
REDIS_URL: Final = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"

APPS: Final[Mapping[Ordering, str]] = {
    "none": "bench.common:create_app",
    "scope": "bench.common:create_app_scope_ordered",
}
"""The workers' ``RELAYR_APP`` by the rules' ordering: the example's own (``none``), or
reflexr's default for every rule (``scope``: one run of a rule at a time per workspace)."""

COUNTS_FOLDER: Final = "tx-counts"
PROFILE_MARKER: Final = "bench-profile"

COUNTS_EVERY_S: Final = 0.2
"""How often a worker process rewrites its counts file: the benchmark waits for a few of these
to pass unchanged before it calls the workers idle."""

BENCH_HOME: Final = REPO / ".relayr" / "bench"


def emit(figures: Mapping[str, Any]) -> None:
    """Print one JSON object on one line of stdout, at once."""
    sys.stdout.write(json.dumps(figures, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    """A line for the person watching, on stderr (stdout carries only JSON)."""
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def quiet_logging() -> None:
    """relayr's log lines at WARNING and above, on stderr: stdout carries only the figures."""
    from relayr.observe.logging import configure_logging

    configure_logging("console", level="WARNING")


def machine() -> dict[str, Any]:
    """What the figures were measured on, and how busy it was."""
    return {
        "cores": os.cpu_count(),
        "load_avg": [round(load, 2) for load in os.getloadavg()],
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``, or None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def reachable(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def storage_available(kind: StorageKind) -> bool:
    """Whether a storage case can run here: the embedded one always can."""
    if kind == "sqlite":
        return True
    return reachable(PG_HOST, PG_PORT) and reachable(REDIS_HOST, REDIS_PORT)


def available_storages(bench: str, chosen: Sequence[str]) -> Iterator[StorageKind]:
    """The ``chosen`` storage cases that can run here, SQLite first; one that cannot is said
    skipped, as ``bench``'s line."""
    for kind in ("sqlite", "postgres"):
        if kind not in chosen:
            continue
        if not storage_available(kind):
            emit({"bench": bench, "storage": kind, "skipped": "PostgreSQL or Redis is down"})
            continue
        yield kind


# -- the counting application (runs in every worker process) --------------------------------


class EngineCounter:
    """Counts the SQL transactions one engine begins, commits and rolls back.

    SQLAlchemy fires ``begin`` for every transaction a connection starts, reads included (on
    SQLite every one is ``BEGIN IMMEDIATE``, the file's write lock), so ``begin`` is the number
    of transactions, and ``commit`` plus ``rollback`` says how each ended.
    """

    def __init__(self, engine: AsyncEngine, into: Counter[str] | None = None) -> None:
        self.counts: Counter[str] = Counter() if into is None else into
        sync = engine.sync_engine
        for name in ("begin", "commit", "rollback"):
            event.listen(sync, name, self._counting(name))

    def _counting(self, name: str) -> Callable[..., None]:
        def count(*_: object) -> None:
            self.counts[name] += 1

        return count

    def snapshot(self) -> dict[str, int]:
        return {name: self.counts[name] for name in ("begin", "commit", "rollback")}


_process_counts: Counter[str] = Counter()
_writer: threading.Thread | None = None


def _counts_path(home: Path, pid: int) -> Path:
    return home / COUNTS_FOLDER / f"{pid}.json"


def _write_counts(home: Path) -> None:
    path = _counts_path(home, os.getpid())
    counts = {name: _process_counts[name] for name in ("begin", "commit", "rollback")}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"pid": os.getpid(), **counts}))
    temporary.replace(path)


def _keep_writing_counts(home: Path) -> None:
    last: dict[str, int] | None = None
    while True:
        now = dict(_process_counts)
        if now != last:
            _write_counts(home)
            last = now
        time.sleep(COUNTS_EVERY_S)


@dataclass(frozen=True)
class BenchApplication(Application):
    """The example application, with things to do when it closes (write counts, a profile)."""

    on_close: tuple[Callable[[], None], ...] = ()

    async def aclose(self) -> None:
        for action in self.on_close:
            action()
        await super().aclose()


async def build_example(settings: Settings, ordering: Ordering) -> Application:
    """The example application, built by its own factory: as it ships (``none``), or with every
    rule, outbound and inbound, ordered by scope (``scope``). Nothing else differs, so the two
    orderings are measured on the same application."""
    if ordering == "none":
        return await example.create_app(settings)
    return await example.build_app(settings, ordering="scope")


async def _counted(settings: Settings, ordering: Ordering) -> Application:
    """The example on ``settings``, counting its transactions into this process's file."""
    global _writer
    app = await build_example(settings, ordering)
    home = settings.home.absolute()
    (home / COUNTS_FOLDER).mkdir(parents=True, exist_ok=True)
    for engine in app.engines:
        EngineCounter(engine, into=_process_counts)
    closing: list[Callable[[], None]] = []
    if (home / PROFILE_MARKER).exists():
        # the factory runs on the process's loop thread, where every run executes
        profiler = cProfile.Profile()
        profiler.enable()

        def dump() -> None:
            profiler.disable()
            profiler.dump_stats(home / f"profile-{os.getpid()}.prof")

        closing.append(dump)
    closing.append(lambda: _write_counts(home))
    if _writer is None or not _writer.is_alive():
        _writer = threading.Thread(
            target=_keep_writing_counts, args=(home,), name="bench-counts", daemon=True
        )
        _writer.start()
    values = {field.name: getattr(app, field.name) for field in fields(app)}
    return BenchApplication(**values, on_close=tuple(closing))


async def create_app(settings: Settings) -> Application:
    """``RELAYR_APP=bench.common:create_app``: the example, counted."""
    return await _counted(settings, "none")


async def create_app_scope_ordered(settings: Settings) -> Application:
    """``RELAYR_APP=bench.common:create_app_scope_ordered``: the example with reflexr's default
    ordering (``scope``) for every rule, outbound and inbound, counted."""
    return await _counted(settings, "scope")


def read_counts(home: Path, pids: Sequence[int]) -> dict[int, dict[str, int]]:
    """The counts the processes ``pids`` last wrote (those that wrote none are left out)."""
    found: dict[int, dict[str, int]] = {}
    for pid in pids:
        path = _counts_path(home, pid)
        with contextlib.suppress(FileNotFoundError, ValueError):
            data = json.loads(path.read_text())
            found[pid] = {name: int(data[name]) for name in ("begin", "commit", "rollback")}
    return found


def total(counts: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    summed: Counter[str] = Counter()
    for one in counts.values():
        summed.update(one)
    return {name: summed[name] for name in ("begin", "commit", "rollback")}


def difference(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {name: after.get(name, 0) - before.get(name, 0) for name in after}


# -- processes ---------------------------------------------------------------------------------

_TICKS: Final = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a worker's pool processes), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.extend(int(child) for child in (task / "children").read_text().split())
    return sorted(set(found))


def cpu_s(pid: int) -> float:
    """User plus system CPU time ``pid`` has used, in seconds (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    after_name = stat.rpartition(")")[2].split()
    return (int(after_name[11]) + int(after_name[12])) / _TICKS


def run_delay_s(pid: int) -> float:
    """How long the threads of ``pid`` waited on a run queue for a CPU, in seconds.

    From each thread's ``/proc/<pid>/task/<tid>/schedstat`` (its second field, nanoseconds):
    time it was ready to run but every core was busy, which on a shared machine is the cost of
    the other processes' load.
    """
    waited = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            waited += int((task / "schedstat").read_text().split()[1])
    return waited / 1e9


def memory_kib(pid: int) -> dict[str, int]:
    """``VmHWM`` (peak RSS) and ``VmRSS`` of ``pid`` in KiB, from /proc/<pid>/status."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                found[name] = int(value.split()[0])
    return found


# -- storage per case --------------------------------------------------------------------------


async def _admin(sql: str) -> None:
    connection = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def postgres_backends(database: str) -> list[int]:
    """The server processes serving ``database`` now (their CPU is the database's share)."""
    connection = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        rows = await connection.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1", database
        )
    finally:
        await connection.close()
    return [int(row["pid"]) for row in rows]


def _clear_queue(queue: str) -> None:
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    try:
        keys = [*client.scan_iter(match=f"{queue}*"), *client.scan_iter(match=f"_kombu.*{queue}")]
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@dataclass(frozen=True)
class CaseStorage:
    """A case's storage: its ``Settings`` overrides, and the PostgreSQL database's name."""

    kind: StorageKind
    overrides: Mapping[str, object]
    database: str | None = None


@contextlib.contextmanager
def case_storage(kind: StorageKind) -> Iterator[CaseStorage]:
    """A storage for one case, removed after it: nothing of one case is seen by the next."""
    queue = f"relayr.bench.{uuid.uuid4().hex[:12]}"
    if kind == "sqlite":
        yield CaseStorage(kind, {"queue": queue})
        return
    database = f"relayr_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{database}"'))
    try:
        yield CaseStorage(
            kind,
            {
                "queue": queue,
                "broker_url": REDIS_URL,
                "database_url": f"postgresql+asyncpg://postgres@{PG_HOST}:{PG_PORT}/{database}",
            },
            database,
        )
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        _clear_queue(queue)


def fresh_home(label: str) -> Path:
    """An empty folder for one case under ``.relayr/bench`` (ignored by git)."""
    home = BENCH_HOME / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{label}"
    home.mkdir(parents=True, exist_ok=False)
    return home
