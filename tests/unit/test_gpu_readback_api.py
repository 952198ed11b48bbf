"""``POST /agent/placements``: only node agents report which GPUs workloads have.

The controller's routes run in this process under tornado over a real store (SQLite), as
in test_api_input.py, whose stand-in controller and fleet (node a1: 4 × A100) are reused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from tornado import web

from gpufleet.hub import scopes
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.notifier import Notifier
from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import SessionRequest

from .test_api_input import PREFIX, Controller, fleet_store, serve

AGENT = Identity("service", "gpufleet-agent", frozenset({scopes.AGENT}), by_cookie=False)
SPAWNER = Identity("service", "gpufleet-spawner", frozenset({scopes.SPAWN}), by_cookie=False)
ALICE = Identity("user", "alice", frozenset({scopes.USE}), by_cookie=False)
MARKER = "0123456789abcdef"


@dataclass
class ReadbackController(Controller):
    notifier: Notifier = field(default_factory=Notifier)


@dataclass
class Api:
    client: httpx.AsyncClient
    controller: ReadbackController
    workload_id: int

    async def post_as(self, identity: Identity, body: object) -> httpx.Response:
        self.controller.identity = identity
        return await self.client.post("/agent/placements", json=body)

    async def gpus(self) -> list[str]:
        self.controller.identity = ALICE
        workload = (await self.client.get(f"/workloads/{self.workload_id}")).json()
        return [a["uuid"] for a in workload["allocations"]]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    """alice's session admitted on GPU-a1-0 with process marker ``MARKER``."""
    store = fleet_store(tmp_path / "gpufleet.sqlite")
    now = datetime.now(UTC)
    request = SessionRequest("alice", "", "vision", "A100", 1, None)
    workload = store.workloads.open_session_request(now, request, timedelta(minutes=5))
    store.reconcile.record_process_marker(now, workload.id, MARKER)
    store.scheduling.scheduling_cycle(now, Policy())
    controller = ReadbackController(store, ALICE)
    async for url in serve(web.Application(routes(PREFIX, controller))):
        async with httpx.AsyncClient(base_url=f"{url}{PREFIX}api/v1", timeout=30) as client:
            yield Api(client, controller, workload.id)


REPORT = {"placements": [{"marker": MARKER, "gpu_uuids": ["GPU-a1-2"]}]}


@pytest.mark.parametrize("caller", [ALICE, SPAWNER], ids=["a user", "the spawner"])
async def test_only_the_agent_may_say_which_gpus_a_workload_has(api: Api, caller: Identity) -> None:
    assert await api.gpus() == ["GPU-a1-0"]
    refused = await api.post_as(caller, REPORT)
    assert refused.status_code == 403, refused.text
    assert refused.json()["message"] == "this needs one of the scopes: custom:gpufleet:agent"
    assert await api.gpus() == ["GPU-a1-0"]

    answer = await api.post_as(AGENT, REPORT)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"reseated": [api.workload_id], "mismatched": [], "unknown": []}
    assert await api.gpus() == ["GPU-a1-2"]


async def test_a_report_that_fits_no_admission_is_answered_as_such(api: Api) -> None:
    body = {
        "placements": [
            {"marker": MARKER, "gpu_uuids": ["GPU-a1-1", "GPU-a1-2"]},
            {"marker": "fedcba9876543210.1", "gpu_uuids": ["GPU-a1-3"]},
        ]
    }
    answer = await api.post_as(AGENT, body)
    assert answer.json() == {
        "reseated": [],
        "mismatched": [api.workload_id],
        "unknown": ["fedcba9876543210.1"],
    }
    assert await api.gpus() == ["GPU-a1-0"]


@pytest.mark.parametrize(
    ("placement", "field_name"),
    [
        ({"marker": "not a marker", "gpu_uuids": ["GPU-a1-2"]}, "placements.0.marker"),
        ({"marker": MARKER, "gpu_uuids": []}, "placements.0.gpu_uuids"),
        ({"marker": MARKER, "gpu_uuids": ["GPU\0"]}, "placements.0.gpu_uuids.0"),
    ],
)
async def test_a_malformed_report_is_a_400_naming_the_field(
    api: Api, placement: dict[str, object], field_name: str
) -> None:
    answer = await api.post_as(AGENT, {"placements": [placement]})
    assert answer.status_code == 400, answer.text
    assert f"{field_name}: " in answer.json()["message"]
    assert await api.gpus() == ["GPU-a1-0"]
