"""Crashes and restarts: the controller killed mid-admission, the hub restarted mid-queue."""

from __future__ import annotations

import sqlite3

import pytest

from .harness import Hub, wait_for

pytestmark = pytest.mark.integration


def open_allocations(hub: Hub) -> list[tuple[str, int]]:
    db = sqlite3.connect(hub.data_dir / "gpufleet.sqlite")
    try:
        return list(
            db.execute("SELECT gpu_uuid, workload_id FROM allocations WHERE closed_at IS NULL")
        )
    finally:
        db.close()


def test_controller_killed_mid_admission_loses_nothing_and_hands_out_no_gpu_twice(
    fleet: Hub,
) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    before = fleet.controller_pid()
    assert before is not None

    # The next admission cycle that admits something dies between its flush and its commit.
    failpoint = fleet.data_dir / "failpoints" / "admission-before-commit"
    failpoint.touch()
    fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=2)
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    wait_for(lambda: not failpoint.exists(), 30, "the controller reaching the failpoint")
    # JupyterHub notices the dead service on its next poll (30 s) and starts it again.
    wait_for(
        lambda: (pid := fleet.controller_pid()) is not None and pid != before,
        90,
        "the hub restarting the controller",
    )

    fleet.wait_ready("carol", timeout=120)
    fleet.wait_ready("bob", timeout=120)
    running = {w["username"]: w for w in fleet.workloads(state="running")}
    assert set(running) == {"alice", "bob", "carol"}
    uuids = [a["uuid"] for w in running.values() for a in w["allocations"]]
    assert len(uuids) == 6 and len(set(uuids)) == 6, "a GPU was handed out twice"
    rows = open_allocations(fleet)
    assert sorted(u for u, _ in rows) == sorted(uuids), "database and sessions disagree"
    # The killed cycle left no trace: each admitted workload has exactly one admission.
    events = fleet.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    for w in running.values():
        admitted = [e for e in events if e["workload_id"] == w["id"] and e["kind"] == "admitted"]
        assert len(admitted) == 1


def test_hub_restart_leaves_no_ghost_request(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("alice")
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    ghost = wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["queue_position"] == 1 and w, 30, "bob queued"
    )

    fleet.stop()  # the hub, its proxy and services; alice's server keeps running
    fleet.start()

    ended = fleet.wait_ended(ghost, 60)
    assert ended["outcome"] == "expired"
    assert fleet.server_model("bob") is None
    alice = fleet.workload_of("alice")
    assert alice is not None and alice["state"] == "running"
    assert fleet.wait_ready("alice", timeout=30)["ready"]


def test_bad_spawn_requests_are_refused_with_a_reason_and_allocate_nothing(fleet: Hub) -> None:
    cases = [
        ({"project": "vision", "gpu_type": "H100", "gpus": 1}, "unknown GPU type 'H100'"),
        ({"project": "vision", "gpu_type": "A100-80GB", "gpus": 0}, "at least 1 GPU"),
        ({"project": "vision", "gpu_type": "A100-80GB", "gpus": -2}, "at least 1 GPU"),
        ({"project": "vision", "gpu_type": "A100-80GB", "gpus": "two"}, "whole number"),
        ({"project": "vision", "gpu_type": "A100-80GB", "gpus": 9}, "largest A100-80GB node has 4"),
        (
            {"project": "nlp", "gpu_type": "A100-80GB", "gpus": 1},
            "bob is not a member of project 'nlp'",
        ),
    ]
    log_before = fleet.log_path.stat().st_size
    for options, message in cases:
        response = fleet.spawn("bob", **options)
        assert response.status_code == 400, (options, response.text)
        assert message in response.json()["message"]
        assert fleet.server_model("bob") is None
    assert fleet.workloads(username="bob", state="pending") == []
    assert fleet.workloads(username="bob", state="running") == []
    with fleet.log_path.open() as log:
        log.seek(log_before)
        written = log.read()
    assert "Invalid GPU request: ask for at least 1 GPU" in written
    assert "Traceback" not in written, "a rejected request was logged as a crash"


def test_controller_api_rejects_malformed_bodies_and_foreign_callers(fleet: Hub) -> None:
    spawner_token = (fleet.data_dir / "spawner-token").read_text().strip()
    cases = [
        (b"{not json", "request body is not valid"),
        (b'{"username": "bob"}', "project: Field required"),
        (b'{"username": "bob", "project": "vision", "gpu_type": "A100-80GB", "gpus": [1]}', "gpus"),
        (
            b'{"username": "bob", "project": "vision", "gpu_type": "A100-80GB", "gpus": 1, '
            b'"colour": "red"}',
            "colour: Extra inputs are not permitted",
        ),
    ]
    for body, message in cases:
        response = fleet.controller("POST", "/sessions", token=spawner_token, content=body)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["code"] == "bad-request" and message in error["message"]
    assert fleet.workloads(username="bob") == [] or all(
        w["state"] == "ended" for w in fleet.workloads(username="bob")
    )

    assert fleet.controller("GET", "/workloads", token="not-a-token").status_code == 401
    bob = fleet.user_token("bob")
    forbidden = fleet.controller(
        "POST",
        "/sessions",
        token=bob,
        json={"username": "bob", "project": "vision", "gpu_type": "A100-80GB", "gpus": 1},
    )
    assert forbidden.status_code == 403
    assert "custom:gpufleet:spawn" in forbidden.json()["message"]
    assert fleet.controller("GET", "/users/alice/spawn-options", token=bob).status_code == 403
    own = fleet.controller("GET", "/users/bob/spawn-options", token=bob).json()
    assert [p["name"] for p in own["projects"]] == ["vision"]
