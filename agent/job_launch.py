"""How a job pod's ``torchrun`` is launched on this node: in its user's containment, with
exactly the directories, variables and GPUs it may have.

Everything a submission chose (its script's name, interpreter, working directory,
arguments, environment and checkpoint location) is checked here again, whatever the
controller let through: a value this node cannot honour refuses the pod with
:class:`JobRefused`, whose message says what to change, and never reaches a path, a
command line or an environment unchecked. Other :class:`~.runner.RunnerError`\\ s are the
node's own (no sandbox, no base environment).

The command is the session sandbox's (``containment.py``), built as the pod's user's
account; the directories it needs are made here, owned as the sandbox needs them.
"""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..recovery import processes
from ..recovery.job_spec import launch_problems
from ..snapshotter.sandbox import (
    RootEntry,
    SandboxDirs,
    SandboxMode,
    SandboxSupport,
    host_root,
    layer_dirs,
    owned_prefix,
    prepare_dirs,
    write_identity,
)
from .checkpoints import checkpoint_credentials, checkpoint_place
from .containment import OUTER_PATH, RankAccount, rank_command, rank_environment
from .runner import RunnerError


class JobRefused(RunnerError):
    """What the job asks for cannot be done; the message says what to change."""


@dataclass(frozen=True)
class RankSandbox:
    """Where and how this node runs ranks (``containment.py``): the sandbox the machine
    allows, the sessions' base environment and the prefix of a job's own environment
    inside, users' homes, and what every rank sees read-only (the fake NVML library)."""

    support: SandboxSupport
    base_env: Path
    prefix: Path
    home_dir_template: str
    read_only: tuple[Path, ...] = ()
    root: tuple[RootEntry, ...] = field(default_factory=host_root)
    unavailable: str = ""  # why no rank may start here (the loopback guard cannot be had)
    checkpoint_root: Path = Path(".gpufleet/checkpoints")  # users' checkpoints (c.NodeAgent)
    # Each user's S3 credentials for their checkpoint prefix, and where S3 is
    # (c.NodeAgent.checkpoint_credentials_file, checkpoint_s3_endpoint).
    s3_credentials: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    s3_endpoint: str = ""
    s3_region: str = "us-east-1"

    def home(self, username: str) -> Path:
        return Path(self.home_dir_template.format(username=username))


@dataclass(frozen=True)
class PodPlace:
    """Where one pod of one attempt keeps its files on this node."""

    jobs_dir: Path
    workload_id: int
    pod_index: int
    attempt: int

    @property
    def rank_id(self) -> str:
        suffix = "" if self.attempt == 1 else f"-attempt-{self.attempt}"
        return f"{self.workload_id}-{self.pod_index}{suffix}"

    @property
    def job_dir(self) -> Path:
        return self.jobs_dir / str(self.workload_id)

    @property
    def directory(self) -> Path:
        # Each attempt has directories of its own: its logs start empty.
        suffix = "" if self.attempt == 1 else f"-attempt-{self.attempt}"
        return self.job_dir / f"pod-{self.pod_index}{suffix}"

    @property
    def ranks_dir(self) -> Path:
        return self.directory / "ranks"


def check_spec(spec: Mapping[str, Any], checkpoint_places: Iterable[str]) -> None:
    """Refuse (``JobRefused``, with what to change) what no node could pass on as asked
    (``recovery/job_spec.py``): the controller refuses the same at submit, and this holds
    for whatever reaches a node anyway. Pure."""
    problems = launch_problems(
        script_name=str(spec.get("script_name") or ""),
        env={str(k): str(v) for k, v in dict(spec.get("env", {})).items()},
        args=[str(a) for a in spec.get("args", [])],
        python=str(spec.get("python") or ""),
        cwd=str(spec.get("cwd") or ""),
        checkpoint_uri=str(spec.get("checkpoint_uri") or ""),
        checkpoint_places=checkpoint_places,
    )
    if problems:
        raise JobRefused("; ".join(problems))


def rank_account(desired: Mapping[str, Any], sandbox: RankSandbox) -> tuple[RankAccount, bool]:
    """Whom the pod's ranks run as, and whether that is a system account of the machine.
    Raises ``RunnerError`` where ranks cannot run contained on this node."""
    account_json = desired.get("account")
    if not account_json or int(account_json.get("uid", 0)) == 0:
        raise RunnerError("the controller gave no account to run its ranks as")
    if sandbox.unavailable:
        raise RunnerError(sandbox.unavailable)
    if sandbox.support.mode is SandboxMode.NONE:
        raise RunnerError(
            f"job ranks run only in the bubblewrap sandbox, and it cannot run on this "
            f"node ({sandbox.support.reason}); install bubblewrap"
        )
    if not (sandbox.base_env / "bin" / "python").exists():
        raise RunnerError(
            f"the sessions' base environment {sandbox.base_env} is missing on this node "
            "(scripts/build-session-env)"
        )
    username = str(desired["username"])
    uid, gid = int(account_json["uid"]), int(account_json["gid"])
    system = account_json.get("mode") == "system"
    try:
        home = Path(pwd.getpwnam(username).pw_dir) if system else sandbox.home(username)
    except KeyError:
        raise RunnerError(f"there is no account {username} on this node") from None
    return RankAccount(username, uid, gid, home), system


def pinned_environment(desired: Mapping[str, Any], sandbox: RankSandbox) -> Path | None:
    """The copy of its session's environment the controller made when the job was
    submitted (its overlay upper directory as it was then), with a layer directory for
    each of the root's; None for a job without one. Raises ``RunnerError`` when the copy is
    gone. Blocking."""
    pinned = str(desired["spec"].get("environment_pinned") or "")
    if not pinned or not sandbox.support.overlay:
        return None
    path = Path(pinned)
    if not path.is_dir() or path.resolve() != path:
        raise RunnerError(f"its copy of its session's environment {pinned} is not there any more")
    for layer in layer_dirs(path, sandbox.root):
        layer.mkdir(exist_ok=True)
    return path


@dataclass(frozen=True)
class _PodDirs:
    """What a pod's sandbox gets of the host, made ready."""

    sandbox: SandboxDirs
    script: Path  # the entry script, read-only inside
    writable: list[Path]  # bound read-write at their own place
    writable_at: list[tuple[Path, Path]]  # (source, destination), read-write


def contained_command(
    desired: Mapping[str, Any],
    place: PodPlace,
    account: RankAccount,
    system: bool,
    sandbox: RankSandbox,
    port: int,
    progress_url: str,
    pinned: Path | None,
) -> tuple[list[str], dict[str, str]]:
    """The pod's torchrun as its user's contained command, its directories made; and the
    agent's own environment for it. Raises ``RunnerError`` (``JobRefused`` for what the
    job asks) where it cannot run contained. Blocking (small files and directories only)."""
    spec = desired["spec"]
    check_spec(spec, [str(account.home), str(sandbox.checkpoint_root / account.username)])
    made = _make_pod_dirs(spec, place, account, sandbox)
    cwd = Path(str(spec.get("cwd") or account.home))
    if not (cwd == account.home or cwd.is_relative_to(account.home)) or not cwd.is_dir():
        cwd = account.home
    python = str(spec.get("python") or sandbox.prefix / "bin" / "python")
    argv = (
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={desired['pods']}",
        f"--node-rank={place.pod_index}",
        f"--nproc-per-node={int(desired['gpus_per_pod'])}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        f"--log-dir={place.ranks_dir}",
        "--redirects=3",
        str(made.script),
        *(str(a) for a in spec.get("args", [])),
    )
    chosen = {str(k): str(v) for k, v in dict(spec.get("env", {})).items()}
    platform = _platform_env(desired, place, account, sandbox, progress_url)
    env = rank_environment(account, sandbox.base_env, sandbox.prefix, chosen, platform)
    read_only = [(path, path) for path in (*sandbox.read_only, made.script)]
    # The passwd and group files over the host's: the user has an entry inside (a
    # system account has its own already).
    if not system:
        read_only += write_identity(
            made.sandbox.root, account.username, account.uid, account.gid, account.home
        )
    command = rank_command(
        sandbox.support,
        made.sandbox,
        root=sandbox.root,
        account=account,
        base_env=sandbox.base_env,
        prefix=sandbox.prefix,
        argv=argv,
        env=env,
        cwd=cwd,
        writable=made.writable,
        writable_at=made.writable_at,
        read_only=read_only,
        pinned=pinned,
    )
    return command, {"PATH": OUTER_PATH, "LANG": "C.UTF-8"}


def _make_pod_dirs(
    spec: Mapping[str, Any], place: PodPlace, account: RankAccount, sandbox: RankSandbox
) -> _PodDirs:
    """The pod's directories, layers and entry script, and the user's checkpoint
    directory and home, made with the owners the sandbox needs."""
    uid, gid = account.uid, account.gid
    place.job_dir.mkdir(mode=0o700, exist_ok=True)
    # What the ranks write (torchrun's per-rank logs) is theirs; the keeper reads it
    # back without following their links (job_logs.read_new).
    dirs = SandboxDirs(place.directory / "sandbox")
    for path in (place.directory, dirs.root):
        path.mkdir(mode=0o700, exist_ok=True)
    place.ranks_dir.mkdir(mode=0o700, exist_ok=True)
    os.chown(place.ranks_dir, uid, gid)
    prepare_layers(dirs, sandbox.root, account, sandbox.prefix)
    writable_at: list[tuple[Path, Path]] = []
    if not sandbox.support.overlay:
        # No layer of its own to hold the job's environment: a directory of the pod's,
        # at the prefix's place (an empty mount point of root's on the host).
        sandbox.prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
        owned_directory(place.directory / "env", uid, gid)
        writable_at.append((place.directory / "env", sandbox.prefix))
    script = place.job_dir / str(spec["script_name"])
    if not script.exists():
        script.write_text(str(spec["script"]))
        script.chmod(0o644)
    writable = [place.ranks_dir]
    checkpoint = str(spec.get("checkpoint_uri", ""))
    if checkpoint and not checkpoint.startswith("s3://"):
        try:
            where = checkpoint_place(Path(checkpoint), account, sandbox.checkpoint_root)
        except RunnerError as e:
            raise JobRefused(str(e)) from e
        if where != account.home:
            writable.append(where)
    if not account.home.is_dir():
        owned_directory(account.home, uid, gid, mode=0o700)
    return _PodDirs(dirs, script, writable, writable_at)


def _platform_env(
    desired: Mapping[str, Any],
    place: PodPlace,
    account: RankAccount,
    sandbox: RankSandbox,
    progress_url: str,
) -> dict[str, str]:
    """The variables the platform sets for every rank of the pod (which the job's own
    ``env`` cannot override): its marker, its GPUs, its job, where it reports progress and
    keeps checkpoints, and its user's S3 credentials for them."""
    checkpoint = str(desired["spec"].get("checkpoint_uri", ""))
    try:
        credentials = checkpoint_credentials(checkpoint, account.username, sandbox)
    except RunnerError as e:
        raise JobRefused(str(e)) from e
    devices = ",".join(desired["gpu_uuids"])
    return {
        processes.MARKER_VARIABLE: processes.part_marker(str(desired["marker"]), place.pod_index),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": devices,
        "NVIDIA_VISIBLE_DEVICES": devices or "none",
        "PYTHONUNBUFFERED": "1",
        "GPUFLEET_JOB_ID": str(place.workload_id),
        "GPUFLEET_JOB_NAME": str(desired["name"]),
        "GPUFLEET_POD_INDEX": str(place.pod_index),
        "GPUFLEET_CHECKPOINT_URI": checkpoint,
        "GPUFLEET_ATTEMPT": str(place.attempt),
        "GPUFLEET_RESUME_FROM": str(desired.get("resume_from") or ""),
        **({"GPUFLEET_PROGRESS_URL": progress_url} if progress_url else {}),
        **fake_nvml_env(sandbox.read_only),
        **credentials,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prepare_layers(
    dirs: SandboxDirs, root: tuple[RootEntry, ...], account: RankAccount, prefix: Path
) -> None:
    """The pod's own overlay layers, scratch and mount-point directories and /tmp
    (:func:`.sandbox.prepare_dirs`), and the job's environment prefix in its upper layer
    owned by the user, so the launcher can make its venv there."""
    prepare_dirs(dirs, True, root)
    owned_prefix(dirs.upper, prefix, account.uid, account.gid)


def owned_directory(path: Path, uid: int, gid: int, mode: int = 0o755) -> None:
    """``path`` as a directory of the user's (made with root-owned parents if missing)."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = path.lstat()
    if (info.st_uid, info.st_gid) != (uid, gid):
        os.chown(path, uid, gid, follow_symlinks=False)


def fake_nvml_env(read_only: tuple[Path, ...]) -> dict[str, str]:
    """Where a rank finds gpufleet's fake NVML library, when this node serves it."""
    for directory in read_only:
        if (directory / "libnvidia-ml.so.1").exists():
            return {
                "LD_LIBRARY_PATH": str(directory),
                "GPUFLEET_FAKE_NVML_CONTROL": str(directory / "control"),
            }
    return {}
