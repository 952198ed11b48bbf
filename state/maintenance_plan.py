"""Which maintenance a recovery verdict leaves due on a node or a GPU, and what each step
of it is (``state/maintenance.py`` carries it out through the node agents).

A node that fell off (XID 79, a lost GPU, NVML's NODE_REBOOT) is recycled once it is
empty, then diagnosed; a GPU with a hardware XID is reset once nothing holds it; a GPU
blamed twice for an application fault, or an NVLink error, is diagnosed; a degraded GPU
is reset at its next idle point. A pass returns what was taken out to service; a failure
leaves it out, with an event that says why, for a person to decide.

States (``nodes.maintenance``, ``gpus.maintenance``): due — ``recycle``, ``diagnose``,
``reset``, ``reset-at-idle`` — then in flight while the agent runs it — ``recycling``,
``diagnosing``, ``resetting`` — then None.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.classify import HardwareAction, Verdict
from .base import _event
from .models import Gpu, Node

# In a maintenance request: the step is the cluster's to do (the controller deletes the
# Node for its node group to replace), not the node agent's.
BY_CLUSTER = "by_cluster"
# Due -> in flight, and the node operation that does it.
NODE_STEPS = {"recycle": "recycling", "diagnose": "diagnosing"}
GPU_STEPS = {"reset": "resetting", "reset-at-idle": "resetting", "diagnose": "diagnosing"}
OPERATION_OF = {
    "recycle": "recycle",
    "diagnose": "diagnose",
    "reset": "reset",
    "reset-at-idle": "reset",
}
MAINTENANCE_KINDS = ("reset", "recycle", "diagnose")

_GPU_MAINTENANCE = {
    HardwareAction.DRAIN_AND_RESET_GPU: "reset",
    HardwareAction.DIAGNOSE_GPU: "diagnose",
    HardwareAction.DIAGNOSE_LINK: "diagnose",
    HardwareAction.RESET_AT_IDLE: "reset-at-idle",
}


def plan_node_maintenance(session: Session, now: datetime, node: Node, verdict: Verdict) -> None:
    """After the loop cordoned ``node``: a node fault that asks for a recycle gets one."""
    if verdict.hardware is not HardwareAction.RECYCLE_NODE or node.maintenance is not None:
        return
    node.maintenance, node.maintenance_by = "recycle", "recovery"
    _event(
        session,
        now,
        EventKind.NODE_MAINTENANCE_PLANNED,
        f"node {node.name} is recycled once nothing runs there, then diagnosed; it returns "
        "to service if the diagnostics pass",
        reason=verdict.fault.value,
        node=node.name,
        cause="recovery",
    )


def plan_gpu_maintenance(session: Session, now: datetime, gpu: Gpu, verdict: Verdict) -> None:
    """A GPU fault's reset or diagnostics, once nothing holds the GPU."""
    wanted = _GPU_MAINTENANCE.get(verdict.hardware)
    if wanted is None or gpu.maintenance is not None:
        return
    gpu.maintenance = wanted
    if wanted == "reset-at-idle":
        _event(
            session,
            now,
            EventKind.GPU_MAINTENANCE_PLANNED,
            f"GPU {gpu.uuid} (index {gpu.index}) of node {gpu.node.name} is reset at its next "
            f"idle point: {verdict.reason}",
            reason=verdict.fault.value,
            node=gpu.node.name,
            cause="recovery",
            data={"uuid": gpu.uuid, "index": gpu.index},
        )
