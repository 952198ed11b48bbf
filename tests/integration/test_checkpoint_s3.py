"""Checkpoints in S3 (a real SeaweedFS): a job's ranks get their user's credentials, which
reach only that user's prefix, so a rank of one researcher cannot read, list or overwrite
another's checkpoints whatever its script does; a user without credentials on the node is
told why the job does not start; a job that loses its node resumes from the checkpoint it
wrote there."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.client import Client
from gpufleet.recovery.fake_nvml import write_control

from ..s3server import CHECKPOINT_BUCKET, CHECKPOINT_USERS, checkpoint_credentials
from .harness import Hub, running_hub
from .test_agent import DECLARED
from .test_recovery import first_checkpoint

if TYPE_CHECKING:
    from ..s3server import S3Server

pytestmark = pytest.mark.integration

PROBES = textwrap.dedent(
    """
    import os
    import boto3, botocore
    from botocore.config import Config

    bucket, _, prefix = os.environ["GPUFLEET_CHECKPOINT_URI"].removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
    s3.put_object(Bucket=bucket, Key=f"{prefix}/step-1", Body=b"my weights")
    mine = s3.get_object(Bucket=bucket, Key=f"{prefix}/step-1")["Body"].read()
    print("own checkpoint written:", mine)
    probes = {
        "read bob's": lambda: s3.get_object(Bucket=bucket, Key="jobs/bob/train/step-9"),
        "list bob's": lambda: s3.list_objects_v2(Bucket=bucket, Prefix="jobs/bob/"),
        "list the bucket": lambda: s3.list_objects_v2(Bucket=bucket),
        "overwrite bob's": lambda: s3.put_object(
            Bucket=bucket, Key="jobs/bob/train/step-9", Body=b"x"
        ),
    }
    for what, probe in probes.items():
        try:
            probe()
            print(what, "ALLOWED")
        except botocore.exceptions.ClientError as e:
            print(what, "denied:", e.response["Error"]["Code"])
    print("AWS variables:", sorted(k for k in os.environ if k.startswith("AWS_")))
    """
)


@pytest.fixture(scope="module")
def s3_hub(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("checkpoints")
    secrets = root / "checkpoint-credentials.json"
    secrets.write_text(json.dumps({u: checkpoint_credentials(u) for u in CHECKPOINT_USERS}))
    secrets.chmod(0o600)
    s3_server.checkpoint_bucket()
    config = f"""
c.FleetController.job_checkpoint_store = "s3://{CHECKPOINT_BUCKET}/jobs/{{user}}/{{job}}"
c.NodeAgent.checkpoint_credentials_file = {str(secrets)!r}
c.NodeAgent.checkpoint_s3_endpoint = {s3_server.endpoint_url!r}
"""
    yield from running_hub(root, config)


def test_a_rank_reaches_its_users_checkpoints_and_no_one_elses(
    s3_hub: Hub, s3_server: S3Server
) -> None:
    admin = s3_server.client()
    admin.put_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/bob/train/step-9", Body=b"bob's")
    with Client(s3_hub.controller_api, s3_hub.user_token("alice")) as alice:
        job = alice.submit(PROBES, gpus=1, gpu_type="A100-80GB", project="vision", name="probe")
        ended = alice.wait(job.id, timeout=180)
        output = "".join(alice.logs(job.id, rank=0))
    assert ended.outcome == "succeeded", (ended.reason, output[-2000:])
    assert ended.checkpoint_uri == f"s3://{CHECKPOINT_BUCKET}/jobs/alice/probe"
    assert "own checkpoint written: b'my weights'" in output
    for probe in ("read bob's", "list bob's", "list the bucket", "overwrite bob's"):
        assert f"{probe} denied: AccessDenied" in output, output
    assert "ALLOWED" not in output
    written = admin.get_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/alice/probe/step-1")
    assert written["Body"].read() == b"my weights"
    bobs = admin.get_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/bob/train/step-9")
    assert bobs["Body"].read() == b"bob's"
    # Alice's own key and secret, and nothing of the platform's or bob's.
    secret = checkpoint_credentials("alice")["secret_key"]
    assert secret not in output and checkpoint_credentials("bob")["access_key"] not in output
    assert "'AWS_ACCESS_KEY_ID', 'AWS_DEFAULT_REGION', 'AWS_ENDPOINT_URL'" in output


def test_a_user_without_checkpoint_credentials_is_told_why_the_job_does_not_start(
    s3_hub: Hub,
) -> None:
    with Client(s3_hub.controller_api, s3_hub.user_token("carol")) as carol:
        job = carol.submit(PROBES, gpus=1, gpu_type="A100-80GB", project="nlp", name="probe")
        ended = carol.wait(job.id, timeout=120)
    assert (ended.outcome, ended.attempt) == ("failed", 1)
    assert "no S3 checkpoint credentials for carol" in ended.reason, ended.reason
    assert "c.NodeAgent.checkpoint_credentials_file" in ended.reason


S3_TRAINING = textwrap.dedent(
    """
    import os, signal, sys, time
    import boto3, torch, torch.distributed as dist
    from botocore.config import Config
    import gpufleet

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))

    def split(uri):
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        return bucket, key

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    resume, start = gpufleet.resume_from(), 0
    if resume:
        bucket, key = split(resume)
        start = int(s3.get_object(Bucket=bucket, Key=key)["Body"].read()) + 1
    print(f"rank {rank} attempt {gpufleet.attempt()} starts at step {start}", flush=True)
    for step in range(start, 100):
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        print(f"rank {rank} step {step}", flush=True)
        gpufleet.progress(step)
        if rank == 0 and step % 10 == 9:
            bucket, prefix = split(os.environ["GPUFLEET_CHECKPOINT_URI"])
            s3.put_object(Bucket=bucket, Key=f"{prefix}/step-{step}", Body=str(step).encode())
            gpufleet.checkpoint_saved(f"s3://{bucket}/{prefix}/step-{step}", step)
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def test_a_job_that_loses_its_node_resumes_from_its_checkpoint_in_s3(
    s3_hub: Hub, s3_server: S3Server
) -> None:
    devices = declared_fake_gpus(DECLARED)
    with Client(s3_hub.controller_api, s3_hub.user_token("alice")) as alice:
        job_id = alice.submit(
            S3_TRAINING,
            gpus=2,
            gpus_per_pod=1,
            gpu_type="A100-80GB",
            project="vision",
            name="s3-survivor",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
        ).id
        checkpoint = first_checkpoint(alice, job_id)
        assert checkpoint.uri.startswith(f"s3://{CHECKPOINT_BUCKET}/jobs/alice/s3-survivor/")
        held = {a.uuid: a.node for a in alice.job(job_id).allocations}
        victim = next(g for g in devices if g.uuid in held)
        try:
            write_control(
                s3_hub.fake_nvml_control,
                [replace(g, xid_events=[79]) if g is victim else g for g in devices],
            )
            ended = alice.wait(job_id, timeout=240)
        finally:
            write_control(s3_hub.fake_nvml_control, devices)
            s3_hub.controller("POST", f"/nodes/{held[victim.uuid]}/uncordon")
        logs = "".join(alice.logs(job_id, rank=0))
    assert (ended.outcome, ended.attempt) == ("succeeded", 2), ended.reason
    after = logs.partition("--- gpufleet: attempt 2: ")[2]
    resumed = re.search(r"rank 0 attempt 2 starts at step (\d+)", after)
    assert resumed is not None and int(resumed.group(1)) > checkpoint.step, after[:500]
    steps = [int(s) for s in re.findall(r"rank 0 step (\d+)", after)]
    assert steps == list(range(int(resumed.group(1)), 100))
    # Attempt 2 read the checkpoint attempt 1 wrote to alice's prefix, and wrote on.
    listed = s3_server.client().list_objects_v2(
        Bucket=CHECKPOINT_BUCKET, Prefix="jobs/alice/s3-survivor/"
    )
    assert f"jobs/alice/s3-survivor/step-{checkpoint.step}" in {
        o["Key"] for o in listed["Contents"]
    }
    assert "jobs/alice/s3-survivor/step-99" in {o["Key"] for o in listed["Contents"]}
