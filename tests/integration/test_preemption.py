"""Guarantee reclaim end to end: a borrowing session is stopped through the hub so that a
project asking within its guarantee gets its GPUs — also when the controller is killed in
the middle of the cycle that decided it."""

from __future__ import annotations

import pytest

from .harness import Hub, wait_for
from .test_resilience import open_allocations

pytestmark = pytest.mark.integration


def test_a_borrower_is_stopped_for_a_guarantee_even_across_a_controller_kill(
    fleet: Hub,
) -> None:
    # nlp (4 guaranteed) borrows 2 of vision's idle GPUs: 6 of the fleet's 8 are nlp's.
    fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("carol")
    first = fleet.workload_of("carol")
    assert first is not None
    fleet.spawn("carol", "extra", project="nlp", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("carol", "extra")
    borrower = fleet.workload_of("carol", "extra")
    assert borrower is not None and "borrowed beyond project nlp's guarantee" in borrower["reason"]
    before = fleet.controller_pid()

    # vision asks for 4 on one node, within its guarantee: only stopping the borrower makes
    # room. The cycle that decides so dies between its flush and its commit.
    failpoint = fleet.data_dir / "failpoints" / "admission-before-commit"
    failpoint.touch()
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    wait_for(lambda: not failpoint.exists(), 30, "the controller reaching the failpoint")
    wait_for(
        lambda: (pid := fleet.controller_pid()) is not None and pid != before,
        90,
        "the hub restarting the controller",
    )

    fleet.wait_ready("alice", timeout=120)
    ended = fleet.wait_ended(borrower, 60)
    assert ended["outcome"] == "preempted"
    assert "borrowed beyond project nlp's guarantee" in ended["reason"]
    fleet.wait_gone("carol", "extra")
    running = {(w["username"], w["server_name"]): w for w in fleet.workloads(state="running")}
    assert set(running) == {("carol", ""), ("alice", "")}
    uuids = [a["uuid"] for w in running.values() for a in w["allocations"]]
    assert len(uuids) == 8 and len(set(uuids)) == 8, "a GPU was handed out twice"
    assert sorted(u for u, _ in open_allocations(fleet)) == sorted(uuids)
    events = fleet.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    # This test's (the shared hub's other tests preempt too).
    preempting = [
        e for e in events if e["kind"] == "preempting" and e["workload_id"] >= first["id"]
    ]
    assert [e["workload_id"] for e in preempting] == [borrower["id"]]  # decided once
    assert preempting[0]["reason"] == "guarantee-reclaim"
