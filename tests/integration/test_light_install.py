"""``pip install gpufleet`` without extras, as a researcher installs it on a laptop: a fresh
virtual environment, a regular (non-editable) install of this checkout, and nothing of the
server side in it. The SDK, the CLI and the wire contract import; the commands that need
the server parts say which extra to install instead of failing with a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.network]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What a checkout holds that is no part of the distribution (tests/unit/test_packaging.py).
NOT_SHIPPED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "node_modules", "build", "*.egg-info", "labextension"
)


def distribution(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503): "psycopg[binary]>=3.2"
    -> "psycopg"."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


SERVER = {distribution(r) for r in CONFIG["project"]["optional-dependencies"]["server"]}


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with this checkout installed without extras; its bin/.

    pip builds from a copy: a build in the checkout itself would write its build/ and
    egg-info beside the strict editable install's link tree."""
    base = tmp_path_factory.mktemp("light")
    tree = base / "checkout"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    folders = {f.split("/")[0] for f in CONFIG["tool"]["setuptools"]["package-dir"].values()}
    for folder in folders | {"share"}:
        shutil.copytree(ROOT / folder, tree / folder, ignore=NOT_SHIPPED)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", str(tree)],
        env=outside_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return venv / "bin"


def outside_env() -> dict[str, str]:
    """This shell's environment without what points into the test's own venv or a
    controller."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    return {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("GPUFLEET", "JUPYTERHUB"))
    }


def run(light: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = outside_env() | {"PATH": f"{light}:{os.environ.get('PATH', '')}", "COLUMNS": "200"}
    return subprocess.run(
        [str(light / argv[0]), *argv[1:]],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_light_install_holds_no_server_dependency(light: Path, tmp_path: Path) -> None:
    listed = run(light, "python", "-m", "pip", "list", "--format=json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    installed = {distribution(d["name"]) for d in json.loads(listed.stdout)}
    assert {"gpufleet", "httpx", "pydantic", "rich"} <= installed
    assert {"jupyterhub", "sqlalchemy", "tornado", "boto3"} <= SERVER
    assert installed & SERVER == set()


def test_the_sdk_the_cli_and_the_wire_contract_import_and_run(light: Path, tmp_path: Path) -> None:
    helped = run(light, "gpufleet", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "submit" in helped.stdout and "nodes" in helped.stdout
    code = (
        "from gpufleet.client import Client\n"
        "from gpufleet.api.events import EventKind\n"
        "import gpufleet, gpufleet.cli, gpufleet.reporting\n"
        "print(Client.__name__, EventKind.SESSION_CULL)\n"
    )
    imported = run(light, "python", "-c", code, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.split() == ["Client", "session-cull"]
    # Without a controller to reach, a command says what to set, not a traceback.
    nodes = run(light, "gpufleet", "nodes", cwd=tmp_path)
    assert nodes.returncode != 0 and "Traceback" not in nodes.stderr
    assert "GPUFLEET_HUB_URL" in nodes.stderr


def test_commands_that_need_the_server_parts_name_the_extra(light: Path, tmp_path: Path) -> None:
    extra = "pip install 'gpufleet[server]'"
    snapshot = run(
        light,
        *("gpufleet", "snapshot", "--store", str(tmp_path), "--key-file", str(tmp_path / "k")),
        *("--project", "vision", "list"),
        cwd=tmp_path,
    )
    assert snapshot.returncode == 1, snapshot.stderr
    assert "Traceback" not in snapshot.stderr
    assert "gpufleet snapshot needs the server extra" in snapshot.stderr
    assert extra in snapshot.stderr
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,submit_s,duration_s,num_gpus,group\n")
    simulate = run(light, "gpufleet", "simulate", "--fleet", "fleet.yaml", str(trace), cwd=tmp_path)
    assert simulate.returncode == 1, simulate.stderr
    assert "Traceback" not in simulate.stderr and extra in simulate.stderr
