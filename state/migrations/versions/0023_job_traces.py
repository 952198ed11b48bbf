"""every rank's Python stacks of a job's attempt, taken on a hang or when asked
(docs/recovery.md, "Stacks")

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_traces",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("workload_id", sa.Integer(), sa.ForeignKey("workloads.id"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("why", sa.String(16), nullable=False),
        sa.Column("asked_by", sa.String(255), nullable=False),
        sa.Column("asked_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_job_traces_workload", "job_traces", ["workload_id", "attempt"])
    op.create_table(
        "job_trace_dumps",
        sa.Column("trace_id", sa.Integer(), sa.ForeignKey("job_traces.id"), primary_key=True),
        sa.Column("pod_index", sa.Integer(), primary_key=True),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("taken_at", sa.DateTime(), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_trace_dumps")
    op.drop_index("ix_job_traces_workload", table_name="job_traces")
    op.drop_table("job_traces")
