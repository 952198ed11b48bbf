"""The queue's rows as their requesters and backends change them: a session request
opened (validated against what the fleet offers) and renewed while it waits, a workload
marked running and ended, and the waiting requests' leases (extended when a controller
takes over, expired when a spawner stops renewing). Admission and preemption are the
scheduling cycle's (``cycle.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from ..api.events import EventKind
from ..scheduler.errors import InvalidRequest
from ..scheduler.validation import SessionRequest, validate_session_request
from .base import Repository, _event, _get_workload, _preemptible, end_workload
from .catalogue import catalogue_of
from .models import Project, Workload, WorkloadKind, WorkloadState

ACTIVE_STATES = (WorkloadState.admitted, WorkloadState.running, WorkloadState.stopping)
OPEN_STATES = (WorkloadState.pending, *ACTIVE_STATES)


class WorkloadStore(Repository):
    def check_session_request(self, request: SessionRequest) -> None:
        """Validate without recording anything (the spawn form's dry run)."""
        with self.read() as session:
            validate_session_request(request, catalogue_of(session, request.username))

    def open_session_request(
        self, now: datetime, request: SessionRequest, lease: timedelta
    ) -> Workload:
        """Validate and queue a session request; supersedes the server's older open request."""
        with self._write(now) as session:
            validated = validate_session_request(request, catalogue_of(session, request.username))
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
                end_workload(
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
                end_workload(session, now, workload, outcome, message)
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
        lapsed = select(Workload).where(
            Workload.lease_expires_at < now,
            (Workload.state == WorkloadState.pending)
            | ((Workload.state == WorkloadState.admitted) & Workload.process_marker.is_(None)),
        )
        with self.read() as session:  # most cycles find none: no write transaction then
            if session.scalars(lapsed.with_only_columns(Workload.id).limit(1)).first() is None:
                return []
        with self._write(now) as session:
            expired = session.scalars(lapsed).all()
            for workload in expired:
                end_workload(
                    session,
                    now,
                    workload,
                    "expired",
                    "the spawner stopped renewing its request (hub restarted or the "
                    "spawn was abandoned)",
                )
            return [w.id for w in expired]
