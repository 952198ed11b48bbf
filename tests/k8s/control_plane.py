"""Real Kubernetes control planes on loopback for the test tier: etcd, kube-apiserver,
kube-scheduler and kube-controller-manager, one set per cluster ("cluster-a", "cluster-b").

The Kubernetes binaries are built once by ``scripts/install --k8s`` (``scripts/build-kube``,
from Debian's ``kubernetes`` source package) and found through ``.tools/k8s/bin`` in the
checkout or ``$GPUFLEET_K8S_BIN``; etcd is Debian's ``etcd-server``.

Each cluster has its own etcd (not one etcd with two ``--etcd-prefix`` es): a cluster whose
store is stopped, compacted or slow then never touches the other, exactly as with two real
clusters, for a second of start-up and some 30 MB. Every process listens on 127.0.0.1 only,
on ports chosen free at start and passed explicitly; none has an insecure port. Each runs in
a process group of its own, which ``ControlPlane.stop`` kills; the temporary directory
(configuration, keys, logs; etcd's data on tmpfs where there is one) goes with it.

Per cluster: RBAC on (``--authorization-mode=Node,RBAC``) with the default admission plugins
of 1.20 plus NodeRestriction; static token identities (``Cluster.identities``):
``admin`` (system:masters), ``controller`` (gpufleet's controller: reads nodes, pods, events
and leases cluster-wide, cordons nodes), ``spawner`` (creates pods and their companions in
the ``gpufleet`` namespace only), the scheduler's and controller-manager's standard users,
and one kubelet per fake node. The node-lifecycle controller runs with short timeouts
(``NODE_MONITOR_GRACE_S``), so a node whose lease stops being renewed is NotReady within
seconds; leader election is off.

Fake GPU nodes and their lease renewers are in ``nodes.py``. Each node has a test kubelet
(``kubelet.py``, ``Cluster.kubelet(name)``) that runs the pods bound to it on this machine,
in gpufleet's session sandbox, each pod at a loopback address of its own (``kubelets=False``
starts the tier without them).

One more identity, ``dns`` (``DNS_USER``, granted ``DNS_RULES``: read EndpointSlices and
Services, nothing else), plays the cluster's DNS server: the kubelets answer pods' peer
names through their ``/etc/hosts`` (``names.py``) from the EndpointSlices of headless
Services, which a kubelet's own identity may not read (the Node authorizer lets a node get
Endpoints and read Services, nothing of EndpointSlices; and Endpoints validation refuses
the tier's loopback pod IPs, so only the slices hold them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from gpufleet.recovery.fake_nvml import FakeNvmlBuildError, build

from ..ports import free_ports
from .kubelet import Kubelet, KubeletSettings
from .nodes import FakeNode, NodeSpec
from .pki import (
    CertificateAuthority,
    Identity,
    KubeContext,
    kubelet_identity,
    trust,
    write_kubeconfig,
    write_signing_key,
    write_token_file,
)
from .processes import ManagedProcess, TierStartError, wait_until
from .resources import PodAddresses

BIN_ENV = "GPUFLEET_K8S_BIN"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / ".tools" / "k8s" / "bin"
KUBE_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
PLATFORM_ENV = REPO_ROOT / ".tools" / "platform-env"
# The chart's default repositories of the images its platform pods run (values.yaml).
PLATFORM_IMAGES = (
    "gpufleet/hub-controller",
    "gpufleet/agent",
    "quay.io/jupyterhub/configurable-http-proxy",
)
INSTALL_HINT = (
    "the Kubernetes test tier is not built: run `scripts/install --k8s` (it builds "
    "kube-apiserver, kube-scheduler and kube-controller-manager once from Debian's source "
    "package, about 15 CPU-minutes, and installs Debian's etcd-server)"
)
NAMESPACE = "gpufleet"  # where the spawner identity may create pods
DNS_USER = "gpufleet-test-cluster-dns"  # what the kubelets read peers' addresses as
START_DEADLINE_S = 90.0
# The node-lifecycle controller's timing: a node whose lease is not renewed for
# NODE_MONITOR_GRACE_S is NotReady (Unknown) at the next 1 s monitor pass. The renewers
# renew every nodes.RENEW_INTERVAL_S, well inside it even on a loaded two-core machine.
NODE_MONITOR_GRACE_S = 5
# How long pods tolerate a NotReady/unreachable node before the taint manager evicts them.
EVICTION_TOLERATION_S = 10
SERVICE_RANGES = ("10.96.0.0/16", "10.97.0.0/16", "10.98.0.0/16", "10.99.0.0/16")


class K8sUnavailable(RuntimeError):
    """The tier's binaries are missing; the message says how to build them."""


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    etcd: Path
    kubectl: Path | None


def find_binaries() -> Binaries:
    """The control plane's binaries, or ``K8sUnavailable`` naming ``scripts/install --k8s``."""
    bindir = Path(os.environ.get(BIN_ENV) or DEFAULT_BIN)
    missing = [b for b in KUBE_BINARIES if not os.access(bindir / b, os.X_OK)]
    etcd = shutil.which("etcd")
    if missing or etcd is None:
        what = [str(bindir / b) for b in missing] + ([] if etcd else ["etcd (etcd-server)"])
        raise K8sUnavailable(f"{INSTALL_HINT}; missing: {', '.join(what)}")
    kubectl = bindir / "kubectl"
    return Binaries(
        bindir / "kube-apiserver",
        bindir / "kube-scheduler",
        bindir / "kube-controller-manager",
        Path(etcd),
        kubectl if os.access(kubectl, os.X_OK) else None,
    )


@dataclass
class Cluster:
    """One cluster: its servers, identities and files. ``rest`` and ``kubeconfig`` give
    access as any identity; ``nodes`` holds its fake GPU nodes by name."""

    name: str
    workdir: Path
    ca: CertificateAuthority
    service_range: str
    ports: dict[str, int]
    identities: dict[str, Identity]
    spare_node_names: list[str] = field(default_factory=list)  # kubelet tokens, no Node yet
    etcd_data: Path | None = None  # on tmpfs where there is one, outside ``workdir``
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    nodes: dict[str, FakeNode] = field(default_factory=dict)
    kubelet_settings: KubeletSettings | None = None  # None: nodes get no kubelet
    kubelets: dict[str, Kubelet] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def kubeconfig(self, identity: str = "admin", namespace: str | None = None) -> Path:
        """A kubeconfig with one context, named as the cluster, as ``identity``."""
        suffix = f"-{namespace}" if namespace else ""
        path = self.workdir / f"{identity.replace(':', '-')}{suffix}.kubeconfig"
        if not path.exists():
            write_kubeconfig(
                path, self.ca.cert_path, [self.context(identity, namespace)], current=self.name
            )
        return path

    def context(self, identity: str, namespace: str | None = None) -> KubeContext:
        return KubeContext(self.name, self.server, self.identities[identity], namespace)

    def rest(self, identity: str = "admin", timeout_s: float = 10.0) -> httpx.Client:
        """A plain HTTP client on the API server as ``identity`` (the caller closes it)."""
        return httpx.Client(
            base_url=self.server,
            verify=trust(self.ca.cert_path),
            headers={"Authorization": f"Bearer {self.identities[identity].token}"},
            timeout=timeout_s,
        )

    def add_node(
        self,
        spec: NodeSpec,
        wait: bool = True,
        devices: Mapping[str, Sequence[str]] | None = None,
    ) -> FakeNode:
        """Registers a fake GPU node as its kubelet would, starts its lease renewer and its
        test kubelet (serving ``devices`` by resource name; default: its GPUs), and (with
        ``wait``) returns once the node-lifecycle controller has it Ready and untainted.
        The API server reads its token file once, so a node added after start takes one of
        the spare kubelet identities' names (``spare_node_name``)."""
        identity = self.identities.get(f"kubelet:{spec.name}")
        if identity is None:
            raise ValueError(
                f"node {spec.name!r} has no kubelet token in {self.name}: declare it at start "
                "or name it with Cluster.spare_node_name()"
            )
        if spec.name in self.spare_node_names:
            self.spare_node_names.remove(spec.name)
        node = FakeNode(spec, self.name, self.server, self.ca.cert_path, identity)
        node.register()
        node.start_renewer()
        self.nodes[spec.name] = node
        if self.kubelet_settings is not None:
            kubelet = Kubelet(node, self.kubelet_settings, devices, self.identities["dns"])
            self.kubelets[spec.name] = kubelet
            kubelet.start()
        if wait:
            with self.rest() as api:
                node.wait_ready(api, deadline_s=30.0)
        return node

    def kubelet(self, node: str) -> Kubelet:
        """The test kubelet of ``node`` (``pause``/``resume``, ``logs``)."""
        if node not in self.kubelets:
            raise KeyError(
                f"{node!r} has no test kubelet in {self.name} (known: {sorted(self.kubelets)})"
            )
        return self.kubelets[node]

    def spare_node_name(self) -> str:
        """The name of a node not registered yet whose kubelet has a token."""
        if not self.spare_node_names:
            raise RuntimeError(f"{self.name} has no spare kubelet identity left")
        return self.spare_node_names[0]

    def remove_node(self, name: str) -> None:
        """Stops the node's renewer and deletes its Node (its Lease follows by owner). Its
        name is not offered again: the node-lifecycle controller remembers a node's health
        by name for a while, so a new node of that name could be found NotReady at once."""
        node = self.nodes.pop(name)
        kubelet = self.kubelets.pop(name, None)
        if kubelet is not None:
            kubelet.stop()
        node.stop_renewer()
        with self.rest() as api:
            r = api.delete(f"/api/v1/nodes/{name}")
            if r.status_code not in (200, 404):
                r.raise_for_status()

    def stop(self) -> None:
        try:
            # The kubelets first: their containers die before anything they talk to.
            for kubelet in self.kubelets.values():
                kubelet.stop()
        finally:
            for node in self.nodes.values():
                node.stop_renewer()
            # Clients first, the store last: nothing logs errors about a vanished etcd.
            for key in ("controller-manager", "scheduler", "apiserver", "etcd"):
                proc = self.processes.get(key)
                if proc is not None:
                    proc.stop()


# Grants of gpufleet's own identities: what the controller and the spawner are expected to
# need (later work may widen them; the tier's tests check that they are not wider).
CONTROLLER_RULES: list[dict[str, Any]] = [
    # delete: a recycle by deleting the Node (c.KubeInventory.recycle_action).
    {
        "apiGroups": [""],
        "resources": ["nodes"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list", "watch"]},
    # A drain evicts what else runs on the node, whatever its namespace.
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list"]},
]
# In gpufleet's namespace only: the reconciler deletes pods of sessions that ended; the
# cluster manager makes and deletes training jobs' pods and the objects they share, and
# patches a pod a restart keeps into the next attempt.
CONTROLLER_NAMESPACE_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["get", "list", "create", "patch", "delete", "deletecollection"],
    },
    {
        "apiGroups": [""],
        "resources": ["services", "configmaps"],
        "verbs": ["get", "list", "create", "delete", "deletecollection"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "create", "delete"],
    },
]
SPAWNER_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [""],
        "resources": ["pods", "services", "persistentvolumeclaims", "configmaps"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
]
# The tier's DNS identity (the kubelets' peer directories): what a DNS server reads to
# answer for headless Services' pods.
DNS_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
]


@dataclass
class ControlPlane:
    """The whole tier: clusters by name, their CA, and the combined kubeconfig."""

    workdir: Path
    binaries: Binaries
    ca: CertificateAuthority
    clusters: dict[str, Cluster]
    kubeconfig: Path  # every cluster as a context, as gpufleet's controller
    admin_kubeconfig: Path  # every cluster as a context, as its admin (for kubectl)
    started_in_s: float = 0.0

    def __getitem__(self, name: str) -> Cluster:
        return self.clusters[name]

    @classmethod
    def start(
        cls,
        binaries: Binaries,
        nodes: dict[str, Sequence[NodeSpec]],
        spare_kubelets: int = 6,
        kubelets: bool = True,
    ) -> ControlPlane:
        """Starts one cluster per key of ``nodes`` with those fake nodes registered and
        Ready, each with its test kubelet (unless ``kubelets`` is False). ``spare_kubelets``
        kubelet tokens per cluster (``<cluster>-spare-<i>``) let tests add nodes later.
        Everything started is stopped again if start-up fails."""
        began = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix="gpufleet-k8s-"))
        ca = CertificateAuthority.create(workdir)
        clusters: dict[str, Cluster] = {}
        for index, (name, specs) in enumerate(nodes.items()):
            spares = [f"{name}-spare-{i}" for i in range(spare_kubelets)]
            clusters[name] = _prepare_cluster(
                workdir, ca, name, index, [s.name for s in specs], spares
            )
        if kubelets:
            settings = KubeletSettings(
                workdir / "kubelets",
                PodAddresses(),
                fake_nvml_library=_fake_nvml(workdir),
                images=platform_images(),
            )
            for cluster in clusters.values():
                cluster.kubelet_settings = settings
        plane = cls(
            workdir,
            binaries,
            ca,
            clusters,
            kubeconfig=workdir / "kubeconfig",
            admin_kubeconfig=workdir / "admin.kubeconfig",
        )
        try:
            plane._boot(nodes)
        except BaseException:
            plane.stop()
            raise
        plane.started_in_s = time.monotonic() - began
        return plane

    def _boot(self, nodes: dict[str, Sequence[NodeSpec]]) -> None:
        # Each phase starts its servers in every cluster, then waits for all of them: the
        # clusters come up side by side.
        clusters = list(self.clusters.values())
        for c in clusters:
            _start(c, "etcd", _etcd_argv(self.binaries, c))
        for c in clusters:
            wait_until(
                partial(_http_ok, f"http://127.0.0.1:{c.ports['etcd']}/health"),
                f"{c.name}'s etcd",
                START_DEADLINE_S,
                [c.processes["etcd"]],
            )
            _start(c, "apiserver", _apiserver_argv(self.binaries, c))
        for c in clusters:
            with c.rest() as api:
                wait_until(
                    partial(_get_ok, api, "/readyz"),
                    f"{c.name}'s kube-apiserver",
                    START_DEADLINE_S,
                    [c.processes["apiserver"]],
                )
                _bootstrap_objects(api)
            _start(c, "scheduler", _scheduler_argv(self.binaries, c))
            _start(c, "controller-manager", _controller_manager_argv(self.binaries, c))
        for c in clusters:
            for spec in nodes[c.name]:
                c.add_node(spec, wait=False)
        for c in clusters:
            watched = [c.processes[k] for k in ("apiserver", "scheduler", "controller-manager")]
            for key in ("scheduler", "controller-manager"):
                wait_until(
                    partial(_healthz, c, key),
                    f"{c.name}'s kube-{key}",
                    START_DEADLINE_S,
                    watched,
                )
            with c.rest() as api:
                for node in c.nodes.values():
                    node.wait_ready(api, deadline_s=START_DEADLINE_S, watched=watched)
                # Pods are admitted only once the namespace's default service account (and,
                # for mounting, its token) exist: made by the controller-manager.
                wait_until(
                    partial(_default_service_account_ready, api, NAMESPACE),
                    f"{c.name}'s default service account in {NAMESPACE}",
                    START_DEADLINE_S,
                    watched,
                )
        write_kubeconfig(
            self.kubeconfig,
            self.ca.cert_path,
            [c.context("controller") for c in clusters],
        )
        write_kubeconfig(
            self.admin_kubeconfig, self.ca.cert_path, [c.context("admin") for c in clusters]
        )

    def stop(self) -> None:
        """Stops every process of every cluster and removes the temporary directories."""
        try:
            for c in self.clusters.values():
                c.stop()
        finally:
            # etcd's data first: it may lie outside the workdir (on tmpfs).
            for c in self.clusters.values():
                if c.etcd_data is not None:
                    shutil.rmtree(c.etcd_data, ignore_errors=True)
            shutil.rmtree(self.workdir, ignore_errors=True)


def platform_images() -> dict[str, Path]:
    """The images of the chart's platform pods (hub, controller, proxy, agent), played by
    this checkout's platform environment (``scripts/build-session-env --platform``, which
    ``scripts/install --k8s`` runs); none where it is not built: such pods then run from
    the sessions' base environment, which lacks the platform's packages."""
    built = PLATFORM_ENV.resolve()
    if not (built / "bin" / "gpufleet-controller").exists():
        return {}
    return dict.fromkeys(PLATFORM_IMAGES, built)


def _fake_nvml(workdir: Path) -> Path | None:
    """gpufleet's fake NVML library, built for the tier's pods (under a second); None
    without a C compiler: pods then get no NVML, and the rest of the tier works."""
    try:
        return build(workdir / "fake-nvml")
    except FakeNvmlBuildError:
        return None


def _prepare_cluster(
    workdir: Path,
    ca: CertificateAuthority,
    name: str,
    index: int,
    nodes: Sequence[str],
    spares: Sequence[str],
) -> Cluster:
    """The cluster's folder, ports, identities, token file, certificates and kubeconfigs."""
    cdir = workdir / name
    cdir.mkdir()
    keys = ("etcd", "etcd_peer", "apiserver", "scheduler", "controller-manager")
    ports = dict(zip(keys, free_ports(len(keys)), strict=True))
    identities = [
        Identity("admin", "gpufleet-test-admin", ("system:masters",)),
        Identity("controller", "gpufleet-controller"),
        Identity("spawner", "gpufleet-spawner"),
        Identity("scheduler", "system:kube-scheduler"),
        Identity("controller-manager", "system:kube-controller-manager"),
        Identity("dns", DNS_USER),
        *(kubelet_identity(n) for n in [*nodes, *spares]),
    ]
    write_token_file(cdir / "tokens.csv", identities)
    for component in ("apiserver", "scheduler", "controller-manager"):
        ca.issue(cdir, component, dns_names=("kubernetes", "kubernetes.default"))
    write_signing_key(cdir, "service-account")
    cluster = Cluster(
        name,
        cdir,
        ca,
        SERVICE_RANGES[index % len(SERVICE_RANGES)],
        ports,
        {i.key: i for i in identities},
        list(spares),
    )
    cluster.kubeconfig("scheduler")
    cluster.kubeconfig("controller-manager")
    return cluster


def _start(cluster: Cluster, key: str, argv: list[str]) -> None:
    proc = ManagedProcess(f"{cluster.name}'s {key}", argv, cluster.workdir / f"{key}.log")
    cluster.processes[key] = proc
    proc.start()


def _etcd_data_dir(cluster: Cluster) -> Path:
    """etcd's data on tmpfs where there is one: etcd fsyncs every write, and a test tier
    needs no durability, only speed on a busy disk. ``ControlPlane.stop`` removes it."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        cluster.etcd_data = Path(tempfile.mkdtemp(prefix=f"gpufleet-etcd-{cluster.name}-", dir=shm))
    else:
        cluster.etcd_data = cluster.workdir / "etcd-data"
        cluster.etcd_data.mkdir()
    return cluster.etcd_data


def _etcd_argv(binaries: Binaries, c: Cluster) -> list[str]:
    client = f"http://127.0.0.1:{c.ports['etcd']}"
    peer = f"http://127.0.0.1:{c.ports['etcd_peer']}"
    return [
        str(binaries.etcd),
        f"--name={c.name}",
        f"--data-dir={_etcd_data_dir(c)}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={c.name}={peer}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-level=warn",
    ]


def _apiserver_argv(binaries: Binaries, c: Cluster) -> list[str]:
    d = c.workdir
    return [
        str(binaries.kube_apiserver),
        f"--etcd-servers=http://127.0.0.1:{c.ports['etcd']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={c.ports['apiserver']}",
        "--insecure-port=0",
        f"--tls-cert-file={d / 'apiserver.crt'}",
        f"--tls-private-key-file={d / 'apiserver.key'}",
        f"--token-auth-file={d / 'tokens.csv'}",
        "--anonymous-auth=false",
        "--authorization-mode=Node,RBAC",
        # 1.20's default plugins (NamespaceLifecycle, ServiceAccount, TaintNodesByCondition,
        # DefaultTolerationSeconds, Priority, ResourceQuota …) plus NodeRestriction: a
        # kubelet identity may change only its own Node and Lease.
        "--enable-admission-plugins=NodeRestriction",
        f"--default-not-ready-toleration-seconds={EVICTION_TOLERATION_S}",
        f"--default-unreachable-toleration-seconds={EVICTION_TOLERATION_S}",
        f"--service-cluster-ip-range={c.service_range}",
        f"--service-account-key-file={d / 'service-account.pub'}",
        f"--service-account-signing-key-file={d / 'service-account.key'}",
        f"--service-account-issuer=https://kubernetes.default.svc/{c.name}",
        "--api-audiences=https://kubernetes.default.svc",
        # The `kubernetes` Service's endpoints would be the loopback address, which
        # Endpoints validation refuses; nothing in the tier runs inside a pod network.
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        "--profiling=false",
        "--v=1",
    ]


def _component_serving(c: Cluster, key: str) -> list[str]:
    """Secure serving on loopback with a CA-signed certificate, delegating authentication
    and authorization to the API server; /healthz needs neither."""
    d = c.workdir
    kubeconfig = c.kubeconfig(key)
    return [
        "--bind-address=127.0.0.1",
        f"--secure-port={c.ports[key]}",
        "--port=0",
        f"--tls-cert-file={d / f'{key}.crt'}",
        f"--tls-private-key-file={d / f'{key}.key'}",
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def _scheduler_argv(binaries: Binaries, c: Cluster) -> list[str]:
    return [str(binaries.kube_scheduler), *_component_serving(c, "scheduler")]


def _controller_manager_argv(binaries: Binaries, c: Cluster) -> list[str]:
    d = c.workdir
    return [
        str(binaries.kube_controller_manager),
        *_component_serving(c, "controller-manager"),
        # Each controller acts as its own service account, with the grants the API server's
        # bootstrap RBAC policy gives it (as kubeadm runs it).
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={d / 'service-account.key'}",
        f"--root-ca-file={c.ca.cert_path}",
        f"--service-cluster-ip-range={c.service_range}",
        "--node-monitor-period=1s",
        f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s",
        "--node-startup-grace-period=10s",
        f"--pod-eviction-timeout={EVICTION_TOLERATION_S}s",
        # The PV controller binds a claim to a static volume created a moment before only at
        # its next sync (15 s by default): a second keeps volume tests short.
        "--pvclaimbinder-sync-period=1s",
        "--controllers=*",
    ]


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _get_ok(api: httpx.Client, path: str) -> bool:
    try:
        return api.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def _healthz(c: Cluster, key: str) -> bool:
    try:
        r = httpx.get(
            f"https://127.0.0.1:{c.ports[key]}/healthz", verify=trust(c.ca.cert_path), timeout=2.0
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def _apply(api: httpx.Client, collection: str, body: dict[str, Any]) -> None:
    """Creates ``body`` in ``collection``; one that already exists is left as it is."""
    r = api.post(collection, json=body)
    if r.status_code not in (200, 201, 409):
        raise TierStartError(f"creating {collection} {body['metadata']['name']}: {r.text}")


def _bootstrap_objects(api: httpx.Client) -> None:
    """gpufleet's namespace and its identities' grants (the RBAC objects above)."""
    _apply(api, "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    _grant(api, "gpufleet-controller", CONTROLLER_RULES)
    _grant(api, "gpufleet-controller", CONTROLLER_NAMESPACE_RULES, NAMESPACE)
    _grant(api, "gpufleet-spawner", SPAWNER_RULES, NAMESPACE)
    _grant(api, DNS_USER, DNS_RULES)


def _grant(
    api: httpx.Client, user: str, rules: list[dict[str, Any]], namespace: str | None = None
) -> None:
    """A role named after ``user`` with ``rules``, bound to that user: a ClusterRole, or a
    Role in ``namespace``."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    where = f"{rbac}/namespaces/{namespace}/" if namespace else f"{rbac}/cluster"
    kind = "Role" if namespace else "ClusterRole"
    _apply(api, f"{where}roles", {"metadata": {"name": user}, "rules": rules})
    _apply(
        api,
        f"{where}rolebindings",
        {
            "metadata": {"name": user},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": user},
            "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}],
        },
    )


def _default_service_account_ready(api: httpx.Client, namespace: str) -> bool:
    try:
        r = api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json().get("secrets"))
