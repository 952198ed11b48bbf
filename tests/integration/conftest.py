from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Hub


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One real hub for the whole session: starting one costs several seconds."""
    instance = Hub.create(Path(tmp_path_factory.mktemp("hub")))
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


@pytest.fixture
def fleet(hub: Hub) -> Iterator[Hub]:
    """The shared hub, with every server stopped and every workload ended afterwards."""
    yield hub
    if hub.proc is None:
        hub.start()
    hub.stop_all_servers()


# The culler's tests (test_culler.py, test_culler_browser.py): vision culls idle sessions
# (always, 20 s, a 6 s warning), nlp only marks them (on-demand).
CULLER_CONFIG = """
c.FleetController.idle_policies = {
    "default": {"mode": "always", "idle_timeout_s": 20, "warn_before_s": 6},
    "projects": {"nlp": {"mode": "on-demand"}},
}
c.FleetController.cull_interval = 1
c.FleetController.cull_retry_seconds = 3
c.LocalGPUSpawner.final_snapshot_attempts = 1
c.LocalGPUSpawner.final_snapshot_retry_seconds = 1
"""


@pytest.fixture(scope="session")
def culling_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    instance = Hub.create(Path(tmp_path_factory.mktemp("culler")), CULLER_CONFIG)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()
