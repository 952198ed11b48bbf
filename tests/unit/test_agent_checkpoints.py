"""The node agent's part in a job's checkpoints and errors: each user's S3 credentials
from a file only the agent may read, given to that user's ranks alone; and the failing
rank's exception read from the error file torchrun gave it, never through a link."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.agent.checkpoints import (
    CredentialsFileError,
    checkpoint_credentials,
    load_checkpoint_credentials,
)
from gpufleet.agent.job_launch import RankSandbox
from gpufleet.agent.job_logs import rank_error
from gpufleet.agent.runner import RunnerError
from gpufleet.snapshotter.sandbox import SandboxMode, SandboxSupport

KEYS = {
    "alice": {"access_key": "AKA", "secret_key": "SKA"},
    "bob": {"access_key": "AKB", "secret_key": "SKB"},
}


def sandbox(**kw: object) -> RankSandbox:
    support = SandboxSupport(SandboxMode.NONE, "not probed in these tests")
    base = RankSandbox(support, Path("/env"), Path("/prefix"), "/home/{username}")
    return replace(base, **kw)  # type: ignore[arg-type]


def test_a_rank_gets_its_users_s3_credentials_and_no_one_elses() -> None:
    node = sandbox(s3_credentials=KEYS, s3_endpoint="http://127.0.0.1:9000", s3_region="eu-west-1")
    assert checkpoint_credentials("s3://ckpt/jobs/alice/train", "alice", node) == {
        "AWS_ACCESS_KEY_ID": "AKA",
        "AWS_SECRET_ACCESS_KEY": "SKA",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    }
    assert checkpoint_credentials("/home/alice/ckpt", "alice", node) == {}  # local: none
    with pytest.raises(RunnerError, match="no S3 checkpoint credentials for carol"):
        checkpoint_credentials("s3://ckpt/jobs/carol/train", "carol", node)


def test_the_credentials_file_must_be_the_agents_alone_and_well_formed(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps(KEYS))
    path.chmod(0o600)
    assert load_checkpoint_credentials(path) == KEYS
    path.chmod(0o640)
    with pytest.raises(CredentialsFileError, match="readable by it alone"):
        load_checkpoint_credentials(path)
    path.chmod(0o600)
    path.write_text(json.dumps({"alice": {"access_key": "AKA"}}))
    with pytest.raises(CredentialsFileError, match="'alice' needs an access_key and a secret_key"):
        load_checkpoint_credentials(path)
    path.write_text("{not json")
    with pytest.raises(CredentialsFileError, match="is not JSON"):
        load_checkpoint_credentials(path)
    with pytest.raises(CredentialsFileError, match="cannot read"):
        load_checkpoint_credentials(tmp_path / "missing.json")


def error_file(ranks: Path, local_rank: int, content: str, attempt: int = 0) -> Path:
    where = ranks / "run-1" / f"attempt_{attempt}" / str(local_rank)
    where.mkdir(parents=True)
    (where / "error.json").write_text(content)
    return where / "error.json"


def test_the_failing_ranks_exception_comes_from_its_torchrun_error_file(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    recorded = {"message": {"message": "ValueError: lr < 0", "extraInfo": {"py_callstack": "..."}}}
    error_file(ranks, 1, json.dumps(recorded))
    assert rank_error(ranks, 1) == "ValueError: lr < 0"
    assert rank_error(ranks, 0) == ""  # it wrote none
    error_file(ranks, 0, json.dumps({"message": "RuntimeError: new format"}), attempt=1)
    assert rank_error(ranks, 0) == "RuntimeError: new format"  # the latest attempt's
    assert rank_error(tmp_path / "nowhere", 0) == ""


def test_an_error_file_that_is_a_link_or_not_torchs_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"message": "the platform's secret"}))
    ranks = tmp_path / "ranks"
    where = ranks / "run-1" / "attempt_0" / "0"
    where.mkdir(parents=True)
    os.symlink(secret, where / "error.json")
    assert rank_error(ranks, 0) == ""
    error_file(ranks, 1, "not json at all")
    assert rank_error(ranks, 1) == ""
    error_file(ranks, 2, json.dumps(["a", "list"]))
    assert rank_error(ranks, 2) == ""
