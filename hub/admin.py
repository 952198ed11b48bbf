"""The admin panel (``/services/gpufleet/admin``, admins only): the project tree with its
quotas and live usage, editable (an organisation or team counts what its projects hold,
against its limit, as the scheduler does); the nodes with each GPU's utilisation and
holder, to cordon, uncordon, drain now or at a time, or recycle; the recovery loop's open
breakers, to reset, and its lemon list, to clear; the queue with each workload's reason;
the latest events.

Plain HTML forms posted back here (with the XSRF token), drawn in the hub's page
(``templates/gpufleet-admin.html``), so nothing is built at install and nothing but the
browser runs. Every change goes through the store as the API's does
(``edit_project``, ``set_cordoned``): validated whole, audited in the event log, in
effect from the next scheduling cycle, which it starts at once. A refused change shows
the form again with the store's message and nothing written. A drain at a time is the
same timed job ``POST /nodes/{name}/drain`` with ``at`` schedules (``timed.py``).

Cordon, Drain and Recycle ask the browser for a confirmation first (a ``confirm()``
dialog; dismissed, nothing is posted). That script is the panel's only one: without it
the forms post at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload
from tornado import web

from ..api.schemas import NodeOut, ProjectUsageOut
from ..output import tree_order
from ..scheduler.errors import InvalidRequest, NotFound
from ..scheduler.model import Project as TreeProject
from ..scheduler.model import ProjectTree, Quota
from ..scheduler.quota import QuotaLimits
from ..state.models import (
    Allocation,
    Event,
    Gpu,
    Node,
    PriorityClass,
    Project,
    Workload,
    WorkloadState,
)
from ..state.projects import UNCHANGED, ProjectEdit, QuotaEdit
from .api.handlers import node_rows
from .api.projects import project_usage
from .errors import ClusterUnavailable
from .pages import PageHandler, project_label, when_text
from .timed import TimedJob, TimedWork, drain_node
from .timed import when as drain_time

T = TypeVar("T")
GIB = 2**30
MAX_REASON = 500  # as the API's DrainIn takes


@dataclass(frozen=True)
class TreeUse:
    """One node of the project tree and one GPU type, counted as the scheduler counts them
    (``scheduler/quota.py``)."""

    used: int  # GPUs allocated now in the node and every node under it
    waiting: int  # GPUs the waiting workloads of the node and every node under it ask for
    guaranteed: int  # an inner node's: the larger of what it declares and its children's sum
    cap: int | None  # the most its subtree may hold; None: no cap (no borrow limit)


NOTHING = TreeUse(used=0, waiting=0, guaranteed=0, cap=None)


def tree_use(
    projects: Sequence[ProjectUsageOut],
    held: Mapping[tuple[str, str], int],
    waiting: Mapping[tuple[str, str], int],
) -> dict[tuple[str, str], TreeUse]:
    """Per (tree node, GPU type): what its subtree holds and waits for, by ``held`` and
    ``waiting`` per (project, GPU type), against its guarantee and cap. A node appears
    for every type it declares or its subtree uses, asks for or is guaranteed."""
    names = {p.name for p in projects}
    parent = {p.name: p.parent if p.parent in names else None for p in projects}
    limits = QuotaLimits(
        ProjectTree(
            {
                p.name: TreeProject(
                    name=p.name,
                    parent=parent[p.name],
                    quotas={
                        q.gpu_type: Quota(q.guaranteed, q.borrow_limit, q.lend_limit)
                        for q in p.quotas
                    },
                )
                for p in projects
            }
        )
    )
    used: Counter[tuple[str, str]] = Counter()
    asked: Counter[tuple[str, str]] = Counter()
    for counts, into in ((held, used), (waiting, asked)):
        for (project, gpu_type), gpus in counts.items():
            node: str | None = project if project in names else None
            while node is not None:
                into[(node, gpu_type)] += gpus
                node = parent[node]
    keys = set(used) | set(asked) | set(limits.guaranteed_of) | set(limits.caps)
    keys |= {(p.name, q.gpu_type) for p in projects for q in p.quotas}
    caps = limits.caps
    return {
        key: TreeUse(
            used=used[key],
            waiting=asked[key],
            guaranteed=limits.guaranteed_of.get(key, 0),
            cap=int(caps[key]) if key in caps else None,
        )
        for key in keys
    }


@dataclass(frozen=True)
class QuotaRow:
    gpu_type: str
    field: str  # the form fields' prefix
    use: TreeUse
    percent: int  # of the bar: used over guaranteed, capped at 100
    guaranteed_input: str
    borrow_input: str
    lend_input: str

    @property
    def borrowing(self) -> bool:
        return self.use.used > self.use.guaranteed

    @property
    def cap_text(self) -> str:
        return "no cap" if self.use.cap is None else f"cap {self.use.cap}"


@dataclass(frozen=True)
class ProjectRow:
    label: str  # its display name (its kind and name are shown beside it)
    depth: int  # in the tree: 0 for a root
    project: ProjectUsageOut
    quotas: list[QuotaRow]
    inner: bool  # an organisation or team: its numbers are its projects' sums


@dataclass(frozen=True)
class Holder:
    """The workload that holds a GPU now."""

    workload_id: int
    kind: str  # session or job
    username: str
    name: str  # a job's name, a named server's name; "" for a default server

    @property
    def text(self) -> str:
        what = f"{self.kind} {self.name}" if self.name else self.kind
        return f"{self.username} · {what} #{self.workload_id}"


@dataclass(frozen=True)
class GpuState:
    index: int
    uuid: str
    lost: bool
    state: str  # its latest reading, or "lost"; then "cordoned" or "lemon"
    sampled_at: datetime | None
    holder: Holder | None


@dataclass(frozen=True)
class NodeRow:
    node: NodeOut
    action: str  # what its cordon button does: cordon or uncordon
    gpu_states: list[GpuState]  # by index (``gpus`` is the node's count)
    drains: list[TimedJob]  # drains scheduled for later, soonest first

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


def project_rows(
    projects: list[ProjectUsageOut],
    gpu_types: list[str],
    held: Mapping[tuple[str, str], int] | None = None,
    waiting: Mapping[tuple[str, str], int] | None = None,
) -> list[ProjectRow]:
    """Each node of the tree under its parent, with a row per GPU type of the fleet (a type
    it has no quota for shows empty inputs: filling them adds one). ``held`` and
    ``waiting``: GPUs per (project, GPU type) allocated now and asked for by waiting
    workloads; an organisation's or team's row shows its subtree's sums."""
    use = tree_use(projects, held or {}, waiting or {})
    parents = {p.parent for p in projects}
    rows = []
    for label, p in tree_order(projects):
        have = {q.gpu_type: q for q in p.quotas}
        types = set(gpu_types) | set(have) | {t for name, t in use if name == p.name}
        quotas = []
        for gpu_type in sorted(types):
            q = have.get(gpu_type)
            counted = use.get((p.name, gpu_type), NOTHING)
            if counted.guaranteed:
                percent = min(100, round(100 * counted.used / counted.guaranteed))
            else:
                percent = 100 if counted.used else 0
            quotas.append(
                QuotaRow(
                    gpu_type=gpu_type,
                    field=f"quota-{gpu_type}",
                    use=counted,
                    percent=percent,
                    guaranteed_input=str(q.guaranteed) if q else "",
                    borrow_input="" if q is None or q.borrow_limit is None else str(q.borrow_limit),
                    lend_input="" if q is None or q.lend_limit is None else str(q.lend_limit),
                )
            )
        depth = (len(label) - len(label.lstrip())) // 2
        rows.append(ProjectRow(project_label(p), depth, p, quotas, p.name in parents))
    return rows


def gpu_reading(sample: Mapping[str, Any]) -> str:
    """A GPU's latest sample in a few words: utilisation, memory, temperature (what the
    GPU does not report is left out); "no sample yet" before the first."""
    parts = []
    if sample.get("utilization_gpu_pct") is not None:
        parts.append(f"{sample['utilization_gpu_pct']}% util")
    used, total = sample.get("memory_used_bytes"), sample.get("memory_total_bytes")
    if used is not None and total:
        parts.append(f"{used / GIB:.0f}/{total / GIB:.0f} GiB")
    if sample.get("temperature_c") is not None:
        parts.append(f"{sample['temperature_c']} °C")
    if parts:
        return " · ".join(parts)
    return "no readings" if sample else "no sample yet"


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
            held, waiting = _project_counts(session)
            nodes = node_rows(session, self.controller.spare_nodes)
            gpus = _gpu_states(session)
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
        unreachable = [
            c for c in self.controller.store.clusters.cluster_statuses() if not c.reachable
        ]
        breakers = {c: at for c, at in self.controller.store.jobs.breakers().items() if at}
        lemons = [(node.name, uuid) for node in nodes for uuid in node.lemon_gpus]
        drains = scheduled_drains(self.controller.timed)
        self.render_page(
            "gpufleet-admin.html",
            title="gpufleet admin",
            section="admin",
            status=status,
            error=error,
            saved=saved,
            projects=project_rows(projects, sorted({n.gpu_type for n in nodes}), held, waiting),
            priorities=priorities,
            nodes=[
                NodeRow(
                    n,
                    "uncordon" if n.cordoned else "cordon",
                    gpus.get(n.name, []),
                    drains.get(n.name, []),
                )
                for n in nodes
            ],
            unreachable=unreachable,
            breakers=breakers,
            lemons=lemons,
            queue=queue,
            events=events,
        )


def _project_counts(
    session: Session,
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """GPUs per (project, GPU type): allocated now, and asked for by waiting workloads."""
    held = {
        (project, gpu_type): int(count)
        for project, gpu_type, count in session.execute(
            select(Project.name, Allocation.gpu_type, func.count())
            .join(Project, Allocation.project_id == Project.id)
            .where(Allocation.closed_at.is_(None))
            .group_by(Project.name, Allocation.gpu_type)
        )
    }
    waiting = {
        (project, gpu_type): int(gpus or 0)
        for project, gpu_type, gpus in session.execute(
            select(Project.name, Workload.gpu_type, func.sum(Workload.pods * Workload.gpus_per_pod))
            .join(Project, Workload.project_id == Project.id)
            .where(Workload.state == WorkloadState.pending)
            .group_by(Project.name, Workload.gpu_type)
        )
    }
    return held, waiting


def _gpu_states(session: Session) -> dict[str, list[GpuState]]:
    """Each node's present GPUs, by index: the latest sample's reading and the workload
    holding each (one open allocation per GPU at most: a unique index keeps it so)."""
    holders = {
        uuid: Holder(wid, kind.value, username, name or server_name)
        for uuid, wid, kind, username, name, server_name in session.execute(
            select(
                Allocation.gpu_uuid,
                Workload.id,
                Workload.kind,
                Workload.username,
                Workload.name,
                Workload.server_name,
            )
            .join(Workload, Allocation.workload_id == Workload.id)
            .where(Allocation.closed_at.is_(None))
        )
    }
    gpus: dict[str, list[GpuState]] = {}
    for node_name, gpu in session.execute(
        select(Node.name, Gpu).join(Gpu, Gpu.node_id == Node.id).order_by(Gpu.index)
    ):
        if not gpu.present:
            continue
        state = "lost" if gpu.lost else gpu_reading(gpu.last_sample or {})
        if gpu.lemon:
            state += ", lemon"
        elif gpu.cordoned:
            state += ", cordoned"
        gpus.setdefault(node_name, []).append(
            GpuState(gpu.index, gpu.uuid, gpu.lost, state, gpu.sampled_at, holders.get(gpu.uuid))
        )
    return gpus


def scheduled_drains(timed: TimedWork) -> dict[str, list[TimedJob]]:
    """The drains scheduled for later, by node, soonest first."""
    drains: dict[str, list[TimedJob]] = {}
    for job in timed.scheduler.get_jobs():
        if job.func is drain_node and job.args:
            at = getattr(job, "next_run_time", None)
            drains.setdefault(str(job.args[0]), []).append(TimedJob(job.id, job.name, at))
    for jobs in drains.values():
        jobs.sort(key=lambda j: j.at.timestamp() if j.at else math.inf)
    return drains


class AdminProjectForm(AdminPage):
    @web.authenticated
    async def post(self, name: str) -> None:
        by = self.require_admin()
        try:
            edit = edit_from_form(self.request.body_arguments)
            changes = self.controller.store.projects.edit_project(
                self.controller.now(), name, by, edit
            )
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


class AdminDrainForm(AdminNodeForm):
    """Drain a node now, or schedule its drain (``at``: HH:MM, the next such time in UTC,
    or an ISO date and time), as ``POST /nodes/{name}/drain`` does."""

    @web.authenticated
    async def post(self, name: str) -> None:
        by = self.require_admin()
        at_text = self.get_body_argument("at", "").strip()
        reason = self.get_body_argument("reason", "").strip() or "asked on the admin panel"
        if len(reason) > MAX_REASON:
            self.render_panel(
                error=f"{name}: the reason is {len(reason)} characters; shorten it to "
                f"{MAX_REASON} or fewer; nothing was done",
                status=400,
            )
            return
        if not at_text:
            done = await self.on_node(name, self.controller.drain(name, by, reason))
            if done is None:
                return
            said = (
                f"{name} is draining: cordoned, its jobs restart elsewhere and its sessions "
                "are snapshotted and stop"
            )
            self.redirect(self.panel_url(said, "nodes"), status=303)
            return
        with self.controller.store.read() as session:
            known = session.scalar(select(Node.id).where(Node.name == name)) is not None
        if not known:
            self.render_panel(error=f"there is no node {name!r}", status=404)
            return
        try:
            at = drain_time(at_text, self.controller.now())
        except ValueError as e:
            self.render_panel(error=f"{name}: {e}; nothing was scheduled", status=400)
            return
        self.controller.timed.schedule_drain(name, by, reason, at)
        said = f"{name} will be drained at {when_text(at)}"
        self.redirect(self.panel_url(said, "nodes"), status=303)


class AdminTimedForm(AdminPage):
    """Cancel a drain scheduled for later, as ``DELETE /timed/{id}`` does."""

    @web.authenticated
    async def post(self, job_id: str) -> None:
        self.require_admin()
        timed = self.controller.timed
        drains = [j for jobs in scheduled_drains(timed).values() for j in jobs]
        job = next((j for j in drains if j.id == job_id), None)
        if job is None or not timed.cancel(job_id):
            self.render_panel(error=f"there is no scheduled drain {job_id!r}", status=404)
            return
        self.redirect(self.panel_url(f"cancelled: {job.what}", "nodes"), status=303)


class AdminRecoveryForm(AdminPage):
    """Reset a cluster's recovery breaker, or take a GPU off the lemon list."""

    @web.authenticated
    async def post(self, what: str, name: str) -> None:
        by = self.require_admin()
        store, now = self.controller.store, self.controller.now()
        try:
            if what == "breakers":
                done = store.jobs.reset_breaker(now, name, by)
                said = f"the recovery breaker of {name} is closed" if done else f"{name}: closed"
            else:
                done = store.jobs.clear_lemon(now, name, by)
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
        (rf"{base}/admin/nodes/([^/]+)/drain", AdminDrainForm, {"controller": controller}),
        (rf"{base}/admin/timed/([^/]+)/cancel", AdminTimedForm, {"controller": controller}),
        (
            rf"{base}/admin/(breakers|lemons)/([^/]+)/(?:reset|clear)",
            AdminRecoveryForm,
            {"controller": controller},
        ),
    ]
