"""The fleet model the scheduling core and the simulator reason about (plain, frozen data).

A project tree (organisation → team → project) whose nodes may carry, per GPU type, a
guaranteed quota, a borrow limit and a lend limit; quotas of inner nodes cap their
subtree. Nodes of the fleet sit in a cluster and a zone; a gang is placed inside one
cluster and one zone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError

KINDS = ("organisation", "team", "project")


@dataclass(frozen=True)
class Quota:
    guaranteed: int = 0
    borrow_limit: int | None = None  # None: may borrow whatever is idle
    lend_limit: int | None = None  # None: lends all of its unused guarantee


@dataclass(frozen=True)
class Project:
    name: str
    parent: str | None = None
    kind: str = "project"
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    weight: float = 1.0
    default_priority: str = "standard"
    per_user_cap: int | None = None
    display_name: str = ""
    hub_group: str = ""  # the JupyterHub group whose members are the project's
    allowed_priorities: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProjectTree:
    projects: Mapping[str, Project]

    def __iter__(self) -> Iterator[Project]:
        return iter(self.projects.values())

    def __contains__(self, name: object) -> bool:
        return name in self.projects

    def ancestors(self, name: str) -> tuple[str, ...]:
        """The project's parents, nearest first."""
        chain = []
        parent = self.projects[name].parent
        while parent is not None:
            chain.append(parent)
            parent = self.projects[parent].parent
        return tuple(chain)

    def children(self, name: str) -> tuple[str, ...]:
        return tuple(p.name for p in self.projects.values() if p.parent == name)


@dataclass(frozen=True)
class FleetNode:
    name: str
    cluster: str
    zone: str
    gpu_type: str
    gpus: int
    labels: Mapping[str, str] = field(default_factory=dict)


def _whole(value: object, what: str, minimum: int = 0, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{what} must be a whole number of at least {minimum}, not {value!r}")
    return value


def project_tree(specs: Sequence[Mapping[str, Any]]) -> ProjectTree:
    """Validate project declarations (the ``c.FleetController.projects`` / projects-file
    shape: name, parent, kind, quotas, weight, default_priority, per_user_gpu_cap,
    display_name, hub_group, allowed_priorities).

    Parents come before their children; every error names the project and what to fix.
    """
    projects: dict[str, Project] = {}
    for spec in specs:
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InputError(f"a project needs a name: {dict(spec)!r}")
        if name in projects:
            raise InputError(f"project {name!r} is declared twice")
        parent = spec.get("parent")
        if parent is not None and parent not in projects:
            raise InputError(
                f"project {name!r} names parent {parent!r}, which is not declared before it"
            )
        kind = spec.get("kind", "project")
        if kind not in KINDS:
            raise InputError(f"project {name!r}: kind must be one of {', '.join(KINDS)}")
        raw_quotas = spec.get("quotas") or {}
        if not isinstance(raw_quotas, Mapping):
            raise InputError(f"project {name!r}: quotas must map GPU types to quotas")
        quotas = {}
        for gpu_type, q in raw_quotas.items():
            if not isinstance(q, Mapping):
                raise InputError(f"project {name!r}: the quota for {gpu_type} must be a mapping")
            where = f"project {name!r}, {gpu_type}"
            unknown = set(q) - {"guaranteed", "borrow_limit", "lend_limit"}
            if unknown:
                raise InputError(f"{where}: unknown quota field(s) {', '.join(sorted(unknown))}")
            quotas[str(gpu_type)] = Quota(
                guaranteed=_whole(q.get("guaranteed", 0), f"{where}: guaranteed") or 0,
                borrow_limit=_whole(
                    q.get("borrow_limit"), f"{where}: borrow_limit", allow_none=True
                ),
                lend_limit=_whole(q.get("lend_limit"), f"{where}: lend_limit", allow_none=True),
            )
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise InputError(f"project {name!r}: weight must be a positive number")
        projects[name] = Project(
            name=name,
            parent=parent if isinstance(parent, str) else None,
            kind=str(kind),
            quotas=quotas,
            weight=float(weight),
            default_priority=str(spec.get("default_priority", "standard")),
            per_user_cap=_whole(
                spec.get("per_user_gpu_cap"),
                f"project {name!r}: per_user_gpu_cap",
                minimum=1,
                allow_none=True,
            ),
            display_name=str(spec.get("display_name") or name),
            hub_group=str(spec.get("hub_group") or name),
            allowed_priorities=tuple(str(p) for p in spec.get("allowed_priorities") or ()),
        )
    tree = ProjectTree(projects)
    over = guarantees_over_limits(tree)
    if over:
        raise InputError(over[0].message)
    return tree


@dataclass(frozen=True)
class OverLimit:
    """An inner node whose children's guarantees for a GPU type sum to more than the node
    may hold as declared: its own ``guaranteed`` plus its ``borrow_limit``."""

    name: str
    kind: str
    gpu_type: str
    children: tuple[tuple[str, int], ...]  # (child, its subtree's guarantee), those above 0
    child_kinds: frozenset[str]
    guaranteed: int  # as the node declares it
    borrow_limit: int

    @property
    def total(self) -> int:
        return sum(g for _, g in self.children)

    @property
    def limit(self) -> int:
        return self.guaranteed + self.borrow_limit

    @property
    def excess(self) -> int:
        return self.total - self.limit

    @property
    def message(self) -> str:
        whose = " and ".join(f"{k}s'" for k in KINDS if k in self.child_kinds)
        parts = ", ".join(f"{c} {g}" for c, g in self.children)
        return (
            f"{self.kind} {self.name}: its {whose} guarantees for {self.gpu_type} sum to "
            f"{self.total} ({parts}), more than the {self.limit} × {self.gpu_type} the "
            f"{self.kind} may hold (guaranteed {self.guaranteed} + borrow_limit "
            f"{self.borrow_limit}); lower a guarantee or raise the {self.kind}'s limit"
        )


def guarantees_over_limits(tree: ProjectTree) -> list[OverLimit]:
    """Every inner node and GPU type where the children's guarantees sum to more than the
    node may hold as declared, ``guaranteed + borrow_limit`` of the node itself (not the
    larger guarantee that ``quota.QuotaLimits`` derives from the children).

    A child's guarantee is its subtree's: the larger of what it declares and its own
    children's sum, so each level (organisation → team → project) is checked against
    the one above. A node without a borrow limit for a type has no cap for it; one that
    declares no guarantee (0) is guaranteed its children's sum, its cap that sum plus its
    borrow limit, which they cannot exceed. In the tree's order, then by GPU type.
    """
    children: dict[str, list[str]] = {name: [] for name in tree.projects}
    for p in tree.projects.values():
        if p.parent is not None:
            children[p.parent].append(p.name)
    subtree: dict[str, dict[str, int]] = {}
    for name in _bottom_up(tree, children):
        own = {t: q.guaranteed for t, q in tree.projects[name].quotas.items()}
        if children[name]:
            total: dict[str, int] = {}
            for child in children[name]:
                for t, g in subtree[child].items():
                    total[t] = total.get(t, 0) + g
            for t, g in own.items():
                total[t] = max(total.get(t, 0), g)
            own = total
        subtree[name] = own
    found = []
    for project in tree.projects.values():
        if not children[project.name]:
            continue
        for gpu_type, quota in sorted(project.quotas.items()):
            if quota.borrow_limit is None or quota.guaranteed == 0:
                continue  # no declared guarantee: it is the children's sum, the cap above it
            over = OverLimit(
                project.name,
                project.kind,
                gpu_type,
                tuple(
                    (c, subtree[c][gpu_type])
                    for c in children[project.name]
                    if subtree[c].get(gpu_type, 0) > 0
                ),
                frozenset(tree.projects[c].kind for c in children[project.name]),
                quota.guaranteed,
                quota.borrow_limit,
            )
            if over.excess > 0:
                found.append(over)
    return found


def _bottom_up(tree: ProjectTree, children: Mapping[str, Sequence[str]]) -> list[str]:
    """Every node after all of its children, whatever order the tree lists them in."""
    order: list[str] = []
    stack = [p.name for p in tree.projects.values() if p.parent not in tree.projects]
    while stack:
        name = stack.pop()
        order.append(name)
        stack.extend(children[name])
    return order[::-1]
