"""job progress: steps, step times, checkpoints as a job's ranks report them

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_progress",
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step_at", sa.DateTime(), nullable=True),
        sa.Column("step_times", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("checkpoint_started_step", sa.BigInteger(), nullable=True),
        sa.Column("checkpoint_started_at", sa.DateTime(), nullable=True),
        sa.Column("last_checkpoint_uri", sa.Text(), nullable=False),
        sa.Column("last_checkpoint_step", sa.BigInteger(), nullable=True),
        sa.Column("last_checkpoint_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_job_progress_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("workload_id", name=op.f("pk_job_progress")),
    )


def downgrade() -> None:
    op.drop_table("job_progress")
