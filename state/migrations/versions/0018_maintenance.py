"""maintenance: a GPU reset, a node recycle and diagnostics are node operations the node
agent runs for the recovery loop or an admin, with no workload (docs/recovery.md)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_operations") as batch:
        batch.alter_column("workload_id", existing_type=sa.Integer(), nullable=True)
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(sa.Column("maintenance", sa.String(32), nullable=True))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("maintenance", sa.String(32), nullable=True))
        batch.add_column(sa.Column("maintenance_by", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("maintenance_by")
        batch.drop_column("maintenance")
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("maintenance")
    op.execute("DELETE FROM node_operations WHERE workload_id IS NULL")
    with op.batch_alter_table("node_operations") as batch:
        batch.alter_column("workload_id", existing_type=sa.Integer(), nullable=False)
