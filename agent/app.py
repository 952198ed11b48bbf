"""The node agent: the controller's eyes and hands on a GPU node.

It reports the node's inventory, a heartbeat, GPU samples, XIDs and which GPUs each
workload's processes were given (``placements``), and runs the job pods the controller
places on its nodes (``jobs.PodKeeper``). On a machine without GPUs
the inventory is the one declared in the config (``c.NodeAgent.declared_nodes``), with
stable made-up UUIDs, so the whole flow runs on a laptop and in CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Enum, Float, Integer, List, Unicode, default
from traitlets.config import Application

from ..api import __version__, schemas
from ..recovery.nvml import GpuSample, NvmlError, gpu_type_of
from ..recovery.processes import marked_process_details
from ..snapshotter.node_operations import run_operation
from ..snapshotter.sandbox import (
    DEFAULT_SESSION_PREFIX,
    SandboxMode,
    default_session_env,
    probe,
)
from ..snapshotter.settings import RenamedSnapshotOptions, StoreAccess
from .checkpoints import CredentialsFileError, load_checkpoint_credentials
from .exporter import GpuState, start_exporter
from .gpus import (
    NodePlace,
    declared_inventory,
    declared_places,
    machine_memory_bytes,
    nodes_body,
    start_fake_nvml,
    try_real_nvml,
)
from .job_launch import RankSandbox
from .jobs import PodKeeper
from .kube_pods import KubePods
from .layers import find_container_layer
from .lifecycle import until_stopped
from .maintenance import KINDS as MAINTENANCE_KINDS
from .maintenance import MaintenanceOptions, MaintenanceSettings, run_maintenance
from .metrics import Assignment
from .network_guard import GuardUnavailable, NetworkGuard, table_name
from .peers import Caller
from .placements import (
    VISIBLE_DEVICES,
    Conflict,
    changed_placements,
    placements_body,
    read_placements,
    served_uuids,
)
from .progress import RankReport, bind_progress, progress_app
from .stacks import StackTaker
from .xid_watch import XidWatch

# While operations run, their progress goes to the controller this often; with none,
# the agent long-polls this long for the next.
PROGRESS_EVERY_S = 0.5
OPERATION_POLL_S = 20.0


def _sample_body(sample: GpuSample) -> dict[str, Any]:
    """What the controller takes of a sample (the exporter's telemetry stays here)."""
    taken = schemas.GpuSampleIn.model_fields
    body = {k: v for k, v in asdict(sample).items() if v is not None and k in taken}
    body["processes"] = [list(p) for p in sample.processes]
    return body


class NodeAgent(Application, RenamedSnapshotOptions, MaintenanceOptions):
    name = "gpufleet-agent"
    version = __version__
    description = "The gpufleet node agent (one per GPU node)."

    config_file = Unicode(
        help="The JupyterHub configuration file that also configures gpufleet. "
        "Defaults to $GPUFLEET_CONFIG, else ./jupyterhub_config.py.",
    ).tag(config=True)

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get("GPUFLEET_CONFIG", "jupyterhub_config.py")

    aliases = {"config": "NodeAgent.config_file", "log-level": "Application.log_level"}

    controller_api_url = Unicode(
        help="The controller's API; set by gpufleet.hub.setup.configure as "
        "$GPUFLEET_CONTROLLER_API_URL.",
    ).tag(config=True)

    @default("controller_api_url")
    def _default_controller_api_url(self) -> str:
        return os.environ.get("GPUFLEET_CONTROLLER_API_URL", "")

    api_token = Unicode(
        help="The agent's token; JupyterHub gives a managed service $JUPYTERHUB_API_TOKEN."
    ).tag(config=True)

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    declared_nodes = List(
        Dict(),
        help="""Nodes this agent reports when it has no NVML GPUs: [{"name": "node-a",
        "cluster": "local", "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4,
        "labels": {...}, "mig": ["3g.40gb", "3g.40gb"] (optional: each GPU split into these
        MIG slices, each a GPU type of its own, "A100-80GB:3g.40gb")}]. UUIDs are made up
        and stable.""",
    ).tag(config=True)

    heartbeat_interval = Float(
        5.0, help="Seconds between heartbeats; keep it well under node_heartbeat_timeout."
    ).tag(config=True)

    sample_interval = Float(5.0, help="Seconds between GPU samples sent to the controller.").tag(
        config=True
    )

    placement_interval = Float(
        5.0,
        help="Seconds between readings of which GPUs the marked processes of this machine "
        "were given (NVIDIA_VISIBLE_DEVICES in their environment, as NVIDIA's device "
        "plugin and container runtime set it); the controller then records each workload "
        "on those GPUs. Only changes are sent. 0 turns the read-back off: the controller "
        "keeps the GPUs it admitted each workload on.",
    ).tag(config=True)

    nvml = Enum(
        ["auto", "real", "fake", "off"],
        "auto",
        help="Where GPUs come from. 'real': this machine's NVML. 'fake': the declared nodes, "
        "served by gpufleet's fake NVML library (machines without GPUs; live numbers for the "
        "demo and tests). 'off': the declared nodes as they are, no samples. 'auto': real "
        "NVML when it finds GPUs, else fake when nodes are declared.",
    ).tag(config=True)

    data_dir = Unicode(
        help="Where the agent keeps its files (the fake NVML library and its control file). "
        "Defaults to $GPUFLEET_DATA_DIR/agent.",
    ).tag(config=True)

    @default("data_dir")
    def _default_data_dir(self) -> str:
        return os.path.join(os.environ.get("GPUFLEET_DATA_DIR", ".gpufleet"), "agent")

    metrics_port = Integer(
        help="Port of the Prometheus exporter (dcgm-exporter's metric names); 0 turns it "
        "off. Defaults to $GPUFLEET_BASE_PORT + 4.",
    ).tag(config=True)

    @default("metrics_port")
    def _default_metrics_port(self) -> int:
        return int(os.environ.get("GPUFLEET_BASE_PORT", "8000")) + 4

    metrics_ip = Unicode("127.0.0.1", help="Address of the Prometheus exporter.").tag(config=True)

    zone = Unicode(
        "",
        help="This node's zone when it reports real GPUs. Empty: the zone its cluster gives "
        "it (a Kubernetes node's zone label, as the controller's inventory read it), or "
        "'default' for a node no cluster placed.",
    ).tag(config=True)
    cluster = Unicode("local", help="This node's cluster when it reports real GPUs.").tag(
        config=True
    )
    gpu_type_names = Dict(
        help="NVML model name → the fleet's GPU type, e.g. {'NVIDIA A100-SXM4-80GB': "
        "'A100-80GB'}. Unlisted models get a derived name ('A100-80GB').",
    ).tag(config=True)

    node_name = Unicode(help="This node's name when it reports real GPUs.").tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return socket.gethostname()

    job_poll_seconds = Float(
        10.0,
        help="Longest wait for news of job pods while none runs here; the controller "
        "answers at once when one is placed, cancelled or preempted. While pods run, "
        "their logs are sent every second.",
    ).tag(config=True)

    session_base_env = Unicode(
        help="The sessions' base environment, which job ranks run from (read-only, as in "
        "sessions). Default: $GPUFLEET_SESSION_ENV, else the checkout's own (scripts/"
        "build-session-env --print-target), else /opt/gpufleet/session-env.",
    ).tag(config=True)

    @default("session_base_env")
    def _default_session_base_env(self) -> str:
        return default_session_env()

    session_prefix = Unicode(
        DEFAULT_SESSION_PREFIX,
        help="Where, inside a rank's sandbox, the job's environment lives: its session's, "
        "pinned at submit, or one made over the base environment (the spawner's "
        "session_prefix).",
    ).tag(config=True)

    home_dir_template = Unicode(
        help="Users' homes on this node, with {username}: the spawner's home_dir_template "
        "in sandbox mode (set by gpufleet.hub.setup.configure). Job ranks get theirs.",
    ).tag(config=True)

    @default("home_dir_template")
    def _default_home_dir_template(self) -> str:
        data = os.environ.get("GPUFLEET_DATA_DIR", ".gpufleet")
        return os.path.join(os.path.abspath(data), "homes", "{username}")

    # Where snapshots go: c.SnapshotSettings (snapshotter/settings.py), as the controller
    # reads it; the earlier c.NodeAgent.snapshot_* and c.FleetController.snapshot_* names
    # are still read (snapshot_access).

    node_operations = Bool(
        True,
        help="Run the snapshot passes and restores the controller asks of this agent's nodes "
        "(Kubernetes sessions' volumes and container layers).",
    ).tag(config=True)

    progress_port = Integer(
        0,
        help="Loopback port where job ranks report their progress (gpufleet.progress), told "
        "to them in $GPUFLEET_PROGRESS_URL; -1: off. 0: the port of the agent before this "
        "one (the ranks it left running report there), else a privileged port (700-999, "
        "which no researcher's process can take while the agent restarts) when the agent "
        "runs as root, else any free port.",
    ).tag(config=True)

    progress_ip = Unicode(
        "127.0.0.1", help="Address of the ranks' progress endpoint (this machine's)."
    ).tag(config=True)

    container_layer_roots = List(
        Unicode(),
        [
            "/var/lib/containerd",
            "/var/lib/containers/storage",
            "/var/lib/docker",
        ],
        help="Where the container runtime keeps containers' layers, as this agent sees the "
        "host: a layer the agent snapshots must be under one of them (and prove to be what "
        "the container sees). containerd's, CRI-O's and Docker's by default.",
    ).tag(config=True)

    operation_nodes = List(
        Unicode(),
        help="The nodes whose snapshot passes and restores this agent runs, and whose "
        "Kubernetes job pods it relays output and progress for. Default: the nodes it "
        "reports, else node_name (a DaemonSet's pod: set node_name from the downward API's "
        "spec.nodeName).",
    ).tag(config=True)

    pod_log_dirs = List(
        Unicode(),
        default_value=["/var/log/pods"],
        help="Where the kubelet keeps containers' output (CRI log files under "
        "<namespace>_<pod>_<uid>/<container>/): the agent reads its Kubernetes job pods' "
        "output there (mount the host's /var/log/pods into a DaemonSet's agent).",
    ).tag(config=True)

    py_spy = Unicode(
        help="The py-spy executable that takes a job's ranks' Python stacks for a trace (on "
        "a hang, or asked for with gpufleet trace); it needs ptrace (root, or "
        "CAP_SYS_PTRACE in the host's PID namespace). Default: the one installed beside "
        "the agent's Python.",
    ).tag(config=True)

    @default("py_spy")
    def _default_py_spy(self) -> str:
        beside = Path(sys.executable).parent / "py-spy"
        return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")

    protected_ports = List(
        Integer(),
        help="Loopback ports only the platform's account may connect to (docs/containment.md): "
        "services that do not authenticate each call, such as an S3 server's master, volume "
        "and filer ports. The agent's metrics port is always among them, and each running "
        "job's rendezvous port is open only to the platform and the job's user.",
    ).tag(config=True)

    network_guard = Bool(
        True,
        help="Keep the loopback guard (an nftables table of the agent's own; needs nftables "
        "and root). Off: every local port is reachable from every session and rank.",
    ).tag(config=True)

    def maintenance_settings(self) -> MaintenanceSettings:
        node = self.node_name or ",".join(n["name"] for n in self.inventory)
        return self.maintenance_for(node, self.fake_nvml_control)

    def loopback_guard(self, rendezvous: dict[int, int] | None = None) -> NetworkGuard | None:
        """The loopback guard, installed (blocking) with the ``rendezvous`` ports of the
        jobs already running here (port -> uid); None when it is off or cannot be had (the
        log says why: then job ranks do not start)."""
        if not self.network_guard:
            self.log.warning("the loopback guard is off: sessions and ranks reach every port")
            return None
        ports = [*self.protected_ports, *([self.metrics_port] if self.metrics_port else [])]
        guard = NetworkGuard(table_name(os.path.abspath(self.data_dir)), os.geteuid(), ports)
        guard.rendezvous.update(rendezvous or {})
        try:
            guard.install()
        except GuardUnavailable as e:
            self.log.error("job ranks cannot start here: %s", e)
            raise
        return guard

    checkpoint_root = Unicode(
        help="Where users' local checkpoints may go besides their homes: <root>/<user>, "
        "made by the agent and owned by the user, shown read-write to their ranks. It must "
        "hold the controller's job_checkpoint_store. Default: $GPUFLEET_DATA_DIR/checkpoints.",
    ).tag(config=True)

    @default("checkpoint_root")
    def _default_checkpoint_root(self) -> str:
        data = os.environ.get("GPUFLEET_DATA_DIR", ".gpufleet")
        return os.path.join(os.path.abspath(data), "checkpoints")

    checkpoint_credentials_file = Unicode(
        help="A JSON file, readable by the agent's account alone, giving each user the S3 "
        'credentials of their own checkpoint prefix: {"alice": {"access_key": ..., '
        '"secret_key": ...}}. A rank of a job whose checkpoint location is s3://... gets '
        "its user's (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and no one else's; the admin "
        'makes each reach only that user\'s prefix (docs/jobs.md, "Checkpoints in S3"). '
        "Empty: such jobs do not start, saying why.",
    ).tag(config=True)

    checkpoint_s3_endpoint = Unicode(
        help="The S3 endpoint job ranks reach their checkpoints at (AWS_ENDPOINT_URL); empty "
        "for AWS itself."
    ).tag(config=True)

    checkpoint_s3_region = Unicode(
        "us-east-1", help="The S3 region of job checkpoints (AWS_DEFAULT_REGION)."
    ).tag(config=True)

    def rank_sandbox(self) -> RankSandbox:
        """How this node contains job ranks; the machine probed once (blocking)."""
        jobs = Path(self.data_dir) / "jobs"
        jobs.mkdir(mode=0o700, parents=True, exist_ok=True)
        support = probe(jobs)
        if support.mode is SandboxMode.NONE:
            self.log.error("job ranks cannot run here: %s", support.reason)
        fake = Path(self.data_dir) / "fake-nvml"
        credentials: dict[str, dict[str, str]] = {}
        if self.checkpoint_credentials_file:
            try:
                credentials = load_checkpoint_credentials(Path(self.checkpoint_credentials_file))
            except CredentialsFileError as e:
                self.log.error("jobs checkpointing to S3 cannot start here: %s", e)
        return RankSandbox(
            checkpoint_root=Path(self.checkpoint_root).absolute(),
            s3_credentials=credentials,
            s3_endpoint=self.checkpoint_s3_endpoint,
            s3_region=self.checkpoint_s3_region,
            support=support,
            base_env=Path(self.session_base_env),
            prefix=Path(self.session_prefix),
            home_dir_template=self.home_dir_template,
            read_only=(fake,) if fake.is_dir() else (),
        )

    def initialize(self, argv: list[str] | None = None) -> None:
        self.parse_command_line(argv)
        path = os.path.abspath(self.config_file)
        if not os.path.exists(path):
            print(f"{self.name}: configuration file {path} does not exist", file=sys.stderr)
            self.exit(1)
        self.load_config_file(path)
        self.parse_command_line(argv)
        if not self.controller_api_url:
            print(
                f"{self.name}: no controller URL; set c.NodeAgent.controller_api_url",
                file=sys.stderr,
            )
            self.exit(1)
        self.gpus: GpuState | None = None
        self.fake_nvml_control: Path | None = None  # maintenance answers through it
        self.inventory = declared_inventory(self.declared_nodes)

    # ------------------------------------------------------------ GPUs
    def open_gpus(self) -> GpuState | None:
        """NVML (real or fake) as configured; None for a declared-only inventory."""
        nvml = None
        if self.nvml in ("auto", "real"):
            nvml = try_real_nvml()
            if nvml is None and self.nvml == "real":
                print(f"{self.name}: nvml = 'real' but NVML finds no GPU", file=sys.stderr)
                self.exit(1)
            if nvml is not None:
                inventory = nvml.inventory()
                places = {
                    (g.parent_uuid or g.uuid): NodePlace(
                        self.node_name,
                        self.cluster,
                        self.zone,
                        gpu_type_of(g.name, g.memory_total_bytes, self.gpu_type_names),
                        {},
                    )
                    for g in inventory
                }
                return GpuState(nvml, inventory, places, nvml.driver_version())
        if self.nvml in ("auto", "fake") and self.declared_nodes:
            nvml = start_fake_nvml(self.declared_nodes, Path(self.data_dir) / "fake-nvml")
            self.fake_nvml_control = Path(self.data_dir) / "fake-nvml" / "control"
            places = declared_places(self.declared_nodes)
            inventory = nvml.inventory()
            return GpuState(nvml, inventory, places, nvml.driver_version())
        return None

    # ------------------------------------------------------------ loops
    async def _post(self, client: httpx.AsyncClient, path: str, body: Any) -> dict[str, Any]:
        response = await client.post(f"{self.controller_api_url}{path}", json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    async def run(self) -> None:
        self.gpus = self.open_gpus()
        if self.gpus is not None:
            self.inventory = nodes_body(
                self.gpus.inventory,
                self.gpus.places,
                float(os.cpu_count() or 1),
                machine_memory_bytes(),
            )
            self.log.info(
                "%d GPU(s) through NVML on %d node(s)",
                len(self.gpus.inventory),
                len(self.inventory),
            )
            if self.metrics_port:
                start_exporter(self.gpus, self.node_name, self.metrics_ip, self.metrics_port)
        # Set while the controller knows this agent's nodes; ``registrations`` counts the
        # times it was told them. A controller that forgot them (a new database) forgot
        # what the read-back reported too: the next report after it is complete.
        self.registered = asyncio.Event()
        self.registrations = 0
        headers = {"Authorization": f"token {self.api_token}"}
        async with httpx.AsyncClient(headers=headers, timeout=10) as client:
            loops = [self._heartbeats(client), self._job_pods(client)]
            if self.placement_interval > 0:
                loops.append(self._placements(client))
            if self.node_operations:
                loops.append(self._node_operations(client))
            if self.gpus is not None:
                loops += [self._samples(client, self.gpus), self._xids(client, self.gpus)]
            await asyncio.gather(*loops)

    async def _heartbeats(self, client: httpx.AsyncClient) -> None:
        registered = False
        while True:
            try:
                if not registered:
                    await self._post(client, "/agent/register", {"nodes": self.inventory})
                    registered = True
                    self.registrations += 1
                    self.registered.set()
                    self.log.info("registered %d node(s) with the controller", len(self.inventory))
                else:
                    answer = await self._post(
                        client,
                        "/agent/heartbeat",
                        {"nodes": [n["name"] for n in self.inventory]},
                    )
                    registered = not answer["unknown"]
                    if not registered:
                        self.registered.clear()
                    if self.gpus is not None:
                        self.gpus.assignments = {
                            uuid: Assignment.from_heartbeat(a)
                            for uuid, a in answer.get("assignments", {}).items()
                        }
            except httpx.HTTPError as e:
                self.log.warning("controller unreachable (%s); retrying", e)
                await asyncio.sleep(min(self.heartbeat_interval, 1.0))
                continue
            await asyncio.sleep(self.heartbeat_interval if registered else 0.2)

    async def _placements(self, client: httpx.AsyncClient) -> None:
        """Report which served GPUs each marker's container was given (agent/placements.py):
        everything at the start, after a failed report and after each registration (a
        controller that forgot this agent); otherwise only what changed. Never before the
        controller knows this agent's GPUs: it would take them for GPUs it does not know."""
        served = served_uuids(self.inventory)
        reported: dict[str, tuple[str, ...]] | None = None
        logged: set[Conflict] = set()
        reported_since = 0  # the registration ``reported`` was sent after
        while True:
            await self.registered.wait()
            if reported_since != self.registrations:
                reported_since, reported = self.registrations, None
            processes = await asyncio.to_thread(marked_process_details, (VISIBLE_DEVICES,))
            readback = read_placements(processes, served)
            for conflict in set(readback.conflicts) - logged:
                self.log.warning(
                    "processes of marker %s disagree on their GPUs: pid %d has %s=%r, pid %d "
                    "(the first, which counts) %r",
                    conflict.marker,
                    conflict.other_pid,
                    VISIBLE_DEVICES,
                    conflict.other,
                    conflict.kept_pid,
                    conflict.kept,
                )
            logged = set(readback.conflicts)  # said once while it lasts
            changes = changed_placements(readback.placements, reported)
            if changes:
                try:
                    answer = await self._post(client, "/agent/placements", placements_body(changes))
                except httpx.HTTPError as e:
                    self.log.warning("could not report which GPUs workloads have (%s)", e)
                    reported = None  # what arrived is unknown: all of it again next time
                    await asyncio.sleep(self.placement_interval)
                    continue
                if answer.get("reseated"):
                    self.log.info(
                        "the controller moved workload(s) %s onto the GPUs their processes have",
                        answer["reseated"],
                    )
            reported = readback.placements
            await asyncio.sleep(self.placement_interval)

    def snapshot_access(self) -> StoreAccess:
        """Where this agent's snapshot passes and restores go: c.SnapshotSettings, under
        the deployment's data directory ($GPUFLEET_DATA_DIR), with stat caches in the
        agent's own. The controller's earlier option names count here too, as they did
        when the agent's defaults were the controller's settings."""
        data = os.path.abspath(os.environ.get("GPUFLEET_DATA_DIR", ".gpufleet"))
        settings = self.snapshot_settings(also_from=("FleetController",))
        return settings.access(data, cache_dir=os.path.join(self.data_dir, "statcache"))

    def _operated_nodes(self) -> list[str]:
        """The nodes whose operations and Kubernetes job pods this agent serves
        (``operation_nodes``, else its GPUs' nodes, else ``node_name``: a DaemonSet's agent
        on a node whose GPUs it does not report, ``nvml = "off"``)."""
        nodes = list(self.operation_nodes) or [n["name"] for n in self.inventory]
        return nodes or [self.node_name]

    async def _node_operations(self, client: httpx.AsyncClient) -> None:
        """Claim the snapshot passes, restores and maintenance asked of this agent's nodes
        and run them (snapshotter/node_operations.py, agent/maintenance.py), reporting progress at
        most every ``PROGRESS_EVERY_S`` while any runs; with none running, long-poll."""
        nodes = self._operated_nodes()
        settings = self.snapshot_access()
        reports: dict[int, dict[str, Any]] = {}
        running: dict[asyncio.Task[None], int] = {}
        wake = asyncio.Event()

        async def run(operation: dict[str, Any]) -> None:
            oid = operation["id"]

            def progress(line: dict[str, Any]) -> None:
                fields = ("phase", "done", "total")
                reports[oid] = {
                    "id": oid,
                    "state": "running",
                    "progress": {k: line[k] for k in fields if k in line},
                }

            try:
                if operation["kind"] in MAINTENANCE_KINDS:
                    result = await run_maintenance(
                        operation["kind"], operation["request"], self.maintenance_settings()
                    )
                else:
                    result = await run_operation(
                        operation["kind"],
                        operation["request"],
                        settings,
                        progress,
                        lambda marker: find_container_layer(marker, self.container_layer_roots),
                    )
                reports[oid] = {"id": oid, "state": "done", "result": result}
            except Exception as e:  # noqa: BLE001 (said to the asker, who decides)
                self.log.warning("node operation %s (%s) failed: %s", oid, operation["kind"], e)
                reports[oid] = {"id": oid, "state": "failed", "error": str(e)[:4000]}
            wake.set()

        while True:
            # A running operation is reported on every round (its progress, or that it
            # still runs): its asker gives up on one whose agent goes silent.
            sent = {oid: {"id": oid, "state": "running"} for oid in running.values()}
            sent.update(reports)
            wait = 0.0 if running or sent else OPERATION_POLL_S
            try:
                response = await client.post(
                    f"{self.controller_api_url}/agent/node-operations",
                    json={"nodes": nodes, "reports": list(sent.values()), "wait": wait},
                    timeout=wait + 30,
                )
                response.raise_for_status()
            except httpx.HTTPError as e:
                self.log.warning("could not sync node operations with the controller (%s)", e)
                await asyncio.sleep(1.0)
                continue
            for oid, report in sent.items():
                if reports.get(oid) is report:
                    del reports[oid]
            for operation in response.json()["operations"]:
                self.log.info(
                    "node operation %s: %s for workload %s",
                    operation["id"],
                    operation["kind"],
                    operation["workload_id"],
                )
                task = asyncio.create_task(run(operation))
                running[task] = operation["id"]
                task.add_done_callback(lambda done: running.pop(done, None))
            if running:
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), PROGRESS_EVERY_S)

    async def _job_pods(self, client: httpx.AsyncClient) -> None:
        """Report the job pods this agent runs, with their new log lines; run what the
        controller answers (agent/jobs.py). The pods an earlier agent left running are
        taken over first, so the loopback guard keeps their rendezvous ports closed."""
        sandbox = await asyncio.to_thread(self.rank_sandbox)
        sockets, progress_url = bind_progress(
            Path(self.data_dir), self.progress_ip, self.progress_port, self.log
        )
        keeper = PodKeeper(
            Path(self.data_dir) / "jobs", self.log, os.environ, sandbox, None, progress_url
        )
        taken = await asyncio.to_thread(keeper.recover)
        if taken:
            self.log.info("took over %d running job pod(s) from the agent before", len(taken))
        try:
            keeper.guard = await asyncio.to_thread(self.loopback_guard, keeper.rendezvous())
        except GuardUnavailable as e:
            keeper.sandbox = replace(sandbox, unavailable=str(e))
        watched = KubePods([Path(d) for d in self.pod_log_dirs], self.log)

        def pod_of(marker: str, caller: Caller | None) -> tuple[int, int]:
            key = watched.pod_of_caller(marker, caller)
            return key if key is not None else keeper.pod_of_caller(marker, caller)

        def own(key: tuple[int, int], report: RankReport) -> tuple[RankReport, list[str]]:
            kept = watched.own_checkpoints(key, report)
            return kept if kept is not None else keeper.own_checkpoints(key, report)

        server = None
        if sockets:
            server = HTTPServer(progress_app(pod_of, own, keeper.note_progress))
            server.add_sockets(sockets)
            self.log.info("ranks report progress to %s", progress_url)
        try:
            await self._sync_pods(client, keeper, watched, StackTaker(self.py_spy, self.log))
        finally:
            if server is not None:
                server.stop()
            # Ranks outlive this agent: while any runs, its guard stays for the next one.
            if keeper.guard is not None and not keeper.running():
                await asyncio.to_thread(keeper.guard.remove)

    async def _sync_pods(
        self, client: httpx.AsyncClient, keeper: PodKeeper, watched: KubePods, stacks: StackTaker
    ) -> None:
        # Its GPUs' nodes (local ranks), and those whose Kubernetes job pods it relays.
        nodes = list(dict.fromkeys([n["name"] for n in self.inventory] + self._operated_nodes()))
        while True:
            pods, chunks = keeper.report()
            relayed = await asyncio.to_thread(watched.chunks)
            known = keeper.known() + watched.known()
            progress = keeper.take_progress()
            gone = keeper.take_gone()
            taken = stacks.take()
            wait = 0.0 if keeper.busy() or gone else (1.0 if known else self.job_poll_seconds)
            body = {
                "nodes": nodes,
                "pods": pods,
                "logs": chunks + relayed,
                "known": known,
                "progress": progress,
                "gone": gone,
                "stacks": taken,
            }
            try:
                response = await client.post(
                    f"{self.controller_api_url}/agent/pods",
                    json={**body, "wait": wait},
                    timeout=wait + 30,
                )
                response.raise_for_status()
            except httpx.HTTPError as e:
                self.log.warning("could not sync job pods with the controller (%s)", e)
                keeper.restore_progress(progress)
                keeper.restore_gone(gone)
                stacks.restore(taken)
                await asyncio.sleep(1.0)
                continue
            keeper.synced(len(chunks), pods)
            watched.acknowledged(len(relayed))
            answer = response.json()
            listed = [*answer["pods"], *answer.get("watch", ())]
            # Stacks first: a pod to stop is read before its ranks get the signal.
            await stacks.answer(listed)
            stacks.forget_all_but(p["trace"] for p in listed if p.get("trace"))
            await asyncio.to_thread(watched.watch, answer.get("watch", ()))
            await keeper.apply(answer["pods"])
            keeper.end_leftovers(answer.get("leftovers", ()))
            if keeper.ending_leftovers() and not keeper.busy():
                await asyncio.sleep(0.5)  # the controller answers at once while any are left

    async def _samples(self, client: httpx.AsyncClient, gpus: GpuState) -> None:
        while True:
            try:
                samples = await asyncio.to_thread(gpus.sample)
            except NvmlError as e:
                self.log.error("%s; trying again", e)
                await asyncio.sleep(self.sample_interval)
                continue
            try:
                await self._post(
                    client, "/agent/samples", {"samples": [_sample_body(s) for s in samples]}
                )
            except httpx.HTTPError as e:
                self.log.warning("could not send GPU samples (%s)", e)
            await asyncio.sleep(self.sample_interval)

    async def _xids(self, client: httpx.AsyncClient, gpus: GpuState) -> None:
        """Forward every XID as NVML delivers it (agent/xid_watch.py)."""
        async for event in XidWatch(gpus.nvml, self.log).events():
            gpus.last_xid[event.uuid] = event.xid
            self.log.warning("XID %d on GPU %s", event.xid, event.uuid)
            for _ in range(10):
                try:
                    await self._post(client, "/agent/xid", {"uuid": event.uuid, "xid": event.xid})
                    break
                except httpx.HTTPError as e:
                    self.log.warning("could not report XID %d (%s); retrying", event.xid, e)
                    await asyncio.sleep(0.5)

    def start(self) -> None:
        asyncio.run(until_stopped(self.run(), self.log))


def main(argv: list[str] | None = None) -> None:
    app = NodeAgent.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()


if __name__ == "__main__":
    main()
