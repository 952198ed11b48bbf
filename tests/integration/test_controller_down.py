"""Servers stopped and spawns cancelled while the controller is down.

These run on a hub of their own whose reconciler waits an hour between passes
(``SLOW_RECONCILER``): whatever is repaired here is repaired on the request's own path,
not by a reconciler pass.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .harness import Hub, wait_for
from .test_reconciler import marked_sleep, process_marker, reconciled

pytestmark = pytest.mark.integration

RECONCILE_INTERVAL = 3600
SLOW_RECONCILER = f"""
c.Reconciling.interval = {RECONCILE_INTERVAL}
c.Reconciling.grace = 60
# A restarted controller takes over the dead one's database lease within 3 s.
c.FleetController.db_lease_seconds = 3
"""


@pytest.fixture(scope="module")
def slow_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    instance = Hub.create(Path(tmp_path_factory.mktemp("controller-down")), SLOW_RECONCILER)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


@pytest.fixture
def quiet(slow_hub: Hub) -> Iterator[Hub]:
    """The hub, with every server stopped and every workload ended afterwards."""
    yield slow_hub
    wait_for(slow_hub.controller_pid, 90, "the controller running")
    wait_for(lambda: controller_answers(slow_hub), 60, "the controller answering")
    slow_hub.stop_all_servers()


def controller_answers(hub: Hub) -> bool:
    """Whether the controller answers and holds the database lease (it may write)."""
    try:
        response = hub.controller("GET", "/")
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and bool(response.json()["leader"])


def kill_controller(hub: Hub) -> int:
    pid = hub.controller_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not controller_answers(hub), 30, "the controller gone")
    return pid


def wait_restarted(hub: Hub, killed: int) -> None:
    # JupyterHub notices the dead service on its next poll (30 s) and starts it again.
    wait_for(
        lambda: hub.controller_pid() not in (None, killed),
        90,
        "the hub restarting the controller",
    )
    wait_for(lambda: controller_answers(hub), 60, "the restarted controller answering")


def log_since(hub: Hub, offset: int) -> str:
    with hub.log_path.open() as log:
        log.seek(offset)
        return log.read()


def test_a_server_stopped_while_the_controller_was_down_starts_again_once_nothing_runs(
    quiet: Hub, tmp_path: Path
) -> None:
    hub = quiet
    first = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    marker = process_marker(hub, first["id"])

    # The controller dies; the spawner ends the server's processes but its release finds
    # nobody: the hub forgets the server, the database still holds its GPUs.
    killed = kill_controller(hub)
    hub.stop_server("alice")
    hub.wait_gone("alice")
    with marked_sleep(marker, tmp_path) as stray:  # something of it escaped the stop
        wait_restarted(hub, killed)
        # A start while something of the old session runs is refused, saying what runs.
        refused = hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
        assert refused.status_code == 400, refused.text
        assert (
            f"server (default) of alice still holds GPUs as workload {first['id']} (running): "
            f"process {stray.pid} of it is still alive on this machine, though the hub no "
            "longer runs the server."
        ) in refused.json()["message"]
        hub.wait_gone("alice")
        still = hub.workload_of("alice")
        assert still is not None and still["id"] == first["id"]

    # Nothing of it runs any more: the next start ends it at once and gets its GPUs,
    # an hour before the reconciler's next pass.
    asked = time.monotonic()
    second = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    assert time.monotonic() - asked < 60 < RECONCILE_INTERVAL
    assert second["id"] != first["id"]
    ended = hub.wait_ended(first, 5)
    assert ended["outcome"] == "lost" and ended["allocations"] == []
    assert [(e["reason"], e["message"]) for e in reconciled(hub, first["id"])] == [
        (
            "session-lost",
            f"a new start of server (default) of alice found workload {first['id']} still "
            "running although the hub no longer runs the server, and no process of it is "
            "alive; its GPUs are released",
        )
    ]


def test_cancelling_a_queued_spawn_while_the_controller_hangs_is_no_error(quiet: Hub) -> None:
    hub = quiet
    hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    hub.wait_ready("alice")
    hub.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    queued = wait_for(
        lambda: (w := hub.workload_of("bob")) and w["queue_position"] == 1 and w, 30, "bob queued"
    )
    log_before = hub.log_path.stat().st_size
    pid = hub.controller_pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it accepts connections and answers nothing
    try:
        response = hub.stop_server("bob")
        assert response.status_code in (202, 204), response.text
        hub.wait_gone("bob", timeout=30)
        # The withdrawal meets the client's time-out (10 s), after the hub has answered.
        written = wait_for(
            lambda: (
                (text := log_since(hub, log_before))
                and f"could not withdraw the GPU request {queued['id']} of bob (" in text
                and text
            ),
            30,
            "the spawner giving up its withdrawal",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (
        "); nothing of it runs, and the request's lease lapses by itself (one that had "
        "reported running is ended by the server's next start or by the reconciler)"
    ) in written
    assert "Traceback" not in written, written[-3000:]
    # The controller takes the withdrawal it had received, or the lease lapses.
    wait_for(lambda: controller_answers(hub), 60, "the controller answering again")
    assert hub.wait_ended(queued, 30)["outcome"] in ("withdrawn", "expired")
