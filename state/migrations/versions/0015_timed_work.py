"""timed work: APScheduler's job store (hub/timed.py)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "apscheduler_jobs",
        sa.Column("id", sa.Unicode(191), nullable=False),
        sa.Column("next_run_time", sa.Float(25), nullable=True),
        sa.Column("job_state", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_apscheduler_jobs")),
    )
    op.create_index(
        op.f("ix_apscheduler_jobs_next_run_time"), "apscheduler_jobs", ["next_run_time"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_apscheduler_jobs_next_run_time"), table_name="apscheduler_jobs")
    op.drop_table("apscheduler_jobs")
