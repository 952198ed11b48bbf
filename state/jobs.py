"""Training jobs in the store: submission, what the node agents report of their pods,
cancel, and the per-rank logs.

A job is a workload of kind ``job`` whose ``spec`` says how to launch it. The scheduler
admits and places it like any workload (a gang: every pod in one zone, or nothing). The
node agents then learn their pods from ``agent_sync``, the one call by which an agent
reports what it runs and is told what it should run. The invariants:

- a pod's GPUs are released only when every pod of the job has been reported ended
  (exited on its own, stopped by the agent, or never started): ``_end`` closes the
  allocations, and only ``agent_sync`` (or the reconciler, once no process of the job is
  alive) calls it for a job that held GPUs;
- one pod failing stops the others: the job goes ``stopping`` with outcome ``failed``
  and every pod's ``run`` turns false (but for a Kubernetes gang's pod that is merely
  gone, whose next attempt may keep the others: ``state/kept_pods.py``);
- a pod reported ended stays ended: a late or repeated report cannot revive it.

The repository is ``store.jobs``; every write is fenced by the controller lease.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.checkpoints import filled
from ..recovery.classify import AgentSilent, NodeLost, Verdict, classify
from ..scheduler.errors import InvalidRequest
from ..scheduler.validation import JobRequest, validate_job_request
from .accounts import AccountStore
from .attempts import AttemptStore, cancelled_ending, stopping_for
from .base import _event, _get_workload, _preemptible, end_workload
from .catalogue import catalogue_of
from .clusters import AGENT_PREFIX
from .database import Database
from .desired_pods import (
    ACTIVE,
    ENDED_POD_STATES,
    DesiredPod,
    desired_on,
    launched_by,
    watched_on,
)
from .inventory import mark_silent
from .job_logs import LogChunk, store_chunks
from .kept_pods import GONE_CAUSES, restart_keeping
from .leftovers import (
    Leftover,
    hold_for_leftovers,
    leftovers_on,
    open_allocations_on,
    release_leftovers,
)
from .models import (
    JobLog,
    JobPod,
    Node,
    NodeHealth,
    Project,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from .progress import ProgressReport, record_progress
from .traces import PodStacks, record_stacks

POD_STATES = ("running", "exited", "stopped", "failed")
MAX_SCRIPT_BYTES = 1 << 20


@dataclass(frozen=True)
class JobSpec:
    """How a job is launched: ``python -m torch.distributed.run ... script args``.

    ``python`` is the submitting session's own interpreter, so the job runs with the
    session's environment; ``env`` is what the submitter chose to pass on (never the
    session's tokens); ``cwd`` is where the ranks start, if it exists on the node.
    """

    script: str
    python: str
    script_name: str = "train.py"
    args: tuple[str, ...] = ()
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    checkpoint_uri: str = ""  # the submission's own, taken as written
    # Where checkpoints go when the submission names no place: the controller's
    # job_checkpoint_store, with {user}, {job} and {id} filled in (recovery.checkpoints).
    checkpoint_store: str = ""
    grace_s: float = 30.0
    session: int | None = None  # the submitting session, whose environment the ranks get
    pinned: str = ""  # the copy of that session's environment made at submit

    def as_json(self) -> dict[str, Any]:
        return {
            "script": self.script,
            "python": self.python,
            "script_name": self.script_name,
            "args": list(self.args),
            "cwd": self.cwd,
            "env": dict(self.env),
            "checkpoint_uri": self.checkpoint_uri,
            "grace_s": self.grace_s,
        }


@dataclass(frozen=True)
class PodReport:
    """What an agent says of one pod it was told about."""

    workload_id: int
    pod_index: int
    state: str  # one of POD_STATES
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""  # for an ended pod: what went wrong, in words (the last error line)
    attempt: int = 1  # the job's attempt it is a pod of: an earlier one's report is stale
    adopted: bool = False  # a new agent took the running pod over from the one before
    # Why it ended in the backend's own word (``OOMKilled``, ``Evicted``, ``NodeLost``,
    # ``Deleted``, ``StartTimeout``...): what the classifier reads before ``reason``'s words.
    cause: str = ""


@dataclass(frozen=True)
class SyncResult:
    desired: list[DesiredPod]
    changed: list[int]  # workloads whose visible state changed (for long-polling readers)
    ended: list[str]  # the outcome of each job that ended in this sync
    restarted: list[str] = field(default_factory=list)  # the fault class of each restart
    # Seconds from a fault to the first step of the attempt after it, one per job resumed.
    resumed_after_s: list[float] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)  # for the agent to end
    released: list[str] = field(default_factory=list)  # GPUs no leftover holds any more
    # For a node agent: the pods its cluster runs on its Kubernetes nodes, whose output and
    # progress it relays (agent/kube_pods.py).
    watched: list[DesiredPod] = field(default_factory=list)


@dataclass
class NodesLost:
    nodes: list[str] = field(default_factory=list)  # became unknown now
    changed: list[int] = field(default_factory=list)  # jobs stopped or restarted for it
    restarted: list[str] = field(default_factory=list)  # the fault class of each restart


@dataclass(frozen=True)
class LogSlice:
    data: str
    next_offset: int


class JobStore(AttemptStore):
    def __init__(self, database: Database, accounts: AccountStore):
        super().__init__(database)
        self.accounts = accounts

    def open_job(self, now: datetime, request: JobRequest, spec: JobSpec) -> Workload:
        """Validate and queue a job; nothing is recorded for a request that cannot run."""
        if len(spec.script.encode()) > MAX_SCRIPT_BYTES:
            raise InvalidRequest(
                f"the entry script has {len(spec.script.encode())} bytes; the limit is "
                f"{MAX_SCRIPT_BYTES} (put the code in a module the script imports)"
            )
        if spec.python and not spec.python.startswith("/"):
            raise InvalidRequest(
                f"python must be an absolute path to the interpreter, not {spec.python!r}"
            )
        with self._write(now) as session:
            valid = validate_job_request(request, catalogue_of(session, request.username))
            project = session.scalar(select(Project).where(Project.name == valid.project))
            assert project is not None  # validation checked membership of an existing project
            priority = valid.priority_class or project.default_priority
            workload = Workload(
                kind=WorkloadKind.job,
                project=project,
                username=request.username,
                name=valid.name,
                gpu_type=valid.gpu_type,
                pods=valid.pods,
                gpus_per_pod=valid.gpus_per_pod,
                priority_class=priority,
                preemptible=_preemptible(session, priority),
                state=WorkloadState.pending,
                reason="waiting for the next admission cycle",
                created_at=now,
                # Known before any process starts: the reconciler tells the job's
                # processes by it (each pod's marker extends it, see recovery.processes).
                process_marker=uuid.uuid4().hex,
            )
            session.add(workload)
            session.flush()
            # Its ranks run as the user's account: made now, so that a job that cannot be
            # given one is refused here rather than failing on its node.
            self.accounts.ensure_account(session, now, request.username)
            environment = _session_environment(session, request.username, spec.session)
            if spec.pinned:
                environment["environment_pinned"] = spec.pinned
            if not workload.name:
                workload.name = f"job-{workload.id}"
            checkpoint = spec.checkpoint_uri or filled(
                spec.checkpoint_store, request.username, workload.name, workload.id
            )
            workload.spec = {**spec.as_json(), "checkpoint_uri": checkpoint, **environment}
            _event(
                session,
                now,
                EventKind.REQUESTED,
                f"{request.username} submitted job {workload.name}: {workload.gpus} × "
                f"{valid.gpu_type} as {valid.pods} pod(s) of {valid.gpus_per_pod} in project "
                f"{project.name} ({priority})",
                workload=workload,
            )
            return workload

    def session_environment(self, username: str, session_id: int) -> str:
        """The overlay upper directory of ``username``'s running session ``session_id``
        (its environment), "" when it has none; ``InvalidRequest`` when there is no such
        running session."""
        with self.read() as session:
            found = _session_environment(session, username, session_id)
        return str(found.get("environment_upper", ""))

    def cancel_job(self, now: datetime, workload_id: int, by: str) -> Workload:
        """Cancel: a waiting job ends at once; a placed one stops (its GPUs wait for that)."""
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.kind != WorkloadKind.job:
                raise InvalidRequest(
                    f"workload {workload_id} is a session; stop it from the hub's home page"
                )
            if workload.state == WorkloadState.pending:
                end_workload(
                    session, now, workload, "cancelled", f"cancelled by {by} while waiting"
                )
            elif workload.state in ACTIVE and workload.outcome != "cancelled":
                # A job stopping for a fault or a drain is cancelled too: it then ends
                # rather than coming back as its next attempt.
                workload.state = WorkloadState.stopping
                workload.outcome = "cancelled"
                workload.reason = f"cancelled by {by}; stopping every rank"
                workload.version += 1
                _event(session, now, EventKind.JOB_CANCELLED, workload.reason, workload=workload)
            return workload

    def agent_sync(
        self,
        now: datetime,
        node_names: Sequence[str],
        reports: Iterable[PodReport],
        chunks: Iterable[LogChunk],
        progress: Iterable[ProgressReport] = (),
        gone: Iterable[str] = (),
        kubernetes: bool = False,
        stacks: Iterable[PodStacks] = (),
    ) -> SyncResult:
        """Record an agent's pod reports, log chunks and its ranks' progress (before the
        pods' ends: the last checkpoint of an attempt that ends now counts), and the
        leftover markers it found nothing of (``gone``); answer the pods of its nodes and
        the leftovers it must end there.

        Who launches a node's pods depends on its cluster: the node agent on the local
        backend, the cluster manager on Kubernetes (``kubernetes``), which syncs here as
        the agent of its cluster's nodes. Pod reports and pods asked for concern only the
        nodes the caller launches on, so an agent running on a Kubernetes node (for its
        GPUs, snapshots and progress) never starts that node's pods as processes."""
        changed: set[int] = set()
        ended: list[str] = []
        restarted: list[str] = []
        with self._write(now) as session:
            nodes = launched_by(session, node_names, kubernetes)
            store_chunks(session, now, chunks)
            resumed: list[float] = []
            changed |= record_progress(session, now, progress, resumed)
            changed |= record_stacks(session, now, stacks, set(node_names))
            by_workload: dict[int, list[PodReport]] = defaultdict(list)
            for report in reports:
                by_workload[report.workload_id].append(report)
            for workload_id, pod_reports in sorted(by_workload.items()):
                workload = session.get(Workload, workload_id)
                if workload is None or workload.kind != WorkloadKind.job:
                    continue
                visible, fault = self._apply_reports(session, now, workload, pod_reports, nodes)
                if visible:
                    changed.add(workload.id)
                    if workload.state == WorkloadState.ended:
                        ended.append(workload.outcome or "")
                if fault is not None:
                    restarted.append(fault)
            released = release_leftovers(session, now, nodes, gone)
            desired = desired_on(session, nodes)
            leftovers = leftovers_on(session, nodes)
            watched = [] if kubernetes else watched_on(session, node_names)
        return SyncResult(
            desired, sorted(changed), ended, restarted, resumed, leftovers, released, watched
        )

    def _apply_reports(
        self,
        session: Session,
        now: datetime,
        workload: Workload,
        reports: list[PodReport],
        nodes: set[str],
    ) -> tuple[bool, str | None]:
        """Apply an agent's reports of the job's pods; whether anything visible changed,
        and the fault class when the job went back to the queue as its next attempt."""
        if workload.state not in ACTIVE:
            return False, None
        placed = {a.pod_index: a.node.name for a in workload.allocations if a.closed_at is None}
        rows = {p.pod_index: p for p in _pods(session, workload.id)}
        attempt = workload.attempt
        # Pods this batch reports ended: a gang whose other pods end too keeps none.
        ending = {r.pod_index for r in reports if r.attempt == attempt and r.state != "running"}
        visible = False
        for report in reports:
            node = placed.get(report.pod_index)
            if node is None or node not in nodes or report.state not in POD_STATES:
                continue  # not a pod of this agent's nodes: not its to report
            if report.attempt != workload.attempt:
                continue  # of an attempt that has ended
            visible |= self._apply_report(session, now, workload, report, node, rows, ending)
        if workload.attempt != attempt:  # begun at once, keeping pods: nothing more ends
            return True, str((workload.recovery or {}).get("restarted_for") or "")
        fault, ended = self._end_attempt_if_done(session, now, workload, rows)
        if visible and not ended:
            workload.version += 1
        return visible or ended, fault

    def _apply_report(
        self,
        session: Session,
        now: datetime,
        workload: Workload,
        report: PodReport,
        node: str,
        rows: dict[int, JobPod],
        ending: Collection[int] = (),
    ) -> bool:
        """Apply the report of one pod of the job's current attempt on ``node`` (its row
        made if it has none yet in ``rows``); whether the job changed visibly. ``ending``:
        the pods the same batch reports ended."""
        row = rows.get(report.pod_index)
        if row is None:
            row = JobPod(workload_id=workload.id, pod_index=report.pod_index, node=node, state="")
            session.add(row)
            rows[report.pod_index] = row
        if report.adopted and row.state == "running" and report.state == "running":
            _event(
                session,
                now,
                EventKind.JOB_POD_ADOPTED,
                f"pod {report.pod_index} on {node} kept running through a restart of its "
                f"node agent, which took it over (attempt {workload.attempt}; nothing "
                "was charged)",
                workload=workload,
                node=node,
                data={"pod": report.pod_index, "attempt": workload.attempt},
            )
        if row.state in ENDED_POD_STATES or row.state == report.state:
            return False
        row.state = report.state
        row.exit_code, row.signal, row.reason = report.exit_code, report.signal, report.reason
        row.cause = report.cause[:32]
        if report.state == "running":
            row.started_at = now
            return _job_running(session, now, workload)
        row.ended_at = now
        _event(
            session,
            now,
            EventKind.JOB_POD_ENDED,
            f"pod {report.pod_index} on {node}: {_pod_ending(row)}",
            reason=report.state,
            workload=workload,
            node=node,
            data={"pod": report.pod_index, "exit_code": row.exit_code, "signal": row.signal},
        )
        failed = report.state == "failed" or (report.state == "exited" and report.exit_code != 0)
        if not failed or workload.state == WorkloadState.stopping:
            return False
        self._pod_failed(session, now, workload, row, node, keep=not set(ending) - {row.pod_index})
        return True

    def _pod_failed(
        self,
        session: Session,
        now: datetime,
        workload: Workload,
        row: JobPod,
        node: str,
        keep: bool = True,
    ) -> None:
        """A pod of the running attempt failed: the job stops its other pods, for the
        fault class of what ended this one; or, for a pod merely gone, begins its next
        attempt keeping them (unless not ``keep``: others end too)."""
        # Classified now, while the evidence is fresh and before the other pods' stop adds
        # endings of its own (``state/attempts.py``).
        verdict = self._classify_pod(session, now, workload, row)
        said = f"pod {row.pod_index} on {node} {_pod_ending(row)}"
        if keep and row.cause in GONE_CAUSES:
            where = session.scalars(select(Node).where(Node.name == node)).one()
            # Its node stays in doubt after a node loss: what may run there keeps its GPUs.
            if restart_keeping(
                session,
                now,
                workload,
                verdict,
                {row.pod_index: (where, row.cause == "NodeLost")},
                (EventKind.JOB_FAILED, said),
                self.retry_policy,
            ):
                return
        stopping_for(workload, verdict, now, said)
        _event(
            session,
            now,
            EventKind.JOB_FAILED,
            f"{workload.reason}; stopping the other pods",
            reason=verdict.fault.value,
            workload=workload,
            data={"attempt": workload.attempt, "verdict": verdict.reason},
        )

    def _end_attempt_if_done(
        self, session: Session, now: datetime, workload: Workload, rows: Mapping[int, JobPod]
    ) -> tuple[str | None, bool]:
        """Once every pod of the attempt is reported ended: end the job or queue its next
        attempt. Returns the fault class of a restart, and whether the attempt ended."""
        ended = [rows.get(i) for i in range(workload.pods)]
        if not all(row is not None and row.state in ENDED_POD_STATES for row in ended):
            return None, False
        fault = self.attempt_ended(session, now, workload, *_job_ending(workload, ended))
        workload.version += 1
        return fault, True

    def lose_silent_nodes(
        self,
        now: datetime,
        timeout: timedelta,
        jobs_after: timedelta | None = None,
        since: datetime | None = None,
    ) -> NodesLost:
        """Nodes whose agent has not reported for ``timeout`` take no new work. Once a
        node's agent has been silent for ``jobs_after`` (``timeout`` when None) each job
        with a pod there stops as ``agent-lost`` and resumes elsewhere, its pods on the
        silent node counted as ended (``lost``) while their GPUs stay held for whatever
        of them may still run (``state/leftovers.py``). The longer wait lets an agent that
        restarts (a crash, an upgrade) take its pods over, which costs them nothing.

        A node is acted on once per silence: when its silence passes ``jobs_after``
        after ``since`` (the caller's previous pass; None: whenever it did). It is
        cordoned, within the recovery breaker: while the breaker holds, its jobs are left
        running (a share of silent nodes that large is more likely the network's or the
        controller's fault, and the hang check still catches a job that stopped)."""
        lost = NodesLost()
        jobs_after = timeout if jobs_after is None else max(jobs_after, timeout)
        with self._write(now) as session:
            lost.nodes = [node.name for node in mark_silent(session, now, timeout)]
            for node in _silent_since(session, now, jobs_after, since):
                held = open_allocations_on(session, node)
                if not any(
                    a.workload.kind == WorkloadKind.job and a.workload.state in ACTIVE for a in held
                ):
                    continue
                silent_s = (now - (node.last_heartbeat_at or now)).total_seconds()
                verdict = classify(
                    AgentSilent(node.name, silent_s, now.timestamp()), (), self.recovery_policy
                )
                if not self._cordon_node(session, now, node, verdict):
                    continue
                why = "its node agent went silent"
                for workload in sorted({a.workload for a in held}, key=lambda w: w.id):
                    if workload.kind == WorkloadKind.job and workload.state in ACTIVE:
                        self._pods_lost(session, now, workload, node, verdict, why, lost)
        return lost

    def lose_cluster_node(self, now: datetime, node_name: str, why: str) -> NodesLost:
        """A Kubernetes node lost to its cluster (not Ready, or deleted, past the
        inventory's grace) under running jobs: each such job stops as a node fault and
        resumes elsewhere, its pods there counted as ended (``lost``) while their GPUs stay
        held until the cluster no longer has them (``state/leftovers.py``): a pod on a node
        whose kubelet does not answer may still run."""
        lost = NodesLost()
        with self._write(now) as session:
            node = session.scalar(select(Node).where(Node.name == node_name))
            if node is None:
                return lost
            verdict = classify(NodeLost(node.name, why, now.timestamp()), (), self.recovery_policy)
            held = open_allocations_on(session, node)
            for workload in sorted({a.workload for a in held}, key=lambda w: w.id):
                if workload.kind == WorkloadKind.job and workload.state in ACTIVE:
                    said = f"its node {node.name} {why}"
                    self._pods_lost(session, now, workload, node, verdict, said, lost)
            if lost.changed:
                lost.nodes.append(node.name)
        return lost

    def _pods_lost(
        self,
        session: Session,
        now: datetime,
        workload: Workload,
        node: Node,
        verdict: Verdict,
        why: str,
        lost: NodesLost,
    ) -> None:
        rows = {p.pod_index: p for p in _pods(session, workload.id)}
        indexes = sorted(
            {
                a.pod_index
                for a in workload.allocations
                if a.closed_at is None and a.node_id == node.id
            }
        )
        for index in indexes:
            row = rows.get(index)
            if row is None:
                row = rows[index] = JobPod(
                    workload_id=workload.id, pod_index=index, node=node.name, state=""
                )
                session.add(row)
            if row.state in ENDED_POD_STATES:
                continue
            uuids = hold_for_leftovers(session, now, workload, index, node)
            row.state, row.ended_at = "lost", now
            row.reason = f"{why}; its GPUs stay held until what is left of it is gone"
            _event(
                session,
                now,
                EventKind.JOB_POD_ENDED,
                f"pod {index} on {node.name}: {row.reason}",
                reason="lost",
                workload=workload,
                node=node.name,
                data={"pod": index, "held": uuids},
            )
        lost.changed.append(workload.id)
        if workload.state != WorkloadState.stopping:
            if restart_keeping(
                session,
                now,
                workload,
                verdict,
                {i: (node, True) for i in indexes},
                (EventKind.JOB_FAULT, verdict.reason),
                self.retry_policy,
            ):
                lost.restarted.append(verdict.fault.value)
                return
            self._fault_stops(session, now, workload, verdict, node.name, lost=node.name)
        fault, _ = self._end_attempt_if_done(session, now, workload, rows)
        if fault is not None:
            lost.restarted.append(fault)

    def desired_pods(self, node_names: Sequence[str], kubernetes: bool = False) -> list[DesiredPod]:
        with self.read() as session:
            return desired_on(session, launched_by(session, node_names, kubernetes))

    def watched_pods(self, node_names: Sequence[str]) -> list[DesiredPod]:
        """The pods a node agent of ``node_names`` watches (``SyncResult.watched``)."""
        with self.read() as session:
            return watched_on(session, node_names)

    def job_pods(self, workload_id: int) -> list[JobPod]:
        with self.read() as session:
            return list(_pods(session, workload_id))

    def log_size(self, workload_id: int, rank: int, stream: str) -> int:
        """Bytes of the stream stored so far (where its last chunk ends)."""
        with self.read() as session:
            last = session.execute(
                select(JobLog.offset, JobLog.data)
                .where(
                    JobLog.workload_id == workload_id,
                    JobLog.rank == rank,
                    JobLog.stream == stream,
                )
                .order_by(JobLog.offset.desc())
                .limit(1)
            ).first()
        return 0 if last is None else last.offset + len(last.data.encode())

    def read_log(
        self, workload_id: int, rank: int, stream: str, offset: int, max_bytes: int
    ) -> LogSlice:
        """From ``offset`` (bytes into the stream) on, at most about ``max_bytes``."""
        with self.read() as session:
            start = session.scalar(
                select(func.max(JobLog.offset)).where(
                    JobLog.workload_id == workload_id,
                    JobLog.rank == rank,
                    JobLog.stream == stream,
                    JobLog.offset <= offset,
                )
            )
            rows = session.execute(
                select(JobLog.offset, JobLog.data)
                .where(
                    JobLog.workload_id == workload_id,
                    JobLog.rank == rank,
                    JobLog.stream == stream,
                    JobLog.offset >= (start if start is not None else offset),
                )
                .order_by(JobLog.offset)
            )
            pieces: list[bytes] = []
            size = 0
            next_offset = offset
            for chunk_offset, data in rows:
                raw = data.encode()
                if chunk_offset + len(raw) <= offset:
                    continue
                if chunk_offset > next_offset:
                    break  # a gap: the rest has not arrived yet
                piece = raw[next_offset - chunk_offset :]
                pieces.append(piece)
                size += len(piece)
                next_offset = chunk_offset + len(raw)
                if size >= max_bytes:
                    break
        return LogSlice(b"".join(pieces).decode(errors="replace"), next_offset)


def _job_running(session: Session, now: datetime, workload: Workload) -> bool:
    """A pod of the job runs: an admitted job is running from now on. Whether it was."""
    if workload.state != WorkloadState.admitted:
        return False
    workload.state = WorkloadState.running
    workload.started_at = now
    workload.reason = f"running: {workload.pods * workload.gpus_per_pod} rank(s)"
    _event(session, now, EventKind.STARTED, workload.reason, workload=workload)
    return True


def _pods(session: Session, workload_id: int) -> Sequence[JobPod]:
    return session.scalars(
        select(JobPod).where(JobPod.workload_id == workload_id).order_by(JobPod.pod_index)
    ).all()


def _session_environment(session: Session, username: str, session_id: int | None) -> dict[str, Any]:
    """Where the submitting session's environment is (its overlay upper directory), which
    its job's ranks get as a read-only layer; {} for a job from outside a session or a
    session without one (docs/containment.md)."""
    if session_id is None:
        return {}
    workload = session.get(Workload, session_id)
    if workload is None or workload.kind != WorkloadKind.session or workload.username != username:
        raise InvalidRequest(f"there is no session {session_id} of {username} to run the job in")
    if workload.state not in (WorkloadState.running, WorkloadState.admitted):
        raise InvalidRequest(
            f"session {session_id} has ended; submit from a running session, or without "
            "one to use your default environment"
        )
    overlays = list((workload.snapshot_sources or {}).get("overlays", []))
    if not overlays:
        return {"session": session_id}
    return {"session": session_id, "environment_upper": str(overlays[0]).partition(":")[0]}


def _pod_ending(row: JobPod) -> str:
    if row.state == "exited":
        how = f"exited with code {row.exit_code}"
    elif row.state == "failed":
        # The agent's reason says it all: "could not start: ..." or how a pod it ran ended.
        return row.reason or "failed"
    elif row.state == "lost":
        how = "was lost"
    elif row.signal is not None:
        how = f"was stopped (signal {row.signal})"
    else:
        how = "was stopped"
    return f"{how}: {row.reason}" if row.reason else how


def _job_ending(workload: Workload, pods: list[JobPod | None]) -> tuple[str, str]:
    """The outcome and message of a job all of whose pods ended."""
    cancelled = cancelled_ending(workload)
    if cancelled is not None:
        return cancelled
    if workload.outcome == "failed":
        return "failed", workload.reason
    if workload.state == WorkloadState.stopping:
        return "stopped", "every rank stopped"  # _end says "preempted" for a preemption
    unclean = [p for p in pods if p is not None and (p.state != "exited" or p.exit_code != 0)]
    if unclean:
        return "failed", f"pod {unclean[0].pod_index} {_pod_ending(unclean[0])}"
    ranks = workload.pods * workload.gpus_per_pod
    return "succeeded", f"all {ranks} rank(s) exited with code 0"


def _silent_since(
    session: Session, now: datetime, silent_for: timedelta, since: datetime | None
) -> Sequence[Node]:
    """The nodes of gpufleet's agents whose silence passed ``silent_for`` after ``since``
    (ever, when None), by name."""
    query = select(Node).where(
        Node.health == NodeHealth.unknown,
        Node.agent.is_(None) | Node.agent.not_like(f"{AGENT_PREFIX}%"),
        Node.last_heartbeat_at < now - silent_for,
    )
    if since is not None:
        query = query.where(Node.last_heartbeat_at >= since - silent_for)
    return session.scalars(query.order_by(Node.name)).all()
