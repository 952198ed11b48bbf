"""One run of a test kubelet's container: its command in the session sandbox, as its user.

The sandbox is gpufleet's own (:func:`gpufleet.spawner.sandboxing.sandboxed_command`, the
code sessions run through; docs/containment.md): a mount namespace whose ``/`` shows only
the host's allow-listed directories (as overlay layers whose upper directory is the
container's own, so what it writes there is its "container layer"), a pid namespace of its
own, a private ``/tmp``, a home of its own, the pod's volumes at their mount paths and the
fake NVML library's directory read-only. The ``image`` is ignored: the command is found in
the host's directories as the sandbox shows them (and in the sessions' base environment,
which plays the image, or the environment the kubelet's settings name for the image:
the platform's, for gpufleet's own images).

The manifest's environment reaches only the container's command: the outer processes
(``unshare``, ``mount``, ``bwrap``, ``setpriv``, the venv launcher), which run as root until
``setpriv``, get a minimal environment, and ``env -i`` gives the command exactly its own,
as a job's rank gets it (gpufleet.agent.containment).

The sandbox code is imported at the first start, not with the tier: it brings JupyterHub
(seconds of import on a busy machine), which the tier's other users need not pay for.

Every process of a run carries ``MARKER_VARIABLE=<its id>``: the run is over once its
outer process has exited and no live process carries the marker (the pid namespace ends
with its init, the marker catches what might linger). A run with a memory limit is in a
memory cgroup of its own from its first process on (:mod:`.memory`): then the run is over
once the outer process has exited and the cgroup is empty, which no process can leave, and
the cgroup says whether the kernel's OOM killer ended it. Processes are started from one
long-lived thread with PR_SET_PDEATHSIG, so a test process that dies without stopping its
kubelets takes their containers with it (the signal follows the thread that forked).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.agent.containment import OUTER_PATH
from gpufleet.snapshotter.sandbox import SandboxDirs, SandboxSupport

from .cri_logs import CriLog
from .memory import MemoryCgroup, place_self
from .processes import die_with_parent
from .volumes import Mount

MARKER_VARIABLE = "GPUFLEET_TEST_KUBELET_CONTAINER"
RUNTIME = "gpufleet-test"  # the "container runtime" of container IDs: gpufleet-test://<id>
# The "image's" PATH: the session's own venv and the sessions' base environment (what
# gpufleet's session image would hold), then the system's, as Docker's default PATH.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# One thread starts every container process and lives as long as the test process: see
# the module docstring (a worker thread that ends would kill what it started).
_launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-kubelet-launcher")


class CannotStart(Exception):
    """A container's sandbox cannot be set up (the machine cannot run one, or preparing
    its directories failed); the message says why."""


@dataclass(frozen=True)
class SandboxSettings:
    """Where sandboxes are probed (one directory for the tier, so the probe runs once) and
    what they run from: the sessions' base environment, the venv prefix inside, and the
    environments that play other images, by image repository (the platform's own)."""

    directory: Path
    base_env: Path
    prefix: Path
    images: Mapping[str, Path] = field(default_factory=dict)

    def image_env(self, image: str) -> Path | None:
        """The environment that plays ``image`` (None: the sessions' base environment)."""
        repository = image.split("@", 1)[0]
        if ":" in repository.rsplit("/", 1)[-1]:
            repository = repository.rsplit(":", 1)[0]
        return self.images.get(repository)

    def default_path(self, image_env: Path | None = None) -> str:
        """The image's PATH: the run's own venv over the image's environment."""
        return f"{self.prefix}/bin:{image_env or self.base_env}/bin:{SYSTEM_PATH}"

    def support(self) -> SandboxSupport:
        """This machine's sandbox (cached after the first probe); raises
        :class:`CannotStart` where none can run."""
        from gpufleet.spawner.sandboxing import SandboxUnavailable, choose, probe_at

        try:
            return choose("auto", probe_at(self.directory))
        except SandboxUnavailable as e:
            raise CannotStart(str(e)) from e


@dataclass(frozen=True)
class Launch:
    """What one run of a container is: its command line and exact environment, whom it
    runs as, its mounts, where it starts, host paths it sees read-only at their own place
    (the fake NVML library's directory), its memory limit in bytes (None: none), the
    environment its image plays (None: the sessions' base) and whether it sees the host's
    processes (``hostPID``: the sandbox keeps the kubelet's pid namespace)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    user: tuple[int, int]
    mounts: Sequence[Mount] = ()
    working_dir: str = ""
    read_only: Sequence[Path] = ()
    memory_limit: int | None = None
    image_env: Path | None = None
    host_pid: bool = False


class ContainerProcess:
    """A started run: its outer process (the shell that waits for the sandbox), the marker
    its processes carry and its memory cgroup (None without a memory limit)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        marker: str,
        cgroup: MemoryCgroup | None = None,
        output: CriLog | None = None,
    ) -> None:
        self.process = process
        self.marker = marker
        self.cgroup = cgroup
        self.output = output

    def output_written(self, timeout_s: float = 2.0) -> None:
        """Return once the run's pumps have written all it wrote (or after ``timeout_s``:
        a process it left behind may hold its pipes open)."""
        for thread in self.output.threads if self.output is not None else ():
            thread.join(timeout_s)

    @property
    def container_id(self) -> str:
        return f"{RUNTIME}://{self.marker}"

    def exit_code(self) -> int | None:
        """The command's exit status once the sandbox has exited (128+N for signal N, as a
        container runtime reports it), else None."""
        code = self.process.poll()
        if code is None:
            return None
        return code if code >= 0 else 128 - code

    def oom_killed(self, code: int) -> bool:
        """Whether the kernel's OOM killer killed a process of this ended run."""
        return self.cgroup is not None and self.cgroup.oom_killed(code)

    def terminate(self) -> None:
        """SIGTERM to the container's command (and whatever the sandbox's init adopted),
        as a runtime signals a container's first process; bwrap passes no signal on. Before
        the sandbox runs, to the outer process group, which ends it."""
        from gpufleet.spawner.sandboxing import sandbox_top_processes

        inner = sandbox_top_processes(self.process.pid)
        for pid in inner:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not inner:
            self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the outer group (bwrap's death ends the pid namespace) and to every
        process that carries the marker or is in the run's cgroup."""
        self._signal_group(signal.SIGKILL)
        inside = self.cgroup.pids() if self.cgroup is not None else []
        for pid in {*marked_pids(self.marker), *inside}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def gone(self) -> bool:
        """Nothing of the run is left: the outer process has exited and been reaped, and no
        process is in its cgroup (with one: cheaper than looking for the marker, and no
        process can leave it) or carries its marker (without)."""
        if self.process.poll() is None:
            return False
        if self.cgroup is not None:
            return self.cgroup.empty()
        return not marked_pids(self.marker)

    def _signal_group(self, sig: signal.Signals) -> None:
        # Only while the outer process is unreaped: its pid (the group's id) cannot have
        # been reused by another process until then.
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)


def marked_pids(marker: str, proc: Path = Path("/proc")) -> list[int]:
    """Live (not zombie) processes whose environment carries ``MARKER_VARIABLE=marker``."""
    wanted = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            # The name before the last ')' is the process's own choice, any bytes.
            state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if state != b"Z":
            found.append(int(entry.name))
    return found


def start(
    settings: SandboxSettings,
    directory: Path,
    launch: Launch,
    log: Path,
    cgroup: MemoryCgroup | None = None,
) -> ContainerProcess:
    """Starts one run of a container whose sandbox lives in ``directory`` (its upper
    directory is kept across restarts, like a container's layer; ``home`` beside it), its
    output written to ``log`` in the CRI log format (:mod:`.cri_logs`), every process of it
    in ``cgroup`` (the caller made it with the run's limit). Raises :class:`CannotStart`."""
    try:
        return _start(settings, directory, launch, log, cgroup)
    except (OSError, subprocess.SubprocessError) as e:  # the latter: placing it failed
        raise CannotStart(f"{type(e).__name__}: {e}") from e


def _start(
    settings: SandboxSettings,
    directory: Path,
    launch: Launch,
    log: Path,
    cgroup: MemoryCgroup | None,
) -> ContainerProcess:
    from gpufleet.spawner.sandboxing import Containment, SandboxUnavailable, sandboxed_command

    support = settings.support()
    uid, gid = launch.user
    home = directory / "home"
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(home, uid, gid)
    # "system": no passwd entry is made for the uid, as in an image that has none; the
    # home is the kubelet's, made above for exactly this uid.
    containment = Containment(
        username=f"uid {uid}",
        uid=uid,
        gid=gid,
        mode="system",
        base_env=launch.image_env or settings.base_env,
        prefix=settings.prefix,
    )
    marker = secrets.token_hex(16)
    env = {"HOME": str(home), **launch.env, MARKER_VARIABLE: marker}
    chdir = [f"--chdir={launch.working_dir}"] if launch.working_dir else []
    inner = ["/usr/bin/env", "-i", *chdir, "--", *(f"{k}={v}" for k, v in env.items())]
    try:
        argv = sandboxed_command(
            support,
            SandboxDirs(directory),
            [*inner, *launch.argv],
            home=home,
            containment=containment,
            extra_binds=(),
            read_only=[str(p) for p in launch.read_only],
            notebook_dir="",
            binds_at=[(m.source, m.destination) for m in launch.mounts if not m.read_only],
            read_only_at=[(m.source, m.destination) for m in launch.mounts if m.read_only],
            share_pids=launch.host_pid,
        )
    except SandboxUnavailable as e:
        raise CannotStart(str(e)) from e
    outer_env = {"PATH": OUTER_PATH, "LANG": "C.UTF-8", "HOME": str(home), MARKER_VARIABLE: marker}
    log.parent.mkdir(parents=True, exist_ok=True)

    def child() -> None:
        die_with_parent()
        # Before exec, so that the sandbox and all it starts are in the cgroup from the
        # first instruction on; an error fails the start (Popen raises SubprocessError).
        if cgroup is not None:
            place_self(cgroup.path)

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            env=outer_env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=child,
        )

    process = _launcher.submit(popen).result()
    output = CriLog(log)
    for stream, pipe in (("stdout", process.stdout), ("stderr", process.stderr)):
        assert pipe is not None
        output.pump(stream, os.dup(pipe.fileno()))
        pipe.close()
    return ContainerProcess(process, marker, cgroup, output)
