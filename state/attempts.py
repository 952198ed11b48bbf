"""A job's attempts in the store: what a fault on a running job does at once (an XID, a
hang, a drain), and what follows when an attempt has ended (``recovery/attempts.py``
decides; this carries it out); the node and GPU cordons the recovery loop makes, within
its breaker (``recovery/breaker.py``).

The invariants:

- an attempt is classified once, when it first goes wrong: the verdict is kept in
  ``workloads.recovery["fault"]`` while its pods stop, so that the SIGTERM the stop
  itself causes is never mistaken for the fault;
- a job goes back to the queue only once every pod of the ended attempt is reported
  ended (its GPUs are released then, as at any end) and under a new process marker, so
  nothing of the old attempt can be taken for the new one; reports and log chunks of an
  earlier attempt change nothing. (On Kubernetes, a gang that lost a pod may instead
  begin its next attempt at once, keeping its other pods: ``state/kept_pods.py``.);
- it keeps its id, name and submission time (its place in the queue), and each rank's log
  continues the same stream: an attempt's output starts after a line that says which
  attempt begins and why (``log_bases``);
- a fault that ends a job says so in its reason, and every restart is a
  ``job-restarting`` event with the attempt, the fault's class and the evidence.

The rules of ``JobStore`` (``store.jobs``), which the maintenance and reconciler repositories
are given to end attempts; every write is fenced by the lease.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.attempts import GiveUp, Resume, RetryPolicy, next_attempt
from ..recovery.breaker import BreakerPolicy, may_cordon
from ..recovery.classify import (
    FaultClass,
    GpuLost,
    HardwareAction,
    JobAction,
    PodOutcome,
    RankError,
    RecoveryPolicy,
    Signal,
    Verdict,
    Xid,
    classify,
    hang_of,
    outcome_reason,
)
from ..recovery.classify import JobProgress as JobProgressSeen
from ..scheduler.errors import NotFound
from .base import Repository, _event, end_workload
from .cycle import Stop
from .maintenance_plan import plan_gpu_maintenance, plan_node_maintenance
from .models import (
    Allocation,
    Cluster,
    Event,
    Gpu,
    JobLog,
    JobPod,
    JobProgress,
    Node,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)
from .next_attempt import attempt_record, begin_next_attempt, pods_of, restarting_event
from .progress import percentile
from .traces import HANG, open_trace

# What the agent reports of a failed rank: "rank 1: ValueError: bad learning rate".
# (Nine digits at most: the rest of the line is what a rank wrote, and int() refuses 4,300.)
_RANK_ERROR = re.compile(r"^rank (\d{1,9}): ([A-Za-z_][\w.]*): (.*)$", re.DOTALL)
HARDWARE_EVENTS = (EventKind.GPU_XID, EventKind.GPU_LOST)


@dataclass(frozen=True)
class DrainStops:
    sessions: tuple[Stop, ...]  # for the backend to snapshot and stop
    changed: tuple[int, ...]  # every workload the drain stops


NODE_ACTIONS = frozenset({HardwareAction.RECYCLE_NODE, HardwareAction.CORDON_NODE})
GPU_ACTIONS = frozenset(
    {
        HardwareAction.DIAGNOSE_GPU,
        HardwareAction.DRAIN_AND_RESET_GPU,
        HardwareAction.LEMON_GPU,
        HardwareAction.DIAGNOSE_LINK,
    }
)


class AttemptStore(Repository):
    # Set by the controller from its configuration (``hub/app.py``).
    retry_policy = RetryPolicy()
    recovery_policy = RecoveryPolicy()
    breaker_policy = BreakerPolicy()
    plan_maintenance = True  # what a fault leaves due is done (state/maintenance.py)

    # ------------------------------------------------------------ classify
    def _classify_pod(
        self, session: Session, now: datetime, workload: Workload, row: JobPod
    ) -> Verdict:
        """The verdict on a pod that ended badly, given the hardware signals seen lately on
        its job's GPUs and nodes."""
        gpus, nodes = _placement(workload)
        error = _RANK_ERROR.match(row.reason or "")
        reason = row.cause or outcome_reason(row.reason or "")
        if reason in ("NodeCannotStart", "NodeLost"):
            nodes = (row.node,)  # this pod's node, not every node of the job
        outcome = PodOutcome(
            exit_code=row.exit_code,
            signal=row.signal,
            reason=reason,
            rank_error=(
                RankError(int(error.group(1)), error.group(2), error.group(3).strip())
                if error
                else None
            ),
            gpus=gpus,
            nodes=nodes,
            at=now.timestamp(),
        )
        history = _hardware_history(session, now, gpus, nodes, self.recovery_policy)
        return classify(outcome, history, self.recovery_policy)

    def _fault_stops(
        self,
        session: Session,
        now: datetime,
        workload: Workload,
        verdict: Verdict,
        node: str | None = None,
        **data: Any,
    ) -> None:
        """Stop a running attempt for ``verdict`` with a ``job-fault`` event that carries
        ``data``."""
        stopping_for(workload, verdict, now, verdict.reason)
        workload.version += 1
        _event(
            session,
            now,
            EventKind.JOB_FAULT,
            f"attempt {workload.attempt}: {verdict.reason}; stopping every rank",
            reason=verdict.fault.value,
            workload=workload,
            node=node,
            data={"attempt": workload.attempt, **data},
        )

    def act_on_xid(self, now: datetime, gpu_uuid: str, xid: int) -> list[int]:
        """What an XID recorded on a GPU does at once: the job holding it stops for the
        verdict (its next attempt follows once its pods are gone), and the GPU or its node
        is taken out of service as the verdict says. Returns the workloads changed."""
        with self._write(now) as session:
            gpu = session.get(Gpu, gpu_uuid)
            if gpu is None:
                return []
            node = gpu.node.name
            signal = Xid(xid, gpu_uuid, node, now.timestamp())
            history = _hardware_history(session, now, (gpu_uuid,), (node,), self.recovery_policy)
            # The XID's own event (``record_xid``, just before) is not an earlier fault.
            own = [s for s in history if isinstance(s, Xid) and (s.code, s.gpu) == (xid, gpu_uuid)]
            if own:
                history.remove(max(own, key=lambda s: s.at))
            verdict = classify(signal, history, self.recovery_policy)
            changed: list[int] = []
            holder = held_by(session, gpu_uuid)
            if (
                holder is not None
                and holder.kind == WorkloadKind.job
                and holder.state in (WorkloadState.admitted, WorkloadState.running)
                and verdict.job is not JobAction.KEEP
            ):
                self._fault_stops(session, now, holder, verdict, node, gpu=gpu_uuid, xid=xid)
                changed.append(holder.id)
            self._take_out_of_service(session, now, gpu, verdict)
            return changed

    def _take_out_of_service(
        self, session: Session, now: datetime, gpu: Gpu, verdict: Verdict
    ) -> None:
        """A node fault cordons the node — unless the cluster's breaker is open or this
        cordon would open it (``recovery/breaker.py``); a GPU's hardware or repeated fault
        cordons the GPU. Either takes no new work until an admin uncordons the node."""
        node = gpu.node
        if verdict.hardware in NODE_ACTIONS:
            if self._cordon_node(session, now, node, verdict) and self.plan_maintenance:
                plan_node_maintenance(session, now, node, verdict)
            return
        if verdict.hardware is not HardwareAction.LEMON_GPU and self.plan_maintenance:
            plan_gpu_maintenance(session, now, gpu, verdict)
        if verdict.hardware is HardwareAction.LEMON_GPU and not gpu.lemon:
            gpu.cordoned = gpu.lemon = True
            gpu.maintenance = None  # a lemon waits for a person, not for a reset
            _event(
                session,
                now,
                EventKind.GPU_LEMON,
                f"GPU {gpu.uuid} (index {gpu.index}) of node {node.name} is on the lemon "
                f"list: {verdict.reason}; it stays out of service until an admin clears it",
                reason=verdict.fault.value,
                node=node.name,
                cause="recovery",
                data={"uuid": gpu.uuid, "index": gpu.index},
            )
        elif verdict.hardware in GPU_ACTIONS and not gpu.cordoned:
            gpu.cordoned = True
            _event(
                session,
                now,
                EventKind.GPU_CORDONED,
                f"GPU {gpu.uuid} (index {gpu.index}) of node {node.name} cordoned by the "
                f"recovery loop: {verdict.reason}; it receives no new work until "
                + (
                    "its maintenance passes or the node is uncordoned"
                    if gpu.maintenance
                    else "the node is uncordoned"
                ),
                reason=verdict.fault.value,
                node=node.name,
                cause="recovery",
                data={"uuid": gpu.uuid, "index": gpu.index},
            )

    def _cordon_node(self, session: Session, now: datetime, node: Node, verdict: Verdict) -> bool:
        """Cordon ``node`` for ``verdict`` unless the cluster's breaker keeps it in service.
        Whether the node is out of service now."""
        if node.cordoned:
            return True
        if self._breaker_holds(session, now, node, verdict):
            return False
        node.cordoned = True
        node.recovery_cordoned_at = now
        _event(
            session,
            now,
            EventKind.NODE_CORDONED,
            f"node {node.name} cordoned by the recovery loop: {verdict.reason}; it "
            "receives no new work",
            reason=verdict.fault.value,
            node=node.name,
            cause="recovery",
        )
        return True

    def _breaker_holds(self, session: Session, now: datetime, node: Node, verdict: Verdict) -> bool:
        """Whether the cluster's breaker keeps ``node`` in service (opening it if this
        cordon would pass its share), with an event that says so."""
        cluster = node.zone.cluster
        if cluster.breaker_tripped_at is None:
            in_cluster = select(Node).join(Zone).where(Zone.cluster_id == cluster.id)
            nodes = session.scalar(select(func.count()).select_from(in_cluster.subquery()))
            since = now - timedelta(seconds=self.breaker_policy.window_s)
            recent = session.scalar(
                select(func.count()).select_from(
                    in_cluster.where(
                        Node.cordoned.is_(True), Node.recovery_cordoned_at >= since
                    ).subquery()
                )
            )
            if may_cordon(recent or 0, nodes or 0, self.breaker_policy):
                return False
            cluster.breaker_tripped_at = now
            _event(
                session,
                now,
                EventKind.RECOVERY_BREAKER_TRIPPED,
                f"the recovery loop stops cordoning nodes of cluster {cluster.name}: {recent} "
                f"of its {nodes} node(s) were cordoned by it within "
                f"{self.breaker_policy.window_s:.0f} s, and one more would pass "
                f"{self.breaker_policy.share:.0%}; an admin resets the breaker when the "
                f"cause is understood (gpufleet reset-breaker {cluster.name})",
                node=node.name,
                cause="recovery",
                data={"cluster": cluster.name, "recent": recent, "nodes": nodes},
            )
        _event(
            session,
            now,
            EventKind.RECOVERY_CORDON_WITHHELD,
            f"node {node.name} stays in service: the recovery breaker of cluster "
            f"{cluster.name} is open; the fault: {verdict.reason}",
            reason=verdict.fault.value,
            node=node.name,
            cause="recovery",
            data={"cluster": cluster.name},
        )
        return True

    def reset_breaker(self, now: datetime, cluster_name: str, by: str) -> bool:
        """Close a cluster's breaker: automated cordons resume. Whether it was open;
        NotFound for an unknown cluster."""
        with self._write(now) as session:
            cluster = session.scalar(select(Cluster).where(Cluster.name == cluster_name))
            if cluster is None:
                raise NotFound(f"there is no cluster {cluster_name!r}")
            if cluster.breaker_tripped_at is None:
                return False
            cluster.breaker_tripped_at = None
            _event(
                session,
                now,
                EventKind.RECOVERY_BREAKER_RESET,
                f"{by} reset the recovery breaker of cluster {cluster_name}: the recovery "
                "loop cordons faulty nodes again",
                cause=by,
                data={"cluster": cluster_name},
            )
            return True

    def clear_lemon(self, now: datetime, gpu_uuid: str, by: str) -> bool:
        """Take a GPU off the lemon list and back into service (an admin replaced or
        checked it). Whether it was on the list; NotFound for an unknown GPU."""
        with self._write(now) as session:
            gpu = session.get(Gpu, gpu_uuid)
            if gpu is None:
                raise NotFound(f"there is no GPU {gpu_uuid!r}")
            if not gpu.lemon:
                return False
            gpu.lemon = gpu.cordoned = False
            _event(
                session,
                now,
                EventKind.GPU_LEMON_CLEARED,
                f"{by} took GPU {gpu.uuid} (index {gpu.index}) of node {gpu.node.name} off "
                "the lemon list: it takes new work again",
                node=gpu.node.name,
                cause=by,
                data={"uuid": gpu.uuid, "index": gpu.index},
            )
            return True

    def breakers(self) -> dict[str, datetime | None]:
        """Each cluster's breaker: when it opened, None while closed."""
        with self.read() as session:
            return dict(session.execute(select(Cluster.name, Cluster.breaker_tripped_at)).all())

    def stop_hung_jobs(self, now: datetime) -> list[int]:
        """Stop every running job that stopped progressing (``classify.hang_of``): no step
        for longer than its limit, a checkpoint that never finished, or — a job that never
        reports progress — no output while its GPUs idle. Each restarts as a hang (its next
        attempt follows once its pods are gone). Returns the workloads stopped."""
        moment = now.timestamp()
        # Read first, in four queries whatever the number of jobs: a pass that finds no
        # hang (nearly every pass) writes nothing.
        with self.read() as session:
            hung = [
                (workload_id, version, hang)
                for workload_id, version, seen in _running_progress(session)
                if (hang := hang_of(seen, moment, self.recovery_policy)) is not None
            ]
        if not hung:
            return []
        stopped: list[int] = []
        with self._write(now) as session:
            for workload_id, version, hang in hung:
                workload = session.get(Workload, workload_id)
                if workload is None or workload.version != version:
                    continue  # it changed since it was read: the next pass looks again
                verdict = classify(hang, (), self.recovery_policy)
                # The stacks first: the gang is stopped once they are in (state/traces.py).
                wait = timedelta(seconds=self.recovery_policy.stacks_wait_s)
                open_trace(session, now, workload, HANG, "gpufleet", wait)
                self._fault_stops(session, now, workload, verdict, hang=hang.kind)
                stopped.append(workload.id)
        return stopped

    def drain_node(self, now: datetime, node_name: str, by: str, why: str) -> DrainStops:
        """Empty ``node_name``: it is cordoned, each job with a pod there stops as drained
        (the checkpoint signal and its grace; it restarts elsewhere at once, spending no
        fault), and each session there becomes stopping (its backend snapshots and stops
        it, as the culler's stop does). GPUs are released only as each ends. Returns the
        sessions the backend must stop and every workload changed; NotFound for an
        unknown node."""
        with self._write(now) as session:
            return self.drain(session, now, _node_named(session, node_name), by, why)

    def drain(self, session: Session, now: datetime, node: Node, by: str, why: str) -> DrainStops:
        said = f"node {node.name} drained by {by}" + (f": {why}" if why else "")
        node.cordoned = True
        _event(session, now, EventKind.NODE_DRAINED, said, node=node.name, cause=by)
        held = select(Allocation.workload_id).where(
            Allocation.node_id == node.id, Allocation.closed_at.is_(None)
        )
        workloads = session.scalars(
            select(Workload)
            .where(
                Workload.id.in_(held),
                Workload.state.in_((WorkloadState.admitted, WorkloadState.running)),
            )
            .order_by(Workload.id)
        ).all()
        stops: list[Stop] = []
        for workload in workloads:
            if workload.kind == WorkloadKind.job:
                # An admin's operation, not a fault: a ``job-drained`` event of its own
                # that names who drained which node (the event's time says when).
                drained = PodOutcome(None, None, "Drained", None, (), (node.name,), 0.0)
                verdict = classify(drained, (), self.recovery_policy)
                verdict = replace(verdict, reason=f"{said}; {verdict.reason}")
                stopping_for(workload, verdict, now, verdict.reason)
                workload.version += 1
                _event(
                    session,
                    now,
                    EventKind.JOB_DRAINED,
                    f"attempt {workload.attempt}: {said}; every rank gets the checkpoint "
                    "signal, and the job restarts on another node without spending its "
                    "retry budget",
                    reason=verdict.fault.value,
                    cause=by,
                    workload=workload,
                    node=node.name,
                    data={"attempt": workload.attempt, "node": node.name, "by": by, "why": why},
                )
                continue
            workload.state = WorkloadState.stopping
            workload.reason = f"{said}; the session is snapshotted and stops"
            workload.version += 1
            _event(session, now, EventKind.SESSION_DRAINED, workload.reason, workload=workload)
            stops.append(
                Stop(workload.id, "session", workload.username, workload.server_name, said)
            )
        return DrainStops(tuple(stops), tuple(w.id for w in workloads))

    # ---------------------------------------------------------- an ending
    def attempt_ended(
        self, session: Session, now: datetime, workload: Workload, outcome: str, message: str
    ) -> str | None:
        """Every pod of the attempt has ended: end the job, or queue its next attempt.
        Returns the fault class of a restart, None when the job ended."""
        cancelled = cancelled_ending(workload)
        if cancelled is not None:  # however the end of its ranks was observed
            outcome, message = cancelled
        verdict = self._ending_verdict(workload, outcome)
        if verdict is None:
            end_workload(session, now, workload, outcome, message)
            return None
        step = next_attempt(
            attempt_record(session, now, workload), verdict, self.retry_policy, now.timestamp()
        )
        if isinstance(step, GiveUp):
            # The pod's own ending, then the verdict, unless the verdict is what stopped it.
            said = (
                step.message if step.message.startswith(message) else f"{message}; {step.message}"
            )
            end_workload(session, now, workload, "failed", said)
            return None
        self._requeue(session, now, workload, verdict, step)
        return verdict.fault.value

    def _ending_verdict(self, workload: Workload, outcome: str) -> Verdict | None:
        """Why the attempt ended, when the job may run again; None when it simply ended."""
        if outcome in ("succeeded", "cancelled"):
            return None
        fault = (workload.recovery or {}).get("fault")
        if fault is not None:
            return _verdict_of(fault)
        if workload.preempted_for_id is not None:
            return classify(PodOutcome(None, None, "Preempted", None, (), (), 0.0))
        return None

    def _requeue(
        self, session: Session, now: datetime, workload: Workload, verdict: Verdict, step: Resume
    ) -> None:
        for allocation in workload.allocations:
            if allocation.closed_at is None:
                allocation.closed_at = now
        for row in session.scalars(pods_of(workload.id)):
            session.delete(row)  # the attempt's pods live on as job-pod-ended events
        begin_next_attempt(session, now, workload, verdict, step)
        workload.not_before = now + timedelta(seconds=step.delay_s) if step.delay_s else None
        workload.state = WorkloadState.pending
        workload.promised = None
        workload.admitted_at = workload.started_at = None
        workload.queue_position = None
        workload.reason = (
            f"attempt {step.attempt} waits for its back-off ({step.delay_s:.0f} s)"
            if step.delay_s
            else f"attempt {step.attempt} waits for the next admission cycle"
        )
        restarting_event(session, now, workload, verdict, step, step.message)


# ------------------------------------------------------------------ helpers
def cancelled_ending(workload: Workload) -> tuple[str, str] | None:
    """A cancelled job's outcome and message once every rank stopped; None if not
    cancelled. A cancel stands whoever sees the ranks gone: the agent or the reconciler."""
    if workload.outcome != "cancelled":
        return None
    return "cancelled", workload.reason.replace("stopping every rank", "every rank stopped")


def stopping_for(workload: Workload, verdict: Verdict, now: datetime, reason: str) -> None:
    """The attempt stops (every pod's ``run`` turns false) for ``verdict``, which is kept
    until its pods are gone: the SIGTERM the stop itself causes is never taken for the
    fault, and the time to resume counts from now."""
    workload.recovery = {
        **(workload.recovery or {}),
        "fault": verdict_json(verdict),
        "fault_at": now.isoformat(),
    }
    workload.state = WorkloadState.stopping
    workload.outcome = "failed"
    workload.reason = reason


def _placement(workload: Workload) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The GPUs and nodes the running attempt holds."""
    held = [a for a in workload.allocations if a.closed_at is None]
    return (
        tuple(sorted(a.gpu_uuid for a in held)),
        tuple(sorted({a.node.name for a in held})),
    )


def _hardware_history(
    session: Session,
    now: datetime,
    gpus: Sequence[str],
    nodes: Sequence[str],
    policy: RecoveryPolicy,
) -> list[Signal]:
    """The XIDs and lost GPUs recorded on these nodes within the classifier's windows (the
    lemon list's, a week by default, is the longest)."""
    window = max(policy.repeat_window_s, policy.blame_window_s, policy.lemon_window_s)
    since = now - timedelta(seconds=window)
    rows = session.scalars(
        select(Event).where(
            Event.kind.in_(HARDWARE_EVENTS), Event.at >= since, Event.node.in_(nodes)
        )
    )
    signals: list[Signal] = []
    for event in rows:
        data = event.data or {}
        gpu, node, at = str(data.get("uuid", "")), event.node or "", event.at.timestamp()
        if event.kind == "gpu-xid":
            signals.append(Xid(int(data.get("xid", 0)), gpu, node, at))
        elif gpu in gpus:
            signals.append(GpuLost(gpu, node, at))
    return signals


def _running_progress(session: Session) -> list[tuple[int, int, JobProgressSeen]]:
    """What the hang rules read of each running job: (id, version, progress). Until an
    attempt's own first step its steps are not judged (starting, loading a checkpoint): it
    is judged as a job that reports nothing, by its output and its GPUs."""
    jobs = session.execute(
        select(Workload.id, Workload.version, Workload.started_at, Workload.created_at).where(
            Workload.kind == WorkloadKind.job, Workload.state == WorkloadState.running
        )
    ).all()
    if not jobs:
        return []
    ids = [j.id for j in jobs]
    rows = {
        p.workload_id: p
        for p in session.scalars(select(JobProgress).where(JobProgress.workload_id.in_(ids)))
    }
    outputs = dict(
        session.execute(
            select(JobLog.workload_id, func.max(JobLog.at))
            .where(JobLog.workload_id.in_(ids))
            .group_by(JobLog.workload_id)
        ).all()
    )
    busy = dict(
        session.execute(
            select(Allocation.workload_id, func.max(Gpu.busy_at))
            .join(Gpu, Allocation.gpu_uuid == Gpu.uuid)
            .where(Allocation.workload_id.in_(ids), Allocation.closed_at.is_(None))
            .group_by(Allocation.workload_id)
        ).all()
    )
    seen = []
    for job in jobs:
        started = (job.started_at or job.created_at).timestamp()
        row = rows.get(job.id)
        last_step_at = p99 = checkpoint_started_at = None
        if (
            row is not None
            and row.last_step_at is not None
            and row.last_step_at.timestamp() >= started
        ):
            last_step_at = row.last_step_at.timestamp()
            p99 = percentile(row.step_times, 0.99)
        if row is not None and row.checkpoint_started_at is not None:
            checkpoint_started_at = row.checkpoint_started_at.timestamp()
        output, idle = outputs.get(job.id), busy.get(job.id)
        progress = JobProgressSeen(
            started_at=started,
            last_step_at=last_step_at,
            p99_step_s=p99,
            checkpoint_started_at=checkpoint_started_at,
            last_output_at=max(output.timestamp(), started) if output else None,
            gpus_idle_since=max(idle.timestamp(), started) if idle else started,
        )
        seen.append((job.id, job.version, progress))
    return seen


def verdict_json(verdict: Verdict) -> dict[str, Any]:
    return {
        "fault": verdict.fault.value,
        "job": verdict.job.value,
        "hardware": verdict.hardware.value,
        "spends_budget": verdict.spends_budget,
        "reason": verdict.reason,
        "gpus": list(verdict.gpus),
        "nodes": list(verdict.nodes),
    }


def _verdict_of(data: dict[str, Any]) -> Verdict:
    return Verdict(
        FaultClass(data["fault"]),
        JobAction(data["job"]),
        HardwareAction(data["hardware"]),
        bool(data["spends_budget"]),
        str(data["reason"]),
        tuple(data.get("gpus", ())),
        tuple(data.get("nodes", ())),
    )


def _node_named(session: Session, name: str) -> Node:
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFound(f"there is no node {name!r}")
    return node


def held_by(session: Session, gpu_uuid: str) -> Workload | None:
    """The workload holding a GPU now, if any."""
    return session.scalar(
        select(Workload)
        .join(Allocation, Allocation.workload_id == Workload.id)
        .where(Allocation.gpu_uuid == gpu_uuid, Allocation.closed_at.is_(None))
    )
