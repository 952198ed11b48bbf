"""The idle culler end to end: a real hub, controller, node agent, sandboxed sessions and
snapshots, on a fleet of 8 fake GPUs (two nodes of 4).

vision culls idle sessions (``always``, 20 s, a 10 s warning); nlp only marks them
(``on-demand``): ``conftest.CULLER_CONFIG``. What a researcher would see: an idle session
is warned, snapshotted, stopped, and a queued session gets its GPUs; a session whose GPUs
work, or whose kernel runs code, is left alone; an on-demand session is only stopped when
someone waits; the next start finds the files, a pip-installed package and a real conda
environment created under /opt as they were; a session whose live snapshot fails keeps
running.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.client import Client
from gpufleet.recovery.fake_nvml import write_control

from ..s3server import S3Server
from .conftest import CULLER_CONFIG
from .harness import REPO, Hub, run_in_kernel, wait_for
from .test_agent import DECLARED, declared_fake_gpus

pytestmark = pytest.mark.integration

# Run in the session (its kernel starts it as a process: rattler needs its own event loop).
# A file in the home; a wheel pip-installs into the session's own Python, outside the home;
# a real conda environment (tests/condaenv.py, whose source the script carries: the session
# cannot see the checkout; a local channel, solved and installed by rattler, which the
# tests' sessions' base environment has) in the session's own environment prefix under
# /opt, listed in ~/.conda/environments.txt as conda does.
CONDA_TEST_ROOT = "/opt/gpufleet/env/conda-test"
SETUP_SCRIPT = f"""
import pathlib, subprocess, sys, tempfile
helpers = pathlib.Path(tempfile.mkdtemp())
(helpers / "condaenv.py").write_text({(REPO / "tests" / "condaenv.py").read_text()!r})
sys.path.insert(0, str(helpers))
from condaenv import build_wheel, create_env, demo_packages, make_channel
home = pathlib.Path.home()
(home / "notes.txt").write_text("results of run 7")
wheel = build_wheel(home / "wheels")
subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                "--disable-pip-version-check", "--no-cache-dir", str(wheel)], check=True)
work = pathlib.Path({CONDA_TEST_ROOT!r})
channel = make_channel(work / "channel", demo_packages())
env = work / "envs" / "demo"
create_env(channel, env, ["gpufleet-hello"], work / "pkgs")
(home / ".conda").mkdir(exist_ok=True)
(home / ".conda" / "environments.txt").write_text(str(env) + "\\n")
"""

WRITE_STATE = f"""
import subprocess, sys
done = subprocess.run([sys.executable, "-c", {SETUP_SCRIPT!r}], capture_output=True, text=True)
tail = "exit %d: %s %s" % (done.returncode, done.stdout[-1500:], done.stderr[-1500:])
print("written" if done.returncode == 0 else tail)  # the exit code too: a kill has no stderr
"""

READ_STATE = f"""
import pathlib, subprocess
import gpufleet_tiny
print((pathlib.Path.home() / "notes.txt").read_text(), end="|")
print(gpufleet_tiny.__version__, end="|")
hello = subprocess.run(["{CONDA_TEST_ROOT}/envs/demo/bin/hello"], capture_output=True, text=True)
print(hello.stdout.strip(), hello.returncode)
"""


@pytest.fixture
def hub(culling_hub: Hub) -> Iterator[Hub]:
    yield culling_hub
    write_control(culling_hub.fake_nvml_control, declared_fake_gpus(DECLARED))
    culling_hub.stop_all_servers()


def events(hub: Hub, workload_id: int) -> list[dict[str, Any]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e.get("workload_id") == workload_id]


def kinds(hub: Hub, workload_id: int) -> list[str]:
    return [e["kind"] for e in sorted(events(hub, workload_id), key=lambda e: e["id"])]


def culler_rounds(hub: Hub) -> float:
    text = httpx.get(f"{hub.url}/services/gpufleet/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpufleet_culler_rounds_total":
                return float(sample.value)
    return 0.0


def busy_gpus(hub: Hub, uuids: list[str]) -> None:
    gpus = declared_fake_gpus(DECLARED)
    for gpu in gpus:
        if gpu.uuid in uuids:
            gpu.utilization_gpu = 90
    write_control(hub.fake_nvml_control, gpus)


def stored_keys(s3_server: S3Server) -> list[str]:
    """What the culler's bucket on the S3 server holds (``conftest.culling_hub``)."""
    client = s3_server.client()
    buckets = client.list_buckets()["Buckets"]
    (bucket,) = [b["Name"] for b in buckets if b["Name"].startswith("culler-")]
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_an_idle_session_is_warned_snapshotted_stopped_and_its_gpus_go_to_the_queue(
    hub: Hub, s3_server: S3Server
) -> None:
    """About 60 s: alice's 20 s of idleness, her live and final snapshots to the S3
    server, bob's session on her GPUs, then alice back with her files, packages and conda
    environment restored. One story: split, each part would start its own sessions and
    wait out the same idle time again."""
    began = datetime.now(UTC)
    # carol's GPUs work (fake NVML says 90%) from the moment they are hers, before her
    # server is up (a slow start on a busy machine must not count as idle time): her
    # session stays, whatever else it does.
    hub.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=4)
    placed = wait_for(
        lambda: (w := hub.workload_of("carol")) and w["allocations"] and w,
        60,
        "carol's GPUs",
    )
    busy_gpus(hub, [a["uuid"] for a in placed["allocations"]])
    hub.wait_ready("carol")
    carol = hub.workload_of("carol")
    assert carol is not None
    # alice's idle time runs from here: only bob's request comes before it ends (on a busy
    # machine, a session start takes a good part of the 20 s).
    alice = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    token = hub.user_token("alice")
    assert run_in_kernel(hub, "alice", "", WRITE_STATE, token).strip() == "written"
    # bob asks for vision's 4 GPUs, which alice holds: he waits.
    hub.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=4)
    waiting = wait_for(lambda: hub.workload_of("bob"), 30, "bob's request")
    assert waiting["state"] == "pending"

    # alice is warned first, with the time of the stop; then snapshotted and stopped.
    warning = wait_for(
        lambda: [e for e in events(hub, alice["id"]) if e["kind"] == "session-idle-warning"],
        60,
        "the idle warning",
    )[0]
    assert "idle for" in warning["message"] and "snapshotted and stopped at" in warning["message"]
    ended = hub.wait_ended(alice, 90)
    assert ended["outcome"] == "stopped"
    # The live snapshot is taken while the warning stands, so the stop comes at its time.
    order = kinds(hub, alice["id"])
    assert order.index("session-idle-warning") < order.index("session-snapshot")
    assert order.index("session-snapshot") < order.index("session-cull") < order.index("ended")
    # Its snapshot is on the S3 server: a manifest of alice's in vision's repository.
    keys = stored_keys(s3_server)
    assert any(k.startswith("snapshots/projects/vision/snapshots/alice/") for k in keys), keys
    # ... and in alice's list of snapshots within seconds (a session's end refreshes it).
    with Client(hub.controller_api, hub.user_token("alice")) as sdk:
        listed = wait_for(
            lambda: [s for s in sdk.snapshots() if s.created_at >= began],
            30,
            "alice's snapshot in the index",
        )
    assert listed[0].username == "alice" and listed[0].file_count > 0
    hub.wait_ready("bob", timeout=90)
    bob = hub.workload_of("bob")
    assert bob is not None and bob["state"] == "running"
    assert {a["uuid"] for a in bob["allocations"]} == {a["uuid"] for a in alice["allocations"]}

    # carol, whose GPUs work, was neither warned nor stopped.
    assert hub.workload_of("carol") is not None
    assert not {"session-idle-warning", "session-marked-idle", "session-cull"} & set(
        kinds(hub, carol["id"])
    )

    # alice comes back (bob leaves first: vision's quota is 4): everything is there.
    hub.stop_server("bob")
    hub.wait_gone("bob")
    hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    hub.wait_ready("alice", timeout=120)
    token = hub.user_token("alice")
    # The session tells her what happened (its extension shows this notice in JupyterLab)
    # for as long as it runs, beside the culler's warnings (here 10 s after the start).
    again = hub.workload_of("alice")
    assert again is not None
    notices = hub.controller("GET", f"/sessions/{again['id']}/activity", token=token).json()
    [message] = [n["message"] for n in notices["notices"] if n["level"] == "info"]
    restored = run_in_kernel(hub, "alice", "", READ_STATE, token)
    assert restored.strip() == "results of run 7|0.4.2|hello from a conda env 0"
    assert message.startswith("Culled at ") and "idle for" in message
    # What came back, in words (no snapshot id): the overlay, emptied at the stop, which
    # held the pip-installed package and the conda environment under /opt (the home stays
    # on the node).
    assert re.search(
        r"Stopped at \d\d:\d\d UTC on \d\d \w{3} and restored from snapshot: the packages "
        r"you installed and other system changes\. Kernels were restarted\.$",
        message,
    ), message


def test_on_demand_marks_an_idle_session_and_stops_it_only_when_someone_waits(
    hub: Hub,
) -> None:
    carol = hub.start_session("carol", project="nlp", gpu_type="A100-80GB", gpus=4)
    marked = wait_for(
        lambda: [e for e in events(hub, carol["id"]) if e["kind"] == "session-marked-idle"],
        60,
        "carol's session marked idle",
    )
    assert "idle for" in marked[0]["message"]
    # Nobody waits: marked, not stopped, for five more culler rounds.
    after_mark = kinds(hub, carol["id"])
    first = culler_rounds(hub)
    wait_for(lambda: culler_rounds(hub) >= first + 5, 60, "five more culler rounds")
    assert hub.workload_of("carol") is not None
    assert "session-cull" not in kinds(hub, carol["id"]) and after_mark == kinds(hub, carol["id"])

    # vision fills its 4, then wants 4 more than the free 0: carol's idle session makes room.
    hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    hub.wait_ready("alice")
    hub.spawn("alice", "more", project="nlp", gpu_type="A100-80GB", gpus=4)
    ended = hub.wait_ended(carol, 90)
    assert ended["outcome"] == "preempted"
    hub.wait_ready("alice", "more", timeout=90)


def test_a_session_whose_live_snapshot_fails_keeps_running_until_a_pass_succeeds(
    hub: Hub,
) -> None:
    # The next snapshot process dies (SIGKILL) as it starts: the culler's live pass.
    (hub.data_dir / "failpoints" / "snapshot-create").touch()
    bob = hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    failed = wait_for(
        lambda: [e for e in events(hub, bob["id"]) if e["kind"] == "session-cull-failed"],
        60,
        "the failed cull",
    )
    assert "the live snapshot failed, so the session keeps running" in failed[0]["message"]
    running = hub.workload_of("bob")
    assert running is not None and running["state"] == "running"
    assert (hub.server_model("bob") or {}).get("ready")
    # Tried again after cull_retry_seconds: this time it is snapshotted and stopped.
    ended = hub.wait_ended(bob, 90)
    assert ended["outcome"] == "stopped"
    assert "session-snapshot" in kinds(hub, bob["id"])


def test_a_kernel_running_code_keeps_its_session_whatever_the_browser_does(hub: Hub) -> None:
    bob = hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    token = hub.user_token("bob")
    # A long silent cell: no output, no browser, only the session extension's "busy".
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(
            run_in_kernel, hub, "bob", "", "import time; time.sleep(45); print('done')", token
        )
        started = time.monotonic()
        # Past the 20 s time-out and its warning, round after round: never warned.
        wait_for(lambda: time.monotonic() - started > 32, 60, "the time-out to pass, kernel busy")
        rounds = culler_rounds(hub)  # earlier tests' rounds count too: two more from here
        wait_for(lambda: culler_rounds(hub) >= rounds + 2, 30, "two culler rounds past it")
        assert not {"session-idle-warning", "session-cull"} & set(kinds(hub, bob["id"]))
        assert (hub.workload_of("bob") or {}).get("state") == "running"
        assert running.result(timeout=60).strip() == "done"


def test_a_failing_final_snapshot_keeps_the_gpus_until_a_retry_commits_it(hub: Hub) -> None:
    bob = hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    failpoint = hub.data_dir / "failpoints" / "snapshot-create"
    failpoint.touch()  # the next snapshot process dies as it starts: the final pass
    hub.stop_server("bob")
    hub.wait_gone("bob")
    for _ in range(2):  # it fails, and fails again when retried: the GPUs stay bob's
        wait_for(lambda: not failpoint.exists(), 60, "a final pass that dies")
        held = hub.controller("GET", f"/workloads/{bob['id']}").json()
        assert held["state"] == "running" and len(held["allocations"]) == 2
        failpoint.touch()
    wait_for(lambda: not failpoint.exists(), 60, "the last failing pass")
    ended = hub.wait_ended(bob, 60)  # the next retry commits, then they are released
    assert ended["outcome"] == "stopped" and "final snapshot" in ended["reason"]


def test_an_admin_may_release_the_gpus_of_a_session_whose_final_snapshot_keeps_failing(
    hub: Hub,
) -> None:
    bob = hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    failpoint = hub.data_dir / "failpoints" / "snapshot-create"
    failpoint.touch()
    hub.stop_server("bob")
    hub.wait_gone("bob")
    wait_for(lambda: not failpoint.exists(), 60, "a final pass that dies")
    failpoint.touch()  # and every retry dies too, until the admin acts
    held = wait_for(
        lambda: [e for e in events(hub, bob["id"]) if e["kind"] == "session-final-snapshot-failed"],
        30,
        "the event saying the GPUs are held",
    )
    assert "an admin may release them" in held[0]["message"]
    assert hub.controller("GET", f"/workloads/{bob['id']}").json()["state"] == "running"

    released = hub.controller(
        "POST",
        f"/workloads/{bob['id']}/release",
        json={"outcome": "stopped", "message": "released by the admin: the disk is full"},
    )
    assert released.status_code == 200, released.text
    ended = hub.wait_ended(bob, 30)
    assert ended["reason"] == "released by the admin: the disk is full"
    # The GPUs are free again: vision's whole quota (4) goes to another session.
    hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    hub.wait_ready("alice", timeout=90)
    # The spawner stops retrying (it would otherwise release a workload that has ended).
    wait_for(
        lambda: "its final snapshot is no longer retried" in hub.log_path.read_text(),
        30,
        "the spawner to give up the retries",
    )
    failpoint.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def unsandboxed_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """The culler's hub with its sessions in the read-only sandbox, as on a machine that
    allows no overlay: a session's home stays on the host when the culler stops it."""
    config = CULLER_CONFIG + 'c.LocalGPUSpawner.sandbox = "readonly"\n'
    instance = Hub.create(tmp_path_factory.mktemp("unsandboxed"), config)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


def test_a_session_culled_without_an_overlay_is_told_so_when_it_comes_back(
    unsandboxed_hub: Hub,
) -> None:
    hub = unsandboxed_hub
    alice = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    assert hub.wait_ended(alice, 90)["outcome"] == "stopped"
    assert "session-cull" in kinds(hub, alice["id"])
    hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    hub.wait_ready("alice", timeout=120)
    again = hub.workload_of("alice")
    assert again is not None
    token = hub.user_token("alice")
    notices = hub.controller("GET", f"/sessions/{again['id']}/activity", token=token).json()
    # Nothing had to be restored (its home never left the host), yet it was stopped. (The
    # culler's warning may stand beside it by now: this hub's time-out is 20 s.)
    (notice,) = [n for n in notices["notices"] if n["level"] == "info"]
    assert notice["message"].startswith("Culled at ") and "idle for" in notice["message"]
    assert notice["message"].endswith("Kernels were restarted.")
    hub.stop_all_servers()
