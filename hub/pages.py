"""The controller's pages, behind the hub's OAuth: "my sessions and the queue", and GPU
usage per project, user and week (a chart and a CSV download).

Researchers see their own workloads with their queue position and reason, and the usage
of their projects; admins see everyone's and the nodes, and a link to the admin panel
(``admin.py``). No JavaScript: the chart is SVG drawn here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta
from typing import TYPE_CHECKING, Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from sqlalchemy import select
from sqlalchemy.orm import selectinload
from tornado import template, web

from ..scheduler.store.models import Workload, WorkloadState
from . import scopes
from .api.base import Identity
from .api.handlers import node_rows
from .api.projects import MAX_WEEKS, finish_with_csv, project_usage, usage_for
from .usage import WeekUsage, week_start

if TYPE_CHECKING:
    from .context import ControllerContext

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — {{ title }}</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
 table { border-collapse: collapse; margin-bottom: 2rem; }
 th, td { border-bottom: 1px solid #ddd; padding: .4rem .8rem; text-align: left; }
 .pending { color: #a15c00; } .running { color: #1a7f37; } .reason { max-width: 40rem; }
</style></head>
<body>
<h1>{{ title }}</h1>
<p>Signed in as <b>{{ identity.name }}</b>{% if identity.is_admin %} (gpufleet admin){% end %}.
<a href="{{ hub_home }}">Back to the hub</a> · <a id="usage-link" href="usage">GPU usage</a>
· <a id="jobs-link" href="jobs">Jobs</a>
{% if identity.is_admin %} · <a id="admin-link" href="admin">Admin panel</a>{% end %}</p>
<h2>{% if identity.is_admin %}Workloads{% else %}Your sessions{% end %}</h2>
{% if not workloads %}<p id="no-workloads">Nothing running or waiting.</p>{% else %}
<table id="workloads"><tr><th>id</th><th>user</th><th>server</th><th>project</th>
<th>GPUs</th><th>state</th><th>queue</th><th>why</th></tr>
{% for w in workloads %}<tr data-workload="{{ w.id }}">
<td>{{ w.id }}</td><td>{{ w.username }}</td><td>{{ w.server_name or "(default)" }}</td>
<td>{{ w.project.name }}</td><td>{{ w.gpus }} × {{ w.gpu_type }}</td>
<td class="{{ w.state.value }}">{{ w.state.value }}</td>
<td>{{ w.queue_position or "" }}</td><td class="reason">{{ w.reason }}</td></tr>{% end %}
</table>{% end %}
<h2>{% if identity.is_admin %}Quotas{% else %}Your projects' quotas{% end %}</h2>
<table id="quotas"><tr><th>project</th><th>GPU type</th><th>used / guaranteed</th>
<th>may borrow</th><th>waiting</th></tr>
{% for p in projects %}{% for q in p.quotas %}<tr data-project="{{ p.name }}">
<td>{{ p.name }}</td><td>{{ q.gpu_type }}</td><td>{{ q.used }} / {{ q.guaranteed }}</td>
<td>{{ "any" if q.borrow_limit is None else q.borrow_limit }}</td><td>{{ q.waiting or "" }}</td>
</tr>{% end %}{% end %}</table>
<h2>Your snapshots</h2>
{% if not snapshots %}<p id="no-snapshots">No snapshots yet: an idle session is snapshotted
before it is stopped, and restored when you start it again.</p>{% else %}
<table id="snapshots"><tr><th>taken (UTC)</th><th>server</th><th>files</th><th>size</th></tr>
{% for s in snapshots %}<tr><td>{{ s.created_at.strftime("%Y-%m-%d %H:%M") }}</td>
<td>{{ s.server_name or "(default)" }}</td><td>{{ s.file_count }}</td>
<td>{{ "%.1f MB" % (s.size_bytes / 1e6) }}</td></tr>{% end %}</table>{% end %}
{% if identity.is_admin %}<h2>Nodes</h2>
<table id="nodes"><tr><th>node</th><th>zone</th><th>GPU type</th><th>GPUs</th><th>free</th>
<th>health</th></tr>
{% for n in nodes %}<tr><td>{{ n.name }}</td><td>{{ n.zone }}</td>
<td>{{ n.gpu_type }}</td><td>{{ n.gpus }}</td><td>{{ n.free_gpus }}</td>
<td>{{ n.health }}</td></tr>{% end %}</table>{% end %}
</body></html>
"""


class PageHandler(HubOAuthenticated, web.RequestHandler):
    controller: ControllerContext
    identity: Identity | None

    def initialize(self, controller: ControllerContext) -> None:
        self.controller = controller
        self.hub_auth = controller.hub_auth

    async def prepare(self) -> None:
        # Resolve the user without blocking the event loop; HubOAuthenticated's own
        # get_current_user would call the hub synchronously.
        self.identity = await self.controller.identify(self)
        self._current_user = self.identity  # what @web.authenticated checks

    def get_current_user(self) -> Any:
        return self.identity

    @property
    def base(self) -> str:
        """The pages' root URL, ending in a slash."""
        return self.controller.service_prefix.rstrip("/") + "/"

    def require_use(self) -> Identity:
        identity = self.identity
        if identity is None:
            raise web.HTTPError(401)
        if not identity.has(scopes.USE):
            raise web.HTTPError(403, "your account may not use gpufleet")
        return identity


class MyWorkloadsPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        identity = self.identity
        assert identity is not None
        if not identity.has(scopes.USE):
            raise web.HTTPError(403, "your account may not use gpufleet")
        await self.controller.refresh_memberships(max_age=5.0)
        query = (
            select(Workload)
            .where(Workload.state != WorkloadState.ended)
            .order_by(Workload.id)
            .options(selectinload(Workload.project))
        )
        if not identity.is_admin:
            query = query.where(Workload.username == identity.name)
        with self.controller.store.read() as session:
            workloads = list(session.scalars(query))
            nodes = node_rows(session) if identity.is_admin else []
            projects = project_usage(self.controller, session, identity)
        snapshots = self.controller.store.snapshots_of(identity.name)[:20]
        self.finish(
            template.Template(PAGE).generate(
                title="gpufleet",
                identity=identity,
                workloads=workloads,
                nodes=nodes,
                snapshots=snapshots,
                projects=projects,
                hub_home="/hub/home",
            )
        )


USAGE_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — GPU usage</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
 table { border-collapse: collapse; margin-bottom: 2rem; }
 th, td { border-bottom: 1px solid #ddd; padding: .3rem .7rem; text-align: right; }
 th:first-child, td:first-child { text-align: left; }
 .legend span { display: inline-block; margin-right: 1rem; }
 .swatch { display: inline-block; width: .8rem; height: .8rem; margin-right: .3rem; }
</style></head>
<body>
<h1>GPU usage</h1>
<p>GPU-hours per week (weeks start on Monday, UTC), the last {{ weeks }} weeks.
<a id="csv" href="usage.csv?weeks={{ weeks }}" download>Download CSV</a> ·
<a href="./">Sessions and queue</a></p>
{% if not charts %}<p id="no-usage">No GPU was used in your projects in these weeks.</p>{% end %}
{% for chart in charts %}<section class="project" data-project="{{ chart.project }}">
<h2>{{ chart.project }} <small>({{ "%.1f" % chart.total }} GPU-hours)</small></h2>
<svg class="chart" role="img" aria-label="GPU-hours per week in {{ chart.project }}"
 width="{{ chart.width }}" height="{{ chart.height + 40 }}">
{% for bar in chart.bars %}<g><title>{{ bar.title }}</title>
<rect class="bar" x="{{ bar.x }}" y="{{ bar.y }}" width="{{ bar.w }}" height="{{ bar.h }}"
 fill="{{ bar.color }}"></rect></g>{% end %}
{% for label in chart.labels %}<text x="{{ label.x }}" y="{{ chart.height + 16 }}"
 font-size="11" text-anchor="middle">{{ label.text }}</text>{% end %}
</svg>
<p class="legend">{% for user, color in chart.legend %}<span><i class="swatch"
 style="background: {{ color }}"></i>{{ user }}</span>{% end %}</p>
<table><tr><th>week</th>{% for user, _ in chart.legend %}<th>{{ user }}</th>{% end %}</tr>
{% for week, row in chart.rows %}<tr><td>{{ week }}</td>{% for value in row %}
<td>{{ "%.1f" % value if value else "" }}</td>{% end %}</tr>{% end %}</table>
</section>{% end %}
</body></html>
"""
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6")
BAR_W, GAP, CHART_H = 36, 12, 160


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    w: float
    h: float
    color: str
    title: str


@dataclass(frozen=True)
class Label:
    x: float
    text: str


@dataclass(frozen=True)
class Chart:
    project: str
    total: float
    width: int
    height: int
    bars: list[Bar]
    labels: list[Label]
    legend: list[tuple[str, str]]  # (user, colour)
    rows: list[tuple[str, list[float]]]  # (week, hours per user in legend order)


def usage_charts(usage: list[WeekUsage], weeks: list[date]) -> list[Chart]:
    """Per project, stacked bars (one per week, a segment per user) with their table."""
    charts = []
    for project in sorted({u.project for u in usage}):
        mine = [u for u in usage if u.project == project]
        users = sorted({u.username for u in mine})
        colors = {user: PALETTE[j % len(PALETTE)] for j, user in enumerate(users)}
        hours = {(u.week, u.username): u.gpu_hours for u in mine}
        totals = [sum(hours.get((w, user), 0.0) for user in users) for w in weeks]
        scale = CHART_H / max(max(totals), 1e-9)
        bars, labels = [], []
        for i, week in enumerate(weeks):
            x, top = GAP + i * (BAR_W + GAP), float(CHART_H)
            for user in users:
                value = hours.get((week, user), 0.0)
                if value <= 0:
                    continue
                h = value * scale
                top -= h
                title = f"{user}, week of {week.isoformat()}: {value:.1f} GPU-hours"
                bars.append(Bar(x, round(top, 1), BAR_W, round(h, 1), colors[user], title))
            labels.append(Label(x + BAR_W / 2, week.strftime("%d %b")))
        charts.append(
            Chart(
                project=project,
                total=sum(totals),
                width=GAP + len(weeks) * (BAR_W + GAP),
                height=CHART_H,
                bars=bars,
                labels=labels,
                legend=list(colors.items()),
                rows=[(w.isoformat(), [hours.get((w, u), 0.0) for u in users]) for w in weeks],
            )
        )
    return charts


class UsagePage(PageHandler):
    """``usage``: the chart and table; ``usage.csv``: the same figures to download."""

    @web.authenticated
    async def get(self, csv_suffix: str | None = None) -> None:
        identity = self.identity
        assert identity is not None
        if not identity.has(scopes.USE):
            raise web.HTTPError(403, "your account may not use gpufleet")
        try:
            weeks = int(self.get_query_argument("weeks", "8"))
        except ValueError:
            weeks = 0
        if not 1 <= weeks <= MAX_WEEKS:
            raise web.HTTPError(400, f"weeks must be a whole number from 1 to {MAX_WEEKS}")
        await self.controller.refresh_memberships(max_age=5.0)
        with self.controller.store.read() as session:
            usage = usage_for(self.controller, session, identity, weeks)
        if csv_suffix:
            finish_with_csv(self, usage)
            return
        first = week_start(self.controller.now()).date() - timedelta(weeks=weeks - 1)
        week_list = [first + timedelta(weeks=i) for i in range(weeks)]
        self.finish(
            template.Template(USAGE_PAGE).generate(
                weeks=weeks, charts=usage_charts(usage, week_list)
            )
        )


def page_routes(
    prefix: str, controller: ControllerContext
) -> list[tuple[str, type, dict[str, Any]]]:
    base = prefix.rstrip("/")
    return [
        (rf"{base}/?", MyWorkloadsPage, {"controller": controller}),
        (rf"{base}/usage(\.csv)?", UsagePage, {"controller": controller}),
        (rf"{base}/oauth_callback", HubOAuthCallbackHandler, {}),
    ]
