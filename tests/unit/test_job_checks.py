"""What a job submission may ask of a node: the checks at submit (a 400 saying what to
change) and the rule for which checkpoints are a job's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.hub.api.job_checks import interpreter_problem
from gpufleet.recovery.checkpoints import location_problem, within
from gpufleet.recovery.job_spec import launch_problems

PLACES = ["/data/homes/alice", "/data/checkpoints/alice"]


def problems(**fields: object) -> list[str]:
    launch: dict[str, object] = {
        "script_name": "train.py",
        "env": {},
        "args": [],
        "python": "",
        "cwd": "",
        "checkpoint_uri": "",
        "checkpoint_places": PLACES,
    }
    return launch_problems(**{**launch, **fields})  # type: ignore[arg-type]


def test_a_plain_submission_has_no_problem() -> None:
    assert (
        problems(
            env={"NCCL_DEBUG": "INFO", "PATH": "/usr/bin"},
            args=["--lr", "0.1", ""],
            python="/opt/env/bin/python",
            cwd="/data/homes/alice/project",
            checkpoint_uri="/data/checkpoints/alice/run-1",
        )
        == []
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"env": {"A=B": "x"}}, "env: 'A=B' is not a variable name"),
        ({"env": {"A\0": "x"}}, "env: 'A\\x00' is not a variable name"),
        ({"env": {"1A": "x"}}, "env: '1A' is not a variable name"),
        ({"env": {"A": "x\0"}}, "env: the value of A holds a NUL character"),
        ({"args": ["ok", "b\0d"]}, "args[1] holds a NUL character"),
        ({"python": "python3"}, "python 'python3' must be an absolute path"),
        ({"python": "/usr/bin/python3\n"}, "python holds a control character"),
        ({"cwd": "work"}, "cwd 'work' must be an absolute path"),
        ({"checkpoint_uri": "/etc"}, "checkpoint_uri /etc must be in /data/homes/alice or"),
        ({"checkpoint_uri": "/data/homes/bob"}, "checkpoint_uri /data/homes/bob must be in"),
        ({"checkpoint_uri": "/data/homes/alice/../bob"}, "without .. parts"),
        ({"checkpoint_uri": "relative/dir"}, "must be an absolute path"),
        ({"checkpoint_uri": "gs://bucket/x"}, "only s3:// locations and local directories"),
        ({"checkpoint_uri": "s3:///x"}, "must be s3://<bucket>/<prefix>"),
        ({"checkpoint_uri": "s3://b/x/../y"}, "without . or .. parts"),
        ({"script_name": "../x.py"}, "script_name '../x.py' must be a plain file name"),
        ({"script_name": ".."}, "script_name '..' must be a plain file name"),
    ],
)
def test_what_a_node_could_not_run_as_asked_is_refused_saying_what_to_change(
    fields: dict[str, object], expected: str
) -> None:
    found = problems(**fields)
    assert len(found) == 1 and expected in found[0], found


def test_an_interpreter_every_sandbox_shows_must_be_an_executable_file(tmp_path: Path) -> None:
    assert "is not an executable file" in str(interpreter_problem("/etc/passwd"))
    assert "is not an executable file" in str(interpreter_problem("/usr/bin"))
    assert interpreter_problem(os.path.realpath("/bin/sh")) is None
    # Only the job's own environment may hold it: left to the node, whose launcher exits
    # 127 (a user error, not retried) if it is nowhere.
    assert interpreter_problem("/opt/gpufleet/env/bin/python") is None
    # Nothing outside what a sandbox shows is looked at: no answer says whether a file of
    # another user's, or of the platform's, is there.
    assert interpreter_problem(str(tmp_path)) is None
    assert interpreter_problem("/root") is None
    assert interpreter_problem("/usr/../root") is None


def test_a_checkpoint_is_the_jobs_own_only_inside_its_location() -> None:
    local = "/data/checkpoints/alice/train"
    assert within("/data/checkpoints/alice/train/step-9", local)
    assert within(local, local)
    assert not within("/data/checkpoints/alice/train-2/step-9", local)
    assert not within("/data/checkpoints/alice/train/../../bob/train/step-9", local)
    assert not within("/data/homes/alice/step-9", local)
    assert not within("step-9", local)
    assert not within("s3://b/alice/train/step-9", local)
    s3 = "s3://ckpt/alice/train"
    assert within("s3://ckpt/alice/train/step-9", s3)
    assert not within("s3://ckpt/alice/train2/step-9", s3)
    assert not within("s3://other/alice/train/step-9", s3)
    assert not within("s3://ckpt/alice/train/../../bob/x", s3)
    assert within("s3://ckpt/anything", "s3://ckpt")
    assert not within("/x", "")


def test_every_place_is_named_when_a_location_is_refused() -> None:
    assert location_problem("/srv/x", ["/a", "/b/"]) == "checkpoint_uri /srv/x must be in /a or /b"
    assert location_problem("s3://bucket/alice", []) is None
    assert location_problem("/a/b", ["/a"]) is None
