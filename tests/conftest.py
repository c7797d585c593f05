from collections.abc import Iterator
from pathlib import Path

import pytest

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
