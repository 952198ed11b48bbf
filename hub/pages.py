"""The controller's pages, behind the hub's OAuth: "my sessions and the queue", and GPU
usage per project, user and week (a chart and a CSV download); and ``server.json``, what
the hub's "server not running" page and the spawn form show of a server's last session
(culled, when and why) and of the snapshot a start restores.

Researchers see their own workloads with their queue position and reason, and the usage
of their projects; admins see everyone's and the nodes, and a link to the admin panel
(``admin.py``). No JavaScript: the chart is SVG drawn here.

Every page is drawn in the hub's own page (its navigation bar and styles) by
``PageHandler.render_page`` from ``templates/gpufleet-*.html``, which extend
``gpufleet-page.html``; times are shown one way, ``2026-12-01 20:13 UTC`` (``when``,
``when_text``), and projects by their display names (``project_label``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import jinja2
from jupyterhub._data import DATA_FILES_PATH
from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from markupsafe import Markup
from sqlalchemy import select
from sqlalchemy.orm import selectinload
from tornado import web

from ..api.events import EventKind
from ..output import tree_order
from ..snapshotter.listing import distinct
from ..state.models import Event, Project, Workload, WorkloadKind, WorkloadState
from . import scopes
from .api.base import Identity
from .api.handlers import node_rows
from .api.projects import MAX_WEEKS, finish_with_csv, project_usage, usage_for
from .gpu_charts import session_charts
from .usage import WeekUsage, week_start

if TYPE_CHECKING:
    from .context import ControllerContext

TEMPLATES = Path(__file__).parent / "templates"
TIME_FORMAT = "%Y-%m-%d %H:%M UTC"  # the one way every page shows a time


def utc(moment: datetime) -> datetime:
    """A time from the database (naive ones are UTC) in UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def when_text(moment: datetime | None) -> str:
    """``2026-12-01 20:13 UTC``: how the pages, the spawn form and the cull notice say
    when; empty for no time."""
    return "" if moment is None else utc(moment).strftime(TIME_FORMAT)


def when(moment: datetime | None) -> Markup:
    """``when_text`` in a ``<time>`` element carrying the exact instant (the pages'
    ``when`` filter)."""
    if moment is None:
        return Markup("")
    exact = utc(moment).isoformat(timespec="seconds").replace("+00:00", "Z")
    return Markup('<time datetime="{0}" title="{0}">{1}</time>').format(exact, when_text(moment))


def project_label(project: Any) -> str:
    """A project as the spawn page names it: its display name, else its name."""
    return str(getattr(project, "display_name", "") or project.name)


def project_html(project: Any) -> Markup:
    """Its display name, then its name (what ``--project`` takes) where they differ."""
    label = project_label(project)
    if label == project.name:
        return Markup("{0}").format(label)
    return Markup('{0} <span class="id">{1}</span>').format(label, project.name)


@functools.cache
def environment() -> jinja2.Environment:
    """The pages' templates (``templates/gpufleet-*.html``) over the hub's own: ours first,
    then JupyterHub's under ``templates/`` (as the hub itself loads them), so
    ``page.html`` here extends the hub's ``templates/page.html``."""
    loader = jinja2.ChoiceLoader(
        [
            jinja2.FileSystemLoader(str(TEMPLATES)),
            jinja2.PrefixLoader(
                {"templates": jinja2.FileSystemLoader(str(Path(DATA_FILES_PATH) / "templates"))}
            ),
        ]
    )
    env = jinja2.Environment(loader=loader, autoescape=True)
    env.filters["when"] = when
    env.filters["urlencode_all"] = lambda text: quote(str(text), safe="")
    env.globals["project_label"] = project_label
    env.globals["project_html"] = project_html
    return env


def page_context(
    identity: Identity | None,
    title: str,
    section: str,
    *,
    base: str,
    site_prefix: str = "/",
    xsrf_token: str = "",
    xsrf_form: str = "",
) -> dict[str, Any]:
    """What ``gpufleet-page.html`` and the hub's page.html need: the title and active tab,
    the pages' root ``base``, the hub's URLs under ``site_prefix`` (its static files are
    served at <hub>/static/), the user and their scopes (the navigation bar shows "GPU
    admin" to admins), and the XSRF token and its hidden form field."""
    hub = f"{site_prefix}hub/"
    return {
        "title": title,
        "section": section,
        "identity": identity,
        "base": base,
        # what the hub's page.html reads
        "prefix": site_prefix,
        "base_url": hub,
        "static_url": lambda path, include_version=True: f"{hub}static/{path}",
        "user": PageUser(identity.name) if identity else None,
        "parsed_scopes": identity.scopes if identity else frozenset(),
        "services": [{"name": "gpufleet", "href": base}],
        "logout_url": f"{hub}logout",
        "login_url": f"{hub}login",
        "logo_url": "",
        "announcement": None,
        "admin_access": False,
        "no_spawner_check": True,
        "version_hash": "",
        "xsrf_token": xsrf_token,
        "xsrf_form": Markup(xsrf_form),
    }


@dataclass(frozen=True)
class PageUser:
    """What the hub's page.html reads of ``user``."""

    name: str

    @property
    def json_escaped_name(self) -> str:
        return json.dumps(self.name)[1:-1]


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

    @property
    def site_prefix(self) -> str:
        """The site's root under the proxy (JupyterHub's base_url, "/" by default)."""
        return self.controller.service_prefix.rsplit("services/", 1)[0] or "/"

    def page_context(self, title: str, section: str) -> dict[str, Any]:
        return page_context(
            self.identity,
            title,
            section,
            base=self.base,
            site_prefix=self.site_prefix,
            xsrf_token=self.xsrf_token.decode(),
            xsrf_form=self.xsrf_form_html(),
        )

    def render_page(
        self, template_name: str, title: str, section: str, status: int = 200, **context: Any
    ) -> None:
        """Finish with one of the pages' templates in the hub's page: ``title`` heads it,
        ``section`` is the active tab (sessions, jobs, usage, admin); ``context`` is the
        template's own."""
        page = environment().get_template(template_name)
        self.set_status(status)
        self.finish(page.render(**self.page_context(title, section), **context))

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
            names = project_names(session)
        snapshots = distinct(self.controller.store.snapshots.snapshots_of(identity.name), names)
        self.render_page(
            "gpufleet-sessions.html",
            title="gpufleet",
            section="sessions",
            workloads=workloads,
            nodes=nodes,
            snapshots=snapshots[:20],
            projects=[(_depth(label), p) for label, p in tree_order(projects)],
            # Each of the viewer's own sessions' GPUs over the last day (an admin's page
            # lists everyone's workloads, but draws only the admin's own sessions).
            charts=session_charts(
                self.controller.store.nodes,
                [
                    w.id
                    for w in workloads
                    if w.username == identity.name and w.kind.value == "session"
                ],
                self.controller.now(),
            ),
        )


def _depth(tree_label: str) -> int:
    """A node's depth in the tree, from its label of ``tree_order`` (two spaces a level)."""
    return (len(tree_label) - len(tree_label.lstrip())) // 2


def project_names(session: Any) -> dict[int | None, tuple[str, str]]:
    """Project id → (name, display name)."""
    return {p.id: (p.name, project_label(p)) for p in session.scalars(select(Project))}


class ServerStatus(PageHandler):
    """``server.json?user=U&server=S``: the last session of that server (how it ended,
    when and why: culled, preempted, stopped), and per project the snapshot a start in
    that project restores (the newest of that project), newest first.

    ``server.js`` is the same as a script, ``window.gpufleetServerStatus(status)``, for
    the hub's pages (the "server not running" page, the spawn form) to include with a
    ``<script>`` element: the hub's auth accepts the controller's cookie on a same-origin
    script request as on a page view (a ``fetch`` would need this page's XSRF token, which
    a hub page cannot read), and a browser without the cookie yet goes through the hub's
    OAuth, which a script request follows. A cross-site include gets no cookie auth."""

    def get_cookie(self, name: str, default: Any = None) -> Any:
        # A hub page includes server.js while the user may be navigating to a gpufleet
        # page: were both to go through the hub's OAuth with HubOAuth's one state cookie,
        # each would overwrite the other's and both logins fail ("oauth state does not
        # match"). Told that cookie is taken, HubOAuth gives this flow one of its own.
        if self.hub_auth is not None and name == self.hub_auth.state_cookie_name:
            return "taken"
        return super().get_cookie(name, default)

    @web.authenticated
    async def get(self, suffix: str) -> None:
        identity = self.require_use()
        username = self.get_query_argument("user", "") or identity.name
        server = self.get_query_argument("server", "")
        if username != identity.name and not identity.is_admin:
            raise web.HTTPError(403, "you may see only your own servers")
        status = json.dumps(self.status(username, server))
        self.set_header("Cache-Control", "no-store")
        if suffix == "js":
            self.set_header("Content-Type", "text/javascript; charset=utf-8")
            self.finish(f"window.gpufleetServerStatus && window.gpufleetServerStatus({status});\n")
        else:
            self.set_header("Content-Type", "application/json; charset=utf-8")
            self.finish(status)

    def status(self, username: str, server: str) -> dict[str, Any]:
        store = self.controller.store
        with store.read() as session:
            sessions = (
                select(Workload)
                .where(
                    Workload.username == username,
                    Workload.server_name == server,
                    Workload.kind == WorkloadKind.session,
                )
                .options(selectinload(Workload.project))
                .order_by(Workload.id.desc())
                .limit(1)
            )
            last = session.scalars(sessions).first()
            cull = None
            if last is not None:
                cull = session.scalars(
                    select(Event)
                    .where(Event.workload_id == last.id, Event.kind == EventKind.SESSION_CULL)
                    .order_by(Event.id.desc())
                    .limit(1)
                ).first()
            names = project_names(session)
            ended = last_session(last, cull) if last is not None else None
        listed = distinct(store.snapshots.snapshots_of(username, server), names)
        return {
            "user": username,
            "server": server,
            "last_session": ended,
            "snapshots": [
                {
                    "project": s.project,
                    "project_label": s.project_label,
                    "taken": when_text(s.created_at),
                    "files": s.file_count,
                }
                for s in listed
                if s.restored_next
            ],
        }


def last_session(workload: Workload, cull: Event | None) -> dict[str, Any]:
    """How a server's last session stands or ended, in words for its owner."""
    culled = cull is not None and workload.state is WorkloadState.ended
    return {
        "id": workload.id,
        "state": workload.state.value,
        "outcome": workload.outcome,
        "culled": culled,
        "why": cull.message if culled and cull is not None else workload.reason,
        "at": when_text(cull.at if culled and cull is not None else workload.ended_at),
        "project": workload.project.name,
        "project_label": project_label(workload.project),
    }


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
        with self.controller.store.read() as session:
            names = {name: label for name, label in project_names(session).values()}
        self.render_page(
            "gpufleet-usage.html",
            title="GPU usage",
            section="usage",
            weeks=weeks,
            charts=usage_charts(usage, week_list),
            names=names,
        )


def page_routes(
    prefix: str, controller: ControllerContext
) -> list[tuple[str, type, dict[str, Any]]]:
    base = prefix.rstrip("/")
    return [
        (rf"{base}/?", MyWorkloadsPage, {"controller": controller}),
        (rf"{base}/usage(\.csv)?", UsagePage, {"controller": controller}),
        (rf"{base}/server\.(json|js)", ServerStatus, {"controller": controller}),
        (rf"{base}/oauth_callback", HubOAuthCallbackHandler, {}),
    ]
