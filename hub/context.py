"""What the API handlers and the pages may use of the controller: a narrow protocol.

The application class (``app.FleetController``) satisfies it; handlers are given it and
never import the application, so ``app`` imports the handlers and not the other way round,
and a test can hand a handler a context of its own.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from logging import Logger
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tornado import web

    from ..culler.loop import IdleCuller
    from ..state.fleet import FleetStore
    from .api.identity import Identity
    from .metrics import ControllerMetrics
    from .notifier import Notifier
    from .timed import TimedWork


class ControllerContext(Protocol):
    """The controller as its handlers see it."""

    store: FleetStore
    notifier: Notifier
    metrics: ControllerMetrics
    culler: IdleCuller
    log: Logger
    version: str
    service_prefix: str
    is_leader: bool
    spare_nodes: frozenset[str]  # the recovery spares of its last admission cycle
    hub_auth: Any  # JupyterHub's HubOAuth, or None when the controller runs without a hub
    gpu_busy_utilization: float
    job_checkpoint_store: str
    job_stop_grace_seconds: float
    data_dir: str

    def now(self) -> datetime: ...

    def checkpoint_places(self, username: str) -> list[str]:
        """The directories ``username``'s local checkpoint locations may lie in."""

    @property
    def request_lease(self) -> timedelta: ...

    def kick(self) -> None:
        """Run an admission cycle soon."""

    def refresh_snapshot_index(self) -> None:
        """Read the snapshot store into the index soon."""

    @property
    def snapshot_index_at(self) -> datetime | None:
        """When the snapshot index last began reading the store; None: not yet."""

    async def identify(self, handler: web.RequestHandler) -> Identity | None: ...

    async def refresh_memberships(self, max_age: float) -> None: ...

    async def live_pod_markers(self) -> frozenset[str] | None:
        """The markers of workloads with a pod in a Kubernetes cluster; None: unknown."""

    async def cordon(self, node: str, cordoned: bool, by: str) -> bool:
        """Cordon or uncordon a node wherever it lives; whether anything changed."""

    timed: TimedWork

    async def run_snapshot_retention(self) -> None:
        """Apply snapshot retention to every project and collect unused data."""

    async def drain(self, node: str, by: str, why: str) -> None:
        """Cordon a node and stop what runs there (jobs restart elsewhere, sessions are
        snapshotted and stopped)."""

    async def recycle(self, node: str, by: str, why: str) -> None:
        """Drain a node, recycle it once it is empty, then diagnose it."""
