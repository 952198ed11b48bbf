"""job progress: the epoch, a thinned history of steps and loss for the job page, and a
count of checkpoints by attempt in place of an event per checkpoint (docs/jobs.md,
"Progress")

The counts are filled from the ``job-checkpoint-saved`` events written before this
revision, each counted for the attempt that was running when it was saved (the
``job-restarting`` events say when each attempt began). The events themselves stay:
events are append-only.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECKPOINT_SAVED = "job-checkpoint-saved"
RESTARTING = "job-restarting"


def upgrade() -> None:
    with op.batch_alter_table("job_progress") as batch:
        batch.add_column(sa.Column("last_epoch", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("history", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("last_checkpoint_epoch", sa.BigInteger(), nullable=True))
        batch.add_column(
            sa.Column("checkpoints_saved", sa.JSON(), nullable=False, server_default="{}")
        )
    _count_saved_checkpoints(op.get_bind())


def _count_saved_checkpoints(bind: sa.Connection) -> None:
    events = sa.table(
        "events",
        sa.column("workload_id", sa.Integer()),
        sa.column("kind", sa.String()),
        sa.column("data", sa.JSON()),
        sa.column("id", sa.Integer()),
    )
    progress = sa.table(
        "job_progress",
        sa.column("workload_id", sa.Integer()),
        sa.column("checkpoints_saved", sa.JSON()),
    )
    rows = bind.execute(
        sa.select(events.c.workload_id, events.c.kind, events.c.data)
        .where(
            events.c.kind.in_((CHECKPOINT_SAVED, RESTARTING)),
            events.c.workload_id.is_not(None),
        )
        .order_by(events.c.id)
    )
    attempt: dict[int, int] = {}
    counts: dict[int, dict[str, int]] = {}
    for workload_id, kind, data in rows:
        if kind == RESTARTING:
            attempt[workload_id] = int((data or {}).get("attempt", attempt.get(workload_id, 1)))
            continue
        key = str(attempt.get(workload_id, 1))
        mine = counts.setdefault(workload_id, {})
        mine[key] = mine.get(key, 0) + 1
    for workload_id, by_attempt in counts.items():
        bind.execute(
            progress.update()
            .where(progress.c.workload_id == workload_id)
            .values(checkpoints_saved=by_attempt)
        )


def downgrade() -> None:
    with op.batch_alter_table("job_progress") as batch:
        batch.drop_column("checkpoints_saved")
        batch.drop_column("last_checkpoint_epoch")
        batch.drop_column("history")
        batch.drop_column("last_epoch")
