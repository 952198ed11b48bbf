"""The admission core: literal fleets in, literal plans out; then the laws over random fleets."""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.admission import (
    Admission,
    AdmissionPlan,
    FleetSnapshot,
    NodeView,
    PendingRequest,
    Waiting,
    admit,
)

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def at(minute: int) -> datetime:
    return T0 + timedelta(minutes=minute)


def gpus(node: str, *indices: int) -> tuple[str, ...]:
    return tuple(f"GPU-{node}-{i}" for i in indices)


def node(
    name: str,
    gpu_type: str,
    free: tuple[int, ...],
    total: int = 4,
    zone: str = "zone-a",
    schedulable: bool = True,
) -> NodeView:
    return NodeView(name, zone, gpu_type, gpus(name, *free), total, schedulable)


def req(
    workload_id: int, project: str, user: str, gpu_type: str, count: int, minute: int
) -> PendingRequest:
    return PendingRequest(workload_id, project, user, gpu_type, count, at(minute))


# ---------------------------------------------------------------- literal plans
def test_a_request_within_the_guarantee_is_admitted_on_one_node() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3)),),
        queue=(req(1, "vision", "alice", "A100", 2, 0),),
        guaranteed={("vision", "A100"): 4},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(Admission(1, "a1", gpus("a1", 0, 1)),), waiting=()
    )


def test_a_request_exactly_filling_the_guarantee_is_admitted() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (2, 3)),),
        queue=(req(1, "vision", "alice", "A100", 2, 0),),
        guaranteed={("vision", "A100"): 4},
        project_usage={("vision", "A100"): 2},
    )
    assert admit(snapshot) == AdmissionPlan(admissions=(Admission(1, "a1", gpus("a1", 2, 3)),))


def test_a_full_quota_makes_the_request_wait_and_says_how_full() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3), total=8),),
        queue=(
            req(1, "vision", "alice", "A100", 2, 0),
            req(2, "vision", "bob", "A100", 1, 1),  # would fit the quota, but queues behind
            req(3, "nlp", "carol", "A100", 1, 2),  # another project's quota: proceeds
            req(4, "robotics", "dave", "A100", 1, 3),  # no guarantee at all
        ),
        guaranteed={("vision", "A100"): 4, ("nlp", "A100"): 2},
        project_usage={("vision", "A100"): 3},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(Admission(3, "a1", gpus("a1", 0)),),
        waiting=(
            Waiting(1, 1, "2 × A100 requested; project vision uses 3 of 4 guaranteed A100"),
            Waiting(
                2,
                2,
                "waiting behind an earlier request for A100 in project vision (workload 1)",
            ),
            Waiting(4, 3, "1 × A100 requested; project robotics uses 0 of 0 guaranteed A100"),
        ),
    )


def test_admissions_in_one_plan_count_against_the_quota() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3)),),
        queue=(
            req(1, "vision", "alice", "A100", 2, 0),
            req(2, "vision", "bob", "A100", 2, 1),
        ),
        guaranteed={("vision", "A100"): 3},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(Admission(1, "a1", gpus("a1", 0, 1)),),
        waiting=(Waiting(2, 1, "2 × A100 requested; project vision uses 2 of 3 guaranteed A100"),),
    )


def test_the_per_user_cap_counts_gpus_of_every_type_in_the_project() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3)), node("h1", "H100", (0, 1, 2, 3))),
        queue=(
            req(1, "vision", "bob", "A100", 2, 0),  # reaches his cap exactly: admitted
            req(2, "vision", "alice", "A100", 2, 1),  # her H100 counts: over the cap
            req(3, "vision", "alice", "H100", 1, 2),  # within the cap, but behind her own
            req(4, "nlp", "alice", "A100", 2, 3),  # another project, no cap: admitted
        ),
        guaranteed={("vision", "A100"): 8, ("vision", "H100"): 8, ("nlp", "A100"): 8},
        project_usage={("vision", "H100"): 1},
        user_usage={("vision", "alice"): 1},
        user_caps={"vision": 2, "nlp": None},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(
            Admission(1, "a1", gpus("a1", 0, 1)),
            Admission(4, "a1", gpus("a1", 2, 3)),
        ),
        waiting=(
            Waiting(
                2, 1, "2 × A100 requested; alice uses 1 of the 2-GPU per-user cap in project vision"
            ),
            Waiting(3, 1, "waiting behind your earlier request in project vision (workload 2)"),
        ),
    )


def test_best_fit_picks_the_fullest_node_that_still_fits() -> None:
    snapshot = FleetSnapshot(
        nodes=(
            node("a1", "A100", (0, 1, 2, 3)),
            node("a2", "A100", (2, 3)),
            node("a3", "A100", (3,)),
        ),
        queue=(
            req(1, "vision", "alice", "A100", 2, 0),
            req(2, "vision", "bob", "A100", 1, 1),
            req(3, "vision", "carol", "A100", 4, 2),
        ),
        guaranteed={("vision", "A100"): 16},
    )
    # Whole node a1 stays free for the 4-GPU request.
    assert admit(snapshot) == AdmissionPlan(
        admissions=(
            Admission(1, "a2", gpus("a2", 2, 3)),
            Admission(2, "a3", gpus("a3", 3)),
            Admission(3, "a1", gpus("a1", 0, 1, 2, 3)),
        ),
    )


def test_best_fit_breaks_ties_by_node_name_not_by_listing_order() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("b", "A100", (0, 1)), node("a", "A100", (0, 1))),
        queue=(req(1, "vision", "alice", "A100", 1, 0),),
        guaranteed={("vision", "A100"): 4},
    )
    assert admit(snapshot) == AdmissionPlan(admissions=(Admission(1, "a", gpus("a", 0)),))


def test_a_large_request_at_the_head_holds_its_place_while_other_types_proceed() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (2, 3)), node("h1", "H100", (0, 1, 2, 3), zone="zone-b")),
        queue=(
            req(1, "vision", "alice", "A100", 4, 0),
            req(2, "nlp", "bob", "A100", 1, 1),
            req(3, "nlp", "carol", "H100", 2, 2),
            req(4, "vision", "dave", "A100", 1, 3),
        ),
        guaranteed={("vision", "A100"): 8, ("nlp", "A100"): 8, ("nlp", "H100"): 8},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(Admission(3, "h1", gpus("h1", 0, 1)),),
        waiting=(
            Waiting(
                1,
                1,
                "4 × A100 requested on one node; the largest free block is 2 on a1 (zone-a); "
                "2 free in all",
            ),
            Waiting(
                2, 2, "waiting behind an earlier request for A100 until GPUs free up (workload 1)"
            ),
            Waiting(
                4, 3, "waiting behind an earlier request for A100 until GPUs free up (workload 1)"
            ),
        ),
    )


def test_free_gpus_spread_over_nodes_do_not_make_a_one_node_request_fit() -> None:
    snapshot = FleetSnapshot(
        nodes=(
            node("a1", "A100", (3,)),
            node("a2", "A100", (0, 1), zone="zone-b"),
            node("a3", "A100", (1,)),
        ),
        queue=(req(1, "vision", "alice", "A100", 3, 0),),
        guaranteed={("vision", "A100"): 8},
    )
    assert admit(snapshot) == AdmissionPlan(
        waiting=(
            Waiting(
                1,
                1,
                "3 × A100 requested on one node; the largest free block is 2 on a2 (zone-b); "
                "4 free in all",
            ),
        ),
    )


def test_unschedulable_nodes_receive_nothing_and_are_not_counted_as_free() -> None:
    snapshot = FleetSnapshot(
        nodes=(
            node("a1", "A100", (0, 1, 2, 3), schedulable=False),
            node("a2", "A100", (3,), zone="zone-b"),
            node("h1", "H100", (0, 1, 2, 3), schedulable=False),
        ),
        queue=(
            req(1, "vision", "alice", "A100", 2, 0),
            req(2, "nlp", "bob", "H100", 1, 1),
        ),
        guaranteed={("vision", "A100"): 8, ("nlp", "H100"): 8},
    )
    assert admit(snapshot) == AdmissionPlan(
        waiting=(
            Waiting(
                1,
                1,
                "2 × A100 requested on one node; the largest free block is 1 on a2 (zone-b); "
                "1 free in all",
            ),
            Waiting(
                2,
                1,
                "1 × H100 requested; no schedulable node has H100 right now "
                "(cordoned, unhealthy or not reporting)",
            ),
        ),
    )


def test_queue_positions_count_per_gpu_type() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", ()), node("h1", "H100", ())),
        queue=(
            req(1, "vision", "alice", "A100", 1, 0),
            req(2, "nlp", "bob", "H100", 1, 1),
            req(3, "nlp", "carol", "A100", 1, 2),
            req(4, "vision", "dave", "H100", 1, 3),
            req(5, "vision", "erin", "A100", 1, 4),
        ),
        guaranteed={
            ("vision", "A100"): 8,
            ("vision", "H100"): 8,
            ("nlp", "A100"): 8,
            ("nlp", "H100"): 8,
        },
    )
    positions = [(w.workload_id, w.position) for w in admit(snapshot).waiting]
    assert positions == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)]


def test_the_queue_is_served_by_creation_time_then_workload_id() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0,)),),
        queue=(  # listed out of order on purpose
            req(7, "p7", "u7", "A100", 1, 5),
            req(3, "p3", "u3", "A100", 1, 5),
            req(9, "p9", "u9", "A100", 1, 1),
        ),
        guaranteed={("p7", "A100"): 1, ("p3", "A100"): 1, ("p9", "A100"): 1},
    )
    assert admit(snapshot) == AdmissionPlan(
        admissions=(Admission(9, "a1", gpus("a1", 0)),),
        waiting=(
            Waiting(
                3,
                1,
                "1 × A100 requested on one node; the largest free block is 0 on a1 (zone-a); "
                "0 free in all",
            ),
            Waiting(
                7, 2, "waiting behind an earlier request for A100 until GPUs free up (workload 3)"
            ),
        ),
    )


def test_an_empty_queue_gives_an_empty_plan() -> None:
    snapshot = FleetSnapshot(nodes=(node("a1", "A100", (0, 1)),), queue=())
    assert admit(snapshot) == AdmissionPlan()


# ---- suspected policy bugs: a wait holds back requests that do not compete with it
def test_a_user_at_the_cap_does_not_hold_back_other_members_of_the_project() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3)),),
        queue=(
            req(1, "vision", "alice", "A100", 1, 0),
            req(2, "vision", "bob", "A100", 1, 1),
        ),
        guaranteed={("vision", "A100"): 8},
        project_usage={("vision", "A100"): 2},
        user_usage={("vision", "alice"): 2},
        user_caps={"vision": 2},
    )
    plan = admit(snapshot)
    assert plan.admissions == (Admission(2, "a1", gpus("a1", 0)),)


def test_a_quota_wait_for_one_type_does_not_hold_back_the_users_other_types() -> None:
    snapshot = FleetSnapshot(
        nodes=(node("a1", "A100", (0, 1, 2, 3)), node("h1", "H100", (0, 1, 2, 3))),
        queue=(
            req(1, "vision", "alice", "A100", 4, 0),
            req(2, "vision", "alice", "H100", 1, 1),
        ),
        guaranteed={("vision", "A100"): 2, ("vision", "H100"): 4},
    )
    plan = admit(snapshot)
    assert plan.admissions == (Admission(2, "h1", gpus("h1", 0)),)


# ------------------------------------------------------------------ properties
GPU_TYPES = ("A100", "H100")
PROJECTS = ("p1", "p2", "p3")
USERS = ("u1", "u2", "u3")


@st.composite
def fleets(draw: st.DrawFn) -> FleetSnapshot:
    """Small fleets under pressure: most requests fit somewhere, many compete."""
    nodes = []
    for i in range(draw(st.integers(0, 6))):
        total = draw(st.integers(1, 8))
        free = draw(st.sets(st.integers(0, total - 1)))
        nodes.append(
            node(
                f"n{i}",
                draw(st.sampled_from(GPU_TYPES)),
                tuple(sorted(free)),
                total=total,
                zone=draw(st.sampled_from(("zone-a", "zone-b"))),
                schedulable=draw(st.integers(0, 3)) > 0,
            )
        )
    ids = draw(st.lists(st.integers(1, 1000), unique=True, max_size=12))
    queue = tuple(
        req(
            workload_id,
            draw(st.sampled_from(PROJECTS)),
            draw(st.sampled_from(USERS)),
            draw(st.sampled_from(GPU_TYPES)),
            draw(st.integers(1, 3) | st.integers(1, 8)),
            draw(st.integers(0, 4)),  # few distinct times: ties are common
        )
        for workload_id in ids
    )
    pairs = [(p, t) for p in PROJECTS for t in GPU_TYPES]
    # A missing key means "no guarantee" (or no usage, or no cap): leave some out.
    guaranteed = {pair: draw(st.integers(0, 16)) for pair in pairs if draw(st.integers(0, 5))}
    project_usage = {pair: draw(st.integers(0, 4)) for pair in pairs if draw(st.booleans())}
    user_usage = {
        (p, u): draw(st.integers(0, 3)) for p in PROJECTS for u in USERS if draw(st.booleans())
    }
    user_caps = {p: draw(st.none() | st.integers(1, 6)) for p in PROJECTS if draw(st.booleans())}
    return FleetSnapshot(tuple(nodes), queue, guaranteed, project_usage, user_usage, user_caps)


# Generating a fleet is the costly part, so every law is checked on each generated plan.
@settings(max_examples=250, deadline=None, database=None)
@given(fleets())
def test_every_plan_obeys_the_laws(snapshot: FleetSnapshot) -> None:
    plan = admit(snapshot)
    requests = {r.workload_id: r for r in snapshot.queue}
    check_every_request_is_admitted_or_waiting_exactly_once(snapshot, plan)
    check_no_gpu_is_handed_out_twice(plan)
    check_admitted_gpus_were_free_on_one_schedulable_node_of_the_type(snapshot, plan, requests)
    check_projects_stay_within_their_guarantee(snapshot, plan, requests)
    check_users_stay_within_their_cap(snapshot, plan, requests)
    check_positions_number_each_gpu_types_queue_in_arrival_order(plan, requests)
    check_no_request_overtakes_one_waiting_for_capacity_of_its_type(plan, requests)


Requests = dict[int, PendingRequest]


def check_every_request_is_admitted_or_waiting_exactly_once(
    snapshot: FleetSnapshot, plan: AdmissionPlan
) -> None:
    decided = [a.workload_id for a in plan.admissions] + [w.workload_id for w in plan.waiting]
    assert sorted(decided) == sorted(r.workload_id for r in snapshot.queue)
    assert all(w.reason for w in plan.waiting), "every waiting request says why"


def check_no_gpu_is_handed_out_twice(plan: AdmissionPlan) -> None:
    handed_out = [uuid for a in plan.admissions for uuid in a.gpu_uuids]
    assert len(handed_out) == len(set(handed_out)), "a GPU was handed out twice"


def check_admitted_gpus_were_free_on_one_schedulable_node_of_the_type(
    snapshot: FleetSnapshot, plan: AdmissionPlan, requests: Requests
) -> None:
    nodes = {n.name: n for n in snapshot.nodes}
    for admission in plan.admissions:
        request = requests[admission.workload_id]
        placed_on = nodes[admission.node]
        assert placed_on.schedulable, f"placed on unschedulable {placed_on.name}"
        assert placed_on.gpu_type == request.gpu_type
        assert len(admission.gpu_uuids) == request.gpus
        assert set(admission.gpu_uuids) <= set(placed_on.free_gpus), "GPU not free there"


def check_projects_stay_within_their_guarantee(
    snapshot: FleetSnapshot, plan: AdmissionPlan, requests: Requests
) -> None:
    added: Counter[tuple[str, str]] = Counter()
    for admission in plan.admissions:
        request = requests[admission.workload_id]
        added[(request.project, request.gpu_type)] += request.gpus
    for key, count in added.items():
        assert snapshot.project_usage.get(key, 0) + count <= snapshot.guaranteed.get(key, 0), key


def check_users_stay_within_their_cap(
    snapshot: FleetSnapshot, plan: AdmissionPlan, requests: Requests
) -> None:
    added: Counter[tuple[str, str]] = Counter()
    for admission in plan.admissions:
        request = requests[admission.workload_id]
        added[(request.project, request.username)] += request.gpus
    for (project, user), count in added.items():
        cap = snapshot.user_caps.get(project)
        if cap is not None:
            assert snapshot.user_usage.get((project, user), 0) + count <= cap, (project, user)


def check_positions_number_each_gpu_types_queue_in_arrival_order(
    plan: AdmissionPlan, requests: Requests
) -> None:
    by_type: dict[str, list[Waiting]] = defaultdict(list)
    for waiting in plan.waiting:
        by_type[requests[waiting.workload_id].gpu_type].append(waiting)
    for waits in by_type.values():
        assert [w.position for w in waits] == list(range(1, len(waits) + 1))
        order = [(requests[w.workload_id].created_at, w.workload_id) for w in waits]
        assert order == sorted(order)


def check_no_request_overtakes_one_waiting_for_capacity_of_its_type(
    plan: AdmissionPlan, requests: Requests
) -> None:
    def arrival(workload_id: int) -> tuple[datetime, int]:
        return requests[workload_id].created_at, workload_id

    for waiting in plan.waiting:
        if " requested on one node; " not in waiting.reason:
            continue  # only a wait for free GPUs holds back the whole GPU type
        blocked = requests[waiting.workload_id]
        for admission in plan.admissions:
            if requests[admission.workload_id].gpu_type == blocked.gpu_type:
                assert arrival(admission.workload_id) < arrival(blocked.workload_id)
