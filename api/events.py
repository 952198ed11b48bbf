"""The event log's kinds, one enum, and an event as ``GET /events`` answers it.

A kind's value is the text stored in the ``events`` table and read by the pages, the
metrics and the clients: a value never changes (the rows already written keep theirs); a
new kind is a new member. Every place that writes an event names one of these (a unit
test reads the source for kinds written as text).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class EventKind(StrEnum):
    # A workload's life, as the scheduler and its requesters see it.
    REQUESTED = "requested"
    WAITING = "waiting"
    ADMITTED = "admitted"
    STARTED = "started"
    PREEMPTING = "preempting"
    ENDED = "ended"
    RECONCILED = "reconciled"

    # Sessions: idleness, keep-alives, snapshots, culls.
    SESSION_IDLE_WARNING = "session-idle-warning"
    SESSION_WARNING_WITHDRAWN = "session-warning-withdrawn"
    SESSION_MARKED_IDLE = "session-marked-idle"
    SESSION_ACTIVE_AGAIN = "session-active-again"
    SESSION_KEEP_ALIVE = "session-keep-alive"
    SESSION_SNAPSHOT = "session-snapshot"
    SESSION_CULL = "session-cull"
    SESSION_CULL_FAILED = "session-cull-failed"
    SESSION_FINAL_SNAPSHOT_FAILED = "session-final-snapshot-failed"
    SESSION_DRAINED = "session-drained"

    # Training jobs: their pods, faults and restarts.
    JOB_POD_ADOPTED = "job-pod-adopted"
    JOB_POD_ENDED = "job-pod-ended"
    JOB_FAILED = "job-failed"
    JOB_CANCELLED = "job-cancelled"
    JOB_FAULT = "job-fault"
    JOB_RESTARTING = "job-restarting"
    JOB_DRAINED = "job-drained"
    JOB_TRACED = "job-traced"

    # Nodes and clusters.
    NODE_REGISTERED = "node-registered"
    NODE_BACK = "node-back"
    NODE_LOST = "node-lost"
    NODE_LOST_SESSION = "node-lost-session"
    NODE_READY = "node-ready"
    NODE_NOT_READY = "node-not-ready"
    NODE_DELETED = "node-deleted"
    NODE_NAME_CONFLICT = "node-name-conflict"
    NODE_CORDONED = "node-cordoned"
    NODE_UNCORDONED = "node-uncordoned"
    NODE_DRAINED = "node-drained"
    NODE_POD_EVICTED = "node-pod-evicted"
    NODE_EVICTION_WAITING = "node-eviction-waiting"
    NODE_EVICTION_GIVEN_UP = "node-eviction-given-up"
    NODE_DRAIN_DONE = "node-drain-done"
    NODE_MAINTENANCE_PLANNED = "node-maintenance-planned"
    CLUSTER_REACHABLE = "cluster-reachable"
    CLUSTER_UNREACHABLE = "cluster-unreachable"

    # GPUs: health, the recovery loop's cordons, maintenance, what runs on them.
    GPU_XID = "gpu-xid"
    GPU_LOST = "gpu-lost"
    GPU_BACK = "gpu-back"
    GPU_MISSING = "gpu-missing"
    GPU_COUNT_CHANGED = "gpu-count-changed"
    GPU_CORDONED = "gpu-cordoned"
    GPU_LEMON = "gpu-lemon"
    GPU_LEMON_CLEARED = "gpu-lemon-cleared"
    GPU_MAINTENANCE_PLANNED = "gpu-maintenance-planned"
    GPU_LEFTOVERS_GONE = "gpu-leftovers-gone"
    GPUS_READ_BACK = "gpus-read-back"
    GPU_READBACK_MISMATCH = "gpu-readback-mismatch"
    MAINTENANCE_ASKED = "maintenance-asked"
    MAINTENANCE_PASSED = "maintenance-passed"
    MAINTENANCE_FAILED = "maintenance-failed"
    RECOVERY_BREAKER_TRIPPED = "recovery-breaker-tripped"
    RECOVERY_BREAKER_RESET = "recovery-breaker-reset"
    RECOVERY_CORDON_WITHHELD = "recovery-cordon-withheld"

    # Snapshots.
    SNAPSHOT_TAKEN = "snapshot-taken"
    SNAPSHOT_INDEX_REBUILT = "snapshot-index-rebuilt"
    SNAPSHOT_RETENTION = "snapshot-retention"

    # Projects and people.
    PROJECT_EDITED = "project-edited"
    MEMBERSHIP_SYNCED = "membership-synced"
    ACCOUNT_CREATED = "account-created"


class EventOut(BaseModel):
    id: int
    at: datetime
    # Text, not EventKind: a client older than the controller reads the kinds it does not
    # know yet.
    kind: str
    message: str
    reason: str
    cause: str
    workload_id: int | None
    project: str | None
    username: str | None
    node: str | None
    # Details for programs (e.g. an idle warning's ``last_active`` and ``due_at``).
    data: dict[str, Any] = Field(default_factory=dict)
