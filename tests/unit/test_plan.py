"""The scheduling core with literal inputs: ``plan(snapshot, now) == Plan(...)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpufleet.scheduler.memo import PlanMemo
from gpufleet.scheduler.model import project_tree
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.snapshot import (
    Admission,
    Mode,
    NodeState,
    Pending,
    Plan,
    Pod,
    Policy,
    Preemption,
    PreemptionCause,
    Running,
    SchedulingSnapshot,
    WaitCause,
    Waiting,
)

NOW = 100_000.0
RANKS = {"critical": 300, "standard": 200, "opportunistic": 100}
PREEMPTIBLE = {"opportunistic": True}


def ids(node: str, *indices: int) -> tuple[str, ...]:
    return tuple(f"{node}/{i}" for i in indices)


def node(
    name: str,
    free: Sequence[int] = range(8),
    total: int = 8,
    zone: str = "z1",
    cluster: str = "c1",
    gpu_type: str = "H100",
    schedulable: bool = True,
    labels: Mapping[str, str] | None = None,
) -> NodeState:
    return NodeState(
        name, cluster, zone, gpu_type, total, ids(name, *free), schedulable, labels or {}
    )


def pending(
    wid: int,
    project: str,
    gpus: int,
    pods: int = 1,
    user: str = "ann",
    priority: str = "standard",
    at: float = 0.0,
    gpu_type: str = "H100",
    **extra: Any,
) -> Pending:
    return Pending(wid, project, user, "job", gpu_type, gpus, pods, priority, at, **extra)


def running(
    wid: int,
    project: str,
    placement: Mapping[str, Sequence[int]],
    priority: str = "standard",
    started: float = 0.0,
    zone: str = "z1",
    kind: str = "job",
    **extra: Any,
) -> Running:
    pods = tuple(Pod(n, ids(n, *gpus)) for n, gpus in placement.items())
    return Running(
        wid,
        project,
        "bob",
        kind,
        "H100",
        "c1",
        zone,
        pods,
        priority,
        PREEMPTIBLE.get(priority, False),
        started,
        **extra,
    )


def projects(**quotas: Any) -> Any:
    """projects(vision=8, nlp=(8, 0)) -> guaranteed 8 (and a borrow limit of 0)."""
    specs = []
    for name, quota in quotas.items():
        guaranteed, borrow = quota if isinstance(quota, tuple) else (quota, None)
        specs.append(
            {"name": name, "quotas": {"H100": {"guaranteed": guaranteed, "borrow_limit": borrow}}}
        )
    return project_tree(specs)


def snap(
    nodes: Sequence[NodeState],
    queue: Sequence[Pending] = (),
    run: Sequence[Running] = (),
    tree: Any = None,
    **policy: Any,
) -> SchedulingSnapshot:
    return SchedulingSnapshot(
        tuple(nodes),
        tuple(run),
        tuple(queue),
        tree if tree is not None else projects(),
        RANKS,
        PREEMPTIBLE,
        Policy(**policy),
    )


# ------------------------------------------------------------------ placement
def test_a_small_request_fills_the_partly_used_node_first() -> None:
    result = plan(
        snap(
            [node("n1"), node("n2", free=[4, 5, 6, 7])],
            [pending(1, "vision", 2)],
            [running(9, "vision", {"n2": [0, 1, 2, 3]})],
            projects(vision=16),
        ),
        NOW,
    )
    assert result == Plan(
        admissions=(
            Admission(
                1,
                "c1",
                "z1",
                (Pod("n2", ids("n2", 4, 5)),),
            ),
        )
    )


def test_a_gang_lands_whole_in_one_zone_taking_whole_nodes() -> None:
    nodes = [
        node("a1", zone="z1"),
        node("a2", zone="z1", free=[0, 1, 2, 3]),
        node("b1", zone="z2"),
        node("b2", zone="z2"),
    ]
    result = plan(snap(nodes, [pending(1, "vision", 8, pods=2)], tree=projects(vision=32)), NOW)
    assert result.admissions == (
        Admission(
            1, "c1", "z2", (Pod("b1", ids("b1", *range(8))), Pod("b2", ids("b2", *range(8))))
        ),
    )


def test_no_partial_gang_and_the_reason_names_the_largest_block() -> None:
    nodes = [node("a1", zone="z1"), node("b1", zone="z2"), node("b2", zone="z2", free=[0])]
    result = plan(snap(nodes, [pending(1, "vision", 8, pods=2)], tree=projects(vision=32)), NOW)
    assert result == Plan(
        waiting=(
            Waiting(
                1,
                1,
                WaitCause.RESERVED,
                "Waiting for 16 GPUs in one zone (2 pods × 8): the most its pods can get in one "
                "zone is 8 × H100, in z1; within project vision's guarantee (0/32 used); you "
                "are next for H100, z1 is kept for you as GPUs free up",
            ),
        )
    )


def test_cordoned_unhealthy_and_other_type_nodes_receive_nothing() -> None:
    nodes = [
        node("bad", schedulable=False),
        node("a100", gpu_type="A100"),
        node("ok", free=[0]),
    ]
    result = plan(snap(nodes, [pending(1, "vision", 2)], tree=projects(vision=8)), NOW)
    assert result.admissions == ()
    assert result.waiting[0].reason.startswith(
        "Waiting for 2 GPUs on one node: the most free on one node is 1 × H100, in z1"
    )


def test_a_node_selector_restricts_placement_to_labelled_nodes() -> None:
    nodes = [node("plain", free=[0, 1]), node("ib", labels={"network": "ib"})]
    request = pending(1, "vision", 2, node_selector={"network": "ib"})
    result = plan(snap(nodes, [request], tree=projects(vision=8)), NOW)
    assert result.admissions == (Admission(1, "c1", "z1", (Pod("ib", ids("ib", 0, 1)),)),)


def test_a_next_attempt_avoids_the_nodes_and_gpus_a_fault_blamed() -> None:
    nodes = [node("best", free=[0, 1, 2]), node("blamed", free=[0, 1]), node("other")]
    avoiding = replace(pending(1, "vision", 2), avoid_nodes=frozenset({"blamed"}))
    result = plan(snap(nodes, [avoiding], tree=projects(vision=8)), NOW)
    assert result.admissions == (Admission(1, "c1", "z1", (Pod("best", ids("best", 0, 1)),)),)
    # A blamed GPU is left out and its node's others still serve.
    bad_gpu = replace(pending(2, "vision", 2), avoid_gpus=frozenset(ids("best", 0)))
    result = plan(snap(nodes, [bad_gpu], tree=projects(vision=8)), NOW)
    assert result.admissions == (Admission(2, "c1", "z1", (Pod("best", ids("best", 1, 2)),)),)
    # With only the blamed node free it waits rather than land there again.
    only_blamed = [node("blamed", free=[0, 1]), node("full", free=[])]
    result = plan(snap(only_blamed, [avoiding], tree=projects(vision=8)), NOW)
    assert result.admissions == () and result.waiting[0].workload_id == 1


def reason_of(nodes: Sequence[NodeState], request: Pending) -> str:
    result = plan(snap(nodes, [request], tree=projects(vision=32)), NOW)
    assert result.admissions == ()
    [waiting] = result.waiting
    return waiting.reason


def test_a_waiting_restart_is_told_which_avoided_gpu_or_node_keeps_it_out() -> None:
    # Two free GPUs on one node, one of which failed this job before.
    bad_gpu = replace(pending(1, "vision", 2), avoid_gpus=frozenset(ids("a", 1)))
    assert reason_of([node("a", free=[0, 1]), node("b", free=[0])], bad_gpu) == (
        "Waiting for 2 GPUs on one node: node a has 2 × H100 free, but one of them, a/1, "
        "failed this job before and is avoided; the most it may use on one node is 1 × H100, "
        "in z1; within project vision's guarantee (0/32 used)"
    )
    both = replace(bad_gpu, avoid_gpus=frozenset(ids("a", 0, 1)))
    assert reason_of([node("a", free=[0, 1]), node("b", free=[])], both).startswith(
        "Waiting for 2 GPUs on one node: node a has 2 × H100 free, but all of them, a/0, a/1, "
        "failed this job before and are avoided; no H100 it may use is free;"
    )
    bad_node = replace(pending(1, "vision", 2), avoid_nodes=frozenset({"a"}))
    assert reason_of([node("a", free=[0, 1, 2]), node("b", free=[])], bad_node).startswith(
        "Waiting for 2 GPUs on one node: node a has 3 × H100 free, but the node failed this "
        "job before and is avoided; no H100 it may use is free;"
    )
    # A gang: its zone would hold both pods but for one GPU of a2.
    gang = replace(pending(1, "vision", 8, pods=2), avoid_gpus=frozenset(ids("a2", 3)))
    assert reason_of([node("a1"), node("a2")], gang).startswith(
        "Waiting for 16 GPUs in one zone (2 pods × 8): zone z1 has room for its 2 pods, but "
        "a2/3 there failed this job before and is avoided; the most its pods may use in one "
        "zone is 8 × H100, in z1;"
    )


def test_an_avoided_gpu_that_keeps_a_request_from_nothing_is_not_blamed() -> None:
    # Node a has 3 free, one avoided: 4 would not fit there anyway.
    request = replace(pending(1, "vision", 4), avoid_gpus=frozenset(ids("a", 0)))
    assert reason_of([node("a", free=[0, 1, 2]), node("b", free=[0])], request).startswith(
        "Waiting for 4 GPUs on one node: the most it may use on one node is 2 × H100, in z1;"
    )


def test_a_selectors_reason_counts_only_the_nodes_it_selects() -> None:
    request = pending(1, "vision", 2, node_selector={"network": "ib"})
    nodes = [node("plain", free=[0, 1]), node("ib", free=[], labels={"network": "ib"})]
    assert reason_of(nodes, request).startswith(
        "Waiting for 2 GPUs on one node: no H100 it may use is free;"
    )


def test_a_request_no_zone_could_ever_hold_is_told_so() -> None:
    result = plan(snap([node("n1"), node("n2", zone="z2")], [pending(1, "v", 8, pods=2)]), NOW)
    assert result.waiting == (
        Waiting(
            1,
            1,
            WaitCause.NEVER_FITS,
            "Cannot start, no zone of the fleet holds that many even when empty; ask for fewer "
            "GPUs, or for smaller pods: needs 16 × H100 (2 pods × 8) in one zone",
        ),
    )
    unknown = plan(snap([node("n1")], [pending(2, "v", 1, gpu_type="B200")]), NOW)
    assert unknown.waiting[0].reason == "Cannot start, the fleet has no B200: needs 1 × B200"


def test_the_first_blocked_request_holds_a_zone_and_smaller_ones_fill_the_rest() -> None:
    nodes = [node("a1", zone="z1", free=[0, 1, 2, 3]), node("b1", zone="z2", free=[0, 1])]
    queue = [pending(1, "vision", 8, at=1), pending(2, "vision", 2, at=2)]
    result = plan(snap(nodes, queue, tree=projects(vision=64)), NOW)
    # z1 is closest to holding 8: held for workload 1; workload 2 goes to z2, not z1.
    assert result.admissions == (Admission(2, "c1", "z2", (Pod("b1", ids("b1", 0, 1)),)),)
    assert result.waiting[0].cause is WaitCause.RESERVED


def test_the_zone_held_for_a_guarantee_is_the_one_its_protected_borrowers_will_free() -> None:
    # z1 is full of project c's work within c's guarantee: it never frees for a. z2 is
    # full of b's borrowing, still within its minimum run time: it will.
    nodes = [node("a1", zone="z1", free=[]), node("b1", zone="z2", free=[])]
    run = [
        running(8, "c", {"a1": range(8)}, started=0.0),
        running(9, "b", {"b1": range(8)}, zone="z2", started=NOW - 60),
    ]
    result = plan(snap(nodes, [pending(1, "a", 6)], run, projects(a=8, b=0, c=8)), NOW)
    assert result.preemptions == ()
    assert result.waiting[0].cause is WaitCause.RESERVED
    assert result.waiting[0].reason.endswith("z2 is kept for you as GPUs free up")


def test_a_request_does_not_stop_by_its_class_the_work_that_stopped_it() -> None:
    # b's opportunistic borrower once stopped a's standard one (a since back in the
    # queue). Borrowing beyond its guarantee, a does not stop it in turn for its class;
    # within its guarantee it takes the GPUs back.
    borrower = running(9, "b", {"n1": range(8)}, priority="opportunistic", started=0.0)
    request = pending(1, "a", 8, at=NOW - 600, preempted_by=frozenset([9]))
    over = plan(snap([node("n1", free=[])], [request], [borrower], projects(a=0, b=0)), NOW)
    assert over.preemptions == ()
    within = plan(snap([node("n1", free=[])], [request], [borrower], projects(a=8, b=0)), NOW)
    assert [(p.victim_id, p.cause) for p in within.preemptions] == [(9, PreemptionCause.GUARANTEE)]
    fresh = replace(request, preempted_by=frozenset())
    again = plan(snap([node("n1", free=[])], [fresh], [borrower], projects(a=0, b=0)), NOW)
    assert [(p.victim_id, p.cause) for p in again.preemptions] == [
        (9, PreemptionCause.BORROWER_PRIORITY)
    ]


# ---------------------------------------------------------------------- quota
def test_a_project_at_its_borrow_limit_waits_with_the_numbers() -> None:
    result = plan(
        snap(
            [node("n1")],
            [pending(1, "vision", 2), pending(2, "vision", 1, at=5)],
            [running(9, "vision", {"n1": [0, 1, 2, 3]})],
            projects(vision=(4, 0)),
        ),
        NOW,
    )
    # A borrower refused by its cap holds nothing: the next request is decided (and
    # refused) on its own numbers.
    assert result.waiting == (
        Waiting(
            1,
            1,
            WaitCause.QUOTA,
            "Waiting for project vision's GPUs to free up: needs 2 × H100, project vision uses "
            "4/4 guaranteed H100 and may borrow 0 more",
        ),
        Waiting(
            2,
            2,
            WaitCause.QUOTA,
            "Waiting for project vision's GPUs to free up: needs 1 × H100, project vision uses "
            "4/4 guaranteed H100 and may borrow 0 more",
        ),
    )


def test_a_borrower_refused_by_its_cap_lets_smaller_requests_start_as_its_backfill() -> None:
    result = plan(
        snap(
            [node("n1", free=[6, 7]), node("n2", free=[])],
            [pending(1, "vision", 8, at=1), pending(2, "vision", 2, at=2)],
            [running(9, "vision", {"n1": [0, 1, 2, 3, 4, 5]})],
            projects(vision=(4, 4)),
        ),
        NOW,
    )
    assert result.admissions == (Admission(2, "c1", "z1", (Pod("n1", ids("n1", 6, 7)),), 2),)
    assert [(w.workload_id, w.cause) for w in result.waiting] == [(1, WaitCause.QUOTA)]


def _backfill_world(backfill_started: float, backfill_queued: float, **extra: Any) -> Any:
    """vision (guarantee 4, cap 8) runs 4 GPUs of old work on n1 and, on n2, two 2-GPU
    borrowers; request 1 (4 GPUs) was queued at 1000."""
    return snap(
        [node("n1", free=[4, 5, 6, 7]), node("n2", free=[4, 5, 6, 7])],
        [pending(1, "vision", 4, at=1000.0)],
        [
            running(9, "vision", {"n1": [0, 1, 2, 3]}, created_at=0.0),
            running(
                10, "vision", {"n2": [0, 1]}, started=backfill_started, created_at=backfill_queued
            ),
            running(
                11, "vision", {"n2": [2, 3]}, started=backfill_started, created_at=backfill_queued
            ),
        ],
        projects(vision=(4, 4)),
        **extra,
    )


def test_a_borrower_takes_back_the_quota_its_backfill_ran_on() -> None:
    result = plan(_backfill_world(2000.0, 1500.0), NOW)
    assert {(p.victim_id, p.for_workload_id, p.cause) for p in result.preemptions} == {
        (10, 1, PreemptionCause.BACKFILL),
        (11, 1, PreemptionCause.BACKFILL),
    }
    assert result.preemptions[0].reason == (
        "it started while workload 1 of project vision, ahead of it in the queue, waited for "
        "the project's quota; that workload can start on it now"
    )
    assert result.waiting[0].cause is WaitCause.PREEMPTING


def test_work_that_was_ahead_in_the_queue_is_not_backfill() -> None:
    # Queued before request 1 (ahead of it), though started after: it keeps its GPUs.
    ahead = plan(_backfill_world(2000.0, 500.0), NOW)
    assert ahead.preemptions == ()
    assert ahead.waiting[0].cause is WaitCause.QUOTA
    # Started before request 1 was queued: it never ran on quota request 1 waited for.
    earlier = plan(_backfill_world(900.0, 900.0), NOW)
    assert earlier.preemptions == ()


def test_backfill_within_the_minimum_run_time_is_spared() -> None:
    result = plan(_backfill_world(NOW - 60, 1500.0, min_run_time_s=300.0), NOW)
    assert result.preemptions == ()
    assert result.waiting[0].cause is WaitCause.QUOTA


def test_backfill_in_another_zone_gives_back_quota_for_a_request_landing_elsewhere() -> None:
    # Request 1 fits z1's free GPUs; its project's cap is full of backfill running in z2.
    world = snap(
        [node("a1", zone="z1", free=[4, 5, 6, 7]), node("b1", zone="z2", free=[4, 5, 6, 7])],
        [pending(1, "vision", 4, at=1000.0)],
        [
            running(9, "vision", {"a1": [0, 1, 2, 3]}, created_at=0.0),
            running(
                10, "vision", {"b1": [0, 1, 2, 3]}, zone="z2", started=2000.0, created_at=1500.0
            ),
        ],
        projects(vision=(4, 4)),
    )
    result = plan(world, NOW)
    assert [(p.victim_id, p.cause) for p in result.preemptions] == [(10, PreemptionCause.BACKFILL)]
    assert [(k.workload_id, k.pods) for k in result.kept] == [
        (1, (Pod("a1", ids("a1", 4, 5, 6, 7)),))
    ]


def test_an_inner_node_caps_its_subtree() -> None:
    tree = project_tree(
        [
            {"name": "org", "kind": "organisation", "quotas": {"H100": {"borrow_limit": 2}}},
            {"name": "a", "parent": "org", "quotas": {"H100": {"guaranteed": 2}}},
            {"name": "b", "parent": "org", "quotas": {"H100": {"guaranteed": 2}}},
        ]
    )
    result = plan(
        snap([node("n1")], [pending(1, "a", 4)], [running(9, "b", {"n1": [0, 1, 2]})], tree), NOW
    )
    assert result.waiting[0].reason == (
        "Waiting for the GPUs of organisation org to free up: needs 4 × H100, organisation "
        "org caps its projects at 6 × H100 and they use 3"
    )


def test_the_per_user_cap_holds_only_that_users_later_requests() -> None:
    tree = project_tree(
        [{"name": "v", "per_user_gpu_cap": 2, "quotas": {"H100": {"guaranteed": 8}}}]
    )
    queue = [
        pending(1, "v", 2, user="ann", at=1),
        pending(2, "v", 1, user="ann", at=2),
        pending(3, "v", 1, user="bob", at=3),
    ]
    result = plan(snap([node("n1")], queue, tree=tree), NOW)
    assert [a.workload_id for a in result.admissions] == [1, 3]
    assert result.waiting == (
        Waiting(
            2,
            1,
            WaitCause.USER_CAP,
            "Waiting until ann holds fewer GPUs in project v: needs 1 × H100, ann uses 2 of "
            "the 2-GPU per-user cap",
        ),
    )


def test_static_quotas_never_borrow_and_fifo_ignores_quotas() -> None:
    nodes = [node("n1")]
    queue = [pending(1, "v", 4, at=1), pending(2, "v", 4, at=2)]
    static = plan(snap(nodes, queue, tree=projects(v=4), mode=Mode.STATIC), NOW)
    assert [a.workload_id for a in static.admissions] == [1]
    assert static.waiting[0].cause is WaitCause.QUOTA
    fifo = plan(snap(nodes, queue, tree=projects(v=0), mode=Mode.FIFO), NOW)
    assert [a.workload_id for a in fifo.admissions] == [1, 2]


def test_borrowing_admits_beyond_the_guarantee_and_says_how_much() -> None:
    result = plan(snap([node("n1")], [pending(1, "v", 6)], tree=projects(v=4, w=4)), NOW)
    assert result.admissions == (Admission(1, "c1", "z1", (Pod("n1", ids("n1", *range(6))),), 2),)


def test_a_lend_limit_keeps_part_of_the_unused_guarantee_idle() -> None:
    tree = project_tree(
        [
            {"name": "owner", "quotas": {"H100": {"guaranteed": 6, "lend_limit": 2}}},
            {"name": "other"},
        ]
    )
    result = plan(snap([node("n1")], [pending(1, "other", 5)], tree=tree), NOW)
    # 8 free, of which owner keeps 4 (6 unused, 2 lent at most): 5 do not fit, 4 do.
    assert result.admissions == ()
    assert result.waiting[0].reason == (
        "Waiting for 5 GPUs on one node: the most free on one node is 8 × H100, in z1, but "
        "other projects' lend limits keep 4 of the 8 free H100 back for themselves; project "
        "other uses 0/0 guaranteed and may borrow without limit; you are next for H100, z1 "
        "is kept for you as GPUs free up"
    )
    fits = plan(snap([node("n1")], [pending(1, "other", 4)], tree=tree), NOW)
    assert len(fits.admissions) == 1


# ------------------------------------------------------------------- ordering
def test_within_guarantee_first_then_borrowers_by_class_then_fair_share() -> None:
    tree = projects(a=0, b=0, c=2)
    # a already borrows 2, b borrows nothing: b goes first among equal classes.
    queue = [
        pending(1, "a", 2, at=1),
        pending(2, "b", 2, at=2),
        pending(3, "c", 2, at=3),
        pending(4, "a", 2, at=4, priority="critical"),
    ]
    result = plan(
        snap([node("n1", free=[2, 3, 4, 5, 6, 7])], queue, [running(9, "a", {"n1": [0, 1]})], tree),
        NOW,
    )
    assert [a.workload_id for a in result.admissions] == [3, 4, 2]


def test_unused_guarantee_goes_to_the_nearest_subtree_first() -> None:
    tree = project_tree(
        [
            {"name": "t1", "kind": "team"},
            {"name": "idle", "parent": "t1", "quotas": {"H100": {"guaranteed": 4}}},
            {"name": "near", "parent": "t1"},
            {"name": "t2", "kind": "team"},
            {"name": "far", "parent": "t2", "quotas": {"H100": {"guaranteed": 4}}},
        ]
    )
    queue = [pending(1, "far", 6, at=1), pending(2, "near", 2, at=2)]
    # far borrows from outside its team; near borrows its sibling's idle guarantee. Only
    # one of them fits: near, although it asked later.
    nodes = [node("n1", free=range(6)), node("n2", free=[])]
    result = plan(snap(nodes, queue, [running(9, "far", {"n2": range(8)})], tree), NOW)
    assert [a.workload_id for a in result.admissions] == [2]
    assert result.waiting[0].workload_id == 1


# ----------------------------------------------------------------- preemption
def test_a_project_within_its_guarantee_reclaims_exactly_what_it_needs() -> None:
    borrowers = [running(10 + i, "b", {"n1": [2 * i, 2 * i + 1]}, started=i) for i in range(4)]
    result = plan(
        snap([node("n1", free=[])], [pending(1, "a", 4)], borrowers, projects(a=4, b=4)),
        NOW,
    )
    # b's guarantee covers its two earliest workloads; the two latest are the borrowers,
    # the latest first: it has done the least work since it started.
    assert result.preemptions == (
        Preemption(
            13,
            1,
            PreemptionCause.GUARANTEE,
            "it ran on GPUs borrowed beyond project b's guarantee, which workload 1 of project "
            "a needed within its own guarantee",
        ),
        Preemption(12, 1, PreemptionCause.GUARANTEE, result.preemptions[0].reason),
    )
    assert result.waiting[0].cause is WaitCause.PREEMPTING
    assert result.waiting[0].reason == (
        "Other work is stopping to make room: needs 4 × H100, stopping workload(s) 13, 12 to "
        "free 4 GPU(s)"
    )


def test_who_borrows_is_counted_by_class_then_start_up_to_exactly_the_guarantee() -> None:
    """b is guaranteed 4 and runs four 2-GPU workloads: the two earliest are within its
    guarantee — the second one exactly reaches it — and only the two latest may be
    reclaimed; once the earliest ends, only the latest borrows. One memo follows both
    cycles, as the controller's does, and plans as a fresh one."""
    b = [running(10 + i, "b", {"n1": [2 * i, 2 * i + 1]}, started=i) for i in range(4)]
    tree = projects(a=8, b=4)
    memo = PlanMemo()
    first = snap([node("n1", free=[])], [pending(1, "a", 6)], b, tree)
    assert plan(first, NOW, memo).preemptions == ()  # 4 borrowed GPUs cannot hold 6
    second = snap([node("n1", free=[0, 1])], [pending(1, "a", 6)], b[1:], tree)
    result = plan(second, NOW + 1, memo)
    assert result.preemptions == ()  # 2 free and 13's 2: still short of 6
    assert result == plan(second, NOW + 1)

    # A higher class counts first, however late it started.
    b = [
        running(10, "b", {"n1": [0, 1]}, started=0),
        running(11, "b", {"n1": [2, 3]}, started=1),
        running(12, "b", {"n1": [4, 5, 6, 7]}, priority="critical", started=2),
    ]
    result = plan(snap([node("n1", free=[])], [pending(1, "a", 4)], b, tree), NOW)
    assert sorted(p.victim_id for p in result.preemptions) == [10, 11]


def test_reclaim_never_evicts_far_more_than_it_needs() -> None:
    nodes = [node(f"n{i}", free=[]) for i in range(8)]
    borrowers = [
        running(100 + 8 * i + j, "b", {f"n{i}": [j]}, started=8 * i + j)
        for i in range(8)
        for j in range(8)
    ]
    result = plan(snap(nodes, [pending(1, "a", 8)], borrowers, projects(a=48, b=16)), NOW)
    victims = {p.victim_id for p in result.preemptions}
    assert len(victims) == 8  # one node's worth: 8 single-GPU workloads, not 48
    assert len({b.pods[0].node for b in borrowers if b.id in victims}) == 1


def test_workloads_within_their_guarantee_are_never_evicted_by_another_project() -> None:
    inside = running(9, "b", {"n1": range(8)}, priority="opportunistic")
    result = plan(
        snap(
            [node("n1", free=[])],
            [pending(1, "a", 4, priority="critical")],
            [inside],
            projects(a=4, b=8),
        ),
        NOW,
    )
    assert result.preemptions == ()
    assert result.waiting[0].cause is WaitCause.RESERVED


def test_an_idle_session_is_reclaimed_even_for_a_borrower() -> None:
    idle = running(9, "b", {"n1": range(8)}, kind="session", idle_reclaimable=True)
    result = plan(
        snap([node("n1", free=[])], [pending(1, "a", 8)], [idle], projects(a=0, b=8)), NOW
    )
    assert result.preemptions == (
        Preemption(
            9, 1, PreemptionCause.IDLE, "idle; its GPUs were reclaimed for workload 1 of project a"
        ),
    )


def test_idle_sessions_go_first_and_the_minimum_run_time_protects_new_work() -> None:
    young = running(8, "b", {"n1": range(4)}, started=NOW - 10)
    old = running(9, "b", {"n1": range(4, 8)}, started=0)
    idle = running(7, "b", {"n2": range(8)}, kind="session", idle_reclaimable=True, started=NOW - 5)
    tree = projects(a=8, b=0)
    result = plan(
        snap(
            [node("n1", free=[]), node("n2", free=[])],
            [pending(1, "a", 8)],
            [young, old, idle],
            tree,
        ),
        NOW,
    )
    assert [p.victim_id for p in result.preemptions] == [7]
    no_idle = plan(snap([node("n1", free=[])], [pending(1, "a", 8)], [young, old], tree), NOW)
    assert no_idle.preemptions == ()  # young is protected, old alone does not make room
    later = plan(snap([node("n1", free=[])], [pending(1, "a", 8)], [young, old], tree), NOW + 300)
    assert {p.victim_id for p in later.preemptions} == {8, 9}


def test_a_higher_class_preempts_a_lower_one_inside_its_project_at_its_cap() -> None:
    low = running(9, "v", {"n1": range(8)}, priority="opportunistic")
    result = plan(
        snap(
            [node("n1", free=[])],
            [pending(1, "v", 8, priority="critical")],
            [low],
            projects(v=(8, 0)),
        ),
        NOW,
    )
    assert [(p.victim_id, p.cause) for p in result.preemptions] == [(9, PreemptionCause.PRIORITY)]
    standard = running(9, "v", {"n1": range(8)}, priority="standard")  # not preemptible
    spared = plan(
        snap(
            [node("n1", free=[])],
            [pending(1, "v", 8, priority="critical")],
            [standard],
            projects(v=(8, 0)),
        ),
        NOW,
    )
    assert spared.preemptions == () and spared.waiting[0].cause is WaitCause.QUOTA


def test_a_borrower_preempts_only_lower_class_preemptible_borrowers() -> None:
    low = running(9, "b", {"n1": range(8)}, priority="opportunistic")
    tree = projects(a=0, b=0)
    result = plan(snap([node("n1", free=[])], [pending(1, "a", 8)], [low], tree), NOW)
    assert [(p.victim_id, p.cause) for p in result.preemptions] == [
        (9, PreemptionCause.BORROWER_PRIORITY)
    ]
    equal = plan(
        snap([node("n1", free=[])], [pending(1, "a", 8, priority="opportunistic")], [low], tree),
        NOW,
    )
    assert equal.preemptions == ()


def test_while_its_victims_stop_a_request_asks_for_no_more() -> None:
    stopping = running(9, "b", {"n1": range(8)}, stopping=True, stopping_for=1)
    other = running(10, "b", {"n2": range(8)})
    result = plan(
        snap(
            [node("n1", free=[]), node("n2", free=[])],
            [pending(1, "a", 8)],
            [stopping, other],
            projects(a=8, b=0),
        ),
        NOW,
    )
    assert result.preemptions == ()
    assert result.waiting == (
        Waiting(
            1,
            1,
            WaitCause.PREEMPTING,
            "Other work is stopping to make room: needs 8 × H100, waiting for 8 GPU(s) being "
            "freed by preempted workload(s) 9",
        ),
    )


def test_a_request_beyond_what_its_project_may_ever_hold_does_not_block_its_queue() -> None:
    queue = [pending(1, "v", 8, at=1), pending(2, "v", 2, at=2)]
    result = plan(snap([node("n1")], queue, tree=projects(v=(2, 2))), NOW)
    assert [a.workload_id for a in result.admissions] == [2]
    assert result.waiting == (
        Waiting(
            1,
            1,
            WaitCause.NEVER_FITS,
            "More than project v may ever hold; ask for fewer GPUs, or for a higher limit: "
            "needs 8 × H100, project v may never hold more than 4 × H100 (guarantee plus "
            "borrow limit)",
        ),
    )


def test_a_reason_leads_with_plain_words_and_puts_the_numbers_after() -> None:
    full = [node("n1", free=[])]
    busy = [running(9, "vision", {"n1": range(8)})]
    tree = projects(vision=16)
    one = plan(snap(full, [pending(1, "vision", 2)], busy, tree), NOW)
    assert one.waiting[0].reason == (
        "Waiting for 2 GPUs on one node: every H100 is in use; within project vision's "
        "guarantee (8/16 used); you are next for H100, z1 is kept for you as GPUs free up"
    )
    gang = plan(snap(full, [pending(1, "vision", 4, pods=2)], busy, tree), NOW)
    assert gang.waiting[0].reason.startswith(
        "Waiting for 8 GPUs in one zone (2 pods × 4): no node has 4 × H100 free; "
    )
