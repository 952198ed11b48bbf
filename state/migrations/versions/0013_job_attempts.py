"""job attempts: a job that ended for the infrastructure's reasons runs again as its next
attempt (recovery/attempts.py); a GPU the recovery loop blamed is cordoned

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("faults", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("not_before", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("recovery", sa.JSON(), nullable=True))
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(
            sa.Column("cordoned", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("cordoned")
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("recovery")
        batch.drop_column("not_before")
        batch.drop_column("faults")
        batch.drop_column("attempt")
