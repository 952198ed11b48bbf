"""The researcher's job pages: ``jobs`` (their jobs; everyone's for admins) and
``jobs/<id>`` (its pods, one rank's output, a cancel button). Server-drawn HTML: the page
of a job that has not ended reloads itself every few seconds, so the output follows
without any JavaScript. Cancel is a form posted back here with the XSRF token and goes
through the store as the API's does.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from tornado import template, web

from ..scheduler.errors import InvalidRequest
from ..scheduler.store.models import Workload, WorkloadKind
from .api.job_schemas import JobOut
from .api.jobs import cancel_job, job_out, load_job
from .api.views import WORKLOAD_DETAILS
from .pages import PageHandler

LOG_TAIL = 64 * 1024
REFRESH_S = 3

STYLE = """<style>
 body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
 table { border-collapse: collapse; margin-bottom: 1.5rem; }
 th, td { border-bottom: 1px solid #ddd; padding: .3rem .6rem; text-align: left; }
 pre { background: #f6f8fa; padding: .8rem; max-height: 32rem; overflow: auto; }
 .failed, .cancelled { color: #b00020; } .succeeded, .running { color: #1a7f37; }
</style>"""

JOBS_PAGE = (
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — jobs</title>"""
    + STYLE
    + """</head><body>
<h1>Jobs</h1>
<p><a href="{{ base }}">Sessions and queue</a> · <a href="{{ base }}usage">GPU usage</a> ·
submit with <code>%%train</code> in a notebook or <code>gpufleet submit</code></p>
{% if not jobs %}<p id="no-jobs">No jobs yet.</p>{% else %}
<table id="jobs"><tr><th>id</th><th>name</th><th>user</th><th>project</th><th>GPUs</th>
<th>state</th><th>what happened last</th></tr>
{% for j in jobs %}<tr data-job="{{ j.id }}">
<td><a href="{{ base }}jobs/{{ j.id }}">{{ j.id }}</a></td>
<td>{{ j.name }}</td><td>{{ j.username }}</td><td>{{ j.project }}</td>
<td>{{ j.gpus }} × {{ j.gpu_type }}</td>
<td class="{{ j.outcome or j.state }}">{{ shown_state(j) }}</td>
<td>{{ j.reason }}</td></tr>{% end %}</table>{% end %}
</body></html>"""
)

JOB_PAGE = (
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — job {{ job.id }}</title>
{% if job.state != "ended" %}<meta http-equiv="refresh" content="{{ refresh }}">{% end %}"""
    + STYLE
    + """</head><body>
<h1>Job {{ job.id }}: {{ job.name }}</h1>
<p><a href="{{ base }}jobs">All jobs</a></p>
{% if error %}<p class="failed" id="error">{{ error }}</p>{% end %}
<p id="state" class="{{ job.outcome or job.state }}"><b>{{ shown_state(job) }}</b>:
{{ job.reason }}</p>
<p>{{ job.gpus }} × {{ job.gpu_type }} as {{ job.pods }} pod(s) of {{ job.gpus_per_pod }} in
project {{ job.project }} ({{ job.priority_class }}) · script {{ job.script_name }}
{{ " ".join(job.args) }} · checkpoints: <code>{{ job.checkpoint_uri }}</code></p>
{% if job.state != "ended" %}<form method="post" action="{{ base }}jobs/{{ job.id }}/cancel">
{% raw xsrf %}<button type="submit" id="cancel">Cancel this job</button></form>{% end %}
<table id="pods"><tr><th>pod</th><th>ranks</th><th>node</th><th>state</th><th>exit</th>
<th>reason</th></tr>
{% for p in job.pod_states %}<tr><td>{{ p.pod }}</td><td>{{ p.ranks[0] }}–{{ p.ranks[-1] }}</td>
<td>{{ p.node }}</td><td>{{ p.state }}</td><td>{{ "" if p.exit_code is None else p.exit_code }}</td>
<td>{{ p.reason }}</td></tr>{% end %}</table>
<form method="get"><label>rank <select name="rank">{% for r, label in ranks %}
<option value="{{ r }}"{% if r == rank %} selected{% end %}>{{ label }}</option>{% end %}
</select></label> <label><select name="stream">{% for s in ("stdout", "stderr") %}
<option{% if s == stream %} selected{% end %}>{{ s }}</option>{% end %}</select></label>
<button type="submit">Show</button></form>
<h2>Rank {{ rank }}, {{ stream }}{% if truncated %} (the last {{ tail // 1024 }} KiB){% end %}</h2>
<pre id="log">{{ log }}</pre>
</body></html>"""
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
        self.finish(
            template.Template(JOBS_PAGE).generate(
                jobs=jobs, base=self.base, shown_state=shown_state
            )
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
        start = max(0, store.log_size(job_id, rank, stream) - LOG_TAIL)
        log = store.read_log(job_id, rank, stream, start, LOG_TAIL).data
        self.set_status(status)
        self.finish(
            template.Template(JOB_PAGE).generate(
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
                base=self.base,
                xsrf=self.xsrf_form_html(),
            )
        )

    def _job(self, job_id: int) -> JobOut:
        identity = self.require_use()
        with self.controller.store.read() as session:
            workload = load_job(session, identity, job_id)
            pods = self.controller.store.job_pods(job_id)
            return job_out(workload, pods)


class JobCancelForm(JobPage):
    @web.authenticated
    async def post(self, job_id: str) -> None:
        identity = self.require_use()
        wid = _page_id(job_id)
        self._job(wid)  # yours, or 404
        try:
            cancel_job(self.controller, wid, identity.name)
        except InvalidRequest as e:
            self.render_job(wid, error=str(e), status=400)
            return
        self.redirect(f"{self.base}jobs/{wid}", status=303)


def shown_state(job: JobOut) -> str:
    """How it ended, or where it stands (with its place in the queue)."""
    if job.state == "ended":
        return job.outcome or "ended"
    return f"{job.state} (#{job.queue_position})" if job.queue_position else job.state


def _page_id(text: str) -> int:
    value = int(text)  # the route admits digits only
    if value > 2**62:
        raise web.HTTPError(404, f"there is no job {text}")
    return value


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
    ]
    return [(path, handler, {"controller": controller}) for path, handler in table]
