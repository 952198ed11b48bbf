"""What the store asks each node agent or cluster manager to run: the pods of the active
jobs on its nodes (``DesiredPod``), with everything a backend needs to start one, and
whether it should run or be gone. Who launches a node's pods depends on its cluster: the
node agent on the local backend, the cluster manager on Kubernetes (``launched_by``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from .clusters import KUBERNETES
from .models import (
    Allocation,
    Cluster,
    JobPod,
    Node,
    UserAccount,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)
from .traces import pending_traces

ACTIVE = (WorkloadState.admitted, WorkloadState.running, WorkloadState.stopping)
# ``lost``: its node's agent went silent (never reported by an agent).
ENDED_POD_STATES = frozenset({"exited", "stopped", "failed", "lost"})


@dataclass(frozen=True)
class DesiredPod:
    """One pod an agent should run (``run``) or make sure is gone (not ``run``)."""

    workload_id: int
    pod_index: int
    pods: int
    gpus_per_pod: int
    node: str
    gpu_uuids: tuple[str, ...]
    marker: str
    run: bool
    started: (
        bool  # the agent reported it running before (an agent that lost it must not restart it)
    )
    username: str
    name: str
    spec: dict[str, Any]
    account: dict[str, Any] | None = None  # uid, gid, mode: whom its ranks run as
    attempt: int = 1
    resume_from: str = ""  # the checkpoint the attempt resumes from (GPUFLEET_RESUME_FROM)
    project: str = ""  # the project charged
    # An open trace this pod has not answered (state/traces.py): its agent takes the
    # ranks' stacks first; a pod to stop is not stopped before, or the trace's wait ends.
    trace: int | None = None
    # The attempt whose pod this is: an earlier one for a pod kept into this attempt by a
    # restart that replaced only its gang's lost pods (state/kept_pods.py); its name is
    # that attempt's.
    created_attempt: int = 0

    @property
    def kept(self) -> bool:
        return 0 < self.created_attempt < self.attempt


def launched_by(session: Session, node_names: Iterable[str], kubernetes: bool) -> set[str]:
    """Those of ``node_names`` whose pods the caller launches: the nodes of Kubernetes
    clusters for a cluster manager, the others for a node agent."""
    names = set(node_names)
    if not names:
        return names
    backends = session.execute(
        select(Node.name, Cluster.backend)
        .join(Zone, Node.zone_id == Zone.id)
        .join(Cluster, Zone.cluster_id == Cluster.id)
        .where(Node.name.in_(names))
    ).all()
    return {name for name, backend in backends if (backend == KUBERNETES) == kubernetes}


def watched_on(session: Session, node_names: Iterable[str]) -> list[DesiredPod]:
    """The pods Kubernetes runs on those of ``node_names`` in its clusters: those to run,
    and those to stop whose stacks are awaited (their agent takes them)."""
    kube_nodes = launched_by(session, node_names, kubernetes=True)
    return [pod for pod in desired_on(session, kube_nodes) if pod.run or pod.trace]


def desired_on(session: Session, nodes: set[str]) -> list[DesiredPod]:
    rows = session.execute(
        select(Allocation, Workload)
        .join(Workload, Allocation.workload_id == Workload.id)
        .join(Node, Allocation.node_id == Node.id)
        .where(
            Allocation.closed_at.is_(None),
            Node.name.in_(nodes),
            Workload.kind == WorkloadKind.job,
            Workload.state.in_(ACTIVE),
        )
        .options(
            selectinload(Allocation.gpu),
            selectinload(Allocation.node),
            selectinload(Allocation.workload).selectinload(Workload.project),
        )
    ).all()
    gpus: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
    where: dict[tuple[int, int], str] = {}
    workloads: dict[int, Workload] = {}
    for allocation, workload in rows:
        key = (workload.id, allocation.pod_index)
        gpus[key].append((allocation.gpu.index, allocation.gpu_uuid))
        where[key] = allocation.node.name
        workloads[workload.id] = workload
    pod_rows = {
        (p.workload_id, p.pod_index): p
        for p in session.scalars(select(JobPod).where(JobPod.workload_id.in_(workloads)))
    }
    traces = pending_traces(session, workloads)
    users = {w.username for w in workloads.values()}
    accounts = {
        a.username: a
        for a in session.scalars(select(UserAccount).where(UserAccount.username.in_(users)))
    }
    desired = []
    for (workload_id, pod_index), node in sorted(where.items()):
        workload = workloads[workload_id]
        row = pod_rows.get((workload_id, pod_index))
        if row is not None and row.state in ENDED_POD_STATES:
            continue  # reported ended: nothing left for the agent to do
        trace_id, answered = traces.get((workload_id, workload.attempt), (None, set()))
        made_by = (workload.recovery or {}).get("pods_made_by") or {}
        desired.append(
            DesiredPod(
                workload_id=workload_id,
                pod_index=pod_index,
                pods=workload.pods,
                gpus_per_pod=workload.gpus_per_pod,
                node=node,
                gpu_uuids=tuple(u for _, u in sorted(gpus[workload_id, pod_index])),
                marker=workload.process_marker or "",
                run=workload.state != WorkloadState.stopping,
                started=row is not None,
                username=workload.username,
                name=workload.name,
                spec=dict(workload.spec or {}),
                account=_account_json(accounts.get(workload.username)),
                attempt=workload.attempt,
                resume_from=str((workload.recovery or {}).get("resume_from") or ""),
                project=workload.project.name,
                trace=trace_id if row is not None and pod_index not in answered else None,
                created_attempt=int(made_by.get(str(pod_index), workload.attempt)),
            )
        )
    return desired


def _account_json(row: UserAccount | None) -> dict[str, Any] | None:
    """Whom a pod's ranks run as; None for a job from before accounts (the agent refuses to
    start it rather than run it as root)."""
    if row is None:
        return None
    return {"uid": row.uid, "gid": row.gid, "mode": row.mode}
