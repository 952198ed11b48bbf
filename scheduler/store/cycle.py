"""One scheduling cycle against the database: refresh the mirror, plan, commit at once.

The decisions of a cycle — allocations opened, workloads admitted, victims set stopping,
reasons and queue positions — are written in one fenced transaction with bulk
statements. A controller killed at any point leaves all of them or none; the partial
unique index on open allocations turns any GPU handed out twice into an error that rolls
the whole cycle back. Every admission and preemption is checked against the row it
changes (``state`` must still be what the plan saw); a mismatch rolls back and the next
cycle starts from a fresh mirror.

What a person reads is written only when it would notice: a waiting workload's row is
updated when the cause of its wait changes, when its position among the first ten of
its queue changes, when a position further back drifts by more than a tenth, or when
its reason changed and was last written ``REASON_REFRESH_S`` ago. Writing every shifted
position of a 10,000-long queue every cycle would cost more than the cycle itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Update, bindparam, insert, or_, update
from sqlalchemy.orm import Session

from .. import failpoints
from ..errors import CycleConflict
from ..idle import IdleCause, idle_after_plan
from ..memo import PlanMemo
from ..plan import plan
from ..quota import QuotaLimits
from ..snapshot import Plan, Policy, SchedulingSnapshot, WaitCause, Waiting
from .base import StoreBase
from .collector import collector_paused
from .mirror import ChangeTracker, Mirror, Shown, promised_json
from .models import Allocation, Event, Workload, WorkloadState

REASON_REFRESH_S = 30.0


@dataclass(frozen=True)
class AdmittedWait:
    workload_id: int
    project: str
    gpu_type: str
    waited_seconds: float


@dataclass(frozen=True)
class Stop:
    """A victim the backend must now stop (stop protocol of DESIGN.md)."""

    workload_id: int
    kind: str
    user: str
    server_name: str
    reason: str


@dataclass(frozen=True)
class CycleResult:
    admitted: tuple[AdmittedWait, ...]
    stops: tuple[Stop, ...]
    changed: tuple[int, ...]  # every workload whose row changed (watchers are woken)
    plan: Plan


class SchedulingStore(StoreBase):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tracker = ChangeTracker(self._sessions)
        self.mirror = Mirror()
        # The planner's indexes and answers from the last cycle (a cache: the plan is the
        # same without it); dropped with the mirror.
        self.plan_memo = PlanMemo()
        # The last committed cycle's snapshot and plan (immutable: read by the metrics
        # scrape in another thread, ``idle_gpus``).
        self.last_cycle: tuple[SchedulingSnapshot, Plan] | None = None
        self._idle_limits: QuotaLimits | None = None

    def refresh_mirror(self, now: datetime) -> None:
        """Bring the mirror up to date with what committed since it was last, and with the
        back-offs that ended by ``now``."""
        dirty = self.tracker.take()
        moment = now.timestamp()
        if dirty or any(until <= moment for until in self.mirror.backing_off.values()):
            with self.read() as session:
                self.mirror.refresh(session, dirty, moment)

    def forget_mirror(self) -> None:
        """Rebuild from the database next cycle (another controller may have written)."""
        self.tracker.everything()
        self.plan_memo = PlanMemo()

    def scheduling_cycle(self, now: datetime, policy: Policy) -> CycleResult:
        with collector_paused():  # see collector.py: no full collection inside a cycle
            return self._cycle(now, policy)

    def _cycle(self, now: datetime, policy: Policy) -> CycleResult:
        self.refresh_mirror(now)
        moment = now.timestamp()
        snapshot = self.mirror.snapshot(policy)
        decided = plan(snapshot, moment, self.plan_memo)
        shown = self._to_show(decided.waiting, moment)
        committed = False
        try:
            with self._write(now) as session:
                stops = self._commit(session, now, decided, shown)
                if decided.admissions or decided.preemptions:
                    failpoints.reach("admission-before-commit")
            committed = True
        finally:
            if not committed:  # whatever stopped it, the mirror may be ahead of the rows
                self.forget_mirror()
        # Only what ``idle_gpus`` reads: the plan's waits may hold the cycle's state.
        self.last_cycle = (
            snapshot,
            Plan(admissions=decided.admissions, kept=decided.kept, held=decided.held),
        )
        admitted = tuple(
            AdmittedWait(r.id, r.project, r.gpu_type, moment - r.created_at)
            for r in (self.mirror.pending[a.workload_id] for a in decided.admissions)
        )
        self.mirror.apply(decided, moment, shown)
        changed = (
            *(a.workload_id for a in decided.admissions),
            *(p.victim_id for p in decided.preemptions),
            *shown,
        )
        return CycleResult(admitted, stops, tuple(changed), decided)

    def idle_gpus(self) -> dict[str, Counter[IdleCause]]:
        """Per GPU type work waits for, once the last cycle's decisions are carried out:
        its free GPUs by why nothing waiting uses them (``idle.idle_after_plan``)."""
        last = self.last_cycle
        if last is None:
            return {}
        snapshot, decided = last
        if self._idle_limits is None or self._idle_limits.tree is not snapshot.projects:
            self._idle_limits = QuotaLimits(snapshot.projects)
        return idle_after_plan(snapshot, decided, self._idle_limits)

    # ---------------------------------------------------------------- commit
    def _to_show(self, waiting: Iterable[Waiting], moment: float) -> dict[int, Shown]:
        changes = {}
        shown = self.mirror.shown
        for wait in waiting:
            before = shown.get(wait.workload_id)
            if (
                before is not None
                and before.position == wait.position
                and before.reason == wait.reason
                and before.cause == wait.cause
            ):
                continue  # what the row says already (most rows, most cycles)
            if before is None or _noticeable(before, wait, moment):
                changes[wait.workload_id] = Shown(wait.cause, wait.reason, wait.position, moment)
        return changes

    def _commit(
        self, session: Session, now: datetime, decided: Plan, shown: dict[int, Shown]
    ) -> tuple[Stop, ...]:
        mirror = self.mirror
        connection = session.connection()
        events: list[dict[str, Any]] = []
        allocations: list[dict[str, Any]] = []
        admitted = []
        for admission in decided.admissions:
            request = mirror.pending[admission.workload_id]
            project_id = mirror.project_ids[request.project]
            for pod_index, pod in enumerate(admission.pods):
                node_id = mirror.node_ids[pod.node]
                allocations.extend(
                    {
                        "workload_id": request.id,
                        "gpu_uuid": uuid,
                        "node_id": node_id,
                        "pod_index": pod_index,
                        "project_id": project_id,
                        "username": request.user,
                        "gpu_type": request.gpu_type,
                        "opened_at": now,
                    }
                    for uuid in pod.gpus
                )
            nodes = ", ".join(sorted({pod.node for pod in admission.pods}))
            borrowed = (
                f"; {admission.borrowed} borrowed beyond project {request.project}'s guarantee"
                if admission.borrowed
                else ""
            )
            reason = f"admitted on {nodes} ({admission.zone}){borrowed}"
            admitted.append({"wid": request.id, "reason": reason})
            events.append(
                _event_row(
                    now,
                    "admitted",
                    f"workload {request.id} admitted: {request.gpus} × {request.gpu_type} on "
                    f"{nodes} in {admission.cluster}/{admission.zone}{borrowed}",
                    request.id,
                    request.project,
                    request.user,
                    reason="borrowed" if admission.borrowed else "",
                    data={"gpus": [g for pod in admission.pods for g in pod.gpus]},
                )
            )
        if allocations:
            session.execute(insert(Allocation), allocations)
        if admitted:
            result = connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(
                    state=WorkloadState.admitted,
                    admitted_at=now,
                    promised=None,
                    held_cluster=None,
                    held_zone=None,
                    queue_position=None,
                    reason=bindparam("reason"),
                    version=Workload.version + 1,
                ),
                admitted,
            )
            if result.rowcount != len(admitted):
                raise CycleConflict("a workload admitted by this cycle is no longer pending")
        stops = []
        stopping = []
        for preemption in decided.preemptions:
            victim = mirror.running[preemption.victim_id]
            reason = f"preempted: {preemption.reason}"
            stopping.append(
                {"wid": victim.id, "reason": reason, "for_id": preemption.for_workload_id}
            )
            stops.append(
                Stop(
                    victim.id,
                    victim.kind,
                    victim.user,
                    mirror.server_names.get(victim.id, ""),
                    reason,
                )
            )
            events.append(
                _event_row(
                    now,
                    "preempting",
                    f"workload {victim.id} is being stopped to make room for workload "
                    f"{preemption.for_workload_id}: {preemption.reason}",
                    victim.id,
                    victim.project,
                    victim.user,
                    reason=preemption.cause.value,
                    data={"for": preemption.for_workload_id},
                )
            )
        if stopping:
            result = connection.execute(
                update(Workload)
                .where(
                    Workload.id == bindparam("wid"),
                    # Not in_(): an expanding IN cannot be part of an executemany.
                    or_(
                        Workload.state == WorkloadState.admitted,
                        Workload.state == WorkloadState.running,
                    ),
                )
                .values(
                    state=WorkloadState.stopping,
                    reason=bindparam("reason"),
                    preempted_for_id=bindparam("for_id"),
                    version=Workload.version + 1,
                ),
                stopping,
            )
            if result.rowcount != len(stopping):
                raise CycleConflict("a workload preempted by this cycle no longer runs")
        if decided.kept:
            connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(promised=bindparam("promised")),
                [{"wid": k.workload_id, "promised": promised_json(k.pods)} for k in decided.kept],
            )
        holds = _hold_changes(mirror.holding, decided)
        if holds:
            connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(held_cluster=bindparam("cluster"), held_zone=bindparam("zone")),
                holds,
            )
        waits = []
        for workload_id, show in shown.items():
            before = mirror.shown.get(workload_id)
            waits.append({"wid": workload_id, "reason": show.reason, "position": show.position})
            if before is None or before.cause != show.cause:
                request = mirror.pending[workload_id]
                events.append(
                    _event_row(
                        now,
                        "waiting",
                        f"workload {workload_id} waits: {show.reason}",
                        workload_id,
                        request.project,
                        request.user,
                        reason=show.cause.value,
                    )
                )
        if waits:
            _execute_many(  # thousands of rows when reasons are refreshed
                connection,
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(
                    reason=bindparam("reason"),
                    queue_position=bindparam("position"),
                    version=Workload.version + 1,
                ),
                waits,
            )
        if events:
            session.execute(insert(Event), events)
        # The partial unique index turns a GPU handed out twice into an IntegrityError
        # here, which rolls the whole cycle back.
        session.flush()
        return tuple(stops)


def _hold_changes(before: Mapping[int, tuple[str, str]], decided: Plan) -> list[dict[str, Any]]:
    """The waiting rows whose held zone changes with this plan: a new or moved hold, or
    one given up (admitted holders are cleared with their admission)."""
    after = {wid: (cluster, zone) for (cluster, zone, _), wid in decided.held.items()}
    changes = [
        {"wid": wid, "cluster": zone[0], "zone": zone[1]}
        for wid, zone in after.items()
        if before.get(wid) != zone
    ]
    changes.extend(
        {"wid": wid, "cluster": None, "zone": None} for wid in before.keys() - after.keys()
    )
    return changes


def _execute_many(
    connection: Connection, statement: Update, rows: Sequence[dict[str, Any]]
) -> None:
    """``connection.execute(statement, rows)`` with the statement compiled once and the
    rows handed to the driver as they are. SQLAlchemy's own executemany runs each row's
    parameters through the compiler: with 10,000 waiting, that was most of a cycle's
    commit whenever their reasons were refreshed. Only for rows of plain values (ints and
    strings: no type conversion is applied to them); the statement's own constants are
    converted by their types as usual."""
    dialect = connection.dialect
    compiled = statement.compile(dialect=dialect)
    constants: dict[str, Any] = {}
    for name, value in compiled.params.items():
        if name in rows[0]:
            continue
        process = compiled.binds[name].type.bind_processor(dialect)
        constants[name] = value if process is None else process(value)
    order = compiled.positiontup
    parameters: list[Any] = (
        [tuple(constants[n] if n in constants else row[n] for n in order) for row in rows]
        if order is not None
        else [{**constants, **row} for row in rows]
    )
    connection.exec_driver_sql(compiled.string, parameters)


def _noticeable(before: Shown, wait: Waiting, moment: float) -> bool:
    if before.cause != wait.cause:
        return True
    if before.position != wait.position and (
        wait.position <= 10 or abs(wait.position - before.position) > before.position / 10
    ):
        return True
    return before.reason != wait.reason and (
        wait.cause is WaitCause.PREEMPTING or moment - before.written_at >= REASON_REFRESH_S
    )


def _event_row(
    now: datetime,
    kind: str,
    message: str,
    workload_id: int,
    project: str,
    user: str,
    reason: str = "",
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "at": now,
        "kind": kind,
        "message": message,
        "reason": reason,
        "cause": "scheduler",
        "workload_id": workload_id,
        "project": project,
        "username": user,
        "node": None,
        "data": data or {},
    }
