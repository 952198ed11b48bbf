"""initial fleet model

Revision ID: 0001
Revises:
Create Date: 2026-11-30 09:07:12.570035
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "clusters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("kube_context", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_clusters")),
        sa.UniqueConstraint("name", name=op.f("uq_clusters_name")),
    )
    op.create_table(
        "controller_lease",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_controller_lease")),
    )
    op.create_table(
        "priority_classes",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("preemptible_by_default", sa.Boolean(), nullable=False),
        sa.Column("description", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_priority_classes")),
    )
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("display_name", sa.String(length=200), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("environment", sa.String(length=500), nullable=False),
        sa.Column("cpu_per_gpu", sa.Float(), nullable=False),
        sa.Column("memory_per_gpu_bytes", sa.BigInteger(), nullable=False),
        sa.Column("allowed_gpu_types", sa.JSON(), nullable=False),
        sa.Column("allowed_projects", sa.JSON(), nullable=False),
        sa.Column("is_default", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profiles")),
        sa.UniqueConstraint("name", name=op.f("uq_profiles_name")),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("display_name", sa.String(length=200), nullable=False),
        sa.Column(
            "kind",
            sa.Enum(
                "organisation", "team", "project", name="projectkind", native_enum=False, length=32
            ),
            nullable=False,
        ),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("hub_group", sa.String(length=255), nullable=True),
        sa.Column("default_priority", sa.String(length=32), nullable=False),
        sa.Column("allowed_priorities", sa.JSON(), nullable=False),
        sa.Column("fair_share_weight", sa.Float(), nullable=False),
        sa.Column("per_user_gpu_cap", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["projects.id"], name=op.f("fk_projects_parent_id_projects")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    op.create_table(
        "memberships",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_memberships_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_memberships")),
        sa.UniqueConstraint("project_id", "username", name=op.f("uq_memberships_project_id")),
    )
    with op.batch_alter_table("memberships", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_memberships_username"), ["username"], unique=False)

    op.create_table(
        "project_quotas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("guaranteed", sa.Integer(), nullable=False),
        sa.Column("borrow_limit", sa.Integer(), nullable=True),
        sa.Column("lend_limit", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_project_quotas_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project_quotas")),
        sa.UniqueConstraint("project_id", "gpu_type", name=op.f("uq_project_quotas_project_id")),
    )
    op.create_table(
        "workloads",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(
            "kind",
            sa.Enum("session", "job", name="workloadkind", native_enum=False, length=32),
            nullable=False,
        ),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("profile", sa.String(length=64), nullable=True),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("pods", sa.Integer(), nullable=False),
        sa.Column("gpus_per_pod", sa.Integer(), nullable=False),
        sa.Column("priority_class", sa.String(length=32), nullable=False),
        sa.Column("preemptible", sa.Boolean(), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "pending",
                "admitted",
                "running",
                "stopping",
                "ended",
                name="workloadstate",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("outcome", sa.String(length=32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("queue_position", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("admitted_at", sa.DateTime(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("idle_since", sa.DateTime(), nullable=True),
        sa.Column("last_checkpoint_at", sa.DateTime(), nullable=True),
        sa.Column("last_snapshot_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_workloads_project_id_projects")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workloads")),
    )
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.create_index("ix_workloads_state_created", ["state", "created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_workloads_username"), ["username"], unique=False)

    op.create_table(
        "zones",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cluster_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["cluster_id"], ["clusters.id"], name=op.f("fk_zones_cluster_id_clusters")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_zones")),
        sa.UniqueConstraint("cluster_id", "name", name=op.f("uq_zones_cluster_id")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("cause", sa.String(length=255), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=True),
        sa.Column("project", sa.String(length=64), nullable=True),
        sa.Column("username", sa.String(length=255), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_events_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_workload_id"), ["workload_id"], unique=False)

    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("zone_id", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("cpus", sa.Float(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column(
            "health",
            sa.Enum(
                "ok",
                "degraded",
                "unhealthy",
                "unknown",
                name="nodehealth",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("agent", sa.String(length=255), nullable=True),
        sa.ForeignKeyConstraint(["zone_id"], ["zones.id"], name=op.f("fk_nodes_zone_id_zones")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "snapshots",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("server_name", sa.String(length=255), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("workload_id", sa.Integer(), nullable=True),
        sa.Column("store_uri", sa.String(length=1000), nullable=False),
        sa.Column("manifest_key", sa.String(length=1000), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_snapshots_project_id_projects")
        ),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_snapshots_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshots")),
        sa.UniqueConstraint("manifest_key", name=op.f("uq_snapshots_manifest_key")),
    )
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_snapshots_username"), ["username"], unique=False)

    op.create_table(
        "gpus",
        sa.Column("uuid", sa.String(length=96), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("pci_bus_id", sa.String(length=32), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("present", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_gpus_node_id_nodes")),
        sa.PrimaryKeyConstraint("uuid", name=op.f("pk_gpus")),
    )
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpus_node_id"), ["node_id"], unique=False)

    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=96), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("pod_index", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["gpu_uuid"], ["gpus.uuid"], name=op.f("fk_allocations_gpu_uuid_gpus")
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_allocations_node_id_nodes")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_allocations_project_id_projects")
        ),
        sa.ForeignKeyConstraint(
            ["workload_id"], ["workloads.id"], name=op.f("fk_allocations_workload_id_workloads")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_allocations_workload_id"), ["workload_id"], unique=False
        )
        batch_op.create_index(
            "uq_allocations_open_gpu",
            ["gpu_uuid"],
            unique=True,
            sqlite_where=sa.text("closed_at IS NULL"),
            postgresql_where=sa.text("closed_at IS NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_allocations_open_gpu",
            sqlite_where=sa.text("closed_at IS NULL"),
            postgresql_where=sa.text("closed_at IS NULL"),
        )
        batch_op.drop_index(batch_op.f("ix_allocations_workload_id"))

    op.drop_table("allocations")
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpus_node_id"))

    op.drop_table("gpus")
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_snapshots_username"))

    op.drop_table("snapshots")
    op.drop_table("nodes")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_workload_id"))
        batch_op.drop_index(batch_op.f("ix_events_at"))

    op.drop_table("events")
    op.drop_table("zones")
    with op.batch_alter_table("workloads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workloads_username"))
        batch_op.drop_index("ix_workloads_state_created")

    op.drop_table("workloads")
    op.drop_table("project_quotas")
    with op.batch_alter_table("memberships", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_memberships_username"))

    op.drop_table("memberships")
    op.drop_table("projects")
    op.drop_table("profiles")
    op.drop_table("priority_classes")
    op.drop_table("controller_lease")
    op.drop_table("clusters")
