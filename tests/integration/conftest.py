from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .harness import Hub

if TYPE_CHECKING:  # boto3 is imported only when a test asks for S3
    from ..s3server import S3Server


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
# (always, 20 s, a 10 s warning), nlp only marks them (on-demand). speech (bob's alone)
# culls them after 40 s with a 25 s warning: time for a researcher in a browser to act on
# it while the machine runs other suites beside. Snapshots go to the real S3 server
# (SeaweedFS), as a deployment's would: credentials in the usual AWS_* variables, for the
# hub (its spawners' final passes and restores) and the controller (live passes).
CULLER_CONFIG = """
c.JupyterHub.load_groups["speech"] = {"users": ["bob"]}
c.FleetController.projects.append(
    {"name": "speech", "parent": "research", "quotas": {"A100-80GB": {"guaranteed": 1}}}
)
c.Culling.idle_policies = {
    "default": {"mode": "always", "idle_timeout_s": 20, "warn_before_s": 10},
    "projects": {
        "nlp": {"mode": "on-demand"},
        "speech": {"mode": "always", "idle_timeout_s": 40, "warn_before_s": 25},
    },
}
c.Culling.interval = 1
c.Culling.retry_seconds = 3
c.LocalGPUSpawner.final_snapshot_attempts = 1
c.LocalGPUSpawner.final_snapshot_retry_seconds = 1
"""

S3_CONFIG = """
import os
os.environ.update({credentials!r})
for service in c.JupyterHub.services:
    if "environment" in service:
        service["environment"].update({credentials!r})
c.SnapshotSettings.store = {store!r}
c.SnapshotSettings.s3_endpoint = {endpoint!r}
"""


@pytest.fixture(scope="session")
def culling_hub(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Hub]:
    options = s3_server.store_options()
    s3 = S3_CONFIG.format(
        credentials={
            "AWS_ACCESS_KEY_ID": options["access_key"],
            "AWS_SECRET_ACCESS_KEY": options["secret_key"],
            "AWS_DEFAULT_REGION": options["region"],
        },
        store=f"s3://{s3_server.create_bucket('culler')}/snapshots",
        endpoint=options["endpoint_url"],
    )
    instance = Hub.create(Path(tmp_path_factory.mktemp("culler")), CULLER_CONFIG + s3)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()
