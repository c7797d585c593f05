"""relayr's tables as releases before migrations made them: the ledger's and the followers'.

A database where an earlier release created them (without a revision) keeps them: each table
is created only when missing, so this revision adopts them as they are.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from relayr.migrations import refuse_downgrade

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _workspace() -> list[sa.Column[str]]:
    return [
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("workspace_id", sa.Text(), nullable=False),
    ]


def upgrade() -> None:
    """Create each of relayr's tables that is missing."""
    present = set(sa.inspect(op.get_bind()).get_table_names())
    if "relayr_causes" not in present:
        op.create_table(
            "relayr_causes",
            *_workspace(),
            sa.Column("kind", sa.Text(), nullable=False),
            sa.Column("key", sa.Text(), nullable=False),
            sa.Column("correlation_id", sa.Text(), nullable=False),
            sa.Column("firing_id", sa.Text(), nullable=False),
            sa.Column("run_id", sa.Text(), nullable=False),
            sa.Column("depth", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("tenant_id", "workspace_id", "kind", "key"),
        )
    if "relayr_emissions" not in present:
        op.create_table(
            "relayr_emissions",
            sa.Column(
                "position",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                primary_key=True,
                autoincrement=True,
            ),
            *_workspace(),
            sa.Column("run_id", sa.Text(), nullable=False),
            sa.Column("epoch", sa.Integer(), nullable=False),
            sa.Column("message_id", sa.Text(), nullable=False),
            sa.Column("record", sa.Text(), nullable=False),
            sa.Column("emitted_at", sa.DateTime(timezone=True), nullable=False),
            sa.UniqueConstraint(
                "tenant_id",
                "workspace_id",
                "run_id",
                "epoch",
                "message_id",
                name="relayr_emissions_once",
            ),
        )
    if "relayr_follow_cursors" not in present:
        op.create_table(
            "relayr_follow_cursors",
            *_workspace(),
            sa.Column("cursor", sa.BigInteger(), nullable=False),
            sa.Column("holder", sa.Text(), nullable=True),
            sa.Column("held_until", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("tenant_id", "workspace_id"),
        )
    if "relayr_follow_dead_letters" not in present:
        op.create_table(
            "relayr_follow_dead_letters",
            *_workspace(),
            sa.Column("envelope_id", sa.Text(), nullable=False),
            sa.Column("seq", sa.BigInteger(), nullable=False),
            sa.Column("event_type", sa.Text(), nullable=False),
            sa.Column("reason", sa.Text(), nullable=False),
            sa.Column("error", sa.Text(), nullable=False),
            sa.Column("dead_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("tries", sa.Integer(), nullable=False),
            sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("tenant_id", "workspace_id", "envelope_id"),
        )


def downgrade() -> None:
    """relayr's migrations only go forward (ADR-0110)."""
    refuse_downgrade()
