"""the Unix identity each hub user's sessions and job ranks run as

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 20:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "user_accounts",
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("uid", sa.Integer(), nullable=False),
        sa.Column("gid", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("username", name=op.f("pk_user_accounts")),
        sa.UniqueConstraint("uid", name=op.f("uq_user_accounts_uid")),
    )


def downgrade() -> None:
    op.drop_table("user_accounts")
