"""What the fleet offers a user: their projects, and the GPU types with the most GPUs one
node and one zone hold (``validation.Catalogue``). Read by session and job requests alike
(``WorkloadStore``, ``JobStore``), and by the spawn page's options: functions of an open
session, so each reads within its caller's transaction."""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..scheduler.validation import Catalogue, ProfileRule
from .models import Gpu, Membership, Node, PriorityClass, Profile, Project, ProjectKind


def projects_of(session: Session, username: str) -> list[Project]:
    return list(
        session.scalars(
            select(Project)
            .join(Membership)
            .where(Membership.username == username, Project.kind == ProjectKind.project)
            .order_by(Project.name)
        )
    )


def catalogue_of(session: Session, username: str) -> Catalogue:
    largest: dict[str, int] = defaultdict(int)
    in_zone: dict[tuple[str, int], int] = defaultdict(int)
    rows = session.execute(
        select(Node.zone_id, Gpu.node_id, Gpu.gpu_type, func.count())
        .join(Node, Gpu.node_id == Node.id)
        .where(Gpu.present.is_(True))
        .group_by(Node.zone_id, Gpu.node_id, Gpu.gpu_type)
    )
    for zone_id, _node_id, gpu_type, count in rows:
        largest[gpu_type] = max(largest[gpu_type], count)
        in_zone[gpu_type, zone_id] += count
    largest_zone: dict[str, int] = defaultdict(int)
    for (gpu_type, _zone_id), count in in_zone.items():
        largest_zone[gpu_type] = max(largest_zone[gpu_type], count)
    profiles = {
        p.name: ProfileRule(tuple(p.allowed_gpu_types), tuple(p.allowed_projects), p.is_default)
        for p in session.scalars(select(Profile).order_by(Profile.name))
    }
    return Catalogue(
        largest_node=dict(largest),
        user_projects=frozenset(p.name for p in projects_of(session, username)),
        profiles=profiles,
        largest_zone=dict(largest_zone),
        priority_classes=frozenset(session.scalars(select(PriorityClass.name))),
    )
