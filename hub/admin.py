"""The admin panel (``/services/gpufleet/admin``, admins only): the project tree with its
quotas and live usage, editable; the nodes with their GPUs' health, to cordon or
uncordon; the queue with each workload's reason; the latest events.

Plain HTML forms posted back here (with the XSRF token), so nothing is built at install
and nothing but the browser runs. Every change goes through the store as the API's does
(``edit_project``, ``set_cordoned``): validated whole, audited in the event log, in
effect from the next scheduling cycle, which it starts at once. A refused change shows
the form again with the store's message and nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sqlalchemy import select
from sqlalchemy.orm import selectinload
from tornado import template, web

from ..fleet_cli import tree_order
from ..scheduler.errors import InvalidRequest, NotFound
from ..scheduler.store.models import Event, Gpu, Node, PriorityClass, Workload, WorkloadState
from ..scheduler.store.projects import UNCHANGED, ProjectEdit, QuotaEdit
from .api.handlers import node_rows
from .api.projects import project_usage
from .api.schemas import NodeOut, ProjectUsageOut
from .pages import PageHandler

ADMIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — admin</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
 table { border-collapse: collapse; margin-bottom: 1.5rem; }
 th, td { border-bottom: 1px solid #ddd; padding: .3rem .6rem; text-align: left; }
 input[type=number] { width: 5rem; } .error { color: #b00020; } .saved { color: #1a7f37; }
 .bar { display: inline-block; width: 8rem; height: .7rem; background: #eee; }
 .bar i { display: block; height: 100%; background: #4c78a8; }
 .bar i.over { background: #f58518; } .lost { color: #b00020; }
 form.project { border: 1px solid #ddd; padding: .6rem; margin-bottom: 1rem; }
</style></head>
<body>
<h1>gpufleet admin</h1>
<p>Signed in as <b>{{ name }}</b>. <a href="{{ base }}">Sessions and queue</a> ·
<a href="{{ base }}jobs">Jobs</a> · <a href="{{ base }}usage">GPU usage</a> ·
<a href="/hub/home">Hub</a></p>
{% if error %}<p class="error" id="error">{{ error }}</p>{% end %}
{% if saved %}<p class="saved" id="saved">{{ saved }}</p>{% end %}

<h2 id="projects">Projects and quotas</h2>
<p>Changes take effect on the next scheduling cycle and are kept in the event log. A value
changed here is no longer overwritten by the configuration file.</p>
{% for row in projects %}{% set p = row.project %}
<form class="project" id="project-{{ p.name }}" method="post"
 action="{{ base }}admin/projects/{{ url_escape(p.name) }}">{% raw xsrf %}
<b>{{ row.label }}</b> ({{ p.kind }})
 weight <input type="number" step="any" min="0" name="weight"
 value="{{ '%g' % p.fair_share_weight }}">
 default priority <select name="default_priority">{% for c in priorities %}
 <option{% if c == p.default_priority %} selected{% end %}>{{ c }}</option>{% end %}</select>
 per-user GPU cap <input type="number" min="1" name="per_user_gpu_cap"
 value="{{ p.per_user_gpu_cap or '' }}" placeholder="none">
<table><tr><th>GPU type</th><th>used / guaranteed</th><th>guaranteed</th>
<th>may borrow</th><th>may lend</th><th>waiting</th></tr>
{% for q in row.quotas %}<tr data-gpu-type="{{ q.gpu_type }}">
<td>{{ q.gpu_type }}</td>
<td><span class="bar" title="{{ q.used }} of {{ q.guaranteed }} guaranteed">
<i class="{{ 'over' if q.used > q.guaranteed else '' }}"
 style="width: {{ q.percent }}%"></i></span> {{ q.used }} / {{ q.guaranteed }}</td>
<td><input type="number" min="0" name="{{ q.field }}-guaranteed" value="{{ q.guaranteed_input }}"
 aria-label="{{ p.name }} {{ q.gpu_type }} guaranteed"></td>
<td><input type="number" min="0" name="{{ q.field }}-borrow" value="{{ q.borrow_input }}"
 placeholder="any"></td>
<td><input type="number" min="0" name="{{ q.field }}-lend" value="{{ q.lend_input }}"
 placeholder="all"></td>
<td>{{ q.waiting or "" }}</td></tr>{% end %}
</table><button type="submit">Save {{ p.name }}</button></form>{% end %}

<h2 id="nodes">Clusters, zones and nodes</h2>
<table><tr><th>node</th><th>cluster / zone</th><th>GPU type</th><th>free / GPUs</th>
<th>health</th><th>GPUs</th><th></th></tr>
{% for n in nodes %}<tr data-node="{{ n.name }}"><td>{{ n.name }}</td>
<td>{{ n.cluster }} / {{ n.zone }}</td><td>{{ n.gpu_type }}</td>
<td>{{ n.free_gpus }} / {{ n.gpus }}</td>
<td>{{ n.health }}{% if n.cordoned %}, cordoned{% end %}</td>
<td>{% for g in gpus.get(n.name, []) %}<span class="{{ 'lost' if g.lost else '' }}"
 title="{{ g.uuid }}">#{{ g.index }} {{ g.state }}</span> {% end %}</td>
<td><form method="post"
 action="{{ base }}admin/nodes/{{ url_escape(n.name) }}/{{ n.action }}">
{% raw xsrf %}<button type="submit">{{ n.action.capitalize() }}</button>
</form></td></tr>{% end %}</table>

<h2 id="queue">Queue</h2>
{% if not queue %}<p>Nothing waits.</p>{% else %}
<table><tr><th>id</th><th>kind</th><th>user</th><th>project</th><th>GPUs</th><th>place</th>
<th>why it waits</th></tr>
{% for w in queue %}<tr data-workload="{{ w.id }}"><td>{{ w.id }}</td><td>{{ w.kind.value }}</td>
<td>{{ w.username }}</td><td>{{ w.project.name }}</td><td>{{ w.gpus }} × {{ w.gpu_type }}</td>
<td>{{ w.queue_position or "" }}</td><td>{{ w.reason }}</td></tr>{% end %}</table>{% end %}

<h2 id="events">Latest events</h2>
<table id="event-log"><tr><th>when (UTC)</th><th>what</th><th>message</th></tr>
{% for e in events %}<tr><td>{{ e.at.strftime("%Y-%m-%d %H:%M:%S") }}</td><td>{{ e.kind }}</td>
<td>{{ e.message }}</td></tr>{% end %}</table>
</body></html>
"""


@dataclass(frozen=True)
class QuotaRow:
    gpu_type: str
    field: str  # the form fields' prefix
    used: int
    guaranteed: int
    waiting: int
    percent: int  # of the bar: used over guaranteed, capped at 100
    guaranteed_input: str
    borrow_input: str
    lend_input: str


@dataclass(frozen=True)
class ProjectRow:
    label: str
    project: ProjectUsageOut
    quotas: list[QuotaRow]


@dataclass(frozen=True)
class NodeRow:
    node: NodeOut
    action: str  # what its button does: cordon or uncordon

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


@dataclass(frozen=True)
class GpuState:
    index: int
    uuid: str
    lost: bool
    state: str


def project_rows(projects: list[ProjectUsageOut], gpu_types: list[str]) -> list[ProjectRow]:
    """Each node of the tree under its parent, with a row per GPU type of the fleet (a type
    it has no quota for shows empty inputs: filling them adds one)."""
    rows = []
    for label, p in tree_order(projects):
        have = {q.gpu_type: q for q in p.quotas}
        quotas = []
        for gpu_type in sorted(set(gpu_types) | set(have)):
            q = have.get(gpu_type)
            used = q.used if q else 0
            guaranteed = q.guaranteed if q else 0
            quotas.append(
                QuotaRow(
                    gpu_type=gpu_type,
                    field=f"quota-{gpu_type}",
                    used=used,
                    guaranteed=guaranteed,
                    waiting=q.waiting if q else 0,
                    percent=min(100, round(100 * used / guaranteed)) if guaranteed else 0,
                    guaranteed_input=str(q.guaranteed) if q else "",
                    borrow_input="" if q is None or q.borrow_limit is None else str(q.borrow_limit),
                    lend_input="" if q is None or q.lend_limit is None else str(q.lend_limit),
                )
            )
        rows.append(ProjectRow(label, p, quotas))
    return rows


def edit_from_form(arguments: dict[str, list[bytes]]) -> ProjectEdit:
    """The form's fields as an edit; a quota row with no guarantee is left as it is."""

    def value(name: str) -> str:
        raw = arguments.get(name)
        return raw[-1].decode().strip() if raw else ""

    def whole(name: str, what: str) -> int | None:
        text = value(name)
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise InvalidRequest(f"{what} must be a whole number, not {text!r}") from None

    weight_text = value("weight")
    try:
        weight = float(weight_text) if weight_text else None
    except ValueError:
        raise InvalidRequest(f"the weight must be a number, not {weight_text!r}") from None
    quotas = {}
    for name in arguments:
        if not (name.startswith("quota-") and name.endswith("-guaranteed")):
            continue
        gpu_type = name.removeprefix("quota-").removesuffix("-guaranteed")
        guaranteed = whole(name, f"{gpu_type}: guaranteed")
        if guaranteed is None:
            continue
        quotas[gpu_type] = QuotaEdit(
            guaranteed,
            whole(f"quota-{gpu_type}-borrow", f"{gpu_type}: may borrow"),
            whole(f"quota-{gpu_type}-lend", f"{gpu_type}: may lend"),
        )
    return ProjectEdit(
        weight=weight,
        default_priority=value("default_priority") or None,
        per_user_gpu_cap=whole("per_user_gpu_cap", "the per-user GPU cap")
        if "per_user_gpu_cap" in arguments
        else UNCHANGED,
        quotas=quotas,
    )


class AdminPage(PageHandler):
    def require_admin(self) -> str:
        identity = self.identity
        if identity is None:
            raise web.HTTPError(401)
        if not identity.is_admin:
            raise web.HTTPError(403, "the admin panel is for gpufleet admins")
        return identity.name

    def panel_url(self, saved: str, anchor: str) -> str:
        return f"{self.base}admin?saved={quote(saved)}#{anchor}"

    @web.authenticated
    async def get(self) -> None:
        self.require_admin()
        self.render_panel(saved=self.get_query_argument("saved", ""))

    def render_panel(self, error: str = "", saved: str = "", status: int = 200) -> None:
        identity = self.identity
        assert identity is not None
        with self.controller.store.read() as session:
            projects = project_usage(self.controller, session, identity)
            nodes = node_rows(session)
            gpu_types = sorted({n.gpu_type for n in nodes})
            gpus: dict[str, list[GpuState]] = {}
            for node_name, gpu in session.execute(
                select(Node.name, Gpu).join(Gpu, Gpu.node_id == Node.id).order_by(Gpu.index)
            ):
                if gpu.present:
                    state = "lost" if gpu.lost else _sample_state(gpu.last_sample)
                    gpus.setdefault(node_name, []).append(
                        GpuState(gpu.index, gpu.uuid, gpu.lost, state)
                    )
            queue = list(
                session.scalars(
                    select(Workload)
                    .where(Workload.state == WorkloadState.pending)
                    .order_by(Workload.gpu_type, Workload.queue_position, Workload.id)
                    .options(selectinload(Workload.project))
                    .limit(500)
                )
            )
            events = list(session.scalars(select(Event).order_by(Event.id.desc()).limit(50)))
            priorities = list(
                session.scalars(select(PriorityClass.name).order_by(PriorityClass.rank.desc()))
            )
        self.set_status(status)
        self.finish(
            template.Template(ADMIN_PAGE).generate(
                name=identity.name,
                error=error,
                saved=saved,
                projects=project_rows(projects, gpu_types),
                priorities=priorities,
                nodes=[NodeRow(n, "uncordon" if n.cordoned else "cordon") for n in nodes],
                gpus=gpus,
                base=self.base,
                queue=queue,
                events=events,
                xsrf=self.xsrf_form_html(),
                url_escape=lambda s: quote(s, safe=""),
            )
        )


def _sample_state(sample: dict[str, Any]) -> str:
    if not sample:
        return "ok"
    parts = []
    if "utilization_gpu" in sample:
        parts.append(f"{sample['utilization_gpu']}%")
    if sample.get("temperature_c") is not None:
        parts.append(f"{sample['temperature_c']} °C")
    return " ".join(parts) or "ok"


class AdminProjectForm(AdminPage):
    @web.authenticated
    async def post(self, name: str) -> None:
        by = self.require_admin()
        try:
            edit = edit_from_form(self.request.body_arguments)
            changes = self.controller.store.edit_project(self.controller.now(), name, by, edit)
        except (InvalidRequest, NotFound) as e:
            self.render_panel(error=f"{name}: {e}; nothing was changed", status=400)
            return
        self.controller.kick()
        said = "; ".join(changes) if changes else f"{name}: nothing changed"
        self.redirect(self.panel_url(said, f"project-{quote(name)}"), status=303)


class AdminNodeForm(AdminPage):
    @web.authenticated
    async def post(self, name: str, action: str) -> None:
        by = self.require_admin()
        cordoned = action == "cordon"
        if not self.controller.store.set_cordoned(self.controller.now(), name, cordoned, by):
            self.render_panel(error=f"there is no node {name!r}", status=404)
            return
        self.controller.kick()
        said = f"{name} {'cordoned' if cordoned else 'uncordoned'}"
        self.redirect(self.panel_url(said, "nodes"), status=303)


def admin_routes(prefix: str, controller: Any) -> list[tuple[str, type, dict[str, Any]]]:
    base = prefix.rstrip("/")
    return [
        (rf"{base}/admin", AdminPage, {"controller": controller}),
        (rf"{base}/admin/projects/([^/]+)", AdminProjectForm, {"controller": controller}),
        (
            rf"{base}/admin/nodes/([^/]+)/(cordon|uncordon)",
            AdminNodeForm,
            {"controller": controller},
        ),
    ]
