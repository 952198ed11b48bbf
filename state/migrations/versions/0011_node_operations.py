"""node operations: snapshot passes and restores a node agent does for a workload

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "node_operations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"],
            ["workloads.id"],
            name=op.f("fk_node_operations_workload_id_workloads"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_operations")),
    )
    op.create_index(
        "ix_node_operations_node_state", "node_operations", ["node", "state"], unique=False
    )
    op.create_index(
        op.f("ix_node_operations_workload_id"), "node_operations", ["workload_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_node_operations_workload_id"), table_name="node_operations")
    op.drop_index("ix_node_operations_node_state", table_name="node_operations")
    op.drop_table("node_operations")
