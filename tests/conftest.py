import sys
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Final

import pytest

from tests.faults.private_redis import PrivateRedis, private_redis
from tests.services import (
    REDIS_HOST,
    REDIS_PORT,
    drop_templates,
    fresh_postgres_database,
    postgres_template,
    require,
    require_program,
)

STARTS_A_PROCESS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn"})
"""The audit events of a new process: the ones Python's subprocess, asyncio, multiprocessing
and the os module raise (os.spawn* is os.posix_spawn or os.fork underneath)."""

_may_start_processes = True


def _no_process_unless_marked(event: str, _args: object) -> None:
    if event in STARTS_A_PROCESS and not _may_start_processes:
        raise AssertionError(
            f"this test started a process ({event}) but is not marked `process` or `worker`: "
            "mark it, so that `make test-fast` leaves it out"
        )


sys.addaudithook(_no_process_unless_marked)


def pytest_sessionstart(session: pytest.Session) -> None:
    """inotify_simple finds libc by running ``ldconfig`` at its first instance in a process:
    have it do so now, so that which test waits on the embedded broker first starts nothing."""
    with suppress(ImportError, OSError):
        from inotify_simple import INotify

        INotify().close()


SERVICE_FIXTURES = {
    "postgres_url": "postgres",
    "migrated_postgres_url": "postgres",
    "redis_url": "redis",
    "redis_server": "redis",
}
"""The fixtures that need a server, and the marker a test that takes one gets (a storage
parametrized by ``tests.services.STORAGES`` marks its PostgreSQL case itself)."""


COST_BY_MARKER: Final = (("worker", 30), ("process", 10), ("slow", 10))
"""A test's cost, in units of a test that starts nothing, by its first marker of these (the
suite's times in one full run: a worker test takes some 5 to 45 s, a process test 2 to 10)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test that takes a server, and run the costliest modules first: xdist hands
    out a module at a time in this order (``--no-loadscope-reorder``), so the last modules
    handed out are short ones, and no test process runs a long one alone at the end
    (ADR-0132)."""
    for item in items:
        for name in sorted(set(SERVICE_FIXTURES).intersection(getattr(item, "fixturenames", ()))):
            item.add_marker(SERVICE_FIXTURES[name])
    cost: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        cost[module] = cost.get(module, 0) + _cost(item)
    # a stable sort: a module's tests stay in the order they are written
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])


def _cost(item: pytest.Item) -> int:
    return next((cost for name, cost in COST_BY_MARKER if any(item.iter_markers(name))), 1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    drop_templates()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """A test starts a process only if it says so (markers ``process`` or ``worker``): the
    audit hook above fails it otherwise, which keeps ``make test-fast`` free of processes."""
    global _may_start_processes
    _may_start_processes = any(item.iter_markers("process")) or any(item.iter_markers("worker"))
    try:
        return (yield)
    finally:
        _may_start_processes = True


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """An empty PostgreSQL database of this test's own (asyncpg URL), dropped after it."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def migrated_postgres_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own with every table made (both libraries' and
    relayr's, at head), copied from this process's template; dropped after the test."""
    with fresh_postgres_database(postgres_template()) as url:
        yield url


@pytest.fixture
def redis_url() -> str:
    require("Redis", REDIS_HOST, REDIS_PORT)
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/0"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A ``redis-server`` of this test's own (its port, its folder), stopped after it: one the
    test may kill and start again without touching other tests' messages."""
    require_program("redis-server")
    with private_redis(tmp_path / "redis") as server:
        yield server
