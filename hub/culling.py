"""The idle culler's loop (docs/culler.md) as a component of the controller: its options,
``c.Culling.<name>``, and the ``IdleCuller`` (culler/loop.py) it runs while the
controller holds the database lease."""

from __future__ import annotations

from datetime import datetime
from logging import Logger
from typing import Any, Protocol

from traitlets import Dict, Float

from ..culler.loop import CullerState, IdleCuller
from ..snapshotter.settings import StoreAccess
from .components import LoopComponent
from .metrics import ControllerMetrics
from .notifier import Notifier
from .stopper import ServerStopper


class CullingController(Protocol):
    """What the culler uses of the controller (``app.FleetController``)."""

    log: Logger
    metrics: ControllerMetrics
    notifier: Notifier
    servers: ServerStopper
    snapshot_access: StoreAccess
    hub_api_url: str
    hub_api_token: str
    is_leader: bool
    projects: list[dict[str, Any]]

    def now(self) -> datetime: ...

    @property
    def store(self) -> CullerState:
        """The repositories the culler uses."""


class Culling(LoopComponent):
    idle_policies = Dict(
        help="Idle culling per project and profile: {'default': {...}, 'projects': {name: "
        "{...}}, 'profiles': {name: {...}}}, a profile's keys over its project's over the "
        "default. Keys: mode ('always': stop after the time-out; 'on-demand', the default: "
        "only mark idle sessions, which the scheduler reclaims first when someone waits), "
        "idle_timeout_s, warn_before_s, max_age_s, keep_alive_max_s, reclaim_by_anyone, "
        "stop_without_snapshot. See docs/culler.md.",
    ).tag(config=True)

    interval = Float(
        30.0, help="Seconds between the culler's rounds over the running sessions."
    ).tag(config=True)

    retry_seconds = Float(
        300.0,
        help="After a cull failed (its live snapshot, or the hub's stop), wait this long "
        "before trying that session again.",
    ).tag(config=True)

    def __init__(self, controller: CullingController, **kwargs: Any) -> None:
        """PolicyError when ``idle_policies`` names what does not exist or cannot work."""
        super().__init__(**kwargs)
        self.controller = controller
        self.culler = IdleCuller(
            controller.store,
            self.idle_policies,
            stopper=controller.servers,
            hub_api_url=controller.hub_api_url,
            hub_api_token=controller.hub_api_token,
            snapshot_settings=controller.snapshot_access,
            registry=controller.metrics.registry,
            log=self.log,
            now=controller.now,
            interval=self.interval,
            retry_after=self.retry_seconds,
            notify=controller.notifier.changed,
        )
        projects = [str(p["name"]) for p in controller.projects]
        self.culler.check_policies(projects)
        self.culler.metrics.know_projects(projects)

    async def run(self) -> None:
        await self.culler.run(lambda: self.controller.is_leader)
