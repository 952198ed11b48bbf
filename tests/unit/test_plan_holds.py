"""Held zones across cycles, with literal inputs: the zone held for a request is handed back
to the next cycle (``Pending.held_zone``) and stays put unless another zone is clearly
closer; the request a zone is held for keeps its place in its project's guarantee, and
claims it against its project's later requests; work in a held zone counts last against
its project's guarantee, so backfill stays evictable (docs/scheduler.md, "Held zones").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.snapshot import NodeState, Plan, PreemptionCause, Running, WaitCause

from .test_plan import NOW, node, pending, projects, running, snap

Z1, Z2 = ("c1", "z1"), ("c1", "z2")


def zone_of_8(zone: str, free_nodes: int) -> list[NodeState]:
    """Eight 8-GPU nodes named after the zone; the first ``free_nodes`` are free."""
    return [
        node(f"{zone}n{i}", free=range(8) if i < free_nodes else (), zone=zone) for i in range(8)
    ]


def full_of(wid: int, project: str, nodes: Sequence[NodeState], **extra: Any) -> Running:
    """One workload on every GPU of the full ``nodes``."""
    placement = {n.name: range(8) for n in nodes if not n.free}
    return running(wid, project, placement, zone=nodes[0].zone, **extra)


def four_nodes() -> list[NodeState]:
    """n1 free and n2 full in z1; n3 and n4 full in z2."""
    return [
        node("n1", zone="z1"),
        node("n2", free=(), zone="z1"),
        node("n3", free=(), zone="z2"),
        node("n4", free=(), zone="z2"),
    ]


def causes(result: Plan) -> dict[int, tuple[WaitCause, str]]:
    return {w.workload_id: (w.cause, w.reason) for w in result.waiting}


def test_a_hold_stays_in_its_zone_unless_another_is_clearly_closer() -> None:
    # A 64-GPU gang (8 pods) within its guarantee; the rest of each zone runs another
    # project's work within that project's guarantee, which nothing may evict.
    def held(z2_free_nodes: int, held_zone: tuple[str, str] | None) -> object:
        z1, z2 = zone_of_8("z1", 3), zone_of_8("z2", z2_free_nodes)
        gang = pending(1, "p", 8, pods=8, held_zone=held_zone)
        world = snap(
            z1 + z2,
            [gang],
            [full_of(10, "q", z1), full_of(11, "q", z2)],
            projects(p=64, q=128),
        )
        return plan(world, NOW).held

    # Decided afresh, the zone where most pods fit is held.
    assert held(4, None) == {("c1", "z2", "H100"): 1}
    # Held in z1 last cycle: one pod more elsewhere does not move it (the margin is a
    # quarter of its 8 pods)...
    assert held(4, Z1) == {("c1", "z1", "H100"): 1}
    # ...two more do.
    assert held(5, Z1) == {("c1", "z2", "H100"): 1}


def test_the_request_a_zone_is_held_for_keeps_its_claim_while_later_work_runs() -> None:
    # p guarantees 16. Its 16-GPU gang waits for z1; p's 8-GPU job queued after it started
    # meanwhile in z2 (by its project's usage alone, the gang now borrows). p's next
    # request, 8 GPUs, could start only by reclaiming q's borrower in z2.
    def decided(held_zone: tuple[str, str] | None) -> Plan:
        nodes = [
            node("n1", zone="z1"),
            node("n2", free=(), zone="z1"),
            node("n3", free=(), zone="z2"),
            node("n4", free=(), zone="z2"),
        ]
        run = [
            running(10, "r", {"n2": range(8)}, zone="z1"),
            running(2, "p", {"n3": range(8)}, zone="z2", created_at=10.0, started=10.0),
            running(11, "q", {"n4": range(8)}, zone="z2", created_at=50.0, started=50.0),
        ]
        queue = [
            pending(1, "p", 8, pods=2, at=0.0, held_zone=held_zone),
            pending(3, "p", 8, at=30.0),
        ]
        return plan(snap(nodes, queue, run, projects(p=16, q=0, r=8)), NOW)

    # The gang held z1 last cycle: counting only what p queued before it, it is within
    # p's guarantee and claims it, so the next request borrows and may not reclaim.
    held = decided(Z1)
    assert held.preemptions == () and held.admissions == ()
    assert causes(held)[1][0] is WaitCause.RESERVED
    assert "project p uses 8/16 guaranteed and may borrow" in causes(held)[3][1]

    # Had it held nothing, the gang borrows and comes after p's next request, which is
    # within p's guarantee beside the job and takes the free GPUs the gang waits for.
    afresh = decided(None)
    assert [(a.workload_id, a.zone) for a in afresh.admissions] == [(3, "z1")]


def test_later_requests_of_the_holders_project_borrow_beside_its_claim() -> None:
    # p guarantees 16 and runs nothing; its 16-GPU gang waits for z1. A later 4-GPU
    # request of p could start only by reclaiming q's borrowers in z2.
    nodes = four_nodes()
    run = [
        running(10, "q", {"n4": range(8)}, zone="z2", created_at=0.0),
        running(11, "q", {"n3": range(4)}, zone="z2", created_at=50.0, started=50.0),
        running(12, "q", {"n3": range(4, 8)}, zone="z2", created_at=60.0, started=60.0),
        running(13, "r", {"n2": range(8)}, zone="z1"),
    ]
    later = pending(2, "p", 4, at=5.0)
    tree = projects(p=16, q=8, r=8, s=16)

    # Behind another project's gang holding z1, it is within p's guarantee and reclaims
    # one of q's borrowers.
    theirs = pending(1, "s", 8, pods=2, at=0.0, held_zone=Z1)
    other = plan(snap(nodes, [theirs, later], run, tree), NOW)
    assert causes(other)[1][0] is WaitCause.RESERVED
    assert [(p.victim_id, p.cause) for p in other.preemptions] == [(12, PreemptionCause.GUARANTEE)]

    # Behind p's own gang, the gang's claim leaves it nothing of the guarantee: it would
    # borrow, and a borrower may not evict a borrower of its own class.
    ours = pending(1, "p", 8, pods=2, at=0.0, held_zone=Z1)
    behind = plan(snap(nodes, [ours, later], run, tree), NOW)
    assert behind.preemptions == () and behind.admissions == ()
    assert causes(behind)[1][0] is WaitCause.RESERVED
    assert "project p uses 0/16 guaranteed and may borrow" in causes(behind)[2][1]


def test_backfill_in_a_held_zone_stays_evictable_as_its_project_shrinks_elsewhere() -> None:
    # q guarantees 16 and runs 24: 8 old in z2, 8 in z1 (entered as backfill), 8 newest
    # in z2. Counted by age alone the newest would borrow and the backfill would be
    # within; in a held zone the backfill counts last.
    nodes = four_nodes()
    run = [
        running(20, "q", {"n3": range(8)}, zone="z2", created_at=10.0, started=10.0),
        running(21, "q", {"n2": range(8)}, zone="z1", created_at=50.0, started=50.0),
        running(22, "q", {"n4": range(8)}, zone="z2", created_at=90.0, started=90.0),
    ]
    tree = projects(p=16, q=16)

    held = plan(snap(nodes, [pending(1, "p", 8, pods=2, held_zone=Z1)], run, tree), NOW)
    assert [(p.victim_id, p.cause) for p in held.preemptions] == [(21, PreemptionCause.GUARANTEE)]
    assert [k.workload_id for k in held.kept] == [1]

    # Without the hold, the workload in z1 is within q's guarantee, and z2 cannot hold the
    # gang beside q's oldest work: the gang waits.
    afresh = plan(snap(nodes, [pending(1, "p", 8, pods=2)], run, tree), NOW)
    assert afresh.preemptions == ()
    assert causes(afresh)[1][0] is WaitCause.RESERVED


def test_backfill_reaches_a_request_that_fits_the_held_zone_behind_many_that_do_not() -> None:
    # p's 64-GPU gang, within p's guarantee, holds z1 (24 GPUs free, the rest q's work
    # within q's guarantee); z2 is full. b borrows: 75 requests of different shapes too
    # large for z1's free GPUs, queued before one 8-GPU job that fits there. Only b's
    # queue may still backfill, and the cycle decides at most 64 requests for backfill:
    # the job must not wait behind requests that can start nowhere.
    z1, z2 = zone_of_8("z1", 3), zone_of_8("z2", 0)
    too_large = [(k, pods) for k in (8, 4, 2, 1) for pods in range(24 // k + 1, 64 // k + 1)]
    assert len(too_large) > 64
    queue = [pending(1, "p", 8, pods=8, held_zone=Z1)]
    queue += [
        pending(100 + i, "b", k, pods=pods, at=float(i)) for i, (k, pods) in enumerate(too_large)
    ]
    queue.append(pending(2, "b", 8, at=1000.0))
    run = [full_of(10, "q", z1), full_of(11, "q", z2)]
    result = plan(
        snap(z1 + z2, queue, run, projects(p=64, q=128, b=0), max_preemption_searches=2), NOW
    )
    assert [(a.workload_id, a.zone) for a in result.admissions] == [(2, "z1")]
    assert causes(result)[1][0] is WaitCause.RESERVED
    # The requests it went before wait for room, in their order.
    waits = {w.workload_id: w for w in result.waiting}
    assert [waits[100 + i].position for i in range(len(too_large))] == sorted(
        waits[100 + i].position for i in range(len(too_large))
    )
    assert {waits[100 + i].cause for i in range(len(too_large))} == {WaitCause.CAPACITY}
