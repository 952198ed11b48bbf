"""The fleet controller: a JupyterHub managed service and the only writer of the database.

It serves the REST API (and later the pages), runs the admission loop, watches node
heartbeats, syncs project membership from hub groups and runs the reconciler. It reads
the same ``jupyterhub_config.py`` as the hub (``c.FleetController.*``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import pwd
import socket
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from sqlalchemy.exc import SQLAlchemyError
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Enum, Float, Integer, List, Unicode, default

from .. import __version__
from ..agent.lifecycle import until_stopped
from ..culler.errors import PolicyError
from ..culler.loop import IdleCuller
from ..scheduler.errors import InputError, LeaseLost, NotFound, SchedulerError, SchemaMismatch
from ..scheduler.model import project_tree
from ..scheduler.snapshot import Policy
from ..snapshotter.errors import SnapshotError
from ..snapshotter.settings import RenamedSnapshotOptions
from ..spawner.clusters import ClusterConfigError, check_loadable, parse_clusters
from ..state import db
from ..state.accounts import check_range
from ..state.clusters import KUBERNETES
from ..state.cycle import Stop
from ..state.fleet import FleetStore
from . import logs
from .admin import admin_routes
from .api.base import Identity
from .api.handlers import routes
from .appbase import DatabaseMixin, UpgradeDB
from .errors import ClusterUnavailable
from .job_pages import job_page_routes
from .kube_inventory import KubeInventory
from .metrics import ControllerMetrics
from .notifier import Notifier
from .pages import page_routes
from .reconciler import Reconciler
from .recovery_options import RecoveryOptions
from .scheduling import PLANNERS, AdmissionCycles
from .secrets import SecretFileError, check_secret_file
from .serving import CountingApplication, answer_in_flight
from .stopper import ServerStopper
from .timed import TimedOptions, TimedWork
from .uid_claims import DEFAULT_REGISTRY, Claim, ClaimError, HeldClaim, claim, deployment_identity
from .victims import VictimStopper

DEFAULT_PRIORITY_CLASSES = [
    {"name": "critical", "rank": 300, "description": "never preempted by lower classes"},
    {"name": "standard", "rank": 200, "description": "the default for sessions and jobs"},
    {
        "name": "opportunistic",
        "rank": 100,
        "preemptible": True,
        "description": "runs on idle capacity; first to make room",
    },
]


class FleetController(RecoveryOptions, TimedOptions, DatabaseMixin, RenamedSnapshotOptions):
    name = "gpufleet-controller"
    version = __version__
    description = "The gpufleet fleet controller (a JupyterHub service)."
    subcommands = {"upgrade-db": (UpgradeDB, UpgradeDB.description)}
    classes = [UpgradeDB]

    service_url = Unicode(
        help="Where the controller listens; set by JupyterHub as $JUPYTERHUB_SERVICE_URL.",
    ).tag(config=True)

    @default("service_url")
    def _default_service_url(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:8001")

    service_prefix = Unicode(
        help="URL prefix under the hub's proxy; set by JupyterHub as $JUPYTERHUB_SERVICE_PREFIX.",
    ).tag(config=True)

    @default("service_prefix")
    def _default_service_prefix(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpufleet/")

    projects = List(
        Dict(),
        help="""The project tree, declared in order (parents first). Each entry:
        {"name": "vision", "parent": "research" | None, "kind": "organisation|team|project",
         "hub_group": "vision" (default: the name), "quotas": {"A100-80GB": {"guaranteed": 8,
         "borrow_limit": None, "lend_limit": None}}, "per_user_gpu_cap": 4,
         "default_priority": "standard", "weight": 1.0}.
        Applied at every start: until the admin panel exists, this list is authoritative.""",
    ).tag(config=True)

    profiles = List(
        Dict(),
        help="""Spawn-page profiles: {"name", "display_name", "description", "environment",
        "gpu_types": [...] (empty: any), "projects": [...] (empty: any), "default": bool,
        "cpu_per_gpu", "memory_per_gpu_bytes"}.""",
    ).tag(config=True)

    priority_classes = List(
        Dict(),
        default_value=DEFAULT_PRIORITY_CLASSES,
        help="Priority classes {name, rank, preemptible, description}; higher rank first.",
    ).tag(config=True)

    request_lease_seconds = Float(
        30.0,
        help="A spawn request the spawner stops renewing for this long is withdrawn (its "
        "place freed), so a hub restart or an abandoned spawn leaves no ghost in the queue.",
    ).tag(config=True)

    min_run_time_seconds = Float(
        300.0,
        help="A workload that started less than this long ago is not preempted to make room "
        "(idle sessions aside): a researcher gets at least this much of what was admitted.",
    ).tag(config=True)

    max_preemption_searches = Integer(
        64,
        help="Waiting workloads that may look for victims in one scheduling cycle; the rest "
        "look in later cycles. Bounds a cycle's time when thousands could ask at once.",
    ).tag(config=True)

    preemption_retry_seconds = Float(
        30.0,
        help="A preempted session the hub has not stopped yet is asked again this often.",
    ).tag(config=True)

    admission_interval = Float(
        1.0, help="Seconds between admission cycles when nothing else triggers one."
    ).tag(config=True)

    planner = Enum(
        PLANNERS,
        "process",
        help="Where admission cycles are planned (hub/scheduling.py): 'process', a child "
        "process (the API answers as fast while a cycle is planned); 'thread', a worker "
        "thread (needs no second process, but shares Python's GIL with the API); 'loop', "
        "the event loop itself (the API waits for every cycle).",
    ).tag(config=True)

    full_collection_interval = Float(
        600.0,
        help="Seconds between full garbage collections of the controller's memory, run "
        "after an admission cycle. Cycles run with the collector paused and freeze what "
        "survives them (state/collector.py); this returns what became cyclic "
        "garbage after being frozen. At 16,000 GPUs one takes 80-90 ms.",
    ).tag(config=True)

    node_heartbeat_timeout = Float(
        30.0,
        help="A node whose agent has not reported for this many seconds is marked unknown and "
        "receives no new work.",
    ).tag(config=True)

    clusters = List(
        Dict(),
        help="""The Kubernetes clusters of the fleet (docs/kubernetes.md); empty: this machine
        only. Each: {"name", "kubeconfig" (a file) and "context", or "in_cluster": True,
        "namespace" ("gpufleet"), "gpu_resource" ("nvidia.com/gpu", or a MIG slice such as
        "nvidia.com/mig-3g.40gb"), "gpu_node_selector" ({label: value}), "pod_url"
        ("http://{ip}:{port}", or a template for an ingress per cluster)}. Their GPU nodes
        come from each cluster's Node objects (watched); the hub's KubeGPUSpawner reads the
        same list.""",
    ).tag(config=True)

    cluster_unreachable_after = Float(
        20.0,
        help="A cluster whose API server has not answered for this many seconds makes its "
        "nodes unknown (no new work) until it answers again; the other clusters go on.",
    ).tag(config=True)

    node_lost_grace_seconds = Float(
        60.0,
        help="A Kubernetes node that is not Ready, or deleted, for this many seconds ends "
        "the sessions on it, each with an event naming the node. Their GPUs stay held "
        "until the pod is gone (a pod on a node that does not answer may still run).",
    ).tag(config=True)

    cluster_probe_interval = Float(
        5.0, help="Seconds between checks that each cluster's API server answers."
    ).tag(config=True)

    membership_sync_interval = Float(
        15.0, help="Seconds between syncs of project membership from JupyterHub groups."
    ).tag(config=True)

    reconcile_interval = Float(
        30.0,
        help="Seconds between reconciler passes, which compare the database with what "
        "really runs (the hub's servers, this machine's session processes) and repair "
        "both ways (docs/reconciler.md).",
    ).tag(config=True)

    reconcile_grace = Float(
        60.0,
        help="A disagreement between the database and what runs is repaired only once the "
        "workload has been in its state (or ended) this many seconds, so spawns, stops and "
        "releases in progress finish first (docs/reconciler.md).",
    ).tag(config=True)

    db_lease_seconds = Float(
        15.0,
        help="The database lease: a second controller takes over this long after the active "
        "one stops renewing (rolling updates, crashes).",
    ).tag(config=True)

    # Where snapshots go: c.SnapshotSettings (snapshotter/settings.py), which the spawners
    # and the node agents read too; the earlier c.FleetController.snapshot_* names come
    # with RenamedSnapshotOptions.

    snapshot_index_interval = Float(
        3600.0,
        help="Seconds between rebuilds of the database's snapshot index from the store "
        "(the store is the truth; the index lets pages and the API list snapshots fast).",
    ).tag(config=True)

    job_checkpoint_store = Unicode(
        help="Where a job's checkpoints go unless its submission says otherwise: a local "
        "directory or an s3:// prefix, with {user}, {job} (its name) and {id} filled in; "
        "the ranks read it as $GPUFLEET_CHECKPOINT_URI. A job submitted again under the "
        "same name finds its checkpoints there. Defaults to "
        "<data_dir>/checkpoints/{user}/{job}.",
    ).tag(config=True)

    @default("job_checkpoint_store")
    def _default_job_checkpoint_store(self) -> str:
        return os.path.join(os.path.abspath(self.data_dir), "checkpoints", "{user}", "{job}")

    job_stop_grace_seconds = Float(
        30.0,
        help="Seconds a job's ranks get between SIGTERM (the checkpoint signal: save and "
        "exit) and SIGKILL when the job is cancelled or preempted.",
    ).tag(config=True)

    user_mode = Enum(
        ["sandbox", "system"],
        "sandbox",
        help="Whom researchers' sessions and job ranks run as (docs/containment.md). "
        "'sandbox': each hub user gets a uid of sandbox_uids, recorded on first use and "
        "kept; researchers need no account on the machine. 'system': each runs as the "
        "machine's account of the same name (it must exist; homes are made mode 0700). "
        "Either way they run in the session sandbox, never as root.",
    ).tag(config=True)

    sandbox_uids = List(
        Integer(),
        [200_000, 299_999],
        minlen=2,
        maxlen=2,
        help="The first and last uid given to hub users in 'sandbox' mode. No account of "
        "the machine may have a uid in it, nor the range of another deployment running on "
        "the machine (both checked at start).",
    ).tag(config=True)

    sandbox_uid_registry = Unicode(
        DEFAULT_REGISTRY,
        help="The directory where each controller of this machine in 'sandbox' mode claims "
        "its sandbox_uids for as long as it runs; a range that overlaps another running "
        "deployment's stops the start (docs/containment.md). Every deployment of the "
        "machine must name the same directory; the controller makes it (mode 0755) where it "
        "may, and must be able to write it. '' turns the check off, for a controller whose "
        "researchers' processes share no machine with another deployment's.",
    ).tag(config=True)

    snapshot_index_min_interval = Float(
        10.0,
        help="Fewest seconds between two reads of the snapshot store into the index; a "
        "session's end asks for one (so researchers see their last snapshot in seconds).",
    ).tag(config=True)

    idle_policies = Dict(
        help="Idle culling per project and profile: {'default': {...}, 'projects': {name: "
        "{...}}, 'profiles': {name: {...}}}, a profile's keys over its project's over the "
        "default. Keys: mode ('always': stop after the time-out; 'on-demand', the default: "
        "only mark idle sessions, which the scheduler reclaims first when someone waits), "
        "idle_timeout_s, warn_before_s, max_age_s, keep_alive_max_s, reclaim_by_anyone, "
        "stop_without_snapshot. See docs/culler.md.",
    ).tag(config=True)

    cull_interval = Float(
        30.0, help="Seconds between the culler's rounds over the running sessions."
    ).tag(config=True)

    cull_retry_seconds = Float(
        300.0,
        help="After a cull failed (its live snapshot, or the hub's stop), wait this long "
        "before trying that session again.",
    ).tag(config=True)

    gpu_busy_utilization = Float(
        5.0,
        help="A GPU sample at or over this utilisation (percent) shows the GPU working: its "
        "session is in use even with no browser or kernel activity.",
    ).tag(config=True)

    auto_create_schema = Bool(
        True,
        help="Create the schema when the database is empty. A database at another revision "
        "is never changed at start-up: run `gpufleet-controller upgrade-db`.",
    ).tag(config=True)

    log_style = Enum(
        ["json", "text"], "json", help="Log lines as JSON objects or as plain text."
    ).tag(config=True)

    def initialize(self, argv: list[str] | None = None) -> None:
        super().initialize(argv)
        if self.subapp is not None:
            return
        logs.configure(self.log, self.log_style, self.log_level)  # type: ignore[arg-type]
        try:
            project_tree(self.projects)
        except InputError as e:
            self.exit_with(f"c.FleetController.projects: {e}", code=2)
        try:
            self.cluster_settings = parse_clusters(self.clusters)
            asyncio.run(check_loadable(self.cluster_settings))
        except ClusterConfigError as e:
            self.exit_with(f"c.FleetController.clusters: {e}", code=2)
        self.kube: KubeInventory | None = None
        self.notifier = Notifier()
        self.engine = self.make_engine()
        try:
            if self.auto_create_schema and db.is_empty(self.engine):
                self.log.info("creating the gpufleet schema in an empty database")
                db.upgrade(self.engine)
            db.check_schema(self.engine)
        except SchemaMismatch as e:
            self.exit_with(str(e), code=3)
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.store = FleetStore(
            self.engine, holder, lease_ttl=timedelta(seconds=self.db_lease_seconds)
        )
        # The one way the controller stops a user's server: the culler, preemption (and
        # drains) and the reconciler all go through it.
        self.servers = ServerStopper(
            os.environ.get("JUPYTERHUB_API_URL", ""),
            os.environ.get("JUPYTERHUB_API_TOKEN", ""),
            self.store,
            self.log,
            self.now,
        )
        self.victims = VictimStopper(self.servers, self.log, self.preemption_retry_seconds)
        self.snapshot_access = self.snapshot_settings().access(self.data_dir)
        self._configure_accounts()
        try:
            policies = self.recovery_policies()
            self.store.retry_policy, self.store.recovery_policy, self.store.breaker_policy = (
                policies
            )
            self.store.plan_maintenance = self.recovery_maintenance
        except ValueError as e:
            self.exit_with(f"job restarts: {e}", code=2)
        self.metrics = ControllerMetrics(self.store)
        try:
            self.timed = TimedWork(self, self.engine, self.retention_trigger())
        except ValueError as e:
            self.exit_with(str(e), code=2)
        self.culler = IdleCuller(
            self.store,
            self.idle_policies,
            stopper=self.servers,
            hub_api_url=os.environ.get("JUPYTERHUB_API_URL", ""),
            hub_api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""),
            snapshot_settings=self.snapshot_access,
            registry=self.metrics.registry,
            log=self.log,
            now=self.now,
            interval=self.cull_interval,
            retry_after=self.cull_retry_seconds,
            notify=self.notifier.changed,
        )
        try:
            self.culler.check_policies([str(p["name"]) for p in self.projects])
        except PolicyError as e:
            self.exit_with(f"c.FleetController.idle_policies: {e}", code=2)
        self.is_leader = False
        self.leading_since: datetime | None = None
        # The recovery spares of the last admission cycle this controller ran.
        self.spare_nodes: frozenset[str] = frozenset()
        try:
            self.admission = AdmissionCycles(self, self.planner)
        except ValueError as e:
            self.exit_with(f"c.FleetController.planner: {e}", code=2)
        self._index_wanted = asyncio.Event()
        self.snapshot_index_at: datetime | None = None
        self._became_leader = asyncio.Event()
        self._memberships_synced_at = 0.0
        self._membership_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.hub_api_url = os.environ.get("JUPYTERHUB_API_URL", "")
        self.hub_api_token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        self.hub_auth: Any = None
        if self.hub_api_url and self.hub_api_token:
            from jupyterhub.services.auth import HubOAuth

            # The singleton: the pages' OAuth callback handler finds the same instance.
            self.hub_auth = HubOAuth.instance(api_token=self.hub_api_token, cache_max_age=60)

    def _configure_accounts(self) -> None:
        first, last = self.sandbox_uids
        self.uid_claim: HeldClaim | None = None
        if self.user_mode == "sandbox":
            problem = check_range(first, last, ((e.pw_name, e.pw_uid) for e in pwd.getpwall()))
            if problem:
                self.exit_with(f"c.FleetController.sandbox_uids: {problem}", code=2)
        self.store.user_mode = self.user_mode
        self.store.sandbox_uids = (first, last)
        key = Path(self.snapshot_access.key_file)
        if key.exists():
            try:
                check_secret_file(key, "the snapshot master key")
            except SecretFileError as e:
                self.exit_with(str(e), code=2)
        if self.user_mode == "sandbox" and self.sandbox_uid_registry:
            self._claim_sandbox_uids(first, last)

    def _claim_sandbox_uids(self, first: int, last: int) -> None:
        """Hold this deployment's claim on its range for the controller's life, or stop
        (exit 2) where another deployment of the machine holds an overlapping one."""
        registry = Path(self.sandbox_uid_registry).absolute()
        mine = Claim(
            first,
            last,
            deployment_identity(self.db_url),
            os.path.realpath(self.data_dir),
            os.getpid(),
        )
        accounts = [(e.pw_uid, e.pw_uid) for e in pwd.getpwall()]
        try:
            self.uid_claim = claim(registry, mine, accounts)
        except ClaimError as e:
            self.exit_with(f"{e.setting}: {e}", code=2)
            return
        atexit.register(self.uid_claim.release)
        self.log.info("sandbox uids %d-%d claimed in %s", first, last, registry)

    # ----------------------------------------------------------- plumbing
    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)

    @property
    def request_lease(self) -> timedelta:
        return timedelta(seconds=self.request_lease_seconds)

    def kick(self) -> None:
        """Run an admission cycle soon (a request arrived, GPUs were released)."""
        self.admission.kick()

    async def identify(self, handler: web.RequestHandler) -> Identity | None:
        if self.hub_auth is None:
            return None
        model = await self.hub_auth.get_user(handler, sync=False)
        if not model:
            return None
        return Identity(
            kind=model.get("kind", "user"),
            name=model["name"],
            scopes=frozenset(model.get("scopes", ())),
            by_cookie=not getattr(handler, "_token_authenticated", False),
        )

    # ----------------------------------------------------------- membership
    async def refresh_memberships(self, max_age: float) -> None:
        """Sync project membership from hub groups unless it was synced within ``max_age``."""
        if not self.hub_api_url:
            return
        async with self._membership_lock:
            if time.monotonic() - self._memberships_synced_at < max_age:
                return
            groups = await self._fetch_hub_groups()
            try:
                self.store.sync_memberships(self.now(), groups)
            except LeaseLost:
                # A controller that does not hold the lease (yet: one killed a moment ago
                # still does) may not write; the leader syncs, and the request goes on
                # with the memberships recorded (its own write says it is not the leader).
                return
            self._memberships_synced_at = time.monotonic()

    async def _fetch_hub_groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        headers = {
            "Authorization": f"token {self.hub_api_token}",
            "Accept": "application/jupyterhub-pagination+json",
        }
        offset = 0
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                response = await client.get(
                    f"{self.hub_api_url}/groups", params={"offset": offset}, headers=headers
                )
                response.raise_for_status()
                page = response.json()
                for group in page["items"]:
                    groups[group["name"]] = list(group.get("users", []))
                next_page = page.get("_pagination", {}).get("next")
                if not next_page:
                    return groups
                offset = next_page["offset"]

    async def cordon(self, node: str, cordoned: bool, by: str) -> bool:
        """Cordon or uncordon ``node``. A node of a Kubernetes cluster is cordoned there
        first (``spec.unschedulable``, the one truth; the watch brings it back), so a refusal
        of its API server changes nothing. Raises NotFound for an unknown node."""
        place = self.store.cluster_of_node(node)
        if place is None:
            raise NotFound(f"there is no node {node!r}")
        cluster, backend = place
        if backend == KUBERNETES:
            if self.kube is None or cluster not in self.kube.watches:
                raise ClusterUnavailable(
                    f"node {node} belongs to cluster {cluster}, which is not in "
                    "c.FleetController.clusters; add it to cordon its nodes"
                )
            await self.kube.cordon(node, cluster, cordoned)
        return self.store.set_cordoned(self.now(), node, cordoned, by)

    async def drain(self, node: str, by: str, why: str) -> None:
        """Cordon ``node`` and stop what runs there: jobs restart elsewhere, sessions are
        snapshotted and stopped (docs/recovery.md, "Drain")."""
        await self.cordon(node, True, by)
        drained = self.store.drain_node(self.now(), node, by, why)
        self.victims.stop(drained.sessions)
        self.notifier.changed(drained.changed)  # the node agents stop the jobs' ranks
        self.kick()

    async def recycle(self, node: str, by: str, why: str) -> None:
        """Drain ``node``, recycle it once it is empty, then diagnose it (docs/recovery.md,
        "Maintenance")."""
        await self.cordon(node, True, by)
        drained = self.store.recycle_node(self.now(), node, by, why)
        self.victims.stop(drained.sessions)
        self.notifier.changed(drained.changed)
        self.kick()

    def _stop_sessions_of_lost_nodes(self, stops: list[Stop]) -> None:
        self.victims.stop(stops)
        self.notifier.changed([s.workload_id for s in stops])

    async def live_pod_markers(self) -> frozenset[str] | None:
        """The markers of workloads with a pod in a Kubernetes cluster (none without
        clusters); None when a cluster cannot say."""
        if self.kube is None:
            return frozenset()
        return await self.kube.live_pod_markers()

    # ----------------------------------------------------------- loops
    async def _hold_lease(self) -> None:
        while True:
            was_leader = self.is_leader
            try:
                held = self.store.try_acquire_lease(self.now())
                if held and not was_leader:
                    self.store.forget_mirror()  # another controller may have written
                    extended = self.store.extend_leases(self.now(), self.request_lease)
                    self.log.info(
                        "holding the database lease as %s; renewed %d waiting request(s)",
                        self.store.holder,
                        extended,
                    )
            except (SQLAlchemyError, LeaseLost):
                self.log.exception("could not take or renew the database lease")
                held = False
            if not held and was_leader:
                self.log.warning("lost the database lease; standing by")
            elif not held:
                self.log.info("another controller holds the database lease; standing by")
            self.is_leader = held
            if not held:
                self.leading_since = None
            elif not was_leader:
                self.leading_since = self.now()
            if held != was_leader:
                (self.timed.lead if held else self.timed.follow)()
            if held:
                self._became_leader.set()
                if not was_leader:
                    self.kick()
            await asyncio.sleep(self.db_lease_seconds / 3)

    @property
    def scheduling_policy(self) -> Policy:
        return Policy(
            min_run_time_s=self.min_run_time_seconds,
            max_preemption_searches=self.max_preemption_searches,
            spares=tuple(sorted(self.recovery_spares.items())),
        )

    async def _watch_nodes(self) -> None:
        previous: datetime | None = None  # this leader's last pass: each silence acts once
        while True:
            await asyncio.sleep(max(self.node_heartbeat_timeout / 3, 0.2))
            timeout = timedelta(seconds=self.node_heartbeat_timeout)
            jobs_after = timedelta(seconds=self.job_agent_lost_seconds)
            now = self.now()
            # Agents could not report while no controller held the lease: silence counts
            # only once this one has led for the whole timeout.
            since = self.leading_since
            if not self.is_leader or since is None or now - since < timeout:
                previous = None
                continue
            try:
                lost = self.store.lose_silent_nodes(now, timeout, jobs_after, previous)
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("could not check node heartbeats")
                continue
            previous = now
            if lost.nodes:
                self.log.warning("nodes stopped reporting", extra={"nodes": lost.nodes})
            for fault in lost.restarted:
                self.metrics.job_restarts.labels(fault).inc()
            if lost.changed:
                self.notifier.changed(lost.changed)
                self.kick()

    async def _sync_memberships(self) -> None:
        while True:
            if self.is_leader:
                try:
                    await self.refresh_memberships(max_age=0)
                except (httpx.HTTPError, SQLAlchemyError, SchedulerError):
                    self.log.exception("could not sync project membership from hub groups")
            await asyncio.sleep(self.membership_sync_interval)

    async def _culler_loop(self) -> None:
        await self.culler.run(lambda: self.is_leader)

    def _snapshots(self) -> tuple[Any, bytes]:
        """The snapshot store and its master key; SnapshotError when unavailable."""
        return self.snapshot_access.open()

    async def run_snapshot_retention(self) -> None:
        from ..snapshotter.retention import RetentionPolicy, retention_pass

        store, key = self._snapshots()
        said = await retention_pass(
            store,
            key,
            self.store.project_names(),
            RetentionPolicy(self.snapshot_keep_last, self.snapshot_keep_daily),
            self.snapshot_gc_margin_seconds,
            time.time(),
        )
        self.store.record_event(self.now(), "snapshot-retention", said)
        self.refresh_snapshot_index()

    async def _snapshot_index_loop(self) -> None:
        from ..snapshotter import listing as snapshots

        try:
            store, key = self._snapshots()
        except SnapshotError as e:
            self.log.error("snapshots are unavailable: %s", e)
            return
        while True:
            self._index_wanted.clear()
            if self.is_leader:
                try:
                    started = self.now()
                    records = await asyncio.to_thread(
                        snapshots.scan, store, key, self.store.project_names()
                    )
                    changes = self.store.rebuild_snapshot_index(self.now(), store.uri, records)
                    self.snapshot_index_at = started
                    self.log.info("snapshot index: %s", changes)
                except (SnapshotError, SQLAlchemyError, SchedulerError):
                    self.log.exception("could not rebuild the snapshot index; retrying later")
            # Asked again when a session ends (its final snapshot is in the store by
            # then), at most every snapshot_index_min_interval seconds.
            await asyncio.sleep(self.snapshot_index_min_interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._index_wanted.wait(),
                    max(0.0, self.snapshot_index_interval - self.snapshot_index_min_interval),
                )

    def refresh_snapshot_index(self) -> None:
        """Read the snapshot store into the index soon (a session ended)."""
        self._index_wanted.set()

    async def _recovery_loop(self) -> None:
        """Stop the jobs that stopped progressing (they come back as their next attempt),
        and ask the node agents for the maintenance that became possible."""
        while True:
            await asyncio.sleep(self.hang_check_interval)
            if not self.is_leader:
                continue
            try:
                stopped = self.store.stop_hung_jobs(self.now())
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("recovery: looking for hung jobs failed; retrying")
                continue
            if stopped:
                self.log.warning("recovery: stopping hung job(s) %s", stopped)
                self.notifier.changed(stopped)  # the node agents stop their ranks
            try:
                asked = self.store.start_due_maintenance(self.now())
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("recovery: starting due maintenance failed; retrying")
                continue
            if asked:
                self.log.info("recovery: maintenance asked of the node agents: %s", asked)
                self.notifier.wake_agents()

    async def _reconcile_loop(self) -> None:
        if not self.hub_api_url:
            self.log.warning("no hub API ($JUPYTERHUB_API_URL): the reconciler is off")
            return
        reconciler = Reconciler(
            self.store,
            self.metrics,
            self.servers,
            self.hub_api_url,
            self.hub_api_token,
            self.log,
            self.now,
            pods=self.live_pod_markers,
            delete_pods=self.kube.delete_pods_with_marker if self.kube is not None else None,
        )
        while True:
            await asyncio.sleep(self.reconcile_interval)
            if not self.is_leader:
                continue
            try:
                changed = await reconciler.run_once(timedelta(seconds=self.reconcile_grace))
            except httpx.TransportError as e:  # the hub restarting
                self.log.warning("reconciler: the hub's API did not answer (%s); retrying", e)
                continue
            except (httpx.HTTPError, SQLAlchemyError, SchedulerError):
                self.log.exception("reconciler pass failed; retrying next pass")
                continue
            if changed:
                self.notifier.changed(changed)
                self.kick()  # released GPUs may admit waiting requests

    # ----------------------------------------------------------- start
    def make_web_app(self) -> CountingApplication:
        return CountingApplication(
            [
                *routes(self.service_prefix, self),
                *page_routes(self.service_prefix, self),
                *admin_routes(self.service_prefix, self),
                *job_page_routes(self.service_prefix, self),
            ],
            log_function=self._log_request,
            # The pages' forms carry tornado's XSRF token; the API takes tokens, not
            # cookies, for its writes (api/base.py), so it needs none.
            xsrf_cookies=True,
            # Signs the hub's OAuth cookie for the controller's pages; a restart logs
            # browsers in again through the hub, which is silent.
            cookie_secret=os.urandom(32),
        )

    def _log_request(self, handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = logging.ERROR if status >= 500 else logging.DEBUG
        self.log.log(
            level,
            "%s %s %d",
            handler.request.method,
            handler.request.uri,
            status,
            extra={"ms": round(1000 * handler.request.request_time(), 1)},
        )

    async def serve(self) -> None:
        url = urlparse(self.service_url)
        app = self.make_web_app()
        server = HTTPServer(app, xheaders=True)
        server.listen(url.port or 80, url.hostname or "127.0.0.1")
        self.log.info("gpufleet controller %s listening on %s", self.version, self.service_url)
        self._tasks.append(asyncio.create_task(self._hold_lease()))
        if self.cluster_settings:
            self.kube = KubeInventory(
                self.cluster_settings,
                self.store,
                log=self.log,
                now=self.now,
                kick=self.kick,
                unreachable_after=self.cluster_unreachable_after,
                probe_interval=self.cluster_probe_interval,
                node_lost_grace=self.node_lost_grace_seconds,
                stop_sessions=self._stop_sessions_of_lost_nodes,
            )
            await self.kube.start()
            self._tasks.append(asyncio.create_task(self.kube.run(lambda: self.is_leader)))
        # Apply the declared projects and profiles once we may write.
        await self._became_leader.wait()
        self.store.apply_config(self.now(), self.projects, self.profiles, self.priority_classes)
        for loop in (
            self.admission.run,
            self._watch_nodes,
            self._sync_memberships,
            self._reconcile_loop,
            self._recovery_loop,
            self._snapshot_index_loop,
            self._culler_loop,
        ):
            self._tasks.append(asyncio.create_task(loop()))
        try:
            await asyncio.Event().wait()
        finally:
            await answer_in_flight(server, app, self.notifier)

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        asyncio.run(until_stopped(self.serve(), self.log))


def main(argv: list[str] | None = None) -> None:
    app = FleetController.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()


if __name__ == "__main__":
    main()
