from collections.abc import Iterator

import pytest

from tests.services import REDIS_HOST, REDIS_PORT, fresh_postgres_database, require


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """An empty PostgreSQL database of this test's own (asyncpg URL), dropped after it."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def redis_url() -> str:
    require("Redis", REDIS_HOST, REDIS_PORT)
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/0"
