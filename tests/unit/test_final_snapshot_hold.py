"""A stopped session whose final snapshot fails keeps its GPUs, and the controller is told
(its event is what tells an admin to act): a hold the controller did not take, because
it was briefly unreachable, is sent again with the next failed retry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpufleet.snapshotter.runner import SnapshotFailed
from gpufleet.spawner import handshake
from gpufleet.spawner.client import ControllerUnavailable
from gpufleet.spawner.local import LocalGPUSpawner


class FlakyController:
    """Unreachable for the first hold; records what it was told."""

    def __init__(self) -> None:
        self.holds: list[str] = []
        self.refused = 0

    async def hold(self, workload_id: int, message: str) -> None:
        if not self.refused:
            self.refused += 1
            raise ControllerUnavailable("connection refused", None)
        self.holds.append(message)


class FailingSnapshots(LocalGPUSpawner):
    passes: int = 0
    released: list[tuple[str, str]]

    async def _final_snapshot(self) -> str:
        self.passes += 1
        if self.passes <= 3:
            raise SnapshotFailed(f"the store is full (pass {self.passes})")
        return "snapshot 5f0c saved"

    async def _released_elsewhere(self, workload_id: int) -> bool:
        return False

    async def _release(self, outcome: str, message: str, *, wait: bool = True) -> None:
        self.released.append((outcome, message))


async def test_a_hold_the_controller_missed_is_sent_again_until_it_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_DATA_DIR", str(tmp_path))
    c = Config()
    c.LocalGPUSpawner.final_snapshot_retry_seconds = 0.01
    user = SimpleNamespace(name="bob", id=7, url="/user/bob/")
    hub = SimpleNamespace(api_url="http://127.0.0.1:8081/hub/api", url="/hub/", base_url="/")
    spawner = FailingSnapshots(config=c, user=user, hub=hub)
    spawner.released = []
    controller = FlakyController()
    spawner._controller = controller  # type: ignore[assignment]
    spawner.workload_id = 41

    await spawner._save_then_release()
    await asyncio.wait_for(asyncio.gather(*handshake._background), 10)  # the retries

    assert controller.holds == ["the final snapshot failed: the store is full (pass 2)"]
    assert spawner.released == [("stopped", "the server stopped; snapshot 5f0c saved, retried")]
