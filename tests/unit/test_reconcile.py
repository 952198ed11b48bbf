"""The reconciler's pure core, with literal inputs and outputs."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gpufleet.hub.reconcile import (
    DeletePods,
    EndProcesses,
    EndWorkload,
    HubServer,
    MarkedProcess,
    Observed,
    RecordedWorkload,
    Rule,
    StopServer,
    reconcile,
)

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
GRACE = timedelta(seconds=60)
NOW = T0 + timedelta(seconds=100)  # 100 s after T0: past the grace for anything since T0

ALICE = RecordedWorkload(
    id=7,
    version=3,
    kind="session",
    username="alice",
    server_name="",
    state="running",
    since=T0,
    marker="m-alice",
)
ALICE_SERVER = HubServer("alice", "", ready=True)
NOTHING = Observed(servers=(), processes=())


def observed(*items: HubServer | MarkedProcess) -> Observed:
    return Observed(
        servers=tuple(i for i in items if isinstance(i, HubServer)),
        processes=tuple(i for i in items if isinstance(i, MarkedProcess)),
    )


def test_nothing_to_repair_when_the_database_and_the_world_agree() -> None:
    world = observed(ALICE_SERVER, MarkedProcess(100, "m-alice"), MarkedProcess(101, "m-alice"))
    assert reconcile([ALICE], world, NOW, GRACE) == ()
    assert reconcile([], NOTHING, NOW, GRACE) == ()


def test_a_session_the_hub_no_longer_runs_with_nothing_alive_is_ended_as_lost() -> None:
    assert reconcile([ALICE], NOTHING, NOW, GRACE) == (
        EndWorkload(
            workload_id=7,
            version=3,
            outcome="lost",
            rule=Rule.session_lost,
            reason="the hub no longer runs server (default) of alice and no process of "
            "workload 7 is alive; its GPUs are released",
        ),
    )
    admitted = replace(ALICE, state="admitted", server_name="big")
    assert reconcile([admitted], NOTHING, NOW, GRACE) == (
        EndWorkload(
            7,
            3,
            "lost",
            Rule.session_lost,
            "the hub no longer runs server big of alice and no process of workload 7 is "
            "alive; its GPUs are released",
        ),
    )


def test_a_lost_session_is_left_alone_within_the_grace_period() -> None:
    young = replace(ALICE, since=NOW - GRACE)
    assert reconcile([young], NOTHING, NOW, GRACE) == ()
    # A workload that changed while the world was observed is younger than now.
    assert reconcile([replace(ALICE, since=NOW + timedelta(seconds=1))], NOTHING, NOW, GRACE) == ()


def test_a_server_the_hub_is_starting_or_stopping_is_not_lost() -> None:
    pending = observed(HubServer("alice", "", ready=False))
    assert reconcile([ALICE], pending, NOW, GRACE) == ()
    assert reconcile([replace(ALICE, state="admitted")], pending, NOW, GRACE) == ()


def test_a_stopped_session_whose_final_snapshot_is_pending_keeps_its_gpus() -> None:
    # Its spawner retries the snapshot; the GPUs wait for it (or for an admin).
    assert reconcile([replace(ALICE, snapshot_pending=True)], NOTHING, NOW, GRACE) == ()


def test_a_session_whose_marker_is_unknown_is_never_released_blind() -> None:
    assert reconcile([replace(ALICE, marker=None)], NOTHING, NOW, GRACE) == ()


def test_processes_of_a_lost_session_are_ended_before_its_gpus_are_released() -> None:
    world = observed(MarkedProcess(301, "m-alice"), MarkedProcess(300, "m-alice"))
    assert reconcile([ALICE], world, NOW, GRACE) == (
        EndProcesses(
            marker="m-alice",
            pids=(300, 301),
            workload_id=7,
            rule=Rule.stray_processes,
            reason="the hub no longer runs server (default) of alice but found 2 processes "
            "(300, 301) of workload 7 alive; ending them before its GPUs are released",
        ),
    )
    # A server that died while the hub was starting it (admitted): the same.
    one = observed(MarkedProcess(300, "m-alice"))
    assert reconcile([replace(ALICE, state="admitted")], one, NOW, GRACE) == (
        EndProcesses(
            "m-alice",
            (300,),
            7,
            Rule.stray_processes,
            "the hub no longer runs server (default) of alice but found process 300 of "
            "workload 7 alive; ending them before its GPUs are released",
        ),
    )


def test_a_stopping_workload_with_nothing_left_is_ended_as_stopped() -> None:
    stopping = replace(ALICE, state="stopping")
    assert reconcile([stopping], NOTHING, NOW, GRACE) == (
        EndWorkload(
            7,
            3,
            "stopped",
            Rule.stop_finished,
            "workload 7 is stopping and nothing of it runs any more; its GPUs are released",
        ),
    )
    job = replace(stopping, id=9, kind="job", username="carol", server_name="", marker="m-job")
    assert reconcile([job], observed(MarkedProcess(500, "m-job")), NOW, GRACE) == (
        EndProcesses(
            "m-job",
            (500,),
            9,
            Rule.stray_processes,
            "workload 9 is stopping but found process 500 of workload 9 alive; ending them "
            "before its GPUs are released",
        ),
    )


def test_a_stop_in_progress_is_left_to_the_hub_and_an_overdue_one_is_repeated() -> None:
    stopping = replace(ALICE, state="stopping")
    assert reconcile([stopping], observed(HubServer("alice", "", False)), NOW, GRACE) == ()
    assert reconcile([replace(stopping, since=NOW)], observed(ALICE_SERVER), NOW, GRACE) == ()
    assert reconcile([stopping], observed(ALICE_SERVER), NOW, GRACE) == (
        StopServer(
            username="alice",
            server_name="",
            workload_id=7,
            rule=Rule.stop_overdue,
            reason="workload 7 has been stopping for 100 s but the hub still runs server "
            "(default) of alice; stopping the server",
        ),
    )


def test_a_running_job_is_not_the_hubs_to_judge() -> None:
    job = replace(ALICE, kind="job", username="carol", server_name="")
    assert reconcile([job], NOTHING, NOW, GRACE) == ()


def test_a_ready_server_whose_workload_ended_is_stopped_after_the_grace() -> None:
    ended = replace(ALICE, state="ended", since=T0, outcome="failed")
    world = observed(ALICE_SERVER, MarkedProcess(100, "m-alice"))
    # Just ended: the hub shows a server whose queued spawn it is tearing down as ready.
    assert reconcile([replace(ended, since=NOW - GRACE)], world, NOW, GRACE) == ()
    assert reconcile([ended], world, NOW, GRACE) == (
        StopServer(
            "alice",
            "",
            7,
            Rule.server_without_gpus,
            "the hub runs server (default) of alice but its workload 7 ended (failed); "
            "stopping the server, which holds no GPUs any more",
        ),
    )
    # The last of several workloads of the server counts.
    older = replace(ended, id=5, since=T0 - GRACE, outcome="stopped")
    assert [r.workload_id for r in reconcile([older, ended], world, NOW, GRACE)] == [7]


def test_a_ready_server_the_database_never_had_a_workload_for_is_stopped_at_once() -> None:
    assert reconcile([], observed(HubServer("bob", "x", True)), NOW, GRACE) == (
        StopServer(
            "bob",
            "x",
            None,
            Rule.server_without_gpus,
            "the hub runs server x of bob but no workload holds GPUs for it; stopping the server",
        ),
    )


def test_a_server_being_started_again_is_not_stopped() -> None:
    new_start = replace(ALICE, id=8, state="pending", marker="m-new", since=NOW)
    assert reconcile([new_start], observed(ALICE_SERVER), NOW, GRACE) == ()
    assert reconcile([], observed(HubServer("alice", "", ready=False)), NOW, GRACE) == ()


def test_processes_with_the_marker_of_an_ended_workload_are_orphans() -> None:
    ended = replace(ALICE, state="ended", since=T0, outcome="stopped")
    world = observed(MarkedProcess(400, "m-alice"))
    assert reconcile([ended], world, NOW, GRACE) == (
        EndProcesses(
            "m-alice",
            (400,),
            7,
            Rule.orphan_processes,
            "found process 400 with the marker of workload 7, which ended (stopped) 100 s "
            "ago; ending them",
        ),
    )
    # Within the grace the backend's own stop may still be ending them.
    assert reconcile([replace(ended, since=NOW - GRACE)], world, NOW, GRACE) == ()


def test_processes_whose_marker_this_database_does_not_know_are_not_ours() -> None:
    world = observed(MarkedProcess(400, "m-other-deployment"))
    assert reconcile([ALICE], observed(ALICE_SERVER, *world.processes), NOW, GRACE) == ()


def test_a_marker_an_open_workload_still_owns_is_no_orphan() -> None:
    # A retried request: the superseded workload and the new one share the start's marker.
    superseded = replace(ALICE, id=6, state="ended", outcome="superseded")
    world = observed(ALICE_SERVER, MarkedProcess(100, "m-alice"))
    assert reconcile([superseded, ALICE], world, NOW, GRACE) == ()


def test_an_orphan_whose_server_the_hub_still_lists_is_left_to_the_servers_stop() -> None:
    ended = replace(ALICE, state="ended", since=T0, outcome="failed")
    world = observed(ALICE_SERVER, MarkedProcess(100, "m-alice"))
    repairs = reconcile([ended], world, NOW, GRACE)
    assert [type(r) for r in repairs] == [StopServer]
    stopping = observed(HubServer("alice", "", ready=False), MarkedProcess(100, "m-alice"))
    assert reconcile([ended], stopping, NOW, GRACE) == ()
    # Once the server runs a new workload, the old marker's processes are orphans.
    new_start = replace(ALICE, id=8, marker="m-new", since=NOW)
    repairs = reconcile([ended, new_start], world, NOW, GRACE)
    assert [(type(r), r.workload_id) for r in repairs] == [(EndProcesses, 7)]


def test_repairs_come_in_a_fixed_order() -> None:
    bob = replace(ALICE, id=3, username="bob", marker="m-bob")
    lost_alice = ALICE
    orphan = replace(ALICE, id=2, username="dan", state="ended", marker="m-dan", outcome="lost")
    world = observed(
        HubServer("zoe", "", True),
        HubServer("carol", "", True),
        MarkedProcess(9, "m-dan"),
    )
    repairs = reconcile([lost_alice, orphan, bob], world, NOW, GRACE)
    assert [(type(r).__name__, r.rule.value) for r in repairs] == [
        ("EndWorkload", "session-lost"),  # bob, workload 3
        ("EndWorkload", "session-lost"),  # alice, workload 7
        ("StopServer", "server-without-gpus"),  # carol
        ("StopServer", "server-without-gpus"),  # zoe
        ("EndProcesses", "orphan-processes"),  # dan's workload 2
    ]


def test_a_workload_whose_pod_still_exists_keeps_its_gpus() -> None:
    # Its node may not answer: the pod may still run there, whatever this machine shows.
    with_pod = Observed(servers=(), processes=(), pods=frozenset({"m-alice"}))
    assert reconcile([ALICE], with_pod, NOW, GRACE) == ()
    stopping = replace(ALICE, state="stopping")
    assert reconcile([stopping], with_pod, NOW, GRACE) == ()
    # Gone from its cluster: the usual rule applies.
    assert reconcile([stopping], NOTHING, NOW, GRACE)[0].rule == Rule.stop_finished


def test_a_pod_of_an_ended_workload_is_deleted_after_the_grace() -> None:
    # The hub lost track of it (say, restored from an old state): its processes would use
    # GPUs the scheduler has given others.
    ended = replace(ALICE, state="ended", since=T0, outcome="lost")
    with_pod = Observed(servers=(), processes=(), pods=frozenset({"m-alice"}))
    assert reconcile([ended], with_pod, NOW, GRACE) == (
        DeletePods(
            "m-alice",
            7,
            Rule.orphan_pods,
            "a pod of workload 7, which ended (lost) 100 s ago, still exists; deleting it",
        ),
    )
    # Within the grace its spawner's own stop may still be deleting it.
    assert reconcile([replace(ended, since=NOW - GRACE)], with_pod, NOW, GRACE) == ()
    # The hub still lists the server: stopping that deletes the pod.
    listed = replace(with_pod, servers=(ALICE_SERVER,))
    assert [type(r) for r in reconcile([ended], listed, NOW, GRACE)] == [StopServer]
    # A pod whose marker an open workload owns (a retried request) is that workload's.
    reused = replace(ALICE, id=8)
    assert reconcile([ended, reused], with_pod, NOW, GRACE) == ()
