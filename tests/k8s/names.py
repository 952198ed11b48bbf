"""Pod names as the cluster's DNS would answer them, written into each pod's ``/etc/hosts``.

The tier has no DNS server. What a pod needs from one, a training job's pods above all, is
its peers' stable names: a pod with ``spec.hostname`` and ``spec.subdomain``, where the
subdomain names a headless Service (``clusterIP: None``) of its namespace, is
``<hostname>.<subdomain>.<namespace>.svc.cluster.local`` in the cluster's DNS. So each
pod gets a hosts file of its own, bound read-only over the container's ``/etc/hosts`` (the
kubelet's ``etc-hosts``, as a real kubelet makes it for every pod not on the host's network;
a pod on the host's network whose ``dnsPolicy`` is ``ClusterFirstWithHostNet`` gets the
machine's lines in place of the first three items below):

- ``localhost`` and the IPv6 names, as the kubelet writes them;
- the pod's own names at its IP: the kubelet's ``<hostname>.<subdomain>.<ns>.svc.<domain>``
  and ``<hostname>`` (the pod's name without ``spec.hostname``), the shorter forms of the
  first that the pod's DNS search path would complete, and the machine's hostname (the
  sandbox shares the machine's UTS namespace, so ``gethostname()`` in a pod is that name,
  where a container's would be its pod's: its own hostname resolves to its own address);
- ``spec.hostAliases``;
- the peers: every endpoint of the subdomain's Service with a ``hostname`` and not marked
  unready (``publishNotReadyAddresses: true`` marks every pod of the Service ready, so a
  job's pods see each other before they are Ready), each as
  ``<hostname>.<subdomain>.<ns>.svc.<domain>`` and its shorter forms;
- the Services of its namespace that have a cluster IP, each at the address of a ready
  endpoint (the lowest), as ``<service>.<ns>.svc.<domain>`` and its shorter forms. A
  cluster's DNS answers with the cluster IP, and its Service proxy forwards the Service's
  port to the endpoint's target port; the tier has no proxy, so such a name works only
  where the two ports are the same (the chart's in-cluster Services keep them so).

The peers come from the Service's EndpointSlices, which the tier's controller-manager keeps
from the pods its selector matches. Not from its Endpoints object: Endpoints validation
refuses loopback addresses, and every pod IP of the tier is one (the endpoints controller's
updates fail with "may not be in the loopback range"); EndpointSlices of 1.20
(``discovery.k8s.io/v1beta1``) take them. A node's kubelet identity may not list or watch
EndpointSlices (the Node authorizer lets a node get Endpoints and read Services, nothing
of EndpointSlices), so each
kubelet's :class:`PeerDirectory` watches them as the tier's DNS identity, which may only
read EndpointSlices and Services, as a cluster's DNS server reads them
(``control_plane.DNS_RULES``).

The file follows the slices as they change, even while its kubelet is paused (the cluster's
DNS does not stop with a kubelet): a job's pods start at the same moment and a
peer's address appears only once it is scheduled and admitted, and glibc reads
``/etc/hosts`` afresh at every lookup, so a process that retries its lookup sees the peer
appear. The bind mount shows the file's inode, so it is changed in place, never replaced
by a rename; and in place only by writes that a reader, whatever it reads at once, sees
whole or not at all: one-byte overwrites, and appends of lines that are comments. A line
that no longer holds has its first byte overwritten with ``#``; a new line is appended as a
comment (``#`` for its first byte: a reader that sees part of it sees a comment) and then
made a line by writing its first byte. So a reader finds a peer's old address, none, or its
new one, never a wrong or cut name. A line that changes is first commented out, then
appended anew. The file only grows, by a line per peer change, over its pod's life.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

from .podspec import Manifest
from .volumes import Mount

CLUSTER_DOMAIN = "cluster.local"
HOSTS = PurePosixPath("/etc/hosts")
SLICES = "/apis/discovery.k8s.io/v1beta1/endpointslices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 5  # the server ends each watch after this; a stopped directory notices then
RETRY_S = 0.5
_LOCALHOST = [
    "127.0.0.1\tlocalhost",
    "::1\tlocalhost ip6-localhost ip6-loopback",
    "fe00::0\tip6-localnet",
    "fe00::0\tip6-mcastprefix",
    "fe00::1\tip6-allnodes",
    "fe00::2\tip6-allrouters",
]


# ------------------------------------------------------------------ what the file says (pure)
def pod_hostname(pod: Manifest) -> str:
    """The pod's hostname: ``spec.hostname``, else its name (cut to 63 characters, as the
    kubelet cuts it)."""
    spec = pod.get("spec") or {}
    return str(spec.get("hostname") or pod["metadata"]["name"])[:63].rstrip("-.")


def names_of(hostname: str, subdomain: str, namespace: str) -> list[str]:
    """A pod's names under its subdomain, the full one first and then the shorter ones a
    pod's DNS search path (``<ns>.svc.<domain> svc.<domain> <domain>``) completes."""
    base = f"{hostname}.{subdomain}"
    return [
        f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}",
        f"{base}.{namespace}.svc",
        f"{base}.{namespace}",
        base,
    ]


def service_names(service: str, namespace: str) -> list[str]:
    """A Service's names as a pod of ``namespace`` resolves them, the full one first."""
    full = f"{service}.{namespace}"
    return [f"{full}.svc.{CLUSTER_DOMAIN}", f"{full}.svc", full, service]


def service_line(namespace: str, service: str, slices: Iterable[Manifest]) -> str | None:
    """The line that answers for a Service with a cluster IP: the lowest address of its
    ready endpoints, where a cluster's DNS gives the cluster IP and its Service proxy picks
    an endpoint (the tier has no proxy, so the pod must serve on the Service's own port);
    None while no endpoint is ready."""
    ready = sorted(
        str(address)
        for piece in slices
        for endpoint in piece.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready") is not False
        for address in endpoint.get("addresses") or []
    )
    return f"{ready[0]}\t{' '.join(service_names(service, namespace))}" if ready else None


def fixed_lines(pod: Manifest, ip: str, machine: str) -> list[str]:
    """What the pod's hosts file holds for its whole life: localhost, the pod's own names at
    ``ip`` (``machine``: the machine's hostname, which ``gethostname()`` gives in the pod),
    its ``hostAliases``."""
    spec = pod.get("spec") or {}
    hostname = pod_hostname(pod)
    own = [hostname]
    subdomain = str(spec.get("subdomain") or "")
    if subdomain:
        own = [*names_of(hostname, subdomain, str(pod["metadata"]["namespace"])), hostname]
    if machine and machine not in own and machine != "localhost":
        own.append(machine)
    lines = ["# Kubernetes-managed hosts file (the gpufleet test kubelet's).", *_LOCALHOST]
    lines.append(f"{ip}\t{' '.join(own)}")
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines.append("# Entries added by HostAliases.")
        for alias in aliases:
            hostnames = " ".join(str(h) for h in alias.get("hostnames") or [])
            if alias.get("ip") and hostnames:
                lines.append(f"{alias['ip']}\t{hostnames}")
    if subdomain:
        lines.append(f"# The peers of headless Service {subdomain}, as the cluster's DNS answers.")
    return lines


def peer_lines(namespace: str, service: str, slices: Iterable[Manifest], own_ip: str) -> list[str]:
    """A line per address of the Service's endpoints that have a hostname and are not
    marked unready (unset means ready), but the pod's own: the DNS records of a headless
    Service's pods. In a stable order."""
    lines = set()
    for piece in slices:
        for endpoint in piece.get("endpoints") or []:
            hostname = endpoint.get("hostname")
            ready = (endpoint.get("conditions") or {}).get("ready")
            if not hostname or ready is False:
                continue
            names = " ".join(names_of(str(hostname), service, namespace))
            for address in endpoint.get("addresses") or []:
                if address != own_ip:
                    lines.add(f"{address}\t{names}")
    return sorted(lines, key=lambda line: (line.split("\t")[1], line))


def with_hosts(mounts: Sequence[Mount], hosts: Path | None) -> tuple[Mount, ...]:
    """The container's mounts with the pod's hosts file over ``/etc/hosts`` (unless the
    container mounts something there itself, as the kubelet leaves it then), shallowest
    first as :func:`.volumes.container_mounts` orders them."""
    if hosts is None or any(PurePosixPath(m.destination) == HOSTS for m in mounts):
        return tuple(mounts)
    added = [*mounts, Mount(hosts, Path(HOSTS), read_only=True)]
    return tuple(sorted(added, key=lambda m: len(m.destination.parts)))


# ------------------------------------------------------------------ the file
class HostsFile:
    """A pod's hosts file on the host (see the module docstring for how it changes: only
    one-byte overwrites and appends). Not thread-safe: :class:`PeerDirectory` writes it
    under its lock."""

    def __init__(self, path: Path, fixed: Sequence[str]) -> None:
        self.path = path
        self._peers: dict[str, int] = {}  # live peer line -> its offset in the file
        text = "".join(f"{line}\n" for line in fixed).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, text)
            os.fchmod(fd, 0o644)  # every uid a container may run as reads it
        finally:
            os.close(fd)
        self._size = len(text)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def follow(self, lines: Sequence[str]) -> None:
        """Makes the file's peer lines ``lines``: those that no longer hold are commented
        out first, then the new ones appended in one write as comments and each made a
        line by its first byte (see the module docstring)."""
        stale = [offset for line, offset in self._peers.items() if line not in lines]
        new = [line for line in dict.fromkeys(lines) if line not in self._peers]
        if not stale and not new:
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for offset in stale:
                os.pwrite(fd, b"#", offset)
            self._peers = {line: o for line, o in self._peers.items() if line in lines}
            if new:
                offset = self._size  # its end: no one else writes it
                os.pwrite(fd, "".join(f"#{line[1:]}\n" for line in new).encode(), offset)
                for line in new:
                    os.pwrite(fd, line[:1].encode(), offset)
                    self._peers[line] = offset
                    offset += len(line.encode()) + 1
                self._size = offset
        finally:
            os.close(fd)


def pod_hosts(pod: Manifest, ip: str, path: Path) -> HostsFile | None:
    """The pod's hosts file, written at ``path`` with its fixed lines. A pod on the host's
    network sees the machine's own (None), or with ``dnsPolicy: ClusterFirstWithHostNet``
    (it asks the cluster's DNS) the machine's lines, and the Services' names after them."""
    spec = pod.get("spec") or {}
    if spec.get("hostNetwork"):
        if spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
            return None
        return HostsFile(path, Path("/etc/hosts").read_text().splitlines())
    return HostsFile(path, fixed_lines(pod, ip, socket.gethostname()))


# ------------------------------------------------------------------ the peers
@dataclass
class _Follower:
    namespace: str
    service: str
    ip: str
    hosts: HostsFile


@dataclass
class _Service:
    """What the directory knows of one Service: its slices by name, and whether it is
    headless (None: not looked up since its slices' owner last changed)."""

    slices: dict[str, Manifest] = field(default_factory=dict)
    owner: str = ""
    headless: bool | None = None


class PeerDirectory:
    """One kubelet's view of the cluster's EndpointSlices, kept by a watch of its own as
    the tier's DNS identity (``client``: a new API client as that identity), which rewrites
    the hosts files of the pods that follow a Service whenever its slices change.

    ``problems``: where a bug of its thread is reported (the kubelet's list)."""

    def __init__(self, name: str, client: Callable[[], httpx.Client], problems: list[str]) -> None:
        self.name = name
        self.last_error: str | None = None  # the watch's last failure, for diagnosis
        self._client = client
        self._problems = problems
        self._lock = threading.Lock()
        self._services: dict[tuple[str, str], _Service] = {}
        self._followers: dict[str, _Follower] = {}  # by pod uid
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._api: httpx.Client | None = None

    def start(self) -> None:
        self._api = self._client()
        self._thread = threading.Thread(target=self._watch, name=f"names-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=0.2)  # it ends within WATCH_TIMEOUT_S by itself
        if self._api is not None:
            self._api.close()

    def follow(self, uid: str, pod: Manifest, ip: str, hosts: HostsFile) -> None:
        """Keeps the pod's hosts file in step with its namespace's Services from now on:
        its subdomain's pods, and the names of the Services with a cluster IP."""
        subdomain = str((pod.get("spec") or {}).get("subdomain") or "")
        follower = _Follower(str(pod["metadata"]["namespace"]), subdomain, ip, hosts)
        if self._api is not None and subdomain:
            self._check_headless(self._api, (follower.namespace, subdomain))
        with self._lock:
            self._followers[uid] = follower
            self._rewrite(follower.namespace)

    def forget(self, uid: str) -> None:
        """No more writes to the pod's hosts file once this returns."""
        with self._lock:
            self._followers.pop(uid, None)

    # -------------------------------------------------------------- the watch
    def _watch(self) -> None:
        try:
            with self._client() as api:
                version = ""
                while not self._stopped.is_set():
                    try:
                        if not version:
                            version = self._list(api)
                        version = self._follow(api, version)
                    except httpx.HTTPError as e:
                        self.last_error = f"{type(e).__name__}: {e}"
                        version = ""
                        self._stopped.wait(RETRY_S)
        except BaseException:
            self._problems.append(f"{self.name} peer directory: {traceback.format_exc()}")
            raise

    def _list(self, api: httpx.Client) -> str:
        r = api.get(SLICES)
        r.raise_for_status()
        listed = r.json()
        seen: dict[tuple[str, str], dict[str, Manifest]] = {}
        for piece in listed.get("items") or []:
            key = _service_of(piece)
            if key is not None:
                seen.setdefault(key, {})[piece["metadata"]["name"]] = piece
        with self._lock:
            for key in set(self._services) | set(seen):
                self._services.setdefault(key, _Service()).slices = seen.get(key, {})
        for key in seen:
            self._check_headless(api, key)
        with self._lock:
            for namespace in {namespace for namespace, _ in self._services}:
                self._rewrite(namespace)
        return str(listed["metadata"]["resourceVersion"])

    def _follow(self, api: httpx.Client, version: str) -> str:
        """Watches from ``version`` until the server ends the watch; the last version
        seen, or "" when the history is gone (list again)."""
        params = {
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = httpx.Timeout(5.0, read=WATCH_TIMEOUT_S + 10.0)
        with api.stream("GET", SLICES, params=params, timeout=timeout) as response:
            if response.status_code == 410:
                return ""
            response.raise_for_status()
            for line in response.iter_lines():
                if self._stopped.is_set():
                    return version
                if not line.strip():
                    continue
                event: dict[str, Any] = json.loads(line)
                kind, piece = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return ""
                version = str(piece.get("metadata", {}).get("resourceVersion", version))
                if kind != "BOOKMARK":
                    self._observe(api, str(kind), piece)
        return version

    def _observe(self, api: httpx.Client, kind: str, piece: Manifest) -> None:
        key = _service_of(piece)
        if key is None:
            return
        name = str(piece["metadata"]["name"])
        with self._lock:
            service = self._services.setdefault(key, _Service())
            if kind == "DELETED":
                service.slices.pop(name, None)
            else:
                service.slices[name] = piece
        self._check_headless(api, key)
        with self._lock:
            self._rewrite(key[0])

    def _check_headless(self, api: httpx.Client, key: tuple[str, str]) -> None:
        """Looks the Service up where its slices name an owner whose kind is not known yet:
        only a headless Service's pods have DNS records of their own."""
        with self._lock:
            service = self._services.setdefault(key, _Service())
            owner = _owner(service.slices.values())
            if not owner or (service.headless is not None and service.owner == owner):
                return  # no slices (nothing to answer), or known
        namespace, name = key
        try:
            r = api.get(f"/api/v1/namespaces/{namespace}/services/{name}")
        except httpx.HTTPError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            return  # looked up again at its slices' next change
        found = r.json() if r.status_code == 200 else {}
        if str(found.get("metadata", {}).get("uid", "")) != owner:
            # Missing, or a newer Service of that name whose own slices are still to come.
            self.last_error = f"service {namespace}/{name}: {r.status_code}, not owner {owner}"
            return
        with self._lock:
            service.owner = owner
            service.headless = (found.get("spec") or {}).get("clusterIP") == "None"

    def _rewrite(self, namespace: str) -> None:
        """Under the lock: the lines of every pod in ``namespace``, which resolve its
        subdomain's pods and every Service with a cluster IP there."""
        answers: list[str] = []
        peers: dict[str, list[Manifest]] = {}
        for (ns, name), service in self._services.items():
            slices = list(service.slices.values())
            if ns != namespace or service.owner != _owner(slices) or service.headless is None:
                continue
            if service.headless:
                peers[name] = slices
            elif (line := service_line(ns, name, slices)) is not None:
                answers.append(line)
        for uid, follower in self._followers.items():
            if follower.namespace != namespace:
                continue
            own = peers.get(follower.service)
            headless = peer_lines(namespace, follower.service, own, follower.ip) if own else []
            lines = [*headless, *answers]
            try:
                follower.hosts.follow(lines)
            except OSError:
                # A bug (a pod's file removed before it was forgotten) or a broken disk:
                # reported, and the other pods' files are still kept.
                self._problems.append(f"{self.name} hosts of pod {uid}: {traceback.format_exc()}")


def _service_of(piece: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = piece.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return None if not service else (str(meta.get("namespace")), str(service))


def _owner(slices: Iterable[Manifest]) -> str:
    """The uid of the Service that owns the slices ("" where none names one)."""
    for piece in slices:
        for ref in (piece.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == "Service":
                return str(ref.get("uid", ""))
    return ""
