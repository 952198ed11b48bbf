"""`gpufleet-controller` refuses a database at another schema and says what to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from gpufleet.state import db

CONTROLLER = str(Path(sys.executable).parent / "gpufleet-controller")


def write_config(tmp_path: Path, db_path: Path) -> Path:
    config = tmp_path / "jupyterhub_config.py"
    config.write_text(
        f"c = get_config()\nc.FleetController.db_url = 'sqlite:///{db_path}'\n"
        # A registry of its own: a deployment running on this machine is not these tests'.
        f"c.FleetController.sandbox_uid_registry = '{tmp_path / 'sandbox-uids'}'\n"
    )
    return config


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONTROLLER, *args], capture_output=True, text=True, timeout=60)


def test_upgrade_db_creates_the_schema_and_reports_the_revisions(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite"
    result = run("upgrade-db", "--config", str(write_config(tmp_path, path)))
    assert result.returncode == 0, result.stderr
    assert f"-> {db.head_revision()}" in result.stdout
    assert db.current_revision(db.make_engine(f"sqlite:///{path}")) == db.head_revision()


@pytest.mark.parametrize(
    ("prepare", "expected"),
    [
        ("CREATE TABLE unrelated (id INTEGER)", "has no gpufleet schema"),
        ("UPGRADE; UPDATE alembic_version SET version_num = 'ffff'", "does not know"),
    ],
)
def test_start_stops_on_a_schema_mismatch_naming_the_fix(
    tmp_path: Path, prepare: str, expected: str
) -> None:
    path = tmp_path / "fleet.sqlite"
    engine = db.make_engine(f"sqlite:///{path}")
    for statement in prepare.split("; "):
        if statement == "UPGRADE":
            db.upgrade(engine)
        else:
            with engine.begin() as connection:
                connection.execute(text(statement))
    result = run("--config", str(write_config(tmp_path, path)))
    assert result.returncode == 3
    assert expected in result.stderr
    if expected == "has no gpufleet schema":
        assert "gpufleet-controller upgrade-db" in result.stderr


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    result = run("--config", str(tmp_path / "nope.py"))
    assert result.returncode == 1
    assert "nope.py does not exist" in result.stderr


def test_a_bad_project_declaration_stops_start_up_with_what_to_fix(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    config.write_text(
        config.read_text()
        + "c.FleetController.projects = [{'name': 'vision', 'parent': 'research'}]\n"
    )
    result = run("--config", str(config))
    assert result.returncode == 2
    assert "c.FleetController.projects: project 'vision' names parent 'research'" in (result.stderr)


@pytest.mark.parametrize(
    ("clusters", "expected"),
    [
        (
            "[{'name': 'east', 'kubeconfig': '/nonexistent/east.yaml'}]",
            "c.FleetController.clusters: cluster 'east': kubeconfig /nonexistent/east.yaml "
            "does not exist or is not a file",
        ),
        (
            "[{'name': 'east', 'kubeconfig': KUBECONFIG, 'context': 'nope'}]",
            "c.FleetController.clusters: cluster 'east': cannot load",
        ),
        (
            "[{'name': 'east', 'kubeconfig': KUBECONFIG, 'gpu_resourse': 'nvidia.com/gpu'}]",
            "cluster 'east': gpu_resourse: unknown key",
        ),
    ],
)
def test_a_cluster_that_cannot_be_used_stops_the_start_naming_it(
    tmp_path: Path, clusters: str, expected: str
) -> None:
    kubeconfig = tmp_path / "east.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: east\n"
        "clusters: [{name: east, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: east, context: {cluster: east, user: u}}]\n"
    )
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    with config.open("a") as f:
        f.write(f"KUBECONFIG = {str(kubeconfig)!r}\nc.FleetController.clusters = {clusters}\n")
    result = run("--config", str(config))
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert not (tmp_path / "fleet.sqlite").exists()  # nothing made before the refusal


def test_a_bad_recovery_spares_entry_stops_start_up_with_what_to_fix(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    config.write_text(config.read_text() + "c.FleetController.recovery_spares = {'zone-a': -1}\n")
    result = run("--config", str(config))
    assert result.returncode != 0
    assert "recovery_spares['zone-a'] must be a whole number of nodes" in result.stderr
