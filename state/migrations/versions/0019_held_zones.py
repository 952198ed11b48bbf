"""held zones: the zone a waiting workload's last cycle held for it survives a restart of
the controller (docs/scheduler.md, "Held zones")

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(sa.Column("held_cluster", sa.String(255), nullable=True))
        batch.add_column(sa.Column("held_zone", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("held_zone")
        batch.drop_column("held_cluster")
