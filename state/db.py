"""Engines, sessions and schema versions for the controller's database.

SQLite (WAL) is the embedded default; PostgreSQL is the production choice. The schema is
owned by Alembic: ``upgrade`` brings a database to this version's head, and
``check_schema`` refuses to run against anything else, naming the command that fixes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.orm import Session, sessionmaker

from ..scheduler.errors import SchemaMismatch

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
UPGRADE_COMMAND = "gpufleet-controller upgrade-db"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config_without_engine()).get_current_head()
    assert head is not None, "the migrations folder has no revision"
    return head


def alembic_config_without_engine() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def is_empty(engine: Engine) -> bool:
    return not inspect(engine).get_table_names()


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    command.downgrade(alembic_config(engine), revision)


def check_schema(engine: Engine) -> None:
    """Raise :class:`SchemaMismatch` unless the database is at this version's head."""
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    where = engine.url.render_as_string(hide_password=True)
    if current is None:
        raise SchemaMismatch(
            f"The gpufleet database at {where} has no gpufleet schema. "
            f"Create it with `{UPGRADE_COMMAND}` (same configuration file as the hub)."
        )
    known = {
        rev.revision
        for rev in ScriptDirectory.from_config(alembic_config_without_engine()).walk_revisions()
    }
    if current not in known:
        raise SchemaMismatch(
            f"The gpufleet database at {where} is at revision {current}, which this version of "
            f"gpufleet does not know (it expects {head}): it was upgraded by a newer gpufleet. "
            "Install that version again, or restore the database from before the upgrade."
        )
    raise SchemaMismatch(
        f"The gpufleet database at {where} is at revision {current}; this version of gpufleet "
        f"needs {head}. Back up the database, then run `{UPGRADE_COMMAND}`."
    )


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work is committed on success and rolled back on any error."""
    with factory() as session, session.begin():
        yield session
