"""The reconciler's writes: a workload's process marker, and repairs with their events.

Like every repository's writes these are fenced (``self._write``), so a controller that
lost the database lease repairs nothing. Each repair is an event of kind ``reconciled`` whose
message is the reason a person reads and whose ``reason`` names the rule
(``gpufleet.hub.reconcile.Rule``).

A repair applies only to the workload the reconciler saw: ``end_reconciled`` compares
the workload's ``version`` (bumped by every visible change), so a workload that changed
since it was observed (its spawner released it, a new start superseded it) is left alone
and looked at again on the next pass.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..api.events import EventKind
from ..scheduler.errors import InvalidRequest, NotFound
from .attempts import AttemptStore
from .base import Repository, _event, end_workload
from .database import Database
from .models import Workload, WorkloadKind, WorkloadState

RECONCILED = EventKind.RECONCILED


class ReconcileStore(Repository):
    def __init__(self, database: Database, attempts: AttemptStore):
        super().__init__(database)
        self.attempts = attempts

    def record_process_marker(self, now: datetime, workload_id: int, marker: str) -> None:
        """Remember the marker every process of ``workload_id`` will carry.

        Recorded with the request, before any process of the workload starts, so a live
        marked process is always either known here or not this deployment's at all. A
        workload keeps its first marker: a second, different one is refused.
        """
        with self._write(now) as session:
            workload = session.get(Workload, workload_id)
            if workload is None:
                raise NotFound(f"there is no workload {workload_id}")
            if workload.process_marker not in (None, marker):
                raise InvalidRequest(
                    f"workload {workload_id} already has a process marker; a new start of the "
                    "server opens a new request"
                )
            workload.process_marker = marker

    def end_reconciled(
        self, now: datetime, workload_id: int, version: int, outcome: str, rule: str, reason: str
    ) -> Workload | None:
        """End a workload the reconciler found with nothing of it running; close its GPUs.

        Only if it is still open at ``version``, the version the decision was taken on;
        returns it once ended — or, for a job stopping for a fault or a preemption before
        its agent reported its pods' ends, once it is back in the queue as its next
        attempt (``state/attempts.py``) — else None. The caller observed that no process
        of it is alive.
        """
        with self._write(now) as session:
            workload = session.get(Workload, workload_id)
            if (
                workload is None
                or workload.version != version
                or workload.state == WorkloadState.ended
            ):
                return None
            _event(
                session,
                now,
                RECONCILED,
                reason,
                reason=rule,
                workload=workload,
                data={"repair": "end-workload", "outcome": outcome},
            )
            if workload.kind == WorkloadKind.job:
                self.attempts.attempt_ended(session, now, workload, outcome, reason)
            else:
                end_workload(session, now, workload, outcome, reason)
            return workload

    def record_reconciled(
        self,
        now: datetime,
        message: str,
        *,
        rule: str,
        workload_id: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        """Record a repair done outside the database (a server stopped, processes ended)."""
        with self._write(now) as session:
            workload = session.get(Workload, workload_id) if workload_id is not None else None
            _event(session, now, RECONCILED, message, reason=rule, workload=workload, data=data)
