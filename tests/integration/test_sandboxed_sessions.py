"""Sessions in the overlay sandbox, through a real hub: changes land in the server's upper only,
and come back from its snapshot after a stop.

The hub's spawner runs with ``sandbox = "overlay"``. The sandbox's lower layer is the host's
real root file system, so the session deletes only a file this test made on the host for it
(and removes afterwards); everything else it writes has a random name.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.snapshotter.overlay import Change, ChangeKind, read_upper
from gpufleet.snapshotter.sandbox import probe

from .harness import Hub, pids_with_env, run_in_kernel

pytestmark = pytest.mark.integration

USER = "alice"


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = Path(tmp_path_factory.mktemp("sandboxed-hub"))
    support = probe(root)
    if not support.overlay:
        pytest.skip(f"no overlay sandbox on this machine ({support.mode.value}): {support.reason}")
    hub = Hub.create(root, extra_config='c.LocalGPUSpawner.sandbox = "overlay"\n')
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()
        # Sessions outlive their hub by design; a failed test must not leave one running.
        for pid in live(pids_with_env("GPUFLEET_SANDBOX_UPPER", str(upper_of(hub)))):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)


@pytest.fixture
def host_victim() -> Iterator[Path]:
    """A file on the host's root file system for the session to delete, removed afterwards."""
    base = Path("/var/tmp")  # not /tmp: the sandbox has a /tmp of its own
    if base.stat().st_dev != Path("/").stat().st_dev:
        pytest.skip("/var/tmp is not on the root file system, so not in the sandbox's overlay")
    where = base / f"gpufleet-test-{secrets.token_hex(6)}"
    where.mkdir()
    victim = where / "victim.txt"
    victim.write_text("still here\n")
    try:
        yield victim
    finally:
        shutil.rmtree(where, ignore_errors=True)


def upper_of(hub: Hub) -> Path:
    return hub.data_dir / "sessions" / USER / "default" / "upper"


def in_session(hub: Hub, code: str) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON object) in a new kernel of the user's server."""
    output = run_in_kernel(hub, USER, "", code, hub.user_token(USER))
    result: dict[str, Any] = json.loads(output)
    return result


def stored_state(hub: Hub) -> dict[str, Any]:
    user = hub.hub_api("GET", f"/users/{USER}", params={"include_stopped_servers": "1"}).json()
    state: dict[str, Any] = user["servers"][""]["state"]
    return state


def live(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_session_changes_land_in_its_upper_and_come_back_on_restart(
    sandboxed: Hub, host_victim: Path
) -> None:
    tag = secrets.token_hex(6)
    etc_file = Path(f"/etc/gpufleet-sandbox-test-{tag}")
    lib_file = Path(f"/usr/local/lib/gpufleet-x-{tag}/file")
    upper = upper_of(sandboxed)

    assert sandboxed.spawn(USER, project="vision", gpu_type="A100-80GB", gpus=2).status_code in (
        201,
        202,
    )
    sandboxed.wait_ready(USER, timeout=60)
    workload = sandboxed.workload_of(USER)
    assert workload is not None and workload["state"] == "running"
    inside = in_session(
        sandboxed,
        f"""
import json, os, pathlib
pathlib.Path({str(etc_file)!r}).write_text("sandboxed\\n")
lib = pathlib.Path({str(lib_file)!r})
lib.parent.mkdir()
lib.write_text("x\\n")
os.remove({str(host_victim)!r})
pathlib.Path(os.environ["HOME"], "home-{tag}.txt").write_text("home\\n")
print(json.dumps({{
    "home": os.environ["HOME"],
    "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
    "marker": os.environ["GPUFLEET_SESSION_MARKER"],
    "mode": os.environ["GPUFLEET_SANDBOX_MODE"],
    "upper": os.environ["GPUFLEET_SANDBOX_UPPER"],
    "victim_gone": not os.path.exists({str(host_victim)!r}),
}}))
""",
    )
    assert inside["gpus"].split(",") == [a["uuid"] for a in workload["allocations"]]
    assert inside["mode"].startswith("overlay-")
    assert inside["upper"] == str(upper)
    assert stored_state(sandboxed)["gpufleet_sandbox_upper"] == str(upper)
    assert inside["victim_gone"]

    # The host is unchanged, but for the home.
    assert not etc_file.exists()
    assert not lib_file.parent.exists()
    assert host_victim.read_text() == "still here\n"
    assert (Path(inside["home"]) / f"home-{tag}.txt").read_text() == "home\n"

    written = {
        Change(str(etc_file.relative_to("/")), ChangeKind.PRESENT),
        Change(str(lib_file.relative_to("/")), ChangeKind.PRESENT),
        Change(str(host_victim.relative_to("/")), ChangeKind.DELETED),
    }
    changes = set(read_upper(upper))
    assert written <= changes
    home = Path(inside["home"]).relative_to("/")
    assert not [c for c in changes if Path(c.path).is_relative_to(home) and c.path != str(home)]

    # Stopping ends every process of the session, then snapshots it: the snapshot holds
    # the container state, and the upper is emptied (free_upper_after_snapshot).
    sandboxed.stop_server(USER)
    ended = sandboxed.wait_ended(workload, 60)
    assert ended["outcome"] == "stopped" and "final snapshot" in ended["reason"]
    assert live(pids_with_env("GPUFLEET_SESSION_MARKER", inside["marker"])) == []
    assert live(pids_with_env("GPUFLEET_SANDBOX_UPPER", str(upper))) == []
    assert list(upper.iterdir()) == []
    assert stored_state(sandboxed)["gpufleet_sandbox_upper"] == str(upper)

    # The same server started again finds its changes: the snapshot restores its upper,
    # deletions (whiteouts) included.
    sandboxed.wait_gone(USER)
    sandboxed.spawn(USER, project="vision", gpu_type="A100-80GB", gpus=1)
    sandboxed.wait_ready(USER, timeout=60)
    again = in_session(
        sandboxed,
        f"""
import json, os, pathlib
print(json.dumps({{
    "etc": pathlib.Path({str(etc_file)!r}).read_text(),
    "lib": pathlib.Path({str(lib_file)!r}).read_text(),
    "victim_gone": not os.path.exists({str(host_victim)!r}),
    "tmp": sorted(os.listdir("/tmp")),
}}))
""",
    )
    assert again["etc"] == "sandboxed\n" and again["lib"] == "x\n"
    assert again["victim_gone"]
    assert not etc_file.exists()
    sandboxed.stop_server(USER)
    sandboxed.wait_gone(USER)
