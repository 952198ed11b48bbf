"""The reconciler against a real hub: the database and what runs disagree, and it repairs.

The harness runs it every second with a 3 s grace (``harness.TEST_CONFIG``).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpufleet.recovery import processes

from .harness import Hub, wait_for

pytestmark = pytest.mark.integration


def process_marker(hub: Hub, workload_id: int) -> str:
    """The marker the controller recorded for the workload (its spawner sent it)."""
    db = sqlite3.connect(hub.data_dir / "gpufleet.sqlite")
    try:
        row = db.execute(
            "SELECT process_marker FROM workloads WHERE id = ?", (workload_id,)
        ).fetchone()
    finally:
        db.close()
    assert row is not None and row[0], f"workload {workload_id} has no process marker"
    return str(row[0])


def reconciled(hub: Hub, workload_id: int) -> list[dict[str, Any]]:
    """The workload's ``reconciled`` events, oldest first."""
    response = hub.controller("GET", "/events", params={"workload_id": workload_id})
    response.raise_for_status()
    items = [e for e in response.json()["items"] if e["kind"] == "reconciled"]
    return items[::-1]


def free_gpus(hub: Hub) -> int:
    return sum(n["free_gpus"] for n in hub.controller("GET", "/nodes").json()["items"])


@contextmanager
def marked_sleep(marker: str, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process carrying ``marker``, in a session of its own (as a kernel is)."""
    proc = subprocess.Popen(
        ["sleep", "600"],
        env={**os.environ, processes.MARKER_VARIABLE: marker},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_session_whose_release_never_reached_the_controller_is_released_once_all_is_gone(
    fleet: Hub, tmp_path: Path
) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    workload = fleet.workload_of("alice")
    assert workload is not None
    marker = process_marker(fleet, workload["id"])
    assert processes.marked_pids(marker), "the session's processes carry the recorded marker"
    before = free_gpus(fleet)
    controller = fleet.controller_pid()
    assert controller is not None

    # The controller dies; the spawner stops the server and ends its processes, but its
    # release finds nobody: the hub forgets the server, the database still holds its GPUs.
    os.kill(controller, signal.SIGKILL)
    fleet.stop_server("alice")
    fleet.wait_gone("alice")
    # And something of the session still runs: a process that escaped the stop.
    with marked_sleep(marker, tmp_path) as stray:
        # JupyterHub notices the dead service on its next poll (30 s) and starts it again.
        wait_for(
            lambda: (pid := fleet.controller_pid()) is not None and pid != controller,
            90,
            "the hub restarting the controller",
        )
        wait_for(lambda: stray.poll() is not None, 60, "the reconciler ending the stray process")
        ended = fleet.wait_ended(workload, 30)

    assert ended["outcome"] == "lost"
    assert ended["allocations"] == []
    events = reconciled(fleet, workload["id"])
    assert [e["reason"] for e in events] == ["stray-processes", "session-lost"]
    assert (
        f"the hub no longer runs server (default) of alice but found process {stray.pid} of "
        f"workload {workload['id']} alive; ending them before its GPUs are released"
    ) == events[0]["message"]
    assert events[1]["message"] == (
        f"the hub no longer runs server (default) of alice and no process of workload "
        f"{workload['id']} is alive; its GPUs are released"
    )
    assert free_gpus(fleet) == before + 2


def test_a_server_whose_workload_the_database_ended_is_stopped(fleet: Hub) -> None:
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("bob")
    workload = fleet.workload_of("bob")
    assert workload is not None
    marker = process_marker(fleet, workload["id"])

    # The database ends the workload while its server runs: the server now uses a GPU
    # that may be handed to someone else.
    spawner_token = (fleet.data_dir / "spawner-token").read_text().strip()
    response = fleet.controller(
        "POST",
        f"/workloads/{workload['id']}/release",
        token=spawner_token,
        json={"outcome": "failed", "message": "ended behind the server's back by a test"},
    )
    assert response.status_code == 200, response.text

    fleet.wait_gone("bob", timeout=60)
    wait_for(lambda: not processes.marked_pids(marker), 30, "bob's processes gone")
    events = wait_for(lambda: reconciled(fleet, workload["id"]), 30, "a reconciled event")
    assert [(e["reason"], e["message"]) for e in events] == [
        (
            "server-without-gpus",
            f"the hub runs server (default) of bob but its workload {workload['id']} ended "
            "(failed); stopping the server, which holds no GPUs any more",
        )
    ]
    assert fleet.workload_of("bob") is None


def test_an_orphan_process_is_ended_and_a_stranger_is_left_alone(
    fleet: Hub, tmp_path: Path
) -> None:
    fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("carol")
    workload = fleet.workload_of("carol")
    assert workload is not None
    marker = process_marker(fleet, workload["id"])
    fleet.stop_server("carol")
    assert fleet.wait_ended(workload)["outcome"] == "stopped"

    # A marker this database never issued: another deployment's session on this machine.
    with (
        marked_sleep(processes.new_marker(), tmp_path) as stranger,
        marked_sleep(marker, tmp_path) as orphan,
    ):
        wait_for(lambda: orphan.poll() is not None, 30, "the reconciler ending the orphan")
        # The pass that ended the orphan saw the stranger too (it started first).
        assert stranger.poll() is None, "a process of another deployment was ended"
        events = wait_for(lambda: reconciled(fleet, workload["id"]), 30, "a reconciled event")

    assert [e["reason"] for e in events] == ["orphan-processes"]
    message = events[0]["message"]
    assert message.startswith(
        f"found process {orphan.pid} with the marker of workload {workload['id']}, which "
        "ended (stopped) "
    )
    assert message.endswith(" s ago; ending them")
