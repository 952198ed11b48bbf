"""One scheduling cycle against the database: refresh the mirror, plan, commit.

A cycle has three steps, so that its planning can run away from the event loop
(``hub/scheduling.py``): ``plan_cycle`` brings the mirror up to date, plans, and turns the
decisions into the rows to write (a ``PlannedCycle``: plain values, picklable);
``commit_cycle`` writes them; ``settle_cycle`` tells the mirror what became of them. The
mirror and the planner's memo are touched by the first and last steps only, which run
wherever the cycle is planned, one cycle at a time. ``scheduling_cycle`` runs all three
here and now.

The decisions of a cycle — allocations opened, workloads admitted, victims set stopping,
the zones held, and the events — are written in one fenced transaction with bulk
statements. A controller killed at any point leaves all of them or none; the partial
unique index on open allocations turns any GPU handed out twice into an error that rolls
the whole cycle back. Every admission and preemption is checked against the row it
changes (``state`` must still be what the plan saw); a mismatch rolls back and the next
cycle starts from a fresh mirror.

What the state check does not see — a node cordoned, drained or found unhealthy, a GPU
lost, a quota changed, an admitted request otherwise changed — the commit checks against
the change tracker: past the fence every other write transaction of this controller has
committed or waits for this one (the lease row is their first write), so what committed
since the mirror was read is known, and a plan that depends on any of it (its admitted
and preempted workloads, the nodes it places on, the tree when it admits or preempts) is
dropped unwritten; the next cycle plans on the mirror brought up to date. A cycle run
whole on the event loop is crossed only by the writes of the controller's worker threads
(the culler's, the cluster inventory's), which it checks alike.

What a person reads is written only when it would notice: a waiting workload's row is
updated when the cause of its wait changes, when its position among the first ten of
its queue changes, when a position further back drifts by more than a tenth, or when
its reason changed and was last written ``REASON_REFRESH_S`` ago. Writing every shifted
position of a 10,000-long queue every cycle would cost more than the cycle itself. Those
rows (``PlannedCycle.waits``, up to the whole queue after a full read) may be written in
transactions of their own after the decisions (``write_waits``): each is guarded by the
row still waiting, and a controller killed between them rewrites them all on its next
full read.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Update, bindparam, insert, or_, update
from sqlalchemy.orm import Session

from ..scheduler import failpoints
from ..scheduler.errors import CycleConflict
from ..scheduler.idle import IdleCause, idle_after_plan
from ..scheduler.memo import PlanMemo
from ..scheduler.plan import plan
from ..scheduler.quota import QuotaLimits
from ..scheduler.snapshot import Plan, Policy, Running, SchedulingSnapshot, WaitCause, Waiting
from .base import Repository
from .collector import collector_paused
from .database import Database
from .mirror import EVERYTHING, ChangeTracker, Mirror, Shown, promised_json
from .models import Allocation, Event, Workload, WorkloadState

REASON_REFRESH_S = 30.0
Change = tuple[str, int]  # the change tracker's marks: ("workload", id), ("node", id), ...


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
    # The plan; from a cycle planned in another process its decisions only (no waits).
    plan: Plan
    # The victims still stopping once the decisions are carried out, with their servers'
    # names: what retrying their stops needs.
    stopping: tuple[Running, ...] = ()
    server_names: dict[int, str] = field(default_factory=dict)
    # Nothing was written: something the plan depended on changed while it was planned.
    dropped: bool = False


@dataclass(frozen=True)
class PlannedCycle:
    """A planned cycle's decisions as the rows its commit writes (``_write_decisions``)."""

    now: datetime
    allocations: tuple[dict[str, Any], ...]
    admitted: tuple[dict[str, Any], ...]
    stopping: tuple[dict[str, Any], ...]
    kept: tuple[dict[str, Any], ...]
    holds: tuple[dict[str, Any], ...]
    events: tuple[dict[str, Any], ...]
    waits: tuple[dict[str, Any], ...]
    # The change tracker's marks the decisions depend on (see the module docstring).
    depends: frozenset[Change]
    result: CycleResult
    # ``idle_gpus`` once the decisions are carried out, when asked for (``plan_cycle``).
    idle: Mapping[str, Counter[IdleCause]] | None = None

    @property
    def writes_nothing(self) -> bool:
        """Whether the commit has no row to write: most cycles of a fleet where nothing
        happens."""
        rows = (self.allocations, self.admitted, self.stopping, self.kept, self.holds)
        return not any(rows) and not self.events and not self.waits


class Outcome(enum.Enum):
    """What became of a planned cycle, for ``settle_cycle``."""

    COMMITTED = "committed"
    DROPPED = "dropped"  # nothing written; the mirror is as the database was when read
    FAILED = "failed"  # the commit failed or was cut short: the mirror is read afresh


@dataclass(frozen=True)
class _Planned:
    snapshot: SchedulingSnapshot
    decided: Plan
    shown: dict[int, Shown]
    moment: float


class SchedulingStore(Repository):
    def __init__(self, database: Database):
        super().__init__(database)
        self.tracker = ChangeTracker(database.sessions)
        self.mirror = Mirror()
        # The planner's indexes and answers from the last cycle (a cache: the plan is the
        # same without it); dropped when the mirror is read afresh.
        self.plan_memo = PlanMemo()
        # The last committed cycle's snapshot and plan (immutable: read by the metrics
        # scrape in another thread, ``idle_gpus``).
        self.last_cycle: tuple[SchedulingSnapshot, Plan] | None = None
        # ``idle_gpus`` as the process that plans the cycles reported it (it has the
        # snapshot); set by the controller when that is not this one.
        self.last_idle: Mapping[str, Counter[IdleCause]] | None = None
        self._idle_limits: QuotaLimits | None = None
        self._planned: _Planned | None = None

    def refresh_mirror(self, now: datetime, dirty: Iterable[Change] = ()) -> None:
        """Bring the mirror up to date with what committed since it was last (``dirty``,
        told by the process that tracks the changes, and what this store's tracker noted),
        and with the back-offs that ended by ``now``."""
        dirty = self.tracker.take().union(dirty)
        if EVERYTHING in dirty:
            self.plan_memo = PlanMemo()
        moment = now.timestamp()
        if dirty or any(until <= moment for until in self.mirror.backing_off.values()):
            with self.read() as session:
                self.mirror.refresh(session, dirty, moment)

    def forget_mirror(self) -> None:
        """Rebuild from the database next cycle (another controller may have written).
        Only marks the tracker: safe while a cycle is planned elsewhere, whose commit it
        makes drop the plan."""
        self.tracker.everything()

    def scheduling_cycle(self, now: datetime, policy: Policy) -> CycleResult:
        """A whole cycle, here and now: plan, commit (waits included) and settle."""
        with collector_paused():  # see collector.py: no full collection inside a cycle
            planned = self.plan_cycle(now, policy)
            outcome = Outcome.FAILED
            try:
                committed = self.commit_cycle(planned)
                outcome = Outcome.COMMITTED if committed else Outcome.DROPPED
            finally:
                self.settle_cycle(outcome)
        if outcome is Outcome.DROPPED:
            return CycleResult((), (), (), Plan(), dropped=True)
        return planned.result

    # ------------------------------------------------------------- planning
    def plan_cycle(
        self, now: datetime, policy: Policy, dirty: Iterable[Change] = (), idle: bool = False
    ) -> PlannedCycle:
        """Refresh the mirror (``refresh_mirror``), plan, and the rows the commit writes;
        with ``idle``, ``idle_gpus`` as it will be once they are. The first step of a
        cycle; ``settle_cycle`` must follow before the next."""
        if self._planned is not None:  # never settled: whatever became of it is unknown
            self.settle_cycle(Outcome.FAILED)
        try:
            self.refresh_mirror(now, dirty)
            moment = now.timestamp()
            snapshot = self.mirror.snapshot(policy)
            decided = plan(snapshot, moment, self.plan_memo)
            shown = self._to_show(decided.waiting, moment)
            planned = self._decisions(now, moment, decided, shown)
        except BaseException:
            self.forget_mirror()  # the changes taken from the tracker may be half read
            raise
        self._planned = _Planned(snapshot, decided, shown, moment)
        if not idle:
            return planned
        return replace(planned, idle=self._idle(snapshot, _decisions_only(decided)))

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

    # --------------------------------------------------------------- commit
    def commit_cycle(self, planned: PlannedCycle, waits: int | None = None) -> bool:
        """Write a planned cycle's decisions, with its first ``waits`` waits rows (all by
        default), in one fenced transaction; False, writing nothing, when something they
        depend on committed since the mirror was read (see the module docstring)."""
        if planned.writes_nothing:
            # No transaction: an idle fleet's cycles, several a second, would each cost a
            # fenced commit. (Stale only when everything must be read again.)
            return not _stale(planned, self.tracker.since_take())
        with self._write(planned.now) as session:
            # Past the fence: every other write transaction has committed, or waits for
            # this one; ``since_take`` holds what the committed ones changed.
            if _stale(planned, self.tracker.since_take()):
                return False
            self._write_decisions(session, planned, planned.waits[:waits])
        return True

    def write_waits(self, now: datetime, rows: Sequence[dict[str, Any]]) -> None:
        """Waits rows of a committed cycle that ``commit_cycle`` left, in a fenced
        transaction of their own (each row is written only if the workload still waits)."""
        if rows:
            with self._write(now) as session:
                _execute_many(session.connection(), _WAITS_UPDATE, rows)

    def settle_cycle(self, outcome: Outcome) -> None:
        """Carry a committed plan into the mirror; after a failure, read everything again.
        The last step of a cycle, where it was planned."""
        planned, self._planned = self._planned, None
        if planned is None:
            return
        if outcome is Outcome.FAILED:  # the mirror may be ahead of the rows
            self.forget_mirror()
        elif outcome is Outcome.COMMITTED:
            self.last_cycle = (planned.snapshot, _decisions_only(planned.decided))
            self.mirror.apply(planned.decided, planned.moment, planned.shown)

    def idle_gpus(self) -> dict[str, Counter[IdleCause]]:
        """Per GPU type work waits for, once the last cycle's decisions are carried out:
        its free GPUs by why nothing waiting uses them (``idle.idle_after_plan``)."""
        last = self.last_cycle
        if last is None:
            return dict(self.last_idle or {})
        return self._idle(*last)

    def _idle(self, snapshot: SchedulingSnapshot, decided: Plan) -> dict[str, Counter[IdleCause]]:
        if self._idle_limits is None or self._idle_limits.tree is not snapshot.projects:
            self._idle_limits = QuotaLimits(snapshot.projects)
        return idle_after_plan(snapshot, decided, self._idle_limits)

    def _decisions(
        self, now: datetime, moment: float, decided: Plan, shown: dict[int, Shown]
    ) -> PlannedCycle:
        """The rows that carry out ``decided``, read off the mirror it was planned on."""
        mirror = self.mirror
        admissions = _admission_rows(mirror, now, decided)
        preemptions = _preemption_rows(mirror, now, decided)
        kept = [{"wid": k.workload_id, "promised": promised_json(k.pods)} for k in decided.kept]
        holds = _hold_changes(mirror.holding, decided)
        waits, wait_events = _wait_rows(mirror, now, shown)
        depends = admissions.depends | preemptions.depends
        depends.update(("workload", row["wid"]) for row in (*kept, *holds))
        return PlannedCycle(
            now=now,
            allocations=tuple(admissions.allocations),
            admitted=tuple(admissions.admitted),
            stopping=tuple(preemptions.stopping),
            kept=tuple(kept),
            holds=tuple(holds),
            events=(*admissions.events, *preemptions.events, *wait_events),
            waits=tuple(waits),
            depends=frozenset(depends),
            result=_cycle_result(mirror, moment, decided, shown, preemptions),
        )

    def _write_decisions(
        self, session: Session, planned: PlannedCycle, waits: Sequence[dict[str, Any]]
    ) -> None:
        connection = session.connection()
        if planned.allocations:
            session.execute(insert(Allocation), list(planned.allocations))
        if planned.admitted:
            result = connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(
                    state=WorkloadState.admitted,
                    admitted_at=planned.now,
                    promised=None,
                    held_cluster=None,
                    held_zone=None,
                    queue_position=None,
                    reason=bindparam("reason"),
                    version=Workload.version + 1,
                ),
                list(planned.admitted),
            )
            if result.rowcount != len(planned.admitted):
                raise CycleConflict("a workload admitted by this cycle is no longer pending")
        if planned.stopping:
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
                list(planned.stopping),
            )
            if result.rowcount != len(planned.stopping):
                raise CycleConflict("a workload preempted by this cycle no longer runs")
        if planned.kept:
            connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(promised=bindparam("promised")),
                list(planned.kept),
            )
        if planned.holds:
            connection.execute(
                update(Workload)
                .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
                .values(held_cluster=bindparam("cluster"), held_zone=bindparam("zone")),
                list(planned.holds),
            )
        if waits:  # thousands of rows when reasons are refreshed
            _execute_many(connection, _WAITS_UPDATE, waits)
        if planned.events:
            session.execute(insert(Event), list(planned.events))
        # The partial unique index turns a GPU handed out twice into an IntegrityError
        # here, which rolls the whole cycle back.
        session.flush()
        if planned.admitted or planned.stopping:
            failpoints.reach("admission-before-commit")


_WAITS_UPDATE = (
    update(Workload)
    .where(Workload.id == bindparam("wid"), Workload.state == WorkloadState.pending)
    .values(
        reason=bindparam("reason"),
        queue_position=bindparam("position"),
        version=Workload.version + 1,
    )
)


def _stale(planned: PlannedCycle, changed: set[Change]) -> bool:
    """Whether a commit of ``planned`` must be dropped for what ``changed`` since it was
    planned (see the module docstring)."""
    if not changed:
        return False
    if EVERYTHING in changed:
        return True
    if ("tree", 0) in changed and (planned.admitted or planned.stopping):
        return True
    return not changed.isdisjoint(planned.depends)


def _decisions_only(decided: Plan) -> Plan:
    """What ``idle_gpus`` reads of a plan: its waits may hold the cycle's state."""
    return Plan(admissions=decided.admissions, kept=decided.kept, held=decided.held)


@dataclass
class _Admissions:
    """The rows a cycle's admissions write: their GPUs' allocations, the workloads set
    admitted, their events, and the change tracker's marks they depend on."""

    allocations: list[dict[str, Any]] = field(default_factory=list)
    admitted: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    depends: set[Change] = field(default_factory=set)


@dataclass
class _Preemptions:
    """The rows a cycle's preemptions write (the victims set stopping, their events), the
    stops the backend carries out, the victims as they will stand, and the marks they
    depend on."""

    stopping: list[dict[str, Any]] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    victims: list[Running] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    depends: set[Change] = field(default_factory=set)


def _admission_rows(mirror: Mirror, now: datetime, decided: Plan) -> _Admissions:
    """The allocations opened, the workloads set admitted and their events; each depends
    on its workload and on the nodes it is placed on."""
    out = _Admissions()
    for admission in decided.admissions:
        request = mirror.pending[admission.workload_id]
        project_id = mirror.project_ids[request.project]
        out.depends.add(("workload", request.id))
        for pod_index, pod in enumerate(admission.pods):
            node_id = mirror.node_ids[pod.node]
            out.depends.add(("node", node_id))
            out.allocations.extend(
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
        out.admitted.append({"wid": request.id, "reason": reason})
        out.events.append(
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
    return out


def _preemption_rows(mirror: Mirror, now: datetime, decided: Plan) -> _Preemptions:
    """The victims set stopping, their stops and events; each depends on the victim and
    on the workload it makes room for."""
    out = _Preemptions()
    for preemption in decided.preemptions:
        victim = mirror.running[preemption.victim_id]
        for_id = preemption.for_workload_id
        out.depends.update((("workload", victim.id), ("workload", for_id)))
        reason = f"preempted: {preemption.reason}"
        out.stopping.append({"wid": victim.id, "reason": reason, "for_id": for_id})
        out.victims.append(replace(victim, stopping=True, stopping_for=for_id))
        server_name = mirror.server_names.get(victim.id, "")
        out.stops.append(Stop(victim.id, victim.kind, victim.user, server_name, reason))
        out.events.append(
            _event_row(
                now,
                "preempting",
                f"workload {victim.id} is being stopped to make room for workload "
                f"{for_id}: {preemption.reason}",
                victim.id,
                victim.project,
                victim.user,
                reason=preemption.cause.value,
                data={"for": for_id},
            )
        )
    return out


def _wait_rows(
    mirror: Mirror, now: datetime, shown: Mapping[int, Shown]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The waiting rows' new reasons and positions (``shown``), and a "waiting" event for
    each workload whose cause of waiting is new or changed."""
    waits: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
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
    return waits, events


def _cycle_result(
    mirror: Mirror,
    moment: float,
    decided: Plan,
    shown: Mapping[int, Shown],
    preemptions: _Preemptions,
) -> CycleResult:
    """What the controller acts on once the cycle commits: the admitted and how long they
    waited, the stops, the workloads changed, and every victim still stopping (those of
    earlier cycles, then this one's)."""
    victim_ids = {v.id for v in preemptions.victims}
    still = (
        *(r for r in mirror.running.values() if r.stopping and r.id not in victim_ids),
        *preemptions.victims,
    )
    return CycleResult(
        admitted=tuple(
            AdmittedWait(r.id, r.project, r.gpu_type, moment - r.created_at)
            for r in (mirror.pending[a.workload_id] for a in decided.admissions)
        ),
        stops=tuple(preemptions.stops),
        changed=(
            *(a.workload_id for a in decided.admissions),
            *(p.victim_id for p in decided.preemptions),
            *shown,
        ),
        plan=decided,
        stopping=still,
        server_names={r.id: mirror.server_names.get(r.id, "") for r in still},
    )


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
