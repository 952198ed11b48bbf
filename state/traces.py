"""Traces: every rank's Python stacks of a running attempt, taken by the node agents.

A trace is asked for by the job's owner or an admin (``POST /jobs/{id}/traces``,
``gpufleet trace``), or by the recovery loop when it finds a hang, in the same
transaction that stops the gang. While it is open, each pod of the attempt carries its id
to the agent of its node (``DesiredPod.trace``), which takes the stacks of the pod's ranks
with py-spy and sends them with its next sync; a pod being stopped keeps running until
then, so a hang's stacks are those of the hang (the local agent takes them before it
signals the ranks; the Kubernetes cluster manager does not delete a pod whose stacks are
awaited). A trace closes when every pod answered (in the sync that brings the last answer)
or ``stacks_wait_s`` passed (the recovery loop's pass, ``TraceStore.close_expired``), with a
``job-traced`` event that says where each rank was.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from ..api.events import EventKind
from ..recovery.classify import RecoveryPolicy
from ..recovery.stacks import RankWhere, summary
from ..scheduler.errors import InvalidRequest
from .base import Repository, _event, _get_workload
from .database import Database
from .models import JobPod, JobTrace, JobTraceDump, Workload, WorkloadKind, WorkloadState

HANG = "hang"
ASKED = "asked"
MAX_RANKS_PER_POD = 1024  # an answer naming more ranks than a pod may have is cut here
MAX_TEXT = 64 * 1024  # one rank's dump, as stored


@dataclass(frozen=True)
class PodStacks:
    """One pod's answer from its node agent (``AgentSyncIn.stacks``)."""

    trace_id: int
    workload_id: int
    pod_index: int
    ranks: Sequence[dict[str, Any]]  # {rank, pid, where, text, error}
    error: str = ""


def open_trace(
    session: Session,
    now: datetime,
    workload: Workload,
    why: str,
    by: str,
    wait: timedelta,
) -> JobTrace:
    trace = JobTrace(
        workload_id=workload.id,
        attempt=workload.attempt,
        why=why,
        asked_by=by,
        asked_at=now,
        expires_at=now + wait,
    )
    session.add(trace)
    session.flush()
    workload.version += 1
    return trace


def pending_traces(
    session: Session, workload_ids: Iterable[int]
) -> dict[tuple[int, int], tuple[int, set[int]]]:
    """The open trace of each (workload, attempt) that has one: its id and the pods that
    answered it. The newest wins where two are open."""
    rows = session.scalars(
        select(JobTrace)
        .where(JobTrace.workload_id.in_(list(workload_ids)), JobTrace.closed_at.is_(None))
        .options(selectinload(JobTrace.dumps))
        .order_by(JobTrace.id)
    ).all()
    return {(t.workload_id, t.attempt): (t.id, {d.pod_index for d in t.dumps}) for t in rows}


def record_stacks(
    session: Session, now: datetime, answers: Iterable[PodStacks], nodes: Collection[str]
) -> set[int]:
    """Store each answer to an open trace from the agent of the pod's node (``nodes``: the
    answering agent's); any other is dropped (a late answer, a second one, one for a pod
    elsewhere), and close the traces every pod answered. Returns the workloads changed."""
    changed: set[int] = set()
    for answer in answers:
        trace = session.get(JobTrace, answer.trace_id)
        pod = session.get(JobPod, (answer.workload_id, answer.pod_index))
        if (
            trace is None
            or trace.closed_at is not None
            or trace.workload_id != answer.workload_id
            or pod is None
            or pod.node not in nodes
            or session.get(JobTraceDump, (trace.id, answer.pod_index)) is not None
        ):
            continue
        workload = session.get(Workload, trace.workload_id)
        if workload is None:
            continue
        session.add(
            JobTraceDump(
                trace_id=trace.id,
                pod_index=answer.pod_index,
                node=pod.node,
                taken_at=now,
                ranks=[_rank_record(r) for r in answer.ranks[:MAX_RANKS_PER_POD]],
                error=answer.error[:2000],
            )
        )
        session.flush()
        session.refresh(trace)
        if len(trace.dumps) >= workload.pods:
            _close(session, now, trace, workload)
        changed.add(workload.id)
    return changed


def close_expired(session: Session, now: datetime) -> list[int]:
    """Close the open traces whose wait is over, saying which pods never answered."""
    expired = session.scalars(
        select(JobTrace).where(JobTrace.closed_at.is_(None), JobTrace.expires_at <= now)
    ).all()
    closed = []
    for trace in expired:
        workload = session.get(Workload, trace.workload_id)
        if workload is not None:
            _close(session, now, trace, workload)
            closed.append(workload.id)
    return closed


def _rank_record(rank: dict[str, Any]) -> dict[str, Any]:
    pid = rank.get("pid")
    return {
        "rank": int(rank.get("rank", -1)),
        "pid": int(pid) if isinstance(pid, int) else None,
        "where": str(rank.get("where") or "")[:500],
        "text": str(rank.get("text") or "")[:MAX_TEXT],
        "error": str(rank.get("error") or "")[:2000],
    }


def _close(session: Session, now: datetime, trace: JobTrace, workload: Workload) -> None:
    trace.closed_at = now
    workload.version += 1
    ranks = [
        RankWhere(int(r["rank"]), str(r["where"]), str(r["error"] or dump.error))
        for dump in trace.dumps
        for r in dump.ranks
    ]
    answered = {d.pod_index for d in trace.dumps}
    silent = [str(i) for i in range(workload.pods) if i not in answered]
    said = summary(ranks) or "no rank's stacks were taken"
    if silent:
        said += f"; pod(s) {', '.join(silent)} did not answer within the wait"
    what = "the hang" if trace.why == HANG else f"asked by {trace.asked_by}"
    _event(
        session,
        now,
        EventKind.JOB_TRACED,
        f"attempt {trace.attempt}: stacks of every rank ({what}): {said}",
        reason=trace.why,
        cause=trace.asked_by,
        workload=workload,
        data={
            "trace": trace.id,
            "attempt": trace.attempt,
            "where": {str(r.rank): r.where for r in ranks if not r.error},
            "missing_pods": [int(i) for i in silent],
        },
    )


class TraceStore(Repository):
    """Traces asked for through the API, and their answers as the pages read them."""

    def __init__(self, database: Database, policy: Callable[[], RecoveryPolicy]):
        super().__init__(database)
        self.policy = policy  # the jobs' recovery policy, whose stacks_wait_s applies

    def ask(self, now: datetime, workload_id: int, by: str) -> int:
        """Open a trace of a running job's current attempt; its id. InvalidRequest for a
        job whose ranks do not run (nothing to take stacks of)."""
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.kind != WorkloadKind.job:
                raise InvalidRequest(f"workload {workload_id} is a session, not a training job")
            running = session.scalars(
                select(JobPod.pod_index).where(
                    JobPod.workload_id == workload.id, JobPod.state == "running"
                )
            ).all()
            if workload.state != WorkloadState.running or not running:
                raise InvalidRequest(
                    f"job {workload_id} has no running ranks (it is {workload.state.value}): "
                    "stacks are taken only while they run; the traces taken before are "
                    f"listed by GET /jobs/{workload_id}/traces"
                )
            wait = timedelta(seconds=self.policy().stacks_wait_s)
            return open_trace(session, now, workload, ASKED, by, wait).id

    def traces(self, workload_id: int, trace_id: int | None = None) -> list[JobTrace]:
        """The job's traces, newest first (with their dumps), or the one asked for."""
        with self.read() as session:
            query = (
                select(JobTrace)
                .where(JobTrace.workload_id == workload_id)
                .options(selectinload(JobTrace.dumps))
                .order_by(JobTrace.id.desc())
            )
            if trace_id is not None:
                query = query.where(JobTrace.id == trace_id)
            found = list(session.scalars(query).all())
            session.expunge_all()
            return found

    def close_expired(self, now: datetime) -> list[int]:
        """Close the traces whose wait is over (``close_expired``): the workloads changed."""
        with self.read() as session:
            due = session.scalar(
                select(JobTrace.id).where(JobTrace.closed_at.is_(None), JobTrace.expires_at <= now)
            )
        if due is None:
            return []  # nearly every pass: nothing is written
        with self._write(now) as session:
            return close_expired(session, now)
