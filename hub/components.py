"""The controller's loops as components: each a class of its own module with its own
options, set as ``c.<Component>.<option>`` in ``jupyterhub_config.py``, given what it uses
of the controller (a narrow protocol), started by the controller once it holds the
database lease and fenced by it (a loop acts only while ``is_leader``), cancelled when
the controller stops.

The options were once the controller's (``c.FleetController.cull_interval``, ...): those
names are still read, with a warning in the log naming the new one
(:class:`EarlierLoopNames`); where both are set the new one wins.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from traitlets import Dict, Float, Integer, Unicode
from traitlets.config import Configurable, LoggingConfigurable

from ..snapshotter.settings import RenamedOptions


class LoopComponent(LoggingConfigurable):
    """A loop of the controller. Made with the controller as its traitlets parent, it
    reads its own section of the controller's config, then the earlier names the
    controller declares for its options."""

    def __init__(self, parent: Configurable | None = None, **kwargs: Any) -> None:
        # traitlets would pass an unknown keyword on with a warning, and the option it
        # was meant for would keep its default.
        unknown = sorted(set(kwargs) - set(self.class_trait_names()))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option {', '.join(unknown)}")
        super().__init__(parent=parent, **kwargs)
        if isinstance(parent, RenamedOptions):
            self._take_earlier_names(parent)

    def _take_earlier_names(self, parent: RenamedOptions) -> None:
        section = type(self).__name__
        mine = self.config.get(section, {})
        for old in parent.trait_names():
            moved = parent.renamed_to(old)
            if moved is None:
                continue
            owner, _, new = moved[0].partition(".")
            value = getattr(parent, old)
            if owner == section and value is not None and new not in mine:
                setattr(self, new, value)


def earlier_help(new: str) -> str:
    """The help of an option's earlier name on the controller, now ``c.<new>``."""
    return (
        f"Deprecated: set c.{new}. Still read, with a warning; c.{new} wins where both "
        "are set (docs/architecture.md, 'The controller's loops')."
    )


LOOPS = "the controller's loops; docs/architecture.md"


def _earlier(trait: type[Float] | type[Integer] | type[Unicode] | type[Dict], new: str) -> Any:
    return trait(default_value=None, allow_none=True, help=earlier_help(new)).tag(
        config=True, renamed_to=new
    )


class EarlierLoopNames(RenamedOptions):
    """The loops' options as the controller once declared them, mixed into it."""

    cull_interval = _earlier(Float, "Culling.interval")
    cull_retry_seconds = _earlier(Float, "Culling.retry_seconds")
    idle_policies = _earlier(Dict, "Culling.idle_policies")
    snapshot_index_interval = _earlier(Float, "SnapshotIndexing.interval")
    snapshot_index_min_interval = _earlier(Float, "SnapshotIndexing.min_interval")
    reconcile_interval = _earlier(Float, "Reconciling.interval")
    reconcile_grace = _earlier(Float, "Reconciling.grace")
    hang_check_interval = _earlier(Float, "RecoveryLoop.hang_check_interval")
    node_heartbeat_timeout = _earlier(Float, "NodeWatch.heartbeat_timeout")
    membership_sync_interval = _earlier(Float, "MembershipSync.interval")
    admission_interval = _earlier(Float, "AdmissionCycles.interval")
    planner = _earlier(Unicode, "AdmissionCycles.planner")
    min_run_time_seconds = _earlier(Float, "AdmissionCycles.min_run_time_seconds")
    max_preemption_searches = _earlier(Integer, "AdmissionCycles.max_preemption_searches")
    preemption_retry_seconds = _earlier(Float, "AdmissionCycles.preemption_retry_seconds")
    full_collection_interval = _earlier(Float, "AdmissionCycles.full_collection_interval")
    cluster_unreachable_after = _earlier(Float, "KubeInventory.unreachable_after")
    cluster_probe_interval = _earlier(Float, "KubeInventory.probe_interval")
    node_lost_grace_seconds = _earlier(Float, "KubeInventory.node_lost_grace_seconds")
    snapshot_retention_schedule = _earlier(Unicode, "TimedWork.snapshot_retention_schedule")
    snapshot_keep_last = _earlier(Integer, "TimedWork.snapshot_keep_last")
    snapshot_keep_daily = _earlier(Integer, "TimedWork.snapshot_keep_daily")
    snapshot_gc_margin_seconds = _earlier(Float, "TimedWork.snapshot_gc_margin_seconds")


# Where each earlier name lives now, read off the declarations above (one list, not two).
EarlierLoopNames.renamed = {
    name: (trait.metadata["renamed_to"], LOOPS)
    for name, trait in EarlierLoopNames.class_traits(renamed_to=lambda new: new is not None).items()
}


class Loops:
    """The controller's running loops: started together once it holds the lease,
    cancelled together when it stops."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, loops: Iterable[Callable[[], Coroutine[Any, Any, None]]]) -> None:
        for loop in loops:
            self.tasks.append(asyncio.create_task(loop()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
