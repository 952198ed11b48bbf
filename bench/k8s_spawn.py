"""Spawn latency on Kubernetes: gpufleet's KubeGPUSpawner against stock KubeSpawner 7.

Measured: from the spawn request to JupyterLab answering through the proxy, median of 5,
KubeGPUSpawner against stock KubeSpawner 7 on the same cluster (target: ratio <= 1.10),
and the milliseconds gpufleet's own steps add (queue handshake, placement, GPU read-back).

The test tier's two real clusters (``tests/k8s``: etcd, kube-apiserver, kube-scheduler,
kube-controller-manager each; fake GPU nodes whose test kubelets run pods on this machine,
in the session sandbox) and two hubs started from the same test configuration
(``tests/integration/harness.Hub``), both up all along, on the same tier:

- gpufleet: exactly ``tests/k8s/test_sessions.py``'s ``KUBE_CONFIG`` (KubeGPUSpawner, the
  controller watching both clusters, no node agent);
- stock: ``kubespawner.KubeSpawner`` on cluster-a as the spawner identity (``KUBECONFIG`` in
  the hub's environment), the same image and command, one ``nvidia.com/gpu``, the GPU
  toleration and node selector, non-root (uid 1000), the server bound to the pod's IP from
  the downward API as KubeGPUSpawner binds it, the same 5 s deletion grace. Its controller
  watches the clusters too, so both hubs carry the same background work; only the spawner
  differs.

Two hubs rather than one restarted between configurations: the runs can then alternate
(gpufleet, stock, gpufleet, ...) so a slow moment of the machine hits both alike, and
neither pays a hub start or a first reflector inside a timed run. One untimed spawn of each
comes first (``--warmup``): the first spawn of a hub starts its reflectors and clients, and
gpufleet's controller makes the user's account.

A run: ``POST /hub/api/users/alice/server`` (1 GPU) until ``GET /user/alice/lab`` through
the proxy answers 200 with JupyterLab's page (polled every 50 ms with the user's token);
then the server is stopped and the next run waits until its pod is gone from the API
server (and gpufleet's workload has ended). Both hubs answer the POST at once (tornado
setting ``slow_spawn_timeout`` 0), so the bench follows the spawn's progress from its start.

Where the time goes, from what the spawn itself reports, stamped as it arrives:
- both: the pod's creation, binding, phase Running, Ready condition and deletion, from a
  watch of the namespace in each cluster; "is running at" in the server's own log (the
  test kubelet keeps its output); the hub's ``ready`` progress event (spawn done, proxy
  route added);
- gpufleet: the controller's ``created_at``, ``admitted_at`` and ``started_at`` of the
  workload, and the progress message "GPUs assigned" (the spawner has its placement; left
  out when it came with the stream's opening, its moment then unknown).
The controller's and the log's times are this machine's wall clock.
GPU read-back: the node agent does not run in this configuration (as in test_sessions.py),
so nothing is read back; on a node with an agent the read-back is asynchronous
(``c.NodeAgent.placement_interval``) and not on the spawn's path.

    .venv/bin/python bench/k8s_spawn.py              # --runs 5 --warmup 1 --max-load 4
    .venv/bin/python bench/k8s_spawn.py --runs 9 --verbose --keep-logs /tmp/k8s-spawn

Needs the tier's binaries (``scripts/install --k8s``) and root (the test kubelets run
containers as their pods' users). Every process it starts is stopped at the end, on failure
and on Ctrl-C (or SIGTERM) too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from k8s_spawn_observe import PodSeen, PodWatch, ProgressStream

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' tier and hub harness
from gpufleet.clusters.manifests import priority_class
from tests.integration.harness import Hub
from tests.k8s.control_plane import NAMESPACE, ControlPlane, K8sUnavailable, find_binaries
from tests.k8s.processes import TierStartError
from tests.k8s.test_sessions import KUBE_CONFIG
from tests.k8s.tier import CLUSTER_A, CLUSTER_B, TIER_NODES

USER = "alice"
TARGET_RATIO = 1.10
POLL_S = 0.05
REPLAY_S = 0.01
SPAWN_DEADLINE_S = 180.0
# Both hubs: answer the spawn POST at once (202) so the progress stream can be followed
# from the start; JupyterHub's default waits up to 10 s inside the request, doing nothing.
BOTH = """
c.JupyterHub.tornado_settings.update({"slow_spawn_timeout": 0})
"""
STOCK_CONFIG = """
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.FleetController.clusters = {controller!r}
c.KubeInventory.probe_interval = 1
c.JupyterHub.services = [s for s in c.JupyterHub.services if s["name"] != "gpufleet-agent"]
c.JupyterHub.load_roles = [r for r in c.JupyterHub.load_roles if r["name"] != "gpufleet-agent"]
# Its reconciler would stop this hub's servers, which no gpufleet workload accounts for.
c.Reconciling.interval = 86400
c.KubeSpawner.namespace = {namespace!r}
c.KubeSpawner.image = "gpufleet/session:test"
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]
# Every pod of the tier shares this machine's network: bind the pod's own IP, as
# KubeGPUSpawner does (--ip=$(GPUFLEET_POD_IP)), not KubeSpawner's 0.0.0.0.
c.KubeSpawner.args = ["--ip=$(POD_IP)"]
c.KubeSpawner.environment = {{
    "POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}}
}}
c.KubeSpawner.uid = 1000
c.KubeSpawner.gid = 1000
c.KubeSpawner.extra_resource_limits = {{"nvidia.com/gpu": "1"}}
c.KubeSpawner.tolerations = [
    {{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}}
]
c.KubeSpawner.node_selector = {{"nvidia.com/gpu.present": "true"}}
c.KubeSpawner.delete_grace_period = 5
c.KubeSpawner.pod_name_template = "stock-{{user_server}}"
"""


@dataclass
class StockHub(Hub):
    """A hub whose KubeSpawner loads its client configuration from ``$KUBECONFIG``."""

    kubeconfig: str = ""

    @classmethod
    def using(cls, root: Path, extra_config: str, kubeconfig: Path) -> StockHub:
        hub = Hub.create(root, extra_config)
        return cls(hub.data_dir, hub.base_port, hub.token, hub.log_path, kubeconfig=str(kubeconfig))

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        env["KUBECONFIG"] = self.kubeconfig
        return env


@dataclass
class Side:
    """One of the two spawners: its hub, the spawn's options, its pods' name prefix."""

    name: str
    hub: Hub
    options: dict[str, Any]
    pod_prefix: str
    token: str = ""
    runs: list[Run] = field(default_factory=list)
    warmups: list[Run] = field(default_factory=list)


@dataclass
class Run:
    """One spawn: seconds from the POST to each moment (None where not seen)."""

    total: float
    load: float
    cluster: str
    moments: dict[str, float | None]
    log: str = ""  # the server's output


# ------------------------------------------------------------------ the tier and hubs
def start_tier() -> ControlPlane:
    plane = ControlPlane.start(find_binaries(), dict(TIER_NODES))
    try:
        for cluster in plane.clusters.values():
            with cluster.rest() as api:
                made = api.post(
                    "/apis/scheduling.k8s.io/v1/priorityclasses",
                    json=priority_class("gpufleet-session", 1000, "gpufleet sessions"),
                )
                if made.status_code not in (201, 409):
                    raise RuntimeError(f"PriorityClass in {cluster.name}: {made.text}")
    except BaseException:
        plane.stop()
        raise
    return plane


def hub_configs(plane: ControlPlane) -> tuple[str, str]:
    """The gpufleet hub's extra configuration (test_sessions.py's) and the stock one's."""
    controller = [
        {"name": name, "kubeconfig": str(plane.kubeconfig), "context": name}
        for name in (CLUSTER_A, CLUSTER_B)
    ]
    spawner = [
        {
            "name": name,
            "kubeconfig": str(plane[name].kubeconfig("spawner", NAMESPACE)),
            "namespace": NAMESPACE,
        }
        for name in (CLUSTER_A, CLUSTER_B)
    ]
    gpufleet = textwrap.dedent(KUBE_CONFIG).format(controller=controller, spawner=spawner)
    stock = textwrap.dedent(STOCK_CONFIG).format(controller=controller, namespace=NAMESPACE)
    return gpufleet + BOTH, stock + BOTH


@contextmanager
def running(hub: Hub) -> Iterator[Hub]:
    """The hub started; at the end its servers stopped and everything of it killed."""
    try:
        hub.start()
        yield hub
    finally:
        with suppress(httpx.HTTPError, AssertionError):
            if hub.proc is not None and hub.proc.poll() is None:
                hub.stop_server(USER)
                hub.wait_gone(USER, timeout=30)
        hub.kill_everything()


@contextmanager
def watching(plane: ControlPlane) -> Iterator[list[PodWatch]]:
    watches = [PodWatch(name, plane[name].rest, NAMESPACE) for name in (CLUSTER_A, CLUSTER_B)]
    for watch in watches:
        watch.start()
    try:
        yield watches
    finally:
        for watch in watches:
            watch.stop()


# ------------------------------------------------------------------ one spawn
def lab_answers(client: httpx.Client, url: str) -> bool:
    try:
        r = client.get(url)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and "jupyter-config-data" in r.text


def new_pod(watches: list[PodWatch], prefix: str, after: float) -> PodSeen | None:
    for watch in watches:
        for pod in watch.pods():
            if pod.name.startswith(prefix) and pod.added is not None and pod.added >= after:
                return pod
    return None


LOG_TIME = re.compile(r"^\[[A-Z] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ")


def server_log(plane: ControlPlane, pod: PodSeen) -> str:
    """The server's output (its container's, kept by the test kubelet until it stops)."""
    if not pod.node:
        return ""
    return plane[pod.cluster].kubelet(pod.node).logs(NAMESPACE, pod.name, "notebook")


def server_moments(log: str, began: float) -> dict[str, float | None]:
    """When the server said it listens ("is running at" in its log), as seconds after
    ``began`` (monotonic); the log's times are this machine's wall clock."""
    offset = time.time() - time.monotonic()
    for line in log.splitlines():
        stamp = LOG_TIME.match(line)
        if stamp is not None and "is running at" in line:
            at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            return {"server listening": at - offset - began}
    return {"server listening": None}


def controller_moments(side: Side, workload_id: int, began: float) -> dict[str, float | None]:
    """The workload's created/admitted/started times, as seconds after ``began``
    (monotonic): the controller's clock is this machine's wall clock."""
    body = side.hub.controller("GET", f"/workloads/{workload_id}").json()
    offset = time.time() - time.monotonic()

    def moment(key: str) -> float | None:
        if not body.get(key):
            return None
        at = datetime.fromisoformat(body[key])
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return at.timestamp() - offset - began

    return {
        "request queued": moment("created_at"),
        "admitted": moment("admitted_at"),
        "running reported": moment("started_at"),
    }


def spawn_once(side: Side, plane: ControlPlane, watches: list[PodWatch], verbose: bool) -> Run:
    hub = side.hub
    load = os.getloadavg()[0]
    lab_url = f"{hub.url}/user/{USER}/lab"
    with httpx.Client(headers={"Authorization": f"token {side.token}"}, timeout=10) as client:
        began = time.monotonic()
        response = hub.spawn(USER, "", **side.options)
        if response.status_code not in (201, 202):
            raise RuntimeError(f"{side.name}: the spawn was refused: {response.text}")
        progress = ProgressStream(f"{hub.api}/users/{USER}/server/progress", hub.token)
        reader = progress.start()
        deadline = began + SPAWN_DEADLINE_S
        while not lab_answers(client, lab_url):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{side.name}: JupyterLab did not answer in time; see {hub.log_path}"
                )
            time.sleep(POLL_S)
        total = time.monotonic() - began
    reader.join(10)
    pod = new_pod(watches, side.pod_prefix, began)

    def rel(at: float | None) -> float | None:
        return None if at is None else at - began

    moments: dict[str, float | None] = {
        "POST": 0.0,
        "pod created": rel(pod.added) if pod else None,
        "pod bound": rel(pod.bound) if pod else None,
        "pod running": rel(pod.running) if pod else None,
        "pod ready": rel(pod.ready) if pod else None,
        "hub ready": rel(progress.ready()),
        "lab 200": total,
    }
    log = server_log(plane, pod) if pod is not None else ""
    moments.update(server_moments(log, began))
    workload = hub.workload_of(USER) if side.name == "gpufleet" else None
    if workload is not None:
        moments.update(controller_moments(side, workload["id"], began))
        assigned = progress.first("GPUs assigned")
        # An event that came with the stream's opening happened before it: its time is
        # unknown (the stream opens a few tens of milliseconds after the POST).
        replayed = assigned is not None and assigned - progress.opened < REPLAY_S
        moments["GPUs assigned"] = None if replayed else rel(assigned)
    if verbose:
        print(f"      {progress.opened - began:7.3f}  (progress stream opened)")
        for at, event in progress.events:
            print(f"      {at - began:7.3f}  {event.get('message', event)}")
        if progress.error:
            print(f"      progress: {progress.status} {progress.error}")
    stop(side, watches, pod, workload)
    return Run(total, load, pod.cluster if pod else "?", moments, log)


def stop(
    side: Side, watches: list[PodWatch], pod: PodSeen | None, workload: dict[str, Any] | None
) -> None:
    """Stop the server; return once its pod is gone (and gpufleet's workload ended)."""
    hub = side.hub
    response = hub.stop_server(USER)
    if response.status_code not in (202, 204):
        raise RuntimeError(f"{side.name}: stopping the server: {response.text}")
    if pod is not None:
        watch = next(w for w in watches if w.cluster == pod.cluster)
        if watch.wait(lambda: pod.deleted, 90) is None:
            raise RuntimeError(f"{side.name}: pod {pod.name} still there 90 s after the stop")
    hub.wait_gone(USER, timeout=90)
    if workload is not None:
        hub.wait_ended(workload, timeout=90)


# ------------------------------------------------------------------ the report
def seconds(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s ({min(values):.2f}–{max(values):.2f})"


def median_span(runs: list[Run], start: str, end: str) -> float | None:
    """The median seconds from ``start`` to ``end`` over the runs that saw both."""
    spans = []
    for r in runs:
        a, b = r.moments.get(start), r.moments.get(end)
        if a is not None and b is not None:
            spans.append(b - a)
    return statistics.median(spans) if spans else None


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f} ms"


PHASES = (
    ("POST", "pod created", "POST → pod created (the spawner's work before the pod)"),
    ("pod created", "pod bound", "pod created → bound (kube-scheduler)"),
    ("pod bound", "pod running", "bound → Running (test kubelet: sandbox, container)"),
    ("pod running", "server listening", "Running → listening (the server's own start)"),
    ("server listening", "hub ready", "listening → hub ready (spawner, hub's check, route)"),
    ("hub ready", "lab 200", "hub ready → lab 200 (through the proxy)"),
)
GPUFLEET_PHASES = (
    ("POST", "request queued", "POST → request queued (hub, dry-run check, open request)"),
    ("request queued", "admitted", "request queued → admitted (admission cycle)"),
    ("admitted", "GPUs assigned", "admitted → spawner has placement (long-poll answer)"),
    ("GPUs assigned", "pod created", "placement → pod created (account, NetworkPolicy, pod)"),
    ("server listening", "pod ready", "listening → pod Ready (its readiness probe, every 2 s)"),
    ("pod ready", "running reported", "pod Ready → running reported (KubeSpawner's back-off)"),
    ("running reported", "hub ready", "running reported → hub ready (hub's check, route)"),
)


def report(gpufleet: Side, stock: Side, started: dict[str, float]) -> None:
    ours = [r.total for r in gpufleet.runs]
    theirs = [r.total for r in stock.runs]
    ratio = statistics.median(ours) / statistics.median(theirs)
    n = len(ours)
    print()
    print(f"spawn → JupyterLab answering through the proxy, 1 GPU, {n} runs each, interleaved")
    print(f"  gpufleet KubeGPUSpawner : {seconds(ours)}  (median, min–max)")
    print(f"  stock KubeSpawner 7     : {seconds(theirs)}")
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"  ratio gpufleet / stock  : {ratio:6.3f}  (target <= {TARGET_RATIO}: {verdict})")
    for side in (gpufleet, stock):
        for r in side.warmups:
            print(f"  first spawn (warm-up, untimed in the median), {side.name}: {r.total:.2f} s")
    print(
        "  hub start (hub, proxy, controller watching both clusters): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in started.items())
    )
    loads = [r.load for side in (gpufleet, stock) for r in side.runs]
    print(f"  load average (1 min) at the runs' starts: {min(loads):.2f}–{max(loads):.2f}")
    clusters = [r.cluster for r in gpufleet.runs]
    print(f"  gpufleet's pods went to: {', '.join(clusters)}; stock's: cluster-a")

    print()
    print(f"{'median of each phase':<62} {'gpufleet':>10} {'stock':>10} {'difference':>11}")
    for start, end, what in PHASES:
        ours_s = median_span(gpufleet.runs, start, end)
        theirs_s = median_span(stock.runs, start, end)
        both = None if ours_s is None or theirs_s is None else ours_s - theirs_s
        print(f"  {what:<60} {ms(ours_s):>10} {ms(theirs_s):>10} {ms(both):>11}")
    print()
    print("gpufleet's own steps (median)")
    for start, end, what in GPUFLEET_PHASES:
        print(f"  {what:<60} {ms(median_span(gpufleet.runs, start, end)):>10}")
    print(
        "  GPU read-back: none here (no node agent in this configuration, as in "
        "test_sessions.py); with an agent it is asynchronous, off the spawn's path"
    )
    print()
    print("per run (s after the POST):")
    keys = (
        "request queued",
        "admitted",
        "GPUs assigned",
        "pod created",
        "pod bound",
        "pod running",
        "server listening",
        "pod ready",
        "running reported",
        "hub ready",
        "lab 200",
    )
    print(f"  {'':<9} {'load':>5} " + " ".join(f"{k[:10]:>10}" for k in keys))
    for i in range(n):
        for side in (gpufleet, stock):
            r = side.runs[i]
            cells = " ".join(
                f"{r.moments[k]:10.3f}" if r.moments.get(k) is not None else f"{'':>10}"
                for k in keys
            )
            print(f"  {side.name:<9} {r.load:5.2f} {cells}")


# ------------------------------------------------------------------ main
def wait_for_quiet(max_load: float, patience: float) -> None:
    deadline = time.monotonic() + patience
    while (load := os.getloadavg()[0]) > max_load and time.monotonic() < deadline:
        print(f"load average {load:.2f} > {max_load}: waiting", flush=True)
        time.sleep(30)
    load = os.getloadavg()[0]
    if load > max_load:
        print(f"load average still {load:.2f} after {patience:.0f} s: measuring anyway")


def run(args: argparse.Namespace) -> None:
    began = time.monotonic()
    plane = start_tier()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp, ExitStack() as cleanup:
        cleanup.callback(plane.stop)
        print(f"tier up in {time.monotonic() - began:.1f} s", flush=True)
        gpufleet_config, stock_config = hub_configs(plane)
        spawner_kubeconfig = plane[CLUSTER_A].kubeconfig("spawner", NAMESPACE)
        gpufleet = Side(
            "gpufleet",
            Hub.create(Path(tmp) / "gpufleet", gpufleet_config),
            {"project": "vision", "gpu_type": "A100-80GB", "gpus": 1},
            "jupyter-",
        )
        stock = Side(
            "stock",
            StockHub.using(Path(tmp) / "stock", stock_config, spawner_kubeconfig),
            {},
            "stock-",
        )
        if args.keep_logs:
            cleanup.callback(keep_logs, Path(args.keep_logs), [gpufleet, stock])
        started: dict[str, float] = {}
        for side in (gpufleet, stock):
            t = time.monotonic()
            cleanup.enter_context(running(side.hub))
            started[side.name] = time.monotonic() - t
            side.token = side.hub.user_token(USER)
        watches = cleanup.enter_context(watching(plane))
        for i in range(args.warmup):
            for side in (gpufleet, stock):
                side.warmups.append(spawn_once(side, plane, watches, args.verbose))
                print(f"warm-up {i + 1} {side.name}: {side.warmups[-1].total:.2f} s", flush=True)
        wait_for_quiet(args.max_load, args.load_patience)
        for i in range(args.runs):
            for side in (gpufleet, stock):
                if args.pause:
                    time.sleep(args.pause)
                result = spawn_once(side, plane, watches, args.verbose)
                side.runs.append(result)
                print(
                    f"run {i + 1} {side.name:<8} {result.total:6.2f} s  "
                    f"(load {result.load:.2f}, {result.cluster})",
                    flush=True,
                )
        report(gpufleet, stock, started)


def keep_logs(directory: Path, sides: list[Side]) -> None:
    """Copies each hub's log (the hub, proxy and controller) and each spawn's server log
    into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for side in sides:
        if side.hub.log_path.exists():
            shutil.copy(side.hub.log_path, directory / f"{side.name}-hub.log")
        for label, runs in (("warmup", side.warmups), ("run", side.runs)):
            for i, r in enumerate(runs, 1):
                (directory / f"{side.name}-{label}{i}-server.log").write_text(r.log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="timed spawns of each spawner")
    parser.add_argument("--warmup", type=int, default=1, help="untimed spawns of each first")
    parser.add_argument(
        "--pause", type=float, default=2.0, help="seconds of quiet before each spawn"
    )
    parser.add_argument("--max-load", type=float, default=4.0)
    parser.add_argument(
        "--load-patience", type=float, default=600.0, help="seconds to wait for --max-load"
    )
    parser.add_argument("--verbose", action="store_true", help="print each progress event")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the hubs' logs here at the end")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    def stop_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop_signal)
    try:
        run(args)
    except (K8sUnavailable, TierStartError, RuntimeError, AssertionError) as e:
        raise SystemExit(f"k8s_spawn: {e}") from None


if __name__ == "__main__":
    main()
