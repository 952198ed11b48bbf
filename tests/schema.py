"""Databases migrated to this version's head, made fast: each is a copy of one migrated once
per test process (the migrations take a tenth of a second or more; a copy, a few
milliseconds). test_store.py checks the migrations themselves, from an empty database.
PostgreSQL's copies: ``PostgresServer.create_migrated_database``."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from gpufleet.state import db

_head: list[Path] = []  # the SQLite file migrated once in this process


def migrated_sqlite(path: Path) -> str:
    """A SQLite database at ``path`` migrated to head, and its URL."""
    if not _head:
        directory = tempfile.mkdtemp(prefix="gpufleet-head-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        head = Path(directory) / "head.sqlite"
        engine = db.make_engine(f"sqlite:///{head}")
        try:
            db.upgrade(engine)
        finally:
            engine.dispose()  # its last connection folds the WAL into the file
        _head.append(head)
    shutil.copyfile(_head[0], path)
    return f"sqlite:///{path}"
