"""How the API shows a workload: the answer models built from the database rows."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, selectinload

from ...api import schemas
from ...state.models import Allocation, Node, Workload, WorkloadKind, WorkloadState, Zone
from ..errors import BadRequest, NotFoundError

MAX_WAIT_SECONDS = 60


# What workload_out reads, loaded up front.
WORKLOAD_DETAILS = (
    selectinload(Workload.project),
    selectinload(Workload.allocations).selectinload(Allocation.gpu),
    selectinload(Workload.allocations)
    .selectinload(Allocation.node)
    .selectinload(Node.zone)
    .selectinload(Zone.cluster),
)


def workload_out(workload: Workload) -> schemas.WorkloadOut:
    return schemas.WorkloadOut(
        id=workload.id,
        kind=workload.kind.value,
        state=workload.state.value,
        outcome=workload.outcome,
        project=workload.project.name,
        username=workload.username,
        server_name=workload.server_name,
        profile=workload.profile,
        gpu_type=workload.gpu_type,
        pods=workload.pods,
        gpus_per_pod=workload.gpus_per_pod,
        gpus=workload.gpus,
        priority_class=workload.priority_class,
        queue_position=workload.queue_position,
        reason=workload.reason,
        version=workload.version,
        created_at=workload.created_at,
        admitted_at=workload.admitted_at,
        started_at=workload.started_at,
        ended_at=workload.ended_at,
        allocations=[
            schemas.GpuOut(
                uuid=a.gpu_uuid,
                index=a.gpu.index,
                pci_bus_id=a.gpu.pci_bus_id,
                node=a.node.name,
                cluster=a.node.zone.cluster.name,
            )
            for a in sorted(workload.allocations, key=lambda a: a.gpu.index)
            if a.closed_at is None
        ],
    )


def load_workload(session: Session, workload_id: int) -> Workload:
    workload = session.scalar(
        select(Workload).where(Workload.id == workload_id).options(*WORKLOAD_DETAILS)
    )
    if workload is None:
        raise NotFoundError(f"there is no workload {workload_id}")
    return workload


def listing(
    states: Sequence[str], username: str | None, kind: WorkloadKind | None
) -> Select[Workload]:
    """The workloads a list asks for: ``?state=`` (repeatable), one user's, one kind."""
    for state in states:
        if state not in WorkloadState.__members__:
            raise BadRequest(
                f"unknown state {state!r}; use one of: {', '.join(WorkloadState.__members__)}"
            )
    query = select(Workload)
    if username is not None:
        query = query.where(Workload.username == username)
    if states:
        query = query.where(Workload.state.in_([WorkloadState(s) for s in states]))
    if kind is not None:
        query = query.where(Workload.kind == kind)
    return query


def page(
    session: Session, query: Select[Workload], offset: int, limit: int
) -> tuple[Sequence[Workload], int]:
    """One page of ``query``, newest first, and how many there are in all."""
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(
        query.order_by(Workload.id.desc()).offset(offset).limit(limit).options(*WORKLOAD_DETAILS)
    ).all()
    return rows, total
