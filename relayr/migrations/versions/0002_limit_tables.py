"""The limits' counts: in-flight slots, uses of windows, waiting runs, and a lock row per limit.

Tables an earlier build of the limits created without a revision are kept: each is created
only when missing (ADR-0106).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from relayr.migrations import refuse_downgrade

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create each of the limits' tables that is missing."""
    present = set(sa.inspect(op.get_bind()).get_table_names())
    if "relayr_limit_locks" not in present:
        op.create_table(
            "relayr_limit_locks",
            sa.Column("bucket", sa.Text(), nullable=False),
            sa.PrimaryKeyConstraint("bucket"),
        )
    if "relayr_limit_slots" not in present:
        op.create_table(
            "relayr_limit_slots",
            sa.Column("bucket", sa.Text(), nullable=False),
            sa.Column("holder", sa.Text(), nullable=False),
            sa.Column("kind", sa.Text(), nullable=False),
            sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
            sa.PrimaryKeyConstraint("bucket", "holder"),
        )
    if "relayr_limit_uses" not in present:
        op.create_table(
            "relayr_limit_uses",
            sa.Column(
                "position",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                primary_key=True,
                autoincrement=True,
            ),
            sa.Column("bucket", sa.Text(), nullable=False),
            sa.Column("use", sa.Text(), nullable=False),
            sa.Column("kind", sa.Text(), nullable=False),
            sa.Column("at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("amount", sa.BigInteger(), nullable=False),
            sa.UniqueConstraint("bucket", "use", name="relayr_limit_uses_once"),
        )
    if "relayr_limit_waits" not in present:
        op.create_table(
            "relayr_limit_waits",
            sa.Column("tenant_id", sa.Text(), nullable=False),
            sa.Column("workspace_id", sa.Text(), nullable=False),
            sa.Column("run_id", sa.Text(), nullable=False),
            sa.Column("limit_name", sa.Text(), nullable=False),
            sa.Column("kind", sa.Text(), nullable=False),
            sa.Column("bound", sa.Text(), nullable=False),
            sa.Column("since", sa.DateTime(timezone=True), nullable=False),
            sa.Column("next_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("tenant_id", "workspace_id", "run_id"),
        )


def downgrade() -> None:
    """relayr's migrations only go forward (ADR-0110)."""
    refuse_downgrade()
