"""The admin panel (``/services/gpufleet/admin``, admins only): the project tree with its
quotas and live usage, editable; the nodes with their GPUs' health, to cordon,
uncordon or recycle; the recovery loop's open breakers, to reset, and its lemon list, to clear; the
queue with each workload's reason; the latest events.

Plain HTML forms posted back here (with the XSRF token), drawn in the hub's page
(``templates/gpufleet-admin.html``), so nothing is built at install and nothing but the
browser runs. Every change goes through the store as the API's does
(``edit_project``, ``set_cordoned``): validated whole, audited in the event log, in
effect from the next scheduling cycle, which it starts at once. A refused change shows
the form again with the store's message and nothing written.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from sqlalchemy import select
from sqlalchemy.orm import selectinload
from tornado import web

from ..output import tree_order
from ..scheduler.errors import InvalidRequest, NotFound
from ..scheduler.store.models import Event, Gpu, Node, PriorityClass, Workload, WorkloadState
from ..scheduler.store.projects import UNCHANGED, ProjectEdit, QuotaEdit
from .api.handlers import node_rows
from .api.projects import project_usage
from .api.schemas import NodeOut, ProjectUsageOut
from .errors import ClusterUnavailable
from .pages import PageHandler, project_label

T = TypeVar("T")


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
    label: str  # its display name (its kind and name are shown beside it)
    depth: int  # in the tree: 0 for a root
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
        depth = (len(label) - len(label.lstrip())) // 2
        rows.append(ProjectRow(project_label(p), depth, p, quotas))
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
            nodes = node_rows(session, self.controller.spare_nodes)
            gpu_types = sorted({n.gpu_type for n in nodes})
            gpus: dict[str, list[GpuState]] = {}
            for node_name, gpu in session.execute(
                select(Node.name, Gpu).join(Gpu, Gpu.node_id == Node.id).order_by(Gpu.index)
            ):
                if gpu.present:
                    state = "lost" if gpu.lost else _sample_state(gpu.last_sample)
                    if gpu.lemon:
                        state += ", lemon"
                    elif gpu.cordoned:
                        state += ", cordoned"
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
        unreachable = [c for c in self.controller.store.cluster_statuses() if not c.reachable]
        breakers = {c: at for c, at in self.controller.store.breakers().items() if at}
        lemons = [(node.name, uuid) for node in nodes for uuid in node.lemon_gpus]
        self.render_page(
            "gpufleet-admin.html",
            title="gpufleet admin",
            section="admin",
            status=status,
            error=error,
            saved=saved,
            projects=project_rows(projects, gpu_types),
            priorities=priorities,
            nodes=[NodeRow(n, "uncordon" if n.cordoned else "cordon") for n in nodes],
            gpus=gpus,
            unreachable=unreachable,
            breakers=breakers,
            lemons=lemons,
            queue=queue,
            events=events,
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
    async def on_node(self, name: str, action: Awaitable[T]) -> T | Literal[True] | None:
        """Run an action on node ``name``: its result (True for one that returns none),
        or None once the panel says why it could not be done."""
        try:
            result = await action
        except NotFound:
            self.render_panel(error=f"there is no node {name!r}", status=404)
            return None
        except ClusterUnavailable as e:
            self.render_panel(error=f"{name}: {e}; nothing was changed", status=503)
            return None
        return True if result is None else result

    @web.authenticated
    async def post(self, name: str, action: str) -> None:
        by = self.require_admin()
        cordoned = action == "cordon"
        changed = await self.on_node(name, self.controller.cordon(name, cordoned, by))
        if changed is None:
            return
        self.controller.kick()
        verb = "cordoned" if cordoned else "uncordoned"
        said = f"{name} {verb}" if changed else f"{name} was already {verb}"
        self.redirect(self.panel_url(said, "nodes"), status=303)


class AdminRecycleForm(AdminNodeForm):
    """Recycle a node: drained, recycled once empty, then diagnosed (docs/recovery.md)."""

    @web.authenticated
    async def post(self, name: str) -> None:
        by = self.require_admin()
        done = await self.on_node(
            name, self.controller.recycle(name, by, "asked on the admin panel")
        )
        if done is None:
            return
        said = f"{name} is draining; it is recycled once empty, then diagnosed"
        self.redirect(self.panel_url(said, "nodes"), status=303)


class AdminRecoveryForm(AdminPage):
    """Reset a cluster's recovery breaker, or take a GPU off the lemon list."""

    @web.authenticated
    async def post(self, what: str, name: str) -> None:
        by = self.require_admin()
        store, now = self.controller.store, self.controller.now()
        try:
            if what == "breakers":
                done = store.reset_breaker(now, name, by)
                said = f"the recovery breaker of {name} is closed" if done else f"{name}: closed"
            else:
                done = store.clear_lemon(now, name, by)
                said = f"{name} is off the lemon list" if done else f"{name}: not a lemon"
        except NotFound as e:
            self.render_panel(error=str(e), status=404)
            return
        self.controller.kick()
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
        (rf"{base}/admin/nodes/([^/]+)/recycle", AdminRecycleForm, {"controller": controller}),
        (
            rf"{base}/admin/(breakers|lemons)/([^/]+)/(?:reset|clear)",
            AdminRecoveryForm,
            {"controller": controller},
        ),
    ]
