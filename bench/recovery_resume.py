"""Fault to action and fault to the first step after resume, measured on this machine: a
2-pod job (CPU PyTorch, gloo) trains and checkpoints; an XID 79 written to the fake NVML
library on one of its GPUs stops it, cordons the node, and the job resumes elsewhere from
its checkpoint. Median of ``--rounds`` faults, with the parts:

- detect: the XID written to the ``job-fault`` event (the controller acted);
- SIGTERM: the XID written to the last rank's SIGTERM (every rank told to stop);
- stop: ``job-fault`` to ``job-restarting`` (every pod gone, the next attempt queued);
- back-off + reschedule: ``job-restarting`` to ``admitted`` (with the product's back-off
  settings; a restart away from the node the XID blamed does not wait for it, so this is
  the next admission cycle);
- start: ``admitted`` to ``started`` (the agent starts the pods under torchrun);
- load checkpoint: ``started`` to the first step after resume (rendezvous, imports, load).

The baseline, in the same run: the same job's first start, from submission to its first
step; the ratio is resume over first start.

    .venv/bin/python bench/recovery_resume.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' hub harness
from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.client import Client
from gpufleet.recovery.fake_nvml import write_control
from tests.integration.harness import Hub, wait_for
from tests.integration.test_agent import DECLARED

PRODUCT_BACKOFF = (  # the product's defaults, over the test harness's short ones
    "c.FleetController.job_restart_backoff_seconds = 10\n"
    "c.FleetController.job_restart_backoff_max_seconds = 600\n"
)
SCRIPT = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    import torch, torch.distributed as dist
    import gpufleet

    def stop(signum, frame):
        print(f"rank {os.environ['RANK']} SIGTERM at {time.time():.3f}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    resume = gpufleet.resume_from()
    start = int(pathlib.Path(resume).read_text()) + 1 if resume else 0
    for step in range(start, 100000):
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        print(f"rank {rank} attempt {gpufleet.attempt()} step {step} at {time.time():.3f}",
              flush=True)
        gpufleet.progress(step)
        if rank == 0 and step % 10 == 9:
            saved = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_URI"]) / f"step-{step}"
            saved.write_text(str(step))
            gpufleet.checkpoint_saved(str(saved), step)
        time.sleep(0.05)
    """
)


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["at"])).timestamp()


def events(hub: Hub, job: int) -> list[dict[str, Any]]:
    found = hub.controller("GET", "/events", params={"limit": 1000, "workload_id": job})
    return list(reversed(found.json()["items"]))  # oldest first


def first_step(client: Client, job: int, attempt: int) -> float | None:
    log = "".join(client.logs(job, rank=0))
    found = re.search(rf"rank 0 attempt {attempt} step \d+ at ([\d.]+)", log)
    return float(found.group(1)) if found else None


def one_round(hub: Hub, client: Client, index: int) -> dict[str, float]:
    job = client.submit(
        SCRIPT,
        gpus=2,
        gpus_per_pod=1,
        gpu_type="A100-80GB",
        project="vision",
        name=f"resume-{index}",
        env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
    ).id
    wait_for(lambda: (p := client.job(job).progress) and p.last_checkpoint, 120, "a checkpoint")
    submitted = at(next(e for e in events(hub, job) if e["kind"] == "requested"))
    fresh = first_step(client, job, 1)
    assert fresh is not None
    held = {a.uuid for a in client.job(job).allocations}
    gpus = declared_fake_gpus(DECLARED)
    faulted = time.time()
    write_control(
        hub.fake_nvml_control,
        [replace(g, xid_events=[79]) if g.uuid == min(held) else g for g in gpus],
    )
    resumed = wait_for(lambda: first_step(client, job, 2), 180, "the first step after resume")
    log = "".join(client.logs(job, rank=0)) + "".join(client.logs(job, rank=1))
    sigterms = [float(t) for t in re.findall(r"SIGTERM at ([\d.]+)", log)]
    seen = events(hub, job)

    def when(kind: str) -> float:
        return at(next(e for e in seen if e["kind"] == kind and at(e) >= faulted - 1))

    client.cancel(job)
    client.wait(job, timeout=120)
    write_control(hub.fake_nvml_control, gpus)
    for node in hub.controller("GET", "/nodes").json()["items"]:
        if node["cordoned"]:
            hub.controller("POST", f"/nodes/{node['name']}/uncordon")
    return {
        "detect": when("job-fault") - faulted,
        "SIGTERM": max(sigterms) - faulted,
        "stop": when("job-restarting") - when("job-fault"),
        "back-off + reschedule": when("admitted") - when("job-restarting"),
        "start": when("started") - when("admitted"),
        "load checkpoint": resumed - when("started"),
        "fault to first step": resumed - faulted,
        "first start (baseline)": fresh - submitted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        hub = Hub.create(Path(tmp) / "hub", extra_config=PRODUCT_BACKOFF)
        try:
            hub.start()
            with Client(hub.controller_api, hub.user_token("alice")) as client:
                rounds = [one_round(hub, client, i) for i in range(args.rounds)]
        except AssertionError:
            print(hub.log_path.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            hub.kill_everything()
    print(f"XID 79 on a 2-pod job's GPU, {args.rounds} rounds (median, min-max, seconds)")
    for part in rounds[0]:
        values = [r[part] for r in rounds]
        print(f"  {part:24} {statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})")
    resume = statistics.median(r["fault to first step"] for r in rounds)
    fresh = statistics.median(r["first start (baseline)"] for r in rounds)
    print(f"  resume / first start     {resume / fresh:7.2f}")
    print(f"fault to action within 5 s: {all(r['SIGTERM'] <= 5 for r in rounds)}")


if __name__ == "__main__":
    main()
