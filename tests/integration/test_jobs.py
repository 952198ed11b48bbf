"""Training jobs on the local backend, end to end: the SDK submits to the real controller,
the scheduler places the gang, the node agent runs each pod under torchrun (CPU PyTorch,
gloo) and sends each rank's output back; cancel and failures end every rank before the
GPUs go back."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.client import ApiError, Client

from .harness import Hub, pids_with_env, wait_for

pytestmark = pytest.mark.integration

ALL_REDUCE = textwrap.dedent(
    """
    import os, pathlib, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']} sum {total.item():.0f} "
          f"gpus {os.environ['CUDA_VISIBLE_DEVICES']} args {sys.argv[1:]}")
    if rank == 0:
        out = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_URI"]) / "step-1.txt"
        out.write_text("checkpoint of step 1")
    print(f"rank {rank} done", file=sys.stderr)
    dist.destroy_process_group()
    """
)


@pytest.fixture
def alice(fleet: Hub) -> Iterator[Client]:
    with Client(fleet.controller_api, fleet.user_token("alice")) as client:
        yield client


def submit(client: Client, script: str, **options: object) -> int:
    defaults: dict[str, object] = {"gpus": 2, "gpu_type": "A100-80GB", "project": "vision"}
    job = client.submit(script, **{**defaults, **options})
    return job.id


def test_a_two_rank_job_all_reduces_and_keeps_each_ranks_output(fleet: Hub, alice: Client) -> None:
    job_id = submit(alice, ALL_REDUCE, name="allreduce", args=["--lr", "0.1"])
    job = alice.wait(job_id, timeout=120)
    assert (job.state, job.outcome) == ("ended", "succeeded"), job.reason
    assert job.reason == "all 2 rank(s) exited with code 0"
    assert [p.state for p in job.pod_states] == ["exited"] and job.pod_states[0].exit_code == 0
    outputs = ["".join(alice.logs(job_id, rank=rank)) for rank in (0, 1)]
    for rank, output in enumerate(outputs):
        assert f"rank {rank}/2 local {rank} sum 3 " in output
        assert "args ['--lr', '0.1']" in output
    # Each rank sees the pod's two GPUs, as torchrun hands them on.
    assert outputs[0].split("gpus ")[1].split()[0].count(",") == 1
    assert "rank 1 done" in "".join(alice.logs(job_id, rank=1, stream="stderr"))
    checkpoint = Path(job.checkpoint_uri)
    assert checkpoint.parts[-2:] == ("alice", "allreduce")
    assert (checkpoint / "step-1.txt").read_text() == "checkpoint of step 1"
    kinds = [e.kind for e in alice.events(workload_id=job_id)]
    assert {"requested", "admitted", "started", "job-pod-ended", "ended"} <= set(kinds)
    assert not job.allocations  # every GPU went back


PROGRESS = textwrap.dedent(
    """
    import os, pathlib, time
    import gpufleet

    rank = int(os.environ["RANK"])
    checkpoints = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_URI"])
    for step in range(1, 31):
        time.sleep(0.02)
        gpufleet.progress(step, loss=1.0 / step)
        if step % 10 == 0:
            gpufleet.checkpoint_started(step)
            out = checkpoints / f"step-{step}.txt"
            if rank == 0:
                out.write_text(f"checkpoint of step {step}")
            gpufleet.checkpoint_saved(str(out), step)
    print(f"rank {rank} trained")
    """
)


def test_a_job_reports_its_steps_and_checkpoints_through_its_node_agent(
    fleet: Hub, alice: Client
) -> None:
    job_id = submit(alice, PROGRESS, name="progress")
    job = alice.wait(job_id, timeout=120)
    assert job.outcome == "succeeded", job.reason
    progress = job.progress
    assert progress is not None
    assert progress.last_step == 30
    assert progress.metrics == {"loss": 1.0 / 30}
    assert progress.step_time_p50_s is not None and 0.01 < progress.step_time_p50_s < 1
    assert progress.checkpoint_in_flight is None
    assert progress.last_checkpoint is not None and progress.last_checkpoint.step == 30
    assert Path(progress.last_checkpoint.uri).read_text() == "checkpoint of step 30"
    # Counted, not an event each (the job's one pod reports through rank 0).
    assert progress.checkpoints_saved == 3 and progress.checkpoints_saved_by_attempt == {1: 3}
    kinds = {e.kind for e in alice.events(workload_id=job_id)}
    assert "job-checkpoint-saved" not in kinds and {"started", "ended"} <= kinds


EPOCH_COUNTER = textwrap.dedent(
    """
    import time
    import gpufleet

    for epoch in range(2):
        for step in range(150):  # 15 s an epoch, past the hang limit here (10 s)
            time.sleep(0.1)
            gpufleet.progress(step, epoch=epoch, loss=1.0)
    print("trained", flush=True)
    """
)


def test_a_step_counter_that_restarts_every_epoch_is_not_taken_for_a_hang(
    fleet: Hub, alice: Client
) -> None:
    job_id = submit(alice, EPOCH_COUNTER, name="epochs", env={"GPUFLEET_PROGRESS_INTERVAL": "1"})
    job = alice.wait(job_id, timeout=180)
    assert (job.outcome, job.attempt, job.faults) == ("succeeded", 1, 0), job.reason
    progress = job.progress
    assert progress is not None
    assert (progress.last_epoch, progress.last_step) == (1, 149)
    # Step times only within an epoch: about 0.1 s, never an epoch's length.
    assert progress.step_time_p99_s is not None and progress.step_time_p99_s < 1
    assert not [e for e in alice.events(workload_id=job_id) if e.kind == "job-fault"]


def test_a_gang_of_two_pods_is_one_world(fleet: Hub, alice: Client) -> None:
    job_id = submit(alice, ALL_REDUCE, gpus=2, gpus_per_pod=1)
    job = alice.wait(job_id, timeout=120)
    assert job.outcome == "succeeded", job.reason
    assert job.pods == 2 and [p.ranks for p in job.pod_states] == [[0], [1]]
    # Both pods in one zone, as every gang.
    assert "rank 1/2 local 0 sum 3" in "".join(alice.logs(job_id, rank=1))


def test_a_failing_rank_fails_the_job_with_its_error(fleet: Hub, alice: Client) -> None:
    script = ALL_REDUCE.replace(
        'dist.init_process_group("gloo")',
        'dist.init_process_group("gloo")\n'
        'if dist.get_rank() == 1:\n    raise RuntimeError("loss is nan at step 7")',
    )
    job = alice.wait(submit(alice, script), timeout=120)
    assert job.outcome == "failed"
    assert "rank 1: RuntimeError: loss is nan at step 7" in job.reason, job.reason
    failed = [e for e in alice.events(workload_id=job.id) if e.kind == "job-failed"]
    assert failed and "RuntimeError: loss is nan" in failed[0].message


RECORDS_ITS_ERROR = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    # What a library prints on the way out: the last line of stderr is not the error.
    atexit.register(lambda: print("dataloader workers shut down", file=sys.stderr))

    @record
    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("learning rate must be positive, got -0.1")
        dist.barrier()

    main()
    """
)


def test_a_ranks_error_comes_from_torchruns_error_file_and_is_not_retried(
    fleet: Hub, alice: Client
) -> None:
    job = alice.wait(submit(alice, RECORDS_ITS_ERROR), timeout=120)
    assert (job.outcome, job.attempt) == ("failed", 1)
    assert "rank 1: ValueError: learning rate must be positive, got -0.1" in job.reason
    assert "not retried" in job.reason, job.reason
    stderr = "".join(alice.logs(job.id, rank=1, stream="stderr"))
    assert stderr.rstrip().endswith("dataloader workers shut down")


LOOPS_UNTIL_SIGTERM = textwrap.dedent(
    """
    import os, signal, sys, time

    def checkpoint(signum, frame):
        print(f"rank {os.environ['RANK']} saving a checkpoint", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, checkpoint)
    print(f"rank {os.environ['RANK']} pid {os.getpid()} training", flush=True)
    while True:
        time.sleep(0.1)
    """
)


def test_cancel_signals_every_rank_and_releases_the_gpus_only_once_they_are_gone(
    fleet: Hub, alice: Client
) -> None:
    job_id = submit(alice, LOOPS_UNTIL_SIGTERM)

    def training() -> list[int] | None:
        pids = []
        for rank in (0, 1):
            output = "".join(alice.logs(job_id, rank=rank))
            if "training" not in output:
                return None
            pids.append(int(output.split(" pid ")[1].split()[0]))
        return pids

    pids = wait_for(training, 120, "both ranks training")
    assert alice.job(job_id).state == "running"
    cancelled = alice.cancel(job_id)
    assert cancelled.state in ("stopping", "ended")
    job = alice.wait(job_id, timeout=60)
    assert job.outcome == "cancelled" and job.reason.startswith("cancelled by alice")
    # (The pids the ranks print are their sandbox's; on the host they are found by the job.)
    assert len(pids) == 2
    assert not [p for p in pids_with_env("GPUFLEET_JOB_ID", str(job_id)) if _alive(p)]
    for rank in (0, 1):
        assert f"rank {rank} saving a checkpoint" in "".join(alice.logs(job_id, rank=rank))
    # The GPUs are free again: a 4-GPU session fits on either node.
    fleet.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=4)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_logs_follow_a_running_job_until_it_ends(fleet: Hub, alice: Client) -> None:
    script = (
        "import time\nfor i in range(3):\n    print('step', i, flush=True)\n    time.sleep(1)\n"
    )
    job_id = submit(alice, script, gpus=1)
    followed = "".join(alice.logs(job_id, follow=True))
    assert followed.split() == ["step", "0", "step", "1", "step", "2"]
    assert alice.job(job_id).state == "ended"


def test_bad_submissions_say_what_to_fix_and_record_nothing(fleet: Hub, alice: Client) -> None:
    before = len(alice.jobs())
    cases = {
        "3 GPUs do not split into pods of 2": {"gpus": 3, "gpus_per_pod": 2},
        "is not a member of project 'nope'": {"project": "nope"},
        "a job runs inside one zone and the largest zone has 4": {"gpus": 8},
        "unknown priority class 'urgent'": {"priority": "urgent"},
    }
    for message, options in cases.items():
        with pytest.raises(ApiError) as raised:
            submit(alice, ALL_REDUCE, **options)
        assert raised.value.status == 400 and message in raised.value.message
    assert len(alice.jobs()) == before


def test_a_researcher_sees_and_cancels_only_their_own_jobs(fleet: Hub, alice: Client) -> None:
    job_id = submit(alice, LOOPS_UNTIL_SIGTERM)
    with Client(fleet.controller_api, fleet.user_token("bob")) as bob:
        assert job_id not in [j.id for j in bob.jobs()]
        for attempt in (bob.job, bob.cancel, lambda j: list(bob.logs(j))):
            with pytest.raises(ApiError) as raised:
                attempt(job_id)
            assert raised.value.status == 404
    assert alice.cancel(job_id).outcome == "cancelled"


def test_the_cli_submits_waits_lists_shows_logs_and_cancels(fleet: Hub, tmp_path: Path) -> None:
    from .test_sdk_cli import cli

    token, api = fleet.user_token("alice"), fleet.controller_api
    script = tmp_path / "train.py"
    script.write_text(ALL_REDUCE)
    submitted = cli(
        "submit", "--gpus", "2", "--gpu-type", "A100-80GB", "--project", "vision",
        "--name", "from-cli", "--wait", str(script), "--epochs", "3",
        token=token, api_url=api,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = int(submitted.stdout.split()[1])
    assert f"gpufleet logs {job_id} -f" in submitted.stdout  # the next useful commands
    assert f"job {job_id} succeeded: all 2 rank(s) exited with code 0" in submitted.stdout
    listed = cli("jobs", "--json", token=token, api_url=api)
    assert [j["name"] for j in json.loads(listed.stdout) if j["id"] == job_id] == ["from-cli"]
    logs = cli("logs", str(job_id), "--rank", "1", token=token, api_url=api)
    assert "rank 1/2 local 1 sum 3 " in logs.stdout and "'--epochs', '3'" in logs.stdout

    script.write_text(LOOPS_UNTIL_SIGTERM)
    queued = cli(
        "submit", "--gpus", "1", "--gpu-type", "A100-80GB", "--project", "vision", "--json",
        str(script), token=token, api_url=api,
    )  # fmt: skip
    looping = json.loads(queued.stdout)[0]["id"]
    cancelled = cli("cancel", str(looping), token=token, api_url=api)
    assert cancelled.returncode == 0 and f"job {looping}" in cancelled.stdout
    followed = cli("logs", str(looping), "-f", token=token, api_url=api)
    assert followed.returncode == 5 and f"job {looping} cancelled" in followed.stdout
    refused = cli("cancel", "999999", token=token, api_url=api)
    assert refused.returncode == 3 and "there is no job 999999" in refused.stderr


def test_a_notebook_trains_with_the_magics_without_blocking_its_kernel(
    fleet: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("GPUFLEET_API_URL", fleet.controller_api)
    monkeypatch.setenv("GPUFLEET_TOKEN", fleet.user_token("alice"))
    cells = [
        "%load_ext gpufleet",
        "%%train --gpus 2 --gpu-type A100-80GB --project vision --name nb-allreduce\n" + ALL_REDUCE,
        "print('the kernel is free:', 6 * 7)",
        "from gpufleet.client import Client\n"
        "with Client() as fleet:\n"
        "    job = [j for j in fleet.jobs() if j.name == 'nb-allreduce'][0]\n"
        "    job = fleet.wait(job, timeout=120)\n"
        "    print(job.outcome, ''.join(fleet.logs(job, rank=1)))",
        "%logs 999999",
        "%%train --gpus 3 --gpu-type A100-80GB --project vision --pods 2\nprint('never')",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(
        notebook, timeout=180, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()  # fmt: skip

    def text(index: int) -> str:
        return "".join(
            o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", "")
            for o in notebook.cells[index].outputs
        )

    assert "job" in text(1) and "nb-allreduce" in text(1)
    assert text(2) == "the kernel is free: 42\n"
    assert text(3).startswith("succeeded") and "rank 1/2 local 1 sum 3 " in text(3)
    # Errors are messages, not tracebacks.
    assert "there is no job 999999" in text(4)
    assert "--pods 2 must divide --gpus 3" in text(5)
    assert all("Traceback" not in text(i) for i in (4, 5))
    # The table under %%train followed the job to its end (display updates by id).
    assert "succeeded" in text(1), text(1)


def test_the_jobs_pages_show_a_researchers_job_its_output_and_cancel_it(
    fleet: Hub, alice: Client
) -> None:
    from playwright.sync_api import expect

    from . import browser as ui

    job_id = submit(alice, LOOPS_UNTIL_SIGTERM, name="page-job")
    with ui.chromium() as chromium:
        context = ui.new_context(chromium, fleet.url)
        try:
            page = ui.login(context, "alice")
            page.goto("/services/gpufleet/")
            page.locator("#jobs-link").click()
            row = page.locator(f"tr[data-job='{job_id}']")
            expect(row).to_contain_text("page-job")
            row.get_by_role("link", name=str(job_id)).click()
            # The page reloads itself while the job runs: rank 0's output appears.
            expect(page.locator("#log")).to_contain_text("rank 0 pid", timeout=90_000)
            # Where its rank is, taken on demand: the page shows it once the agent answered.
            page.get_by_role("button", name="Take every rank's stacks now").click()
            stacks = page.locator("#stacks .trace").first
            expect(stacks).to_contain_text("asked by alice", timeout=30_000)
            expect(stacks).to_contain_text("in <module> (train.py:", timeout=30_000)
            page.get_by_role("button", name="Cancel this job").click()
            expect(page.locator("#state")).to_contain_text("cancelled", timeout=60_000)
            expect(page.locator("#log")).to_contain_text("rank 0 saving a checkpoint")
        finally:
            context.close()
    with Client(fleet.controller_api, fleet.user_token("bob")) as bob:
        assert job_id not in [j.id for j in bob.jobs()]


def test_a_borrowing_job_is_preempted_for_a_guarantee_checkpoints_and_comes_back(
    fleet: Hub, alice: Client
) -> None:
    # nlp's guarantee is 4 and it may borrow vision's idle 4: two 4-GPU nlp jobs fill the
    # fleet, one of them on borrowed GPUs. bob asks within vision's guarantee.
    first = submit(alice, LOOPS_UNTIL_SIGTERM, gpus=4, project="nlp", name="nlp-a")
    second = submit(alice, LOOPS_UNTIL_SIGTERM, gpus=4, project="nlp", name="nlp-b")
    wait_for(
        lambda: all(
            "training" in "".join(alice.logs(j, rank=rank))
            for j in (first, second)
            for rank in range(4)
        ),
        120,
        "every rank of both nlp jobs training",
    )
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("bob", timeout=180)

    jobs = {j: alice.job(j) for j in (first, second)}
    # The victim is back in the queue as its next attempt, with nothing spent.
    preempted = [j for j in jobs.values() if j.attempt == 2]
    assert len(preempted) == 1, {j.id: (j.state, j.attempt) for j in jobs.values()}
    victim = preempted[0]
    assert (victim.state, victim.faults) == ("pending", 0), victim.reason
    survivor = next(j for j in jobs.values() if j.id != victim.id)
    assert survivor.state == "running"
    # Its ranks got the checkpoint signal before they were stopped.
    for rank in range(4):
        output = "".join(alice.logs(victim.id, rank=rank))
        assert f"rank {rank} saving a checkpoint" in output, output
    bob = fleet.workload_of("bob")
    assert bob is not None and len(bob["allocations"]) == 4
    assert {a["uuid"] for a in bob["allocations"]}.isdisjoint(
        {a.uuid for a in survivor.allocations}
    )
    # Once bob's GPUs are free again it runs again by itself, and its log says why.
    fleet.stop_server("bob", "")
    wait_for(
        lambda: "".join(alice.logs(victim.id)).count("training") == 2,
        120,
        "the preempted job training again",
    )
    again = alice.job(victim.id)
    assert (again.state, again.attempt) == ("running", 2)
    output = "".join(alice.logs(victim.id))
    assert "--- gpufleet: attempt 2: the pod was stopped (Preempted)" in output, output


def test_a_jobs_page_charts_each_of_its_gpus_from_the_agents_samples(
    fleet: Hub, alice: Client
) -> None:
    import xml.etree.ElementTree as ET

    import httpx

    job_id = submit(alice, "import time\nprint('sleeping', flush=True)\ntime.sleep(8)\n")
    uuids = wait_for(lambda: {a.uuid for a in alice.job(job_id).allocations}, 60, "the job placed")
    assert len(uuids) == 2
    page = f"{fleet.url}/services/gpufleet/jobs/{job_id}"
    headers = {"Authorization": f"token {fleet.user_token('alice')}"}
    svg = "{http://www.w3.org/2000/svg}"

    def lines_with_points() -> dict[str, int] | None:
        html = httpx.get(page, headers=headers, timeout=30).raise_for_status().text
        start, end = html.find('<svg class="gpu-chart"'), html.find("</svg>")
        if start < 0:
            return None
        chart = ET.fromstring(html[start : end + len("</svg>")])
        drawn = {
            line.get("data-gpu", ""): len(line.get("points", "").split())
            for line in chart.iter(f"{svg}polyline")
            if line.get("class") == "series utilization"
        }
        # Samples arrive every 0.5 s here: wait until each GPU's line has a few.
        return drawn if len(drawn) == 2 and min(drawn.values()) >= 3 else None

    drawn = wait_for(lines_with_points, 60, "the job page charting both GPUs", interval=0.5)
    assert set(drawn) == uuids
    html = httpx.get(page, headers=headers, timeout=30).text
    assert html.count('class="legend"') == 2 and " UTC</text>" in html
    assert alice.wait(job_id, timeout=60).outcome == "succeeded"
