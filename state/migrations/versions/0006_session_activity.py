"""the culler's session activity, what a session's snapshot holds, and when each GPU
last did work

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 17:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.add_column(sa.Column("busy_at", sa.DateTime(), nullable=True))
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.add_column(sa.Column("snapshot_sources", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("snapshot_pending_since", sa.DateTime(), nullable=True))
    op.create_table(
        "session_activity",
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("reported_at", sa.DateTime(), nullable=True),
        sa.Column("kernels_busy", sa.Boolean(), nullable=False),
        sa.Column("kernels", sa.Integer(), nullable=False),
        sa.Column("kernel_activity", sa.DateTime(), nullable=True),
        sa.Column("terminal_activity", sa.DateTime(), nullable=True),
        sa.Column("keep_alive_until", sa.DateTime(), nullable=True),
        sa.Column("warned_at", sa.DateTime(), nullable=True),
        sa.Column("warned_stop_at", sa.DateTime(), nullable=True),
        sa.Column("notice", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["workload_id"],
            ["workloads.id"],
            name=op.f("fk_session_activity_workload_id_workloads"),
        ),
        sa.PrimaryKeyConstraint("workload_id", name=op.f("pk_session_activity")),
    )


def downgrade() -> None:
    op.drop_table("session_activity")
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.drop_column("snapshot_pending_since")
        batch_op.drop_column("snapshot_sources")
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_column("busy_at")
