"""The ``gpufleet`` command from outside any session, as docs/jobs.md tells a researcher to
use it: the hub's public URL and a token made on the hub's Token page with
``custom:gpufleet:use`` alone, nothing else in the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import Hub

pytestmark = pytest.mark.integration

GPUFLEET = Path(sys.executable).parent / "gpufleet"


def token_page_token(hub: Hub, username: str, scopes: list[str]) -> str:
    """What the Token page's form sends for the user (note, expiry, permissions)."""
    response = hub.hub_api(
        "POST",
        f"/users/{username}/tokens",
        json={"note": "my laptop", "expires_in": 3600, "scopes": scopes},
    )
    response.raise_for_status()
    return str(response.json()["token"])


def outside(hub: Hub, token: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command in a shell that no session set up: no JupyterHub or gpufleet variable
    but the two the researcher exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    env.update(GPUFLEET_HUB_URL=hub.url, GPUFLEET_TOKEN=token, COLUMNS="200")
    return subprocess.run(
        [str(GPUFLEET), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=180
    )


def test_a_researcher_submits_and_follows_a_job_from_their_own_shell(
    fleet: Hub, tmp_path: Path
) -> None:
    token = token_page_token(fleet, "bob", ["custom:gpufleet:use"])
    nodes = outside(fleet, token, "nodes", cwd=tmp_path)
    assert nodes.returncode == 0, nodes.stderr
    assert "gpu-node-a" in nodes.stdout
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'trained')\n")
    submitted = outside(
        fleet,
        token,
        *("submit", "--gpus", "1", "--gpu-type", "A100-80GB", "--project", "vision"),
        *("--name", "from-a-laptop", "--wait", str(script)),
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "succeeded" in submitted.stdout
    job = submitted.stdout.split()[1]
    logs = outside(fleet, token, "logs", job, cwd=tmp_path)
    assert logs.returncode == 0 and logs.stdout.strip() == "rank 0 trained", logs.stderr
    # The token acts for bob alone, with a researcher's rights.
    refused = outside(fleet, token, "cordon", "gpu-node-a", cwd=tmp_path)
    assert refused.returncode == 3
    assert "custom:gpufleet:admin" in refused.stderr


def test_a_token_without_gpufleets_scope_is_told_which_it_needs(fleet: Hub, tmp_path: Path) -> None:
    token = token_page_token(fleet, "bob", ["read:users:name!user=bob"])
    refused = outside(fleet, token, "jobs", cwd=tmp_path)
    assert refused.returncode == 3
    assert "custom:gpufleet:use" in refused.stderr
