"""What the cluster manager decides for a cluster's job pods (``clusters/gang_plan.py``):
literal pod readings and passes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpufleet.clusters.gang_plan import GangMemory, ObservedPod, plan_pass, read_pod
from gpufleet.state.jobs import DesiredPod, PodReport


def want(index: int, run: bool = True, started: bool = False, node: str = "a-gpu-1") -> DesiredPod:
    return DesiredPod(
        workload_id=7,
        pod_index=index,
        pods=2,
        gpus_per_pod=2,
        node=node,
        gpu_uuids=(),
        marker="m",
        run=run,
        started=started,
        username="ann",
        name="resnet",
        spec={},
        attempt=1,
    )


def pod(index: int, phase: str = "Running", **fields: Any) -> ObservedPod:
    base: dict[str, Any] = dict(
        name=f"gf-job-7-a1-{index}",
        workload_id=7,
        attempt=1,
        index=index,
        marker=f"m.{index}",
        node="a-gpu-1",
        phase=phase,
        terminating=False,
        running=phase == "Running",
    )
    base.update(fields)
    return ObservedPod(**base)


def manifest(status: dict[str, Any], deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": "gf-job-7-a1-0",
        "labels": {
            "gpufleet.io/workload": "7",
            "gpufleet.io/attempt": "1",
            "gpufleet.io/pod-index": "0",
        },
        "annotations": {"gpufleet.io/marker": "m.0"},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-05T10:00:00Z"
    return {"metadata": metadata, "spec": {"nodeName": "a-gpu-1"}, "status": status}


def terminated(**state: Any) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "containerStatuses": [{"name": "torchrun", "state": {"terminated": state}}],
    }


# ------------------------------------------------------------------ reading a pod
def test_out_of_memory_is_the_containers_termination_reason_not_exit_137() -> None:
    oom = read_pod(manifest(terminated(exitCode=137, reason="OOMKilled")))
    killed = read_pod(manifest(terminated(exitCode=137, reason="Error")))
    assert oom is not None and killed is not None
    assert (oom.cause, oom.exit_code) == ("OOMKilled", 137)
    assert (killed.cause, killed.exit_code) == ("", 137)


def test_an_evicted_pod_says_so_in_the_kubelets_words() -> None:
    evicted = read_pod(
        manifest({"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."})
    )
    assert evicted is not None
    assert (evicted.ended, evicted.cause, evicted.message) == (
        True,
        "Evicted",
        "The node was low on memory.",
    )


def test_a_pending_pod_says_what_it_waits_for() -> None:
    pulling = read_pod(
        manifest(
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "torchrun",
                        "state": {
                            "waiting": {"reason": "ErrImagePull", "message": "not found: x:1"}
                        },
                    }
                ],
            }
        )
    )
    assert pulling is not None and pulling.waiting == "ErrImagePull: not found: x:1"
    unscheduled = manifest(
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        }
    )
    unscheduled["spec"] = {}
    read = read_pod(unscheduled)
    assert read is not None
    assert read.waiting == "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_a_pod_that_is_not_a_job_pod_is_not_read() -> None:
    assert read_pod({"metadata": {"name": "jupyter-ann", "labels": {}}}) is None


# ------------------------------------------------------------------ passes
def test_a_new_placement_is_created_whole_once() -> None:
    memory = GangMemory()
    first = plan_pass([want(0), want(1)], [], [], [], memory, 0.0, 60)
    assert first.create == [(7, 1)] and first.reports == []
    memory.created_at[(7, 1)] = 0.0
    again = plan_pass([want(0), want(1)], [], [], [], memory, 1.0, 60)
    assert again.create == []


def test_running_pods_are_reported_once_started() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    out = plan_pass([want(0), want(1)], [pod(0), pod(1, "Pending")], [], [], memory, 1.0, 60)
    assert out.reports == [PodReport(7, 0, "running", attempt=1)]


def test_a_gang_not_running_whole_by_its_deadline_is_deleted_then_reported_with_why() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    waiting = pod(1, "Pending", waiting="ErrImagePull: not found")
    out = plan_pass([want(0, started=True), want(1)], [pod(0), waiting], [], [], memory, 61.0, 60)
    assert sorted(out.delete) == ["gf-job-7-a1-0", "gf-job-7-a1-1"]
    assert out.reports == []  # nothing is reported ended while a pod of it exists
    gone = plan_pass([want(0, started=True), want(1)], [], [], [], memory, 62.0, 60)
    assert [(r.pod_index, r.state, r.cause) for r in gone.reports] == [
        (0, "failed", "StartTimeout"),
        (1, "failed", "StartTimeout"),
    ]
    assert "pod 1 on a-gpu-1: ErrImagePull: not found" in gone.reports[0].reason


def test_a_pod_deleted_by_someone_else_is_reported_only_once_gone() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    wanted = [want(0, started=True), want(1, started=True)]
    going = plan_pass(wanted, [pod(0, terminating=True), pod(1)], [], [], memory, 5.0, 60)
    assert going.reports == [] and going.delete == []
    gone = plan_pass(wanted, [pod(1)], [], [], memory, 6.0, 60)
    assert [(r.pod_index, r.state, r.cause) for r in gone.reports] == [(0, "failed", "Deleted")]


def test_a_deleted_pod_whose_ranks_ended_on_the_sigterm_is_still_a_deletion() -> None:
    """Its phase may turn Failed (exit 143) before it is gone: that end is the deletion's."""
    memory = GangMemory(created_at={(7, 1): 0.0})
    wanted = [want(0, started=True), want(1, started=True)]
    ended = pod(0, "Failed", terminating=True, exit_code=143)
    going = plan_pass(wanted, [ended, pod(1)], [], [], memory, 5.0, 60)
    assert going.reports == []
    gone = plan_pass(wanted, [pod(1)], [], [], memory, 6.0, 60)
    assert [(r.pod_index, r.state, r.cause) for r in gone.reports] == [(0, "failed", "Deleted")]
    # One that succeeded before someone deleted it succeeded.
    done = pod(0, "Succeeded", terminating=True, exit_code=0)
    finished = plan_pass(wanted, [done, pod(1)], [], [], GangMemory(), 7.0, 60)
    assert [(r.pod_index, r.state, r.exit_code) for r in finished.reports] == [(0, "exited", 0)]


def test_a_pod_gone_with_its_lost_node_is_a_node_fault() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    wanted = [want(0, started=True), want(1, started=True, node="a-gpu-2")]
    out = plan_pass(wanted, [pod(0)], [], [], memory, 6.0, 60, {"a-gpu-2": "was deleted"})
    assert [(r.pod_index, r.cause) for r in out.reports] == [(1, "NodeLost")]


def test_a_stopping_job_deletes_its_pods_and_reports_them_stopped_once_gone() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    wanted = [want(0, run=False, started=True), want(1, run=False, started=True)]
    first = plan_pass(wanted, [pod(0), pod(1)], [], [], memory, 5.0, 60)
    assert sorted(first.delete) == ["gf-job-7-a1-0", "gf-job-7-a1-1"] and first.reports == []
    terminating = [pod(0, terminating=True), pod(1, terminating=True)]
    assert plan_pass(wanted, terminating, [], [], memory, 6.0, 60).delete == []
    done = plan_pass(wanted, [pod(1, terminating=True)], [], [], memory, 7.0, 60)
    assert done.reports == [PodReport(7, 0, "stopped", attempt=1)]


def test_a_pod_to_stop_whose_stacks_are_awaited_is_deleted_only_once_they_are_in() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    awaited = [replace(want(i, run=False, started=True), trace=3) for i in (0, 1)]
    held = plan_pass(awaited, [pod(0), pod(1)], [], [], memory, 5.0, 60)
    assert held.delete == [] and held.reports == []
    answered = [awaited[0], want(1, run=False, started=True)]  # pod 1's stacks are in
    assert plan_pass(answered, [pod(0), pod(1)], [], [], memory, 6.0, 60).delete == [
        "gf-job-7-a1-1"
    ]


def test_failures_come_before_other_reports() -> None:
    memory = GangMemory(created_at={(7, 1): 0.0})
    wanted = [want(0, started=True), want(1, started=True)]
    ended = [pod(0, "Succeeded", exit_code=0), pod(1, "Failed", exit_code=1, message="boom")]
    out = plan_pass(wanted, ended, [], [], memory, 5.0, 60)
    assert [(r.pod_index, r.exit_code) for r in out.reports] == [(1, 1), (0, 0)]


def test_leftovers_are_deleted_and_said_gone_when_no_pod_carries_them() -> None:
    memory = GangMemory()
    lost = pod(0, marker="old.0", workload_id=5, name="gf-job-5-a1-0")
    out = plan_pass([], [lost], ["old.0", "older.1"], [], memory, 0.0, 60)
    assert out.delete == ["gf-job-5-a1-0"] and out.gone == ["older.1"]


def test_objects_of_attempts_nothing_asks_for_are_deleted() -> None:
    memory = GangMemory()
    out = plan_pass([want(0), want(1)], [], [], ["gf-job-7-a1", "gf-job-3-a4"], memory, 0.0, 60)
    assert out.orphan_gangs == ["gf-job-3-a4"]


def test_a_pod_kept_into_the_next_attempt_is_patched_not_recreated_nor_deleted() -> None:
    """Attempt 2 keeps pod 0 (made by attempt 1) and places pod 1 anew: pod 0 is patched
    into attempt 2 and its address is the master's, only pod 1 is created, and nothing of
    attempt 1 that is kept is deleted; once patched, its end is attempt 2's."""
    kept = replace(want(0, started=True), attempt=2, created_attempt=1)
    new = replace(want(1, node="a-gpu-2"), attempt=2)
    old = pod(0, ip="127.0.3.4", keepable=True)
    memory = GangMemory()
    first = plan_pass([kept, new], [old], [], [], memory, 0.0, 60.0)
    assert first.create == [(7, 2)]
    assert first.keep == [((7, 2), 0, "gf-job-7-a1-0")]
    assert first.masters == {(7, 2): "127.0.3.4"}
    assert first.delete == [] and first.reports == []

    memory.created_at[(7, 2)] = 0.0  # as the manager notes when it creates the gang
    patched = replace(old, attempt=2, marker="n.0")
    made = pod(1, name="gf-job-7-a2-1", attempt=2, node="a-gpu-2")
    later = plan_pass([kept, new], [patched, made], [], [], memory, 1.0, 60.0)
    assert later.create == [] and later.keep == [] and later.delete == []
    assert later.reports == [PodReport(7, 1, "running", attempt=2)]

    ended = replace(patched, phase="Failed", running=False, exit_code=1)
    started = replace(new, started=True)
    last = plan_pass([kept, started], [ended, made], [], [], memory, 2.0, 60.0)
    assert last.reports == [PodReport(7, 0, "exited", exit_code=1, attempt=2)]


def test_a_kept_pod_that_is_gone_is_reported_by_its_own_name() -> None:
    kept = replace(want(0, started=True), attempt=2, created_attempt=1)
    new = replace(want(1, node="a-gpu-2", started=True), attempt=2)
    made = pod(1, name="gf-job-7-a2-1", attempt=2, node="a-gpu-2")
    memory = GangMemory(created_at={(7, 2): 0.0})
    out = plan_pass([kept, new], [made], [], [], memory, 1.0, 60.0)
    [report] = out.reports
    assert (report.pod_index, report.cause, report.attempt) == (0, "Deleted", 2)
    assert "gf-job-7-a1-0" in report.reason


def test_the_objects_of_the_attempt_that_made_a_kept_pod_stay_while_it_is_kept() -> None:
    """Its volume still names them (a script over 16 KiB is its attempt's ConfigMap)."""
    kept = replace(want(0, started=True), attempt=2, created_attempt=1)
    new = replace(want(1, node="a-gpu-2", started=True), attempt=2)
    patched = pod(0, attempt=2)  # its name is still attempt 1's
    made = pod(1, name="gf-job-7-a2-1", attempt=2, node="a-gpu-2")
    gangs = ["gf-job-7-a1", "gf-job-7-a2", "gf-job-7-a0"]
    memory = GangMemory(created_at={(7, 2): 0.0})
    out = plan_pass([kept, new], [patched, made], [], gangs, memory, 1.0, 60.0)
    assert out.orphan_gangs == ["gf-job-7-a0"]


def test_a_pod_of_an_earlier_launcher_is_not_kept_but_deleted() -> None:
    """Its launcher became torchrun and reads no assignment: patched, it would never run
    the next attempt, whose other pods would wait for it in vain."""
    kept = replace(want(0, started=True), attempt=2, created_attempt=1)
    new = replace(want(1, node="a-gpu-2"), attempt=2)
    out = plan_pass([kept, new], [pod(0)], [], [], GangMemory(), 0.0, 60.0)
    assert out.keep == [] and out.cannot_keep == ["gf-job-7-a1-0"]


def test_a_pod_reads_as_keepable_only_with_an_assignment() -> None:
    status = {"phase": "Running"}
    plain = read_pod(manifest(status))
    with_one = manifest(status)
    with_one["metadata"]["annotations"]["gpufleet.io/assignment"] = "{}"
    assert plain is not None and not plain.keepable
    assert (read := read_pod(with_one)) is not None and read.keepable
