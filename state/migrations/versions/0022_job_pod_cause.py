"""why a job's pod ended in its backend's own word (Kubernetes' OOMKilled, Evicted, a lost
node...), which the failure classifier reads (docs/kubernetes.md, "Training jobs")

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-05 22:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_pods") as batch:
        batch.add_column(sa.Column("cause", sa.String(32), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("job_pods") as batch:
        batch.drop_column("cause")
