"""Fixtures shared by every test tier: a real PostgreSQL server and store engines.

The PostgreSQL server starts once per test run, and only when a test asks for it. Every test
gets its own fresh database (PostgreSQL) or file (SQLite), so tests never share rows.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import Engine

from gpufleet.state import db

from .postgres import PostgresServer, PostgresUnavailable, skip_requested
from .schema import migrated_sqlite

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Kubernetes tier runs first: under ``--dist loadfile`` it is the longest unit of
    work (see ``pytest_xdist_make_scheduler``), and started last it would leave one worker
    running it alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/k8s/"))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` keeps each file's tests on one worker (its module-scoped hubs
    start once), and here the whole Kubernetes tier too (its two clusters start once per
    worker that runs any of it, and a second pair would cost more than it saves)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/k8s" if path.startswith("tests/k8s/") else path

        def schedule(self) -> None:
            # Schemathesis's tests (one per API operation) all carry their function's
            # node id, and a scope scheduler keys tests by node id: it would run one.
            counts = Counter(next(iter(self.registered_collections.values())))
            repeated = {nodeid for nodeid, count in counts.items() if count > 1}
            if repeated:
                raise pytest.UsageError(
                    f"{sorted(repeated)[0]} names several tests, and --dist loadfile would "
                    "run one of them: run that file with --dist load (scripts/test does)"
                )
            super().schedule()

    return ByFile(config, log)


@pytest.fixture(autouse=True)
def _unfreeze_after_each_test() -> Iterator[None]:
    """A scheduling cycle freezes what is alive when it ends (``state/collector.py``), in
    the test process too; the controller returns what later became cyclic garbage with a
    periodic full collection. Here each test gives it back to the collector instead."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the whole run, stopped at the end."""
    if skip_requested():
        pytest.skip("GPUFLEET_SKIP_POSTGRES=1: PostgreSQL tests skipped")
    try:
        server = PostgresServer.start()
    except PostgresUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A SQLAlchemy URL of a fresh, empty database, dropped after the test."""
    name = postgres_server.create_database()
    try:
        yield postgres_server.url(name)
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(params=BACKENDS)
def empty_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an empty database (no schema), once per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'gpufleet.sqlite'}"
    else:
        url = request.getfixturevalue("postgres_url")
    engine = db.make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on a database migrated to this version's head, once per backend."""
    name = ""
    if request.param == "sqlite":
        url = migrated_sqlite(tmp_path / "gpufleet.sqlite")
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        name = server.create_migrated_database()
        url = server.url(name)
    engine = db.make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
        if name:
            server.drop_database(name)


# ------------------------------------------------------------------------ S3
# Imported when a test asks for S3 only: boto3 costs a fraction of a second to import.
if TYPE_CHECKING:
    from gpufleet.snapshotter.s3 import S3Store

    from .s3server import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One real S3 server (SeaweedFS) for the whole run, stopped at the end."""
    from .s3server import S3Server, S3Unavailable
    from .s3server import skip_requested as s3_skip_requested

    if s3_skip_requested():
        pytest.skip("GPUFLEET_SKIP_S3=1: S3 tests skipped")
    try:
        server = S3Server.start()
    except S3Unavailable as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_store(s3_server: S3Server) -> S3Store:
    """An ``S3Store`` under a fresh prefix that no other test uses."""
    from gpufleet.snapshotter.s3 import S3Store

    return S3Store(*s3_server.fresh_place(), **s3_server.store_options())
