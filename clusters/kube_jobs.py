"""The cluster manager of training jobs on one Kubernetes cluster: the store's placements in,
pods on the cluster out, what the pods do back into the store.

It is, for its cluster's nodes, what the node agent is on the local backend: each pass it
reads the pods the store asks for there (``JobStore.desired_pods(..., kubernetes=True)``),
lists the cluster's job pods, lets the pure :func:`~.gang_plan.plan_pass` decide, does what
it decided (create gangs whole, delete pods with their grace period, delete the shared
objects of attempts that are over) and syncs the pods' reports and the leftovers found gone
(``JobStore.agent_sync(..., kubernetes=True)``), exactly as an agent reports its processes.
So the attempts, the failure classifier, the retry budget and the GPUs' release are the
local backend's, unchanged.

Creating a gang: what its pods share (``job_manifests.gang_objects``: nothing for a job
of one pod), then every pod at once. If the API server refuses any of them (admission,
RBAC, quota, a bad field), whatever was made is deleted at once and the gang's pods are
reported failed with the server's words (``CreateRefused``): nothing of it runs or holds
GPUs, and the job goes back to the queue within its retry budget with that reason. What
every job pod of the namespace shares (the launcher's ConfigMap, the jobs' NetworkPolicy)
is made on the manager's first pass, and made again before a gang, at most once a minute,
should someone delete it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from ..state.jobs import DesiredPod, JobStore, PodReport
from .gang_plan import CREATE_REFUSED, GangMemory, Pass, plan_pass, read_pod
from .job_manifests import (
    ATTEMPT_LABEL,
    JOB_LABELS,
    JOBS_NETWORK_POLICY_PREFIX,
    SHARED_LABELS,
    JobGang,
    S3Checkpoints,
    gang_name,
    gang_objects,
    gang_pod,
    jobs_network_policy,
    keep_patch,
    launcher_config_map,
)
from .kube_config import ClusterSettings, api_client
from .manifests import WORKLOAD_LABEL, Endpoint, Peer, Toleration, Volume

REQUEST_TIMEOUT_S = 15
# How long the namespace's shared objects, once made, are taken to exist without asking.
SHARED_OBJECTS_RECHECK_S = 60.0


class JobsState(Protocol):
    """The repository the manager syncs its cluster's pods with (``FleetStore``'s)."""

    jobs: JobStore


@dataclass(frozen=True)
class JobPodSettings:
    """What every job pod of the fleet's Kubernetes clusters is made with, besides what the
    job and the scheduler say (the hub's ``c.KubeJobs`` options)."""

    image: str
    hub: Endpoint
    controller: Endpoint
    python: str = "/opt/session/bin/python"  # the ranks' interpreter where a job names none
    dns: Peer | None = None
    extra_egress: tuple[Endpoint, ...] = ()
    priority_class_name: str = "gpufleet-job"
    memory_limit: str | None = None
    cpu_limit: str | None = None
    volumes: tuple[Volume, ...] = ()
    tolerations: tuple[Toleration, ...] | None = None  # None: the GPU taint's
    rendezvous_ports: tuple[int, int] = (29500, 29500)  # a range: first, last
    rendezvous_timeout_s: int = 600
    start_deadline_s: float = 120.0
    progress_url: str = ""
    keep_wait_s: float = 30.0
    s3: S3Checkpoints | None = None  # for checkpoints in S3: the users' keys


def _describe(error: BaseException) -> str:
    status = getattr(error, "status", None)
    if status is None:
        return f"{type(error).__name__}: {error}"
    body = getattr(error, "body", "") or ""
    try:
        message = json.loads(body).get("message") or body
    except (ValueError, AttributeError):
        message = body
    return f"{status} {getattr(error, 'reason', '')}: {message}".strip()


class ClusterJobs:
    """One cluster's manager (see the module docstring). ``lost_nodes()`` names the
    cluster's nodes that are not Ready or deleted, with what their cluster says."""

    def __init__(
        self,
        cluster: ClusterSettings,
        store: JobsState,
        settings: JobPodSettings,
        *,
        now: Callable[[], datetime],
        lost_nodes: Callable[[], Mapping[str, str]] = dict,
        log: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ):
        self.cluster = cluster
        self.store = store
        self.settings = settings
        self.now = now
        self.lost_nodes = lost_nodes
        self.log = log or logging.getLogger(__name__)
        self.memory = GangMemory()
        self.api: Any = None
        self.leftovers: list[str] = []  # part markers whose pods must go (the last sync's)
        self.refusals: list[PodReport] = []  # gangs refused since the last sync
        self._shared_made_at: float | None = None  # the namespace's launcher and policy
        self._shared_refused_at: float | None = None
        self.restarted: list[str] = []  # the fault class of each restart of the last pass

    async def start(self) -> None:
        self.api = await api_client(self.cluster)

    async def close(self) -> None:
        if self.api is not None:
            await self.api.close()
            self.api = None

    # ------------------------------------------------------------------ one pass
    async def run_pass(self, node_names: Sequence[str]) -> tuple[list[int], bool]:
        """One pass over the cluster's job pods: the jobs whose visible state changed, and
        whether GPUs held for leftovers went back. A cluster that does not answer is
        skipped whole: nothing is reported of pods that cannot be seen."""
        self.restarted = []
        if self.api is None:
            return [], False
        listed = await self._list()
        if listed is None:
            return [], False
        pods, ports, gangs = listed
        desired = await asyncio.to_thread(self.store.jobs.desired_pods, node_names, True)
        plan = plan_pass(
            desired,
            [p for p in (read_pod(pod) for pod in pods) if p is not None],
            self.leftovers,
            gangs,
            self.memory,
            time.monotonic(),
            self.settings.start_deadline_s,
            self.lost_nodes(),
        )
        await self._act(plan, desired, ports)
        reports = [*self.refusals, *plan.reports]
        self.refusals = []
        result = await asyncio.to_thread(
            self.store.jobs.agent_sync,
            self.now(),
            node_names,
            reports,
            (),
            (),
            plan.gone,
            True,
        )
        self.leftovers = [left.marker for left in result.leftovers]
        self.restarted = list(result.restarted)
        return list(result.changed), bool(result.released)

    async def _list(self) -> tuple[list[dict[str, Any]], dict[str, int], set[str]] | None:
        """The cluster's job pods (as JSON), its gangs' Services (name → rendezvous port)
        and the names of every gang's shared objects; None when it cannot list them."""
        from kubernetes_asyncio import client

        selector = ",".join(f"{k}={v}" for k, v in sorted(JOB_LABELS.items()))
        core: Any = client.CoreV1Api(self.api)
        namespace = self.cluster.namespace
        try:
            response: Any = await core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            async with response:
                # Unread by the client, so unchecked by it: an answer that is no listing
                # must never read as a cluster without pods (each would seem deleted).
                if response.status != 200:
                    raise RuntimeError(f"{response.status} {response.reason}")
                pods = json.loads(await response.read()).get("items") or []
            services, config_maps = await asyncio.gather(
                core.list_namespaced_service(
                    namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
                ),
                core.list_namespaced_config_map(
                    namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
                ),
            )
        except Exception as e:  # noqa: BLE001 - any failure: this pass cannot see the cluster
            self.log.warning("cluster %s: cannot list job pods: %s", self.cluster.name, e)
            return None
        ports = {
            s.metadata.name: int(s.spec.ports[0].port) if s.spec.ports else 0
            for s in services.items
        }
        gangs = set(ports) | {c.metadata.name for c in config_maps.items}
        return pods, ports, gangs

    async def _act(
        self, plan: Pass, desired: Sequence[DesiredPod], ports: Mapping[str, int]
    ) -> None:
        by_gang: dict[tuple[int, int], list[DesiredPod]] = {}
        for want in desired:
            by_gang.setdefault((want.workload_id, want.attempt), []).append(want)
        creating = []
        # Made on the first pass, gangs or none, so a burst of new jobs does not wait for
        # them; and again before creating, at most once a minute.
        first = self._shared_made_at is None and self._shared_refused_at is None
        refused = await self._make_shared_objects() if plan.create or first else ""
        taken = set(ports.values())
        chosen = {gang: ports.get(gang_name(*gang), 0) for gang in by_gang}
        for gang in plan.create:
            if refused:
                self.memory.created_at[gang] = time.monotonic()
                self._refuse(gang, by_gang[gang], refused)
                continue
            port = chosen[gang] = self._free_port(taken)
            if by_gang[gang][0].pods > 1:  # a job of one pod picks its own port
                taken.add(port)
            creating.append(self._create(gang, by_gang[gang], port, plan.masters.get(gang, "")))
        await asyncio.gather(*creating)
        work = [
            self._keep(gang, index, name, by_gang[gang], chosen[gang], plan.masters.get(gang, ""))
            for gang, index, name in plan.keep
            # (no port: its Service is not listed yet; the start deadline covers one lost)
            if gang not in self.memory.refused and chosen[gang]
        ]
        old_launcher = "its launcher, an earlier gpufleet's, cannot follow an assignment"
        work += [self._cannot_keep(name, old_launcher) for name in plan.cannot_keep]
        work += [self._delete_pod(name) for name in plan.delete]
        work += [self._delete_gang_objects(name) for name in plan.orphan_gangs]
        await asyncio.gather(*work)

    async def _make_shared_objects(self) -> str:
        """Make what every job pod of the namespace shares, unless made within the last
        ``SHARED_OBJECTS_RECHECK_S``, then delete the jobs' NetworkPolicies of settings
        before; what the API server refused, in words ('' if none)."""
        from kubernetes_asyncio import client

        made = self._shared_made_at
        if made is not None and time.monotonic() - made < SHARED_OBJECTS_RECHECK_S:
            return ""
        settings = self.settings
        namespace = self.cluster.namespace
        policy = jobs_network_policy(
            namespace,
            hub=settings.hub,
            controller=settings.controller,
            dns=settings.dns,
            extra_egress=settings.extra_egress,
        )
        networking: Any = client.NetworkingV1Api(self.api)
        try:
            await _create_one(
                client.CoreV1Api(self.api).create_namespaced_config_map,
                namespace,
                launcher_config_map(namespace),
            )
            await _create_one(networking.create_namespaced_network_policy, namespace, policy)
        except Exception as e:  # noqa: BLE001 - reported as every gang's reason
            self._shared_refused_at = time.monotonic()
            return (
                f"cluster {self.cluster.name} refused what every job pod needs, the "
                f"launcher's ConfigMap and the jobs' NetworkPolicy ({_describe(e)})"
            )
        self._shared_made_at = time.monotonic()
        await self._delete_older_jobs_policies(networking, policy["metadata"]["name"])
        return ""

    async def _delete_older_jobs_policies(self, networking: Any, current: str) -> None:
        """The jobs' NetworkPolicies made with other settings: they would add what those
        allowed to what the current one allows. Tried again at the next making."""
        namespace = self.cluster.namespace
        selector = ",".join(f"{k}={v}" for k, v in sorted(SHARED_LABELS.items()))
        try:
            listed = await networking.list_namespaced_network_policy(
                namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
            )
            for older in listed.items:
                name = older.metadata.name
                if name.startswith(JOBS_NETWORK_POLICY_PREFIX) and name != current:
                    await networking.delete_namespaced_network_policy(
                        name, namespace, _request_timeout=REQUEST_TIMEOUT_S
                    )
                    self.log.info("cluster %s: deleted jobs' policy %s", self.cluster.name, name)
        except Exception as e:  # noqa: BLE001 - the next making tries again
            self.log.warning(
                "cluster %s: could not delete the jobs' older policies: %s",
                self.cluster.name,
                _describe(e),
            )

    def _free_port(self, taken: set[int]) -> int:
        """The first rendezvous port of the range no live gang of the cluster uses (on a
        real cluster every pod has its own network and a range of one port will do)."""
        first, last = self.settings.rendezvous_ports
        for port in range(first, last + 1):
            if port not in taken:
                return port
        return first  # more gangs than ports: they share it, each pod on its own address

    # ------------------------------------------------------------------ creating
    async def _create(
        self, gang_key: tuple[int, int], wanted: list[DesiredPod], port: int, master: str
    ) -> None:
        """Create the gang whole (but for the pods it keeps from the attempt before), or
        leave nothing of it and report why."""
        from kubernetes_asyncio import client

        self.memory.created_at[gang_key] = time.monotonic()
        try:
            gang = self.gang_of(wanted, port, master)
        except ValueError as e:
            self._refuse(gang_key, wanted, f"gpufleet cannot make the job's pods: {e}")
            return
        core: Any = client.CoreV1Api(self.api)
        networking: Any = client.NetworkingV1Api(self.api)
        creators = {
            "ConfigMap": core.create_namespaced_config_map,
            "Service": core.create_namespaced_service,
            "NetworkPolicy": networking.create_namespaced_network_policy,
        }
        namespace = gang.namespace
        try:
            for shared in gang_objects(gang):
                await _create_one(creators[shared["kind"]], namespace, shared)
            made = await asyncio.gather(
                *(
                    _create_one(core.create_namespaced_pod, namespace, gang_pod(gang, i))
                    for i in range(gang.pods)
                    if i not in gang.kept
                ),
                return_exceptions=True,
            )
            refused = [m for m in made if isinstance(m, BaseException)]
            if refused:
                raise refused[0]
        except Exception as e:  # noqa: BLE001 - reported whole: see _refuse
            await self._delete_gang_objects(gang.name, pods_now=True)
            self._refuse(
                gang_key,
                wanted,
                f"cluster {self.cluster.name} refused the job's pods ({_describe(e)}); "
                "nothing of them was left",
            )
            return
        self.log.info(
            "cluster %s: created job %s attempt %s: %s pod(s) on %s",
            self.cluster.name,
            gang.workload_id,
            gang.attempt,
            gang.pods - len(gang.kept),
            ", ".join(n for i, n in enumerate(gang.nodes) if i not in gang.kept),
        )

    async def _keep(
        self,
        gang_key: tuple[int, int],
        index: int,
        name: str,
        wanted: list[DesiredPod],
        port: int,
        master: str,
    ) -> None:
        """Make a pod kept from an attempt before pod ``index`` of this one: its launcher
        stops the old torchrun and starts this attempt's. The next pass tries again if
        the patch fails for a while; a pod that is gone meanwhile is reported as any pod
        that vanishes. A pod whose patch the API server refuses outright (RBAC,
        admission) is deleted, and reported ``CreateRefused`` once it is gone: the whole
        gang restarts instead."""
        from kubernetes_asyncio import client

        try:
            gang = self.gang_of(wanted, port, master)
            core: Any = client.CoreV1Api(self.api)
            await core.patch_namespaced_pod(
                name,
                self.cluster.namespace,
                keep_patch(gang, index),
                _content_type="application/merge-patch+json",
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - the next pass tries again, or see above
            why = f"cluster {self.cluster.name} refused to keep pod {name} ({_describe(e)})"
            self.log.warning("job %s attempt %s: %s", *gang_key, why)
            if getattr(e, "status", None) in (400, 403, 422):
                await self._cannot_keep(name, why)
            return
        self.log.info(
            "cluster %s: kept pod %s as pod %s of job %s attempt %s",
            self.cluster.name,
            name,
            index,
            *gang_key,
        )

    async def _cannot_keep(self, name: str, why: str) -> None:
        """A pod that cannot be kept is deleted, and reported ``CreateRefused`` once gone
        (``gang_plan._vanished``): until then it runs, and holds its GPUs."""
        self.log.warning("cluster %s: pod %s cannot be kept: %s", self.cluster.name, name, why)
        self.memory.ending[name] = CREATE_REFUSED
        self.memory.deleting.add(name)
        await self._delete_pod(name)

    def _refuse(self, gang: tuple[int, int], wanted: Sequence[DesiredPod], why: str) -> None:
        self.log.warning("job %s attempt %s: %s", gang[0], gang[1], why)
        self.memory.refused[gang] = why
        # A pod kept from the attempt before still runs: it is not reported ended (its GPUs
        # would go back under it) but stopped with the rest of the gang, once the store
        # has the others' failure.
        self.refusals += [
            PodReport(
                w.workload_id,
                w.pod_index,
                "failed",
                reason=why,
                attempt=w.attempt,
                cause=CREATE_REFUSED,
            )
            for w in sorted(wanted, key=lambda w: w.pod_index)
            if not w.kept
        ]

    # ------------------------------------------------------------------ deleting
    async def _delete_pod(self, name: str) -> None:
        """Delete a pod with its own grace period (SIGTERM is the checkpoint signal)."""
        from kubernetes_asyncio import client

        try:
            await client.CoreV1Api(self.api).delete_namespaced_pod(
                name, self.cluster.namespace, _request_timeout=REQUEST_TIMEOUT_S
            )
        except Exception as e:  # noqa: BLE001 - the next pass tries again
            if getattr(e, "status", None) != 404:
                self.memory.deleting.discard(name)
                self.log.warning(
                    "cluster %s: could not delete pod %s: %s", self.cluster.name, name, e
                )

    async def _delete_gang_objects(self, name: str, pods_now: bool = False) -> None:
        """Delete an attempt's ConfigMap, Service and NetworkPolicy (and, when a gang's
        creation failed half-way, the pods it made, at once: none of them ran)."""
        from kubernetes_asyncio import client

        core: Any = client.CoreV1Api(self.api)
        networking: Any = client.NetworkingV1Api(self.api)
        namespace = self.cluster.namespace
        deletions = [
            core.delete_namespaced_config_map(name, namespace, _request_timeout=REQUEST_TIMEOUT_S),
            core.delete_namespaced_service(name, namespace, _request_timeout=REQUEST_TIMEOUT_S),
            networking.delete_namespaced_network_policy(
                name, namespace, _request_timeout=REQUEST_TIMEOUT_S
            ),
        ]
        if pods_now:
            workload, _, attempt = name.removeprefix("gf-job-").partition("-a")
            deletions.append(
                core.delete_collection_namespaced_pod(
                    namespace,
                    label_selector=f"{WORKLOAD_LABEL}={workload},{ATTEMPT_LABEL}={attempt}",
                    grace_period_seconds=0,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
            )
        for outcome in await asyncio.gather(*deletions, return_exceptions=True):
            if isinstance(outcome, BaseException) and getattr(outcome, "status", None) != 404:
                self.log.warning(
                    "cluster %s: could not delete %s's objects: %s",
                    self.cluster.name,
                    name,
                    _describe(outcome),
                )

    # ------------------------------------------------------------------ the gang
    def gang_of(self, wanted: Sequence[DesiredPod], port: int, master: str = "") -> JobGang:
        """The gang of an attempt from the store's pods; ValueError says what is wrong.
        ``master``: the address of its pod 0 where that pod is kept from an attempt before."""
        first = min(wanted, key=lambda w: w.pod_index)
        if len(wanted) != first.pods:
            raise ValueError(f"{len(wanted)} of the job's {first.pods} pods are placed here")
        if not self.settings.image:
            raise ValueError("no image is configured for job pods (c.KubeJobs.image)")
        spec = first.spec
        account = first.account
        if account is None:
            raise ValueError("the job's user has no account (uid) to run its pods as")
        settings = self.settings
        extra: dict[str, Any] = {}
        if settings.tolerations is not None:
            extra["tolerations"] = settings.tolerations
        if settings.s3 is not None:
            extra["s3"] = replace(settings.s3, user_key=_slug(first.username))
        return JobGang(
            workload_id=first.workload_id,
            attempt=first.attempt,
            job_name=first.name,
            user=first.username,
            project=first.project,
            marker=first.marker,
            cluster=self.cluster.name,
            namespace=self.cluster.namespace,
            nodes=tuple(w.node for w in sorted(wanted, key=lambda w: w.pod_index)),
            node_selector=self.cluster.gpu_node_selector,
            image=settings.image,
            python=str(spec.get("python") or settings.python),
            script_name=str(spec.get("script_name") or "train.py"),
            script=str(spec.get("script") or ""),
            args=tuple(str(a) for a in spec.get("args", ())),
            env={str(k): str(v) for k, v in dict(spec.get("env") or {}).items()},
            checkpoint_uri=str(spec.get("checkpoint_uri") or ""),
            resume_from=first.resume_from,
            rendezvous_port=port,
            rendezvous_timeout_s=settings.rendezvous_timeout_s,
            progress_url=settings.progress_url,
            master_addr=master,
            kept=frozenset(w.pod_index for w in wanted if w.kept),
            keep_wait_s=settings.keep_wait_s,
            uid=int(account["uid"]),
            gid=int(account["gid"]),
            gpus_per_pod=first.gpus_per_pod,
            gpu_resource=self.cluster.gpu_resource,
            memory_limit=settings.memory_limit,
            cpu_limit=settings.cpu_limit,
            priority_class_name=settings.priority_class_name,
            grace_seconds=int(float(spec.get("grace_s") or 30)),
            volumes=tuple(_for_user(v, first.username) for v in settings.volumes),
            **extra,
        )


def _slug(username: str) -> str:
    """The user's name as KubeSpawner's default ("safe") slug scheme writes it."""
    from kubespawner.slugs import safe_slug

    return str(safe_slug(username))


def _for_user(volume: Volume, username: str) -> Volume:
    """The volume with ``{username}`` in its source and sub-path filled in as KubeSpawner's
    default ("safe") slug scheme writes it, so a job's pods mount the homes its user's
    sessions mount."""
    slug = _slug(username)
    return replace(
        volume,
        source=volume.source.replace("{username}", slug),
        sub_path=volume.sub_path.replace("{username}", slug),
    )


async def _create_one(create: Callable[..., Any], namespace: str, body: Mapping[str, Any]) -> None:
    """Create one object; one that exists already (a pass before a restart made it) is
    taken as made. The answer is not read into the client's models: nothing here needs
    it, and for a burst of pods that reading is most of the manager's work."""
    from kubernetes_asyncio.client.exceptions import ApiException

    response = await create(
        namespace, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
    )
    async with response:
        if response.status == 409 or 200 <= response.status <= 299:
            return
        refused = ApiException(status=response.status, reason=response.reason)
        refused.body = await response.text()
        raise refused
