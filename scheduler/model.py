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
    return ProjectTree(projects)
