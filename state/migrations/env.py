"""Alembic environment: the engine comes from the caller (``db.upgrade``), never from an ini."""

from alembic import context

from gpufleet.state.models import Base

config = context.config
engine = config.attributes["engine"]

with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    context.run_migrations()
