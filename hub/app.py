"""The fleet controller: a JupyterHub managed service and the only writer of the database.

It serves the REST API and the pages, holds the database lease and, while it does, runs
its loops: admission cycles, the culler, the reconciler, the recovery loop, the watch
over node heartbeats, membership sync, the snapshot index and timed work. Each loop is a
component of its own module with its own options (docs/architecture.md, "The
controller's loops"). It reads the same ``jupyterhub_config.py`` as the hub
(``c.FleetController.*``, ``c.Culling.*``, ...).
"""

from __future__ import annotations

import asyncio
import atexit
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

from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, default

from .. import __version__
from ..agent.lifecycle import until_stopped
from ..clusters.kube_config import ClusterConfigError, check_loadable, parse_clusters
from ..culler.errors import PolicyError
from ..scheduler.errors import InputError, NotFound, SchemaMismatch
from ..scheduler.model import project_tree
from ..snapshotter.settings import RenamedSnapshotOptions
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
from .components import EarlierLoopNames, Loops
from .culling import Culling
from .errors import ClusterUnavailable, HubUnavailable
from .inventory_loop import NodeWatch
from .job_pages import job_page_routes
from .kube_drains import KubeDrains
from .kube_inventory import KubeInventory
from .kube_jobs import KubeJobs
from .lease import LeaseHolder
from .memberships import MembershipSync
from .metrics import ControllerMetrics
from .notifier import Notifier
from .pages import page_routes
from .reconciling import Reconciling
from .recovery_loop import RecoveryLoop
from .recovery_options import RecoveryOptions
from .scheduling import AdmissionCycles
from .secrets import SecretFileError, check_secret_file
from .serving import CountingApplication, answer_in_flight
from .snapshot_index import SnapshotIndexing
from .stopper import ServerStopper
from .timed import TimedWork
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


class FleetController(RecoveryOptions, DatabaseMixin, RenamedSnapshotOptions, EarlierLoopNames):
    name = "gpufleet-controller"
    version = __version__
    description = "The gpufleet fleet controller (a JupyterHub service)."
    subcommands = {"upgrade-db": (UpgradeDB, UpgradeDB.description)}
    classes = [
        UpgradeDB,
        AdmissionCycles,
        KubeInventory,
        KubeJobs,
        TimedWork,
        Culling,
        SnapshotIndexing,
        Reconciling,
        RecoveryLoop,
        NodeWatch,
        MembershipSync,
    ]

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

    db_lease_seconds = Float(
        15.0,
        help="The database lease: a second controller takes over this long after the active "
        "one stops renewing (rolling updates, crashes).",
    ).tag(config=True)

    # Where snapshots go: c.SnapshotSettings (snapshotter/settings.py), which the spawners
    # and the node agents read too; the earlier c.FleetController.snapshot_* names come
    # with RenamedSnapshotOptions. The loops' options are their components' (Culling,
    # Reconciling, ...; hub/components.py), their earlier names here EarlierLoopNames'.

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
        self.kube_jobs: KubeJobs | None = None
        self.kube_drains: KubeDrains | None = None
        self.notifier = Notifier()
        self._open_database()
        self.hub_api_url = os.environ.get("JUPYTERHUB_API_URL", "")
        self.hub_api_token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        # The one way the controller stops a user's server: the culler, preemption (and
        # drains) and the reconciler all go through it.
        self.servers = ServerStopper(
            self.hub_api_url, self.hub_api_token, self.store, self.log, self.now
        )
        self.snapshot_access = self.snapshot_settings().access(self.data_dir)
        self._configure_accounts()
        try:
            policies = self.recovery_policies()
            (
                self.store.jobs.retry_policy,
                self.store.jobs.recovery_policy,
                self.store.jobs.breaker_policy,
            ) = policies
            self.store.jobs.plan_maintenance = self.recovery_maintenance
        except ValueError as e:
            self.exit_with(f"job restarts: {e}", code=2)
        self.metrics = ControllerMetrics(self.store)
        self.is_leader = False
        self.leading_since: datetime | None = None
        # The recovery spares of the last admission cycle this controller ran.
        self.spare_nodes: frozenset[str] = frozenset()
        self._make_components()
        self.hub_auth: Any = None
        if self.hub_api_url and self.hub_api_token:
            from jupyterhub.services.auth import HubOAuth

            # The singleton: the pages' OAuth callback handler finds the same instance.
            self.hub_auth = HubOAuth.instance(api_token=self.hub_api_token, cache_max_age=60)

    def _open_database(self) -> None:
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

    def _make_components(self) -> None:
        """The lease, the timed work and the loops, each given the controller; a
        configuration that cannot work stops the start (exit 2)."""
        self.lease = LeaseHolder(self)
        try:
            self.timed = TimedWork(self, self.engine, parent=self)
        except ValueError as e:
            self.exit_with(str(e), code=2)
        try:
            self.admission = AdmissionCycles(self, parent=self)
        except (TraitError, ValueError) as e:
            self.exit_with(f"c.AdmissionCycles: {e}", code=2)
        self.victims = VictimStopper(
            self.servers, self.log, self.admission.preemption_retry_seconds
        )
        try:
            self.culling = Culling(self, parent=self)
        except PolicyError as e:
            self.exit_with(f"c.Culling.idle_policies: {e}", code=2)
        self.culler = self.culling.culler
        self.node_watch = NodeWatch(self, parent=self)
        self.memberships = MembershipSync(self, parent=self)
        self.reconciling = Reconciling(self, parent=self)
        self.recovery_loop = RecoveryLoop(self, parent=self)
        self.snapshot_indexing = SnapshotIndexing(self, parent=self)
        self.loops = Loops()

    def _configure_accounts(self) -> None:
        first, last = self.sandbox_uids
        self.uid_claim: HeldClaim | None = None
        if self.user_mode == "sandbox":
            problem = check_range(first, last, ((e.pw_name, e.pw_uid) for e in pwd.getpwall()))
            if problem:
                self.exit_with(f"c.FleetController.sandbox_uids: {problem}", code=2)
        self.store.accounts.user_mode = self.user_mode
        self.store.accounts.sandbox_uids = (first, last)
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
        try:
            model = await self.hub_auth.get_user(handler, sync=False)
        except web.HTTPError as e:
            # HubAuth's words for a hub it could not reach (500) or that failed (502).
            if e.status_code not in (500, 502):
                raise
            raise HubUnavailable(
                f"the hub could not check the request's token: {e.log_message}; "
                "try again once it answers"
            ) from e
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
        await self.memberships.refresh(max_age)

    async def cordon(self, node: str, cordoned: bool, by: str) -> bool:
        """Cordon or uncordon ``node``. A node of a Kubernetes cluster is cordoned there
        first (``spec.unschedulable``, the one truth; the watch brings it back), so a refusal
        of its API server changes nothing. Raises NotFound for an unknown node."""
        place = self.store.clusters.cluster_of_node(node)
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
        return self.store.nodes.set_cordoned(self.now(), node, cordoned, by)

    async def drain(self, node: str, by: str, why: str) -> None:
        """Cordon ``node`` and stop what runs there: jobs restart elsewhere, sessions are
        snapshotted and stopped (docs/recovery.md, "Drain")."""
        await self.cordon(node, True, by)
        drained = self.store.jobs.drain_node(self.now(), node, by, why)
        self.victims.stop(drained.sessions)
        self.notifier.changed(drained.changed)  # the node agents stop the jobs' ranks
        self.kick()
        place = self.store.clusters.cluster_of_node(node)
        if place is not None and place[1] == KUBERNETES and self.kube_drains is not None:
            # What gpufleet does not run there: evicted, so PodDisruptionBudgets hold.
            self.kube_drains.start(node, place[0], by)

    async def recycle(self, node: str, by: str, why: str) -> None:
        """Drain ``node``, recycle it once it is empty, then diagnose it (docs/recovery.md,
        "Maintenance")."""
        await self.cordon(node, True, by)
        drained = self.store.maintenance.recycle_node(self.now(), node, by, why)
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

    # ----------------------------------------------------------- policies, snapshots
    def _snapshots(self) -> tuple[Any, bytes]:
        """The snapshot store and its master key; SnapshotError when unavailable."""
        return self.snapshot_access.open()

    async def run_snapshot_retention(self) -> None:
        from ..snapshotter.retention import RetentionPolicy, retention_pass

        store, key = self._snapshots()
        said = await retention_pass(
            store,
            key,
            self.store.snapshots.project_names(),
            RetentionPolicy(self.timed.snapshot_keep_last, self.timed.snapshot_keep_daily),
            self.timed.snapshot_gc_margin_seconds,
            time.time(),
        )
        self.store.events.record_event(self.now(), "snapshot-retention", said)
        self.refresh_snapshot_index()

    def refresh_snapshot_index(self) -> None:
        """Read the snapshot store into the index soon (a session ended)."""
        self.snapshot_indexing.refresh()

    @property
    def snapshot_index_at(self) -> datetime | None:
        return self.snapshot_indexing.indexed_at

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
        try:
            await self._start_loops()
            await asyncio.Event().wait()
        finally:
            try:
                await answer_in_flight(server, app, self.notifier)
            finally:
                await self.loops.stop()
                self.lease.release()

    async def _start_loops(self) -> None:
        """The lease first, then (once this controller leads, which may be never while
        another does) the declared projects and profiles, then every loop."""
        self.loops.start([self.lease.run])
        if self.cluster_settings:
            kube = self.kube = KubeInventory(
                self.cluster_settings,
                self.store,
                now=self.now,
                kick=self.kick,
                stop_sessions=self._stop_sessions_of_lost_nodes,
                jobs_changed=self.notifier.changed,
                parent=self,
            )
            await kube.start()
            self.loops.start([lambda: kube.run(lambda: self.is_leader)])
            self.kube_drains = KubeDrains(kube, self.store, self.now, parent=self)
            if kube.recycle_action == "delete-node":
                self.store.maintenance.replacing_clusters = frozenset(kube.watches)
            jobs = self.kube_jobs = KubeJobs(
                self.cluster_settings,
                self.store,
                now=self.now,
                kick=self.kick,
                notifier=self.notifier,
                hub_url=self.hub_api_url,
                controller_url=self.service_url,
                lost_nodes=lambda: {name: why for name, (_, why) in kube.lost_since.items()},
                on_restart=lambda fault: self.metrics.job_restarts.labels(fault).inc(),
                parent=self,
            )
            await jobs.start()
            self.loops.start([lambda: jobs.run(lambda: self.is_leader)])
        await self.lease.became_leader.wait()
        self.store.projects.apply_config(
            self.now(), self.projects, self.profiles, self.priority_classes
        )
        self.loops.start(
            [
                self.admission.run,
                self.node_watch.run,
                self.memberships.run,
                self.reconciling.run,
                self.recovery_loop.run,
                self.snapshot_indexing.run,
                self.culling.run,
            ]
        )

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
