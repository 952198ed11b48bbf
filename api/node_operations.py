"""The bodies and answers of the node operations: snapshot passes and restores a session's
node agent does, and the maintenance it runs (hub/api/node_operations.py serves them)."""

from __future__ import annotations

import posixpath
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from .schemas import MAX_INT, Name, Strict

MAX_WAIT_S = 30


class NodeOperationIn(Strict):
    """What to snapshot or restore: host paths on the session's node (its hostPath
    volumes), and for a snapshot whether its container's layer is read too."""

    kind: Literal["snapshot", "restore"]
    paths: list[str] = Field(default_factory=list, max_length=16)
    exclude: list[str] = Field(default_factory=list, max_length=256)
    container: bool = Field(
        default=False,
        description="snapshot: also what the container changed outside its volumes (its "
        "overlay upper directory), found by the session's process marker",
    )
    tags: list[Name] = Field(default_factory=list, max_length=8)
    owner: list[Annotated[int, Field(ge=0, le=2**32 - 1)]] | None = Field(
        default=None,
        min_length=2,
        max_length=2,
        description="restore: [uid, gid] of a volume directory the agent makes where none is",
    )

    @field_validator("paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or posixpath.normpath(path) != path:
                raise ValueError(
                    f"{path!r} is not an absolute, normalised path on the node (no '..', "
                    "no trailing '/')"
                )
        return paths


class NodeOperationOut(BaseModel):
    id: int
    workload_id: int | None = Field(
        description="the session it is for; null for maintenance (reset, recycle, diagnose)"
    )
    node: str
    kind: str
    state: str = Field(description="pending|running|done|failed")
    progress: dict[str, Any] | None = Field(
        default=None, description="the latest progress line: phase, done, total"
    )
    result: dict[str, Any] | None = Field(
        default=None,
        description="snapshot: id, name, stats; restore: id, created_at, restored (paths; "
        "empty when nothing was missing)",
    )
    error: str = ""
    updated_at: datetime = Field(
        description="the agent's latest report (every half second while it runs)"
    )


class AgentOperationOut(NodeOperationOut):
    request: dict[str, Any] = Field(
        description="snapshot, restore: project, username, server, marker, paths, exclude, "
        "container, tags; maintenance: scope (node or gpu), uuids, indexes, by"
    )


class OperationReportIn(Strict):
    id: int = Field(ge=1, le=MAX_INT)
    state: Literal["running", "done", "failed"]
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: str = Field(default="", max_length=4000)


class AgentOperationsIn(Strict):
    nodes: list[Name] = Field(max_length=10_000)
    reports: list[OperationReportIn] = Field(default_factory=list, max_length=1000)
    wait: float = Field(default=0, ge=0, le=MAX_WAIT_S)


class AgentOperationsOut(BaseModel):
    operations: list[AgentOperationOut] = Field(
        description="operations of the agent's nodes claimed for it by this call: run them"
    )
