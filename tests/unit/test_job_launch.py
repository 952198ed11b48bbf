"""What a job's rank is started with, as plain values: ``launch_spec`` (a pod's torchrun,
its user, variables, working directory and binds) and ``rank_process`` (the rank
runner's process), each compared whole with what a reader expects, like the session pod's
manifest (``test_kube_manifests.py``). No sandbox, no process, no file is needed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.containment import RankAccount
from gpufleet.agent.job_launch import (
    JobRefused,
    LaunchSpec,
    PodFacts,
    PodPlace,
    RankSandbox,
    asked_cwd,
    check_spec,
    launch_spec,
)
from gpufleet.agent.runner import RankProcess, RankSpec, rank_process
from gpufleet.snapshotter.sandbox import SandboxDirs, SandboxMode, SandboxSupport

SANDBOX = RankSandbox(
    SandboxSupport(SandboxMode.OVERLAY_BWRAP, "probed", bwrap="/usr/bin/bwrap"),
    base_env=Path("/opt/gpufleet/session-env"),
    prefix=Path("/opt/job-env"),
    home_dir_template="/home/{username}",
    read_only=(Path("/var/lib/gpufleet/fake-nvml"),),
    root=(),
    checkpoint_root=Path("/srv/checkpoints"),
    s3_credentials={"alice": {"access_key": "AKIA-alice", "secret_key": "s3cret"}},
    s3_endpoint="http://s3.internal:8333",
)
ALICE = RankAccount("alice", 200_123, 200_123, Path("/home/alice"))
# Pod 1 of job 42's second attempt.
PLACE = PodPlace(Path("/var/lib/gpufleet/jobs"), 42, 1, 2)
FACTS = PodFacts(
    port=29511,
    progress_url="http://127.0.0.1:8004/jobs/progress",
    pinned=Path("/var/lib/gpufleet/pinned/42"),
    checkpoint_dir=Path("/srv/checkpoints/alice"),
    cwd_is_dir=True,
    fake_nvml=Path("/var/lib/gpufleet/fake-nvml"),
)


def desired(**spec: Any) -> dict[str, Any]:
    return {
        "workload_id": 42,
        "pod_index": 1,
        "pods": 2,
        "gpus_per_pod": 2,
        "gpu_uuids": ["GPU-a", "GPU-b"],
        "marker": "m42",
        "name": "llama-ft",
        "resume_from": "/srv/checkpoints/alice/llama/step-100",
        "spec": {
            "script": "print('training')",
            "script_name": "train.py",
            "args": ["--lr", "0.1"],
            "env": {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/tmp"},
            "cwd": "/home/alice/project",
            "checkpoint_uri": "/srv/checkpoints/alice/llama",
            **spec,
        },
    }


POD_DIR = Path("/var/lib/gpufleet/jobs/42/pod-1-attempt-2")
EXPECTED = LaunchSpec(
    account=ALICE,
    argv=(
        "/opt/job-env/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        "--master-port=29511",
        f"--log-dir={POD_DIR}/ranks",
        "--redirects=3",
        "/var/lib/gpufleet/jobs/42/train.py",
        "--lr",
        "0.1",
    ),
    env={
        # the user's basics, then what the job chose (its HOME too), then the platform's,
        # which the job cannot override (its CUDA_VISIBLE_DEVICES is not the pod's GPUs)
        "PATH": "/opt/job-env/bin:/opt/gpufleet/session-env/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "USER": "alice",
        "LOGNAME": "alice",
        "LANG": "C.UTF-8",
        "VIRTUAL_ENV": "/opt/job-env",
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "GPUFLEET_SESSION_MARKER": "m42.1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "PYTHONUNBUFFERED": "1",
        "GPUFLEET_JOB_ID": "42",
        "GPUFLEET_JOB_NAME": "llama-ft",
        "GPUFLEET_POD_INDEX": "1",
        "GPUFLEET_CHECKPOINT_URI": "/srv/checkpoints/alice/llama",
        "GPUFLEET_ATTEMPT": "2",
        "GPUFLEET_RESUME_FROM": "/srv/checkpoints/alice/llama/step-100",
        "GPUFLEET_PROGRESS_URL": "http://127.0.0.1:8004/jobs/progress",
        "LD_LIBRARY_PATH": "/var/lib/gpufleet/fake-nvml",
        "GPUFLEET_FAKE_NVML_CONTROL": "/var/lib/gpufleet/fake-nvml/control",
    },
    cwd=Path("/home/alice/project"),
    dirs=SandboxDirs(POD_DIR / "sandbox"),
    writable=(POD_DIR / "ranks", Path("/srv/checkpoints/alice")),
    writable_at=(),
    read_only=(
        (Path("/var/lib/gpufleet/fake-nvml"), Path("/var/lib/gpufleet/fake-nvml")),
        (Path("/var/lib/gpufleet/jobs/42/train.py"), Path("/var/lib/gpufleet/jobs/42/train.py")),
    ),
    identity=True,
    pinned=Path("/var/lib/gpufleet/pinned/42"),
    outer_env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
)


def test_a_pods_launch_is_its_torchrun_as_its_user_with_the_platforms_variables_last() -> None:
    check_spec(desired()["spec"], ["/home/alice", "/srv/checkpoints/alice"])  # a fair job
    assert launch_spec(desired(), PLACE, ALICE, False, SANDBOX, FACTS) == EXPECTED


def test_a_job_that_names_its_interpreter_runs_it() -> None:
    launch = launch_spec(
        desired(python="/home/alice/venv/bin/python"), PLACE, ALICE, False, SANDBOX, FACTS
    )
    assert launch.argv == ("/home/alice/venv/bin/python", *EXPECTED.argv[1:])


@pytest.mark.parametrize(
    ("cwd", "is_dir"),
    [
        ("/home/alice/project", False),  # not there on this node
        ("/etc", True),  # not the user's
        ("/home/alice-other/x", True),  # beside the home, not in it
    ],
)
def test_a_working_directory_the_ranks_cannot_start_in_is_the_home(cwd: str, is_dir: bool) -> None:
    facts = replace(FACTS, cwd_is_dir=is_dir)
    assert launch_spec(desired(cwd=cwd), PLACE, ALICE, False, SANDBOX, facts).cwd == ALICE.home


def test_the_working_directory_asked_for_is_looked_up_only_inside_the_home() -> None:
    assert asked_cwd({"cwd": "/home/alice/project"}, ALICE.home) == Path("/home/alice/project")
    assert asked_cwd({}, ALICE.home) == ALICE.home
    assert asked_cwd({"cwd": "/root"}, ALICE.home) is None


def test_a_system_account_keeps_its_own_passwd_entry() -> None:
    assert launch_spec(desired(), PLACE, ALICE, True, SANDBOX, FACTS).identity is False


def test_a_checkpoint_in_the_home_binds_nothing_more() -> None:
    facts = replace(FACTS, checkpoint_dir=ALICE.home)
    launch = launch_spec(
        desired(checkpoint_uri="/home/alice/ckpt"), PLACE, ALICE, False, SANDBOX, facts
    )
    assert launch.writable == (POD_DIR / "ranks",)


def test_without_an_overlay_the_jobs_environment_is_a_directory_of_the_pods() -> None:
    sandbox = replace(SANDBOX, support=SandboxSupport(SandboxMode.READONLY, "no overlay"))
    launch = launch_spec(desired(), PLACE, ALICE, False, sandbox, FACTS)
    assert launch.writable_at == ((POD_DIR / "env", Path("/opt/job-env")),)


def test_a_node_without_the_fake_nvml_library_sets_no_library_path() -> None:
    facts = replace(FACTS, fake_nvml=None, progress_url="")
    env = launch_spec(desired(), PLACE, ALICE, False, SANDBOX, facts).env
    assert env == {
        k: v
        for k, v in EXPECTED.env.items()
        if k not in ("LD_LIBRARY_PATH", "GPUFLEET_FAKE_NVML_CONTROL", "GPUFLEET_PROGRESS_URL")
    }


def test_an_s3_checkpoint_gets_its_users_credentials_and_no_bind() -> None:
    facts = replace(FACTS, checkpoint_dir=None)
    uri = "s3://checkpoints/alice/llama"
    launch = launch_spec(desired(checkpoint_uri=uri), PLACE, ALICE, False, SANDBOX, facts)
    assert launch.writable == (POD_DIR / "ranks",)
    assert {k: v for k, v in launch.env.items() if k.startswith(("AWS_", "GPUFLEET_CHECK"))} == {
        "GPUFLEET_CHECKPOINT_URI": uri,
        "AWS_ACCESS_KEY_ID": "AKIA-alice",
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": "http://s3.internal:8333",
    }


def test_an_s3_checkpoint_without_the_users_credentials_is_refused_with_what_to_do() -> None:
    bob = RankAccount("bob", 200_124, 200_124, Path("/home/bob"))
    with pytest.raises(
        JobRefused,
        match=r"no S3 checkpoint credentials for bob.*c\.NodeAgent\.checkpoint_credentials_file",
    ):
        launch_spec(desired(checkpoint_uri="s3://b/bob"), PLACE, bob, False, SANDBOX, FACTS)


# ------------------------------------------------------------------ the rank runner
SPEC = RankSpec(
    "42-1-attempt-2",
    ("/usr/bin/bwrap", "--die-with-parent", "--", "torchrun"),
    gpu_uuids=("GPU-a", "GPU-b"),
    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    cwd="/",
    marker="m42.1",
)
SHELL = (
    "/bin/sh",
    "-c",
    'trap : TERM INT HUP; exit_file=$1; shift; "$@"; code=$?; echo "$code" > "$exit_file"; '
    'exit "$code"',
    "gpufleet-rank",
    "/var/lib/gpufleet/ranks/42-1-attempt-2.exit",
)
EXIT_FILE = Path("/var/lib/gpufleet/ranks/42-1-attempt-2.exit")


def test_a_contained_rank_starts_under_its_shell_with_only_the_variables_it_was_given() -> None:
    assert rank_process(SPEC, "m42.1", EXIT_FILE, {"SECRET": "agent's"}, inherit=False) == (
        RankProcess(
            argv=(*SHELL, "/usr/bin/bwrap", "--die-with-parent", "--", "torchrun"),
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            cwd="/",
        )
    )


def test_an_inheriting_rank_gets_the_base_environment_its_marker_and_its_gpus() -> None:
    spec = replace(SPEC, env={"LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0"}, cwd=None)
    assert rank_process(spec, "m42.1", EXIT_FILE, {"HOME": "/root", "LANG": "C"}, True) == (
        RankProcess(
            argv=(*SHELL, "/usr/bin/bwrap", "--die-with-parent", "--", "torchrun"),
            env={
                "HOME": "/root",
                "LANG": "C.UTF-8",
                "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
                "GPUFLEET_SESSION_MARKER": "m42.1",
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
            },
            cwd=None,
        )
    )
    no_gpus = rank_process(replace(spec, gpu_uuids=()), "m42.1", EXIT_FILE, {}, True)
    assert (no_gpus.env["CUDA_VISIBLE_DEVICES"], no_gpus.env["NVIDIA_VISIBLE_DEVICES"]) == (
        "",
        "none",
    )
