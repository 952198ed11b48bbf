"""Node operations: snapshot passes and restores a node agent runs for a Kubernetes session
(state/operations.py, hub/api/node_operations.py, snapshotter/node_operations.py).

The controller's routes run in this process under tornado over a real store (SQLite), as
in test_gpu_readback_api.py; the spawner's side is its real ControllerClient and
``snapshotter.runner.on_node``; the agent's side is its HTTP sync, played here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from tornado import web

from gpufleet.hub import scopes
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.notifier import Notifier
from gpufleet.scheduler.errors import NotFound
from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import SessionRequest
from gpufleet.snapshotter.node_operations import (
    OverlayMount,
    container_layer,
    overlay_mounts,
    prepare_volume,
)
from gpufleet.snapshotter.runner import SnapshotFailed, on_node
from gpufleet.spawner.client import ControllerClient
from gpufleet.state.fleet import FleetStore

from .test_api_input import PREFIX, Controller, fleet_store, serve

AGENT = Identity("service", "gpufleet-agent", frozenset({scopes.AGENT}), by_cookie=False)
SPAWNER = Identity("service", "jupyterhub", frozenset({scopes.SPAWN}), by_cookie=False)
ALICE = Identity("user", "alice", frozenset({scopes.USE}), by_cookie=False)
MARKER = "0123456789abcdef"
HOME = "/var/lib/gpufleet/homes/alice"


IDENTITIES = {"agent": AGENT, "spawner": SPAWNER, "alice": ALICE}


@dataclass
class OperationsController(Controller):
    """Whoever's token a request carries (callers run at once here: the agent long-polls
    while the spawner asks)."""

    notifier: Notifier = field(default_factory=Notifier)

    async def identify(self, handler: web.RequestHandler) -> Identity | None:
        token = handler.request.headers.get("Authorization", "").removeprefix("token ")
        return IDENTITIES.get(token)


@dataclass
class Api:
    client: httpx.AsyncClient
    url: str
    controller: OperationsController
    store: FleetStore
    workload_id: int

    async def call(
        self, identity: Identity, method: str, path: str, body: Any = None
    ) -> httpx.Response:
        token = next(k for k, v in IDENTITIES.items() if v is identity)
        return await self.client.request(
            method, path, json=body, headers={"Authorization": f"token {token}"}
        )

    async def agent_sync(
        self, reports: list[dict[str, Any]] | None = None, wait: float = 0, nodes: Any = None
    ) -> list[dict[str, Any]]:
        answer = await self.call(
            AGENT,
            "POST",
            "/agent/node-operations",
            {"nodes": nodes or ["a1"], "reports": reports or [], "wait": wait},
        )
        assert answer.status_code == 200, answer.text
        return list(answer.json()["operations"])


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    """alice's session admitted on node a1 with process marker ``MARKER``."""
    store = fleet_store(tmp_path / "gpufleet.sqlite")
    now = datetime.now(UTC)
    request = SessionRequest("alice", "", "vision", "A100", 1, None)
    workload = store.workloads.open_session_request(now, request, timedelta(minutes=5))
    store.reconcile.record_process_marker(now, workload.id, MARKER)
    store.scheduling.scheduling_cycle(now, Policy())
    controller = OperationsController(store, SPAWNER)
    async for url in serve(web.Application(routes(PREFIX, controller))):
        base = f"{url}{PREFIX}api/v1"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            yield Api(client, base, controller, store, workload.id)


def snapshot_body(**extra: Any) -> dict[str, Any]:
    return {"kind": "snapshot", "paths": [HOME], "container": True, "tags": ["live"], **extra}


async def ask(spawner: ControllerClient, api: Api, **waiting: Any) -> dict[str, Any]:
    """The spawner's side: a snapshot asked for alice's session, waited for by on_node."""
    return await on_node(
        lambda: spawner.request_node_operation(api.workload_id, snapshot_body()),
        spawner.node_operation,
        spawner.abandon_node_operation,
        **{"poll_s": 0.05, **waiting},
    )


async def test_the_agent_of_the_sessions_node_claims_runs_and_reports_what_the_spawner_asked(
    api: Api,
) -> None:
    # The agent long-polls with nothing pending; the spawner's request wakes it.
    polling = asyncio.create_task(api.agent_sync(wait=20))
    await asyncio.sleep(0)
    spawner = ControllerClient(api.url, "spawner")
    asked = await spawner.request_node_operation(api.workload_id, snapshot_body())
    assert asked["node"] == "a1" and asked["state"] == "pending"
    (claimed,) = await asyncio.wait_for(polling, 10)
    assert claimed["id"] == asked["id"] and claimed["kind"] == "snapshot"
    # What the agent needs to find the container and file the snapshot under its owner.
    assert claimed["request"] == {
        "paths": [HOME],
        "exclude": [],
        "container": True,
        "tags": ["live"],
        "owner": None,
        "project": "vision",
        "username": "alice",
        "server": "",
        "marker": MARKER,
    }
    # Claimed once: neither this agent asking again nor another one gets it.
    assert await api.agent_sync() == []

    oid = claimed["id"]
    progress = {"phase": "files", "done": 3, "total": 10}
    await api.agent_sync([{"id": oid, "state": "running", "progress": progress}])
    seen = await spawner.node_operation(oid)
    assert seen["state"] == "running" and seen["progress"] == progress

    result = {"id": "ab12cd34", "name": "x", "stats": {"files": 10}}
    await api.agent_sync([{"id": oid, "state": "done", "result": result}])
    done = await spawner.node_operation(oid)
    assert done["state"] == "done" and done["result"] == result
    # An ended operation never changes again (a late or repeated report).
    await api.agent_sync([{"id": oid, "state": "failed", "error": "late"}])
    assert (await spawner.node_operation(oid))["state"] == "done"
    await spawner.aclose()


async def test_on_node_waits_for_the_result_and_shows_progress_on_the_way(api: Api) -> None:
    spawner = ControllerClient(api.url, "spawner")
    shown: list[dict[str, Any]] = []

    async def agent() -> None:
        claimed: list[dict[str, Any]] = []
        while not claimed:
            claimed = await api.agent_sync(wait=5)
        oid = claimed[0]["id"]
        await api.agent_sync([{"id": oid, "state": "running", "progress": {"done": 1}}])
        await asyncio.sleep(0.5)
        await api.agent_sync([{"id": oid, "state": "done", "result": {"id": "f00d"}}])

    running = asyncio.create_task(agent())
    result = await ask(
        spawner,
        api,
        what="live snapshot",
        claim_within=10,
        on_progress=shown.append,
    )
    await running
    assert result == {"id": "f00d"}
    assert shown == [{"done": 1}]
    await spawner.aclose()


async def test_an_operation_no_agent_takes_fails_with_what_to_check_and_is_never_run(
    api: Api,
) -> None:
    spawner = ControllerClient(api.url, "spawner")
    with pytest.raises(SnapshotFailed) as failed:
        await ask(
            spawner,
            api,
            what="restore",
            claim_within=0.3,
        )
    assert "no gpufleet node agent on node a1 took the restore within 0 s" in str(failed.value)
    assert "is the agent running there" in str(failed.value)
    # An agent that comes up later does not run what its asker gave up on.
    assert await api.agent_sync() == []
    await spawner.aclose()


async def test_a_failed_operation_says_why_to_the_asker(api: Api) -> None:
    spawner = ControllerClient(api.url, "spawner")

    async def agent() -> None:
        claimed: list[dict[str, Any]] = []
        while not claimed:
            claimed = await api.agent_sync(wait=5)
        await api.agent_sync([{"id": claimed[0]["id"], "state": "failed", "error": "disk full"}])

    running = asyncio.create_task(agent())
    with pytest.raises(SnapshotFailed, match="live snapshot on node a1 failed: disk full"):
        await ask(
            spawner,
            api,
            what="live snapshot",
            claim_within=10,
        )
    await running
    await spawner.aclose()


async def test_an_agent_that_stops_reporting_fails_the_operation_and_its_late_word_is_ignored(
    api: Api,
) -> None:
    spawner = ControllerClient(api.url, "spawner")

    async def agent_that_dies() -> int:
        claimed: list[dict[str, Any]] = []
        while not claimed:
            claimed = await api.agent_sync(wait=5)
        return int(claimed[0]["id"])  # and then nothing more

    dying = asyncio.create_task(agent_that_dies())
    with pytest.raises(SnapshotFailed) as failed:
        await ask(
            spawner,
            api,
            what="final snapshot",
            claim_within=10,
            silent_within=0.5,
        )
    assert "the gpufleet node agent on node a1 stopped reporting on the final snapshot" in str(
        failed.value
    )
    oid = await dying
    await api.agent_sync([{"id": oid, "state": "done", "result": {"id": "late"}}])
    late = await spawner.node_operation(oid)
    assert late["state"] == "failed" and late["result"] is None
    await spawner.aclose()


async def test_a_running_operation_that_reports_on_time_is_waited_for(api: Api) -> None:
    spawner = ControllerClient(api.url, "spawner")

    async def slow_agent() -> None:
        claimed: list[dict[str, Any]] = []
        while not claimed:
            claimed = await api.agent_sync(wait=5)
        oid = claimed[0]["id"]
        for _ in range(8):  # 1.6 s of work, reported on every 0.2 s, with no progress
            await asyncio.sleep(0.2)
            await api.agent_sync([{"id": oid, "state": "running"}])
        await api.agent_sync([{"id": oid, "state": "done", "result": {"id": "slow"}}])

    working = asyncio.create_task(slow_agent())
    result = await ask(
        spawner,
        api,
        what="final snapshot",
        claim_within=10,
        silent_within=1.0,
    )
    await working
    assert result == {"id": "slow"}
    await spawner.aclose()


def test_ended_operations_are_forgotten_after_a_week(api: Api) -> None:
    store, wid = api.store, api.workload_id
    now = datetime.now(UTC)
    old = store.node_operations.request_node_operation(now - timedelta(days=8), wid, "snapshot", {})
    (claimed,) = store.node_operations.claim_node_operations(now - timedelta(days=8), ["a1"])
    store.node_operations.report_node_operation(
        now - timedelta(days=8), claimed.id, state="done", result={}
    )
    recent = store.node_operations.request_node_operation(
        now - timedelta(days=1), wid, "snapshot", {}
    )
    store.node_operations.abandon_node_operation(now - timedelta(days=1), recent.id, "gave up")
    store.node_operations.request_node_operation(now, wid, "restore", {})
    with pytest.raises(NotFound):
        store.node_operations.node_operation(old.id)
    assert store.node_operations.node_operation(recent.id).state == "failed"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (snapshot_body(paths=["relative/home"]), 400, "paths: Value error, 'relative/home'"),
        (snapshot_body(paths=["/homes/../etc"]), 400, "not an absolute, normalised path"),
        (snapshot_body(kind="format"), 400, "kind: "),
        ({"kind": "restore", "owner": [1]}, 400, "owner: "),
    ],
)
async def test_bad_requests_are_400s_naming_the_field_and_make_nothing(
    api: Api, body: dict[str, Any], status: int, says: str
) -> None:
    answer = await api.call(SPAWNER, "POST", f"/workloads/{api.workload_id}/node-operations", body)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["message"]
    assert await api.agent_sync() == []


async def test_only_the_hub_asks_and_only_agents_claim(api: Api) -> None:
    path = f"/workloads/{api.workload_id}/node-operations"
    for caller in (ALICE, AGENT):
        refused = await api.call(caller, "POST", path, snapshot_body())
        assert refused.status_code == 403, refused.text
    for caller in (ALICE, SPAWNER):
        refused = await api.call(
            caller, "POST", "/agent/node-operations", {"nodes": ["a1"], "reports": []}
        )
        assert refused.status_code == 403, refused.text
    # Not a workload on any node yet, or no workload at all.
    assert (
        await api.call(SPAWNER, "POST", "/workloads/999/node-operations", snapshot_body())
    ).status_code == 404
    # An agent of another node does not get a1's work.
    made = await api.call(SPAWNER, "POST", path, snapshot_body())
    assert made.status_code == 201
    assert await api.agent_sync(nodes=["a2"]) == []
    assert [o["id"] for o in await api.agent_sync()] == [made.json()["id"]]


# ------------------------------------------------------------ the agent's pure side
CONTAINERD = (
    "1012 987 0:312 / / rw,relatime master:302 - overlay overlay rw,lowerdir=/var/lib/"
    "containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/41/fs,upperdir=/var/lib/"
    "containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/57/fs,workdir=/var/lib/"
    "containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/57/work\n"
    "1013 1012 0:314 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
)
SANDBOX = (
    "93 92 0:40 / /usr rw,relatime - overlay overlay rw,lowerdir=/usr,upperdir=/srv/pods/"
    "p\\0401/upper/usr,workdir=/srv/pods/p\\0401/work/usr,uuid=on\n"
    "94 92 0:41 / /etc rw,relatime - overlay overlay rw,lowerdir=/etc,upperdir=/srv/pods/"
    "p\\0401/upper/etc,workdir=/srv/pods/p\\0401/work/etc,uuid=on\n"
    "95 92 8:1 /srv/homes/alice /home/alice rw,relatime - ext4 /dev/sda1 rw\n"
)


def test_a_runtimes_overlay_root_is_the_containers_layer() -> None:
    assert container_layer(overlay_mounts(CONTAINERD)) == (
        "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/57/fs"
    )


def test_a_sandbox_of_one_overlay_per_directory_is_read_as_their_common_upper() -> None:
    mounts = overlay_mounts(SANDBOX)
    assert mounts == [
        OverlayMount("/usr", "/srv/pods/p 1/upper/usr"),
        OverlayMount("/etc", "/srv/pods/p 1/upper/etc"),
    ]
    assert container_layer(mounts) == "/srv/pods/p 1/upper"


@pytest.mark.parametrize(
    "mounts",
    [
        [],  # no overlay: another snapshotter, a VM runtime
        [OverlayMount("/usr", "/a/upper/usr"), OverlayMount("/etc", "/b/upper/etc")],
        [OverlayMount("/data", "/a/upper/scratch")],  # not a layer of that directory
    ],
)
def test_no_layer_is_made_up_where_the_mounts_do_not_say_one(mounts: list[OverlayMount]) -> None:
    assert container_layer(mounts) is None


def test_a_volume_directory_is_made_for_its_user_only_where_none_is(tmp_path: Path) -> None:
    uid, gid = 4242, 4343
    home = tmp_path / "homes" / "alice"
    home.parent.mkdir()
    prepare_volume(str(home), [uid, gid])
    made = home.stat()
    assert (made.st_uid, made.st_gid, made.st_mode & 0o777) == (uid, gid, 0o700)
    (home / "notes.txt").write_text("kept")
    prepare_volume(str(home), [0, 0])  # there already: left as it is
    assert home.stat().st_uid == uid and (home / "notes.txt").read_text() == "kept"
