"""``GET /projects``: the project tree with quotas and live usage.

Admins see every node of the tree (organisations, teams, projects); a researcher sees the
projects they are a member of and the nodes above them (an organisation's cap limits its
projects too). Usage counts the GPUs allocated now in a node and every node under it;
waiting counts the GPUs its own waiting workloads ask for.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import func, select
from sqlalchemy.orm import selectinload

from ...scheduler.store.models import Allocation, Project, Workload, WorkloadState
from .. import scopes
from . import schemas
from .base import APIHandler


class ProjectsHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        await self.controller.refresh_memberships(max_age=5.0)
        store = self.controller.store
        with store.read() as session:
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
                for member_of in store.projects_of(session, identity.name):
                    node = member_of
                    while node is not None and node.id not in visible:
                        visible.add(node.id)
                        node = projects.get(node.parent_id) if node.parent_id else None
            items = [
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
        self.send(schemas.ProjectList(items=items))


def project_routes(api: str) -> list[tuple[str, type]]:
    return [(rf"{api}/projects", ProjectsHandler)]
