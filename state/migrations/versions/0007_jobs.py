"""training jobs: their launch spec, their pods as the node agent reports them, and
their per-rank logs; who last edited a project or quota in the admin panel

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.add_column(sa.Column("spec", sa.JSON(), nullable=True))
    for table in ("projects", "project_quotas"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("edited_by", sa.String(length=255), nullable=True))
            batch_op.add_column(sa.Column("edited_at", sa.DateTime(), nullable=True))
    op.create_table(
        "job_pods",
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("pod_index", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_job_pods_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("workload_id", "pod_index", name=op.f("pk_job_pods")),
    )
    op.create_table(
        "job_logs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stream", sa.String(length=8), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_job_logs_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_logs")),
        sa.UniqueConstraint(
            "workload_id", "rank", "stream", "offset", name=op.f("uq_job_logs_workload_id")
        ),
    )


def downgrade() -> None:
    op.drop_table("job_logs")
    op.drop_table("job_pods")
    for table in ("project_quotas", "projects"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("edited_at")
            batch_op.drop_column("edited_by")
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.drop_column("spec")
