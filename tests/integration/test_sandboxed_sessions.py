"""Sessions in the overlay sandbox, through a real hub: changes land in the server's upper only,
and come back from its snapshot after a stop.

The hub's spawner runs with ``sandbox = "overlay"``. The sandbox's lower layers are the host's
real /usr, /etc and /opt; the session runs as its own unprivileged uid, so what it can change
outside its home is its own environment, whose files have random names here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
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


def test_session_changes_land_in_its_upper_and_come_back_on_restart(sandboxed: Hub) -> None:
    tag = secrets.token_hex(6)
    upper = upper_of(sandboxed)

    assert sandboxed.spawn(USER, project="vision", gpu_type="A100-80GB", gpus=2).status_code in (
        201,
        202,
    )
    sandboxed.wait_ready(USER, timeout=60)
    workload = sandboxed.workload_of(USER)
    assert workload is not None and workload["state"] == "running"
    # What a researcher may change outside their home is their session's own environment:
    # a module installed into it, a file of its prefix. The host's /etc stays theirs to read.
    inside = in_session(
        sandboxed,
        f"""
import json, os, pathlib, site, sys
module = pathlib.Path(site.getsitepackages()[0], "gpufleet_probe_{tag}.py")
module.write_text("VALUE = 42\\n")
pathlib.Path(sys.prefix, "note-{tag}.txt").write_text("prefix\\n")
try:
    pathlib.Path("/etc/gpufleet-sandbox-test-{tag}").write_text("no")
    etc = "written"
except PermissionError:
    etc = "refused"
pathlib.Path(os.environ["HOME"], "home-{tag}.txt").write_text("home\\n")
print(json.dumps({{
    "home": os.environ["HOME"],
    "prefix": sys.prefix,
    "module": str(module),
    "etc": etc,
    "uid": os.getuid(),
    "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
    "marker": os.environ["GPUFLEET_SESSION_MARKER"],
    "mode": os.environ["GPUFLEET_SANDBOX_MODE"],
    "upper": os.environ["GPUFLEET_SANDBOX_UPPER"],
}}))
""",
    )
    assert inside["gpus"].split(",") == [a["uuid"] for a in workload["allocations"]]
    assert inside["mode"].startswith("overlay-")
    assert inside["upper"] == str(upper)
    assert inside["uid"] != 0 and inside["etc"] == "refused"
    assert inside["prefix"] == "/opt/gpufleet/env"
    assert stored_state(sandboxed)["gpufleet_sandbox_upper"] == str(upper)

    # The host is unchanged, but for the home.
    assert not Path(inside["module"]).exists()
    assert not Path(inside["prefix"], f"note-{tag}.txt").exists()
    assert (Path(inside["home"]) / f"home-{tag}.txt").read_text() == "home\n"

    written = {
        Change(str(Path(inside["module"]).relative_to("/")), ChangeKind.PRESENT),
        Change(f"opt/gpufleet/env/note-{tag}.txt", ChangeKind.PRESENT),
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

    # The same server started again finds its environment as it left it.
    sandboxed.wait_gone(USER)
    sandboxed.spawn(USER, project="vision", gpu_type="A100-80GB", gpus=1)
    sandboxed.wait_ready(USER, timeout=60)
    again = in_session(
        sandboxed,
        f"""
import json, os, pathlib, sys
import gpufleet_probe_{tag}
print(json.dumps({{
    "value": gpufleet_probe_{tag}.VALUE,
    "note": pathlib.Path(sys.prefix, "note-{tag}.txt").read_text(),
    "tmp": sorted(os.listdir("/tmp")),
}}))
""",
    )
    assert again["value"] == 42 and again["note"] == "prefix\n"
    sandboxed.stop_server(USER)
    sandboxed.wait_gone(USER)
