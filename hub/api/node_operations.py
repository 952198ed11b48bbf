"""Snapshot passes and restores the node agent of a session's node does
(``scheduler/store/operations.py``).

``POST /workloads/<id>/node-operations``: the hub's spawner (or an admin) asks for one;
``GET /node-operations/<id>``: its state and progress; ``POST /node-operations/<id>/abandon``:
the asker gives up on one no agent has claimed. ``POST /agent/node-operations``: a node
agent reports on what it runs and claims what is pending for its nodes, long-polling
while there is nothing.
"""

from __future__ import annotations

import posixpath
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from ...scheduler.store.operations import Operation
from .. import scopes
from .base import APIHandler, store_errors_as_http
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


def operation_out(operation: Operation) -> NodeOperationOut:
    return NodeOperationOut(
        id=operation.id,
        workload_id=operation.workload_id,
        node=operation.node,
        kind=operation.kind,
        state=operation.state,
        progress=operation.progress,
        result=operation.result,
        error=operation.error,
        updated_at=operation.updated_at,
    )


class WorkloadNodeOperationsHandler(APIHandler):
    async def post(self, workload_id: str) -> None:
        self.require(scopes.SPAWN)
        body = self.body(NodeOperationIn)
        wid = self.path_id(workload_id)
        request = body.model_dump(exclude={"kind"})
        with store_errors_as_http():
            made = self.controller.store.request_node_operation(
                self.controller.now(), wid, body.kind, request
            )
        self.controller.notifier.changed([wid])  # wakes the agents' long polls
        self.send(operation_out(made), 201)


class NodeOperationHandler(APIHandler):
    async def get(self, operation_id: str) -> None:
        self.require(scopes.SPAWN)
        with store_errors_as_http():
            found = self.controller.store.node_operation(self.path_id(operation_id))
        self.send(operation_out(found))


class NodeOperationAbandonHandler(APIHandler):
    async def post(self, operation_id: str) -> None:
        self.require(scopes.SPAWN)
        oid = self.path_id(operation_id)
        with store_errors_as_http():
            store = self.controller.store
            store.abandon_node_operation(self.controller.now(), oid, "its asker gave up on it")
            found = store.node_operation(oid)
        self.send(operation_out(found))


class AgentNodeOperationsHandler(APIHandler):
    async def post(self) -> None:
        self.require(scopes.AGENT)
        body = self.body(AgentOperationsIn)
        controller = self.controller
        store = controller.store
        with store_errors_as_http():
            for report in body.reports:
                store.report_node_operation(
                    controller.now(),
                    report.id,
                    state=report.state,
                    progress=report.progress,
                    result=report.result,
                    error=report.error,
                )
            if any(r.state != "running" for r in body.reports):
                controller.kick()  # a maintenance's end may return GPUs
            claimed = store.claim_node_operations(controller.now(), body.nodes)
            if not claimed and body.wait:
                await controller.notifier.wait_for_any_change(body.wait)
                claimed = store.claim_node_operations(controller.now(), body.nodes)
        self.send(
            AgentOperationsOut(
                operations=[
                    AgentOperationOut(**operation_out(o).model_dump(), request=o.request)
                    for o in claimed
                ]
            )
        )


def node_operation_routes(api: str) -> list[tuple[str, Any]]:
    return [
        (rf"{api}/workloads/(\d+)/node-operations", WorkloadNodeOperationsHandler),
        (rf"{api}/node-operations/(\d+)", NodeOperationHandler),
        (rf"{api}/node-operations/(\d+)/abandon", NodeOperationAbandonHandler),
        (rf"{api}/agent/node-operations", AgentNodeOperationsHandler),
    ]
