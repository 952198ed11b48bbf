"""what a session's start said (restored, culled before), kept beside the culler's warning

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06 04:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("session_activity") as batch:
        batch.add_column(sa.Column("start_notice", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("session_activity") as batch:
        batch.drop_column("start_notice")
