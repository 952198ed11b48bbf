"""The worlds of ``scheduler_cycle.py``: each a database built at a scale (the fleet, the
projects and their quotas, the running work, the queue) and the churn applied through the
store between two cycles, as the API and the agents do it. Seeded: the same arguments
build the same world, whichever tree's code runs it (``--against``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select

from gpufleet.state import db
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import (
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

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
GPU_TYPE = "H100"
CLASSES = [("critical", 300, False), ("standard", 200, False), ("opportunistic", 100, True)]
MIXED_PRIORITIES = ["standard"] * 8 + ["critical", "opportunistic"]


def build(path: Path, nodes: int, waiting: int, seed: int = 7) -> tuple[FleetStore, Any]:
    """A database with the fleet, the projects, running work at ~90% and the queue."""
    rng = random.Random(seed)
    engine = db.make_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    with engine.begin() as c:
        _fleet(c, nodes)
        project_ids = _main_projects(c, nodes * 8)
        rows = _Rows(rng)
        _main_running(rows, nodes, project_ids)
        _main_waiting(rows, waiting, project_ids)
        _insert(c, Workload, rows.workloads)
        _insert(c, Allocation, rows.allocations)
    return _leading_store(engine), rng


def _main_projects(c: Any, capacity: int) -> list[int]:
    """10 organisations of 20 projects, whose guarantees cover 80% of ``capacity``; the
    projects' ids."""
    projects, project_ids = [], []
    pid = 0
    for o in range(10):
        pid += 1
        org_id = pid
        projects.append(_project(org_id, f"org{o}", ProjectKind.organisation, None, 1.0))
        for p in range(20):
            pid += 1
            project_ids.append(pid)
            projects.append(_project(pid, f"p{o}-{p}", ProjectKind.project, org_id, 1.0 + (p % 3)))
    _insert(c, Project, projects)
    guaranteed = capacity * 8 // 10 // len(project_ids)
    _insert(
        c,
        ProjectQuota,
        [dict(project_id=p, gpu_type=GPU_TYPE, guaranteed=guaranteed) for p in project_ids],
    )
    return project_ids


def _main_running(rows: _Rows, nodes: int, project_ids: list[int]) -> None:
    """Nine nodes in ten each filled by sessions of one size (1, 2, 4 or 8 GPUs)."""
    rng = rows.rng
    for n in range(nodes):
        if rng.random() > 0.9:
            continue
        size = rng.choice([1, 2, 4, 8])
        for first in range(0, 8, size):
            w = rows.workload(
                WorkloadState.running,
                rng.choice(project_ids),
                size,
                1,
                WorkloadKind.session,
                T0 - timedelta(hours=1),
                priority=None,
            )
            rows.allocate(w, 0, n, range(first, first + size))


def _main_waiting(rows: _Rows, waiting: int, project_ids: list[int]) -> None:
    """The queue: 70% sessions of 1–8 GPUs, 30% jobs of 16–1,024 GPUs (pods of 8)."""
    rng = rows.rng
    for q in range(waiting):
        at = T0 + timedelta(milliseconds=q)
        if rng.random() < 0.7:
            rows.workload(
                WorkloadState.pending,
                rng.choice(project_ids),
                rng.choice([1, 2, 4, 8]),
                1,
                WorkloadKind.session,
                at,
                priority=None,
            )
        else:
            gpus = rng.choice([16, 32, 64, 128, 256, 512, 1024])
            rows.workload(
                WorkloadState.pending,
                rng.choice(project_ids),
                8,
                gpus // 8,
                WorkloadKind.job,
                at,
                priority=None,
            )


def _leading_store(engine: Any) -> FleetStore:
    """The store over ``engine``, holding the controller's lease."""
    store = FleetStore(engine, "bench", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(T0)
    return store


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
    running = [w for w in store.scheduling.mirror.running.values() if not w.stopping]
    for victim in rng.sample(running, min(completions, len(running))):
        store.workloads.end(now, victim.id, "completed", "")
    with store.database.write(now) as session:
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
        node = session.get(Node, rng.randrange(len(store.scheduling.mirror.nodes)) + 1)
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
        borrowers, reclaimers = _gang_projects(c, nodes * 8)
        rows = _Rows(rng)
        _gang_running(rows, nodes, borrowers, reclaimers)
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
    return _leading_store(engine), rng


def _gang_projects(c: Any, capacity: int) -> tuple[list[int], list[int]]:
    """``GANG_ORGS`` organisations of ``GANG_PROJECTS`` projects, whose guarantees cover
    80% of ``capacity``: the ids of the even ones (borrowers) and of the odd ones
    (reclaiming)."""
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
    guaranteed = capacity * 8 // 10 // (len(borrowers) + len(reclaimers))
    _insert(
        c,
        ProjectQuota,
        [
            dict(project_id=p, gpu_type=GPU_TYPE, guaranteed=guaranteed)
            for p in borrowers + reclaimers
        ],
    )
    return borrowers, reclaimers


def _gang_running(rows: _Rows, nodes: int, borrowers: list[int], reclaimers: list[int]) -> None:
    """Per zone, two nodes in five filled by the reclaiming projects' sessions of 1–2
    GPUs, the rest held whole by the borrowers' gangs of 8, 16 or 32 nodes, a fifth of
    them opportunistic."""
    rng = rows.rng
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
        priority: str | None = "standard",
        preemptible: bool = False,
    ) -> int:
        """A workload's row; ``priority`` None: the main world's mix, drawn after its user
        (standard eight times in ten, else critical or opportunistic)."""
        wid = len(self.workloads) + 1
        username = f"user{self.rng.randrange(2000)}"
        if priority is None:
            priority = self.rng.choice(MIXED_PRIORITIES)
        self.workloads.append(
            dict(
                id=wid,
                kind=kind,
                project_id=project,
                username=username,
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
    running = list(store.scheduling.mirror.running.values())
    for victim in (w for w in running if w.stopping):
        store.workloads.end(now, victim.id, "preempted", "stopped for a preemptor")
    sessions = [w for w in running if w.kind == "session" and not w.stopping]
    rng.shuffle(sessions)
    done = 0
    for w in sessions:
        if done >= 96:
            break
        store.workloads.end(now, w.id, "completed", "")
        done += _gpus(w)
    gangs = [
        w
        for w in store.scheduling.mirror.running.values()
        if w.kind != "session" and not w.stopping
    ]
    for w in rng.sample(gangs, min(3, len(gangs))):
        store.workloads.end(now, w.id, "completed", "")
    project_ids = store.scheduling.mirror.project_ids
    reclaimers = [i for n, i in sorted(project_ids.items()) if _reclaims(n)]
    borrowers = [i for n, i in project_ids.items() if n.startswith("g") and not _reclaims(n)]
    with store.database.write(now) as session:
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
        node = session.get(Node, rng.randrange(len(store.scheduling.mirror.nodes)) + 1)
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
