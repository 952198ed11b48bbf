"""Node operations: heavy work a node agent does on its node for a workload.

On Kubernetes a session's files live on its node (hostPath volumes, the container's
layer); neither the hub nor the controller can read them, and the snapshot master key
must never enter a user's pod. So a snapshot pass or a restore is *asked for* here and
*done* by the node agent of the workload's node, which holds the key as the platform
does (``snapshotter/node_operations.py``). The life of one operation:

    pending --(agent claims)--> running --(agent reports)--> done | failed
    pending --(nobody claims in time: the asker gives up)--> failed
    running --(the agent stops reporting: the asker gives up)--> failed

While it runs, the agent reports on it every half second (``updated_at`` moves), so an
agent that died mid-way is told from a long pass.

Invariants: an operation is claimed at most once (the claim is a conditional update:
two agents, or one agent asking twice, cannot both run it); an ended operation never
changes again, so a late report from an agent that was thought gone changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update

from ..scheduler.errors import InvalidRequest, NotFound
from .base import Repository, _get_workload
from .maintenance import settle_operation
from .maintenance_plan import BY_CLUSTER
from .models import Allocation, NodeOperation, WorkloadKind

KINDS = ("snapshot", "restore")
ENDED = ("done", "failed")
KEEP_ENDED = timedelta(days=7)


@dataclass(frozen=True)
class Operation:
    id: int
    workload_id: int | None  # None: maintenance (state/maintenance.py)
    node: str
    kind: str
    request: dict[str, Any]
    state: str
    progress: dict[str, Any] | None
    result: dict[str, Any] | None
    error: str
    updated_at: datetime

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def _operation(row: NodeOperation) -> Operation:
    return Operation(
        row.id,
        row.workload_id,
        row.node,
        row.kind,
        dict(row.request),
        row.state,
        row.progress,
        row.result,
        row.error,
        row.updated_at,
    )


class NodeOperationStore(Repository):
    def request_node_operation(
        self, now: datetime, workload_id: int, kind: str, request: Mapping[str, Any]
    ) -> Operation:
        """Ask the agent of the node the session's GPUs are (or last were) on for
        ``kind``. The workload's owner, server and process marker go with the request:
        the agent finds the container by the marker and files the snapshot under the
        owner."""
        if kind not in KINDS:
            raise InvalidRequest(f"a node operation is one of {', '.join(KINDS)}, not {kind!r}")
        with self._write(now) as session:
            workload = _get_workload(session, workload_id)
            if workload.kind is not WorkloadKind.session:
                raise InvalidRequest(f"workload {workload_id} is not a session")
            latest = session.scalars(
                select(Allocation)
                .where(Allocation.workload_id == workload_id)
                .order_by(Allocation.id.desc())
                .limit(1)
            ).first()
            if latest is None:
                raise InvalidRequest(
                    f"workload {workload_id} has never had GPUs: it is on no node yet"
                )
            row = NodeOperation(
                workload_id=workload_id,
                node=latest.node.name,
                kind=kind,
                request={
                    **request,
                    "project": workload.project.name,
                    "username": workload.username,
                    "server": workload.server_name,
                    "marker": workload.process_marker or "",
                },
                state="pending",
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            # Ended operations are kept a while for whoever looks at them (the result
            # says which snapshot a pass made, the error why it failed), then forgotten.
            session.execute(
                delete(NodeOperation).where(
                    NodeOperation.state.in_(ENDED),
                    NodeOperation.updated_at < now - KEEP_ENDED,
                )
            )
            session.flush()
            return _operation(row)

    def node_operation(self, operation_id: int) -> Operation:
        with self.read() as session:
            row = session.get(NodeOperation, operation_id)
            if row is None:
                raise NotFound(f"there is no node operation {operation_id}")
            return _operation(row)

    def claim_node_operations(
        self, now: datetime, nodes: Sequence[str], by_cluster: bool = False
    ) -> list[Operation]:
        """The pending operations of ``nodes``, now ``running``: the caller runs them. A
        node agent claims those of its nodes; the controller's inventory loop
        (``by_cluster``) those only a cluster can do (a recycle that deletes the Node)."""
        if not nodes:
            return []
        # A read first: a claim with nothing pending (nearly every one) writes nothing.
        with self.read() as session:
            pending = [
                operation_id
                for operation_id, request in session.execute(
                    select(NodeOperation.id, NodeOperation.request)
                    .where(NodeOperation.node.in_(list(nodes)), NodeOperation.state == "pending")
                    .order_by(NodeOperation.id)
                )
                if bool((request or {}).get(BY_CLUSTER)) == by_cluster
            ]
        if not pending:
            return []
        with self._write(now) as session:
            claimed = []
            for operation_id in pending:
                taken = session.execute(
                    update(NodeOperation)
                    .where(NodeOperation.id == operation_id, NodeOperation.state == "pending")
                    .values(state="running", updated_at=now)
                )
                if taken.rowcount == 1:  # type: ignore[attr-defined]
                    claimed.append(operation_id)
            rows = session.scalars(select(NodeOperation).where(NodeOperation.id.in_(claimed))).all()
            return [_operation(r) for r in sorted(rows, key=lambda r: r.id)]

    def report_node_operation(
        self,
        now: datetime,
        operation_id: int,
        *,
        state: str,
        progress: Mapping[str, Any] | None = None,
        result: Mapping[str, Any] | None = None,
        error: str = "",
    ) -> bool:
        """What the agent says of a running operation (``running`` with progress, or its
        end); whether it changed anything (an ended or unknown operation stays as it is)."""
        if state not in ("running", *ENDED):
            raise InvalidRequest(f"an operation is reported running, done or failed, not {state}")
        values: dict[str, Any] = {"state": state, "updated_at": now}
        if progress is not None:
            values["progress"] = dict(progress)
        if result is not None:
            values["result"] = dict(result)
        if error:
            values["error"] = error
        with self._write(now) as session:
            changed = session.execute(
                update(NodeOperation)
                .where(NodeOperation.id == operation_id, NodeOperation.state == "running")
                .values(**values)
            )
            if not changed.rowcount:  # type: ignore[attr-defined]
                return False
            if state in ENDED:
                row = session.get(NodeOperation, operation_id)
                if row is not None:
                    session.refresh(row)
                    settle_operation(session, now, row)
            return True

    def abandon_node_operation(self, now: datetime, operation_id: int, error: str) -> bool:
        """Fail an operation its asker gave up on (nobody claimed it, or its agent stopped
        reporting); False if it ended meanwhile. A later report of it changes nothing."""
        with self._write(now) as session:
            changed = session.execute(
                update(NodeOperation)
                .where(
                    NodeOperation.id == operation_id,
                    NodeOperation.state.in_(("pending", "running")),
                )
                .values(state="failed", error=error, updated_at=now)
            )
            return bool(changed.rowcount)  # type: ignore[attr-defined]
