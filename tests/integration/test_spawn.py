"""Spawning GPU sessions through the hub's REST API: placement, isolation, queueing."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import Hub, host_pid, pids_with_env, run_in_kernel, server_environ, wait_for

pytestmark = pytest.mark.integration

GPU_PROBE = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'])"


def kernel_gpus(hub: Hub, username: str, server: str = "") -> tuple[list[str], str]:
    token = hub.user_token(username)
    devices, order = run_in_kernel(hub, username, server, GPU_PROBE, token).split()
    return devices.split(","), order


NVML_PROBE = (
    "import pynvml; pynvml.nvmlInit(); "
    "print(','.join(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) "
    "for i in range(pynvml.nvmlDeviceGetCount())))"
)


def nvml_gpus(hub: Hub, username: str) -> list[str]:
    output = run_in_kernel(hub, username, "", NVML_PROBE, hub.user_token(username))
    return output.strip().split(",")


@pytest.mark.smoke
def test_two_sessions_see_exactly_their_own_gpus(fleet: Hub) -> None:
    assert fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2).status_code in (
        201,
        202,
    )
    assert fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus="2").status_code in (
        201,
        202,
    )
    fleet.wait_ready("alice")
    fleet.wait_ready("carol")

    alice = fleet.workload_of("alice")
    carol = fleet.workload_of("carol")
    assert alice and carol and alice["state"] == carol["state"] == "running"
    alice_uuids = [a["uuid"] for a in alice["allocations"]]
    carol_uuids = [a["uuid"] for a in carol["allocations"]]
    assert len(alice_uuids) == len(carol_uuids) == 2
    assert not set(alice_uuids) & set(carol_uuids)

    devices, order = kernel_gpus(fleet, "alice")
    assert devices == alice_uuids
    assert order == "PCI_BUS_ID"
    assert kernel_gpus(fleet, "carol")[0] == carol_uuids
    # NVML inside the session (here the fake library, as a container would) shows the same.
    assert nvml_gpus(fleet, "alice") == alice_uuids
    assert nvml_gpus(fleet, "carol") == carol_uuids


def test_named_servers_hold_separate_gpus(fleet: Hub) -> None:
    fleet.spawn("bob", "one", project="vision", gpu_type="A100-80GB", gpus=1)
    fleet.spawn("bob", "two", project="vision", gpu_type="A100-80GB", gpus=1)
    one = fleet.wait_ready("bob", "one")
    two = fleet.wait_ready("bob", "two")
    assert one["name"] == "one" and two["name"] == "two"
    gpus_one = kernel_gpus(fleet, "bob", "one")[0]
    gpus_two = kernel_gpus(fleet, "bob", "two")[0]
    assert len(gpus_one) == len(gpus_two) == 1
    assert gpus_one != gpus_two


def test_second_user_queues_while_quota_is_full_and_starts_when_it_frees(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("alice")
    assert fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2).status_code in (
        201,
        202,
    )  # the hub answers 201 or 202 for a spawn still pending after 10 s

    waiting = wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["queue_position"] == 1 and w,
        30,
        "bob's request queued",
    )
    assert waiting["state"] == "pending"
    assert waiting["reason"] == (
        "Waiting for project vision's GPUs to free up: needs 2 × A100-80GB, project vision "
        "uses 4/4 guaranteed A100-80GB and may borrow 0 more"
    )
    model = fleet.server_model("bob")
    assert model is not None and model["pending"] == "spawn"

    fleet.stop_server("alice")
    fleet.wait_ready("bob", timeout=60)
    started = fleet.workload_of("bob")
    assert started is not None and started["state"] == "running"


def test_cancelling_a_queued_spawn_frees_its_place(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("alice")
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    bob = wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["queue_position"] and w, 30, "bob queued"
    )
    fleet.spawn("alice", "second", project="vision", gpu_type="A100-80GB", gpus=1)
    wait_for(
        lambda: (w := fleet.workload_of("alice", "second")) and w["queue_position"] == 2,
        30,
        "alice's second server queued behind bob",
    )

    fleet.stop_server("bob")
    ended = fleet.wait_ended(bob, 30)
    assert ended["outcome"] == "withdrawn"
    wait_for(
        lambda: (w := fleet.workload_of("alice", "second")) and w["queue_position"] == 1,
        30,
        "alice's second server moved up to position 1",
    )
    fleet.wait_gone("bob")


def test_stopping_releases_gpus_only_after_every_process_is_gone(fleet: Hub) -> None:
    fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("carol")
    workload = fleet.workload_of("carol")
    assert workload is not None
    token = fleet.user_token("carol")
    marker = run_in_kernel(
        fleet, "carol", "", "import os; print(os.environ['GPUFLEET_SESSION_MARKER'])", token
    ).strip()
    # A process in a session of its own (as kernels are): it must be gone before the GPU is
    # released. Its pid is the session's; a sandboxed session has a pid namespace of its own.
    leftover = host_pid(
        int(
            run_in_kernel(
                fleet,
                "carol",
                "",
                "import subprocess; p = subprocess.Popen(['sleep', '600'], start_new_session=True);"
                " print(p.pid)",
                token,
            )
        ),
        marker,
    )
    assert server_environ(leftover)["GPUFLEET_WORKLOAD_ID"] == str(workload["id"])
    assert server_environ(leftover)["GPUFLEET_SESSION_MARKER"] == marker

    fleet.stop_server("carol")
    ended = fleet.wait_ended(workload, 60)
    assert ended["outcome"] == "stopped"
    for pid in pids_with_env("GPUFLEET_SESSION_MARKER", marker):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"process {pid} of the session still runs after release"
