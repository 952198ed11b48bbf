"""each GPU's utilisation and memory over time, thinned with age

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "gpu_history",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=96), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("utilization_pct", sa.Integer(), nullable=True),
        sa.Column("memory_used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("memory_total_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_history")),
    )
    op.create_index("ix_gpu_history_gpu_uuid_at", "gpu_history", ["gpu_uuid", "at"])


def downgrade() -> None:
    op.drop_index("ix_gpu_history_gpu_uuid_at", table_name="gpu_history")
    op.drop_table("gpu_history")
