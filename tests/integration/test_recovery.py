"""The recovery loop end to end on the local backend: a fault written to the fake NVML
library reaches the controller, which stops the job on that GPU and takes the node out of
service at once; the job comes back by itself as its next attempt on healthy GPUs and
resumes from the checkpoint it saved (CPU PyTorch, gloo, the real agent and controller)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.client import Client
from gpufleet.recovery import processes
from gpufleet.recovery.fake_nvml import FakeGpu, write_control

from .harness import Hub, pids_with_env, running_hub, server_environ, wait_for
from .test_agent import DECLARED, events
from .test_sdk_cli import cli

pytestmark = pytest.mark.integration

STEPS = 100
TRAINS_AND_CHECKPOINTS = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    import torch, torch.distributed as dist
    import gpufleet

    STEPS, HANGS_AT = 200, None

    def stop(signum, frame):
        print(f"rank {os.environ['RANK']} SIGTERM at {time.time():.3f}", flush=True)
        sys.exit(0)

    def wait_for_nothing():
        time.sleep(3600)  # alive, and no step any more

    signal.signal(signal.SIGTERM, stop)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    resume = gpufleet.resume_from()
    start = int(pathlib.Path(resume).read_text()) + 1 if resume else 0
    print(f"rank {rank} attempt {gpufleet.attempt()} starts at step {start} at "
          f"{time.time():.3f}", flush=True)
    for step in range(start, STEPS):
        if HANGS_AT == step and rank == 1 and gpufleet.attempt() == 1:
            wait_for_nothing()
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        print(f"rank {rank} step {step}", flush=True)
        gpufleet.progress(step)
        if rank == 0 and step % 10 == 9:
            saved = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_URI"]) / f"step-{step}"
            saved.write_text(str(step))
            gpufleet.checkpoint_saved(str(saved), step)
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def training(steps: int = STEPS, hangs_at: int | None = None) -> str:
    """The training script, running ``steps`` steps; rank 1 of attempt 1 hangs at
    ``hangs_at`` (alive, stepping no more)."""
    return TRAINS_AND_CHECKPOINTS.replace(
        "STEPS, HANGS_AT = 200, None", f"STEPS, HANGS_AT = {steps}, {hangs_at}"
    )


def submit_training(client: Client, script: str, name: str) -> int:
    """A gang of two 1-GPU pods in vision, reporting its progress every half second."""
    return client.submit(
        script,
        gpus=2,
        gpus_per_pod=1,
        gpu_type="A100-80GB",
        project="vision",
        name=name,
        env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
    ).id


def first_checkpoint(client: Client, job: int) -> Any:
    return wait_for(
        lambda: (p := client.job(job).progress) and p.last_checkpoint,
        120,
        "the job's first checkpoint",
        interval=0.1,
    )


@pytest.fixture
def alice(fleet: Hub) -> Iterator[Client]:
    with Client(fleet.controller_api, fleet.user_token("alice")) as client:
        yield client


def fake_gpus_of(hub: Hub) -> Iterator[list[FakeGpu]]:
    """The hub's fake devices as its agent declared them; written back as they were."""
    devices = declared_fake_gpus(DECLARED)
    yield devices
    write_control(hub.fake_nvml_control, devices)


@pytest.fixture
def gpus(fleet: Hub) -> Iterator[list[FakeGpu]]:
    yield from fake_gpus_of(fleet)


def test_an_xid_79_stops_the_job_at_once_and_it_resumes_elsewhere_from_its_checkpoint(
    fleet: Hub, alice: Client, gpus: list[FakeGpu]
) -> None:
    job_id = submit_training(alice, training(), "survivor")
    checkpoint = first_checkpoint(alice, job_id)
    first = alice.job(job_id)
    held = {a.uuid: a.node for a in first.allocations}
    [node] = set(held.values())  # a gang of two in one zone: one node here
    victim = next(g for g in gpus if g.uuid in held)

    faulted_at = time.time()
    write_control(
        fleet.fake_nvml_control, [replace(g, xid_events=[79]) if g is victim else g for g in gpus]
    )
    fault = wait_for(
        lambda: next((e for e in events(fleet, "job-fault") if e["workload_id"] == job_id), None),
        10,
        "the job-fault event",
        interval=0.05,
    )
    assert str(fault["message"]).startswith(f"attempt 1: XID 79 on GPU {victim.uuid}")
    cordoned = wait_for(
        lambda: next(
            (
                n
                for n in fleet.controller("GET", "/nodes").json()["items"]
                if n["name"] == node and n["cordoned"]
            ),
            None,
        ),
        10,
        "the node cordoned",
    )
    assert cordoned["cordoned"]

    def sigterms() -> list[float] | None:
        found = [
            re.findall(r"SIGTERM at ([\d.]+)", "".join(alice.logs(job_id, rank=rank)))
            for rank in (0, 1)
        ]
        return [float(f[0]) for f in found] if all(found) else None

    stopped = wait_for(sigterms, 30, "both ranks' SIGTERM in their logs")
    # Fault to action: the cordon event and every rank's SIGTERM within 5 s of the XID.
    fault_event = _controller_time(fault["at"])
    assert fault_event - faulted_at <= 5.0, fault_event - faulted_at
    assert max(stopped) - faulted_at <= 5.0, max(stopped) - faulted_at

    ended = alice.wait(job_id, timeout=180)
    assert (ended.outcome, ended.attempt, ended.faults) == ("succeeded", 2, 1), ended.reason
    assert node in ended.avoids
    # The restart cost it part of its time: the redone steps and the time to resume.
    ratio = ended.effective_training_ratio
    assert ratio is not None and 0.0 < ratio < 1.0, ratio
    assert {p.node for p in ended.pod_states} == {n["name"] for n in DECLARED} - {node}
    restarted = [e for e in events(fleet, "job-restarting") if e["workload_id"] == job_id]
    assert [e["data"]["attempt"] for e in restarted] == [2]
    data = restarted[0]["data"]
    assert data["fault"] == "node" and data["avoid_nodes"] == [node]
    resumed_from = int(str(data["resume_from"]).rsplit("step-", 1)[1])
    assert resumed_from >= checkpoint.step  # the newest checkpoint attempt 1 saved
    output = "".join(alice.logs(job_id, rank=0))
    before, _, after = output.partition("--- gpufleet: attempt 2: ")
    assert after, output[-2000:]
    assert f"rank 0 step {resumed_from}\n" in before
    # Attempt 2 starts from that checkpoint, on the other node, and runs to the end.
    resumed = re.search(r"rank 0 attempt 2 starts at step (\d+) at ([\d.]+)", after)
    assert resumed is not None and int(resumed.group(1)) == resumed_from + 1, after[:500]
    steps = [int(s) for s in re.findall(r"rank 0 step (\d+)", after)]
    assert steps == list(range(resumed_from + 1, STEPS))
    print(f"fault to first step after resume: {float(resumed.group(2)) - faulted_at:.1f} s")


def _controller_time(at: object) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(at)).timestamp()


def test_a_rank_that_hangs_is_found_traced_stopped_and_the_job_resumes(
    fleet: Hub, alice: Client, tmp_path: Path
) -> None:
    job_id = submit_training(alice, training(steps=40, hangs_at=15), "hangs")
    wait_for(lambda: (p := alice.job(job_id).progress) and p.last_step, 60, "the job stepping")
    # Asked for while it trains: every rank's stacks, from the job's own script or torch.
    asked = alice.trace(job_id, timeout=30)
    assert (asked.why, asked.complete, asked.missing_pods) == ("asked", True, [])
    ranks = [r for p in asked.pods for r in p.ranks]
    assert [(r.rank, r.error) for r in ranks] == [(0, ""), (1, "")]
    assert all(r.where and "(" in r.where for r in ranks), ranks

    fault = wait_for(
        lambda: next((e for e in events(fleet, "job-fault") if e["workload_id"] == job_id), None),
        90,
        "the hang found",
    )
    assert fault["reason"] == "hang" and fault["data"]["hang"] == "step"
    assert "no progress reported for" in str(fault["message"])
    # Before its gang was stopped, the stacks of the hang: the hung rank in the function
    # it hangs in, the other waiting for it in the all-reduce.
    traced = wait_for(
        lambda: next(
            (
                e
                for e in events(fleet, "job-traced")
                if e["workload_id"] == job_id and e["reason"] == "hang"
            ),
            None,
        ),
        30,
        "the hang's stacks",
    )
    assert str(traced["data"]["where"]["1"]).startswith("wait_for_nothing (train.py:"), traced
    assert "all_reduce" in str(traced["data"]["where"]["0"]) or "wait" in str(
        traced["data"]["where"]["0"]
    ), traced
    ended = alice.wait(job_id, timeout=120)
    assert (ended.outcome, ended.attempt, ended.faults) == ("succeeded", 2, 1), ended.reason
    after = "".join(alice.logs(job_id, rank=0)).partition("--- gpufleet: attempt 2: ")[2]
    assert "rank 0 attempt 2 starts at step 10" in after, after[:500]
    assert [int(s) for s in re.findall(r"rank 0 step (\d+)", after)] == list(range(10, 40))
    shown = cli("trace", str(job_id), token=fleet.user_token("alice"), api_url=fleet.controller_api)
    assert shown.returncode == 0, shown.stderr
    assert "(the hang," in shown.stdout and "rank 1 (pod 1 on " in shown.stdout
    assert ") in wait_for_nothing (train.py:" in shown.stdout, shown.stdout


def test_a_drain_snapshots_and_stops_the_session_and_the_job_resumes_elsewhere(
    fleet: Hub, alice: Client
) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("alice", timeout=180)
    session = fleet.workload_of("alice")
    assert session is not None
    [node] = {a["node"] for a in session["allocations"]}
    # Best fit: the 2-GPU job goes where 3 GPUs are free, beside the session.
    job_id = submit_training(alice, training(steps=120), "drained")
    checkpoint = first_checkpoint(alice, job_id)
    assert {a.node for a in alice.job(job_id).allocations} == {node}

    drained = fleet.controller(
        "POST", f"/nodes/{node}/drain", json={"reason": "firmware update"}
    ).json()
    assert drained["cordoned"]
    ended = fleet.wait_ended(session, 120)
    assert ended["outcome"] == "stopped" and "final snapshot" in ended["reason"], ended
    finished = alice.wait(job_id, timeout=180)
    assert (finished.outcome, finished.attempt, finished.faults) == ("succeeded", 2, 0)
    assert {p.node for p in finished.pod_states} == {n["name"] for n in DECLARED} - {node}
    restarted = [e for e in events(fleet, "job-restarting") if e["workload_id"] == job_id]
    assert restarted[0]["message"].startswith(f"node {node} drained by ")
    assert int(str(restarted[0]["data"]["resume_from"]).rsplit("step-", 1)[1]) >= checkpoint.step
    drained_events = [e for e in events(fleet, "node-drained") if e["node"] == node]
    assert drained_events and str(drained_events[0]["message"]).endswith("firmware update")
    # The job's side of it: an admin's drain, never a fault.
    [drained_job] = [e for e in events(fleet, "job-drained") if e["workload_id"] == job_id]
    assert drained_job["data"] == {
        "attempt": 1,
        "node": node,
        "by": "test-admin",
        "why": "firmware update",
    }
    assert not [e for e in events(fleet, "job-fault") if e["workload_id"] == job_id]


def test_faults_on_most_of_a_cluster_open_the_breaker_and_it_says_so(
    fleet: Hub, gpus: list[FakeGpu]
) -> None:
    # The two declared nodes are one cluster: the loop may cordon one of them (half).
    by_node: dict[str, FakeGpu] = {}
    for gpu, spec in zip(gpus, [d for d in DECLARED for _ in range(d["gpus"])], strict=True):
        by_node.setdefault(str(spec["name"]), gpu)
    write_control(
        fleet.fake_nvml_control,
        [replace(g, xid_events=[79]) if g in by_node.values() else g for g in gpus],
    )
    tripped = wait_for(lambda: events(fleet, "recovery-breaker-tripped"), 15, "the breaker tripped")
    assert "stops cordoning nodes of cluster" in str(tripped[0]["message"])
    nodes = {n["name"]: n for n in fleet.controller("GET", "/nodes").json()["items"]}
    withheld = events(fleet, "recovery-cordon-withheld")
    assert withheld and not nodes[str(withheld[0]["node"])]["cordoned"]
    # The other node was cordoned (and, empty, is recycled and diagnosed meanwhile).
    [other] = set(nodes) - {str(withheld[0]["node"])}
    assert any(e["node"] == other for e in events(fleet, "node-cordoned"))
    breakers = fleet.controller("GET", "/recovery/breakers").json()["items"]
    assert [b["open"] for b in breakers] == [True]
    exported = httpx.get(f"{fleet.url}/services/gpufleet/metrics", timeout=10).text
    assert f'gpufleet_recovery_breaker_open{{cluster="{breakers[0]["cluster"]}"}} 1.0' in exported
    assert 'gpufleet_recovery_cordons_total{cause="node",what="node"}' in exported


def test_a_drain_scheduled_for_later_runs_then_from_the_database(fleet: Hub) -> None:
    at = datetime.now(UTC) + timedelta(seconds=4)
    node = DECLARED[1]["name"]
    answer = fleet.controller(
        "POST", f"/nodes/{node}/drain", json={"reason": "rack move", "at": at.isoformat()}
    )
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert job["what"] == f"drain {node} (rack move), asked by test-admin"
    listed = fleet.controller("GET", "/timed").json()["items"]
    assert [j["id"] for j in listed] == [job["id"]]
    assert not _node(fleet, str(node))["cordoned"]
    wait_for(lambda: _node(fleet, str(node))["cordoned"], 30, "the drain at its time")
    # The cordon, the drain's event and the timed job's end are separate writes: each polled.
    drained = wait_for(
        lambda: [e for e in events(fleet, "node-drained") if e["node"] == node],
        30,
        "the node-drained event",
    )
    assert str(drained[0]["message"]).endswith("rack move")
    wait_for(
        lambda: fleet.controller("GET", "/timed").json()["items"] == [],
        30,
        "the timed drain gone from the list",
    )
    refused = fleet.controller("POST", f"/nodes/{node}/drain", json={"at": "yesterday"})
    assert refused.status_code == 400 and "neither HH:MM" in refused.text


def _node(fleet: Hub, name: str) -> dict[str, Any]:
    found = _node_in(fleet, name)
    assert found is not None, f"no node {name}"
    return found


# A hub of this module's own (its GPUs' fault history starts empty), whose nodes and their
# jobs are lost after 6 s of silence. In the agent-loss test node-c has an agent of its
# own, started by the test (so the hub does not restart it), and the job's first attempt
# hangs, alive, so that something is left of it; the hang check stays out of the way.
RECOVERY_HUB_CONFIG = """
c.FleetController.recovery_maintenance = True
c.NodeWatch.heartbeat_timeout = 6
c.FleetController.job_agent_lost_seconds = 6
c.FleetController.job_hang_floor_seconds = 300
"""
NODE_C = {"name": "gpu-node-c", "zone": "zone-c", "gpu_type": "A100-80GB", "gpus": 2}
AGENT_C_CONFIG = """
c = get_config()
load_subconfig({hub_config!r})
c.NodeAgent.declared_nodes = [{node!r}]
c.NodeAgent.data_dir = {data_dir!r}
c.NodeAgent.metrics_port = 0
"""


@pytest.fixture(scope="module")
def recovery_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    yield from running_hub(tmp_path_factory.mktemp("recovery"), RECOVERY_HUB_CONFIG)


class NodeAgentProcess:
    """A node agent of node-c only, run beside the hub's (whose environment it borrows)."""

    def __init__(self, hub: Hub) -> None:
        pid = hub.service_pid("gpufleet-agent")
        assert pid is not None
        self.command = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        self.data_dir = hub.data_dir / "agent-c"
        config = hub.log_path.parent / "agent_c_config.py"
        config.write_text(
            AGENT_C_CONFIG.format(
                hub_config=str(hub.log_path.parent / "test_config.py"),
                node=NODE_C,
                data_dir=str(self.data_dir),
            )
        )
        self.env = {**server_environ(pid), "GPUFLEET_CONFIG": str(config)}
        self.log_path = hub.log_path.parent / "agent-c.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)
        self.proc.wait(30)


def _node_in(hub: Hub, name: str) -> dict[str, Any] | None:
    nodes = hub.controller("GET", "/nodes").json()["items"]
    return next((n for n in nodes if n["name"] == name), None)


def _rank_pids(job_id: int, attempt: int) -> set[int]:
    return {
        pid
        for pid in pids_with_env("GPUFLEET_JOB_ID", str(job_id))
        if f"GPUFLEET_ATTEMPT={attempt}".encode()
        in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    }


def test_a_killed_agents_job_resumes_elsewhere_and_its_gpus_wait_for_its_processes(
    recovery_hub: Hub,
) -> None:
    hub, node = recovery_hub, str(NODE_C["name"])
    agent = NodeAgentProcess(hub)
    agent.start()
    try:
        wait_for(lambda: (n := _node_in(hub, node)) and n["health"] == "ok", 60, "node-c")
        for other in DECLARED:  # the job lands on node-c
            hub.controller("POST", f"/nodes/{other['name']}/cordon")
        with Client(hub.controller_api, hub.user_token("alice")) as alice:
            job_id = submit_training(alice, training(hangs_at=30), "outlives")
            checkpoint = first_checkpoint(alice, job_id)
            assert {a.node for a in alice.job(job_id).allocations} == {node}
            for other in DECLARED:
                hub.controller("POST", f"/nodes/{other['name']}/uncordon")
            # Each with its start: a pid the kernel hands out again is not the rank.
            old_ranks = {pid: processes.start_ticks(pid) or 0 for pid in _rank_pids(job_id, 1)}
            assert old_ranks

            agent.kill(signal.SIGKILL)  # its ranks live on, unwatched
            restarted = wait_for(
                lambda: [e for e in events(hub, "job-restarting") if e["workload_id"] == job_id],
                60,
                "the job restarted after node-c's silence",
            )
            assert restarted[0]["data"]["fault"] == "agent-lost"
            assert restarted[0]["data"]["avoid_nodes"] == [node]
            lost = _node_in(hub, node)
            assert lost is not None and (lost["health"], lost["cordoned"]) == ("unknown", True)
            assert len(lost["leftover_gpus"]) == 2 and lost["free_gpus"] == 0
            # Attempt 2 runs on the other nodes from the checkpoint, while attempt 1's
            # ranks still run on node-c: their GPUs are not handed out.
            wait_for(lambda: _rank_pids(job_id, attempt=2), 90, "attempt 2's ranks")
            second = alice.job(job_id)
            assert second.attempt == 2 and node not in {a.node for a in second.allocations}
            assert all(processes.running(pid, start) for pid, start in old_ranks.items())
            assert len(_node_in(hub, node)["leftover_gpus"]) == 2  # type: ignore[index]

            # node-c's agent is back: it ends what is left, and only then are the GPUs free.
            agent.start()
            wait_for(
                lambda: not _node_in(hub, node)["leftover_gpus"],  # type: ignore[index]
                60,
                "node-c's GPUs released",
            )
            # What the agent waits for before it reports them gone: none still runs (a
            # zombie does not: it holds nothing, and its parent reaps it).
            assert not any(processes.running(pid, start) for pid, start in old_ranks.items())
            gone = sorted(
                str(e["message"]) for e in events(hub, "gpu-leftovers-gone") if e["node"] == node
            )
            assert [m.partition(" any more")[0] for m in gone] == [
                f"nothing of job {job_id}'s lost pod {pod} runs on {node}" for pod in (0, 1)
            ]

            ended = alice.wait(job_id, timeout=240)
            assert (ended.outcome, ended.attempt) == ("succeeded", 2), ended.reason
            after = "".join(alice.logs(job_id, rank=0)).partition("--- gpufleet: attempt 2: ")[2]
            resumed = re.search(r"rank 0 attempt 2 starts at step (\d+)", after)
            assert resumed is not None and int(resumed.group(1)) > checkpoint.step, after[:500]
            steps = [int(s) for s in re.findall(r"rank 0 step (\d+)", after)]
            assert steps == list(range(int(resumed.group(1)), STEPS))
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.kill(signal.SIGTERM)  # it takes its loopback guard away


@pytest.fixture
def recovery_gpus(recovery_hub: Hub) -> Iterator[list[FakeGpu]]:
    yield from fake_gpus_of(recovery_hub)


def _fault_on_a_gpu_of(
    hub: Hub, client: Client, job_id: int, gpus: list[FakeGpu], xid: int
) -> FakeGpu:
    """Deliver ``xid`` on one of the job's GPUs (the fake library, as NVML would)."""
    held = {a.uuid for a in client.job(job_id).allocations}
    victim = next(g for g in gpus if g.uuid in held)
    write_control(
        hub.fake_nvml_control, [replace(g, xid_events=[xid]) if g is victim else g for g in gpus]
    )
    return victim


def _events_of(hub: Hub, kind: str, uuid: str, after: int = 0) -> list[dict[str, Any]]:
    """The events of ``kind`` that name ``uuid``, newer than event ``after``."""
    return [e for e in events(hub, kind) if uuid in str(e["message"]) and int(e["id"]) > after]


@contextlib.contextmanager
def _telling_events(hub: Hub, since: int) -> Iterator[None]:
    """A failure inside says what the controller recorded meanwhile."""
    try:
        yield
    except AssertionError as e:
        items = hub.controller("GET", "/events", params={"limit": 200}).json()["items"]
        told = [f"{x['id']} {x['kind']}: {x['message']}" for x in items if int(x["id"]) > since]
        raise AssertionError(f"{e}\nevents since:\n" + "\n".join(reversed(told))) from e


def _last_event(hub: Hub) -> int:
    items = hub.controller("GET", "/events", params={"limit": 1}).json()["items"]
    return int(items[0]["id"]) if items else 0


def test_an_xid_48_resets_the_gpu_once_free_and_the_job_resumes_without_it(
    recovery_hub: Hub, recovery_gpus: list[FakeGpu]
) -> None:
    hub, since = recovery_hub, _last_event(recovery_hub)
    with (
        _telling_events(hub, since),
        Client(hub.controller_api, hub.user_token("alice")) as alice,
    ):
        job_id = submit_training(alice, training(), "reset")
        checkpoint = first_checkpoint(alice, job_id)
        victim = _fault_on_a_gpu_of(hub, alice, job_id, recovery_gpus, 48)
        ended = alice.wait(job_id, timeout=180)
        assert (ended.outcome, ended.attempt, ended.faults) == ("succeeded", 2, 1), ended.reason
        # Attempt 2 avoided the GPU (until its reset passed: then the avoidance lapsed).
        [restarted] = [e for e in events(hub, "job-restarting") if e["workload_id"] == job_id]
        assert restarted["data"]["avoid_gpus"] == [victim.uuid]
        assert victim.uuid not in {a.uuid for a in ended.allocations}
        after = "".join(alice.logs(job_id, rank=0)).partition("--- gpufleet: attempt 2: ")[2]
        resumed = re.search(r"rank 0 attempt 2 starts at step (\d+)", after)
        assert resumed is not None and int(resumed.group(1)) > checkpoint.step, after[:500]
    # The GPU was drained (cordoned), reset once its ranks were gone, and is back.
    assert _events_of(hub, "gpu-cordoned", victim.uuid, since)
    passed = wait_for(
        lambda: _events_of(hub, "maintenance-passed", victim.uuid, since), 30, "the GPU's reset"
    )
    assert str(passed[0]["message"]).startswith(f"reset of GPU {victim.uuid} of node ")
    nodes = hub.controller("GET", "/nodes").json()["items"]
    assert all(victim.uuid not in n["cordoned_gpus"] for n in nodes)
    control = hub.fake_nvml_control.read_text().splitlines()
    index = next(line.split(".")[1] for line in control if line.endswith(f".uuid={victim.uuid}"))
    assert not [line for line in control if line.startswith(f"gpu.{index}.xid=")]


def test_an_xid_13_restarts_in_place_and_twice_on_one_gpu_has_it_diagnosed(
    recovery_hub: Hub, recovery_gpus: list[FakeGpu]
) -> None:
    hub, since = recovery_hub, _last_event(recovery_hub)
    with (
        _telling_events(hub, since),
        Client(hub.controller_api, hub.user_token("alice")) as alice,
    ):
        job_id = submit_training(alice, training(steps=150), "app-fault")
        first_checkpoint(alice, job_id)
        victim = _fault_on_a_gpu_of(hub, alice, job_id, recovery_gpus, 13)
        restarted = wait_for(
            lambda: [e for e in events(hub, "job-restarting") if e["workload_id"] == job_id],
            60,
            "the restart in place",
        )
        assert restarted[0]["data"]["fault"] == "application"
        assert restarted[0]["data"]["avoid_gpus"] == []  # in place: nothing is blamed
        assert not _events_of(hub, "gpu-cordoned", victim.uuid, since)
        wait_for(lambda: alice.job(job_id).state == "running", 60, "attempt 2 running")
        # The same GPU again, whoever holds it now: it is cordoned and diagnosed.
        write_control(
            hub.fake_nvml_control,
            [replace(g, xid_events=[13]) if g is victim else g for g in recovery_gpus],
        )
        cordoned = wait_for(
            lambda: _events_of(hub, "gpu-cordoned", victim.uuid, since), 30, "the GPU cordoned"
        )
        assert "13" in str(cordoned[0]["message"])
        passed = wait_for(
            lambda: _events_of(hub, "maintenance-passed", victim.uuid, since),
            60,
            "its diagnostics",
        )
        assert str(passed[0]["message"]).startswith(f"diagnose of GPU {victim.uuid}")
        ended = alice.wait(job_id, timeout=240)
        assert ended.outcome == "succeeded", ended.reason
