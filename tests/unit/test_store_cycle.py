"""The scheduling cycle against real databases (SQLite and PostgreSQL): borrowing and
reclaim committed as a user sees them, the mirror following every committed change (and
equal to one read afresh after random changes), and a cycle whose rows changed underneath
rolling back whole."""

from __future__ import annotations

import random
from datetime import datetime

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, text
from sqlalchemy.event import listen, remove

from gpufleet.hub.metrics import ControllerMetrics
from gpufleet.scheduler.errors import CycleConflict
from gpufleet.scheduler.idle import IdleCause
from gpufleet.scheduler.snapshot import Policy, SchedulingSnapshot
from gpufleet.state.cycle import CycleResult
from gpufleet.state.fleet import FleetStore
from gpufleet.state.mirror import EVERYTHING, Mirror
from gpufleet.state.models import Event, Node, Workload, WorkloadState

from .test_store import allocations, ask, events, store, t, workload

__all__ = ["store"]  # the fixture

NOW_POLICY = Policy(min_run_time_s=0)


def cycle(store: FleetStore, now: datetime) -> CycleResult:
    return store.scheduling.scheduling_cycle(now, NOW_POLICY)


def test_a_borrower_is_reclaimed_for_a_guarantee_and_ends_as_preempted(store: FleetStore) -> None:
    # nlp: 4 guaranteed A100, no borrow limit; the fleet has 6 A100 (a1: 4, a2: 2).
    carol = ask(store, t(1), "carol", project="nlp", gpus=4)
    extra = ask(store, t(2), "carol", server="extra", project="nlp", gpus=2)
    cycle(store, t(3))
    assert workload(store, extra).reason == (
        "admitted on a2 (zone-a); 2 borrowed beyond project nlp's guarantee"
    )
    store.workloads.mark_running(t(4), extra)
    assert workload(store, extra).reason == (
        "running on a2 (zone-a); 2 borrowed beyond project nlp's guarantee"
    )

    # vision asks within its guarantee (2): only the borrower can make room.
    alice = ask(store, t(5), "alice", gpus=2)
    result = store.scheduling.scheduling_cycle(t(6), NOW_POLICY)
    assert [(s.workload_id, s.kind, s.user, s.server_name) for s in result.stops] == [
        (extra, "session", "carol", "extra")
    ]
    victim = workload(store, extra)
    assert victim.state == WorkloadState.stopping
    assert victim.preempted_for_id == alice
    assert victim.reason.startswith("preempted: it ran on GPUs borrowed beyond project nlp")
    waiting = workload(store, alice)
    assert (waiting.state, waiting.reason) == (
        WorkloadState.pending,
        "Other work is stopping to make room: needs 2 × A100, stopping workload(s) "
        f"{extra} to free 2 GPU(s)",
    )
    assert events(store, "preempting") == [
        f"workload {extra} is being stopped to make room for workload {alice}: it ran on GPUs "
        f"borrowed beyond project nlp's guarantee, which workload {alice} of project vision "
        "needed within its own guarantee"
    ]

    # While it stops, nothing more is preempted and its GPUs stay allocated.
    again = store.scheduling.scheduling_cycle(t(7), NOW_POLICY)
    assert again.stops == () and again.admitted == ()
    assert workload(store, alice).reason == (
        "Other work is stopping to make room: needs 2 × A100, waiting for 2 GPU(s) being "
        f"freed by preempted workload(s) {extra}"
    )

    # The backend observed it gone: it ends as preempted, whatever it called the stop.
    ended = store.workloads.end(t(8), extra, "stopped", "the server stopped")
    assert (ended.outcome, ended.state) == ("preempted", WorkloadState.ended)
    assert ended.reason.startswith("preempted: ") and ended.reason.endswith("the server stopped")
    assert [
        a.workload_id for a in store.scheduling.scheduling_cycle(t(9), NOW_POLICY).admitted
    ] == [alice]
    assert {w for w, _, closed in allocations(store) if closed is None} == {carol, alice}


def test_the_minimum_run_time_delays_a_reclaim(store: FleetStore) -> None:
    ask(store, t(1), "carol", project="nlp", gpus=4)
    ask(store, t(2), "carol", server="extra", project="nlp", gpus=2)
    store.scheduling.scheduling_cycle(t(3), Policy(min_run_time_s=60))
    alice = ask(store, t(5), "alice", gpus=2)
    assert store.scheduling.scheduling_cycle(t(6), Policy(min_run_time_s=60)).stops == ()
    assert workload(store, alice).state == WorkloadState.pending
    assert len(store.scheduling.scheduling_cycle(t(64), Policy(min_run_time_s=60)).stops) == 1


def test_cycles_over_a_fleet_where_nothing_happens_write_nothing(store: FleetStore) -> None:
    running = ask(store, t(1), "carol", project="nlp", gpus=4)
    cycle(store, t(2))
    store.workloads.mark_running(t(3), running)
    waiting = ask(store, t(3), "alice", gpus=4)  # no node has 4 free: it waits
    cycle(store, t(4))
    commits: list[object] = []
    count = commits.append  # one bound method, so that ``remove`` finds it
    listen(store.engine, "commit", count)
    try:
        for second in (5, 6, 7):  # what a controller does every interval
            assert store.workloads.expire_leases(t(second)) == []
            assert cycle(store, t(second)).admitted == ()
        assert commits == []
        # Something to do is still done at once: a request that fits is admitted.
        fits = ask(store, t(8), "bob", gpus=1)
        assert [a.workload_id for a in cycle(store, t(8)).admitted] == [fits]
    finally:
        remove(store.engine, "commit", count)
    assert workload(store, waiting).state == WorkloadState.pending


def test_the_mirror_follows_committed_changes_only(store: FleetStore) -> None:
    cycle(store, t(1))  # the first cycle reads everything
    assert store.nodes.set_cordoned(t(2), "a2", True, by="admin")
    assert not store.nodes.set_cordoned(t(2), "a2", True, by="admin")  # already: no change
    alice = ask(store, t(3), "alice")
    cycle(store, t(4))
    assert allocations(store) == [(alice, "GPU-a1-0", None)]  # a2 would be the best fit
    with store.read() as session:
        assert session.scalars(
            select(Event.message).where(Event.kind == "node-cordoned")
        ).all() == ["node a2 cordoned by admin; it receives no new work"]

    # A rolled-back transaction changed nothing, and the mirror must not think it did.
    with pytest.raises(RuntimeError), store.database.write(t(5)) as session:
        node = session.scalar(select(Node).where(Node.name == "a2"))
        assert node is not None
        node.cordoned = False
        session.flush()  # the change tracker sees the flush...
        raise RuntimeError("abandoned")  # ...but the transaction never commits
    bob = ask(store, t(6), "bob")
    cycle(store, t(7))
    assert (bob, "GPU-a1-1", None) in allocations(store)  # a2 still cordoned


def test_a_cycle_whose_rows_changed_underneath_rolls_back_whole(store: FleetStore) -> None:
    alice = ask(store, t(1), "alice")
    ask(store, t(1), "bob")
    ask(store, t(1), "carol", project="nlp", gpus=4)
    cycle(store, t(2))  # all 6 A100 taken
    late = ask(store, t(3), "carol", server="two", project="nlp")
    cycle(store, t(4))  # the mirror knows it waits...
    # ...and a write that bypasses the store withdraws it behind the controller's back.
    with store.engine.begin() as connection:
        connection.execute(
            text("UPDATE workloads SET state = 'ended' WHERE id = :id"), {"id": late}
        )
    store.workloads.end(t(5), alice, "stopped", "")  # a GPU frees up: the plan gives it to `late`
    before = allocations(store)
    with pytest.raises(CycleConflict):
        cycle(store, t(6))
    assert allocations(store) == before  # nothing of the cycle was committed
    # The next cycle reads everything again and decides on what is really there.
    assert cycle(store, t(7)).admitted == ()
    assert allocations(store) == before


def held_in_rows(store: FleetStore) -> dict[int, tuple[str | None, str | None]]:
    with store.read() as session:
        rows = session.execute(
            select(Workload.id, Workload.held_cluster, Workload.held_zone).where(
                Workload.held_cluster.is_not(None) | Workload.held_zone.is_not(None)
            )
        )
        return {wid: (cluster, zone) for wid, cluster, zone in rows}


def test_the_zone_held_for_a_request_is_handed_back_to_the_next_cycle(store: FleetStore) -> None:
    """The zone the last plan held for a request is handed to the next plan
    (``Pending.held_zone``) so that the hold stays put: across full reads, and across a
    restart of the controller (its row says so)."""
    ask(store, t(1), "carol", project="nlp", gpus=4)
    alice = ask(store, t(1), "alice", gpus=2)
    cycle(store, t(2))  # every A100 taken
    late = ask(store, t(3), "carol", server="two", project="nlp", gpus=2)
    cycle(store, t(4))
    assert workload(store, late).reason.endswith("zone-a is kept for you as GPUs free up")
    assert store.scheduling.mirror.pending[late].held_zone == ("local", "zone-a")
    assert held_in_rows(store) == {late: ("local", "zone-a")}
    with store.read() as session:
        store.scheduling.mirror.refresh(session, {EVERYTHING}, t(5).timestamp())
    assert store.scheduling.mirror.pending[late].held_zone == ("local", "zone-a")
    # A new controller process: nothing in memory, the rows read afresh.
    store.scheduling.mirror = Mirror()
    store.scheduling.forget_mirror()
    store.scheduling.refresh_mirror(t(5))
    assert store.scheduling.mirror.pending[late].held_zone == ("local", "zone-a")
    assert store.scheduling.mirror.holding == {late: ("local", "zone-a")}

    store.workloads.end(t(6), alice, "stopped", "")
    assert [a.workload_id for a in cycle(store, t(7)).admitted] == [late]
    assert store.scheduling.mirror.holding == {}
    assert held_in_rows(store) == {}  # cleared with the admission


def test_a_hold_given_up_is_cleared_from_its_row(store: FleetStore) -> None:
    """A request the plan no longer holds a zone for has its row say so, so that a
    restarted controller does not hold for it again."""
    ask(store, t(1), "carol", project="nlp", gpus=4)
    ask(store, t(1), "alice", gpus=2)
    cycle(store, t(2))  # every A100 taken
    late = ask(store, t(3), "carol", server="two", project="nlp", gpus=2)
    cycle(store, t(4))
    assert held_in_rows(store) == {late: ("local", "zone-a")}
    # Every A100 node cordoned: no zone can take new work, so none is held.
    for node in ("a1", "a2"):
        assert store.nodes.set_cordoned(t(5), node, True, by="admin")
    cycle(store, t(6))
    assert "cordoned" in workload(store, late).reason
    assert store.scheduling.mirror.holding == {}
    assert held_in_rows(store) == {}


def _world(snapshot: SchedulingSnapshot) -> tuple[object, ...]:
    return (
        sorted(snapshot.nodes, key=lambda n: (n.name, n.gpu_type)),
        sorted(snapshot.running, key=lambda r: r.id),
        sorted(snapshot.queue, key=lambda r: r.id),
        snapshot.projects,
        snapshot.priorities,
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_the_mirror_followed_through_random_changes_equals_one_read_afresh(
    store: FleetStore, seed: int
) -> None:
    """Arrivals, endings, starts, cordons and cycles in a random order: after every cycle
    the mirror, kept up to date by the changes it was told of, holds what a mirror reading
    the whole database holds — the nodes' free GPUs above all."""
    rng = random.Random(seed)
    users = {"alice": "vision", "bob": "vision", "carol": "nlp"}
    live: set[int] = set()
    for step in range(1, 80):
        now = t(step)
        action = rng.choice(["ask", "ask", "end", "start", "cordon", "cycle", "cycle"])
        if action == "ask":
            user = rng.choice(sorted(users))
            gpu_type, gpus = rng.choice([("A100", 1), ("A100", 2), ("A100", 4), ("H100", 1)])
            live.add(
                ask(
                    store,
                    now,
                    user,
                    server=f"s{step}",
                    project=users[user],
                    gpu_type=gpu_type,
                    gpus=gpus,
                )
            )
        elif action == "end" and live:
            ended = rng.choice(sorted(live))
            store.workloads.end(now, ended, "stopped", "")
            live.discard(ended)
        elif action == "start":
            admitted = [
                w for w in sorted(live) if workload(store, w).state == WorkloadState.admitted
            ]
            if admitted:
                store.workloads.mark_running(now, rng.choice(admitted))
        elif action == "cordon":
            node = rng.choice(["a1", "a2", "h1"])
            store.nodes.set_cordoned(now, node, rng.random() < 0.5, by="admin")
        else:
            cycle(store, now)
            fresh = Mirror()
            with store.read() as session:
                fresh.refresh(session, {EVERYTHING}, now.timestamp())
            assert _world(store.scheduling.mirror.snapshot(NOW_POLICY)) == _world(
                fresh.snapshot(NOW_POLICY)
            )


def test_the_idle_gpus_after_a_cycle_say_why_nothing_waiting_uses_them(store: FleetStore) -> None:
    """vision may hold 2 A100 and holds them; bob's third waits on its cap while 4 A100
    are free: the metric puts those 4 down to the caps, not to the scheduler."""
    assert store.scheduling.idle_gpus() == {}  # no cycle yet
    ask(store, t(1), "alice", gpus=2)
    cycle(store, t(2))
    assert store.scheduling.idle_gpus() == {}  # nothing waits
    bob = ask(store, t(3), "bob")
    cycle(store, t(4))
    assert "vision" in workload(store, bob).reason
    assert store.scheduling.idle_gpus() == {"A100": {IdleCause.CAPS: 4}}
    scraped = {
        sample.labels["cause"]: sample.value
        for family in text_string_to_metric_families(
            generate_latest(ControllerMetrics(store).registry).decode()
        )
        for sample in family.samples
        if sample.name == "gpufleet_idle_gpus" and sample.labels["gpu_type"] == "A100"
    }
    assert scraped == {cause.value: 4.0 if cause is IdleCause.CAPS else 0.0 for cause in IdleCause}
    # carol's request fits the free GPUs and her project may have them: admitted.
    ask(store, t(5), "carol", project="nlp", gpus=4)
    cycle(store, t(6))
    assert store.scheduling.idle_gpus() == {"A100": {}}
