"""The node agent's pod keeper under whatever a job asks for: a pod that cannot start as
asked ends alone, failed with a reason that says what to change, and the keeper goes on
(it raised out of the agent's loop before, and the agent exited)."""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.job_launch import JobRefused, PodPlace, RankSandbox, check_spec
from gpufleet.agent.jobs import PodKeeper
from gpufleet.agent.progress import RankReport
from gpufleet.agent.runner import RankRunner, RankSpec
from gpufleet.api.jobs import PodProgressIn
from gpufleet.snapshotter.sandbox import SandboxMode, SandboxSupport

ACCOUNT = {"uid": 200_123, "gid": 200_123, "mode": "sandbox"}


def keeper(tmp_path: Path) -> PodKeeper:
    """A keeper whose node passes every check before the job's own: a sandbox, a base
    environment, a home for its user."""
    base = tmp_path / "session-env"
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python").write_text("")
    sandbox = RankSandbox(
        SandboxSupport(SandboxMode.READONLY, "not probed: the job is refused first"),
        base,
        tmp_path / "prefix",
        str(tmp_path / "homes" / "{username}"),
        checkpoint_root=tmp_path / "checkpoints",
    )
    return PodKeeper(tmp_path / "jobs", logging.getLogger("test"), {}, sandbox)


def desired(workload_id: int, **spec: Any) -> dict[str, Any]:
    return {
        "workload_id": workload_id,
        "pod_index": 0,
        "pods": 1,
        "gpus_per_pod": 1,
        "node": "gpu-node-a",
        "gpu_uuids": ["GPU-a"],
        "marker": f"marker-{workload_id}",
        "run": True,
        "started": False,
        "username": "alice",
        "name": f"job-{workload_id}",
        "spec": {"script": "print(1)", "script_name": "train.py", **spec},
        "account": ACCOUNT,
        "attempt": 1,
    }


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"checkpoint_uri": "/etc"}, "checkpoint_uri /etc must be in "),
    ({"checkpoint_uri": "file:///etc"}, "only s3:// locations and local directories"),
    ({"checkpoint_uri": "/tmp/../etc"}, "without .. parts"),
    ({"env": {"A=B": "x"}}, "env: 'A=B' is not a variable name"),
    ({"env": {"A": "x\0y"}}, "env: the value of A holds a NUL character"),
    ({"script_name": "../../../etc/cron.d/x.py"}, "must be a plain file name"),
    ({"python": "python3"}, "must be an absolute path"),
    ({"python": "/usr/bin/python3\0"}, "python holds a control character"),
    ({"cwd": "/home\0"}, "cwd holds a control character"),
    ({"args": ["--lr", "1\0"]}, "args[1] holds a NUL character"),
]


async def test_a_pod_that_cannot_start_as_asked_fails_alone_and_the_keeper_goes_on(
    tmp_path: Path,
) -> None:
    pods = keeper(tmp_path)
    hostile = [desired(100 + i, **spec) for i, (spec, _) in enumerate(HOSTILE)]
    broken = desired(99)
    del broken["gpus_per_pod"]  # what no controller sends: the agent's own trouble
    await pods.apply([*hostile, broken])

    reported, _ = pods.report()
    reasons = {p["workload_id"]: (p["state"], p["reason"]) for p in reported}
    for i, (_, expected) in enumerate(HOSTILE):
        state, reason = reasons[100 + i]
        assert state == "failed" and reason.startswith("could not start: "), reason
        assert expected in reason, reason
    assert reasons[99][0] == "failed"
    assert reasons[99][1].startswith(
        "this node could not start it: the node agent failed preparing it (KeyError"
    )
    assert not list((tmp_path / "jobs").glob("*/pod-*/pod.json"))  # none of them started

    await pods.apply([])  # the controller took note: every one is forgotten
    assert pods.known() == []


@pytest.mark.parametrize(("spec", "expected"), HOSTILE[3:])
def test_what_no_node_could_pass_on_as_asked_is_refused_before_anything_is_made(
    spec: dict[str, Any], expected: str
) -> None:
    with pytest.raises(JobRefused) as refused:
        check_spec({"script": "", "script_name": "train.py", **spec}, ["/home/alice"])
    assert expected in str(refused.value)


def test_a_plain_spec_passes() -> None:
    check_spec(
        {
            "script_name": "train.py",
            "python": "/opt/env/bin/python",
            "cwd": "/home/alice",
            "args": ["--lr", "0.1"],
            "env": {"NCCL_DEBUG": "INFO", "_X1": ""},
            "checkpoint_uri": "/home/alice/ckpt",
        },
        ["/home/alice"],
    )


@pytest.mark.parametrize(
    ("launcher_says", "error_file", "reason"),
    [
        # torchrun's summary as a rank could fake it, with a rank number int() refuses
        (f"rank : {'9' * 5000} (local_rank: 0)", "{}", "rank : 999"),
        # the error file torchrun gave the rank, nested deeper than json can read
        ("rank : 0 (local_rank: 0)", "[" * 60_000, "rank : 0 (local_rank: 0)"),
    ],
)
def test_what_a_failed_pods_ranks_wrote_never_stops_the_keeper(
    tmp_path: Path, launcher_says: str, error_file: str, reason: str
) -> None:
    """A pod's ranks write its error file and may fake its launcher's output: its end is
    reported all the same (here taken over from an agent before, as after a restart)."""
    pods = keeper(tmp_path)
    place = PodPlace(pods.jobs_dir, 7, 0, 1)
    attempt = place.ranks_dir / "run" / "attempt_0" / "0"
    attempt.mkdir(parents=True)
    (attempt / "error.json").write_text(error_file)
    writes = f"import sys\nprint('Root Cause\\n{launcher_says}', file=sys.stderr)\nsys.exit(1)\n"
    marker = "marker-7.0"
    record = {
        "workload_id": 7,
        "pod_index": 0,
        "attempt": 1,
        "first_rank": 0,
        "local_ranks": 1,
        "marker": marker,
        "grace_s": 1.0,
        "uid": 200_123,
        "port": None,
        "checkpoint_uri": "",
    }
    (place.directory / "pod.json").write_text(json.dumps(record))
    RankRunner(pods.runner.log_dir, inherit=False).start(
        RankSpec(place.rank_id, (sys.executable, "-c", writes), marker=marker)
    )
    pods.recover()  # running still, or ended already: either way the keeper's now
    deadline = time.monotonic() + 30
    while (reported := pods.report()[0]) == [] or reported[0]["state"] == "running":
        assert time.monotonic() < deadline, reported
        time.sleep(0.05)
    assert (reported[0]["state"], reported[0]["exit_code"]) == ("exited", 1)
    assert reported[0]["reason"].startswith(reason)


def test_progress_kept_over_failed_syncs_stays_within_what_the_controller_takes(
    tmp_path: Path,
) -> None:
    pods = keeper(tmp_path)
    now = datetime.now(UTC)
    full = {"step": 10, "epoch": 1, "step_age_s": 0.0, "step_times_s": [0.1] * 512}
    pods.note_progress((7, 0), RankReport.model_validate(full), now)
    for _ in range(3):  # three syncs fail, and more comes in between each
        taken = pods.take_progress()
        pods.note_progress(
            (7, 0), RankReport.model_validate({**full, "step": 11, "epoch": None}), now
        )
        pods.restore_progress(taken)
    (sent,) = pods.take_progress()
    assert len(sent["step_times_s"]) == 512  # PodProgressIn's bound: more is a 422
    PodProgressIn.model_validate_json(json.dumps({**sent, "workload_id": 7, "pod_index": 0}))
    assert (sent["step"], sent.get("epoch")) == (11, None)  # the newer step's, not 1
