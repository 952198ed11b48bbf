"""Admission cycles planned away from the event loop (hub/scheduling.py): the API answers
while a cycle is planned, a plan that went stale meanwhile is dropped unwritten, the
planning process commits what a cycle planned here would, comes back after dying, and
goes away with the controller.

Over real databases (the ``store`` fixture: SQLite and PostgreSQL) and a real planning
process; the controller around the cycles is a small stand-in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpufleet.hub import scopes
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.metrics import ControllerMetrics
from gpufleet.hub.notifier import Notifier
from gpufleet.hub.scheduling import AdmissionCycles
from gpufleet.scheduler.idle import IdleCause
from gpufleet.scheduler.snapshot import Policy, Running
from gpufleet.state import db
from gpufleet.state.cycle import Outcome, PlannedCycle, Stop
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Event, Workload
from gpufleet.state.planners import ProcessPlanner, ThreadPlanner

from .test_store import (
    GROUPS,
    NODES,
    PRIORITY_CLASSES,
    PROFILES,
    PROJECTS,
    T0,
    allocations,
    ask,
    make_store,
    store,
    t,
    workload,
)

__all__ = ["store"]  # the fixture

PREFIX = "/services/gpufleet/"
POLICY = Policy(min_run_time_s=0)
GROUP_OF = {"alice": "vision", "bob": "vision", "carol": "nlp"}
SPAWNER = Identity("service", "spawner", frozenset({scopes.SPAWN}), by_cookie=False)


class Victims:
    """Who would ask the backends to stop preempted workloads: here, notes who."""

    def __init__(self) -> None:
        self.stopped: list[int] = []
        self.still_stopping: list[dict[int, str]] = []  # what each retry was told

    def stop(self, stops: Iterable[Stop]) -> None:
        self.stopped += [s.workload_id for s in stops]

    def retry(self, running: Iterable[Running], server_names: dict[int, str]) -> None:
        self.still_stopping.append({r.id: server_names[r.id] for r in running if r.stopping})


@dataclass
class Controller:
    """What the admission cycles and the handlers use of the controller (hub/context.py,
    hub/scheduling.py), over a real store; its clock is set by the test."""

    store: FleetStore
    clock: datetime = T0
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("test_cycles"))
    version: str = "test"
    is_leader: bool = True
    spare_nodes: frozenset[str] = frozenset()
    recovery_spares: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ControllerMetrics(self.store)
        self.notifier = Notifier()
        self.victims = Victims()

    def now(self) -> datetime:
        return self.clock

    def kick(self) -> None:
        return

    async def identify(self, handler: web.RequestHandler) -> Identity | None:
        return SPAWNER

    async def refresh_memberships(self, max_age: float) -> None:
        return


def cycles_of(controller: Controller, planner: str) -> AdmissionCycles:
    """The cycles as the controller makes them, with ``POLICY``'s times and cycles only
    when the test asks for them (a long interval)."""
    return AdmissionCycles(
        controller, planner=planner, interval=60.0, min_run_time_seconds=POLICY.min_run_time_s
    )


def gated_store(engine: Engine) -> FleetStore:
    """``test_store.make_store``'s fleet, in a store whose planning can be held."""
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    gate = threading.Event()
    gate.set()
    plan = store.scheduling.plan_cycle

    def gated_plan(*args: Any, **kwargs: Any) -> PlannedCycle:
        gate.wait(30)
        return plan(*args, **kwargs)

    # On the instance, not a second scheduling repository over the same database: the
    # controller makes one, and a second one's change tracker missed commits here.
    store.scheduling.plan_cycle = gated_plan  # type: ignore[method-assign]
    store.scheduling.gate = gate  # type: ignore[attr-defined]
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(T0, PROJECTS, PROFILES, PRIORITY_CLASSES)
    store.nodes.register_nodes(T0, "agent-1", NODES)
    store.projects.sync_memberships(T0, GROUPS)
    return store


@contextmanager
def planning_held(cycles: AdmissionCycles) -> Iterator[None]:
    """The cycles' planner makes no progress inside the block: the planning process is
    stopped (SIGSTOP), or the gated store's plan waits."""
    planner = cycles.worker
    if isinstance(planner, ProcessPlanner):
        assert planner.pid is not None, "the planning process has not started yet"
        os.kill(planner.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(planner.pid, signal.SIGCONT)
    else:
        assert isinstance(planner, ThreadPlanner)
        gate = planner.store.gate  # type: ignore[attr-defined]
        gate.clear()
        try:
            yield
        finally:
            gate.set()


@asynccontextmanager
async def api(controller: Controller) -> AsyncIterator[httpx.AsyncClient]:
    """The controller's API served in this process, on this event loop."""
    sock, port = bind_unused_port()
    server = HTTPServer(web.Application(routes(PREFIX, controller)))
    server.add_sockets([sock])
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}{PREFIX}api/v1", timeout=10
        ) as client:
            yield client
    finally:
        server.stop()
        await server.close_all_connections()


@pytest.fixture(params=["process", "thread"])
def cycles(request: pytest.FixtureRequest, engine: Engine) -> Iterator[AdmissionCycles]:
    store = gated_store(engine)
    admission = cycles_of(Controller(store), request.param)
    try:
        yield admission
    finally:
        admission.close()


async def test_the_api_answers_while_a_cycle_is_planned(cycles: AdmissionCycles) -> None:
    store = cycles.controller.store
    assert await cycles.run_cycle() is not None  # the planner is up and knows the fleet
    alice = ask(store, t(1), "alice", gpus=2)
    with planning_held(cycles):
        cycle = asyncio.create_task(cycles.run_cycle())
        async with api(cycles.controller) as client:  # type: ignore[arg-type]
            answer = await client.get("/workloads", params={"state": "pending"})
        # Answered while the plan is still being made: the cycle has not ended.
        assert answer.status_code == 200
        assert [w["id"] for w in answer.json()["items"]] == [alice]
        assert not cycle.done()
    result = await cycle
    assert result is not None and [a.workload_id for a in result.admitted] == [alice]
    assert workload(store, alice).reason == "admitted on a2 (zone-a)"


@pytest.mark.parametrize("change", ["cordon", "withdrawal", "takeover"])
def test_a_plan_gone_stale_while_it_was_made_is_dropped_unwritten(
    store: FleetStore, engine: Engine, change: str
) -> None:
    """What committed while a plan was made and that the plan relies on — the node it
    places on, the request it admits, the whole database after another controller held
    the lease — drops it; nothing of it is written and the next cycle decides afresh."""
    alice = ask(store, t(1), "alice", gpus=2)
    carol = ask(store, t(1), "carol", project="nlp", gpus=1)
    planned = store.scheduling.plan_cycle(t(2), POLICY)
    placed = {a.workload_id: a.pods[0].node for a in planned.result.plan.admissions}
    assert placed == {alice: "a2", carol: "a1"}
    if change == "cordon":
        assert store.nodes.set_cordoned(t(2), "a2", True, by="admin")
    elif change == "withdrawal":
        store.workloads.end(t(2), carol, "withdrawn", "the spawn was cancelled")
    else:
        store.scheduling.forget_mirror()
    assert not store.scheduling.commit_cycle(planned)
    store.scheduling.settle_cycle(Outcome.DROPPED)
    assert allocations(store) == []
    with store.read() as session:
        assert session.scalars(select(Event).where(Event.kind == "admitted")).all() == []

    # The next plan is what a planner that never saw the dropped one makes.
    again = store.scheduling.plan_cycle(t(3), POLICY)
    fresh = FleetStore(engine, "controller-b").scheduling.plan_cycle(t(3), POLICY)
    assert again.result.plan == fresh.result.plan
    assert store.scheduling.commit_cycle(again)
    store.scheduling.settle_cycle(Outcome.COMMITTED)
    admitted = {w for w, _, closed in allocations(store) if closed is None}
    if change == "cordon":  # on a1 now, both of them
        assert workload(store, alice).reason == "admitted on a1 (zone-a)"
        assert admitted == {alice, carol}
    elif change == "withdrawal":
        assert admitted == {alice}
    else:
        assert admitted == {alice, carol}


async def test_the_planning_process_commits_what_a_cycle_here_would(
    store: FleetStore, tmp_path: Path
) -> None:
    """The same requests through cycles planned in the planning process and through
    cycles run here, on a second database: the same rows, reasons and events, and the
    idle GPUs for the metrics (vision holds its cap of 2; bob's third waits on it)."""
    engine_here = db.make_engine(f"sqlite:///{tmp_path / 'here.sqlite'}")
    db.upgrade(engine_here)
    here = make_store(engine_here)
    controller = Controller(store)
    cycles = cycles_of(controller, "process")
    idle = []
    try:
        for at, user, gpus in [(1, "alice", 2), (3, "bob", 1), (5, "carol", 4)]:
            ask(store, t(at), user, gpus=gpus, project=GROUP_OF[user])
            ask(here, t(at), user, gpus=gpus, project=GROUP_OF[user])
            controller.clock = t(at + 1)
            assert await cycles.run_cycle() is not None
            here.scheduling.scheduling_cycle(t(at + 1), POLICY)
            assert what_a_person_reads(store) == what_a_person_reads(here)
            idle.append(store.scheduling.idle_gpus())
            assert idle[-1] == here.scheduling.idle_gpus()
    finally:
        cycles.close()
    assert idle == [{}, {"A100": {IdleCause.CAPS: 4}}, {"A100": {}}]
    assert "vision" in what_a_person_reads(store)[0][1]["bob"][1]


async def test_a_victim_the_planning_process_preempts_is_stopped_then_retried(
    store: FleetStore,
) -> None:
    """carol's second session borrows beyond nlp's guarantee; alice asks within vision's:
    the cycle planned in the process preempts the borrower, its stop is asked once, and
    the cycles after it retry it (by its server's name) until it is gone."""
    controller = Controller(store)
    victims = controller.victims
    assert isinstance(victims, Victims)
    cycles = cycles_of(controller, "process")
    try:
        ask(store, t(1), "carol", project="nlp", gpus=4)
        extra = ask(store, t(2), "carol", server="extra", project="nlp", gpus=2)
        controller.clock = t(3)
        assert await cycles.run_cycle() is not None
        alice = ask(store, t(5), "alice", gpus=2)
        controller.clock = t(6)
        result = await cycles.run_cycle()
        assert result is not None and [s.workload_id for s in result.stops] == [extra]
        controller.clock = t(7)
        assert await cycles.run_cycle() is not None
        assert victims.stopped == [extra]
        assert victims.still_stopping[-2:] == [{extra: "extra"}, {extra: "extra"}]
        store.workloads.end(t(8), extra, "stopped", "the server stopped")
        controller.clock = t(9)
        result = await cycles.run_cycle()
        assert result is not None and [a.workload_id for a in result.admitted] == [alice]
        assert victims.still_stopping[-1] == {}
    finally:
        cycles.close()


def what_a_person_reads(store: FleetStore) -> tuple[Any, ...]:
    """Each user's workload (state, reason, place in the queue), and the events."""
    with store.read() as session:
        rows = session.scalars(select(Workload)).all()
        events = session.execute(select(Event.kind, Event.message).order_by(Event.id)).all()
        return (
            (len(rows), {w.username: (w.state, w.reason, w.queue_position) for w in rows}),
            [tuple(e) for e in events if e[0] in ("admitted", "waiting", "preempting")],
        )


@pytest.mark.parametrize("when", ["between cycles", "mid-plan"])
async def test_a_planning_process_that_died_is_started_again(store: FleetStore, when: str) -> None:
    """Killed between two cycles, the next starts another planning process; killed
    while it plans, that cycle fails (logged) and the next starts another. Either way
    the new one reads everything and admits what asked meanwhile."""
    controller = Controller(store)
    cycles = cycles_of(controller, "process")
    try:
        assert await cycles.run_cycle() is not None
        planner = cycles.worker
        assert isinstance(planner, ProcessPlanner) and planner.pid is not None
        first = planner.pid
        alice = ask(store, t(1), "alice")
        controller.clock = t(2)
        if when == "mid-plan":
            os.kill(first, signal.SIGSTOP)
            cycle = asyncio.create_task(cycles.run_cycle())
            await wait_until(lambda: planner.asked_at is not None, "the plan to be asked for")
            os.kill(first, signal.SIGKILL)
            assert await cycle is None
        else:
            os.kill(first, signal.SIGKILL)
            await wait_until(lambda: planner.pid is None, "the planning process to die")
        controller.clock = t(3)
        result = await cycles.run_cycle()
        assert result is not None and [a.workload_id for a in result.admitted] == [alice]
        assert planner.pid not in (None, first)
    finally:
        cycles.close()


async def wait_until(condition: Callable[[], bool], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_stopping_the_controller_while_a_cycle_is_planned_writes_nothing(
    store: FleetStore,
) -> None:
    """The cycles' task cancelled mid-plan (the controller stopping): it ends at once,
    the planning process with it, and nothing of the cycle is written."""
    cycles = cycles_of(Controller(store), "process")
    assert await cycles.run_cycle() is not None
    planner = cycles.worker
    assert isinstance(planner, ProcessPlanner) and planner.pid is not None
    child = planner.pid
    ask(store, t(1), "alice")
    os.kill(child, signal.SIGSTOP)  # a plan that takes as long as it takes
    running = asyncio.create_task(cycles.run())
    cycles.kick()
    await wait_until(lambda: planner.asked_at is not None, "the plan to be asked for")
    assert not running.done()
    started = time.monotonic()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert time.monotonic() - started < 10
    assert planner.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # reaped
    assert allocations(store) == []


def test_an_in_memory_database_cannot_be_planned_in_a_process() -> None:
    store = FleetStore(db.make_engine("sqlite://"), "controller-a")
    with pytest.raises(ValueError, match="planner = 'thread'"):
        cycles_of(Controller(store), "process")
