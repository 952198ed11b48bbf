"""Recovery spares in the scheduling core (``scheduler/spares.py``): nodes held back per
zone for jobs restarting after a fault, lent to preemptible work meanwhile."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.model import project_tree
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.snapshot import (
    NodeState,
    Pending,
    Plan,
    Policy,
    PreemptionCause,
    Running,
    SchedulingSnapshot,
    WaitCause,
)
from gpufleet.scheduler.spares import choose_spares, lendable, spares_for

from .test_plan import NOW, PREEMPTIBLE, RANKS, node, pending, running

TREE = project_tree(
    [
        {"name": "vision", "quotas": {"H100": {"guaranteed": 16}}},
        {"name": "nlp", "quotas": {"H100": {"guaranteed": 8}}},
    ]
)


def snapshot(
    nodes: tuple[NodeState, ...],
    queue: tuple[Pending, ...] = (),
    runs: tuple[Running, ...] = (),
    spares: tuple[tuple[str, int], ...] = (("z1", 1),),
) -> SchedulingSnapshot:
    return SchedulingSnapshot(
        nodes,
        runs,
        queue,
        TREE,
        RANKS,
        PREEMPTIBLE,
        Policy(min_run_time_s=300.0, spares=spares),
    )


def placed_on(result: Plan, wid: int) -> set[str]:
    return {pod.node for a in result.admissions if a.workload_id == wid for pod in a.pods}


def wait_of(result: Plan, wid: int) -> Any:
    return next(w for w in result.waiting if w.workload_id == wid)


BUSY = (running(5, "vision", {"a": range(8)}), running(6, "vision", {"b": range(8)}))


def test_a_zone_keeps_its_spare_from_ordinary_work_and_says_so() -> None:
    nodes = (node("a", free=()), node("b", free=()), node("c"))
    result = plan(snapshot(nodes, (pending(1, "nlp", 8),), BUSY), NOW)
    assert result.admissions == ()
    assert result.spares == {("c1", "z1", "H100"): ("c",)}
    row = wait_of(result, 1)
    assert row.cause is WaitCause.RESERVED
    assert "(1 H100 node in z1 is held back as a recovery spare" in row.reason


def test_the_spare_is_lent_to_preemptible_work() -> None:
    nodes = (node("a", free=()), node("b", free=()), node("c"))
    queue = (pending(1, "nlp", 4, priority="opportunistic"),)
    result = plan(snapshot(nodes, queue, BUSY), NOW)
    assert placed_on(result, 1) == {"c"}


def test_a_recovering_job_goes_first_onto_the_spare_and_the_free_gpus_of_its_zone() -> None:
    nodes = (node("a"), node("b"), node("c", free=()), node("d", free=()))
    busy = (running(5, "vision", {"c": range(8)}), running(6, "vision", {"d": range(8)}))
    earlier = pending(1, "nlp", 8, at=0.0)
    restarting = pending(2, "vision", 8, pods=2, at=10.0, recovering=True)
    result = plan(snapshot(nodes, (earlier, restarting), busy), NOW)
    # The spare (a) and the one free node (b) are the restarting job's, before the
    # earlier ordinary request, which would have taken b.
    assert placed_on(result, 2) == {"a", "b"}
    assert wait_of(result, 1).position == 1


def test_a_recovering_job_takes_back_lent_work_however_young() -> None:
    nodes = (node("a", free=()), node("b"), node("c", free=()))
    lent = running(7, "nlp", {"a": range(8)}, priority="opportunistic", started=NOW - 1)
    ordinary = running(8, "nlp", {"c": range(8)}, priority="opportunistic", started=NOW - 1)
    restarting = pending(2, "vision", 8, pods=2, recovering=True, avoid_nodes=frozenset({"c"}))
    result = plan(snapshot(nodes, (restarting,), (lent, ordinary)), NOW)
    assert result.spares == {("c1", "z1", "H100"): ("a",)}
    [preemption] = result.preemptions
    assert (preemption.victim_id, preemption.for_workload_id) == (7, 2)
    assert preemption.cause is PreemptionCause.SPARE
    assert "recovery spare of z1 (a)" in preemption.reason
    [kept] = result.kept
    assert {p.node for p in kept.pods} == {"a", "b"}
    row = wait_of(result, 2)
    assert row.cause is WaitCause.PREEMPTING and "workload 7" in row.reason

    # While the lent work stops, the nodes of the kept placement are nobody's spares (the
    # other lent node is) and the core keeps the promise; once it is gone, the job starts.
    stopping = replace(lent, stopping=True, stopping_for=2)
    promised = replace(restarting, promised=kept.pods)
    after = plan(snapshot(nodes, (promised,), (stopping, ordinary)), NOW)
    assert after.spares == {("c1", "z1", "H100"): ("c",)}
    assert after.admissions == () and after.preemptions == ()
    assert wait_of(after, 2).cause is WaitCause.PREEMPTING
    gone = plan(snapshot((node("a"), *nodes[1:]), (promised,), (ordinary,)), NOW)
    assert placed_on(gone, 2) == {"a", "b"}


def test_ordinary_work_is_not_taken_back_for_a_recovering_job() -> None:
    nodes = (node("a", free=()), node("b"))
    standard = running(7, "nlp", {"a": range(8)}, started=NOW - 1)
    restarting = pending(2, "vision", 8, pods=2, recovering=True)
    result = plan(snapshot(nodes, (restarting,), (standard,)), NOW)
    # a runs ordinary work: it is no spare; b is, and alone it is not enough.
    assert result.spares == {("c1", "z1", "H100"): ("b",)}
    assert result.preemptions == () and result.admissions == ()


def test_a_cap_still_refuses_a_recovering_job() -> None:
    tree = project_tree([{"name": "nlp", "quotas": {"H100": {"guaranteed": 8, "borrow_limit": 0}}}])
    nodes = (node("a"), node("b", free=()))
    busy = running(7, "nlp", {"b": range(8)})
    restarting = pending(2, "nlp", 8, recovering=True)
    result = plan(replace(snapshot(nodes, (restarting,), (busy,)), projects=tree), NOW)
    assert result.admissions == ()
    assert wait_of(result, 2).cause is WaitCause.QUOTA


def test_the_spare_stays_where_work_was_lent() -> None:
    nodes = (node("a"), node("b", free=range(4)))
    lent = running(7, "nlp", {"b": range(4, 8)}, priority="opportunistic")
    assert choose_spares(snapshot(nodes, runs=(lent,))) == {("c1", "z1", "H100"): ("b",)}
    assert choose_spares(snapshot(nodes)) == {("c1", "z1", "H100"): ("a",)}


def test_the_most_specific_entry_names_a_zones_spares() -> None:
    table = (("*", 1), ("z1", 2), ("c1/z1", 3))
    assert spares_for(table, ("c1", "z1", "H100")) == 3
    assert spares_for(table, ("c2", "z1", "H100")) == 2
    assert spares_for(table, ("c2", "z9", "H100")) == 1
    assert spares_for((("z1", 2),), ("c1", "z2", "H100")) == 0


def test_without_spares_the_plan_is_the_cores() -> None:
    nodes = (node("a"), node("b", free=range(2)))
    queue = (pending(1, "nlp", 8), pending(2, "vision", 4, recovering=True))
    with_none = plan(snapshot(nodes, queue, spares=()), NOW)
    elsewhere = plan(snapshot(nodes, queue, spares=(("z9", 2),)), NOW)
    assert with_none == elsewhere
    assert placed_on(with_none, 1) == {"a"}


# ------------------------------------------------------------------ properties
@st.composite
def worlds(draw: st.DrawFn) -> SchedulingSnapshot:
    """Two zones of 2-4 nodes of 4 GPUs, some running work, a queue with recovering and
    preemptible requests, and 0-2 spares per zone."""
    nodes = []
    for zone in ("z1", "z2"):
        for i in range(draw(st.integers(2, 4))):
            nodes.append(node(f"{zone}-n{i}", free=range(4), total=4, zone=zone))
    free = {n.name: list(n.free) for n in nodes}
    runs = []
    wid = 1
    for n in nodes:
        if draw(st.booleans()):
            take = draw(st.integers(1, 4))
            gpus, free[n.name] = free[n.name][:take], free[n.name][take:]
            runs.append(
                Running(
                    wid,
                    draw(st.sampled_from(["vision", "nlp"])),
                    "bob",
                    "job",
                    "H100",
                    "c1",
                    n.zone,
                    (replace_pod(n.name, gpus),),
                    priority=draw(st.sampled_from(["standard", "opportunistic"])),
                    started_at=NOW - draw(st.sampled_from([1.0, 1000.0])),
                )
            )
            wid += 1
    nodes = [replace(n, free=tuple(free[n.name])) for n in nodes]
    if draw(st.booleans()):
        nodes[0] = replace(nodes[0], schedulable=False)
    queue = []
    for _ in range(draw(st.integers(0, 6))):
        per_pod = draw(st.sampled_from([1, 2, 4]))
        queue.append(
            pending(
                wid,
                draw(st.sampled_from(["vision", "nlp"])),
                per_pod,
                pods=draw(st.integers(1, 3)),
                user=draw(st.sampled_from(["ann", "cy"])),
                priority=draw(st.sampled_from(["standard", "opportunistic"])),
                at=float(wid),
                recovering=draw(st.booleans()),
                avoid_nodes=frozenset(draw(st.sets(st.sampled_from([n.name for n in nodes])))),
            )
        )
        wid += 1
    spares = (("z1", draw(st.integers(0, 2))), ("z2", draw(st.integers(0, 2))))
    return snapshot(tuple(nodes), tuple(queue), tuple(runs), spares)


def replace_pod(name: str, gpus: list[int]) -> Any:
    from gpufleet.scheduler.snapshot import Pod

    return Pod(name, tuple(f"{name}/{g}" for g in gpus))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_spares_keep_the_laws(world: SchedulingSnapshot) -> None:
    result = plan(world, NOW)
    queue = {r.id: r for r in world.queue}
    runs = {r.id: r for r in world.running}
    nodes = {n.name: n for n in world.nodes}
    spare_nodes = {name for names in result.spares.values() for name in names}
    for zone, names in result.spares.items():
        assert len(names) <= spares_for(world.policy.spares, zone)

    admitted = [a.workload_id for a in result.admissions]
    waiting = [w.workload_id for w in result.waiting]
    assert len(admitted) == len(set(admitted)) and not set(admitted) & set(waiting)
    assert set(admitted) | set(waiting) == set(queue)
    positions: dict[tuple[str, str], list[int]] = defaultdict(list)
    for w in result.waiting:
        positions[(queue[w.workload_id].project, "H100")].append(w.position)
    for seen in positions.values():
        assert sorted(seen) == list(range(1, len(seen) + 1))

    used = {g for r in world.running for p in r.pods for g in p.gpus}
    victims = {p.victim_id for p in result.preemptions}
    for p in result.preemptions:
        if p.cause is PreemptionCause.SPARE:
            assert queue[p.for_workload_id].recovering
            assert lendable(runs[p.victim_id], PREEMPTIBLE)
            assert {pod.node for pod in runs[p.victim_id].pods} & spare_nodes
    coming = {g for v in victims for p in runs[v].pods for g in p.gpus}
    coming |= {g for r in world.running if r.stopping for p in r.pods for g in p.gpus}
    for a in result.admissions:
        request = queue[a.workload_id]
        assert len(a.pods) == request.pods
        for pod in a.pods:
            n = nodes[pod.node]
            assert n.schedulable and (n.cluster, n.zone) == (a.cluster, a.zone)
            assert pod.node not in request.avoid_nodes
            assert len(pod.gpus) == request.gpus_per_pod
            for gpu in pod.gpus:
                assert gpu in n.free and gpu not in used, f"{gpu} handed out twice"
                used.add(gpu)
            if pod.node in spare_nodes:
                assert request.recovering or lendable(request, PREEMPTIBLE), (
                    f"ordinary workload {request.id} on spare {pod.node}"
                )
    for kept in result.kept:
        for pod in kept.pods:
            for gpu in pod.gpus:
                if gpu not in coming:
                    assert gpu in nodes[pod.node].free and gpu not in used
                    used.add(gpu)
