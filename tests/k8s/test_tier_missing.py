"""Without its binaries the tier never passes silently: a skip naming the install command,
or under CI=true a failure. (Runs pytest on one tier test in two subprocesses at once,
pointed at an empty binaries folder; needs no tier itself.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .control_plane import BIN_ENV, REPO_ROOT

ONE_TIER_TEST = "tests/k8s/test_tier_access.py::test_each_api_server_answers_its_own_tokens"
# Only the tier's own conftest and the plugins it needs: the suite's root conftest and the
# other installed plugins (Playwright, Hypothesis, Schemathesis …) cost seconds of start-up
# that this check does not need.
FAST = ("--confcutdir", "tests/k8s", "-p", "asyncio", "-p", "timeout")


def _start_without_tier(tmp_path: Path, ci: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rsE",
            "-p",
            "no:cacheprovider",
            *FAST,
            ONE_TIER_TEST,
        ],
        cwd=REPO_ROOT,
        env={**os.environ, BIN_ENV: str(tmp_path), "CI": ci, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_missing_tier_is_a_skip_naming_the_install_command_or_fails_under_ci(
    tmp_path: Path,
) -> None:
    runs = {ci: _start_without_tier(tmp_path, ci) for ci in ("", "true")}
    try:
        out = {ci: proc.communicate(timeout=120)[0] for ci, proc in runs.items()}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert runs[""].returncode == 0, out[""]
    assert "1 skipped" in out[""]
    assert "scripts/install --k8s" in out[""]

    assert runs["true"].returncode != 0, out["true"]
    assert "1 error" in out["true"]
    assert "CI=true" in out["true"]
    assert "scripts/install --k8s" in out["true"]
