from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection, Queue

from tests.broker_files import QUEUE, connect
from tests.faults.private_redis import PrivateRedis, private_redis
from tests.services import (
    REDIS_HOST,
    REDIS_PORT,
    fresh_postgres_database,
    require,
    require_program,
)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """An empty PostgreSQL database of this test's own (asyncpg URL), dropped after it."""
    with fresh_postgres_database() as url:
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


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The embedded broker's folder of this test's own, not made yet."""
    return tmp_path / "broker"


@pytest.fixture
def conn(folder: Path) -> Iterator[Connection]:
    """A connection on the embedded broker in ``folder``, its test queue declared."""
    with connect(folder) as connection:
        Queue(QUEUE, routing_key=QUEUE)(connection.default_channel).declare()
        yield connection
