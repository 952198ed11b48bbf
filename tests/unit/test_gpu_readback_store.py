"""Recording which GPUs workloads' processes really have (state/readback.py).

Store tests run on SQLite and PostgreSQL (the ``engine`` fixture); PostgreSQL checks the
unique index on open allocations at every statement, so a swap that ever held one GPU
twice fails there. The planner's rules are also tested alone, with literal inputs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import SessionRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import Allocation, Event, Workload, WorkloadState
from gpufleet.state.readback import (
    GpuFacts,
    Held,
    Mismatch,
    Placement,
    ReadbackResult,
    ReseatPlan,
    plan_reseat,
    split_marker,
)

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
LEASE = timedelta(minutes=5)


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def node(name: str, gpu_type: str, count: int) -> NodeSpec:
    gpus = tuple(GpuSpec(f"GPU-{name}-{i}", i) for i in range(count))
    return NodeSpec(name, "local", "zone-a", gpu_type, gpus)


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    """4 A100 on n1, 2 A100 on n2, 2 H100 on h1; alice, bob and carol in vision."""
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(
        T0,
        [{"name": "vision", "quotas": {"A100": {"guaranteed": 6}, "H100": {"guaranteed": 2}}}],
        [{"name": "pytorch", "default": True}],
        [{"name": "standard", "rank": 100}],
    )
    store.nodes.register_nodes(T0, "agent-1", [node("n1", "A100", 4), node("n2", "A100", 2)])
    store.nodes.register_nodes(T0, "agent-1", [node("h1", "H100", 2)])
    store.projects.sync_memberships(T0, {"vision": ["alice", "bob", "carol"]})
    return store


def admit(store: FleetStore, now: datetime, user: str, gpus: int = 1) -> tuple[int, str]:
    """A session of ``user`` admitted now, with its process marker; (id, marker)."""
    request = SessionRequest(user, "", "vision", "A100", gpus, None)
    wid = store.workloads.open_session_request(now, request, LEASE).id
    marker = f"marker{user}"
    store.reconcile.record_process_marker(now, wid, marker)
    store.scheduling.scheduling_cycle(now, Policy())
    assert state(store, wid) == WorkloadState.admitted
    return wid, marker


def state(store: FleetStore, wid: int) -> WorkloadState:
    with store.read() as session:
        return session.get_one(Workload, wid).state


def version(store: FleetStore, wid: int) -> int:
    with store.read() as session:
        return session.get_one(Workload, wid).version


def held(store: FleetStore, wid: int) -> list[str]:
    with store.read() as session:
        return sorted(
            session.scalars(
                select(Allocation.gpu_uuid).where(
                    Allocation.workload_id == wid, Allocation.closed_at.is_(None)
                )
            )
        )


def history(store: FleetStore, wid: int) -> list[tuple[str, datetime, datetime | None]]:
    with store.read() as session:
        rows = session.execute(
            select(Allocation.gpu_uuid, Allocation.opened_at, Allocation.closed_at)
            .where(Allocation.workload_id == wid)
            .order_by(Allocation.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def events(store: FleetStore, kind: str) -> list[tuple[int | None, str, str, dict[str, Any]]]:
    with store.read() as session:
        return [
            (e.workload_id, e.reason, e.message, e.data)
            for e in session.scalars(select(Event).where(Event.kind == kind).order_by(Event.id))
        ]


def report(store: FleetStore, now: datetime, **placements: list[str]) -> ReadbackResult:
    return store.readback.record_placements(
        now, "agent-1", [Placement(m, tuple(uuids)) for m, uuids in placements.items()]
    )


# ------------------------------------------------------------------ the store
def test_a_report_that_matches_the_admission_records_nothing(store: FleetStore) -> None:
    alice, marker = admit(store, t(1), "alice", gpus=2)
    before = (history(store, alice), version(store, alice))
    assert before[0] == [("GPU-n2-0", t(1), None), ("GPU-n2-1", t(1), None)]

    result = report(store, t(5), **{marker: ["GPU-n2-1", "GPU-n2-0"]})
    assert result == ReadbackResult((), (), ())
    assert (history(store, alice), version(store, alice)) == before
    assert events(store, "gpus-read-back") == events(store, "gpu-readback-mismatch") == []


def test_a_workload_is_recorded_on_the_gpu_its_processes_have(store: FleetStore) -> None:
    alice, marker = admit(store, t(1), "alice")
    assert held(store, alice) == ["GPU-n2-0"]
    before = version(store, alice)

    result = report(store, t(5), **{marker: ["GPU-n2-1"]})
    assert result == ReadbackResult((alice,), (), ())
    # History, not an edit: the GPU counted until now is closed, the real one opened now.
    assert history(store, alice) == [("GPU-n2-0", t(1), t(5)), ("GPU-n2-1", t(5), None)]
    assert version(store, alice) == before + 1  # watchers of the workload see the change
    assert events(store, "gpus-read-back") == [
        (
            alice,
            "read-back",
            f"workload {alice}'s processes have GPU(s) GPU-n2-1 (index 1) of n2, not "
            "GPU-n2-0 (index 0) as recorded: the node's device plugin chose them; recorded "
            "from now on",
            {"pod": 0, "node": "n2", "gpus": ["GPU-n2-1"], "was": ["GPU-n2-0"]},
        )
    ]
    # The scheduler sees it too: the next session gets the GPU alice's processes left.
    bob, _ = admit(store, t(6), "bob")
    assert held(store, bob) == ["GPU-n2-0"]
    # The same report again changes nothing more.
    assert report(store, t(7), **{marker: ["GPU-n2-1"]}) == ReadbackResult((), (), ())
    assert len(events(store, "gpus-read-back")) == 1


def test_two_workloads_the_device_plugin_swapped_are_both_recorded_right(
    store: FleetStore,
) -> None:
    alice, alice_marker = admit(store, t(1), "alice")
    bob, bob_marker = admit(store, t(2), "bob")
    assert (held(store, alice), held(store, bob)) == (["GPU-n2-0"], ["GPU-n2-1"])

    result = report(store, t(5), **{alice_marker: ["GPU-n2-1"], bob_marker: ["GPU-n2-0"]})
    assert result == ReadbackResult((alice, bob), (), ())
    assert history(store, alice) == [("GPU-n2-0", t(1), t(5)), ("GPU-n2-1", t(5), None)]
    assert history(store, bob) == [("GPU-n2-1", t(2), t(5)), ("GPU-n2-0", t(5), None)]
    assert [(w, reason) for w, reason, _, _ in events(store, "gpus-read-back")] == [
        (alice, "read-back"),
        (bob, "read-back"),
    ]
    # n2 is still full: the next session goes to n1.
    carol, _ = admit(store, t(6), "carol")
    assert held(store, carol)[0].startswith("GPU-n1-")


def test_a_workload_holding_the_gpu_another_has_moves_onto_the_one_left(
    store: FleetStore,
) -> None:
    alice, alice_marker = admit(store, t(1), "alice")
    bob, bob_marker = admit(store, t(2), "bob")

    # Only alice's processes are read (bob's pod is still starting).
    result = report(store, t(5), **{alice_marker: ["GPU-n2-1"]})
    assert result == ReadbackResult((alice, bob), (), ())
    assert (held(store, alice), held(store, bob)) == (["GPU-n2-1"], ["GPU-n2-0"])
    displaced = events(store, "gpus-read-back")[1]
    assert displaced == (
        bob,
        "displaced",
        f"workload {bob}'s GPU(s) GPU-n2-1 (index 1) of n2 are used by workload(s) {alice}, "
        "whose processes have them; recorded on GPU-n2-0 (index 0) until its own processes "
        "are read back",
        {"pod": 0, "node": "n2", "gpus": ["GPU-n2-0"], "was": ["GPU-n2-1"], "by": [alice]},
    )
    # Then bob's processes are read: they have what the swap gave it, nothing moves.
    assert report(store, t(6), **{bob_marker: ["GPU-n2-0"]}) == ReadbackResult((), (), ())


@pytest.mark.parametrize(
    ("seen", "reason", "why"),
    [
        (["GPU-nowhere"], "unknown-gpu", "GPU(s) GPU-nowhere are unknown to the controller"),
        (["GPU-n1-3"], "other-node", "GPU(s) GPU-n1-3 are on another node"),
        (["GPU-n2-0", "GPU-n2-1"], "count", "2 GPU(s) seen, 1 allocated"),
    ],
)
def test_a_report_that_fits_no_admission_changes_nothing_and_is_said_once(
    store: FleetStore, seen: list[str], reason: str, why: str
) -> None:
    alice, marker = admit(store, t(1), "alice")
    before = (history(store, alice), version(store, alice))

    for now in (t(5), t(10)):  # an agent that starts again sends it again
        assert report(store, now, **{marker: seen}) == ReadbackResult((), (alice,), ())
    assert (history(store, alice), version(store, alice)) == before
    assert events(store, "gpus-read-back") == []
    assert events(store, "gpu-readback-mismatch") == [
        (
            alice,
            reason,
            f"workload {alice}'s processes have GPU(s) {', '.join(sorted(seen))}, but "
            f"GPU-n2-0 is allocated on n2: {why}; its allocations are left as they are",
            {"pod": 0, "seen": sorted(seen), "allocated": ["GPU-n2-0"]},
        )
    ]
    # Something else seen later is said too.
    report(store, t(15), **{marker: ["GPU-h1-0"]})
    assert len(events(store, "gpu-readback-mismatch")) == 2


def test_reports_of_unknown_or_ended_workloads_change_nothing(store: FleetStore) -> None:
    alice, marker = admit(store, t(1), "alice")
    store.workloads.end(t(2), alice, "stopped", "the server stopped")

    result = report(store, t(5), **{marker: ["GPU-n2-1"], "markerfromelsewhere": ["GPU-n2-1"]})
    assert result == ReadbackResult((), (), ("markerfromelsewhere",))
    assert history(store, alice) == [("GPU-n2-0", t(1), t(2))]
    assert events(store, "gpus-read-back") == events(store, "gpu-readback-mismatch") == []


# ------------------------------------------------------------------ the planner alone
A, B, C = (1, 0), (2, 0), (3, 0)
FACTS = {
    "g0": GpuFacts(10, "A100", 0),
    "g1": GpuFacts(10, "A100", 1),
    "g2": GpuFacts(10, "A100", 2),
    "g3": GpuFacts(10, "A100", 3),
    "s0": GpuFacts(10, "A100:1g.10gb", 4),
}


def on_n10(*uuids: str) -> Held:
    return Held(10, "A100", frozenset(uuids))


def test_three_pods_that_each_have_the_next_ones_gpu_rotate() -> None:
    held = {A: on_n10("g0"), B: on_n10("g1"), C: on_n10("g2")}
    seen = {A: frozenset({"g1"}), B: frozenset({"g2"}), C: frozenset({"g0"})}
    assert plan_reseat(held, seen, FACTS) == ReseatPlan(
        {A: frozenset({"g1"}), B: frozenset({"g2"}), C: frozenset({"g0"})},
        frozenset({A, B, C}),
        {},
    )


def test_a_pod_keeps_what_it_still_has_and_a_displaced_one_gets_what_was_left() -> None:
    held = {A: on_n10("g0", "g1"), B: on_n10("g2")}
    seen = {A: frozenset({"g1", "g2"})}
    assert plan_reseat(held, seen, FACTS) == ReseatPlan(
        {A: frozenset({"g1", "g2"}), B: frozenset({"g0"})}, frozenset({A}), {}
    )


def test_one_gpu_seen_in_two_pods_is_recorded_for_neither() -> None:
    held = {A: on_n10("g0"), B: on_n10("g1"), C: on_n10("g2")}
    seen = {A: frozenset({"g3"}), B: frozenset({"g3"}), C: frozenset({"g2"})}
    plan = plan_reseat(held, seen, FACTS)
    assert plan.moves == {}
    assert plan.mismatches == {
        A: Mismatch("shared", "GPU g3 is also seen in workload 2's processes"),
        B: Mismatch("shared", "GPU g3 is also seen in workload 1's processes"),
    }
    # Nor one whose holder's processes are read back with it.
    seen = {A: frozenset({"g2"}), C: frozenset({"g2"})}
    assert plan_reseat(held, seen, FACTS).mismatches == {
        A: Mismatch("shared", "GPU g2 is also seen in workload 3's processes")
    }


def test_a_gpu_of_another_type_is_not_recorded() -> None:
    plan = plan_reseat({A: on_n10("g0")}, {A: frozenset({"s0"})}, FACTS)
    assert plan == ReseatPlan({}, frozenset(), {A: Mismatch("gpu-type", "GPU(s) s0 are not A100")})


def test_markers_name_a_workload_and_a_pod() -> None:
    assert split_marker("0a1b2c3d") == ("0a1b2c3d", 0)
    assert split_marker("0a1b2c3d.3") == ("0a1b2c3d", 3)
    assert split_marker("0a1b2c3d.x") is None
