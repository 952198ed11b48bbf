"""The reconciler's loop (docs/reconciler.md) as a component of the controller: every
``c.Reconciling.interval`` seconds, while the controller holds the database lease, one
pass of ``reconciler.Reconciler`` compares the database with what really runs and repairs
both ways."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from logging import Logger
from typing import Any, Protocol

import httpx
from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float

from ..scheduler.errors import SchedulerError
from .components import LoopComponent
from .kube_inventory import KubeInventory
from .metrics import ControllerMetrics
from .notifier import Notifier
from .reconciler import Reconciler, ReconcilerState
from .stopper import ServerStopper


class ReconcilingController(Protocol):
    """What the reconciler uses of the controller (``app.FleetController``)."""

    log: Logger
    metrics: ControllerMetrics
    notifier: Notifier
    servers: ServerStopper
    hub_api_url: str
    hub_api_token: str
    is_leader: bool
    kube: KubeInventory | None

    def now(self) -> datetime: ...

    def kick(self) -> None: ...

    async def live_pod_markers(self) -> frozenset[str] | None: ...

    @property
    def store(self) -> ReconcilerState: ...


class Reconciling(LoopComponent):
    interval = Float(
        30.0,
        help="Seconds between reconciler passes, which compare the database with what "
        "really runs (the hub's servers, this machine's session processes) and repair "
        "both ways (docs/reconciler.md).",
    ).tag(config=True)

    grace = Float(
        60.0,
        help="A disagreement between the database and what runs is repaired only once the "
        "workload has been in its state (or ended) this many seconds, so spawns, stops and "
        "releases in progress finish first (docs/reconciler.md).",
    ).tag(config=True)

    def __init__(self, controller: ReconcilingController, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.controller = controller

    async def run(self) -> None:
        c = self.controller
        if not c.hub_api_url:
            self.log.warning("no hub API ($JUPYTERHUB_API_URL): the reconciler is off")
            return
        reconciler = Reconciler(
            c.store,
            c.metrics,
            c.servers,
            c.hub_api_url,
            c.hub_api_token,
            self.log,
            c.now,
            pods=c.live_pod_markers,
            delete_pods=c.kube.delete_pods_with_marker if c.kube is not None else None,
        )
        try:
            while True:
                await asyncio.sleep(self.interval)
                if not c.is_leader:
                    continue
                try:
                    changed = await reconciler.run_once(timedelta(seconds=self.grace))
                except httpx.TransportError as e:  # the hub restarting
                    self.log.warning("reconciler: the hub's API did not answer (%s); retrying", e)
                    continue
                except (httpx.HTTPError, SQLAlchemyError, SchedulerError):
                    self.log.exception("reconciler pass failed; retrying next pass")
                    continue
                if changed:
                    c.notifier.changed(changed)
                    c.kick()  # released GPUs may admit waiting requests
        finally:
            await reconciler.close()
