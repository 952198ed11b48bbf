"""What the fleet and job commands print alike: JSON lists, the project tree's order."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .api.jobs import JobOut
    from .api.schemas import ProjectUsageOut


def job_state(job: JobOut) -> str:
    """A job's state in a word or two: its outcome once ended, its attempt after a restart."""
    state = (job.outcome if job.state == "ended" else job.state) or ""
    return f"{state} (attempt {job.attempt})" if job.attempt > 1 else state


def print_json(items: Sequence[BaseModel]) -> int:
    print(json.dumps([item.model_dump(mode="json") for item in items], indent=2))
    return 0


def tree_order(projects: Sequence[ProjectUsageOut]) -> list[tuple[str, ProjectUsageOut]]:
    """Each node under its parent, labelled with its name indented by its depth."""
    parents = {p.name: p.parent for p in projects}
    paths = {name: _path(name, parents) for name in parents}
    ordered = []
    for p in sorted(projects, key=lambda p: paths[p.name]):
        kind = "" if p.kind == "project" else f" ({p.kind})"
        ordered.append(("  " * (len(paths[p.name]) - 1) + p.name + kind, p))
    return ordered


def _path(name: str, parents: dict[str, str | None]) -> tuple[str, ...]:
    """A node's names from the root down: sorting by it lists each node under its parent."""
    path = [name]
    up = parents[name]
    while up is not None and up in parents:
        path.append(up)
        up = parents[up]
    return tuple(reversed(path))
