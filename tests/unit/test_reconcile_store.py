"""The reconciler's store methods and its read of the database, on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, select

from gpufleet.hub.metrics import ControllerMetrics
from gpufleet.hub.notifier import Notifier
from gpufleet.hub.reconcile import RecordedWorkload
from gpufleet.hub.reconciler import (
    last_workloads,
    open_session_exists,
    recorded_workloads,
    settle_before_start,
)
from gpufleet.recovery import processes
from gpufleet.scheduler.errors import InvalidRequest, LeaseLost, NotFound
from gpufleet.scheduler.validation import SessionRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import Allocation, Event, Node, Workload, WorkloadState

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(
        T0,
        [{"name": "vision", "quotas": {"A100": {"guaranteed": 2}}}],
        [{"name": "lab", "default": True}],
        [{"name": "standard", "rank": 100}],
    )
    node = NodeSpec("a1", "local", "zone-a", "A100", (GpuSpec("GPU-0", 0), GpuSpec("GPU-1", 1)))
    store.nodes.register_nodes(T0, "agent-1", [node])
    store.projects.sync_memberships(T0, {"vision": ["alice", "bob"]})
    return store


def ask(store: FleetStore, now: datetime, username: str, marker: str | None = None) -> int:
    request = SessionRequest(username, "", "vision", "A100", 1, None)
    workload_id = store.workloads.open_session_request(now, request, LEASE).id
    if marker is not None:
        store.reconcile.record_process_marker(now, workload_id, marker)
    return workload_id


def run_on_gpu(store: FleetStore, workload_id: int, gpu: str, now: datetime) -> None:
    """Seed an admitted-then-running workload directly (the scheduler is tested elsewhere)."""
    with store.read() as session, session.begin():
        workload = session.get_one(Workload, workload_id)
        node = session.scalars(select(Node)).one()
        session.add(
            Allocation(
                workload_id=workload_id,
                gpu_uuid=gpu,
                node_id=node.id,
                project_id=workload.project_id,
                username=workload.username,
                gpu_type="A100",
                opened_at=now,
            )
        )
        workload.state = WorkloadState.running
        workload.admitted_at = workload.started_at = now
        workload.lease_expires_at = None
        workload.version += 2


def test_a_workload_keeps_the_first_marker_its_backend_sent(store: FleetStore) -> None:
    alice = ask(store, t(1), "alice", marker="m-alice-0001")
    store.reconcile.record_process_marker(t(2), alice, "m-alice-0001")  # the same again: fine
    with pytest.raises(InvalidRequest, match="already has a process marker"):
        store.reconcile.record_process_marker(t(3), alice, "m-other-0002")
    with pytest.raises(NotFound):
        store.reconcile.record_process_marker(t(3), 999, "m-alice-0001")
    with store.read() as session:
        assert session.get_one(Workload, alice).process_marker == "m-alice-0001"


def test_ending_a_lost_workload_closes_its_gpus_and_says_why(store: FleetStore) -> None:
    alice = ask(store, t(1), "alice", marker="m-alice-0001")
    run_on_gpu(store, alice, "GPU-0", t(2))
    with store.read() as session:
        version = session.get_one(Workload, alice).version

    reason = "the hub no longer runs server (default) of alice and ..."
    assert (
        store.reconcile.end_reconciled(t(9), alice, version - 1, "lost", "session-lost", reason)
        is None
    )
    ended = store.reconcile.end_reconciled(t(10), alice, version, "lost", "session-lost", reason)
    assert ended is not None and ended.state == WorkloadState.ended
    assert (
        store.reconcile.end_reconciled(t(11), alice, ended.version, "lost", "session-lost", reason)
        is None
    )

    with store.read() as session:
        workload = session.get_one(Workload, alice)
        assert (workload.outcome, workload.reason, workload.ended_at) == ("lost", reason, t(10))
        assert [a.closed_at for a in workload.allocations] == [t(10)]
        events = session.execute(
            select(Event.kind, Event.reason, Event.message, Event.username, Event.data)
            .where(Event.workload_id == alice, Event.at == t(10))
            .order_by(Event.id)
        ).all()
    assert [tuple(e) for e in events] == [
        (
            "reconciled",
            "session-lost",
            reason,
            "alice",
            {"repair": "end-workload", "outcome": "lost"},
        ),
        ("ended", "lost", f"workload {alice} ended (lost): {reason}", "alice", {}),
    ]


def test_repairs_outside_the_database_are_events_too(store: FleetStore) -> None:
    bob = ask(store, t(1), "bob")
    store.reconcile.record_reconciled(
        t(5), "stopping the server", rule="server-without-gpus", workload_id=bob, data={"x": 1}
    )
    store.reconcile.record_reconciled(t(6), "found process 12 ...", rule="orphan-processes")
    with store.read() as session:
        rows = session.execute(
            select(Event.workload_id, Event.username, Event.reason, Event.message, Event.data)
            .where(Event.kind == "reconciled")
            .order_by(Event.id)
        ).all()
    assert [tuple(r) for r in rows] == [
        (bob, "bob", "server-without-gpus", "stopping the server", {"x": 1}),
        (None, None, "orphan-processes", "found process 12 ...", {}),
    ]


def test_a_controller_without_the_lease_repairs_nothing(store: FleetStore, engine: Engine) -> None:
    alice = ask(store, t(1), "alice", marker="m-alice-0001")
    other = FleetStore(engine, "controller-b", lease_ttl=timedelta(seconds=15))
    assert other.try_acquire_lease(t(60))  # the first one's lease expired
    with pytest.raises(LeaseLost):
        store.reconcile.end_reconciled(t(61), alice, 1, "lost", "session-lost", "...")
    with pytest.raises(LeaseLost):
        store.reconcile.record_reconciled(t(61), "...", rule="orphan-processes")
    with store.read() as session:
        assert session.get_one(Workload, alice).state == WorkloadState.pending


def test_the_reconciler_reads_open_workloads_and_ended_ones_whose_marker_is_alive(
    store: FleetStore,
) -> None:
    alice = ask(store, t(1), "alice", marker="m-alice-0001")
    run_on_gpu(store, alice, "GPU-0", t(2))
    bob = ask(store, t(3), "bob", marker="m-bob-00000001")
    run_on_gpu(store, bob, "GPU-1", t(4))
    store.workloads.end(t(5), bob, "stopped", "the server stopped")
    old = ask(store, t(6), "bob")  # pending, no marker yet
    with store.read() as session, session.begin():
        # A stop decided at t(8) (the preemption or culler path records an event).
        session.get_one(Workload, alice).state = WorkloadState.stopping
    store.reconcile.record_reconciled(t(8), "stop decided", rule="stop-overdue", workload_id=alice)

    with store.read() as session:
        versions = {w.id: w.version for w in session.scalars(select(Workload))}
    assert recorded_workloads(store, ["m-bob-00000001", "m-unknown-0001"]) == [
        RecordedWorkload(
            alice, versions[alice], "session", "alice", "", "stopping", t(8), "m-alice-0001"
        ),
        RecordedWorkload(
            bob, versions[bob], "session", "bob", "", "ended", t(5), "m-bob-00000001", "stopped"
        ),
        RecordedWorkload(old, versions[old], "session", "bob", "", "pending", t(6), None),
    ]
    # Ended workloads whose marker no process carries are not read at all.
    assert [w.id for w in recorded_workloads(store, [])] == [alice, old]
    # A ready server with none open: its last workload says since when it holds no GPUs.
    assert last_workloads(store, [("bob", ""), ("bob", "other")]) == [
        RecordedWorkload(old, versions[old], "session", "bob", "", "pending", t(6), None)
    ]
    # The second look before stopping a server: is any workload open for it?
    assert open_session_exists(store, "bob", "")  # the new start, pending
    assert not open_session_exists(store, "bob", "other")
    store.workloads.end(t(9), old, "withdrawn", "cancelled")
    assert not open_session_exists(store, "bob", "")


# ------------------------------------------------------------------ a new start


@dataclass
class Controller:
    """What ``settle_before_start`` uses of the controller."""

    store: FleetStore
    metrics: ControllerMetrics
    notifier: Notifier = field(default_factory=Notifier)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("test-settle"))
    clock: datetime = T0
    kicks: int = 0

    def now(self) -> datetime:
        return self.clock

    def kick(self) -> None:
        self.kicks += 1

    async def live_pod_markers(self) -> frozenset[str] | None:
        return frozenset()  # no Kubernetes clusters


@contextmanager
def marked_sleep(marker: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, processes.MARKER_VARIABLE: marker})
    try:
        wait_until(lambda: proc.pid in processes.marked_pids(marker))
        yield proc
    finally:
        proc.kill()
        proc.wait()


def wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def test_a_new_start_ends_the_previous_workload_at_once_when_nothing_of_it_runs(
    store: FleetStore,
) -> None:
    marker = processes.new_marker()
    alice = ask(store, t(1), "alice", marker=marker)
    run_on_gpu(store, alice, "GPU-0", t(2))
    controller = Controller(store, ControllerMetrics(store), clock=t(3))  # no grace

    with marked_sleep(marker) as alive:
        with pytest.raises(InvalidRequest) as refused:
            await settle_before_start(controller, "alice", "")
        assert str(refused.value).startswith(
            f"server (default) of alice still holds GPUs as workload {alice} (running): "
            f"process {alive.pid} of it is still alive on this machine"
        )
        with store.read() as session:
            assert session.get_one(Workload, alice).state == WorkloadState.running

    await settle_before_start(controller, "alice", "")
    with store.read() as session:
        workload = session.get_one(Workload, alice)
        assert (workload.state, workload.outcome) == (WorkloadState.ended, "lost")
        assert [a.closed_at for a in workload.allocations] == [t(3)]
        events = session.execute(
            select(Event.kind, Event.reason, Event.message).where(
                Event.workload_id == alice, Event.kind == "reconciled"
            )
        ).all()
    assert [tuple(e) for e in events] == [
        (
            "reconciled",
            "session-lost",
            f"a new start of server (default) of alice found workload {alice} still running "
            "although the hub no longer runs the server, and no process of it is alive; its "
            "GPUs are released",
        )
    ]
    assert controller.kicks == 1
    # Then the new request opens as any other.
    assert ask(store, t(4), "alice", marker=processes.new_marker()) > alice


async def test_a_new_start_leaves_other_servers_and_waiting_requests_alone(
    store: FleetStore,
) -> None:
    alice = ask(store, t(1), "alice", marker="m-alice-0001")
    run_on_gpu(store, alice, "GPU-0", t(2))
    bob = ask(store, t(3), "bob", marker="m-bob-00000001")  # pending
    controller = Controller(store, ControllerMetrics(store), clock=t(4))

    await settle_before_start(controller, "bob", "")
    await settle_before_start(controller, "alice", "other")
    with store.read() as session:
        assert session.get_one(Workload, alice).state == WorkloadState.running
        assert session.get_one(Workload, bob).state == WorkloadState.pending
    assert controller.kicks == 0
