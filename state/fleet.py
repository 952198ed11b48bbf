"""FleetStore: every read and write of the fleet's state, as short transactions.

The state is changed only through the methods of FleetStore and the classes it builds on
(``base.StoreBase``: lease and fenced writes; ``inventory.InventoryStore``: what node
agents report; ``readback.ReadbackStore``: the GPUs workloads' processes really have;
``operations.NodeOperationStore``: snapshot passes and restores node agents do;
``reconcile.ReconcileStore``: process markers and the reconciler's repairs;
``cycle.SchedulingStore``: the scheduling cycle, whose decisions are committed
in one transaction: a controller killed at any point leaves either all of them or none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import selectinload

from ..api.events import EventKind
from ..scheduler.errors import InputError, InvalidRequest
from ..scheduler.model import project_tree
from ..scheduler.validation import SessionRequest, validate_session_request
from .accounts import AccountStore
from .base import _event, _get_workload, _preemptible
from .catalogue import CatalogueStore
from .clusters import ClusterInventoryStore
from .cycle import SchedulingStore
from .inventory import InventoryStore
from .jobs import JobStore
from .maintenance import MaintenanceStore
from .models import (
    Membership,
    PriorityClass,
    Profile,
    Project,
    ProjectKind,
    ProjectQuota,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from .operations import NodeOperationStore
from .projects import ProjectAdminStore
from .readback import ReadbackStore
from .reconcile import ReconcileStore
from .sessions import SessionActivityStore
from .snapshots import SnapshotStore

ACTIVE_STATES = (WorkloadState.admitted, WorkloadState.running, WorkloadState.stopping)
OPEN_STATES = (WorkloadState.pending, *ACTIVE_STATES)


class FleetStore(
    SchedulingStore,
    ReconcileStore,
    InventoryStore,
    ClusterInventoryStore,
    ReadbackStore,
    MaintenanceStore,
    NodeOperationStore,
    SnapshotStore,
    SessionActivityStore,
    JobStore,
    ProjectAdminStore,
    CatalogueStore,
    AccountStore,
):
    # ------------------------------------------------------------- bootstrap
    def apply_config(
        self,
        now: datetime,
        projects: Sequence[Mapping[str, Any]],
        profiles: Sequence[Mapping[str, Any]],
        priority_classes: Sequence[Mapping[str, Any]],
    ) -> None:
        """Create or update the projects, profiles and priority classes the config declares.

        Projects are validated first (``model.project_tree``): nothing is written for a
        declaration that cannot be used. Values an admin changed in the admin panel
        (``edited_at`` set) are left as the admin set them.
        """
        try:
            tree = project_tree(projects)
        except InputError as e:
            raise InvalidRequest(str(e)) from e
        with self._write(now) as session:
            for spec in priority_classes:
                pc = session.get(PriorityClass, spec["name"]) or PriorityClass(name=spec["name"])
                pc.rank = int(spec["rank"])
                pc.preemptible_by_default = bool(spec.get("preemptible", False))
                pc.description = spec.get("description", "")
                session.add(pc)
            by_name = {p.name: p for p in session.scalars(select(Project))}
            for declared in tree:
                project = by_name.get(declared.name) or Project(name=declared.name)
                by_name[project.name] = project
                project.display_name = declared.display_name
                project.kind = ProjectKind(declared.kind)
                project.parent = by_name[declared.parent] if declared.parent else None
                project.hub_group = declared.hub_group
                project.allowed_priorities = list(declared.allowed_priorities)
                if project.edited_at is None:  # else the admin panel's values stand
                    project.default_priority = declared.default_priority
                    project.fair_share_weight = declared.weight
                    project.per_user_gpu_cap = declared.per_user_cap
                session.add(project)
                session.flush()
                quotas = {q.gpu_type: q for q in project.quotas}
                for gpu_type, q in declared.quotas.items():
                    quota = quotas.pop(gpu_type, None) or ProjectQuota(gpu_type=gpu_type)
                    if quota.edited_at is None:
                        quota.guaranteed = q.guaranteed
                        quota.borrow_limit = q.borrow_limit
                        quota.lend_limit = q.lend_limit
                    if quota not in project.quotas:
                        project.quotas.append(quota)
                for stale in quotas.values():
                    if stale.edited_at is None:
                        project.quotas.remove(stale)
            for spec in profiles:
                profile = session.scalar(select(Profile).where(Profile.name == spec["name"]))
                profile = profile or Profile(name=spec["name"])
                profile.display_name = spec.get("display_name", profile.name)
                profile.description = spec.get("description", "")
                profile.environment = spec.get("environment", "")
                profile.cpu_per_gpu = float(spec.get("cpu_per_gpu", 4))
                profile.memory_per_gpu_bytes = int(spec.get("memory_per_gpu_bytes", 32 * 2**30))
                profile.allowed_gpu_types = list(spec.get("gpu_types", []))
                profile.allowed_projects = list(spec.get("projects", []))
                profile.is_default = bool(spec.get("default", False))
                session.add(profile)

    # ------------------------------------------------------------ membership
    def sync_memberships(self, now: datetime, groups: Mapping[str, Iterable[str]]) -> int:
        """Make each project's members those of its hub group; returns how many changed."""
        changes = 0
        with self._write(now) as session:
            for project in session.scalars(select(Project).options(selectinload(Project.members))):
                wanted = set(groups.get(project.hub_group or project.name, ()))
                have = {m.username: m for m in project.members}
                for username in wanted - have.keys():
                    project.members.append(Membership(username=username))
                    changes += 1
                for username in have.keys() - wanted:
                    project.members.remove(have[username])
                    changes += 1
            if changes:
                _event(
                    session,
                    now,
                    EventKind.MEMBERSHIP_SYNCED,
                    f"{changes} project membership change(s) synced from hub groups",
                )
        return changes

    # ------------------------------------------------------------- workloads
    def check_session_request(self, request: SessionRequest) -> None:
        """Validate without recording anything (the spawn form's dry run)."""
        with self.read() as session:
            validate_session_request(request, self.catalogue(session, request.username))

    def open_session_request(
        self, now: datetime, request: SessionRequest, lease: timedelta
    ) -> Workload:
        """Validate and queue a session request; supersedes the server's older open request."""
        with self._write(now) as session:
            validated = validate_session_request(request, self.catalogue(session, request.username))
            project = session.scalar(select(Project).where(Project.name == validated.project))
            assert project is not None  # validation checked membership of an existing project
            older = session.scalars(
                select(Workload).where(
                    Workload.kind == WorkloadKind.session,
                    Workload.username == request.username,
                    Workload.server_name == request.server_name,
                    Workload.state.in_(OPEN_STATES),
                )
            ).all()
            for old in older:
                if old.state in (WorkloadState.running, WorkloadState.stopping):
                    raise InvalidRequest(
                        f"server {request.server_name or '(default)'} of {request.username} "
                        f"still holds GPUs as workload {old.id} ({old.state.value}); stop it "
                        "before starting it again"
                    )
                self._end(
                    session,
                    now,
                    old,
                    "superseded",
                    "a new start of the same server replaced this request",
                )
            workload = Workload(
                kind=WorkloadKind.session,
                project=project,
                username=request.username,
                server_name=request.server_name,
                name=request.server_name,
                profile=validated.profile,
                gpu_type=validated.gpu_type,
                pods=1,
                gpus_per_pod=validated.gpus,
                priority_class=project.default_priority,
                preemptible=_preemptible(session, project.default_priority),
                state=WorkloadState.pending,
                reason="waiting for the next admission cycle",
                created_at=now,
                lease_expires_at=now + lease,
            )
            session.add(workload)
            session.flush()
            _event(
                session,
                now,
                EventKind.REQUESTED,
                f"{request.username} asked for {validated.gpus} × {validated.gpu_type} "
                f"in project {project.name} for server {request.server_name or '(default)'}",
                workload=workload,
            )
            return workload

    def renew(self, now: datetime, workload_id: int, lease: timedelta) -> Workload:
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.state in (WorkloadState.pending, WorkloadState.admitted):
                workload.lease_expires_at = now + lease
            return workload

    def mark_running(
        self, now: datetime, workload_id: int, snapshot_sources: Mapping[str, Any] | None = None
    ) -> Workload:
        """The backend reports the workload up; a session's spawner also says what its
        snapshot would hold (``SessionActivityStore``'s culler reads it)."""
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.state != WorkloadState.admitted:
                raise InvalidRequest(
                    f"workload {workload_id} is {workload.state.value}, not admitted; it "
                    "cannot be marked running"
                )
            workload.state = WorkloadState.running
            workload.started_at = now
            workload.lease_expires_at = None
            if snapshot_sources is not None:
                workload.snapshot_sources = dict(snapshot_sources)
            # "admitted on n1 (zone-a); 2 borrowed ..." -> "running on n1 (zone-a); 2 ..."
            admitted = workload.reason.removeprefix("admitted")
            workload.reason = "running" + (admitted if admitted != workload.reason else "")
            workload.version += 1
            _event(
                session,
                now,
                EventKind.STARTED,
                f"workload {workload.id} is running",
                workload=workload,
            )
            return workload

    def end(self, now: datetime, workload_id: int, outcome: str, message: str) -> Workload:
        """End a workload and close its allocations.

        The caller asserts that nothing of the workload still runs: for a running workload
        the backend has observed its processes gone before calling this.
        """
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.state != WorkloadState.ended:
                self._end(session, now, workload, outcome, message)
            return workload

    def extend_leases(self, now: datetime, lease: timedelta) -> int:
        """Give every waiting request a full lease again.

        Called when a controller becomes the writer: spawners could not renew while no
        controller answered, and a request must not expire for the controller's absence.
        """
        with self._write(now) as session:
            result = session.execute(
                update(Workload)
                .where(
                    Workload.state.in_((WorkloadState.pending, WorkloadState.admitted)),
                    Workload.lease_expires_at < now + lease,
                )
                .values(lease_expires_at=now + lease)
            )
            return int(result.rowcount)  # type: ignore[attr-defined]

    def expire_leases(self, now: datetime) -> list[int]:
        """End pending or admitted workloads whose requester stopped renewing.

        An admitted workload whose backend gave its process marker may already have
        processes holding its GPUs: it is left to the reconciler, which ends it only once
        nothing carrying the marker runs.
        """
        with self._write(now) as session:
            expired = session.scalars(
                select(Workload).where(
                    Workload.lease_expires_at < now,
                    (Workload.state == WorkloadState.pending)
                    | (
                        (Workload.state == WorkloadState.admitted)
                        & Workload.process_marker.is_(None)
                    ),
                )
            ).all()
            for workload in expired:
                self._end(
                    session,
                    now,
                    workload,
                    "expired",
                    "the spawner stopped renewing its request (hub restarted or the "
                    "spawn was abandoned)",
                )
            return [w.id for w in expired]

    def record_event(
        self,
        now: datetime,
        kind: str,
        message: str,
        *,
        workload_id: int | None = None,
        **fields: Any,
    ) -> None:
        """An event of ``kind``, one of EventKind's values (a ValueError names any other,
        before anything is written), about workload ``workload_id`` if given."""
        known = EventKind(kind)
        with self._write(now) as session:
            workload = session.get(Workload, workload_id) if workload_id is not None else None
            _event(session, now, known, message, workload=workload, **fields)
