"""Why free GPUs sit idle while work waits (scheduler/idle.py): the split the simulator
integrates and the controller exports as ``gpufleet_idle_gpus``."""

from __future__ import annotations

from dataclasses import replace

from gpufleet.scheduler.idle import IdleCause, idle_after_plan, idle_by_cause
from gpufleet.scheduler.model import project_tree
from gpufleet.scheduler.quota import QuotaLimits
from gpufleet.scheduler.snapshot import (
    Admission,
    Kept,
    Mode,
    NodeState,
    Pending,
    Plan,
    Pod,
    Policy,
    SchedulingSnapshot,
)


def test_idle_gpus_are_put_down_to_why_nothing_that_waits_uses_them():
    tree = project_tree(
        [
            {"name": "p", "quotas": {"V100": {"guaranteed": 16}}},
            {"name": "capped", "quotas": {"V100": {"guaranteed": 0, "borrow_limit": 0}}},
        ]
    )

    def node(name: str, zone: str, free: int, schedulable: bool = True) -> NodeState:
        gpus = tuple(f"{name}-{i}" for i in range(free))
        return NodeState(name, "c", zone, "V100", 8, gpus, schedulable)

    nodes = [
        node("a1", "held", 8),  # p's 8-GPU pod fits: a held zone, and it may not enter
        node("a2", "held", 3),
        node("b1", "open", 8),  # p's pod fits, not held: the scheduler's shortfall
        node("c1", "small", 2),  # only capped's 2-GPU pod fits, which its cap refuses
        node("c2", "small", 3),  # one of these 3 is kept for a preemptor
        node("d1", "tiny", 1),  # nothing that waits fits one GPU
        node("e1", "repair", 8, schedulable=False),
        node("t1", "other", 8),  # a type nobody waits for is not counted
    ]
    nodes[-1] = replace(nodes[-1], gpu_type="T4")
    waiting = [("p", "V100", 8, 1), ("capped", "V100", 2, 1)]
    idle = idle_by_cause(
        nodes,
        waiting,
        usage=[],
        kept={"c2-0"},
        held_zones={("c", "held", "V100")},
        tree=tree,
        limits=QuotaLimits(tree),
    )
    assert idle == {
        IdleCause.HELD: 11,
        IdleCause.SCHEDULER: 8,
        IdleCause.CAPS: 4,
        IdleCause.STOPPING: 1,
        IdleCause.SHAPE: 1,
        IdleCause.OUT_OF_SERVICE: 8,
    }


def test_what_a_plan_admits_is_not_idle_and_what_it_keeps_for_a_preemptor_is_stopping():
    tree = project_tree([{"name": "p", "quotas": {"V100": {"guaranteed": 16}}}])
    gpus = {name: tuple(f"{name}-{i}" for i in range(8)) for name in ("n1", "n2")}
    nodes = tuple(NodeState(name, "c", "z1", "V100", 8, free) for name, free in gpus.items())

    def request(wid: int, per_pod: int) -> Pending:
        return Pending(wid, "p", f"u{wid}", "job", "V100", per_pod, 1, created_at=float(wid))

    snapshot = SchedulingSnapshot(nodes, (), (request(1, 8), request(2, 8), request(3, 2)), tree)
    decided = Plan(
        admissions=(Admission(1, "c", "z1", (Pod("n1", gpus["n1"]),)),),
        kept=(Kept(2, (Pod("n2", gpus["n2"]),)),),
    )
    # n1 went to workload 1; n2 is kept for workload 2; workload 3 waits on nothing idle.
    assert idle_after_plan(snapshot, decided) == {"V100": {IdleCause.STOPPING: 8}}
    # Nothing kept: workload 2 and 3 fit n2 and the quotas admit them, yet they wait.
    assert idle_after_plan(snapshot, replace(decided, kept=())) == {
        "V100": {IdleCause.SCHEDULER: 8}
    }
    # The causes are gpufleet's quotas': other policies get none.
    fifo = replace(snapshot, policy=Policy(mode=Mode.FIFO))
    assert idle_after_plan(fifo, decided) == {}
