"""Training jobs in the REST API: submit, list, one job, its logs, cancel; and the node
agent's pod sync (report what runs, learn what should)."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ...api import jobs as js
from ...recovery.checkpoints import filled
from ...recovery.job_spec import launch_problems
from ...scheduler.validation import JobRequest
from ...snapshotter.sandbox import remove_tree
from ...state.jobs import DesiredPod, JobSpec, LogChunk, PodReport
from ...state.models import JobPod, JobProgress, Workload, WorkloadKind, WorkloadState
from ...state.progress import ProgressReport, Saved, progress_json, training_ratio
from ...state.traces import PodStacks
from .. import scopes
from ..errors import BadRequest, Forbidden, NotFoundError
from .base import APIHandler, Identity, store_errors_as_http
from .job_checks import interpreter_problem
from .views import MAX_WAIT_SECONDS, WORKLOAD_DETAILS, listing, page, workload_out

if TYPE_CHECKING:
    from ..context import ControllerContext

MAX_LOG_READ = 1 << 20


def job_out(
    workload: Workload, pods: list[JobPod], progress: JobProgress | None = None
) -> js.JobOut:
    base = workload_out(workload).model_dump()
    spec = workload.spec or {}
    reported = {p.pod_index: p for p in pods}
    placed = {a.pod_index: a.node.name for a in workload.allocations if a.closed_at is None}
    cluster_of = {a.node.name: a.node.zone.cluster.name for a in workload.allocations}
    per_pod = workload.gpus_per_pod
    pod_states = []
    for index in range(workload.pods):
        row = reported.get(index)
        ranks = list(range(index * per_pod, (index + 1) * per_pod))
        if row is None:
            pod_states.append(
                js.JobPodOut(
                    pod=index,
                    node=placed.get(index, ""),
                    cluster=cluster_of.get(placed.get(index, ""), ""),
                    state="waiting",
                    ranks=ranks,
                    exit_code=None,
                    signal=None,
                    reason="",
                    started_at=None,
                    ended_at=None,
                )
            )
            continue
        pod_states.append(
            js.JobPodOut(
                pod=index,
                node=row.node,
                cluster=cluster_of.get(row.node, ""),
                state=row.state,
                ranks=ranks,
                exit_code=row.exit_code,
                signal=row.signal,
                reason=row.reason,
                started_at=row.started_at,
                ended_at=row.ended_at,
            )
        )
    return js.JobOut(
        **base,
        name=workload.name,
        script_name=str(spec.get("script_name", "")),
        args=[str(a) for a in spec.get("args", [])],
        checkpoint_uri=str(spec.get("checkpoint_uri", "")),
        ranks=workload.pods * per_pod,
        pod_states=pod_states,
        progress=None if progress is None else js.JobProgressOut(**progress_json(progress)),
        attempt=workload.attempt,
        faults=workload.faults,
        restarts_at=workload.not_before if workload.state == WorkloadState.pending else None,
        avoids=[
            *(workload.recovery or {}).get("avoid_nodes", ()),
            *(workload.recovery or {}).get("avoid_gpus", ()),
        ],
        effective_training_ratio=training_ratio(
            workload.recovery, workload.ended_at or datetime.now(UTC)
        ),
    )


def load_job(session: Session, identity: Identity, workload_id: int) -> Workload:
    """The job, if the caller may see it (a researcher's own; anyone's for admins)."""
    workload = session.scalar(
        select(Workload).where(Workload.id == workload_id).options(*WORKLOAD_DETAILS)
    )
    if (
        workload is None
        or workload.kind != WorkloadKind.job
        or not (identity.is_admin or identity.may_act_for(workload.username))
    ):
        raise NotFoundError(f"there is no job {workload_id}")
    return workload


def _progress_of(session: Session, workload_ids: list[int]) -> dict[int, JobProgress]:
    rows = session.scalars(select(JobProgress).where(JobProgress.workload_id.in_(workload_ids)))
    return {row.workload_id: row for row in rows}


def _pods_of(session: Session, workload_ids: list[int]) -> dict[int, list[JobPod]]:
    found: dict[int, list[JobPod]] = {i: [] for i in workload_ids}
    for row in session.scalars(
        select(JobPod).where(JobPod.workload_id.in_(workload_ids)).order_by(JobPod.pod_index)
    ):
        found[row.workload_id].append(row)
    return found


class JobsHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE)
        offset = self.int_argument("offset", 0, 0, 10**9)
        limit = self.int_argument("limit", 100, 1, 1000)
        username = self.get_query_argument("username", None)
        states = self.get_query_arguments("state")
        if not identity.is_admin:
            if username not in (None, identity.name):
                raise Forbidden("you may list only your own jobs")
            username = identity.name
        query = listing(states, username, WorkloadKind.job)
        with self.controller.store.read() as session:
            rows, total = page(session, query, offset, limit)
            pods = _pods_of(session, [w.id for w in rows])
            progress = _progress_of(session, [w.id for w in rows])
            items = [job_out(w, pods[w.id], progress.get(w.id)) for w in rows]
        self.send(js.JobList(items=items, total=total, offset=offset, limit=limit))

    async def post(self) -> None:
        identity = self.require(scopes.USE)
        if identity.kind != "user":
            raise Forbidden("jobs are submitted by users, with their own token")
        body = self.body(js.JobSubmitIn)
        controller = self.controller
        problems = launch_problems(
            script_name=body.script_name,
            env=body.env,
            args=body.args,
            python=body.python,
            cwd=body.cwd,
            # The submission's own location, or where the controller's store puts it (the
            # job's id is not known yet: what it fills in is a number, which moves nothing).
            checkpoint_uri=body.checkpoint_uri
            or filled(controller.job_checkpoint_store, identity.name, body.name or "job-1", 1),
            checkpoint_places=controller.checkpoint_places(identity.name),
        )
        interpreter = await asyncio.to_thread(interpreter_problem, body.python)
        if interpreter:
            problems.append(interpreter)
        if problems:
            raise BadRequest(f"the job cannot run as submitted: {'; '.join(problems)}")
        request = JobRequest(
            username=identity.name,
            project=body.project,
            gpu_type=body.gpu_type,
            gpus=body.gpus,
            gpus_per_pod=body.gpus_per_pod,
            priority_class=body.priority,
            name=body.name,
        )
        spec = JobSpec(
            script=body.script,
            python=body.python,
            script_name=body.script_name,
            args=tuple(body.args),
            cwd=body.cwd,
            env=body.env,
            checkpoint_uri=body.checkpoint_uri,
            checkpoint_store=controller.job_checkpoint_store,
            grace_s=controller.job_stop_grace_seconds,
            session=body.session,
        )
        await controller.refresh_memberships(max_age=5.0)
        pinned = ""
        if body.session is not None:
            with store_errors_as_http():
                upper = controller.store.jobs.session_environment(identity.name, body.session)
            if upper:
                pinned = await pin_environment(controller.data_dir, upper)
                spec = replace(spec, pinned=pinned)
        try:
            with store_errors_as_http():
                workload = controller.store.jobs.open_job(controller.now(), request, spec)
        except BaseException:
            if pinned:
                await asyncio.to_thread(remove_tree, Path(pinned))
            raise
        controller.kick()
        with controller.store.read() as session:
            self.send(job_out(load_job(session, identity, workload.id), []), status=201)


class JobHandler(APIHandler):
    """One job; ``?wait=S&version=N`` long-polls until its version differs from N."""

    async def get(self, workload_id: str) -> None:
        identity = self.require(scopes.USE)
        wait = self.int_argument("wait", 0, 0, MAX_WAIT_SECONDS)
        known_version = self.int_argument("version", 0, 0, 2**62)
        wid = self.path_id(workload_id)
        with self.controller.store.read() as session:
            version = load_job(session, identity, wid).version
        if wait and version == known_version:
            await self.controller.notifier.wait_for_change(wid, wait)
        with self.controller.store.read() as session:
            workload = load_job(session, identity, wid)
            self.send(
                job_out(workload, _pods_of(session, [wid])[wid], session.get(JobProgress, wid))
            )


class JobCancelHandler(APIHandler):
    async def post(self, workload_id: str) -> None:
        identity = self.require(scopes.USE)
        wid = self.path_id(workload_id)
        with self.controller.store.read() as session:
            load_job(session, identity, wid)
        with store_errors_as_http():
            cancel_job(self.controller, wid, identity.name)
        with self.controller.store.read() as session:
            workload = load_job(session, identity, wid)
            self.send(
                job_out(workload, _pods_of(session, [wid])[wid], session.get(JobProgress, wid))
            )


async def pin_environment(data_dir: str, upper: str) -> str:
    """A copy of a session's environment (its overlay upper directory) for a job submitted
    from it, made now, in a thread: the job's ranks get it as it is at submit, whatever the
    session does afterwards (a cull empties its upper directory). ``cp -a`` keeps owners,
    modes, links and the overlay's whiteouts. The copy's path."""
    return await asyncio.to_thread(_copy_environment, data_dir, upper)


def _copy_environment(data_dir: str, upper: str) -> str:
    target = Path(data_dir).absolute() / "pinned-environments" / uuid.uuid4().hex
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = subprocess.run(
        ["cp", "-a", "--reflink=auto", f"{upper}/.", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        remove_tree(target)
        raise BadRequest(
            f"the session's environment could not be copied for the job: "
            f"{done.stderr.strip()[-300:]}"
        )
    return str(target)


def cancel_job(controller: ControllerContext, workload_id: int, by: str) -> None:
    """Cancel (the API's and the jobs page's): the store decides, the loops are told."""
    cancelled = controller.store.jobs.cancel_job(controller.now(), workload_id, by)
    if cancelled.state == WorkloadState.ended:
        controller.metrics.ended.labels("job", "cancelled").inc()
    controller.notifier.changed([workload_id])
    controller.kick()  # a waiting job's place, or (once its ranks are gone) its GPUs


class JobLogsHandler(APIHandler):
    """One rank's stdout or stderr from ``offset`` on; ``wait`` long-polls for more while
    the job runs."""

    async def get(self, workload_id: str) -> None:
        identity = self.require(scopes.USE)
        wid = self.path_id(workload_id)
        rank = self.int_argument("rank", 0, -(10**6), 10**6)
        offset = self.int_argument("offset", 0, 0, 2**62)
        wait = self.int_argument("wait", 0, 0, MAX_WAIT_SECONDS)
        stream = self.get_query_argument("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise BadRequest(f"stream must be stdout or stderr, not {stream!r}")
        with self.controller.store.read() as session:
            workload = load_job(session, identity, wid)
            ranks = workload.pods * workload.gpus_per_pod
            if not -workload.pods <= rank < ranks:
                raise BadRequest(
                    f"job {wid} has ranks 0-{ranks - 1} (and -1 to -{workload.pods} for its "
                    f"pods' launchers); there is no rank {rank}"
                )
        store = self.controller.store
        piece = store.jobs.read_log(wid, rank, stream, offset, MAX_LOG_READ)
        ended = self._ended(identity, wid)
        if wait and not piece.data and not ended:
            await self.controller.notifier.wait_for_change(wid, wait)
            piece = store.jobs.read_log(wid, rank, stream, offset, MAX_LOG_READ)
            ended = self._ended(identity, wid)
        if ended:  # everything the agent sent arrived before the job ended
            ended = store.jobs.read_log(wid, rank, stream, piece.next_offset, 1).data == ""
        self.send(
            js.LogOut(
                rank=rank,
                stream=stream,
                offset=offset,
                next_offset=piece.next_offset,
                data=piece.data,
                complete=ended,
            )
        )

    def _ended(self, identity: Identity, wid: int) -> bool:
        with self.controller.store.read() as session:
            return load_job(session, identity, wid).state == WorkloadState.ended


class AgentPodsHandler(APIHandler):
    """The node agent's sync: its reports and log chunks in, the pods of its nodes out.

    With ``wait``, an agent that knows exactly the pods listed for its nodes is answered
    when a workload changes (an admission, a cancel, a preemption) or after ``wait``
    seconds.
    """

    async def post(self) -> None:
        self.require(scopes.AGENT)
        body = self.body(js.AgentSyncIn)
        controller = self.controller
        reports = [
            PodReport(
                p.workload_id,
                p.pod_index,
                p.state,
                p.exit_code,
                p.signal,
                p.reason,
                p.attempt,
                p.adopted,
            )
            for p in body.pods
        ]
        chunks = [
            LogChunk(c.workload_id, c.rank, c.stream, c.offset, c.data, c.attempt)
            for c in body.logs
        ]
        progress = [
            ProgressReport(
                p.workload_id,
                p.pod_index,
                p.step,
                p.step_at,
                p.step_times_s,
                p.metrics,
                None
                if p.checkpoint_started is None
                else (
                    p.checkpoint_started.step,
                    p.checkpoint_started.at,
                ),
                [Saved(c.uri, c.step, c.at, c.epoch) for c in p.checkpoints_saved],
                epoch=p.epoch,
            )
            for p in body.progress
        ]
        stacks = [
            PodStacks(s.trace_id, s.workload_id, s.pod_index, [r.model_dump() for r in s.ranks])
            for s in body.stacks
        ]
        with store_errors_as_http():
            result = controller.store.jobs.agent_sync(
                controller.now(), body.nodes, reports, chunks, progress, body.gone, stacks=stacks
            )
        for outcome in result.ended:
            controller.metrics.ended.labels("job", outcome).inc()
        for fault in result.restarted:
            controller.metrics.job_restarts.labels(fault).inc()
        for seconds in result.resumed_after_s:
            controller.metrics.job_resume.observe(seconds)
        if result.changed or result.released:
            controller.notifier.changed(result.changed)
            controller.kick()  # GPUs may have been released
        elif chunks:
            controller.notifier.changed({c.workload_id for c in chunks})
        desired, leftovers, watched = result.desired, result.leftovers, result.watched
        if (
            body.wait
            and not leftovers
            and not any(p.trace for p in [*desired, *watched])  # stacks to take: at once
            and {(p.workload_id, p.pod_index) for p in [*desired, *watched]} == set(body.known)
        ):
            await controller.notifier.wait_for_any_change(body.wait)
            desired = controller.store.jobs.desired_pods(body.nodes)
            watched = controller.store.jobs.watched_pods(body.nodes)
        self.send(
            js.AgentSyncOut(
                pods=[_desired_out(p) for p in desired],
                watch=[_desired_out(p) for p in watched],
                leftovers=[
                    js.LeftoverOut(node=x.node, marker=x.marker, workload_id=x.workload_id)
                    for x in leftovers
                ],
            )
        )


def _desired_out(pod: DesiredPod) -> js.DesiredPodOut:
    return js.DesiredPodOut(
        workload_id=pod.workload_id,
        pod_index=pod.pod_index,
        pods=pod.pods,
        gpus_per_pod=pod.gpus_per_pod,
        node=pod.node,
        gpu_uuids=list(pod.gpu_uuids),
        marker=pod.marker,
        run=pod.run,
        started=pod.started,
        username=pod.username,
        name=pod.name,
        spec=pod.spec,
        account=pod.account,
        attempt=pod.attempt,
        created_attempt=pod.created_attempt,
        resume_from=pod.resume_from,
        trace=pod.trace,
    )


def job_routes(api: str) -> list[tuple[str, Any]]:
    return [
        (rf"{api}/jobs", JobsHandler),
        (rf"{api}/jobs/(\d+)", JobHandler),
        (rf"{api}/jobs/(\d+)/cancel", JobCancelHandler),
        (rf"{api}/jobs/(\d+)/logs", JobLogsHandler),
        (rf"{api}/agent/pods", AgentPodsHandler),
    ]
