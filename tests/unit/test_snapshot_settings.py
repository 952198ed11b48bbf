"""Where snapshots go is declared once, ``c.SnapshotSettings``, and the controller, the
local spawner and the node agent all read it; the options' earlier names still work
where a deployment's config sets them, with a warning in the log."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpufleet.agent.app import NodeAgent
from gpufleet.hub.app import FleetController
from gpufleet.snapshotter.settings import SnapshotSettings, StoreAccess
from gpufleet.spawner.local import LocalGPUSpawner

STORE_VARIABLES = ("GPUFLEET_SNAPSHOT_STORE", "GPUFLEET_SNAPSHOT_KEY_FILE", "GPUFLEET_S3_ENDPOINT")


@pytest.fixture(autouse=True)
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUFLEET_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def controller_access(c: Config) -> StoreAccess:
    controller = FleetController(config=c)
    return controller.snapshot_settings().access(controller.data_dir)


def agent_access(c: Config) -> StoreAccess:
    return NodeAgent(config=c).snapshot_access()


def spawner_access(c: Config) -> StoreAccess:
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(api_url="http://127.0.0.1:8081/hub/api", url="/hub/", base_url="/")
    return LocalGPUSpawner(config=c, user=user, hub=hub).snapshot_access()


READERS = {"controller": controller_access, "agent": agent_access, "spawner": spawner_access}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_writes_where_snapshot_settings_say(reader: str) -> None:
    c = Config()
    c.SnapshotSettings.store = "s3://bucket/snapshots"
    c.SnapshotSettings.key_file = "/etc/gpufleet/master.key"
    c.SnapshotSettings.s3_endpoint = "https://s3.example.org"
    c.SnapshotSettings.cache_dir = "/var/cache/gpufleet"
    access = READERS[reader](c)
    assert (access.store, access.key_file, access.s3_endpoint, access.cache_dir) == (
        "s3://bucket/snapshots",
        "/etc/gpufleet/master.key",
        "https://s3.example.org",
        "/var/cache/gpufleet",
    )
    assert not access.create_key  # a named key that is missing is an error, never made


@pytest.mark.parametrize("reader", READERS)
def test_unset_settings_are_the_environments_else_the_data_directorys(
    reader: str, deployment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    access = READERS[reader](Config())
    assert (access.store, access.key_file, access.s3_endpoint) == (
        str(deployment / "snapshots"),
        str(deployment / "snapshot-master.key"),
        "",
    )
    assert access.create_key  # the embedded default's key is made on first start
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_STORE", "s3://from-env/x")
    monkeypatch.setenv("GPUFLEET_SNAPSHOT_KEY_FILE", "/run/key")
    monkeypatch.setenv("GPUFLEET_S3_ENDPOINT", "http://127.0.0.1:9000")
    access = READERS[reader](Config())
    assert (access.store, access.key_file, access.s3_endpoint, access.create_key) == (
        "s3://from-env/x",
        "/run/key",
        "http://127.0.0.1:9000",
        False,
    )


def test_stat_caches_default_to_the_readers_own_place(deployment: Path) -> None:
    assert controller_access(Config()).cache_dir == str(deployment / "statcache")
    assert spawner_access(Config()).cache_dir == str(deployment / "statcache")
    assert agent_access(Config()).cache_dir == str(deployment / "agent" / "statcache")


@pytest.mark.parametrize(
    ("section", "readers"),
    [
        # The agent took the controller's settings as its defaults: it still does.
        ("FleetController", ("controller", "agent")),
        ("NodeAgent", ("agent",)),
        ("LocalGPUSpawner", ("spawner",)),
    ],
)
def test_an_earlier_name_still_sets_its_readers_store_and_says_it_is_deprecated(
    section: str,
    readers: tuple[str, ...],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = Config()
    c.SnapshotSettings.store = "/srv/snapshots"
    c[section].snapshot_store = f"s3://old-{section.lower()}/snapshots"
    c[section].snapshot_s3_endpoint = "https://old.example.org"
    with caplog.at_level(logging.WARNING):
        seen = {name: read(c) for name, read in READERS.items()}
    for name, access in seen.items():
        if name in readers:
            assert access.store == f"s3://old-{section.lower()}/snapshots"
            assert access.s3_endpoint == "https://old.example.org"
        else:
            assert access.store == "/srv/snapshots"
            assert access.s3_endpoint == ""
    # The applications log through their own handler on stderr, the spawner through the
    # hub's logger.
    warned = capsys.readouterr().err + caplog.text
    assert f"c.{section}.snapshot_store is deprecated: set c.SnapshotSettings.store" in warned


def test_the_spawners_earlier_cache_dir_name_still_counts() -> None:
    c = Config()
    c.LocalGPUSpawner.snapshot_cache_dir = "/old/statcache"
    c.LocalGPUSpawner.snapshot_key_file = "/old/master.key"
    access = spawner_access(c)
    assert (access.cache_dir, access.key_file) == ("/old/statcache", "/old/master.key")


def test_each_option_has_help_a_user_can_act_on() -> None:
    for name, trait in SnapshotSettings.class_traits(config=True).items():
        assert trait.help and "Empty:" in trait.help, name
