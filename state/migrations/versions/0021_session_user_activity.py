"""the culler's session activity: what the session's user last did in JupyterLab (typed,
clicked or scrolled; saved or changed a file), which the session extension reports, and
when (docs/culler.md, "When is a session idle?")

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("session_activity") as batch:
        batch.add_column(sa.Column("user_activity", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("user_action", sa.String(16), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("session_activity") as batch:
        batch.drop_column("user_action")
        batch.drop_column("user_activity")
