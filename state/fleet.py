"""The platform's database as the controller uses it: one repository per capability over
one ``Database`` (its sessions, the controller lease, the fenced writes).

Each handler and loop is given the repositories it uses; none reaches another's rows except
through functions of an open session that two capabilities share (``base.end_workload``,
``catalogue.catalogue_of``, ``maintenance.settle_operation``) or a repository it is given
(maintenance, the reconciler and jobs ending attempts through ``jobs``; jobs making accounts
through ``accounts``). The scheduling cycle's decisions are committed in one transaction: a
controller killed at any point leaves either all of them or none (``cycle.py``).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .accounts import AccountStore
from .clusters import ClusterInventoryStore
from .cycle import SchedulingStore
from .database import Database
from .events import EventStore
from .inventory import InventoryStore
from .jobs import JobStore
from .maintenance import MaintenanceStore
from .operations import NodeOperationStore
from .projects import ProjectStore
from .readback import ReadbackStore
from .reconcile import ReconcileStore
from .sessions import SessionActivityStore
from .snapshots import SnapshotStore
from .traces import TraceStore
from .workloads import WorkloadStore


class FleetStore:
    """Every repository, built once over one database."""

    def __init__(self, engine: Engine, holder: str, lease_ttl: timedelta = timedelta(seconds=15)):
        self.database = Database(engine, holder, lease_ttl)
        self.accounts = AccountStore(self.database)
        self.projects = ProjectStore(self.database)
        self.workloads = WorkloadStore(self.database)
        self.scheduling = SchedulingStore(self.database)
        self.sessions = SessionActivityStore(self.database)
        self.jobs = JobStore(self.database, self.accounts)
        self.traces = TraceStore(self.database, lambda: self.jobs.recovery_policy)
        self.reconcile = ReconcileStore(self.database, self.jobs)
        self.maintenance = MaintenanceStore(self.database, self.jobs)
        self.nodes = InventoryStore(self.database)
        self.clusters = ClusterInventoryStore(self.database)
        self.readback = ReadbackStore(self.database)
        self.node_operations = NodeOperationStore(self.database)
        self.snapshots = SnapshotStore(self.database)
        self.events = EventStore(self.database)

    @property
    def engine(self) -> Engine:
        return self.database.engine

    @property
    def holder(self) -> str:
        return self.database.holder

    def try_acquire_lease(self, now: datetime) -> bool:
        return self.database.try_acquire_lease(now)

    def release_lease(self, now: datetime) -> bool:
        return self.database.release_lease(now)

    def read(self) -> Session:
        """A session for reading (the API's views and pages read through it)."""
        return self.database.read()
