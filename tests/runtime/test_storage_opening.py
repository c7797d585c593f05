"""Opening the shared storage (``open_storage``, ``create_engine``): both libraries migrated
into one database, by processes that start together, on SQLite (its folder made), PostgreSQL
and in memory (no engine). On real SQLite and PostgreSQL databases of the test's own.
"""

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import inspect

from relayr.runtime.application import create_engine, open_storage
from relayr.settings import Settings
from tests.example_runtime import settings_for
from tests.services import SQL_STORAGES, STORAGES, empty_storage_url


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_storage_url(request, tmp_path)


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_both_libraries_share_one_migrated_database(
    database_url: str, tmp_path: Path
) -> None:
    settings = settings_for(database_url, tmp_path)

    first = await open_storage(settings)
    second = await open_storage(settings)  # migrating again is a no-op
    try:
        assert first.engine is not None
        async with first.engine.connect() as connection:
            tables = await connection.run_sync(lambda c: inspect(c).get_table_names())
        assert "artifactr_alembic_version" in tables
        assert "reflexr_alembic_version" in tables
        assert {t.split("_")[0] for t in tables} == {"artifactr", "reflexr"}
    finally:
        for storage in (first, second):
            for engine in storage.engines:
                await engine.dispose()


@pytest.mark.postgres
async def test_processes_that_start_together_migrate_one_at_a_time(postgres_url: str) -> None:
    settings = Settings(database_url=postgres_url)

    opened = await asyncio.gather(*(open_storage(settings) for _ in range(4)))

    for storage in opened:
        for engine in storage.engines:
            await engine.dispose()


async def test_a_sqlite_database_gets_its_folder(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/deep/er/relayr.db")
    try:
        assert (tmp_path / "deep" / "er").is_dir()
        assert engine.dialect.name == "sqlite"
    finally:
        await engine.dispose()


async def test_memory_storage_has_no_engine() -> None:
    storage = await open_storage(Settings(database_url="memory://"))

    assert storage.engine is None
    assert storage.engines == ()
