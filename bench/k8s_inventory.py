"""The Kubernetes inventory under kubelet churn: one node's change seen, and the CPU it costs.

Targets: with 2 clusters × 500 fake GPU Nodes whose status and Leases are renewed every
10 s as real kubelets do, one node's change seen by the scheduler within 1 s at p99, and
the controller's CPU under that churn under 5 % of a core.

Two real clusters of the test tier (``tests/k8s/control_plane.py``: etcd, kube-apiserver,
kube-scheduler, kube-controller-manager each), started without nodes; ``k8s_churn.py``, a
process of its own, registers ``--nodes-per-cluster`` GPU nodes in each in bulk and renews
every node's status (its conditions' heartbeats) and its Lease once a ``--period``, spread
evenly. The node-lifecycle controller runs with Kubernetes' default 40 s grace (the tier's
5 s would mark every node that renews only every 10 s Unknown).

Under test, a process of its own (``k8s_observers.py controller``): ``KubeInventory``
watching both clusters as gpufleet's controller identity and writing into a SQLite
``FleetStore``, as the leading controller does (its defaults: writes as soon as a watch
reports a change, probes every 5 s). Its store prints a timestamp (``time.monotonic``, one
clock for every process of the machine) when ``sync_cluster_nodes`` has committed, naming
the nodes whose record changed: the moment the scheduler can see the change, measured
where it happens, without polling the database.

Baseline, a process of its own in the same run (``k8s_observers.py watcher``): a bare
watcher (httpx; list, then a streaming watch of ``/api/v1/nodes`` on each cluster, as the
same identity; each event JSON-parsed, a node's cordon and GPU count compared with the
last ones, nothing else), which prints a timestamp when it sees the same change.
``--aiohttp-watcher`` adds a second one, the same over aiohttp (the transport under
gpufleet's ``kubernetes_asyncio``).

Measurement: once the nodes are Ready and the churn driver keeps to its plan (it falls
behind while a thousand nodes come up), ``--cpu-window`` seconds (20) of churn alone, then
``--changes`` times at random moments (0.25–1.25 s apart) a random node is changed as its
cluster's admin — cordoned, then uncordoned at the next such change (``spec.unschedulable``),
or one time in four its allocatable GPUs moved from 8 to 7 and back — and the time from
just before the PATCH to each process's timestamp is taken. Printed: p50/p99/max of every
side and the ratios; the CPU time (``/proc/<pid>/stat``) of the controller and of the
watchers in both windows, in percent of one core, and the ratios; beside them the API
servers', etcds', controller-managers', schedulers', the churn driver's, everything else's
on the machine and how busy it was; the churn actually achieved (renewals per second, the
longest time between two renewals of one node, how far behind its plan the driver was);
and what the store wrote (transactions, events by kind).

    .venv/bin/python bench/k8s_inventory.py        # --nodes-per-cluster 500 --changes 100
    .venv/bin/python bench/k8s_inventory.py --nodes-per-cluster 50 --changes 20
    .venv/bin/python bench/k8s_inventory.py --profile   # cProfile of the controller's window

Needs the tier's binaries (``scripts/install --k8s``). Every process it starts is stopped
at the end, on failure and on Ctrl-C (or SIGTERM) too.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pstats
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from k8s_children import Child, CpuWindow
from k8s_churn import GPUS, node_specs
from sqlalchemy import func, select

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' Kubernetes tier
from gpufleet.state import db
from gpufleet.state.models import Event
from tests.k8s import control_plane
from tests.k8s.control_plane import ControlPlane, K8sUnavailable, find_binaries
from tests.k8s.nodes import GPU_RESOURCE, is_ready
from tests.k8s.processes import ManagedProcess, TierStartError

CLUSTERS = ("cluster-a", "cluster-b")
# Kubernetes' default --node-monitor-grace-period: a kubelet renewing every 10 s is fine.
NODE_MONITOR_GRACE_S = 40
SEEN_DEADLINE_S = 15.0
TARGET_P99_S = 1.0
TARGET_CPU = 5.0  # % of one core


# --------------------------------------------------------------------- the bench
GPUFLEET, WATCHER, AIOHTTP_WATCHER = "gpufleet", "bare watcher", "bare watcher (aiohttp)"
THREADED_WATCHER = "bare watcher (thread)"


@dataclass
class Change:
    cluster: str
    node: str
    kind: str  # "cordon", "uncordon", "gpus"
    sent: float
    answered: float = 0.0
    seen: dict[str, float | None] = field(default_factory=dict)  # by side


class Sightings:
    """When each side reported each node changed (monotonic times), by (cluster, node)."""

    def __init__(self) -> None:
        self.times: dict[str, dict[tuple[str, str], list[float]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.transactions: list[dict[str, Any]] = []

    def controller(self, kind: str, message: dict[str, Any]) -> None:
        if kind == "synced":
            self.transactions.append(message)
            for node in message["changed"]:
                self.times[GPUFLEET][message["cluster"], node].append(message["t"])

    def watcher(self, side: str) -> Callable[[str, dict[str, Any]], None]:
        def seen(kind: str, message: dict[str, Any]) -> None:
            if kind == "seen":
                self.times[side][message["cluster"], message["node"]].append(message["t"])

        return seen

    def first_after(self, side: str, cluster: str, node: str, t: float) -> float | None:
        return next((s for s in self.times[side].get((cluster, node), []) if s >= t), None)


def start_plane(binaries: control_plane.Binaries) -> ControlPlane:
    """Both clusters without nodes (the churn driver registers them), the node-lifecycle
    controller at Kubernetes' default grace. The tier reads its grace from
    ``control_plane.NODE_MONITOR_GRACE_S`` when it starts the controller-manager; it is set
    for this start only."""
    options: dict[str, Any] = {"spare_kubelets": 0}
    if "kubelets" in inspect.signature(ControlPlane.start).parameters:
        options["kubelets"] = False  # no test kubelets: no pods run here
    grace = control_plane.NODE_MONITOR_GRACE_S
    control_plane.NODE_MONITOR_GRACE_S = NODE_MONITOR_GRACE_S
    try:
        return ControlPlane.start(binaries, {name: [] for name in CLUSTERS}, **options)
    finally:
        control_plane.NODE_MONITOR_GRACE_S = grace


def wait_all_ready(plane: ControlPlane, count: int, driver: Child, deadline_s: float) -> float:
    """Until every cluster has ``count`` nodes Ready and untainted; the seconds it took."""
    began = time.monotonic()
    for name in CLUSTERS:
        with plane[name].rest(timeout_s=60.0) as api:
            while True:
                nodes = api.get("/api/v1/nodes").raise_for_status().json()["items"]
                ready = sum(1 for n in nodes if is_ready(n))
                if ready >= count:
                    break
                if driver.process.poll() is not None:
                    raise RuntimeError(f"the churn driver exited\n{driver.tail()}")
                if time.monotonic() - began > deadline_s:
                    raise RuntimeError(
                        f"{name}: {ready} of {count} nodes Ready after {deadline_s} s"
                    )
                time.sleep(5.0)  # a listing of every node is work for the API server too
    return time.monotonic() - began


def wait_on_plan(driver: Child, period: float, deadline_s: float) -> float | None:
    """Until a whole period of renewals went out on time (under a tenth of a period late):
    a driver that fell behind while the nodes came up catches up first, at more than the
    planned rate. The seconds it took; None if it did not catch up by the deadline."""
    began = time.monotonic()
    seen = len(driver.of_kind("churn"))

    def on_plan() -> bool:
        return any(m["lag_max"] < period / 10 for m in driver.of_kind("churn")[seen:])

    if driver.wait_for(on_plan, "renewals on time", deadline_s, missing_ok=True):
        return time.monotonic() - began
    return None


def make_changes(
    plane: ControlPlane,
    count: int,
    nodes_per_cluster: int,
    sightings: Sightings,
    sides: Mapping[str, Child],
    rng: random.Random,
) -> list[Change]:
    """``count`` changes of random nodes at random moments, each waited for on every side:
    three in four a cordon or an uncordon (alternately: a random node cordoned, then
    uncordoned at the next such change), one in four a GPU count change (likewise: a random
    node's allocatable GPUs 8 → 7, then back to 8)."""
    names = [(c, s.name) for c in CLUSTERS for s in node_specs(c, nodes_per_cluster)]
    cordoned: list[tuple[str, str]] = []  # the node cordoned last, until it is uncordoned
    short: list[tuple[str, str]] = []  # the node at GPUS - 1, until it is back at GPUS
    clients = {c: plane[c].rest(timeout_s=30.0) for c in CLUSTERS}
    changes: list[Change] = []
    try:
        for api in clients.values():  # connections open before the first change
            api.get("/version").raise_for_status()
        for _ in range(count):
            time.sleep(rng.uniform(0.25, 1.25))
            if rng.random() < 0.25:
                (cluster, node), back = _toggle(names, short, rng)
                kind, path = "gpus", f"/api/v1/nodes/{node}/status"
                body: dict[str, Any] = {
                    "status": {"allocatable": {GPU_RESOURCE: str(GPUS if back else GPUS - 1)}}
                }
            else:
                (cluster, node), back = _toggle(names, cordoned, rng)
                kind, path = ("uncordon" if back else "cordon"), f"/api/v1/nodes/{node}"
                body = {"spec": {"unschedulable": not back}}
            change = Change(cluster, node, kind, time.monotonic())
            clients[cluster].patch(
                path, json=body, headers={"Content-Type": "application/strategic-merge-patch+json"}
            ).raise_for_status()
            change.answered = time.monotonic()
            changes.append(change)
            for side, child in sides.items():

                def seen(side: str = side, c: Change = change) -> bool:
                    return sightings.first_after(side, c.cluster, c.node, c.sent) is not None

                child.wait_for(
                    seen,
                    f"{side} seeing {kind} of {node}",
                    SEEN_DEADLINE_S,
                    missing_ok=True,  # not seen in time: counted as missed
                )
                change.seen[side] = sightings.first_after(side, cluster, node, change.sent)
    finally:
        for api in clients.values():
            api.close()
    return changes


def _toggle(
    names: Sequence[tuple[str, str]], changed: list[tuple[str, str]], rng: random.Random
) -> tuple[tuple[str, str], bool]:
    """A random node to change, and whether it is changed back: alternately one of
    ``names`` (then kept in ``changed``) and the one in ``changed`` (True)."""
    if changed:
        return changed.pop(), True
    changed.append(rng.choice(names))
    return changed[0], False


def run(args: argparse.Namespace) -> None:
    try:
        binaries = find_binaries()
    except K8sUnavailable as e:
        raise SystemExit(str(e)) from None
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-k8s-"))
    children: list[Child] = []
    plane: ControlPlane | None = None
    sightings = Sightings()
    try:
        began = time.monotonic()
        plane = start_plane(binaries)
        print(f"two control planes up in {time.monotonic() - began:.1f} s", flush=True)
        clusters = [
            {
                "name": name,
                "server": plane[name].server,
                "ca": str(plane.ca.cert_path),
                "admin": plane[name].identities["admin"].token,
                "token": plane[name].identities["controller"].token,
            }
            for name in CLUSTERS
        ]
        driver = start_churn(args, plane, clusters, work, children)
        database = work / "gpufleet.sqlite"
        profile = work / "controller.pstats" if args.profile else None
        sides = start_observers(args, plane, clusters, database, profile, sightings, children)
        wait_listed(args.nodes_per_cluster, sides, sightings)
        caught_up = wait_on_plan(driver, args.period, deadline_s=300.0)
        if caught_up is None:
            print("the churn driver is still behind its plan after 300 s: measuring anyway")
        else:
            print(f"renewals on time after {caught_up:.0f} s; measuring", flush=True)
        measure(args, plane, driver, sides, sightings, rng, database)
        if profile is not None and profile.exists():
            print_profile(profile)
    finally:
        for child in reversed(children):
            child.stop()
        if plane is not None:
            plane.stop()
        shutil.rmtree(work, ignore_errors=True)


def start_churn(
    args: argparse.Namespace,
    plane: ControlPlane,
    clusters: Sequence[Mapping[str, str]],
    work: Path,
    children: list[Child],
) -> Child:
    """The churn driver (in ``children``), once its nodes are registered and Ready."""
    n = args.nodes_per_cluster
    churn = _config(
        work / "churn.json",
        {
            "period": args.period,
            "connections": args.connections,
            "clusters": [{**c, "token": c["admin"], "count": n} for c in clusters],
        },
    )
    here = Path(__file__).resolve().parent
    driver = Child("churn", [sys.executable, str(here / "k8s_churn.py"), str(churn)], work)
    children.append(driver)
    driver.wait_for(lambda: driver.last("registered") is not None, "registration", 600.0)
    registered = driver.last("registered") or {}
    print(
        f"{registered['nodes']} nodes registered (Node, status, Lease) in "
        f"{registered['seconds']:.1f} s",
        flush=True,
    )
    ready_s = wait_all_ready(plane, n, driver, deadline_s=120.0 + n / 5)
    print(f"all Ready (not-ready taints gone) {ready_s:.1f} s later", flush=True)
    return driver


def start_observers(
    args: argparse.Namespace,
    plane: ControlPlane,
    clusters: Sequence[Mapping[str, str]],
    database: Path,
    profile: Path | None,
    sightings: Sightings,
    children: list[Child],
) -> dict[str, Child]:
    """The controller under test (its store in ``database``, made here) and the bare
    watchers asked for, each reporting to ``sightings``: the sides, by name."""
    engine = db.make_engine(f"sqlite:///{database}")
    db.upgrade(engine)
    engine.dispose()
    work = database.parent
    controller_config = _config(
        work / "controller.json",
        {
            "database": str(database),
            "kubeconfig": str(plane.kubeconfig),
            "clusters": list(CLUSTERS),
            "profile": str(profile) if profile else None,
        },
    )
    observers = str(Path(__file__).resolve().parent / "k8s_observers.py")
    controller = Child(
        "controller",
        [sys.executable, observers, "controller", str(controller_config)],
        work,
        sightings.controller,
    )
    children.append(controller)
    sides = {GPUFLEET: controller}
    watched = [{k: c[k] for k in ("name", "server", "ca", "token")} for c in clusters]
    for side, client in (
        (WATCHER, "httpx"),
        (AIOHTTP_WATCHER, "aiohttp"),
        (THREADED_WATCHER, "thread"),
    ):
        if (client == "aiohttp" and not args.aiohttp_watcher) or (
            client == "thread" and not args.threaded_watcher
        ):
            continue
        config = _config(work / f"{client}.json", {"client": client, "clusters": watched})
        sides[side] = Child(
            f"watcher-{client}",
            [sys.executable, observers, "watcher", str(config)],
            work,
            sightings.watcher(side),
        )
        children.append(sides[side])
    return sides


def wait_listed(n: int, sides: Mapping[str, Child], sightings: Sightings) -> None:
    """Until the controller has written its first listing of every cluster's ``n`` nodes
    and every watcher has listed them."""
    began = time.monotonic()
    controller = sides[GPUFLEET]
    for name in CLUSTERS:

        def listed_all(name: str = name) -> bool:
            return sum(1 for k in sightings.times[GPUFLEET] if k[0] == name) >= n

        controller.wait_for(
            listed_all,
            f"the controller's first listing of {name}",
            120.0 + n / 5,
        )
    for side, child in sides.items():
        if side != GPUFLEET:
            child.wait_for(
                partial(lambda c: len(c.of_kind("ready")) == len(CLUSTERS), child),
                f"the {side}'s lists",
                60.0,
            )
    listed = time.monotonic() - began
    first = ", ".join(
        f"{t['cluster']} {t['took']:.1f} s" for t in sightings.transactions if t["states"] >= n
    )
    print(
        f"controller and watchers listed every node in {listed:.1f} s (the controller's "
        f"first complete listing written in {first})"
    )


def measure(
    args: argparse.Namespace,
    plane: ControlPlane,
    driver: Child,
    sides: Mapping[str, Child],
    sightings: Sightings,
    rng: random.Random,
    database: Path,
) -> None:
    """The CPU window of churn alone, then the changes under churn, then the report."""
    pids = {
        **{_cpu_label(side): [c.pid] for side, c in sides.items()},
        "churn driver": [driver.pid],
        **{
            role: [_pid(plane[c].processes[key]) for c in CLUSTERS]
            for role, key in (
                ("kube-apiserver ×2", "apiserver"),
                ("etcd ×2", "etcd"),
                ("kube-controller-manager ×2", "controller-manager"),
                ("kube-scheduler ×2", "scheduler"),
            )
        },
    }
    quiet, window = CpuWindow(pids), CpuWindow(pids)
    churn_before = len(driver.of_kind("churn"))
    window_began_at = datetime.now(UTC)
    transactions_before = len(sightings.transactions)
    if args.profile:
        sides[GPUFLEET].signal(signal.SIGUSR1)
    quiet.start()
    print(f"{args.cpu_window:g} s of churn alone, then {args.changes} changes", flush=True)
    time.sleep(args.cpu_window)
    quiet.stop()
    window.start()
    changes = make_changes(plane, args.changes, args.nodes_per_cluster, sightings, sides, rng)
    window.stop()
    window_transactions = sightings.transactions[transactions_before:]
    churn_stats = driver.of_kind("churn")[max(0, churn_before - 1) :]
    for child in sides.values():
        child.stop()
    report(args, changes, (quiet, window), churn_stats, window_transactions, sides[WATCHER])
    report_store(database, window_began_at)


def print_profile(profile: Path) -> None:
    print(
        "\ncontroller profile over the window (cProfile; its CPU figure includes the "
        "profiler's overhead):"
    )
    stats = pstats.Stats(str(profile))
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


def _pid(process: ManagedProcess) -> int:
    assert process.process is not None, f"{process.name} was never started"
    return process.process.pid


def _cpu_label(side: str) -> str:
    return f"{side} controller" if side == GPUFLEET else side


def _config(path: Path, data: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    path.chmod(0o600)  # tokens
    return path


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"


def _q(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(
    args: argparse.Namespace,
    changes: Sequence[Change],
    windows: tuple[CpuWindow, CpuWindow],
    churn: Sequence[Mapping[str, Any]],
    transactions: Sequence[Mapping[str, Any]],
    watcher: Child,
) -> None:
    n = args.nodes_per_cluster
    quiet, window = windows
    writes = 2 * len(CLUSTERS) * n / args.period
    kinds = Counter(c.kind for c in changes)
    print()
    print(
        f"{len(CLUSTERS)} clusters × {n} nodes, status and Lease of each every "
        f"{args.period:g} s ({writes:,.0f} renewals/s); {len(changes)} changes "
        f"({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}) over {window.wall:.0f} s"
    )
    sides = list(changes[0].seen) if changes else []
    if not report_latency(changes, sides):
        return
    print()
    report_cpu(quiet, window, sides)
    print()
    report_churn(churn, writes, watcher, changes, transactions)


def report_latency(changes: Sequence[Change], sides: Sequence[str]) -> bool:
    """From each change to each side's sighting: p50, p99, max, the ratios and the
    target's verdict. False when no change was seen by every side."""
    missed = {side: sum(1 for c in changes if c.seen[side] is None) for side in sides}
    seen = [c for c in changes if all(t is not None for t in c.seen.values())]
    if not seen:
        print("no change was seen by every side")
        return False
    after = {side: [c.seen[side] - c.sent for c in seen] for side in sides}  # type: ignore[operator]
    added = [c.seen[GPUFLEET] - c.seen[WATCHER] for c in seen]  # type: ignore[operator]
    print()
    print(f"{'change → seen':<40} {'p50':>10} {'p99':>10} {'max':>10}")
    rows = [
        ("gpufleet (store committed)", after[GPUFLEET]),
        *((f"{side} (event parsed)", after[side]) for side in sides if side != GPUFLEET),
        ("gpufleet − bare watcher, per change", added),
        ("(admin's PATCH answered)", [c.answered - c.sent for c in seen]),
    ]
    for label, values in rows:
        print(
            f"{label:<40} {_ms(_q(values, 0.5)):>10} {_ms(_q(values, 0.99)):>10} "
            f"{_ms(max(values)):>10}"
        )
    ours = after[GPUFLEET]
    for side in sides:
        if side != GPUFLEET:
            base = after[side]
            print(
                f"{'ratio gpufleet / ' + side:<40} {_q(ours, 0.5) / _q(base, 0.5):>10.2f} "
                f"{_q(ours, 0.99) / _q(base, 0.99):>10.2f} {max(ours) / max(base):>10.2f}"
            )
    verdict = "met" if _q(ours, 0.99) <= TARGET_P99_S and not missed[GPUFLEET] else "NOT met"
    print(
        f"target p99 ≤ {TARGET_P99_S:g} s: {verdict}; not seen within {SEEN_DEADLINE_S:g} s: "
        + ", ".join(f"{side} {count}" for side, count in missed.items())
    )
    return True


def report_cpu(quiet: CpuWindow, window: CpuWindow, sides: Sequence[str]) -> None:
    """Each process's CPU in both windows, the machine's, and the target's verdict."""
    print(
        f"{'CPU, % of one core':<40} {'churn alone':>12} {'+ changes':>12}\n"
        f"{'':<40} {f'({quiet.wall:.0f} s)':>12} {f'({window.wall:.0f} s)':>12}"
    )
    for key in window.used:
        print(f"{key:<40} {quiet.percent(key):>10.2f} % {window.percent(key):>10.2f} %")
    print(
        f"{'everything else on the machine':<40} {quiet.others():>10.2f} % "
        f"{window.others():>10.2f} %"
    )
    print(
        f"{'machine busy (% of all its cores)':<40} {quiet.busy():>10.0f} % "
        f"{window.busy():>10.0f} %"
    )
    for label, w in (("churn alone", quiet), ("with changes", window)):
        cpu = w.percent(_cpu_label(GPUFLEET))
        ratios = "; ".join(
            f"/ {side} {cpu / w.percent(side) if w.percent(side) else float('inf'):.2f}"
            for side in sides
            if side != GPUFLEET
        )
        verdict = "met" if cpu < TARGET_CPU else "NOT met"
        print(f"{label}: controller CPU {ratios}; target < {TARGET_CPU:g} % of a core: {verdict}")
    print(f"{os.cpu_count()} cores; hypervisor steal {window.steal():.1f} % of the time")


def report_churn(
    churn: Sequence[Mapping[str, Any]],
    writes: float,
    watcher: Child,
    changes: Sequence[Change],
    transactions: Sequence[Mapping[str, Any]],
) -> None:
    """The churn achieved in the window (against ``writes`` planned renewals a second),
    the watch events it made, and what the store wrote."""
    if len(churn) >= 2:
        elapsed = churn[-1]["t"] - churn[0]["t"]
        status = sum(c["status"] for c in churn[1:])
        leases = sum(c["lease"] for c in churn[1:])
        print(
            f"churn in the window: {status / elapsed:,.1f} status + {leases / elapsed:,.1f} "
            f"Lease renewals/s (planned {writes / 2:,.1f} + {writes / 2:,.1f}); a node's "
            f"renewals p99 {max(c['gap_p99'] for c in churn):.1f} s apart, at most "
            f"{max(c['gap_max'] for c in churn):.1f} s (grace {NODE_MONITOR_GRACE_S} s); "
            f"behind the plan by {churn[0]['lag_max']:.2f} s, then {churn[-1]['lag_max']:.2f} s; "
            f"request p50 {_ms(statistics.median(c['latency_p50'] for c in churn))}, p99 up to "
            f"{_ms(max(c['latency_p99'] for c in churn))}; errors {sum(c['errors'] for c in churn)}"
        )
    lines = watcher.of_kind("seen")
    if len(lines) >= 2:
        first = next(s for s in lines if s["t"] >= changes[0].sent)
        rate = (lines[-1]["events"] - first["events"]) / (lines[-1]["t"] - first["t"])
        print(f"Node watch events per second (both clusters, as the watcher got them): {rate:,.1f}")
    if transactions:
        took = [t["took"] for t in transactions]
        print(
            f"store: {len(transactions)} sync transactions in the window for {len(changes)} "
            f"changes ({sum(len(t['changed']) for t in transactions)} node records changed, "
            f"{sum(t['states'] for t in transactions)} node states written); a sync took p50 "
            f"{_ms(statistics.median(took))}, max {_ms(max(took))}"
        )


def report_store(database: Path, since: datetime) -> None:
    engine = db.make_engine(f"sqlite:///{database}")
    try:
        with engine.connect() as c:
            rows = c.execute(
                select(Event.kind, func.count()).where(Event.at >= since).group_by(Event.kind)
            ).all()
    finally:
        engine.dispose()
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(rows)) or "none"
    print(f"events recorded in the window: {kinds}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes-per-cluster", type=int, default=500)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--period", type=float, default=10.0, help="renewal period, seconds")
    parser.add_argument(
        "--connections", type=int, default=32, help="the churn driver's connections per cluster"
    )
    parser.add_argument(
        "--cpu-window", type=float, default=20.0, help="seconds of churn alone measured first"
    )
    parser.add_argument(
        "--aiohttp-watcher",
        action="store_true",
        help="a second baseline: the bare watcher over aiohttp (gpufleet's transport)",
    )
    parser.add_argument(
        "--threaded-watcher",
        action="store_true",
        help="another baseline: the bare watcher reading in a thread (http.client, no event loop)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the controller over the window"
    )
    args = parser.parse_args(argv)

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Ctrl-C and SIGTERM unwind through run()'s clean-up (also where the shell that
    # started the bench in the background left SIGINT ignored).
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        run(args)
    except (TierStartError, RuntimeError) as e:
        raise SystemExit(f"k8s_inventory: {e}") from None
    except KeyboardInterrupt as e:
        raise SystemExit(f"k8s_inventory: interrupted ({e}); every process stopped") from None


if __name__ == "__main__":
    main()
