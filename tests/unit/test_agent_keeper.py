"""The node agent's pod keeper under whatever a job asks for: a pod that cannot start as
asked ends alone, failed with a reason that says what to change, and the keeper goes on
(it raised out of the agent's loop before, and the agent exited)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.job_launch import JobRefused, RankSandbox, check_spec
from gpufleet.agent.jobs import PodKeeper
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
    ({"env": {"A=B": "x"}}, "environment name 'A=B' is not a variable name"),
    ({"env": {"A": "x\0y"}}, "environment variable A holds a NUL character"),
    ({"script_name": "../../../etc/cron.d/x.py"}, "must be a plain file name"),
    ({"python": "python3"}, "must be an absolute path"),
    ({"python": "/usr/bin/python3\0"}, "python holds a NUL character"),
    ({"cwd": "/home\0"}, "cwd holds a NUL character"),
    ({"args": ["--lr", "1\0"]}, "an argument holds a NUL character"),
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
    assert "the node agent failed preparing it (KeyError" in reasons[99][1]
    assert not list((tmp_path / "jobs").glob("*/pod-*/pod.json"))  # none of them started

    await pods.apply([])  # the controller took note: every one is forgotten
    assert pods.known() == []


@pytest.mark.parametrize(("spec", "expected"), HOSTILE[3:])
def test_what_no_node_could_pass_on_as_asked_is_refused_before_anything_is_made(
    spec: dict[str, Any], expected: str
) -> None:
    with pytest.raises(JobRefused, match=expected.replace("(", r"\(")):
        check_spec({"script": "", "script_name": "train.py", **spec})


def test_a_plain_spec_passes() -> None:
    check_spec(
        {
            "script_name": "train.py",
            "python": "/opt/env/bin/python",
            "cwd": "/home/alice",
            "args": ["--lr", "0.1"],
            "env": {"NCCL_DEBUG": "INFO", "_X1": ""},
        }
    )
