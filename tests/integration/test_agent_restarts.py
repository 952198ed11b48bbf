"""The platform's own restarts cost running jobs nothing: the node agent killed with
SIGKILL, the agent restarted, and the whole platform (hub, proxy, controller, agent)
restarted, each while two users' jobs run. Their ranks outlive the agent; the new agent
takes every pod over (``job-pod-adopted``), keeps watching it and its logs, and the jobs
go on stepping in the same attempt with no fault charged."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.client import Client
from gpufleet.recovery import processes

from .harness import Hub, pids_with_env, running_hub, wait_for
from .test_agent import events
from .test_recovery import training

pytestmark = pytest.mark.integration

# A job that steps until cancelled (test_recovery's: each rank prints every step once,
# reports its progress, and rank 0 saves a checkpoint every 10 steps).
STEPS_FOREVER = training(steps=10**9)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    # The hang check stays out of the way: an agent away must not pass for a hang.
    yield from running_hub(
        tmp_path_factory.mktemp("agent-restarts"),
        "c.FleetController.job_hang_floor_seconds = 600\n",
    )


def _submit(hub: Hub, user: str, project: str) -> int:
    with Client(hub.controller_api, hub.user_token(user)) as client:
        return client.submit(
            STEPS_FOREVER,
            gpus=2,
            gpus_per_pod=1,
            gpu_type="A100-80GB",
            project=project,
            name=f"steps-{user}",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
        ).id


def _job(hub: Hub, job_id: int) -> dict[str, Any]:
    found = hub.controller("GET", f"/jobs/{job_id}")
    assert found.status_code == 200, found.text
    answer: dict[str, Any] = found.json()
    return answer


def _step(hub: Hub, job_id: int) -> int:
    progress = _job(hub, job_id)["progress"]
    return -1 if progress is None or progress["last_step"] is None else int(progress["last_step"])


def _ranks(job_id: int) -> dict[int, int]:
    """The job's rank processes, each with its start (a reused pid is not the rank)."""
    return {
        pid: processes.start_ticks(pid) or 0
        for pid in pids_with_env("GPUFLEET_JOB_ID", str(job_id))
    }


def _adopted(hub: Hub, job_ids: list[int]) -> int:
    return sum(1 for e in events(hub, "job-pod-adopted") if e["workload_id"] in job_ids)


def _agent(hub: Hub) -> int:
    return wait_for(lambda: hub.service_pid("gpufleet-agent"), 120, "the hub's node agent")


def _kept_running(
    hub: Hub, jobs: list[int], ranks: dict[int, dict[int, int]], adopted: int
) -> None:
    """Both jobs were taken over by the new agent, run the same ranks in the same attempt,
    were charged nothing, and step on."""
    wait_for(lambda: _adopted(hub, jobs) >= adopted, 120, f"{adopted} pods taken over")
    for job_id in jobs:
        job = _job(hub, job_id)
        assert (job["state"], job["attempt"], job["faults"]) == ("running", 1, 0), job["reason"]
        assert all(processes.running(pid, start) for pid, start in ranks[job_id].items())
        before = _step(hub, job_id)
        wait_for(lambda j=job_id, b=before: _step(hub, j) >= b + 10, 60, f"job {job_id} steps on")
    said = {e["kind"] for e in events(hub, "job-fault") + events(hub, "job-restarting")}
    assert not said, f"the restart was charged as a fault: {said}"


def test_restarts_of_the_agent_and_of_the_whole_platform_cost_running_jobs_nothing(
    hub: Hub,
) -> None:
    """About 50 s: three restarts one after the other (the agent killed, the agent stopped,
    the whole platform), each waiting for a new agent to take four pods over, while the
    same two jobs step on. Split, each part would start its own hub and jobs and wait for
    them to step, and the last could not show that takeovers add up (4, 8, 12 adopted)."""
    jobs = [_submit(hub, "alice", "vision"), _submit(hub, "carol", "nlp")]
    for job_id in jobs:
        wait_for(lambda j=job_id: _step(hub, j) >= 5, 180, f"job {job_id} stepping")
    ranks = {job_id: _ranks(job_id) for job_id in jobs}
    assert all(len(found) >= 2 for found in ranks.values()), ranks

    # 1. The agent killed: nothing of it runs on, and the hub starts another.
    killed = _agent(hub)
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: hub.service_pid("gpufleet-agent") not in (None, killed), 120, "a new agent")
    _kept_running(hub, jobs, ranks, adopted=4)

    # 2. The agent stopped as for an upgrade (SIGTERM), and started again by the hub.
    stopped = _agent(hub)
    os.kill(stopped, signal.SIGTERM)
    wait_for(lambda: hub.service_pid("gpufleet-agent") not in (None, stopped), 120, "a new agent")
    _kept_running(hub, jobs, ranks, adopted=8)

    # 3. The whole platform stopped and started again: hub, proxy, controller, agent.
    # The controller answers the agent's requests in flight as it stops (no 500).
    logged = hub.log_path.stat().st_size
    hub.stop()
    with hub.log_path.open("rb") as log:
        log.seek(logged)
        stopping = log.read().decode(errors="replace")
    assert not re.findall(r"FleetController\] \w+ \S+ 5\d\d", stopping), stopping[-3000:]
    hub.start()
    _kept_running(hub, jobs, ranks, adopted=12)

    # Each rank's output reached the controller whole: every step once, in order, up to
    # one the job reported after the last restart.
    reported = _step(hub, jobs[0])

    def logged_steps() -> list[int]:
        with Client(hub.controller_api, hub.user_token("alice")) as alice:
            text = "".join(alice.logs(jobs[0], rank=0))
        return [int(s) for s in re.findall(r"rank 0 step (\d+)", text)]

    steps = wait_for(
        lambda: (found := logged_steps()) and found[-1] >= reported and found,
        60,
        f"rank 0's output up to step {reported}",
    )
    assert steps == list(range(len(steps))), steps
    for job_id in jobs:
        hub.controller("POST", f"/jobs/{job_id}/cancel")
    for job_id in jobs:
        wait_for(lambda j=job_id: _job(hub, j)["state"] == "ended", 120, f"job {job_id} cancelled")
        assert not any(processes.running(p, s) for p, s in ranks[job_id].items())
    assert Path(hub.data_dir / "agent" / "progress-port").exists()
