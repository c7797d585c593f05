"""Real services for tests: PostgreSQL and Redis on this machine, the storage a test runs on,
and free ports.

A test that needs a service skips when it is down and the tests run by hand, but fails when
``CI=true``: CI must never pass by testing nothing. So does a test that needs a program
(:func:`require_program`), such as ``redis-server`` for a Redis of the test's own.

A test's SQL database is its own: a copy of one migrated once per test process
(:func:`storage_url`, the fixture ``migrated_postgres_url``), or an empty one for the tests of
the migrations (:func:`empty_storage_url`, ``postgres_url``).

Tests share the machine's Redis, each on a queue of its own (:mod:`tests.workers`), and leave it
as they found it: :func:`forgetting_redis_queue` removes every key kombu and relayr made for a
test's queue, however the test ended.
"""

import asyncio
import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import asyncpg
import pytest
import redis
from kombu.transport import redis as kombu_redis

from relayr.broker.redis import DEAD_LETTER_SUFFIX

PG_HOST, PG_PORT = "127.0.0.1", 5432
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
ADMIN_DSN = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/test"
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"

KOMBU: Any = kombu_redis.Channel
"""kombu's Redis channel, whose class attributes name the keys it keeps (its transport options
``unacked_key`` and ``unacked_index_key``, the binding tables' prefixes, the separator of a
queue's priority lists): read from it, so the names follow kombu's."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago.

    The port is released before it is returned, so another process may take it before the
    caller's server binds it: a server started on it must check that it bound it (that what
    answers there is the process it started, as :mod:`tests.faults.private_redis` does).
    """
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require(service: str, host: str, port: int) -> None:
    if not reachable(host, port):
        _missing(f"{service} is not reachable at {host}:{port}")


def require_program(name: str) -> None:
    """Skip (by hand) or fail (``CI=true``) when the program ``name`` is not on the PATH."""
    if shutil.which(name) is None:
        _missing(f"{name} is not installed")


def _missing(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a service test may not skip)")
    pytest.skip(message)


SQL_STORAGES: Final = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""The SQL storage a test runs on, for ``pytest.fixture(params=...)`` and indirect
parametrization of a fixture that calls :func:`storage_url`."""

STORAGES: Final = ["memory", *SQL_STORAGES]
"""Every storage relayr runs on: reflexr's and artifactr's in-memory stores, then SQL."""


def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The database URL of a fixture parametrized by :data:`STORAGES` (or
    :data:`SQL_STORAGES`): a database of the test's own, its tables made (both libraries' and
    relayr's, at head), copied from a template migrated once per test process.

    A test of the migrations themselves takes :func:`empty_storage_url`.
    """
    if request.param == "postgres":
        url = request.getfixturevalue("migrated_postgres_url")
        assert isinstance(url, str)
        return url
    url = empty_storage_url(request, tmp_path)
    if request.param == "sqlite":
        shutil.copyfile(_sqlite_template(), tmp_path / "relayr.db")
    return url


def empty_storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """:func:`storage_url`, but an empty database: no table made yet."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/relayr.db"
    url = request.getfixturevalue("postgres_url")
    assert isinstance(url, str)
    return url


_templates: dict[str, str] = {}
"""This process's migrated templates: the SQLite file's path, the PostgreSQL database's name."""


def _sqlite_template() -> str:
    """The path of this process's migrated SQLite file, to copy; made at the first call."""
    if "sqlite" not in _templates:
        folder = Path(tempfile.mkdtemp(prefix="relayr-template-"))
        _templates["sqlite folder"] = str(folder)  # for drop_templates, even if this fails
        _migrate(f"sqlite+aiosqlite:///{folder}/relayr.db")
        assert not (folder / "relayr.db-wal").exists(), "the template's log was not checkpointed"
        _templates["sqlite"] = str(folder / "relayr.db")
    return _templates["sqlite"]


def postgres_template() -> str:
    """The name of this process's PostgreSQL database with every table made, to copy
    (``CREATE DATABASE ... TEMPLATE``); made at the first call, dropped by
    :func:`drop_templates`."""
    if "postgres" not in _templates:
        require("PostgreSQL", PG_HOST, PG_PORT)
        name = f"relayr_template_{uuid.uuid4().hex[:12]}"
        _admin_execute(f'CREATE DATABASE "{name}"')
        try:
            _migrate(f"postgresql+asyncpg://postgres@{PG_HOST}:{PG_PORT}/{name}")
        except BaseException:
            _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            raise
        _templates["postgres"] = name
    return _templates["postgres"]


def drop_templates() -> None:
    """Remove the templates this process made (at the end of its test session)."""
    if (name := _templates.pop("postgres", None)) is not None:
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if (folder := _templates.pop("sqlite folder", None)) is not None:
        shutil.rmtree(folder, ignore_errors=True)
    _templates.clear()


def _migrate(url: str) -> None:
    from relayr.migrations import upgrade
    from relayr.runtime.application import create_engine, migrate

    async def made() -> None:
        engine = create_engine(url)
        try:
            await migrate(engine)
            await upgrade(engine)
        finally:
            await engine.dispose()

    _run_in_a_thread(made())


def _admin_execute(sql: str) -> None:
    async def execute() -> None:
        connection = await asyncpg.connect(ADMIN_DSN)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    _run_in_a_thread(execute())


def _run_in_a_thread(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to its end on an event loop of its own, in a thread of its own, so that a
    fixture may call this while a test's event loop runs."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, work).result()


@contextmanager
def fresh_postgres_database(template: str | None = None) -> Iterator[str]:
    """Create a database for one test, empty or a copy of ``template``, and drop it after;
    yields its asyncpg URL."""
    require("PostgreSQL", PG_HOST, PG_PORT)
    name = f"relayr_{uuid.uuid4().hex[:12]}"
    copied = "" if template is None else f' TEMPLATE "{template}"'
    _admin_execute(f'CREATE DATABASE "{name}"{copied}')
    try:
        yield f"postgresql+asyncpg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def forget_redis_queue(queue: str, url: str = REDIS_URL) -> int:
    """Remove what kombu and relayr keep in Redis for ``queue``; return how many keys and
    entries went.

    That is: the queue's lists (its own and one per priority), their dead letters
    (:func:`relayr.broker.redis.dead_letter_list`), its bindings in the exchanges' binding
    tables (which outlive every message: a Celery worker declares them at start), and the
    unacknowledged deliveries of its messages (kombu's ``unacked`` hash and ``unacked_index``
    sorted set are one per database, shared by every queue). Call it once no process consumes
    the queue any more: a worker still running would declare it again.
    """
    client: redis.Redis = redis.Redis.from_url(url, socket_connect_timeout=5)
    removed = 0
    try:
        own = f"{queue}{KOMBU.sep}"
        pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in queue) + "*"
        for key in client.scan_iter(match=pattern):
            name = key.decode(errors="replace").removesuffix(DEAD_LETTER_SUFFIX)
            if name == queue or name.startswith(own):
                removed += client.delete(key)
        tables = KOMBU.keyprefix_queue % "*", KOMBU.keyprefix_binding_permanent % "*"
        for table in (key for match in tables for key in client.scan_iter(match=match)):
            if client.type(table) != b"set":
                continue
            bound = [
                member
                for member in client.smembers(table)
                if member.decode(errors="replace").split(KOMBU.sep)[-1] == queue
            ]
            if bound:
                removed += client.srem(table, *bound)
        removed += client.zrem(KOMBU.keyprefix_binding_deadlines, queue)
        for tag, entry in client.hscan_iter(KOMBU.unacked_key):
            if queue in _unacked_destination(entry):
                removed += client.hdel(KOMBU.unacked_key, tag)
                client.zrem(KOMBU.unacked_index_key, tag)
    finally:
        client.close()
    return removed


def _unacked_destination(entry: bytes) -> tuple[str, ...]:
    """The exchange and routing key an unacknowledged delivery goes back to (kombu keeps it
    as ``[message, exchange, routing_key]``); nothing for an entry that is not that."""
    try:
        _, exchange, routing_key = json.loads(entry)
    except (ValueError, TypeError):
        return ()
    return (str(exchange), str(routing_key))


@contextmanager
def forgetting_redis_queue(*queues: str, url: str = REDIS_URL) -> Iterator[None]:
    """The block, then :func:`forget_redis_queue` for each of ``queues``, however it ended."""
    try:
        yield
    finally:
        for queue in queues:
            forget_redis_queue(queue, url)
