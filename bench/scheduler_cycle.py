"""Scheduling-cycle latency at the scale of the platform gpufleet is modelled on.

4 clusters × 3 zones, 2,000 nodes × 8 GPUs = 16,000 GPUs, 200 projects (10 organisations ×
20 projects, guarantees covering 80% of the fleet), about 90% of the GPUs held by running
workloads, and 10,000 waiting workloads: 70% sessions of 1–8 GPUs, 30% jobs of 16–1,024
GPUs (pods of 8). Every cycle first applies churn through the store — arrivals,
completions (which free GPUs for admissions), a node cordoned or uncordoned — and then a
cycle is timed: applying the changes since the last one to the mirror, ``plan``, and
committing the decisions in one transaction (SQLite file in WAL mode, as embedded).

Baseline, in the same run: the same cycle with the mirror rebuilt from the database
(what a scheduler without an incremental snapshot does every cycle). Target: p99 ≤ 100 ms
on one core. Then the scaling table: 1k/4k/16k/64k GPUs at 10k waiting, and 1k/10k/100k
waiting at 16k GPUs.

World "gang-preemption", at the same scale: the running work is mostly big gangs (64–256
GPUs, pods of 8) of projects far beyond their guarantees and of opportunistic work, and
most of the 10,000 waiting are within their project's guarantee, so every cycle runs
preemption searches and stops victims (the preemptions per cycle are printed). Each
cycle's churn ends the victims stopped the cycle before (their backends report them gone),
completes some work (of the projects within guarantee as much as they reclaim, so the
reclaiming never runs out) and brings new arrivals.

Against another revision (``--against REV``): a git worktree of REV (made once, in
/tmp/gpufleet-bench-<rev>) and this tree each run the worlds in a worker process of this
very file, with ``gpufleet`` resolved to that tree's code through a symlink farm that
mirrors ``package-dir`` of the tree's pyproject.toml. The worlds are built by this file's
code on both sides (each side's database made by its own migrations); rounds of cycles
run alternately on the two sides, and p50/p99 of each side and the ratio new/old are
printed per world. Target: p99 new/old <= 1.10.

    .venv/bin/python bench/scheduler_cycle.py [--cycles 100] [--quick] [--profile]
    .venv/bin/python bench/scheduler_cycle.py --against main [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from sqlalchemy import insert, select

from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.store import db
from gpufleet.scheduler.store.fleet import FleetStore
from gpufleet.scheduler.store.models import (
    Allocation,
    Cluster,
    Gpu,
    Node,
    NodeHealth,
    PriorityClass,
    Project,
    ProjectKind,
    ProjectQuota,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)

ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
GPU_TYPE = "H100"
CLASSES = [("critical", 300, False), ("standard", 200, False), ("opportunistic", 100, True)]


def build(path: Path, nodes: int, waiting: int, seed: int = 7) -> tuple[FleetStore, Any]:
    """A database with the fleet, the projects, running work at ~90% and the queue."""
    rng = random.Random(seed)
    engine = db.make_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    capacity = nodes * 8
    with engine.begin() as c:
        _fleet(c, nodes)
        projects, project_ids = [], []
        pid = 0
        for o in range(10):
            pid += 1
            org_id = pid
            projects.append(
                dict(
                    id=org_id,
                    name=f"org{o}",
                    kind=ProjectKind.organisation,
                    display_name="",
                    parent_id=None,
                    default_priority="standard",
                    allowed_priorities=[],
                    fair_share_weight=1.0,
                )
            )
            for p in range(20):
                pid += 1
                project_ids.append(pid)
                projects.append(
                    dict(
                        id=pid,
                        name=f"p{o}-{p}",
                        kind=ProjectKind.project,
                        display_name="",
                        parent_id=org_id,
                        default_priority="standard",
                        allowed_priorities=[],
                        fair_share_weight=1.0 + (p % 3),
                    )
                )
        _insert(c, Project, projects)
        guaranteed = capacity * 8 // 10 // len(project_ids)
        _insert(
            c,
            ProjectQuota,
            [dict(project_id=p, gpu_type=GPU_TYPE, guaranteed=guaranteed) for p in project_ids],
        )
        workloads: list[dict[str, Any]] = []
        allocations: list[dict[str, Any]] = []
        wid = 0

        def workload(
            state: WorkloadState,
            project: int,
            gpus_per_pod: int,
            pods: int,
            kind: WorkloadKind,
            at: datetime,
        ) -> int:
            nonlocal wid
            wid += 1
            workloads.append(
                dict(
                    id=wid,
                    kind=kind,
                    project_id=project,
                    username=f"user{rng.randrange(2000)}",
                    server_name=f"s{wid}",
                    name="",
                    gpu_type=GPU_TYPE,
                    pods=pods,
                    gpus_per_pod=gpus_per_pod,
                    priority_class=rng.choice(["standard"] * 8 + ["critical", "opportunistic"]),
                    preemptible=False,
                    state=state,
                    reason="",
                    version=1,
                    created_at=at,
                    admitted_at=at if state != WorkloadState.pending else None,
                    started_at=at if state == WorkloadState.running else None,
                )
            )
            return wid

        # Running: each node filled by sessions of one size, or held whole by a job's pod.
        for n in range(nodes):
            if rng.random() > 0.9:
                continue
            size = rng.choice([1, 2, 4, 8])
            for first in range(0, 8, size):
                w = workload(
                    WorkloadState.running,
                    rng.choice(project_ids),
                    size,
                    1,
                    WorkloadKind.session,
                    T0 - timedelta(hours=1),
                )
                allocations.extend(
                    dict(
                        workload_id=w,
                        gpu_uuid=f"GPU-{n}-{g}",
                        node_id=n + 1,
                        pod_index=0,
                        project_id=workloads[-1]["project_id"],
                        username=workloads[-1]["username"],
                        gpu_type=GPU_TYPE,
                        opened_at=T0 - timedelta(hours=1),
                    )
                    for g in range(first, first + size)
                )
        for q in range(waiting):
            at = T0 + timedelta(milliseconds=q)
            if rng.random() < 0.7:
                workload(
                    WorkloadState.pending,
                    rng.choice(project_ids),
                    rng.choice([1, 2, 4, 8]),
                    1,
                    WorkloadKind.session,
                    at,
                )
            else:
                gpus = rng.choice([16, 32, 64, 128, 256, 512, 1024])
                workload(
                    WorkloadState.pending,
                    rng.choice(project_ids),
                    8,
                    gpus // 8,
                    WorkloadKind.job,
                    at,
                )
        _insert(c, Workload, workloads)
        _insert(c, Allocation, allocations)
    store = FleetStore(engine, "bench", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(T0)
    return store, rng


def _insert(c: Any, model: Any, rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` in chunks, leaving out keys the model has no column for: the worlds
    are built by this file's code over whichever tree's models (``--against``)."""
    columns = set(model.__table__.columns.keys())
    for chunk in range(0, len(rows), 20000):
        c.execute(
            insert(model),
            [{k: v for k, v in row.items() if k in columns} for row in rows[chunk : chunk + 20000]],
        )


def _fleet(c: Any, nodes: int) -> None:
    """The priority classes, and 4 clusters × 3 zones of ``nodes`` nodes of 8 GPUs."""
    _insert(
        c,
        PriorityClass,
        [dict(name=n, rank=r, preemptible_by_default=p, description="") for n, r, p in CLASSES],
    )
    _insert(c, Cluster, [dict(id=i + 1, name=f"cluster-{i}", backend="local") for i in range(4)])
    _insert(
        c,
        Zone,
        [
            dict(id=i * 3 + z + 1, cluster_id=i + 1, name=f"zone-{i}{'abc'[z]}")
            for i in range(4)
            for z in range(3)
        ],
    )
    _insert(
        c,
        Node,
        [
            dict(
                id=n + 1,
                name=f"node-{n}",
                zone_id=n % 12 + 1,
                gpu_type=GPU_TYPE,
                labels={},
                health=NodeHealth.ok,
                cordoned=False,
                last_heartbeat_at=T0,
            )
            for n in range(nodes)
        ],
    )
    _insert(
        c,
        Gpu,
        [
            dict(
                uuid=f"GPU-{n}-{g}",
                node_id=n + 1,
                index=g,
                gpu_type=GPU_TYPE,
                pci_bus_id="",
                memory_bytes=80 * 2**30,
                present=True,
                lost=False,
                last_sample={},
            )
            for n in range(nodes)
            for g in range(8)
        ],
    )


def churn(
    store: FleetStore, rng: random.Random, now: datetime, arrivals: int, completions: int
) -> None:
    """What happens between two cycles, through the store as the API and agents do it."""
    running = [w for w in store.mirror.running.values() if not w.stopping]
    for victim in rng.sample(running, min(completions, len(running))):
        store.end(now, victim.id, "completed", "")
    with store._write(now) as session:
        projects = session.scalars(
            select(Project.id).where(Project.kind == ProjectKind.project)
        ).all()
        for _ in range(arrivals):
            job = rng.random() < 0.3
            session.add(
                Workload(
                    kind=WorkloadKind.job if job else WorkloadKind.session,
                    project_id=rng.choice(projects),
                    username=f"user{rng.randrange(2000)}",
                    server_name="",
                    gpu_type=GPU_TYPE,
                    pods=rng.choice([2, 4, 8, 16]) if job else 1,
                    gpus_per_pod=8 if job else rng.choice([1, 2, 4, 8]),
                    priority_class="standard",
                    state=WorkloadState.pending,
                    created_at=now,
                )
            )
        node = session.get(Node, rng.randrange(len(store.mirror.nodes)) + 1)
        assert node is not None
        node.cordoned = not node.cordoned


# ------------------------------------------------------------- gang-preemption
GANG_ORGS, GANG_PROJECTS = 10, 10  # 100 projects: half borrow far beyond, half reclaim


def build_gangs(path: Path, nodes: int, waiting: int, seed: int = 7) -> tuple[FleetStore, Any]:
    """A quarter of the nodes hold sessions of 1–2 GPUs of the odd ("reclaiming") projects,
    at 60% of their guarantees; the rest are held whole by gangs of 64–256 GPUs (pods of
    8) of the even projects, which hold about 1.9× their guarantee, a fifth of them
    opportunistic (preemptible). The reclaiming projects wait, within their
    guarantee, for gangs of 8–64 GPUs (pods of 8), which the free GPUs their sessions
    leave never fit: they need a borrower's whole nodes. Behind them wait the borrowers'
    next gangs."""
    rng = random.Random(seed)
    engine = db.make_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    with engine.begin() as c:
        _fleet(c, nodes)
        projects: list[dict[str, Any]] = []
        borrowers: list[int] = []
        reclaimers: list[int] = []
        pid = 0
        for o in range(GANG_ORGS):
            pid += 1
            org_id = pid
            projects.append(_project(org_id, f"org{o}", ProjectKind.organisation, None, 1.0))
            for p in range(GANG_PROJECTS):
                pid += 1
                projects.append(_project(pid, f"g{o}-{p}", ProjectKind.project, org_id, 1.0))
                (borrowers if p % 2 == 0 else reclaimers).append(pid)
        _insert(c, Project, projects)
        guaranteed = nodes * 8 * 8 // 10 // (len(borrowers) + len(reclaimers))
        _insert(
            c,
            ProjectQuota,
            [
                dict(project_id=p, gpu_type=GPU_TYPE, guaranteed=guaranteed)
                for p in borrowers + reclaimers
            ],
        )
        rows = _Rows(rng)
        hour_ago = T0 - timedelta(hours=1)
        order = list(range(nodes))
        rng.shuffle(order)  # a gang's nodes spread over the zone's node numbers
        by_zone: dict[int, list[int]] = {}
        for n in order:
            by_zone.setdefault(n % 12, []).append(n)
        for zone_nodes in by_zone.values():
            sessions = len(zone_nodes) * 2 // 5
            for n in zone_nodes[:sessions]:
                first = 0
                while first < 8:
                    size = min(rng.choice([1, 2]), 8 - first)
                    w = rows.workload(
                        WorkloadState.running,
                        rng.choice(reclaimers),
                        size,
                        1,
                        WorkloadKind.session,
                        hour_ago,
                    )
                    rows.allocate(w, 0, n, range(first, first + size))
                    first += size
            at = sessions
            while at < len(zone_nodes):
                held = zone_nodes[at : at + rng.choice([8, 16, 32])]
                opportunistic = rng.random() < 0.2
                w = rows.workload(
                    WorkloadState.running,
                    rng.choice(borrowers),
                    8,
                    len(held),
                    WorkloadKind.job,
                    hour_ago,
                    priority="opportunistic" if opportunistic else "standard",
                    preemptible=opportunistic,
                )
                for pod, n in enumerate(held):
                    rows.allocate(w, pod, n, range(8))
                at += len(held)
        for q in range(waiting):
            within = rng.random() < 0.7
            rows.workload(
                WorkloadState.pending,
                rng.choice(reclaimers if within else borrowers),
                8,
                rng.choice([1, 2, 4, 8] if within else [8, 16, 32]),
                WorkloadKind.job,
                T0 + timedelta(milliseconds=q),
            )
        _insert(c, Workload, rows.workloads)
        _insert(c, Allocation, rows.allocations)
    store = FleetStore(engine, "bench", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(T0)
    return store, rng


def _project(
    pid: int, name: str, kind: ProjectKind, parent: int | None, weight: float
) -> dict[str, Any]:
    return dict(
        id=pid,
        name=name,
        kind=kind,
        display_name="",
        parent_id=parent,
        default_priority="standard",
        allowed_priorities=[],
        fair_share_weight=weight,
    )


class _Rows:
    """Workload and allocation rows for a bulk insert."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.workloads: list[dict[str, Any]] = []
        self.allocations: list[dict[str, Any]] = []

    def workload(
        self,
        state: WorkloadState,
        project: int,
        gpus_per_pod: int,
        pods: int,
        kind: WorkloadKind,
        at: datetime,
        priority: str = "standard",
        preemptible: bool = False,
    ) -> int:
        wid = len(self.workloads) + 1
        self.workloads.append(
            dict(
                id=wid,
                kind=kind,
                project_id=project,
                username=f"user{self.rng.randrange(2000)}",
                server_name=f"s{wid}",
                name="",
                gpu_type=GPU_TYPE,
                pods=pods,
                gpus_per_pod=gpus_per_pod,
                priority_class=priority,
                preemptible=preemptible,
                state=state,
                reason="",
                version=1,
                created_at=at,
                admitted_at=at if state != WorkloadState.pending else None,
                started_at=at if state == WorkloadState.running else None,
            )
        )
        return wid

    def allocate(self, wid: int, pod: int, node: int, gpus: Iterable[int]) -> None:
        w = self.workloads[wid - 1]
        self.allocations.extend(
            dict(
                workload_id=wid,
                gpu_uuid=f"GPU-{node}-{g}",
                node_id=node + 1,
                pod_index=pod,
                project_id=w["project_id"],
                username=w["username"],
                gpu_type=GPU_TYPE,
                opened_at=w["admitted_at"],
            )
            for g in gpus
        )


def churn_gangs(store: FleetStore, rng: random.Random, now: datetime) -> None:
    """The victims stopped the cycle before end (their backends saw them go); sessions of
    the reclaiming projects end, 96 GPUs' worth (room in their guarantees, but no room for
    a pod of 8), and 3 gangs; 20 requests arrive: 6 gangs within guarantee, 4 borrowers'
    standard gangs and 10 opportunistic (preemptible) gangs; a node is cordoned or
    uncordoned."""
    running = list(store.mirror.running.values())
    for victim in (w for w in running if w.stopping):
        store.end(now, victim.id, "preempted", "stopped for a preemptor")
    sessions = [w for w in running if w.kind == "session" and not w.stopping]
    rng.shuffle(sessions)
    done = 0
    for w in sessions:
        if done >= 96:
            break
        store.end(now, w.id, "completed", "")
        done += _gpus(w)
    gangs = [w for w in store.mirror.running.values() if w.kind != "session" and not w.stopping]
    for w in rng.sample(gangs, min(3, len(gangs))):
        store.end(now, w.id, "completed", "")
    project_ids = store.mirror.project_ids
    reclaimers = [i for n, i in sorted(project_ids.items()) if _reclaims(n)]
    borrowers = [i for n, i in project_ids.items() if n.startswith("g") and not _reclaims(n)]
    with store._write(now) as session:
        for a in range(20):
            within, opportunistic = a < 6, a >= 10
            session.add(
                Workload(
                    kind=WorkloadKind.job,
                    project_id=rng.choice(reclaimers if within else borrowers),
                    username=f"user{rng.randrange(2000)}",
                    server_name="",
                    gpu_type=GPU_TYPE,
                    pods=rng.choice([1, 2, 4, 8] if within else [8, 16, 32]),
                    gpus_per_pod=8,
                    priority_class="opportunistic" if opportunistic else "standard",
                    preemptible=opportunistic,
                    state=WorkloadState.pending,
                    created_at=now,
                )
            )
        node = session.get(Node, rng.randrange(len(store.mirror.nodes)) + 1)
        assert node is not None
        node.cordoned = not node.cordoned


def _reclaims(project: str) -> bool:
    """The odd projects of the gang world (``g<org>-<odd>``)."""
    return project.startswith("g") and int(project.rsplit("-", 1)[1]) % 2 == 1


def _gpus(running: Any) -> int:
    """A mirror's running workload's GPUs (its pods' GPUs)."""
    return sum(len(pod.gpus) for pod in running.pods)


def churn_main(store: FleetStore, rng: random.Random, now: datetime) -> None:
    churn(store, rng, now, arrivals=20, completions=20)


@dataclass(frozen=True)
class World:
    name: str
    title: str
    build: Callable[[Path, int, int], tuple[FleetStore, Any]]
    churn: Callable[[FleetStore, random.Random, datetime], None]
    nodes: int = 2000
    waiting: int = 10_000
    step_s: float = 1.0  # the clock between cycles


WORLDS = {
    w.name: w
    for w in (
        World(
            "main",
            "16,000 GPUs, 10,000 waiting (20 arrivals, 20 completions, 1 node change per cycle)",
            build,
            churn_main,
        ),
        World(
            "gang-preemption",
            "16,000 GPUs in big gangs of borrowers and opportunistic work, 10,000 waiting, "
            "most within guarantee",
            build_gangs,
            churn_gangs,
            # Workloads admitted here may be victims once they have run the minimum run
            # time (300 s): 5 cycles later.
            step_s=60.0,
        ),
    )
}


# ------------------------------------------------------------------ one side
class Side:
    """A world's store and clock, cycled round by round (the ``--against`` worker's)."""

    def __init__(self, world: World, path: Path):
        self.world = world
        started = time.perf_counter()
        self.store, self.rng = world.build(path, world.nodes, world.waiting)
        self.build_s = time.perf_counter() - started
        self.policy = Policy(min_run_time_s=300)
        self.now = T0
        started = time.perf_counter()
        self.store.scheduling_cycle(self.now, self.policy)  # the first cycle reads everything
        self.cold_s = time.perf_counter() - started

    def cycles(self, n: int, profiler: cProfile.Profile | None = None) -> dict[str, list[Any]]:
        wall: list[float] = []
        cpu: list[float] = []
        preemptions: list[int] = []
        admissions: list[int] = []
        queue: list[int] = []
        for _ in range(n):
            self.now += timedelta(seconds=self.world.step_s)
            self.world.churn(self.store, self.rng, self.now)
            if profiler:
                profiler.enable()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = self.store.scheduling_cycle(self.now, self.policy)
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            if profiler:
                profiler.disable()
            preemptions.append(len(result.plan.preemptions))
            admissions.append(len(result.plan.admissions))
            queue.append(len(result.plan.waiting))
        return dict(wall=wall, cpu=cpu, preemptions=preemptions, admissions=admissions, queue=queue)


def run(nodes: int, waiting: int, cycles: int, profile: bool = False) -> dict[str, float]:
    """The main world's figures, with the baseline: every fifth cycle rebuilds the mirror."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        store, rng = build(Path(tmp) / "bench.sqlite", nodes, waiting)
        built = time.perf_counter() - started
        policy = Policy(min_run_time_s=300)
        now = T0
        started = time.perf_counter()
        store.scheduling_cycle(now, policy)  # the first cycle reads everything
        cold = time.perf_counter() - started
        incremental, cpu, rebuilt, plans = [], [], [], []
        profiler = cProfile.Profile() if profile else None
        for i in range(cycles):
            now += timedelta(seconds=1)
            churn(store, rng, now, arrivals=20, completions=20)
            if i % 5 == 4:  # the baseline: every fifth cycle reads the world afresh
                store.forget_mirror()
                started = time.perf_counter()
                store.scheduling_cycle(now, policy)
                rebuilt.append(time.perf_counter() - started)
                continue
            if profiler:
                profiler.enable()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = store.scheduling_cycle(now, policy)
            incremental.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            if profiler:
                profiler.disable()
            plans.append(len(result.plan.waiting))
        if profiler:
            stats = pstats.Stats(profiler).sort_stats("cumulative")
            stats.print_stats(30)
            if os.environ.get("GPUFLEET_BENCH_CALLERS"):
                stats.print_callers(os.environ["GPUFLEET_BENCH_CALLERS"])
        return {
            "gpus": nodes * 8,
            "waiting": waiting,
            "build_s": built,
            "cold_s": cold,
            "p50": statistics.median(incremental) * 1000,
            "p99": _p99(incremental) * 1000,
            "cpu_p50": statistics.median(cpu) * 1000,
            "cpu_p99": _p99(cpu) * 1000,
            "rebuilt_p50": statistics.median(rebuilt) * 1000 if rebuilt else float("nan"),
            "queue": statistics.mean(plans),
        }


def gangs(cycles: int) -> None:
    """The gang-preemption world's figures."""
    world = WORLDS["gang-preemption"]
    with tempfile.TemporaryDirectory() as tmp:
        side = Side(world, Path(tmp) / "bench.sqlite")
        r = side.cycles(cycles)
    pre = r["preemptions"]
    print(f"gang-preemption: {world.title}, {cycles} cycles")
    print(f"  database built in {side.build_s:.1f} s; first cycle {side.cold_s * 1000:.0f} ms")
    print(
        f"  cycle p50 {statistics.median(r['wall']) * 1000:.1f} ms, p99 "
        f"{_p99(r['wall']) * 1000:.1f} ms; CPU p50 {statistics.median(r['cpu']) * 1000:.1f} ms, "
        f"p99 {_p99(r['cpu']) * 1000:.1f} ms"
    )
    print(
        f"  preemptions per cycle: mean {statistics.mean(pre):.1f}, min {min(pre)}, "
        f"max {max(pre)}, in {sum(1 for p in pre if p)} of {len(pre)} cycles; "
        f"admissions per cycle mean {statistics.mean(r['admissions']):.1f}; "
        f"waiting {r['queue'][-1]}"
    )
    print()
    sys.stdout.flush()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# ------------------------------------------------------------------ --against
def worktree(rev: str) -> tuple[Path, str]:
    """A git worktree of ``rev`` in /tmp/gpufleet-bench-<rev> (made, or moved to ``rev``'s
    commit when it is there already); its path and the commit."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    path = Path(tempfile.gettempdir()) / f"gpufleet-bench-{re.sub(r'[^A-Za-z0-9._-]', '-', rev)}"
    if not (path / ".git").exists():
        _git("worktree", "add", "--detach", str(path), commit)
    elif _git("-C", str(path), "rev-parse", "HEAD").strip() != commit:
        _git("-C", str(path), "checkout", "--quiet", "--detach", commit)
    return path, commit


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def package_farm(tree: Path, into: Path) -> Path:
    """A folder to put first on ``sys.path`` so that ``gpufleet`` is ``tree``'s code, as
    the strict editable install maps it: ``package-dir`` of the tree's pyproject.toml, by
    symlinks (the top package's files one by one, every other package's folder whole
    unless it lies inside its parent's already)."""
    setuptools = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: Mapping[str, str] = setuptools["package-dir"]
    top = into / "gpufleet"
    top.mkdir(parents=True)
    for entry in (tree / mapping["gpufleet"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        if package == "gpufleet":
            continue
        parent, last = package.rsplit(".", 1)
        if parent in mapping and Path(mapping[parent]) / last == Path(folder):
            continue  # inside its parent's folder, which is linked whole
        link = into.joinpath(*package.split("."))
        if (
            link.exists()
            or link.is_symlink()
            or any(p.is_symlink() for p in link.parents if into in p.parents)
        ):
            raise SystemExit(f"{tree}: package {package} cannot be mapped by symlinks")
        link.symlink_to(tree / folder)
    return into


class Worker:
    """This file run as a worker (``--worker``) over one tree's code: one world, cycled a
    round at a time on request."""

    def __init__(self, label: str, tree: Path, world: str, farm: Path):
        self.label, self.tree = label, tree
        env = dict(os.environ, PYTHONPATH=str(farm), PYTHONDONTWRITEBYTECODE="")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", world],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.preemptions: list[int] = []
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        self.ready = self._answer()

    def round(self, cycles: int) -> None:
        self._ask({"cycles": cycles})
        result = self._answer()
        self.wall += result["wall"]
        self.cpu += result["cpu"]
        self.preemptions += result["preemptions"]

    def close(self) -> None:
        if self.process.poll() is None:
            self._ask({"quit": True})
            self.process.wait(timeout=60)

    def _ask(self, message: Mapping[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                answer: dict[str, Any] = json.loads(line[len(ANSWER) :])
                return answer
        raise SystemExit(f"the {self.label} worker stopped (exit status {self.process.wait()})")


ANSWER = "@@bench "


def worker(world: str, out: IO[str]) -> None:
    """The worker's side of ``Worker``: build, then a round per request, until told to quit."""
    import gpufleet.scheduler.plan as plan_module

    with tempfile.TemporaryDirectory() as tmp:
        side = Side(WORLDS[world], Path(tmp) / "bench.sqlite")
        code = str(Path(plan_module.__file__).resolve().parents[1])
        out.write(
            ANSWER + json.dumps({"build_s": side.build_s, "cold_s": side.cold_s, "code": code})
        )
        out.write("\n")
        out.flush()
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("quit"):
                return
            out.write(ANSWER + json.dumps(side.cycles(int(request["cycles"]))) + "\n")
            out.flush()


def against(rev: str, worlds: list[str], rounds: int, cycles: int) -> None:
    """Each world on this tree (new) and on ``rev`` (old), rounds interleaved."""
    old_tree, commit = worktree(rev)
    print(f"new: {ROOT} (this tree, as it is on disk)")
    print(f"old: {rev} = {commit[:12]}, worktree {old_tree}")
    print(f"{rounds} rounds of {cycles} cycles per side and world, alternating new/old")
    with tempfile.TemporaryDirectory() as tmp:
        farms = {
            "new": package_farm(ROOT, Path(tmp) / "new"),
            "old": package_farm(old_tree, Path(tmp) / "old"),
        }
        for world in worlds:
            print()
            print(f"world {world}: {WORLDS[world].title}")
            sides = {
                "new": Worker("new", ROOT, world, farms["new"]),
                "old": Worker("old", old_tree, world, farms["old"]),
            }
            try:
                for side in sides.values():  # both build at once; nothing is timed yet
                    side.wait_ready()
                for label, side in sides.items():
                    print(
                        f"  {label}: gpufleet.scheduler from {side.ready['code']}; built in "
                        f"{side.ready['build_s']:.1f} s, first cycle {side.ready['cold_s']:.1f} s"
                    )
                    sys.stdout.flush()
                for r in range(rounds):
                    order = ("new", "old") if r % 2 == 0 else ("old", "new")
                    for label in order:
                        sides[label].round(cycles)
            finally:
                for side in sides.values():
                    side.close()
            for label, side in sides.items():
                pre = side.preemptions
                print(
                    f"  {label}: cycle p50 {statistics.median(side.wall) * 1000:.1f} ms, "
                    f"p99 {_p99(side.wall) * 1000:.1f} ms; CPU p50 "
                    f"{statistics.median(side.cpu) * 1000:.1f} ms, p99 "
                    f"{_p99(side.cpu) * 1000:.1f} ms; preemptions per cycle mean "
                    f"{statistics.mean(pre):.1f} (min {min(pre)}, max {max(pre)}; in "
                    f"{sum(1 for p in pre if p)} of {len(pre)} cycles)"
                )
            new, old = sides["new"], sides["old"]
            ratio = _p99(new.wall) / _p99(old.wall)
            cpu_ratio = _p99(new.cpu) / _p99(old.cpu)
            verdict = "ok" if ratio <= 1.10 else "OVER"
            print(
                f"  p99 new/old {ratio:.2f} (target <= 1.10: {verdict}); "
                f"CPU p99 new/old {cpu_ratio:.2f}"
            )
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, help="cycles per world (100; --quick: 30)")
    parser.add_argument("--quick", action="store_true", help="the main points only")
    parser.add_argument("--profile", action="store_true", help="profile the main point's cycles")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="compare with REV's code (a worktree in /tmp), rounds interleaved",
    )
    parser.add_argument("--rounds", type=int, help="--against: rounds per side (5; --quick: 3)")
    parser.add_argument(
        "--world",
        action="append",
        choices=sorted(WORLDS),
        help="--against: only this world (repeatable; default: all)",
    )
    parser.add_argument("--worker", choices=sorted(WORLDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, sys.stdout)
        return
    cycles = args.cycles or ((18 if args.against else 30) if args.quick else 100)
    if args.against:
        rounds = args.rounds or (3 if args.quick else 5)
        against(args.against, args.world or list(WORLDS), rounds, max(1, cycles // rounds))
        return
    args.cycles = cycles
    gangs(cycles)
    main_point = run(2000, 10_000, args.cycles, args.profile)
    m = main_point
    print(
        f"16,000 GPUs, 10,000 waiting, {args.cycles} cycles under churn "
        "(20 arrivals, 20 completions, 1 node change per cycle)"
    )
    print(
        f"  database built in {m['build_s']:.1f} s; "
        f"first cycle (reads everything) {m['cold_s'] * 1000:.0f} ms"
    )
    print(
        f"  cycle p50 {m['p50']:.1f} ms, p99 {m['p99']:.1f} ms "
        f"(target p99 <= 100 ms: ratio {m['p99'] / 100:.2f})"
    )
    print(
        f"  cycle CPU time p50 {m['cpu_p50']:.1f} ms, p99 {m['cpu_p99']:.1f} ms "
        "(the process's own time: less noisy on a shared machine)"
    )
    print(
        f"  baseline, the mirror rebuilt from the database each cycle: p50 "
        f"{m['rebuilt_p50']:.0f} ms (incremental: {m['rebuilt_p50'] / m['p50']:.1f}x faster)"
    )
    if args.quick:
        return
    print()
    print(
        f"{'GPUs':>7} {'waiting':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU p50':>8} {'CPU p99':>8} "
        f"{'rebuilt p50 ms':>15}"
    )
    points = [(125, 10_000), (500, 10_000), (2000, 10_000), (8000, 10_000)]
    points += [(2000, 1_000), (2000, 100_000)]
    for nodes, waiting in points:
        cycles = max(10, args.cycles // (4 if nodes * 8 * waiting > 2e8 else 1))
        r = m if (nodes, waiting) == (2000, 10_000) else run(nodes, waiting, cycles)
        print(
            f"{int(r['gpus']):>7} {int(r['waiting']):>8} {r['p50']:>8.1f} {r['p99']:>8.1f} "
            f"{r['cpu_p50']:>8.1f} {r['cpu_p99']:>8.1f} {r['rebuilt_p50']:>15.0f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
