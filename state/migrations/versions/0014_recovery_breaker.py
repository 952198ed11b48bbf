"""recovery breaker: when the recovery loop cordoned each node, and each cluster's breaker
on automated cordons (recovery/breaker.py)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("recovery_cordoned_at", sa.DateTime(), nullable=True))
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("breaker_tripped_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("breaker_tripped_at")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("recovery_cordoned_at")
