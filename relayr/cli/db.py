"""``relayr db``: the database's schemas, brought to their newest revision or shown.

Three schemas share the database: artifactr's, reflexr's and relayr's own tables, each with its
Alembic migrations and version table (:mod:`relayr.migrations`). The processes that use them
upgrade them at start; ``relayr db upgrade`` does it ahead of a release, as the tables' owner,
and ``relayr db current`` says where each one is (exit 1 when one is behind its head). A
database URL that cannot be used (``memory://``, a database that cannot be reached) is bad
input: one line and exit code 2, before anything is written.
"""

from typing import TYPE_CHECKING

import click

from relayr.cli.helpers import EXIT_PROBLEMS, echo_json, fail, load_settings, run_async

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from relayr.migrations import Revision
    from relayr.settings import Settings


@click.group("db")
def db() -> None:
    """The database's schemas: artifactr's, reflexr's and relayr's own tables."""


@db.command("upgrade")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per schema.")
def upgrade(as_json: bool) -> None:
    """Upgrade every schema of RELAYR_DATABASE_URL to its newest revision, then show them.

    Safe at any time, and beside running processes: they would do the same at start.
    """
    settings = load_settings()
    _show(run_async(_upgraded(settings)), as_json=as_json)


@db.command("current")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per schema.")
def current(as_json: bool) -> None:
    """Show each schema's revision and its newest one; exit 1 when one is behind."""
    settings = load_settings()
    revisions = run_async(_current(settings))
    _show(revisions, as_json=as_json)
    if not all(revision.at_head for revision in revisions):
        raise SystemExit(EXIT_PROBLEMS)


async def _upgraded(settings: "Settings") -> list["Revision"]:
    from relayr import migrations
    from relayr.runtime.application import migrate

    engine = await _connected(settings)
    try:
        await migrate(engine)
        await migrations.upgrade(engine)
        return await migrations.revisions(engine)
    finally:
        await engine.dispose()


async def _current(settings: "Settings") -> list["Revision"]:
    from relayr import migrations

    if _missing_sqlite_file(settings.database_url):
        return [
            migrations.Revision(schema, None, migrations.head(schema))
            for schema in migrations.SCHEMAS
        ]
    engine = await _connected(settings)
    try:
        return await migrations.revisions(engine)
    finally:
        await engine.dispose()


async def _connected(settings: "Settings") -> "AsyncEngine":
    """relayr's engine for the settings' database, once a connection to it was made.

    Raises:
        BadInput: Naming the database (without its password) and why it cannot be used.
    """
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError, DBAPIError

    from relayr.runtime.application import create_engine

    url = settings.database_url
    if url.startswith("memory://"):
        fail(
            "RELAYR_DATABASE_URL is memory://: its tables live in one process's memory, "
            "there is no database to migrate"
        )
    try:
        shown = make_url(url).render_as_string(hide_password=True)
        engine = create_engine(url)
    except (ArgumentError, ValueError) as error:
        fail(
            "RELAYR_DATABASE_URL cannot be read as dialect+driver://user:password@host:port/"
            f"database: {error}"
        )
    try:
        async with engine.connect():
            pass
    except (DBAPIError, OSError) as error:
        await engine.dispose()
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        fail(f"cannot connect to the database {shown} (RELAYR_DATABASE_URL): {reason}")
    return engine


def _missing_sqlite_file(url: str) -> bool:
    """Whether ``url`` names a SQLite file that does not exist (then nothing is at a revision,
    and showing so makes no file)."""
    from pathlib import Path

    from sqlalchemy import make_url

    if not url.startswith("sqlite"):
        return False
    path = make_url(url).database
    return bool(path) and path != ":memory:" and not Path(str(path)).exists()


def _show(revisions: list["Revision"], *, as_json: bool) -> None:
    for revision in revisions:
        if as_json:
            echo_json(
                {
                    "schema": revision.schema.name,
                    "current": revision.current,
                    "head": revision.head,
                    "at_head": revision.at_head,
                }
            )
            continue
        where = revision.current or "none"
        state = "(head)" if revision.at_head else f"(head is {revision.head})"
        click.echo(f"{revision.schema.name:<10} {where:<6} {state}")
