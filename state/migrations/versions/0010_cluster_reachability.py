"""whether a Kubernetes cluster's API server answers

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(
            sa.Column("reachable", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        batch.add_column(sa.Column("status_message", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("status_since", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("status_since")
        batch.drop_column("status_message")
        batch.drop_column("reachable")
