"""Snapshot passes and restores the node agent of a session's node does
(``state/operations.py``).

``POST /workloads/<id>/node-operations``: the hub's spawner (or an admin) asks for one;
``GET /node-operations/<id>``: its state and progress; ``POST /node-operations/<id>/abandon``:
the asker gives up on one no agent has claimed. ``POST /agent/node-operations``: a node
agent reports on what it runs and claims what is pending for its nodes, long-polling
while there is nothing.
"""

from __future__ import annotations

from typing import Any

from ...api.node_operations import (
    AgentOperationOut,
    AgentOperationsIn,
    AgentOperationsOut,
    NodeOperationIn,
    NodeOperationOut,
)
from ...state.operations import Operation
from .. import scopes
from .base import APIHandler, store_errors_as_http


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
            made = self.controller.store.node_operations.request_node_operation(
                self.controller.now(), wid, body.kind, request
            )
        self.controller.notifier.changed([wid])  # wakes the agents' long polls
        self.send(operation_out(made), 201)


class NodeOperationHandler(APIHandler):
    async def get(self, operation_id: str) -> None:
        self.require(scopes.SPAWN)
        with store_errors_as_http():
            found = self.controller.store.node_operations.node_operation(self.path_id(operation_id))
        self.send(operation_out(found))


class NodeOperationAbandonHandler(APIHandler):
    async def post(self, operation_id: str) -> None:
        self.require(scopes.SPAWN)
        oid = self.path_id(operation_id)
        with store_errors_as_http():
            store = self.controller.store
            store.node_operations.abandon_node_operation(
                self.controller.now(), oid, "its asker gave up on it"
            )
            found = store.node_operations.node_operation(oid)
        self.send(operation_out(found))


class AgentNodeOperationsHandler(APIHandler):
    async def post(self) -> None:
        self.require(scopes.AGENT)
        body = self.body(AgentOperationsIn)
        controller = self.controller
        store = controller.store
        with store_errors_as_http():
            for report in body.reports:
                store.node_operations.report_node_operation(
                    controller.now(),
                    report.id,
                    state=report.state,
                    progress=report.progress,
                    result=report.result,
                    error=report.error,
                )
            if any(r.state != "running" for r in body.reports):
                controller.kick()  # a maintenance's end may return GPUs
            claimed = store.node_operations.claim_node_operations(controller.now(), body.nodes)
            if not claimed and body.wait:
                await controller.notifier.wait_for_any_change(body.wait)
                claimed = store.node_operations.claim_node_operations(controller.now(), body.nodes)
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
