"""gpu samples and lost flag

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 10:02:11.866997
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("lost", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("sampled_at", sa.DateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("last_sample", sa.JSON(), server_default="{}", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_column("last_sample")
        batch_op.drop_column("sampled_at")
        batch_op.drop_column("lost")
