"""Recovery spares end to end (``c.FleetController.recovery_spares``): a zone of three
nodes keeps one back; ordinary work waits rather than take it, preemptible work borrows
it, and a training job that loses a node to a fault restarts at once on the spare and
the free GPUs of its zone, the borrowed work stopped for it (real hub, controller and
agent; CPU PyTorch, gloo)."""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.client import Client
from gpufleet.recovery.fake_nvml import write_control

from .harness import Hub, running_hub, wait_for
from .test_agent import events
from .test_recovery import STEPS, _last_event, _telling_events, first_checkpoint, training

pytestmark = pytest.mark.integration

SPARE_ZONE = [
    {"name": f"gpu-node-s{i}", "zone": "zone-s", "gpu_type": "A100-80GB", "gpus": 2}
    for i in (1, 2, 3)
]
SPARES_CONFIG = f"""
c.FleetController.recovery_spares = {{"zone-s": 1}}
c.NodeAgent.declared_nodes = {SPARE_ZONE!r}
"""
LENT_WORK = textwrap.dedent(
    """
    import time
    print("borrowing the spare", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def spares_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    yield from running_hub(tmp_path_factory.mktemp("spares"), SPARES_CONFIG)


def _nodes(hub: Hub) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = hub.controller("GET", "/nodes").json()["items"]
    return items


def _spare(hub: Hub) -> str | None:
    spares = [n["name"] for n in _nodes(hub) if n["spare"]]
    return spares[0] if len(spares) == 1 else None


def _nodes_of(client: Client, job: int) -> set[str]:
    return {a.node for a in client.job(job).allocations}


def test_a_job_that_loses_a_node_restarts_at_once_on_the_spare_lent_work_gives_way(
    spares_hub: Hub,
) -> None:
    hub, since = spares_hub, _last_event(spares_hub)
    devices = declared_fake_gpus(SPARE_ZONE)
    wait_for(
        lambda: sum(n["health"] == "ok" for n in _nodes(hub)) == 3, 60, "the zone's three nodes"
    )
    spare = wait_for(lambda: _spare(hub), 30, "one spare node in zone-s")
    with (
        _telling_events(hub, since),
        Client(hub.controller_api, hub.user_token("alice")) as alice,
        Client(hub.controller_api, hub.user_token("carol")) as carol,
    ):
        job_id = alice.submit(
            training(),
            gpus=4,
            gpus_per_pod=2,
            gpu_type="A100-80GB",
            project="vision",
            name="spared",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
        ).id
        checkpoint = first_checkpoint(alice, job_id)
        first_nodes = _nodes_of(alice, job_id)
        assert spare not in first_nodes and len(first_nodes) == 2

        # Ordinary work waits, saying why; preemptible work borrows the spare.
        waiting = carol.submit(
            LENT_WORK, gpus=2, gpu_type="A100-80GB", project="nlp", name="ordinary"
        ).id
        reason = wait_for(
            lambda: "recovery spare" in (r := carol.job(waiting).reason) and r,
            30,
            "the ordinary job's reason",
        )
        assert "1 A100-80GB node in zone-s is held back as a recovery spare" in reason
        lent = carol.submit(
            LENT_WORK,
            gpus=2,
            gpu_type="A100-80GB",
            project="nlp",
            name="borrower",
            priority="opportunistic",
        ).id
        wait_for(lambda: carol.job(lent).state == "running", 60, "the borrower running")
        assert _nodes_of(carol, lent) == {spare}
        assert carol.job(waiting).state == "pending"

        # XID 79 on a node of the job: it restarts on the spare and its other node, and
        # the borrower is stopped for it.
        victim = next(
            g for g in devices if g.uuid in {a.uuid for a in alice.job(job_id).allocations}
        )
        lost_node = next(a.node for a in alice.job(job_id).allocations if a.uuid == victim.uuid)
        faulted_at = time.time()
        write_control(
            hub.fake_nvml_control,
            [replace(g, xid_events=[79]) if g is victim else g for g in devices],
        )
        reclaimed = wait_for(
            lambda: [
                e
                for e in events(hub, "preempting")
                if e["workload_id"] == lent and e["reason"] == "spare-reclaim"
            ],
            30,
            "the borrower preempted for the restart",
        )
        assert f"recovery spare of zone-s ({spare})" in str(reclaimed[0]["message"])
        wait_for(
            lambda: alice.job(job_id).attempt == 2 and alice.job(job_id).state == "running",
            60,
            "attempt 2 running",
        )
        second_nodes = _nodes_of(alice, job_id)
        assert second_nodes == (first_nodes - {lost_node}) | {spare}
        restarted_in = time.time() - faulted_at

        ended = alice.wait(job_id, timeout=240)
        assert (ended.outcome, ended.attempt) == ("succeeded", 2), ended.reason
        after = "".join(alice.logs(job_id, rank=0)).partition("--- gpufleet: attempt 2: ")[2]
        resumed = re.search(r"rank 0 attempt 2 starts at step (\d+)", after)
        assert resumed is not None and int(resumed.group(1)) > checkpoint.step, after[:500]
        steps = [int(s) for s in re.findall(r"rank 0 step (\d+)", after)]
        assert steps == list(range(int(resumed.group(1)), STEPS))

        # The borrower comes back to the queue by itself, without spending a fault.
        back = wait_for(
            lambda: (j := carol.job(lent)).attempt == 2 and j,
            60,
            "the borrower's next attempt",
        )
        assert back.outcome is None
        assert restarted_in < 60
        for job in (waiting, lent):
            carol.cancel(job)
    write_control(hub.fake_nvml_control, devices)
