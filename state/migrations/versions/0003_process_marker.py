"""workload process marker

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 12:10:41.402113
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.add_column(sa.Column("process_marker", sa.String(length=64), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_workloads_process_marker"), ["process_marker"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workloads_process_marker"))
        batch_op.drop_column("process_marker")
