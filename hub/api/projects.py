"""``GET /projects``: the project tree with quotas and live usage; ``PATCH
/projects/{name}``: an admin's change to it; ``GET /usage``: GPU-hours per project, user
and week (``?format=csv`` for the export).

Admins see every node of the tree (organisations, teams, projects); a researcher sees the
projects they are a member of and the nodes above them (an organisation's cap limits its
projects too). Usage counts the GPUs allocated now in a node and every node under it;
waiting counts the GPUs its own waiting workloads ask for.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, selectinload
from tornado import web

from ...api import schemas
from ...state.catalogue import projects_of
from ...state.models import Allocation, Project, Workload, WorkloadState
from ...state.projects import UNCHANGED, ProjectEdit, QuotaEdit
from .. import scopes
from ..errors import BadRequest
from ..usage import Span, WeekUsage, to_csv_rows, usage_by_week, week_start
from .base import APIHandler, Identity, store_errors_as_http

if TYPE_CHECKING:
    from ..context import ControllerContext

MAX_WEEKS = 104  # how far back a usage query may reach: two years


class ProjectsHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        await self.controller.refresh_memberships(max_age=5.0)
        with self.controller.store.read() as session:
            items = project_usage(self.controller, session, identity)
        self.send(schemas.ProjectList(items=items))


class ProjectHandler(APIHandler):
    """``PATCH /projects/{name}``: an admin changes quotas, weight, priority or cap."""

    async def patch(self, name: str) -> None:
        identity = self.require(scopes.ADMIN)
        body = self.body(schemas.ProjectEditIn)
        edit = ProjectEdit(
            weight=body.weight,
            default_priority=body.default_priority,
            per_user_gpu_cap=(
                body.per_user_gpu_cap if "per_user_gpu_cap" in body.model_fields_set else UNCHANGED
            ),
            quotas={
                gpu_type: QuotaEdit(q.guaranteed, q.borrow_limit, q.lend_limit)
                for gpu_type, q in body.quotas.items()
            },
        )
        with store_errors_as_http():
            self.controller.store.projects.edit_project(
                self.controller.now(), name, identity.name, edit
            )
        self.controller.kick()  # takes effect on the next cycle: run one now
        with self.controller.store.read() as session:
            items = project_usage(self.controller, session, identity)
        self.send(next(p for p in items if p.name == name))


def project_usage(
    controller: ControllerContext, session: Session, identity: Identity
) -> list[schemas.ProjectUsageOut]:
    """The tree's nodes the caller may see, with quotas and what each uses and waits for."""
    projects = {
        p.id: p
        for p in session.scalars(
            select(Project).options(selectinload(Project.quotas)).order_by(Project.name)
        )
    }
    allocated = Counter[tuple[int, str]]()
    for project_id, gpu_type, count in session.execute(
        select(Allocation.project_id, Allocation.gpu_type, func.count())
        .where(Allocation.closed_at.is_(None))
        .group_by(Allocation.project_id, Allocation.gpu_type)
    ):
        # Each GPU counts in its project and in every node above it.
        node: Project | None = projects.get(project_id)
        while node is not None:
            allocated[(node.id, gpu_type)] += count
            node = projects.get(node.parent_id) if node.parent_id else None
    waiting = Counter[tuple[int, str]]()
    for project_id, gpu_type, gpus in session.execute(
        select(
            Workload.project_id,
            Workload.gpu_type,
            func.sum(Workload.pods * Workload.gpus_per_pod),
        )
        .where(Workload.state == WorkloadState.pending)
        .group_by(Workload.project_id, Workload.gpu_type)
    ):
        waiting[(project_id, gpu_type)] = int(gpus or 0)
    visible = set(projects)
    if not identity.has(scopes.SPAWN):
        visible = set()
        for member_of in projects_of(session, identity.name):
            node = member_of
            while node is not None and node.id not in visible:
                visible.add(node.id)
                node = projects.get(node.parent_id) if node.parent_id else None
    return [
        schemas.ProjectUsageOut(
            name=p.name,
            display_name=p.display_name or p.name,
            kind=p.kind.value,
            parent=projects[p.parent_id].name if p.parent_id in projects else None,
            fair_share_weight=p.fair_share_weight,
            per_user_gpu_cap=p.per_user_gpu_cap,
            default_priority=p.default_priority,
            quotas=[
                schemas.QuotaUsageOut(
                    gpu_type=q.gpu_type,
                    guaranteed=q.guaranteed,
                    borrow_limit=q.borrow_limit,
                    lend_limit=q.lend_limit,
                    used=allocated[(p.id, q.gpu_type)],
                    waiting=waiting[(p.id, q.gpu_type)],
                )
                for q in sorted(p.quotas, key=lambda q: q.gpu_type)
            ],
        )
        for p in projects.values()
        if p.id in visible
    ]


def usage_for(
    controller: ControllerContext, session: Session, identity: Identity, weeks: int
) -> list[WeekUsage]:
    """GPU-hours per project, user and week over the last ``weeks`` weeks (this one
    included): every project's for admins and the spawner, else those of the caller's
    projects, colleagues included (a project's members share its quota)."""
    now = controller.now()
    since = week_start(now) - timedelta(weeks=weeks - 1)
    query = (
        select(Project.name, Allocation.username, Allocation.opened_at, Allocation.closed_at)
        .join(Project, Allocation.project_id == Project.id)
        .where(
            Allocation.opened_at < now,
            or_(Allocation.closed_at.is_(None), Allocation.closed_at > since),
        )
    )
    if not identity.has(scopes.SPAWN):
        mine = [p.id for p in projects_of(session, identity.name)]
        query = query.where(Allocation.project_id.in_(mine))
    spans = (Span(*row) for row in session.execute(query))
    return usage_by_week(spans, since, now)


def finish_with_csv(handler: web.RequestHandler, usage: list[WeekUsage]) -> None:
    """Answer with the usage as a CSV file to download (the API's and the page's)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_csv_rows(usage))
    handler.set_header("Content-Type", "text/csv; charset=utf-8")
    handler.set_header("Content-Disposition", 'attachment; filename="gpufleet-usage.csv"')
    handler.finish(out.getvalue())


class UsageHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        weeks = self.int_argument("weeks", 8, 1, MAX_WEEKS)
        fmt = self.get_query_argument("format", "json")
        if fmt not in ("json", "csv"):
            raise BadRequest(f"format must be json or csv, not {fmt!r}")
        await self.controller.refresh_memberships(max_age=5.0)
        with self.controller.store.read() as session:
            usage = usage_for(self.controller, session, identity, weeks)
        if fmt == "csv":
            finish_with_csv(self, usage)
            return
        self.send(
            schemas.UsageList(
                weeks=weeks,
                items=[
                    schemas.WeekUsageOut(
                        project=u.project, username=u.username, week=u.week, gpu_hours=u.gpu_hours
                    )
                    for u in usage
                ],
            )
        )


def project_routes(api: str) -> list[tuple[str, type]]:
    return [
        (rf"{api}/projects", ProjectsHandler),
        (rf"{api}/projects/([^/]+)", ProjectHandler),
        (rf"{api}/usage", UsageHandler),
    ]
