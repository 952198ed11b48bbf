"""Which sessions' base environment a checkout builds and runs from: its own, so one
checkout's install or test run never rewrites what another checkout's sessions run from."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from traitlets.config import Config

from gpufleet.hub.setup import configure
from gpufleet.snapshotter.sandbox import checkout_session_env, default_session_env

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "scripts" / "build-session-env"


def checkout(where: Path) -> Path:
    """A checkout with the build script (enough for --print-target, which builds nothing)."""
    (where / "scripts").mkdir(parents=True)
    shutil.copy2(BUILD, where / "scripts" / "build-session-env")
    return where


def target(root: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "GPUFLEET_SESSION_ENV"}
    done = subprocess.run(
        [str(root / "scripts" / "build-session-env"), "--print-target"],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_each_checkout_builds_its_own_environment_outside_it(tmp_path: Path) -> None:
    demo = checkout(tmp_path / "gpufleet")
    other = checkout(tmp_path / "elsewhere" / "gpufleet")
    mine, theirs = target(demo), target(other)
    assert mine != theirs  # same folder name, another checkout
    assert mine.startswith("/opt/gpufleet/session-env-gpufleet-")
    assert theirs.startswith("/opt/gpufleet/session-env-gpufleet-")
    # The same checkout reached through a link is the same checkout.
    (tmp_path / "link").symlink_to(demo)
    assert target(tmp_path / "link") == mine
    # Named, it is the one named.
    assert target(demo, GPUFLEET_SESSION_ENV="/srv/env") == "/srv/env"


def test_a_checkout_runs_from_where_its_link_points(tmp_path: Path) -> None:
    built = tmp_path / "opt" / "session-env-x-1234"
    built.mkdir(parents=True)
    (tmp_path / "co" / ".tools").mkdir(parents=True)
    assert checkout_session_env(tmp_path / "co") == str(tmp_path / "co/.tools/session-env")
    (tmp_path / "co" / ".tools" / "session-env").symlink_to(built)
    # The real path: a sandbox binds the environment where it really is.
    assert checkout_session_env(tmp_path / "co") == str(built)


def test_this_development_install_uses_its_checkouts_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUFLEET_SESSION_ENV", raising=False)
    assert default_session_env() == os.path.realpath(ROOT / ".tools" / "session-env")
    assert default_session_env() != "/opt/gpufleet/session-env"
    monkeypatch.setenv("GPUFLEET_SESSION_ENV", "/srv/env")
    assert default_session_env() == "/srv/env"


def test_the_hub_gives_its_agent_the_environment_it_gives_its_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GPUFLEET_SESSION_ENV", "/srv/env")
    c = Config()
    configure(c, str(ROOT / "jupyterhub_config.py"))
    managed = [s for s in c.JupyterHub.services if "command" in s]
    assert managed and all(s["environment"]["GPUFLEET_SESSION_ENV"] == "/srv/env" for s in managed)
