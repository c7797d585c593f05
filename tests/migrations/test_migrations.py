"""relayr's migrations: from an empty database, or one an earlier release made with
``create_all``, they reach exactly the tables the code uses; one forward path; processes that
start together upgrade once; ``relayr db`` upgrades and shows the revisions, and refuses a
database it cannot use. On SQLite and PostgreSQL databases of the test's own.
"""

import asyncio
import itertools
import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from reflexr.sql.tables import metadata as reflexr_tables
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    inspect,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr import migrations
from relayr.cli import cli
from relayr.cli.processes import relayr_command
from relayr.dispatch import changes, shards
from relayr.follow import store as follow_store
from relayr.follow.store import SqlFollowStore
from relayr.ledger import SqlLedger
from relayr.ledger import limits as limit_store
from relayr.ledger import sql as ledger_sql
from relayr.ledger.port import Cause, WorkspaceKey
from relayr.runtime.application import MIGRATION_LOCK, create_engine, migrate
from tests.services import SQL_STORAGES, empty_storage_url
from tests.workers import REPO, relayr_environment

WORKSPACE = WorkspaceKey("acme", "ops")
CAUSE = Cause(correlation_id="cor_1", firing_id="fir_1", run_id="run_1", depth=1)
PROCESS_TIMEOUT_S = 120
AT_HEAD_S = 10.0
"""Far above the few reads that find tables at head, far below the locks' own waits."""


def code_tables() -> MetaData:
    """Every table relayr's code reads and writes, in one MetaData."""
    tables = MetaData()
    for source in (
        ledger_sql.metadata,
        follow_store.metadata,
        limit_store.metadata,
        shards.metadata,
        changes.metadata,
    ):
        for table in source.tables.values():
            table.to_metadata(tables)
    return tables


def earlier_release_tables() -> MetaData:
    """relayr's tables as releases before migrations made them with ``create_all`` (0.1.0),
    kept here as they were: what an upgrade must adopt, whatever the code's tables become."""
    tables = MetaData()
    Table(
        "relayr_causes",
        tables,
        Column("tenant_id", Text, primary_key=True),
        Column("workspace_id", Text, primary_key=True),
        Column("kind", Text, primary_key=True),
        Column("key", Text, primary_key=True),
        Column("correlation_id", Text, nullable=False),
        Column("firing_id", Text, nullable=False),
        Column("run_id", Text, nullable=False),
        Column("depth", Integer, nullable=False),
    )
    Table(
        "relayr_emissions",
        tables,
        Column(
            "position",
            BigInteger().with_variant(Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("tenant_id", Text, nullable=False),
        Column("workspace_id", Text, nullable=False),
        Column("run_id", Text, nullable=False),
        Column("epoch", Integer, nullable=False),
        Column("message_id", Text, nullable=False),
        Column("record", Text, nullable=False),
        Column("emitted_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint(
            "tenant_id",
            "workspace_id",
            "run_id",
            "epoch",
            "message_id",
            name="relayr_emissions_once",
        ),
    )
    Table(
        "relayr_follow_cursors",
        tables,
        Column("tenant_id", Text, primary_key=True),
        Column("workspace_id", Text, primary_key=True),
        Column("cursor", BigInteger, nullable=False),
        Column("holder", Text, nullable=True),
        Column("held_until", DateTime(timezone=True), nullable=True),
    )
    Table(
        "relayr_follow_dead_letters",
        tables,
        Column("tenant_id", Text, primary_key=True),
        Column("workspace_id", Text, primary_key=True),
        Column("envelope_id", Text, primary_key=True),
        Column("seq", BigInteger, nullable=False),
        Column("event_type", Text, nullable=False),
        Column("reason", Text, nullable=False),
        Column("error", Text, nullable=False),
        Column("dead_at", DateTime(timezone=True), nullable=False),
        Column("tries", Integer, nullable=False),
        Column("replayed_at", DateTime(timezone=True), nullable=True),
    )
    return tables


def differences(connection: Connection) -> list[Any]:
    """What Alembic would change to make the database's relayr tables the code's (empty when
    they are the same: columns, types, nullability, keys, unique constraints)."""
    context = MigrationContext.configure(
        connection,
        opts={"version_table": migrations.RELAYR.version_table, "compare_type": True},
    )
    return compare_metadata(context, code_tables())


def table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


def script() -> ScriptDirectory:
    config = Config()
    config.set_main_option("script_location", migrations.RELAYR.migrations)
    return ScriptDirectory.from_config(config)


@pytest.fixture(params=SQL_STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_storage_url(request, tmp_path)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_an_empty_database_upgrades_to_exactly_the_code_s_tables(
    engine: AsyncEngine,
) -> None:
    assert await migrations.upgrade(engine) == migrations.head()
    assert await migrations.upgrade(engine) == migrations.head()  # again: nothing to do

    async with engine.connect() as connection:
        assert await connection.run_sync(table_names) == {
            *code_tables().tables,
            migrations.RELAYR.version_table,
        }
        assert await connection.run_sync(differences) == []
        versions = await connection.execute(
            text(f"SELECT version_num FROM {migrations.RELAYR.version_table}")
        )
        assert versions.scalars().all() == [migrations.head()]


def test_the_migrations_are_one_forward_path() -> None:
    revisions = list(script().walk_revisions(base="base", head="heads"))  # newest first
    assert script().get_heads() == [migrations.head()]
    assert revisions[0].revision == migrations.head()
    assert revisions[-1].revision == "0001"
    assert revisions[-1].down_revision is None
    for newer, older in itertools.pairwise(revisions):
        assert newer.down_revision == older.revision, newer.revision
    for revision in revisions:
        assert not revision.branch_labels, revision.revision
        assert not revision.dependencies, revision.revision


async def test_a_revision_at_a_time_reaches_the_same_tables(engine: AsyncEngine) -> None:
    from alembic import command

    path = [revision.revision for revision in script().walk_revisions("base", "heads")][::-1]

    def upgrade_to(connection: Connection, revision: str) -> None:
        config = Config()
        config.set_main_option("script_location", migrations.RELAYR.migrations)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    for revision in path:
        async with engine.begin() as connection:
            await connection.run_sync(upgrade_to, revision)
        [found] = await migrations.revisions(engine, (migrations.RELAYR,))
        assert found.current == revision
    async with engine.connect() as connection:
        assert await connection.run_sync(differences) == []


async def test_a_database_an_earlier_release_made_keeps_its_rows(engine: AsyncEngine) -> None:
    earlier = earlier_release_tables()
    async with engine.begin() as connection:
        await connection.run_sync(earlier.create_all)
        await connection.execute(
            earlier.tables["relayr_causes"]
            .insert()
            .values(
                tenant_id="acme",
                workspace_id="ops",
                kind="message",
                key="msg-1",
                correlation_id="cor_1",
                firing_id="fir_1",
                run_id="run_1",
                depth=1,
            )
        )
        await connection.execute(
            earlier.tables["relayr_follow_cursors"]
            .insert()
            .values(tenant_id="acme", workspace_id="ops", cursor=41, holder=None, held_until=None)
        )

    ledger = await SqlLedger.open(engine)  # a process of this release, starting on it

    assert await ledger.cause(WORKSPACE, "message", "msg-1") == CAUSE
    async with engine.connect() as connection:
        cursor = await connection.execute(select(follow_store.cursors_table.c.cursor))
        assert cursor.scalars().all() == [41]
        assert await connection.run_sync(differences) == []
    [found] = await migrations.revisions(engine, (migrations.RELAYR,))
    assert found.current == migrations.head()


async def test_relayr_s_stores_upgrade_the_tables_before_their_first_statement(
    database_url: str,
) -> None:
    for opened in (SqlLedger, SqlFollowStore):
        engine = create_engine(database_url)
        try:
            [before] = await migrations.revisions(engine, (migrations.RELAYR,))
            store = opened(engine)
            taken = (
                await store.take(
                    WORKSPACE, "follower-1", until=datetime.now(UTC), now=datetime.now(UTC)
                )
                if isinstance(store, SqlFollowStore)
                else await store.record_cause(WORKSPACE, "message", "msg-1", CAUSE)
            )
            assert taken in (0, CAUSE)
            [after] = await migrations.revisions(engine, (migrations.RELAYR,))
        finally:
            await engine.dispose()
        assert (before.current, after.current) in (
            (None, migrations.head()),
            (migrations.head(), migrations.head()),
        )


@asynccontextmanager
async def migrating_elsewhere(database_url: str) -> AsyncIterator[None]:
    """Another process in the middle of a migration: it holds the advisory locks of the
    libraries' migrations and of relayr's upgrade."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as other:
            for key in (MIGRATION_LOCK, migrations.UPGRADE_LOCK):
                await other.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            await other.commit()
            yield
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_tables_at_head_are_found_so_without_waiting_for_a_migration(
    engine: AsyncEngine, database_url: str
) -> None:
    """A process that starts on tables already up to date, as at almost every start, reads the
    revisions and goes on: it neither takes the migrations' locks nor waits for them. (On
    SQLite every transaction of relayr's engines takes the file's write lock, reads too.)"""
    await migrate(engine)
    await migrations.upgrade(engine)
    async with migrating_elsewhere(database_url):
        async with asyncio.timeout(AT_HEAD_S):
            await migrate(engine)
            assert await migrations.upgrade(engine) == migrations.head()


async def test_a_start_runs_alembic_only_for_a_schema_behind_its_head(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty database has Alembic upgrade each of the three schemas once; a start on tables
    at head, as at almost every start, loads no migration (on SQLite it reads the revisions in
    the migration's transaction); a schema put back behind its head is upgraded alone."""
    from alembic import command

    upgraded: list[str] = []
    real_upgrade = command.upgrade

    def recording(config: Config, revision: str) -> None:
        upgraded.append(config.get_main_option("script_location") or "")
        real_upgrade(config, revision)

    monkeypatch.setattr(command, "upgrade", recording)
    await migrate(engine)
    await migrations.upgrade(engine)
    assert upgraded == [schema.migrations for schema in migrations.SCHEMAS]

    upgraded.clear()
    await migrate(engine)
    await migrations.upgrade(engine)
    assert upgraded == []

    async with engine.begin() as connection:  # reflexr's tables gone, the others kept
        await connection.run_sync(reflexr_tables.drop_all)
        await connection.execute(text("DROP TABLE reflexr_alembic_version"))
    await migrate(engine)
    assert upgraded == ["reflexr.sql:migrations"]
    assert all(found.at_head for found in await migrations.revisions(engine))


async def test_upgrades_that_start_together_upgrade_once(database_url: str) -> None:
    engines = [create_engine(database_url) for _ in range(6)]
    try:
        done = await asyncio.gather(*(migrations.upgrade(engine) for engine in engines))
        assert done == [migrations.head()] * len(engines)
        async with engines[0].connect() as connection:
            versions = await connection.execute(
                text(f"SELECT version_num FROM {migrations.RELAYR.version_table}")
            )
            assert versions.scalars().all() == [migrations.head()]
            assert await connection.run_sync(differences) == []
    finally:
        for engine in engines:
            await engine.dispose()


@pytest.mark.slow
@pytest.mark.process
def test_processes_that_start_together_on_an_empty_database_need_no_extra_step(
    database_url: str, tmp_path: Path
) -> None:
    """Three real ``relayr follow --once`` processes (each opens the runtime, its ledger and
    the followers' store) started at once on an empty database: all succeed, and the database
    is then at every head, as ``relayr db current`` says."""
    environment = relayr_environment(tmp_path / "home", database_url=database_url)
    started = [
        subprocess.Popen(
            relayr_command("follow", "--once", "--json"),
            cwd=REPO,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for process in started:
        out, err = process.communicate(timeout=PROCESS_TIMEOUT_S)
        assert process.returncode == 0, out + err

    result = CliRunner().invoke(cli, ["db", "current", "--json"], env=environment)

    assert result.exit_code == 0, result.output
    shown = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["schema"] for row in shown] == ["artifactr", "reflexr", "relayr"]
    assert all(row["at_head"] for row in shown), shown
    assert shown[-1]["current"] == migrations.head()


def test_db_upgrade_then_current_print_each_schema_at_its_head(
    database_url: str, tmp_path: Path
) -> None:
    environment = relayr_environment(tmp_path / "home", database_url=database_url)
    runner = CliRunner()

    before = runner.invoke(cli, ["db", "current"], env=environment)
    upgraded = runner.invoke(cli, ["db", "upgrade"], env=environment)
    after = runner.invoke(cli, ["db", "current"], env=environment)

    assert before.exit_code == 1, before.output
    assert f"relayr     none   (head is {migrations.head()})" in before.stdout.splitlines()
    assert upgraded.exit_code == 0, upgraded.output
    assert after.exit_code == 0, after.output
    assert upgraded.stdout == after.stdout
    lines = after.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["artifactr", "reflexr", "relayr"]
    assert all(line.endswith("(head)") for line in lines), lines
    assert f"relayr     {migrations.head()}   (head)" in lines


def test_db_current_on_a_missing_sqlite_file_makes_none(tmp_path: Path) -> None:
    environment = relayr_environment(tmp_path / "home")

    result = CliRunner().invoke(cli, ["db", "current"], env=environment)

    assert result.exit_code == 1, result.output
    assert all(" none " in line for line in result.stdout.splitlines())
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://", "RELAYR_DATABASE_URL is memory://: its tables live in one process's memory"),
        (
            "postgresql+asyncpg://postgres:secret@127.0.0.1:notaport/relayr",
            "RELAYR_DATABASE_URL cannot be read as dialect+driver://",
        ),
        ("mysql://localhost/relayr", "RELAYR_DATABASE_URL='mysql://localhost/relayr' is invalid"),
    ],
    ids=["memory", "malformed", "unsupported"],
)
@pytest.mark.parametrize("command", ["upgrade", "current"])
def test_a_database_url_relayr_cannot_use_is_bad_input(
    tmp_path: Path, command: str, url: str, message: str
) -> None:
    environment = relayr_environment(tmp_path / "home", database_url=url)

    result = CliRunner().invoke(cli, ["db", command], env=environment)

    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: {message}"), line
    assert "secret" not in line


@pytest.mark.postgres
def test_a_database_that_cannot_be_reached_is_bad_input(tmp_path: Path, postgres_url: str) -> None:
    missing = postgres_url.rsplit("/", 1)[0].replace("postgres@", "postgres:secret@") + "/nowhere"
    environment = relayr_environment(tmp_path / "home", database_url=missing)

    result = CliRunner().invoke(cli, ["db", "upgrade"], env=environment)

    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "Error: cannot connect to the database postgresql+asyncpg://postgres:***@"
    )
    assert 'database "nowhere" does not exist' in line
