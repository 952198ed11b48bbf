"""The controller's snapshot index: rebuilt from a scan of a real repository (the store is
the truth), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, select

from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.listing import SnapshotRecord, scan
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.settings import master_key
from gpufleet.snapshotter.store import LocalStore
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Event, Project, Snapshot

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
PROJECTS = [{"name": "vision"}, {"name": "nlp"}]


def _store(engine: Engine) -> FleetStore:
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(T0, PROJECTS, [], [{"name": "standard", "rank": 100}])
    return store


def test_the_index_follows_the_store(engine: Engine, tmp_path: Path) -> None:
    fleet = _store(engine)
    key = master_key(tmp_path / "master.key", create=True)
    assert master_key(tmp_path / "master.key", create=True) == key  # made once, then read
    assert oct((tmp_path / "master.key").stat().st_mode & 0o777) == "0o600"
    snapshots = LocalStore(tmp_path / "snapshots")
    home = tmp_path / "home"
    home.mkdir()
    (home / "a.txt").write_text("a")
    made = []
    for project, user in [("vision", "ann"), ("vision", "bob"), ("nlp", "ann")]:
        repository = Repository.open(snapshots, project, key)
        made.append(create_snapshot(repository, [SourceSpec("home", home)], user=user))

    records = scan(snapshots, key, fleet.snapshots.project_names())
    assert sorted((r.project, r.username) for r in records) == [
        ("nlp", "ann"),
        ("vision", "ann"),
        ("vision", "bob"),
    ]
    changes = fleet.snapshots.rebuild_snapshot_index(T0, snapshots.uri, records)
    assert (changes.added, changes.updated, changes.removed) == (3, 0, 0)
    assert [s.file_count for s in fleet.snapshots.snapshots_of("ann")] == [1, 1]

    # A manifest deleted from the store (retention, an admin) leaves the index too.
    vision = Repository.open(snapshots, "vision", key)
    vision.delete_manifest(vision.snapshots("bob")[0])
    changes = fleet.snapshots.rebuild_snapshot_index(
        T0, snapshots.uri, scan(snapshots, key, ["vision", "nlp"])
    )
    assert (changes.added, changes.updated, changes.removed) == (0, 0, 1)
    assert fleet.snapshots.snapshots_of("bob") == []
    again = fleet.snapshots.rebuild_snapshot_index(
        T0, snapshots.uri, scan(snapshots, key, ["vision", "nlp"])
    )
    assert (again.added, again.updated, again.removed) == (0, 0, 0)
    with fleet.read() as session:
        rows = session.scalars(select(Snapshot)).all()
        vision_id = session.scalars(select(Project.id).where(Project.name == "vision")).one()
        kinds = [e.kind for e in session.scalars(select(Event))]
    assert {r.project_id for r in rows if r.username == "ann"} >= {vision_id}
    assert kinds.count("snapshot-index-rebuilt") == 2


def test_a_recorded_snapshot_is_one_row(engine: Engine) -> None:
    fleet = _store(engine)
    record = SnapshotRecord(
        "vision", "ann", "gpu", "file:///s", "projects/vision/snapshots/x", T0, 10, 2
    )
    fleet.snapshots.record_snapshot(T0, record)
    fleet.snapshots.record_snapshot(T0, record)
    rows = fleet.snapshots.snapshots_of("ann", "gpu")
    assert [(r.manifest_key, r.size_bytes) for r in rows] == [("projects/vision/snapshots/x", 10)]


def test_scheduled_retention_forgets_what_the_policy_does_not_keep(tmp_path: Path) -> None:
    from gpufleet.snapshotter.retention import RetentionPolicy, retain_and_collect

    key = master_key(tmp_path / "master.key", create=True)
    snapshots = LocalStore(tmp_path / "snapshots")
    home = tmp_path / "home"
    home.mkdir()
    repository = Repository.open(snapshots, "vision", key)
    for i in range(4):
        (home / "a.txt").write_text(f"version {i}")
        create_snapshot(repository, [SourceSpec("home", home)], user="ann")
    now = datetime.now(UTC).timestamp() + 1
    run = retain_and_collect(snapshots, key, ["vision", "nlp"], RetentionPolicy(2, 0), 0.0, now)
    assert run.forgotten == 2
    assert len(Repository.open(snapshots, "vision", key).snapshots("ann")) == 2
    # Nothing more to forget; the latest two stay whatever runs after.
    again = retain_and_collect(snapshots, key, ["vision"], RetentionPolicy(2, 0), 0.0, now)
    assert again.forgotten == 0


def test_the_retention_schedule_is_a_crontab_line_or_nothing() -> None:
    import pytest

    from gpufleet.hub.timed import retention_trigger

    assert retention_trigger("") is None
    trigger = retention_trigger("0 3 * * *")
    assert trigger is not None
    fire = trigger.get_next_fire_time(None, T0)
    assert fire == datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    with pytest.raises(ValueError, match="is not a crontab line"):
        retention_trigger("every night")
