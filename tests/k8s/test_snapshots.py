"""Cull and resume on Kubernetes, end to end: a real hub, proxy and controller with the
KubeGPUSpawner, the tier's clusters and test kubelets, and gpufleet's node agent running
the snapshot passes and restores of the tier's nodes (they are all on this machine, so one
agent serves the three: ``c.NodeAgent.operation_nodes``).

alice's home is a hostPath volume on her node. She writes a file, creates a virtual
environment in her home and installs a package into it, and installs the same package
outside her home, into her container's layer. Idle, she is warned, her
session is snapshotted by the agent on its node, her pod deleted and her GPUs go to bob,
who waited. Her node's copy of her home is then wiped (as when the session comes back on
another node); her next start restores it before the pod is made, and the package works.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..integration.harness import REPO, Hub, run_in_kernel, wait_for
from .control_plane import ControlPlane
from .hubs import make_kube_hub, node_homes_config
from .test_sessions import objects_of, pod_of, spawn_api
from .tier import TIER_NODES

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

SETUP = f"""
import pathlib, subprocess, sys, tempfile
helpers = pathlib.Path(tempfile.mkdtemp())
(helpers / "condaenv.py").write_text({(REPO / "tests" / "condaenv.py").read_text()!r})
sys.path.insert(0, str(helpers))
from condaenv import build_wheel
home = pathlib.Path.home()
(home / "notes.txt").write_text("results of run 7")
wheel = build_wheel(helpers / "wheels")
pip = ["-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
       "--disable-pip-version-check", "--no-cache-dir", str(wheel)]
subprocess.run([sys.executable, "-m", "venv", str(home / "envs" / "demo")], check=True)
subprocess.run([str(home / "envs" / "demo" / "bin" / "python"), *pip], check=True)
# Outside the volume: the container's layer (the session's own prefix in the image).
subprocess.run([sys.executable, *pip, "--target", "/opt/gpufleet/env/site"], check=True)
"""

WRITE_STATE = f"""
import subprocess, sys
done = subprocess.run([sys.executable, "-c", {SETUP!r}], capture_output=True, text=True)
errors = [line for line in done.stderr.splitlines() if "rror" in line][-3:]
tail = "exit %d: %s %s" % (done.returncode, done.stdout[-1500:], errors)
print("written" if done.returncode == 0 else tail)
"""

READ_STATE = """
import pathlib, subprocess
home = pathlib.Path.home()
print((home / "notes.txt").read_text(), end="|")
python = home / "envs" / "demo" / "bin" / "python"
done = subprocess.run([str(python), "-c", "import gpufleet_tiny; print(gpufleet_tiny.__version__)"],
                      capture_output=True, text=True)
print(done.stdout.strip() or done.stderr[-500:])
"""


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The nodes' directory of users' homes (root's; each home is its user's)."""
    made = Path(tmp_path_factory.mktemp("node-disk")) / "homes"
    made.mkdir(mode=0o755)
    return made


@pytest.fixture(scope="module")
def snapshot_hub(
    k8s_tier: ControlPlane, homes: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hub]:
    nodes = [spec.name for specs in TIER_NODES.values() for spec in specs]
    config = (
        node_homes_config(homes)
        + f"""
c.KubeGPUSpawner.final_snapshot_retry_seconds = 1
c.Culling.idle_policies = {{
    "default": {{"mode": "always", "idle_timeout_s": 20, "warn_before_s": 6}},
}}
c.Culling.interval = 1
c.Culling.retry_seconds = 3
# The agent serves no GPUs of this machine (the clusters' own are the fleet's); it runs
# the snapshot passes and restores of the tier's nodes.
c.NodeAgent.declared_nodes = []
c.NodeAgent.nvml = "off"
c.NodeAgent.placement_interval = 0
c.NodeAgent.operation_nodes = {nodes!r}
# The test kubelets are the runtime: their containers' layers are under their directory.
c.NodeAgent.container_layer_roots = [{str(k8s_tier.workdir / "kubelets")!r}]
"""
    )
    hub = make_kube_hub(k8s_tier, Path(tmp_path_factory.mktemp("snapshot-hub")), config)
    hub.start()
    try:
        yield hub
    finally:
        hub.stop_all_servers()
        hub.kill_everything()


def events(hub: Hub, workload_id: int) -> list[dict[str, Any]]:
    items = hub.controller("GET", "/events", params={"workload_id": workload_id}).json()["items"]
    return sorted(items, key=lambda e: e["id"])


def snapshot_command(hub: Hub, *args: str) -> Any:
    """``gpufleet snapshot --json ...`` on the hub's store, as an admin would run it."""
    done = subprocess.run(
        [
            str(Path(shutil.which("gpufleet") or "gpufleet")),
            "snapshot",
            "--json",
            "--store",
            str(hub.data_dir / "snapshots"),
            "--key-file",
            str(hub.data_dir / "snapshot-master.key"),
            "--project",
            "vision",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=hub.env,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return next(line for line in lines if line.get("event") == "done")


def test_an_idle_pod_is_snapshotted_on_its_node_culled_and_resumed_with_its_home_and_packages(
    snapshot_hub: Hub, k8s_tier: ControlPlane, homes: Path, tmp_path: Path
) -> None:
    hub = snapshot_hub
    spawn_api(hub, "alice", "", "vision", 4)
    hub.wait_ready("alice", timeout=180)
    alice = hub.workload_of("alice")
    assert alice is not None
    pod = pod_of(k8s_tier, alice)
    # The platform's snapshot secrets never enter the pod: no variable, no volume of them.
    container = pod["spec"]["containers"][0]
    names = {e["name"] for e in container.get("env", [])}
    assert not {n for n in names if "SNAPSHOT" in n or n.startswith("AWS_")}, names
    assert [v["hostPath"]["path"] for v in pod["spec"]["volumes"]] == [f"{homes}/alice"]
    token = hub.user_token("alice")
    assert run_in_kernel(hub, "alice", "", WRITE_STATE, token).strip() == "written"

    # bob asks for vision's 4 GPUs, which alice holds: he waits.
    spawn_api(hub, "bob", "", "vision", 4)
    waiting = wait_for(lambda: hub.workload_of("bob"), 30, "bob's request")
    assert waiting["state"] == "pending"

    ended = hub.wait_ended(alice, 150)
    assert ended["outcome"] == "stopped"
    assert "final snapshot" in ended["reason"] and "on the node" in ended["reason"]
    kinds = [e["kind"] for e in events(hub, alice["id"])]
    # The live pass is taken while the warning stands, so the cull comes at the time the
    # warning gave (docs/culler.md), and the session ends after it.
    assert kinds.index("session-idle-warning") < kinds.index("session-snapshot")
    assert kinds.index("session-snapshot") < kinds.index("session-cull") < kinds.index("ended")
    assert objects_of(k8s_tier, _cluster(alice), alice["id"], "pods") == []
    hub.wait_ready("bob", timeout=120)

    # The snapshots: the live pass and the one before the pod went hold the container's
    # layer (the package installed outside the home); the final one, the home.
    listed = snapshot_command(hub, "list", "--user", "alice")["snapshots"]
    tags = [tuple(s["tags"]) for s in listed]
    assert ("live",) in tags and ("stop",) in tags and tags[-1] == ("final",), tags
    layer = next(s for s in listed if s["tags"] == ["stop"])
    (overlay,) = [x for x in layer["sources"] if x["kind"] == "overlay"]
    target = tmp_path / "layer"
    snapshot_command(
        hub,
        "restore",
        layer["id"],
        "--source",
        overlay["name"],
        "--target",
        f"{overlay['name']}={target}",
    )
    assert (target / "opt/gpufleet/env/site/gpufleet_tiny/__init__.py").is_file()

    # Her node's copy of her home is gone (another node, a wiped disk): the next start
    # brings it back before the pod runs, and tells her.
    hub.stop_server("bob")
    hub.wait_gone("bob")
    shutil.rmtree(homes / "alice")
    spawn_api(hub, "alice", "", "vision", 4)
    hub.wait_ready("alice", timeout=180)
    token = hub.user_token("alice")
    restored = run_in_kernel(hub, "alice", "", READ_STATE, token)
    assert restored.strip() == "results of run 7|0.4.2"
    again = hub.workload_of("alice")
    assert again is not None
    notices = hub.controller("GET", f"/sessions/{again['id']}/activity", token=token).json()
    message = notices["notices"][0]["message"]
    assert message.startswith("Culled at ") and "restored from snapshot" in message, message


def _cluster(workload: dict[str, Any]) -> str:
    (cluster,) = {a["cluster"] for a in workload["allocations"]}
    return str(cluster)
