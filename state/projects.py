"""The projects and their quotas: the tree the config declares (``apply_config``), its
members as the hub's groups say (``sync_memberships``), and an admin's changes to it:
quotas per GPU type, fair-share weight, default priority and per-user cap, each with an
audit event.

A change is validated whole before anything is written (``InvalidRequest`` says what to
fix), committed in one fenced transaction, and marks what it changed as edited so the
config file no longer overwrites it (``apply_config``). A quota change is also
checked against the whole tree as it would be after it (``model.guarantees_over_limits``):
it is refused when it takes some node's children's guarantees above what that node may
hold, or further above it than they already were. The scheduler reads the
tree again on its next cycle: a quota change takes effect there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from ..api.events import EventKind
from ..scheduler.errors import InputError, InvalidRequest, NotFound
from ..scheduler.model import (
    OverLimit,
    ProjectTree,
    Quota,
    guarantees_over_limits,
    project_tree,
)
from ..scheduler.model import Project as TreeProject
from .base import Repository, _event
from .models import (
    Gpu,
    Membership,
    PriorityClass,
    Profile,
    Project,
    ProjectKind,
    ProjectQuota,
)

UNCHANGED = object()  # a field the edit leaves as it is


@dataclass(frozen=True)
class QuotaEdit:
    guaranteed: int
    borrow_limit: int | None  # None: may borrow whatever is idle
    lend_limit: int | None  # None: lends all of its unused guarantee


@dataclass(frozen=True)
class ProjectEdit:
    weight: float | None = None
    default_priority: str | None = None
    per_user_gpu_cap: int | object | None = UNCHANGED  # None: no cap
    quotas: Mapping[str, QuotaEdit] = field(default_factory=dict)


class ProjectStore(Repository):
    def apply_config(
        self,
        now: datetime,
        projects: Sequence[Mapping[str, Any]],
        profiles: Sequence[Mapping[str, Any]],
        priority_classes: Sequence[Mapping[str, Any]],
    ) -> None:
        """Create or update the projects, profiles and priority classes the config declares.

        Projects are validated first (``model.project_tree``): nothing is written for a
        declaration that cannot be used. Values an admin changed in the admin panel
        (``edited_at`` set) are left as the admin set them.
        """
        try:
            tree = project_tree(projects)
        except InputError as e:
            raise InvalidRequest(str(e)) from e
        with self._write(now) as session:
            for spec in priority_classes:
                pc = session.get(PriorityClass, spec["name"]) or PriorityClass(name=spec["name"])
                pc.rank = int(spec["rank"])
                pc.preemptible_by_default = bool(spec.get("preemptible", False))
                pc.description = spec.get("description", "")
                session.add(pc)
            by_name = {p.name: p for p in session.scalars(select(Project))}
            for declared in tree:
                project = by_name.get(declared.name) or Project(name=declared.name)
                by_name[project.name] = project
                project.display_name = declared.display_name
                project.kind = ProjectKind(declared.kind)
                project.parent = by_name[declared.parent] if declared.parent else None
                project.hub_group = declared.hub_group
                project.allowed_priorities = list(declared.allowed_priorities)
                if project.edited_at is None:  # else the admin panel's values stand
                    project.default_priority = declared.default_priority
                    project.fair_share_weight = declared.weight
                    project.per_user_gpu_cap = declared.per_user_cap
                session.add(project)
                session.flush()
                quotas = {q.gpu_type: q for q in project.quotas}
                for gpu_type, q in declared.quotas.items():
                    quota = quotas.pop(gpu_type, None) or ProjectQuota(gpu_type=gpu_type)
                    if quota.edited_at is None:
                        quota.guaranteed = q.guaranteed
                        quota.borrow_limit = q.borrow_limit
                        quota.lend_limit = q.lend_limit
                    if quota not in project.quotas:
                        project.quotas.append(quota)
                for stale in quotas.values():
                    if stale.edited_at is None:
                        project.quotas.remove(stale)
            for spec in profiles:
                profile = session.scalar(select(Profile).where(Profile.name == spec["name"]))
                profile = profile or Profile(name=spec["name"])
                profile.display_name = spec.get("display_name", profile.name)
                profile.description = spec.get("description", "")
                profile.environment = spec.get("environment", "")
                profile.cpu_per_gpu = float(spec.get("cpu_per_gpu", 4))
                profile.memory_per_gpu_bytes = int(spec.get("memory_per_gpu_bytes", 32 * 2**30))
                profile.allowed_gpu_types = list(spec.get("gpu_types", []))
                profile.allowed_projects = list(spec.get("projects", []))
                profile.is_default = bool(spec.get("default", False))
                session.add(profile)

    def sync_memberships(self, now: datetime, groups: Mapping[str, Iterable[str]]) -> int:
        """Make each project's members those of its hub group; returns how many changed."""
        changes = 0
        with self._write(now) as session:
            for project in session.scalars(select(Project).options(selectinload(Project.members))):
                wanted = set(groups.get(project.hub_group or project.name, ()))
                have = {m.username: m for m in project.members}
                for username in wanted - have.keys():
                    project.members.append(Membership(username=username))
                    changes += 1
                for username in have.keys() - wanted:
                    project.members.remove(have[username])
                    changes += 1
            if changes:
                _event(
                    session,
                    now,
                    EventKind.MEMBERSHIP_SYNCED,
                    f"{changes} project membership change(s) synced from hub groups",
                )
        return changes

    def edit_project(self, now: datetime, name: str, by: str, edit: ProjectEdit) -> list[str]:
        """Apply ``edit`` to project ``name``; returns the changes as the audit log says them
        (empty when the edit changes nothing)."""
        with self._write(now) as session:
            project = session.scalar(select(Project).where(Project.name == name))
            if project is None:
                raise NotFound(f"there is no project {name!r}")
            _check(session, edit)
            before = _over_limits(session) if edit.quotas else {}
            changes: list[str] = []

            def note(what: str, old: object, new: object) -> bool:
                if old == new:
                    return False
                changes.append(f"{name}: {what} {_shown(old)} → {_shown(new)}")
                return True

            edited = False
            if edit.weight is not None:
                edited |= note("fair-share weight", project.fair_share_weight, edit.weight)
                project.fair_share_weight = edit.weight
            if edit.default_priority is not None:
                edited |= note("default priority", project.default_priority, edit.default_priority)
                project.default_priority = edit.default_priority
            if edit.per_user_gpu_cap is not UNCHANGED:
                cap = edit.per_user_gpu_cap
                assert cap is None or isinstance(cap, int)
                edited |= note("per-user GPU cap", project.per_user_gpu_cap, cap)
                project.per_user_gpu_cap = cap
            if edited:
                project.edited_by, project.edited_at = by, now
            quotas = {q.gpu_type: q for q in project.quotas}
            for gpu_type, wanted in sorted(edit.quotas.items()):
                quota = quotas.get(gpu_type)
                if quota is None:
                    quota = ProjectQuota(gpu_type=gpu_type, guaranteed=0)
                    project.quotas.append(quota)
                    changes.append(f"{name}: new quota for {gpu_type}")
                    quota_edited = True
                else:
                    quota_edited = False
                for what, old, new in (
                    ("guaranteed", quota.guaranteed, wanted.guaranteed),
                    ("borrow limit", quota.borrow_limit, wanted.borrow_limit),
                    ("lend limit", quota.lend_limit, wanted.lend_limit),
                ):
                    quota_edited |= note(f"{gpu_type} {what}", old, new)
                quota.guaranteed = wanted.guaranteed
                quota.borrow_limit = wanted.borrow_limit
                quota.lend_limit = wanted.lend_limit
                if quota_edited:
                    quota.edited_by, quota.edited_at = by, now
            if edit.quotas:
                session.flush()
                for key, over in _over_limits(session).items():
                    # One the tree had before (the config and earlier edits together) may
                    # stay while this edit does not make it worse: it can be mended in steps.
                    if key not in before or over.excess > before[key].excess:
                        raise InvalidRequest(over.message)
            for change in changes:
                _event(session, now, EventKind.PROJECT_EDITED, f"{change} (by {by})", cause=by)
            return changes


def _check(session: Session, edit: ProjectEdit) -> None:
    if edit.weight is not None and not edit.weight > 0:
        raise InvalidRequest(f"the fair-share weight must be above 0, not {edit.weight}")
    if edit.default_priority is not None:
        known = set(session.scalars(select(PriorityClass.name)))
        if edit.default_priority not in known:
            raise InvalidRequest(
                f"unknown priority class {edit.default_priority!r}; choose one of: "
                f"{', '.join(sorted(known))}"
            )
    cap = edit.per_user_gpu_cap
    if cap is not UNCHANGED and cap is not None and (not isinstance(cap, int) or cap < 1):
        raise InvalidRequest(f"the per-user GPU cap must be at least 1 (or none), not {cap}")
    if edit.quotas:
        types = set(session.scalars(select(Gpu.gpu_type).distinct()))
        types |= set(session.scalars(select(ProjectQuota.gpu_type).distinct()))
    for gpu_type, q in edit.quotas.items():
        if gpu_type not in types:
            raise InvalidRequest(
                f"unknown GPU type {gpu_type!r}; this fleet has: {', '.join(sorted(types))}"
            )
        for what, value in (
            ("guaranteed", q.guaranteed),
            ("borrow limit", q.borrow_limit),
            ("lend limit", q.lend_limit),
        ):
            if value is not None and value < 0:
                raise InvalidRequest(f"{gpu_type}: the {what} must be 0 or more, not {value}")
        if q.lend_limit is not None and q.lend_limit > q.guaranteed:
            raise InvalidRequest(
                f"{gpu_type}: a project lends only from its guarantee; the lend limit "
                f"({q.lend_limit}) cannot exceed the guarantee ({q.guaranteed})"
            )


def _over_limits(session: Session) -> dict[tuple[str, str], OverLimit]:
    """The tree's nodes whose children's guarantees exceed what they may hold, by (node,
    GPU type), as the session sees the tree now (edits not yet committed included)."""
    projects = session.scalars(select(Project).options(selectinload(Project.quotas))).all()
    names = {p.id: p.name for p in projects}
    tree = ProjectTree(
        {
            p.name: TreeProject(
                name=p.name,
                parent=names.get(p.parent_id) if p.parent_id else None,
                kind=p.kind.value,
                quotas={
                    q.gpu_type: Quota(q.guaranteed, q.borrow_limit, q.lend_limit) for q in p.quotas
                },
            )
            for p in projects
        }
    )
    return {(o.name, o.gpu_type): o for o in guarantees_over_limits(tree)}


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
