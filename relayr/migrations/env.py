"""Alembic's environment for relayr's migrations.

:func:`relayr.migrations.upgrade` runs it on a connection it opened, inside the transaction it
commits, so an upgrade is atomic wherever the database's DDL is (PostgreSQL, SQLite).
"""

from alembic import context

from relayr.migrations import RELAYR

context.configure(
    connection=context.config.attributes["connection"],
    version_table=RELAYR.version_table,
)
with context.begin_transaction():
    context.run_migrations()
