"""The researcher's job pages: ``jobs`` (their jobs; everyone's for admins) and
``jobs/<id>`` (its pods, its progress — step, epoch, loss, checkpoints — and what happened
to it, its steps and loss beside its GPUs' utilisation and memory over time, one rank's
output, a cancel button). Server-drawn HTML and SVG: the page of a job that has not ended
reloads itself every few seconds, so the output and the charts follow without any
JavaScript. Cancel is a form posted back here with the XSRF token and goes through the
store as the API's does.

"What happened" lists the job's turns: attempts, faults, drains, its end. Checkpoints are
progress (the last one and how many), not events: one a few minutes would push the rest
off the page.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from tornado import web

from ..api.events import EventKind
from ..api.jobs import JobOut
from ..scheduler.errors import InvalidRequest
from ..state.models import Event, JobProgress, Workload, WorkloadKind
from .api.jobs import cancel_job, job_out, load_job
from .api.traces import trace_out
from .api.views import WORKLOAD_DETAILS
from .gpu_charts import job_charts
from .pages import PageHandler, project_names

LOG_TAIL = 64 * 1024
SHOWN_TRACES = 5  # the newest; GET /jobs/{id}/traces has them all
REFRESH_S = 3
TIMELINE_EVENTS = (
    EventKind.REQUESTED,
    EventKind.ADMITTED,
    EventKind.STARTED,
    EventKind.JOB_FAULT,
    EventKind.JOB_DRAINED,
    EventKind.JOB_TRACED,
    EventKind.JOB_FAILED,
    EventKind.JOB_RESTARTING,
    EventKind.JOB_CANCELLED,
    EventKind.PREEMPTING,
    EventKind.ENDED,
)


class JobsPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        identity = self.require_use()
        query = select(Workload).where(Workload.kind == WorkloadKind.job)
        if not identity.is_admin:
            query = query.where(Workload.username == identity.name)
        with self.controller.store.read() as session:
            rows = session.scalars(
                query.order_by(Workload.id.desc()).limit(500).options(*WORKLOAD_DETAILS)
            ).all()
            jobs = [job_out(w, []) for w in rows]
            names = display_names(session)
        self.render_page(
            "gpufleet-jobs.html",
            title="Jobs",
            section="jobs",
            jobs=jobs,
            shown_state=shown_state,
            project_names=names,
        )


class JobPage(PageHandler):
    @web.authenticated
    async def get(self, job_id: str) -> None:
        self.render_job(_page_id(job_id))

    def render_job(self, job_id: int, error: str = "", status: int = 200) -> None:
        rank = _rank(self.get_query_argument("rank", "0"))
        stream = self.get_query_argument("stream", "stdout")
        stream = stream if stream in ("stdout", "stderr") else "stdout"
        job = self._job(job_id)
        store = self.controller.store
        start = max(0, store.jobs.log_size(job_id, rank, stream) - LOG_TAIL)
        log = store.jobs.read_log(job_id, rank, stream, start, LOG_TAIL).data
        charts = job_charts(store.nodes, job_id, self.controller.now())
        with store.read() as session:
            names = display_names(session)
            events = timeline(session, job_id)
        self.render_page(
            "gpufleet-job.html",
            title=f"Job {job.id}: {job.name}",
            section="jobs",
            status=status,
            job=job,
            shown_state=shown_state,
            ranks=[
                (r, str(r) if r >= 0 else f"launcher of pod {-1 - r}")
                for r in range(-job.pods, job.ranks)
            ],
            rank=rank,
            stream=stream,
            log=log,
            truncated=start > 0,
            tail=LOG_TAIL,
            refresh=REFRESH_S,
            error=error,
            gpu_chart=charts.gpus,
            progress_chart=charts.progress,
            project_names=names,
            timeline=events,
            traces=[trace_out(t, job.pods) for t in store.traces.traces(job_id)[:SHOWN_TRACES]],
        )

    def _job(self, job_id: int) -> JobOut:
        identity = self.require_use()
        with self.controller.store.read() as session:
            workload = load_job(session, identity, job_id)
            pods = self.controller.store.jobs.job_pods(job_id)
            return job_out(workload, pods, session.get(JobProgress, job_id))


class _JobForm(JobPage):
    """A button of the job page, posted back with the XSRF token: its action goes through
    the store as the API's does; a refusal shows on the page, else the page loads again."""

    def act(self, workload_id: int, by: str) -> None:
        raise NotImplementedError

    @web.authenticated
    async def post(self, job_id: str) -> None:
        identity = self.require_use()
        wid = _page_id(job_id)
        self._job(wid)  # yours, or 404
        try:
            self.act(wid, identity.name)
        except InvalidRequest as e:
            self.render_job(wid, error=str(e), status=400)
            return
        # No #fragment: the page's refresh would then only scroll, never load it again.
        self.redirect(f"{self.base}jobs/{wid}", status=303)


class JobCancelForm(_JobForm):
    def act(self, workload_id: int, by: str) -> None:
        cancel_job(self.controller, workload_id, by)


class JobTraceForm(_JobForm):
    """Take every rank's stacks now (``POST /jobs/{id}/traces``'s page form)."""

    def act(self, workload_id: int, by: str) -> None:
        self.controller.store.traces.ask(self.controller.now(), workload_id, by)
        self.controller.notifier.changed([workload_id])


def shown_state(job: JobOut) -> str:
    """How it ended, or where it stands (with its place in the queue), and which attempt."""
    if job.state == "ended":
        state = job.outcome or "ended"
    else:
        state = f"{job.state} (#{job.queue_position})" if job.queue_position else job.state
    return f"{state}, attempt {job.attempt}" if job.attempt > 1 else state


def timeline(session: Any, job_id: int) -> list[Event]:
    """The job's life as its events tell it, oldest first: attempts, faults, drains."""
    return list(
        session.scalars(
            select(Event)
            .where(Event.workload_id == job_id, Event.kind.in_(TIMELINE_EVENTS))
            .order_by(Event.id)
            .limit(500)
        )
    )


def display_names(session: Any) -> dict[str, str]:
    """Project name → its display name, as the spawn page shows it."""
    return {name: label for name, label in project_names(session).values()}


def _page_id(text: str) -> int:
    # The route admits digits only; more than any id can have is no job (and int() of
    # thousands of digits would raise).
    if len(text) > 19 or int(text) > 2**62:
        raise web.HTTPError(404, f"there is no job {text[:30]}")
    return int(text)


def _rank(text: str) -> int:
    """The rank asked for; anything unreadable or out of range shows rank 0."""
    try:
        value = int(text)
    except ValueError:
        return 0
    return value if abs(value) <= 10**6 else 0


def job_page_routes(prefix: str, controller: Any) -> list[tuple[str, type, dict[str, Any]]]:
    jobs = prefix.rstrip("/") + "/jobs"
    table: list[tuple[str, type]] = [
        (rf"{jobs}", JobsPage),
        (rf"{jobs}/(\d+)", JobPage),
        (rf"{jobs}/(\d+)/cancel", JobCancelForm),
        (rf"{jobs}/(\d+)/trace", JobTraceForm),
    ]
    return [(path, handler, {"controller": controller}) for path, handler in table]
