"""leftover processes: the GPUs of a job pod whose node agent went silent stay held, by the
pod's process marker, until an agent reports that nothing of it runs (docs/recovery.md)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03 18:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(sa.Column("leftover_marker", sa.String(80), nullable=True))
        batch.add_column(sa.Column("leftover_workload_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("leftover_since", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("leftover_since")
        batch.drop_column("leftover_workload_id")
        batch.drop_column("leftover_marker")
