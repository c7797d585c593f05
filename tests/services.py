"""Real services for tests: PostgreSQL and Redis on this machine.

A test that needs a service skips when it is down and the tests run by hand, but fails when
``CI=true``: CI must never pass by testing nothing.
"""

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import asyncpg
import pytest

PG_HOST, PG_PORT = "127.0.0.1", 5432
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
ADMIN_DSN = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/test"


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require(service: str, host: str, port: int) -> None:
    if reachable(host, port):
        return
    message = f"{service} is not reachable at {host}:{port}"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a service test may not skip)")
    pytest.skip(message)


def _admin_execute(sql: str) -> None:
    async def execute() -> None:
        connection = await asyncpg.connect(ADMIN_DSN)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    # its own thread, so a fixture may call it while a test's event loop runs
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, execute()).result()


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """Create an empty database for one test and drop it after; yields its asyncpg URL."""
    require("PostgreSQL", PG_HOST, PG_PORT)
    name = f"relayr_{uuid.uuid4().hex[:12]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+asyncpg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
