"""How a job pod's ``torchrun`` is launched on this node: in its user's containment, with
exactly the directories, variables and GPUs it may have.

Everything a submission chose (its script's name, interpreter, working directory,
arguments, environment and checkpoint location) is checked here again, whatever the
controller let through: a value this node cannot honour refuses the pod with
:class:`JobRefused`, whose message says what to change, and never reaches a path, a
command line or an environment unchecked. Other :class:`~.runner.RunnerError`\\ s are the
node's own (no sandbox, no base environment).

The command is the session sandbox's (``containment.py``), built as the pod's user's
account; the directories it needs are made here, owned as the sandbox needs them. What a
pod is started with (:class:`LaunchSpec`: its account, argv, variables, working directory
and binds) is decided by :func:`launch_spec`, a pure function of the job's spec and the
node's facts (:class:`PodFacts`); :func:`contained_command` gathers those facts, makes the
directories and turns the spec into the command line the rank runner starts.
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

    @property
    def sandbox(self) -> SandboxDirs:
        """The pod's own overlay layers, scratch and /tmp."""
        return SandboxDirs(self.directory / "sandbox")

    def script(self, spec: Mapping[str, Any]) -> Path:
        """Where the job's entry script is kept for its pods on this node."""
        return self.job_dir / str(spec["script_name"])


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
class PodFacts:
    """What a pod's launch reads of this node besides the job's spec and the sandbox's
    settings, found (or made) by the agent: :func:`contained_command` gathers them."""

    port: int  # the job's rendezvous port on this machine
    progress_url: str  # where ranks report progress; "" for nowhere
    pinned: Path | None  # the job's copy of its session's environment (pinned_environment)
    # The user's directory bound read-write for the job's local checkpoint location (their
    # home, or theirs under the checkpoint root; made by _make_pod_dirs); None without one.
    checkpoint_dir: Path | None
    cwd_is_dir: bool  # the working directory the job asks for (asked_cwd) is one here
    fake_nvml: Path | None = None  # the folder gpufleet's fake NVML library is served from


@dataclass(frozen=True)
class LaunchSpec:
    """What one pod's ``torchrun`` is started with, decided by :func:`launch_spec` from the
    job's spec and the node's facts alone; :func:`contained_command` runs it contained
    (``containment.rank_command``). Ranks have no resource limits of their own: a pod
    holds its GPUs (``CUDA_VISIBLE_DEVICES``), and its user's account bounds the rest."""

    account: RankAccount  # whom the ranks run as
    argv: tuple[str, ...]  # torchrun's, run inside from the job's environment
    env: dict[str, str]  # exactly the ranks' variables inside
    cwd: Path  # inside
    dirs: SandboxDirs  # the pod's own layers, scratch and /tmp
    writable: tuple[Path, ...]  # bound read-write at their own place
    writable_at: tuple[tuple[Path, Path], ...]  # (host, inside), read-write
    read_only: tuple[tuple[Path, Path], ...]  # (host, inside), the entry script among them
    # The user's passwd and group entries shown over the host's at /etc (written into the
    # pod's root when it starts): a system account has its own already.
    identity: bool
    pinned: Path | None  # the session's environment, a layer below the pod's own
    outer_env: dict[str, str]  # what the sandbox's own processes (bwrap, setpriv) run with


def asked_cwd(spec: Mapping[str, Any], home: Path) -> Path | None:
    """The working directory the job asks for (its user's home when it names none), when it
    is the home or inside it; None otherwise (the ranks then start in the home). Pure."""
    cwd = Path(str(spec.get("cwd") or home))
    return cwd if cwd == home or cwd.is_relative_to(home) else None


def launch_spec(
    desired: Mapping[str, Any],
    place: PodPlace,
    account: RankAccount,
    system: bool,
    sandbox: RankSandbox,
    facts: PodFacts,
) -> LaunchSpec:
    """The pod's ``torchrun`` as ``desired`` (the controller's record of the pod and its
    job's spec) asks for it, as ``account`` (``system``: an account of the machine's own),
    in ``sandbox``, on a node with ``facts``. Pure. Raises ``JobRefused`` for an S3
    checkpoint this node has no credentials of the user's for."""
    spec = desired["spec"]
    asked = asked_cwd(spec, account.home)
    cwd = asked if asked is not None and facts.cwd_is_dir else account.home
    python = str(spec.get("python") or sandbox.prefix / "bin" / "python")
    script = place.script(spec)
    argv = (
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={desired['pods']}",
        f"--node-rank={place.pod_index}",
        f"--nproc-per-node={int(desired['gpus_per_pod'])}",
        "--master-addr=127.0.0.1",
        f"--master-port={facts.port}",
        f"--log-dir={place.ranks_dir}",
        "--redirects=3",
        str(script),
        *(str(a) for a in spec.get("args", [])),
    )
    chosen = {str(k): str(v) for k, v in dict(spec.get("env", {})).items()}
    platform = _platform_env(desired, place, account, sandbox, facts)
    writable = [place.ranks_dir]
    if facts.checkpoint_dir is not None and facts.checkpoint_dir != account.home:
        writable.append(facts.checkpoint_dir)
    # No layer of its own to hold the job's environment: a directory of the pod's, at the
    # prefix's place.
    env_dir = () if sandbox.support.overlay else ((place.directory / "env", sandbox.prefix),)
    return LaunchSpec(
        account=account,
        argv=argv,
        env=rank_environment(account, sandbox.base_env, sandbox.prefix, chosen, platform),
        cwd=cwd,
        dirs=place.sandbox,
        writable=tuple(writable),
        writable_at=env_dir,
        read_only=tuple((path, path) for path in (*sandbox.read_only, script)),
        identity=not system,
        pinned=facts.pinned,
        outer_env={"PATH": OUTER_PATH, "LANG": "C.UTF-8"},
    )


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
    job asks) where it cannot run contained. Blocking (small files and directories only):
    what it decides is :func:`launch_spec`'s."""
    spec = desired["spec"]
    check_spec(spec, [str(account.home), str(sandbox.checkpoint_root / account.username)])
    checkpoint_dir = _make_pod_dirs(spec, place, account, sandbox)
    asked = asked_cwd(spec, account.home)
    facts = PodFacts(
        port=port,
        progress_url=progress_url,
        pinned=pinned,
        checkpoint_dir=checkpoint_dir,
        cwd_is_dir=asked is not None and asked.is_dir(),
        fake_nvml=fake_nvml_dir(sandbox.read_only),
    )
    launch = launch_spec(desired, place, account, system, sandbox, facts)
    read_only = list(launch.read_only)
    if launch.identity:
        read_only += write_identity(
            launch.dirs.root, account.username, account.uid, account.gid, account.home
        )
    command = rank_command(
        sandbox.support,
        launch.dirs,
        root=sandbox.root,
        account=account,
        base_env=sandbox.base_env,
        prefix=sandbox.prefix,
        argv=launch.argv,
        env=launch.env,
        cwd=launch.cwd,
        writable=launch.writable,
        writable_at=launch.writable_at,
        read_only=read_only,
        pinned=launch.pinned,
    )
    return command, dict(launch.outer_env)


def _make_pod_dirs(
    spec: Mapping[str, Any], place: PodPlace, account: RankAccount, sandbox: RankSandbox
) -> Path | None:
    """The pod's directories, layers and entry script, and the user's checkpoint
    directory and home, made with the owners the sandbox needs; the directory of the
    user's that holds the job's local checkpoint location (None without one)."""
    uid, gid = account.uid, account.gid
    place.job_dir.mkdir(mode=0o700, exist_ok=True)
    # What the ranks write (torchrun's per-rank logs) is theirs; the keeper reads it
    # back without following their links (job_logs.read_new).
    dirs = place.sandbox
    for path in (place.directory, dirs.root):
        path.mkdir(mode=0o700, exist_ok=True)
    place.ranks_dir.mkdir(mode=0o700, exist_ok=True)
    os.chown(place.ranks_dir, uid, gid)
    prepare_layers(dirs, sandbox.root, account, sandbox.prefix)
    if not sandbox.support.overlay:
        # The job's environment lives in a directory of the pod's (launch_spec), bound at
        # the prefix's place: an empty mount point of root's on the host.
        sandbox.prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
        owned_directory(place.directory / "env", uid, gid)
    script = place.script(spec)
    if not script.exists():
        script.write_text(str(spec["script"]))
        script.chmod(0o644)
    where = None
    checkpoint = str(spec.get("checkpoint_uri", ""))
    if checkpoint and not checkpoint.startswith("s3://"):
        try:
            where = checkpoint_place(Path(checkpoint), account, sandbox.checkpoint_root)
        except RunnerError as e:
            raise JobRefused(str(e)) from e
    if not account.home.is_dir():
        owned_directory(account.home, uid, gid, mode=0o700)
    return where


def _platform_env(
    desired: Mapping[str, Any],
    place: PodPlace,
    account: RankAccount,
    sandbox: RankSandbox,
    facts: PodFacts,
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
    progress_url = facts.progress_url
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
        **fake_nvml_env(facts.fake_nvml),
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


def fake_nvml_dir(read_only: tuple[Path, ...]) -> Path | None:
    """The folder among ``read_only`` that serves gpufleet's fake NVML library, if any."""
    for directory in read_only:
        if (directory / "libnvidia-ml.so.1").exists():
            return directory
    return None


def fake_nvml_env(directory: Path | None) -> dict[str, str]:
    """Where a rank finds gpufleet's fake NVML library, when this node serves it
    (``directory``). Pure."""
    if directory is None:
        return {}
    return {
        "LD_LIBRARY_PATH": str(directory),
        "GPUFLEET_FAKE_NVML_CONTROL": str(directory / "control"),
    }
