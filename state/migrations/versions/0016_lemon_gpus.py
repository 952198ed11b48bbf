"""lemon GPUs: a GPU with repeated hardware faults stays out of service until an admin
clears it (docs/recovery.md)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03 16:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(
            sa.Column("lemon", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("lemon")
