"""The controller's loops are components with options of their own
(``c.Reconciling.grace``, ...); the names the controller once declared for them
(``c.FleetController.reconcile_grace``, ...) still configure them, with a warning in the
log naming the new option."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import make_url
from traitlets.config import Config

from gpufleet.hub.app import FleetController
from gpufleet.hub.components import EarlierLoopNames, LoopComponent
from gpufleet.hub.culling import Culling
from gpufleet.hub.inventory_loop import NodeWatch
from gpufleet.hub.kube_inventory import KubeInventory
from gpufleet.hub.kube_jobs import KubeJobs
from gpufleet.hub.memberships import MembershipSync
from gpufleet.hub.notifier import Notifier
from gpufleet.hub.reconciling import Reconciling
from gpufleet.hub.recovery_loop import RecoveryLoop
from gpufleet.hub.scheduling import AdmissionCycles
from gpufleet.hub.snapshot_index import SnapshotIndexing
from gpufleet.hub.timed import TimedWork
from gpufleet.state import db

COMPONENTS: dict[str, type[LoopComponent]] = {
    cls.__name__: cls
    for cls in (
        Culling,
        SnapshotIndexing,
        Reconciling,
        RecoveryLoop,
        NodeWatch,
        MembershipSync,
        AdmissionCycles,
        KubeInventory,
        KubeJobs,
        TimedWork,
    )
}


def stub_controller() -> Any:
    """What the components read of the controller as they are made."""
    # The planning process starts with the first cycle: a database's name is all it reads.
    database = SimpleNamespace(engine=SimpleNamespace(url=make_url("sqlite:////nowhere.sqlite")))
    return SimpleNamespace(
        store=SimpleNamespace(scheduling=SimpleNamespace(database=database)),
        servers=None,
        snapshot_access=None,
        metrics=SimpleNamespace(registry=CollectorRegistry()),
        notifier=Notifier(),
        hub_api_url="",
        hub_api_token="",
        projects=[{"name": "vision"}],
        now=lambda: datetime.now(UTC),
    )


def made(name: str, controller: FleetController) -> Any:
    if name == "KubeInventory":  # made as the controller starts, of the configured clusters
        stub = stub_controller()
        return KubeInventory([], stub.store, now=stub.now, kick=lambda: None, parent=controller)
    if name == "KubeJobs":  # made as the controller starts, of the configured clusters
        stub = stub_controller()
        return KubeJobs(
            [],
            stub.store,
            now=stub.now,
            kick=lambda: None,
            notifier=stub.notifier,
            hub_url="http://127.0.0.1:8081/hub/api",
            controller_url="http://127.0.0.1:8090/",
            parent=controller,
        )
    if name == "TimedWork":  # its jobs are kept in the database
        return TimedWork(stub_controller(), db.make_engine("sqlite://"), parent=controller)
    return COMPONENTS[name](stub_controller(), parent=controller)


def earlier_value(old: str) -> Any:
    if old == "idle_policies":
        return {"projects": {"vision": {"mode": "always", "idle_timeout_s": 1200}}}
    integers = {"max_preemption_searches": 7, "snapshot_keep_last": 7, "snapshot_keep_daily": 7}
    texts = {"planner": "thread", "snapshot_retention_schedule": "0 3 * * *"}
    return {**integers, **texts}.get(old, 7.5)


def new_value(old: str) -> Any:
    integers = {"max_preemption_searches": 2, "snapshot_keep_last": 2, "snapshot_keep_daily": 2}
    texts = {"idle_policies": {}, "planner": "loop", "snapshot_retention_schedule": "0 4 * * *"}
    return {**integers, **texts}.get(old, 2.0)


@pytest.mark.parametrize("old", sorted(EarlierLoopNames.renamed))
def test_an_earlier_controller_name_still_sets_its_loops_option_and_names_the_new_one(
    old: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    new = EarlierLoopNames.renamed[old][0]
    component, _, option = new.partition(".")
    c = Config()
    c.FleetController[old] = earlier_value(old)
    with caplog.at_level(logging.WARNING):
        loop = made(component, FleetController(config=c))
    assert getattr(loop, option) == earlier_value(old)
    warned = capsys.readouterr().err + caplog.text
    assert f"c.FleetController.{old} is deprecated: set c.{new} instead" in warned


@pytest.mark.parametrize("old", sorted(EarlierLoopNames.renamed))
def test_the_new_name_wins_over_the_earlier_one(old: str) -> None:
    new = EarlierLoopNames.renamed[old][0]
    component, _, option = new.partition(".")
    c = Config()
    c.FleetController[old] = earlier_value(old)
    c[component][option] = new_value(old)
    loop = made(component, FleetController(config=c))
    assert getattr(loop, option) == new_value(old)


def test_a_loop_left_unset_keeps_its_default_and_nothing_is_warned(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with caplog.at_level(logging.WARNING):
        reconciling = made("Reconciling", FleetController(config=Config()))
    assert (reconciling.interval, reconciling.grace) == (30.0, 60.0)
    assert "deprecated" not in capsys.readouterr().err + caplog.text


def test_the_culler_runs_with_what_the_earlier_names_say() -> None:
    c = Config()
    c.FleetController.cull_interval = 4.0
    c.FleetController.cull_retry_seconds = 9.0
    c.FleetController.idle_policies = earlier_value("idle_policies")
    culler = made("Culling", FleetController(config=c)).culler
    assert (culler.interval, culler.retry_after) == (4.0, 9.0)
    policy = culler.policy_for("vision")
    assert (policy.mode.value, policy.idle_timeout_s) == ("always", 1200)


def test_every_loop_option_is_listed_in_the_controllers_help_with_its_text() -> None:
    for cls in COMPONENTS.values():
        assert cls in FleetController.classes
        for name, trait in cls.class_traits(config=True).items():
            assert trait.help, f"c.{cls.__name__}.{name} has no help"


def test_a_component_refuses_an_option_it_does_not_have() -> None:
    stub = stub_controller()
    with pytest.raises(TypeError, match=r"KubeInventory has no option node_lost_grace$"):
        KubeInventory([], stub.store, now=stub.now, kick=lambda: None, node_lost_grace=30.0)
