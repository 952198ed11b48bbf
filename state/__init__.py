"""The controller's database: SQLAlchemy 2 models, Alembic migrations, sessions and the lease."""
