"""The SDK (``gpufleet.client``) and the ``gpufleet`` command against the real controller
of the shared test hub (two nodes of 4 A100-80GB; vision's guarantee is 4, and it may not
borrow): what an admin and a researcher see and may do."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.client import ApiError, AsyncClient, Client

from .harness import Hub, wait_for

pytestmark = pytest.mark.integration

GPUFLEET = Path(sys.executable).parent / "gpufleet"


def cli(*args: str, token: str, api_url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    env.update(GPUFLEET_API_URL=api_url, GPUFLEET_TOKEN=token, COLUMNS="200")
    return subprocess.run(
        [str(GPUFLEET), *args], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def admin(fleet: Hub) -> Iterator[Client]:
    with Client(fleet.controller_api, fleet.token) as client:
        yield client
        for node in client.nodes():
            if node.cordoned:
                client.uncordon(node.name)


def test_an_admin_cordons_a_node_and_new_sessions_go_elsewhere(fleet: Hub, admin: Client) -> None:
    cordoned = admin.cordon("gpu-node-a")
    assert cordoned.name == "gpu-node-a" and cordoned.cordoned
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    alice = fleet.workload_of("alice")
    assert alice is not None
    assert {a["node"] for a in alice["allocations"]} == {"gpu-node-b"}
    said = [e for e in admin.events(limit=50) if e.kind == "node-cordoned"]
    assert said and said[0].message.startswith("node gpu-node-a cordoned by ")

    async def nodes_seen_by_asyncio() -> dict[str, bool]:
        async with AsyncClient(fleet.controller_api, fleet.token) as client:
            return {n.name: n.cordoned for n in await client.nodes()}

    assert asyncio.run(nodes_seen_by_asyncio()) == {"gpu-node-a": True, "gpu-node-b": False}
    # The command says what it did and how to undo it.
    done = cli("uncordon", "gpu-node-a", token=fleet.token, api_url=fleet.controller_api)
    assert done.returncode == 0, done.stderr
    assert "gpu-node-a takes new work again" in done.stdout
    table = cli("nodes", token=fleet.token, api_url=fleet.controller_api)
    assert table.returncode == 0 and "gpu-node-b" in table.stdout and "2 / 4" in table.stdout


def test_the_queue_shows_each_waiting_workload_its_place_and_why(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("alice")
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["queue_position"] == 1,
        30,
        "bob queued",
    )
    # bob asks with his own token: he sees his own waiting workload and why.
    token = fleet.user_token("bob")
    answer = cli("queue", "--json", token=token, api_url=fleet.controller_api)
    assert answer.returncode == 0, answer.stderr
    (waiting,) = json.loads(answer.stdout)
    assert waiting["username"] == "bob" and waiting["queue_position"] == 1
    assert "4/4 guaranteed" in waiting["reason"]
    table = cli("queue", token=token, api_url=fleet.controller_api)
    assert "bob" in table.stdout and "2 × A100-80GB" in table.stdout


def test_a_researcher_may_not_cordon_and_is_told_why(fleet: Hub, admin: Client) -> None:
    token = fleet.user_token("alice")
    refused = cli("cordon", "gpu-node-a", token=token, api_url=fleet.controller_api)
    assert refused.returncode == 3
    assert "refused (403 forbidden)" in refused.stderr and "custom:gpufleet:admin" in refused.stderr
    assert not {n.name: n.cordoned for n in admin.nodes()}["gpu-node-a"]
    with pytest.raises(ApiError) as unknown:
        admin.cordon("no-such-node")
    assert unknown.value.status == 404 and "no-such-node" in unknown.value.message


def test_the_command_says_what_to_set_and_when_the_controller_does_not_answer() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    lost = subprocess.run(
        [str(GPUFLEET), "nodes"], env=env, capture_output=True, text=True, timeout=60
    )
    assert lost.returncode == 2 and "GPUFLEET_HUB_URL" in lost.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = cli("nodes", token="t", api_url=f"http://127.0.0.1:{port}/api/v1")
    assert silent.returncode == 4 and "did not answer" in silent.stderr


def test_quota_shows_your_projects_usage_and_what_waits(fleet: Hub, admin: Client) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=4)
    wait_for(lambda: (w := fleet.workload_of("bob")) and w["state"] == "pending", 30, "bob")
    # bob is in vision only: he sees it and the organisation above it, not nlp.
    answer = cli("quota", "--json", token=fleet.user_token("bob"), api_url=fleet.controller_api)
    assert answer.returncode == 0, answer.stderr
    seen = {p["name"]: p for p in json.loads(answer.stdout)}
    assert set(seen) == {"research", "vision"}
    assert seen["vision"]["parent"] == "research" and seen["research"]["kind"] == "organisation"
    (quota,) = seen["vision"]["quotas"]
    assert (quota["gpu_type"], quota["guaranteed"], quota["borrow_limit"]) == ("A100-80GB", 4, 0)
    assert (quota["used"], quota["waiting"]) == (2, 4)
    table = cli("quota", token=fleet.user_token("bob"), api_url=fleet.controller_api)
    assert "  vision" in table.stdout and "2 / 4" in table.stdout
    # An admin sees the whole tree.
    tree = {p.name: p for p in admin.projects()}
    assert set(tree) == {"research", "vision", "nlp"}
    assert tree["nlp"].quotas[0].used == 0 and tree["nlp"].quotas[0].borrow_limit is None


def test_an_admin_lists_the_project_tree_and_a_researcher_their_part(fleet: Hub) -> None:
    everything = cli("projects", token=fleet.token, api_url=fleet.controller_api)
    assert everything.returncode == 0, everything.stderr
    assert "vision" in everything.stdout and "nlp" in everything.stdout
    assert "A100-80GB" in everything.stdout and "weight" in everything.stdout
    mine = cli("projects", "--json", token=fleet.user_token("bob"), api_url=fleet.controller_api)
    assert mine.returncode == 0, mine.stderr
    assert {p["name"] for p in json.loads(mine.stdout)} >= {"vision"}
    assert "nlp" not in {p["name"] for p in json.loads(mine.stdout)}
