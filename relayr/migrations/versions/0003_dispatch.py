"""The dispatchers' tables and the change feed (ADR-0091, ADR-0092).

``relayr_dispatchers`` (who is alive) and ``relayr_dispatch_shards`` (who holds each shard,
until when); ``relayr_changes``, the workspaces whose logs moved (written by SQLite's triggers,
read by the dispatcher; empty on PostgreSQL, where the triggers ``NOTIFY`` instead); and on
each library's workspace table present, a trigger that fires when its ``head_seq`` moves.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from relayr.migrations import refuse_downgrade

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SOURCES = {"reflexr": "reflexr_workspaces", "artifactr": "artifactr_workspaces"}
CHANNEL = "relayr_changes"


def upgrade() -> None:
    """Create the tables, then the triggers on the libraries' workspace tables present."""
    bind = op.get_bind()
    present = set(sa.inspect(bind).get_table_names())
    if "relayr_dispatchers" not in present:
        op.create_table(
            "relayr_dispatchers",
            sa.Column("holder", sa.Text(), nullable=False),
            sa.Column("seen_until", sa.DateTime(timezone=True), nullable=False),
            sa.PrimaryKeyConstraint("holder"),
        )
    if "relayr_dispatch_shards" not in present:
        op.create_table(
            "relayr_dispatch_shards",
            sa.Column("shard", sa.Integer(), autoincrement=False, nullable=False),
            sa.Column("holder", sa.Text(), nullable=False),
            sa.Column("held_until", sa.DateTime(timezone=True), nullable=False),
            sa.PrimaryKeyConstraint("shard"),
        )
    if "relayr_changes" not in present:
        op.create_table(
            "relayr_changes",
            sa.Column("source", sa.Text(), nullable=False),
            sa.Column("tenant_id", sa.Text(), nullable=False),
            sa.Column("workspace_id", sa.Text(), nullable=False),
            sa.Column("version", sa.BigInteger(), nullable=False),
            sa.PrimaryKeyConstraint("source", "tenant_id", "workspace_id"),
        )
        op.create_index("ix_relayr_changes_version", "relayr_changes", ["version"])
    tables = {source: table for source, table in SOURCES.items() if table in present}
    statements = _postgres(tables) if bind.dialect.name == "postgresql" else _sqlite(tables)
    for statement in statements:
        op.execute(statement)


def downgrade() -> None:
    """relayr's migrations only go forward (ADR-0110)."""
    refuse_downgrade()


def _postgres(tables: dict[str, str]) -> list[str]:
    function = f"""
CREATE OR REPLACE FUNCTION relayr_log_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF (TG_OP = 'INSERT' AND NEW.head_seq > 0)
     OR (TG_OP = 'UPDATE' AND NEW.head_seq IS DISTINCT FROM OLD.head_seq) THEN
    PERFORM pg_notify('{CHANNEL}',
      json_build_array(TG_ARGV[0], NEW.tenant_id, NEW.workspace_id)::text);
  END IF;
  RETURN NULL;
END $$"""
    return [
        function,
        *(
            f"CREATE OR REPLACE TRIGGER relayr_log_moved AFTER INSERT OR UPDATE OF head_seq "
            f"ON {table} FOR EACH ROW EXECUTE FUNCTION relayr_log_moved('{source}')"
            for source, table in tables.items()
        ),
    ]


def _sqlite(tables: dict[str, str]) -> list[str]:
    statements = []
    for source, table in tables.items():
        moved = (
            "INSERT OR REPLACE INTO relayr_changes (source, tenant_id, workspace_id, version) "
            f"VALUES ('{source}', NEW.tenant_id, NEW.workspace_id, "
            "(SELECT coalesce(max(version), 0) + 1 FROM relayr_changes))"
        )
        statements += [
            f"CREATE TRIGGER IF NOT EXISTS relayr_{source}_moved AFTER UPDATE OF head_seq "
            f"ON {table} FOR EACH ROW WHEN NEW.head_seq <> OLD.head_seq BEGIN {moved}; END",
            f"CREATE TRIGGER IF NOT EXISTS relayr_{source}_created AFTER INSERT ON {table} "
            f"FOR EACH ROW WHEN NEW.head_seq > 0 BEGIN {moved}; END",
        ]
    return statements
