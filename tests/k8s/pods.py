"""One pod on a test kubelet: admission, volumes, containers, probes, status, termination.

A :class:`PodWorker` owns one pod (by uid) from the moment its kubelet first sees it bound
to the node until it is gone from the API and nothing of it runs. Its thread wakes on every
change of the pod (the kubelet's watch calls :meth:`PodWorker.observe`) and every
``TICK_S``, and takes one :meth:`~PodWorker.sync` step: nothing in a step waits for a
container, so a step is short and a paused kubelet (``NodeContext.gate`` closed) takes none.

The pod's story, as a real kubelet tells it:

1. admission: the node's devices (``nvidia.com/gpu`` and any other resource name the
   kubelet serves) are chosen for each container (``podspec.allocate_devices``), or the
   pod fails with UnexpectedAdmissionError; it gets its own loopback address (its IP);
2. its ``/etc/hosts`` is written (and from then on follows its peers: :mod:`.names`), and
   volumes are made ready (a volume kind the kubelet cannot mount fails the pod);
3. init containers run one after another, each to success; then the app containers start,
   each run with a memory limit in a memory cgroup of its own (:mod:`.memory`), whose OOM
   kill makes its end ``OOMKilled``, removed once nothing of the run is left;
4. ``restartPolicy`` restarts containers that exit (Always, OnFailure), with a short
   back-off; Ready follows the containers and their readiness probes;
5. termination: once the pod has a ``deletionTimestamp`` its containers get SIGTERM, then
   SIGKILL when ``deletionGracePeriodSeconds`` have passed; once nothing of it runs the
   kubelet deletes it (grace 0, uid precondition). A pod deleted outright (the watch says
   DELETED) is killed at once.

Devices and the pod IP are released once nothing of the pod runs and it is finished
(Succeeded or Failed) or gone, as the device manager frees a terminated pod's devices.
Statuses are posted as strategic merge patches, only when they change (and again after a
pause: the node-lifecycle controller marks the pods of a NotReady node not Ready).
"""

from __future__ import annotations

import base64
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpufleet.snapshotter.sandbox import remove_tree

from . import containers
from .containers import CannotStart, ContainerProcess, Launch
from .cri_logs import read_cri, set_aside
from .memory import MemoryCgroup, memory_limit
from .names import HostsFile, pod_hostname, pod_hosts, with_hosts
from .nodes import rfc3339
from .podspec import (
    AdmissionError,
    Manifest,
    PodSpecError,
    command_line,
    container_env,
    pod_conditions,
    pod_phase,
    run_as,
    run_as_refusal,
)
from .resources import NodeContext
from .volumes import (
    Volume,
    VolumeLookups,
    VolumeNotReady,
    VolumeUnsupported,
    container_mounts,
    prepare_volumes,
    refresh_downward,
)

TICK_S = 0.1
HOST_IP = "127.0.0.1"  # the fake nodes' InternalIP
CONFIG_RETRY_S = 1.0  # a container whose configuration failed is tried again after this
BACKOFF_MAX_S = 10.0  # restarts wait 0, 1, 2, 4, 8, 10, 10 … s (a real kubelet: 10 s … 5 min)
DEFAULT_GRACE_S = 30
SMP = {"Content-Type": "application/strategic-merge-patch+json"}
TERMINAL = ("Succeeded", "Failed")


# ------------------------------------------------------------------ one container
@dataclass
class Probe:
    """A readiness probe's running tally (Ready needs successThreshold successes in a row,
    unready after failureThreshold failures)."""

    spec: Manifest
    due: float = 0.0
    successes: int = 0
    failures: int = 0
    ready: bool = False


TERMINATION_MESSAGE_BYTES = 2048
TERMINATION_MESSAGE_LINES = 80


@dataclass
class Container:
    """One container of the pod: its manifest, its current run and the status it reports."""

    spec: Manifest
    init: bool
    devices: tuple[str, ...] = ()
    process: ContainerProcess | None = None
    started_at: str = ""
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    last_state: dict[str, Any] = field(default_factory=dict)
    not_before: float = 0.0  # monotonic: not (re)started before
    probe: Probe | None = None
    failed_message: str = ""  # the last Failed event's, so each is posted once
    probe_warned: bool = False  # an Unhealthy event said its probe is not supported

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def field_path(self) -> str:
        return f"spec.{'initContainers' if self.init else 'containers'}{{{self.name}}}"

    @property
    def ready(self) -> bool:
        if self.init:
            return self.succeeded
        return "running" in self.state and (self.probe is None or self.probe.ready)

    @property
    def succeeded(self) -> bool:
        return self.state.get("terminated", {}).get("exitCode") == 0

    def status(self) -> dict[str, Any]:
        image = str(self.spec.get("image", ""))
        status: dict[str, Any] = {
            "name": self.name,
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "restartCount": self.restarts,
            "image": image,
            "imageID": f"{containers.RUNTIME}://image/{image}",
            "started": "running" in self.state,
        }
        if self.process is not None:
            status["containerID"] = self.process.container_id
        return status


def _backoff(restarts: int) -> float:
    return 0.0 if restarts <= 1 else min(2.0 ** (restarts - 2), BACKOFF_MAX_S)


# ------------------------------------------------------------------ the pod
class PodWorker:
    """One pod's kubelet side (see the module docstring)."""

    def __init__(self, ctx: NodeContext, pod: Manifest) -> None:
        meta = pod["metadata"]
        self.ctx = ctx
        self.uid = str(meta["uid"])
        self.namespace = str(meta["namespace"])
        self.name = str(meta["name"])
        self.pod = pod
        self.deleted = False  # gone from the API
        self.finished = False
        self.wake = threading.Event()
        self.directory = ctx.directory / self.uid
        self.log_dir = ctx.logs / f"{self.namespace}_{self.name}_{self.uid}"
        self.ip = ""
        self.admitted = False
        self.released = False
        self.volumes: dict[str, Volume] | None = None
        self.hosts: HostsFile | None = None  # None on the host's network
        self.named = False  # its hosts file is written and follows its peers
        self.failure: tuple[str, str] | None = None  # (reason, message) of a failed pod
        self.rejected = False  # failed admission
        self.finished_before = (pod.get("status") or {}).get("phase") in TERMINAL
        self.start_time = rfc3339()
        self.kill_at: float | None = None  # monotonic, once terminating
        self.killed = False
        self.leftovers: list[ContainerProcess] = []  # ended runs, until nothing of them runs
        self.posted: Any = None
        self.transitions: dict[str, tuple[str, str]] = {}
        self.mount_problem = ""
        spec = pod.get("spec") or {}
        self.host_network = bool(spec.get("hostNetwork"))
        self.containers: dict[str, Container] = {}
        for c in spec.get("initContainers") or []:
            self.containers[c["name"]] = Container(c, init=True)
        for c in spec.get("containers") or []:
            self.containers[c["name"]] = Container(c, init=False)
        for c in self.containers.values():
            reason = "PodInitializing" if self._inits() and not c.init else "ContainerCreating"
            c.state = {"waiting": {"reason": reason}}
        self.thread = threading.Thread(
            target=self.run, name=f"pod-{ctx.node}-{self.namespace}-{self.name}", daemon=True
        )

    def __repr__(self) -> str:
        return f"PodWorker({self.namespace}/{self.name}, uid={self.uid})"

    # -------------------------------------------------------------- driving
    def observe(self, pod: Manifest | None) -> None:
        """The pod as the API has it now; None: deleted."""
        if pod is None:
            self.deleted = True
        else:
            before, self.pod = self.pod, pod
            if self.volumes is not None and _metadata_changed(before, pod):
                refresh_downward(pod, self.directory / "volumes")
        self.wake.set()

    def repost(self) -> None:
        """Post the status again even if it has not changed (after a pause)."""
        self.posted = None
        self.wake.set()

    def run(self) -> None:
        try:
            while not self.finished and not self.ctx.stopping.is_set():
                self.wake.wait(TICK_S)
                self.wake.clear()
                if not self.ctx.gate.enter():
                    continue
                try:
                    self.sync()
                except httpx.HTTPError:
                    pass  # the API server is slow or away: the next tick tries again
                finally:
                    self.ctx.gate.leave()
        except BaseException:
            self.ctx.problems.append(f"{self!r}: {traceback.format_exc()}")
            raise

    def sync(self) -> None:
        now = time.monotonic()
        if self.deleted:
            # Gone from the API, so no longer an active pod: the device manager frees its
            # devices at once (the scheduler counts them free already), while it dies.
            self.ctx.devices.release(self.uid)
            self._kill_all()
            if self._nothing_runs():
                self._finish()
            return
        if (self.pod["metadata"]).get("deletionTimestamp"):
            self._terminate(now)
            return
        if self.finished_before:
            return
        if self.failure is not None or (not self.admitted and not self._admit()):
            self._post_status()  # again until it is posted: an HTTP error may have lost it
            return
        if self.volumes is None and not self._mount_volumes():
            self._post_status()
            return
        self._step_containers(now)
        self._post_status()
        self._prune_runs()
        if self._phase() in TERMINAL and self._nothing_runs():
            self._release()

    # -------------------------------------------------------------- admission and volumes
    def _admit(self) -> bool:
        try:
            devices = self.ctx.devices.allocate(self.uid, self.pod)
        except AdmissionError as e:
            self._reject("UnexpectedAdmissionError", str(e))
            return False
        for name, ids in devices.items():
            self.containers[name].devices = ids
        # A pod on the host's network has the node's address; others one of their own.
        self.ip = HOST_IP if self.host_network else self.ctx.addresses.take()
        self.admitted = True
        return True

    def _reject(self, reason: str, message: str) -> None:
        """The pod fails admission, as the kubelet rejects a pod: its status is only the
        phase, reason and message."""
        self.failure = (reason, f"Pod {message}")
        self.rejected = True
        self._event("Warning", reason, message)
        self._release()

    def _mount_volumes(self) -> bool:
        lookups = VolumeLookups(
            claim=lambda name: self._get(
                f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{name}"
            ),
            persistent_volume=lambda name: self._get(f"/api/v1/persistentvolumes/{name}"),
            secret=self._secret,
            config_map=self._config_map,
        )
        try:
            if not self.named:
                self.hosts = pod_hosts(self.pod, self.ip, self.directory / "etc-hosts")
                if self.hosts is not None and self.ctx.peers is not None:
                    self.ctx.peers.follow(self.uid, self.pod, self.ip, self.hosts)
                self.named = True
            self.volumes = prepare_volumes(self.pod, self.directory / "volumes", lookups)
        except VolumeUnsupported as e:
            self.failure = ("UnsupportedVolume", str(e))
            self._event("Warning", "FailedMount", str(e))
            self._release()
            return False
        except (VolumeNotReady, OSError) as e:
            if str(e) != self.mount_problem:
                self.mount_problem = str(e)
                self._event("Warning", "FailedMount", f"MountVolume.SetUp failed: {e}")
            return False
        return True

    # -------------------------------------------------------------- containers
    def _inits(self) -> list[Container]:
        return [c for c in self.containers.values() if c.init]

    def _apps(self) -> list[Container]:
        return [c for c in self.containers.values() if not c.init]

    def _restart_policy(self) -> str:
        return str((self.pod.get("spec") or {}).get("restartPolicy") or "Always")

    def _step_containers(self, now: float) -> None:
        policy = self._restart_policy()
        for c in self._inits():
            if c.succeeded:
                continue
            # Init containers restart on failure unless the policy is Never.
            self._step(c, now, restart=policy != "Never" and "terminated" in c.state)
            if not c.succeeded:
                return
        for c in self._apps():
            if c.state.get("waiting", {}).get("reason") == "PodInitializing":
                c.state = {"waiting": {"reason": "ContainerCreating"}}
            exited = c.state.get("terminated")
            restart = exited is not None and (
                policy == "Always" or (policy == "OnFailure" and exited["exitCode"] != 0)
            )
            self._step(c, now, restart)
            self._probe(c, now)

    def _step(self, c: Container, now: float, restart: bool) -> None:
        """Notice the container's exit, or (re)start it when it is due."""
        if c.process is not None:
            code = c.process.exit_code()
            if code is not None:
                self._ended(c, code)
            return
        if "terminated" in c.state:
            if not restart:
                return
            c.restarts += 1
            delay = _backoff(c.restarts)
            c.last_state, c.not_before = {"terminated": c.state["terminated"]}, now + delay
            if delay:
                message = (
                    f"back-off {delay:.0f}s restarting failed container={c.name} "
                    f"pod={self.name}_{self.namespace}({self.uid})"
                )
                c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
                self._event("Warning", "BackOff", "Back-off restarting failed container", c)
            else:
                c.state = {"waiting": {"reason": "ContainerCreating"}}
        if now >= c.not_before:
            self._start(c, now)

    def _ended(self, c: Container, code: int) -> None:
        assert c.process is not None
        # The kernel's verdict first, as a runtime reports it whatever the exit code.
        if c.process.oom_killed(code):
            reason = "OOMKilled"
        else:
            reason = "Completed" if code == 0 else "Error"
        c.state = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": c.started_at,
                "finishedAt": rfc3339(),
                "containerID": c.process.container_id,
            }
        }
        c.process.output_written()
        message = self._termination_message(c, code)
        if message:
            c.state["terminated"]["message"] = message
        self.leftovers.append(c.process)
        c.process = None

    def _termination_message(self, c: Container, code: int) -> str:
        """``FallbackToLogsOnError``: a container that failed says why in its last output,
        at most 80 lines and 2048 bytes of it, as the kubelet takes them (the tier has no
        termination-log file to prefer)."""
        if code == 0 or c.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return ""
        tail = read_cri(self.log_dir / c.name / f"{c.restarts}.log")[-TERMINATION_MESSAGE_BYTES:]
        return "\n".join(tail.splitlines()[-TERMINATION_MESSAGE_LINES:])

    def _start(self, c: Container, now: float) -> None:
        if not c.failed_message:
            self._pulled(c)
        try:
            launch = self._launch(c)
        except PodSpecError as e:
            self._start_failed(c, "CreateContainerConfigError", str(e), now + CONFIG_RETRY_S)
            return
        self._event("Normal", "Created", f"Created container {c.name}", c)
        cgroup = None
        try:
            cgroup = self._cgroup(c, launch)
            process = containers.start(
                self.ctx.sandbox,
                self.directory / "containers" / c.name,
                launch,
                self.log_dir / c.name / f"{c.restarts}.log",
                cgroup,
            )
        except (CannotStart, OSError) as e:
            if cgroup is not None and self.ctx.memory is not None:
                self.ctx.memory.release(cgroup)
            retry = now + max(_backoff(c.restarts + 1), CONFIG_RETRY_S)
            self._start_failed(c, "CreateContainerError", str(e), retry)
            return
        c.process, c.failed_message = process, ""
        c.started_at = rfc3339()
        c.state = {"running": {"startedAt": c.started_at}}
        probe = c.spec.get("readinessProbe")
        c.probe = None if not probe else Probe(probe, due=now + probe.get("initialDelaySeconds", 0))
        self._event("Normal", "Started", f"Started container {c.name}", c)

    def _cgroup(self, c: Container, launch: Launch) -> MemoryCgroup | None:
        """The run's memory cgroup, with its limit (None without a limit, or where the
        machine has no memory controller: a Warning event says the limit is not kept)."""
        if launch.memory_limit is None:
            return None
        if self.ctx.memory is None:
            if c.restarts == 0 and not c.failed_message:
                message = f"memory limit not enforced: {self.ctx.memory_problem}"
                self._event("Warning", "MemoryLimitIgnored", message, c)
            return None
        return self.ctx.memory.create(self.uid, c.name, c.restarts, launch.memory_limit)

    def _start_failed(self, c: Container, reason: str, message: str, retry_at: float) -> None:
        c.state = {"waiting": {"reason": reason, "message": message}}
        c.not_before = retry_at
        if message != c.failed_message:
            c.failed_message = message
            self._event("Warning", "Failed", f"Error: {message}", c)

    def _pulled(self, c: Container) -> None:
        image = str(c.spec.get("image", ""))
        if c.spec.get("imagePullPolicy") == "Always":
            self._event("Normal", "Pulling", f'Pulling image "{image}"', c)
            message = f'Successfully pulled image "{image}" in 0s (present on the machine)'
        else:
            message = f'Container image "{image}" already present on machine'
        self._event("Normal", "Pulled", message, c)

    def _launch(self, c: Container) -> Launch:
        """What the container runs, with what; raises :class:`PodSpecError`."""
        refusal = run_as_refusal(self.pod, c.spec)
        if refusal:
            raise PodSpecError(refusal)
        own = container_env(
            self.pod,
            c.spec,
            pod_ip=self.ip,
            host_ip=HOST_IP,
            secret=self._secret,
            config_map=self._config_map,
        )
        argv = command_line(c.spec, own)
        # The runtime's variables, then the manifest's, then the platform's, which a
        # manifest cannot override (a pod must not name GPUs it was not given).
        platform = {"NVIDIA_VISIBLE_DEVICES": ",".join(c.devices) or "void"}
        read_only: list[Path] = []
        nvml = self.ctx.fake_nvml_dir
        if nvml is not None and (nvml / "libnvidia-ml.so.1").exists():
            library_path = [str(nvml), own.get("LD_LIBRARY_PATH", "")]
            platform["LD_LIBRARY_PATH"] = ":".join(p for p in library_path if p)
            platform["GPUFLEET_FAKE_NVML_CONTROL"] = str(nvml / "control")
            read_only.append(nvml)
        image_env = self.ctx.sandbox.image_env(str(c.spec.get("image", "")))
        env = {
            "PATH": self.ctx.sandbox.default_path(image_env),
            "HOSTNAME": pod_hostname(self.pod),
            **self.ctx.api_service_env,
        }
        env.update({**own, **platform})
        assert self.volumes is not None
        try:
            mounts = container_mounts(c.spec, self.volumes)
        except OSError as e:
            raise PodSpecError(f"preparing the mounts of {c.name}: {e}") from e
        try:
            limit = memory_limit(c.spec)
        except ValueError as e:
            raise PodSpecError(f"resources.limits.memory of {c.name}: {e}") from e
        return Launch(
            argv=argv,
            env=env,
            user=run_as(self.pod, c.spec).user,
            mounts=with_hosts(mounts, None if self.hosts is None else self.hosts.path),
            working_dir=str(c.spec.get("workingDir") or ""),
            read_only=read_only,
            memory_limit=limit,
            image_env=image_env,
            host_pid=bool((self.pod.get("spec") or {}).get("hostPID")),
        )

    # -------------------------------------------------------------- readiness
    def _probe(self, c: Container, now: float) -> None:
        probe = c.probe
        if probe is None or "running" not in c.state or now < probe.due:
            return
        spec = probe.spec
        probe.due = now + max(int(spec.get("periodSeconds", 10)), 1)
        if self._probe_once(c, spec):
            probe.successes, probe.failures = probe.successes + 1, 0
            if probe.successes >= int(spec.get("successThreshold", 1)):
                probe.ready = True
        else:
            probe.successes, probe.failures = 0, probe.failures + 1
            if probe.failures >= int(spec.get("failureThreshold", 3)):
                probe.ready = False

    def _probe_once(self, c: Container, spec: Manifest) -> bool:
        timeout = max(float(spec.get("timeoutSeconds", 1)), 0.1)
        if "httpGet" in spec:
            get = spec["httpGet"]
            host = get.get("host") or self.ip
            scheme = str(get.get("scheme", "HTTP")).lower()
            port = self._port(c, get.get("port"))
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            url = f"{scheme}://{host}:{port}{get.get('path', '/')}"
            try:
                r = httpx.get(url, headers=headers, timeout=timeout, verify=False)
            except httpx.HTTPError:
                return False
            return 200 <= r.status_code < 400
        if "tcpSocket" in spec:
            tcp = spec["tcpSocket"]
            try:
                with socket.create_connection(
                    (tcp.get("host") or self.ip, self._port(c, tcp.get("port"))), timeout
                ):
                    return True
            except OSError:
                return False
        if not c.probe_warned:
            c.probe_warned = True
            message = "Readiness probe: only httpGet and tcpSocket probes are supported here"
            self._event("Warning", "Unhealthy", message, c)
        return False

    @staticmethod
    def _port(c: Container, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in c.spec.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        return 0  # an unknown name: the probe fails, as a real one does

    # -------------------------------------------------------------- termination
    def _terminate(self, now: float) -> None:
        if self.kill_at is None:
            meta = self.pod["metadata"]
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = (self.pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            self.kill_at = now + (DEFAULT_GRACE_S if grace is None else int(grace))
            for c in self.containers.values():
                if c.process is not None:
                    self._event("Normal", "Killing", f"Stopping container {c.name}", c)
                    c.process.terminate()
        elif now >= self.kill_at and not self.killed:
            self._kill_all()
        for c in self.containers.values():
            if c.process is not None:
                code = c.process.exit_code()
                if code is not None:
                    self._ended(c, code)
        if not self._nothing_runs():
            return
        if not self.finished_before:
            self._post_status()
        # Freed before the pod goes: a pod the scheduler places on its GPUs once it is
        # gone must find them free here.
        self._release()
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        r = self.ctx.api.request(
            "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", json=body
        )
        # 409: the name belongs to a newer pod now, and this one is gone.
        if r.status_code not in (404, 409):
            r.raise_for_status()
        self._finish()

    def _kill_all(self) -> None:
        self.killed = True
        for process in self._processes():
            process.kill()

    def _processes(self) -> list[ContainerProcess]:
        running = [c.process for c in self.containers.values() if c.process is not None]
        return [*running, *self.leftovers]

    def _nothing_runs(self) -> bool:
        if any(c.process is not None for c in self.containers.values()):
            return False
        self._prune_runs(every=True)
        return not self.leftovers

    def _prune_runs(self, every: bool = False) -> None:
        """Forgets the ended runs of which nothing is left, removing their cgroups. Only
        those with a cgroup unless ``every``: finding the others' processes scans /proc."""
        kept = []
        for process in self.leftovers:
            if (every or process.cgroup is not None) and process.gone():
                if process.cgroup is None:
                    continue
                assert self.ctx.memory is not None  # which made the cgroup
                if self.ctx.memory.release(process.cgroup):
                    continue
            kept.append(process)
        self.leftovers = kept

    def _release(self) -> None:
        """Frees the pod's devices and address, and its hosts file stops following its
        peers (once nothing of it runs)."""
        if self.released:
            return
        self.released = True
        if self.ctx.peers is not None:
            self.ctx.peers.forget(self.uid)  # before its hosts file goes with its directory
        self.ctx.devices.release(self.uid)
        if self.ip and not self.host_network:
            self.ctx.addresses.release(self.ip)

    def _finish(self) -> None:
        self.log_dir = set_aside(self.log_dir)
        self._release()
        if self.directory.exists():
            remove_tree(self.directory)
        self.finished = True
        self.ctx.forget(self.uid)

    def stop(self) -> None:
        """The kubelet stops: kill what runs, free what the pod holds, remove its files
        (its logs are the kubelet's to remove). Blocking, at most a few seconds."""
        self._kill_all()
        deadline = time.monotonic() + 10.0
        while not self._nothing_runs() and time.monotonic() < deadline:
            for c in self.containers.values():
                code = None if c.process is None else c.process.exit_code()
                if code is not None:
                    self._ended(c, code)
            time.sleep(0.05)
        self._release()
        if self.directory.exists():
            remove_tree(self.directory)

    # -------------------------------------------------------------- status
    def _phase(self) -> str:
        if self.failure is not None:
            return "Failed"
        return pod_phase(
            self._restart_policy(),
            [c.name for c in self._inits()],
            [c.name for c in self._apps()],
            {c.name: c.status() for c in self.containers.values()},
        )

    def _post_status(self) -> None:
        if self.rejected and self.failure is not None:
            reason, message = self.failure
            self._post({"phase": "Failed", "reason": reason, "message": message})
            return
        statuses = {c.name: c.status() for c in self.containers.values()}
        phase = self._phase()
        inits, apps = [c.name for c in self._inits()], [c.name for c in self._apps()]
        stamp = rfc3339()
        conditions = []
        for kind, (value, reason, message) in pod_conditions(phase, inits, apps, statuses).items():
            if self.transitions.get(kind, ("", ""))[0] != value:
                self.transitions[kind] = (value, stamp)
            condition = {
                "type": kind,
                "status": value,
                "lastProbeTime": None,
                "lastTransitionTime": self.transitions[kind][1],
            }
            if reason:
                condition.update(reason=reason, message=message)
            conditions.append(condition)
        scheduled = [
            c
            for c in (self.pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled"
        ]
        if not scheduled:  # a pod given its node directly was never seen by a scheduler
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": self.start_time,
                }
            )
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": HOST_IP,
            "startTime": self.start_time,
            "containerStatuses": [statuses[name] for name in apps],
        }
        if self.ip:
            status["podIP"], status["podIPs"] = self.ip, [{"ip": self.ip}]
        if inits:
            status["initContainerStatuses"] = [statuses[name] for name in inits]
        if self.failure is not None:
            status["reason"], status["message"] = self.failure
        self._post(status)

    def _post(self, status: Mapping[str, Any]) -> None:
        # The uid makes the patch a precondition: never a newer pod of the same name.
        body = {"metadata": {"uid": self.uid}, "status": status}
        if body == self.posted:
            return
        r = self.ctx.api.patch(
            f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status", json=body, headers=SMP
        )
        if r.status_code in (404, 409):
            return  # gone, or replaced: the watch tells
        r.raise_for_status()
        self.posted = body

    # -------------------------------------------------------------- the API
    def _get(self, path: str) -> Manifest | None:
        """An object the node may read; None where it is missing. The Node authorizer learns
        of a bound pod's references a moment late, so 403 is "not yet" too."""
        r = self.ctx.api.get(path)
        if r.status_code in (403, 404):
            return None
        r.raise_for_status()
        result: Manifest = r.json()
        return result

    def _secret(self, name: str) -> Mapping[str, str] | None:
        found = self._get(f"/api/v1/namespaces/{self.namespace}/secrets/{name}")
        if found is None:
            return None
        return {
            k: base64.b64decode(v).decode(errors="surrogateescape")
            for k, v in (found.get("data") or {}).items()
        }

    def _config_map(self, name: str) -> Mapping[str, str] | None:
        found = self._get(f"/api/v1/namespaces/{self.namespace}/configmaps/{name}")
        return None if found is None else dict(found.get("data") or {})

    def _event(
        self, kind: str, reason: str, message: str, container: Container | None = None
    ) -> None:
        """Posts an Event about the pod, as a kubelet does (best effort: a lost event
        changes nothing the pod does)."""
        stamp = rfc3339()
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
        }
        if container is not None:
            involved["fieldPath"] = container.field_path
        event = {
            "metadata": {
                "name": f"{self.name}.{uuid.uuid4().hex[:16]}",
                "namespace": self.namespace,
            },
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.ctx.node},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.ctx.node,
        }
        try:
            self.ctx.api.post(f"/api/v1/namespaces/{self.namespace}/events", json=event)
        except httpx.HTTPError:
            return


def _metadata_changed(before: Manifest, after: Manifest) -> bool:
    """Whether the pod's labels or annotations changed (what its downward API shows)."""
    old, new = before.get("metadata") or {}, after.get("metadata") or {}
    return any(old.get(key) != new.get(key) for key in ("labels", "annotations"))
