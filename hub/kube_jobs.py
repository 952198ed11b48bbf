"""Training jobs on the fleet's Kubernetes clusters, as one of the controller's loops: a
cluster manager per cluster (``clusters/kube_jobs.py``) passes over its job pods every
``interval`` seconds, and at once when the scheduler placed, stopped or restarted a job.
Only the controller holding the database lease acts: the others keep their clients open
and wait (docs/kubernetes.md, "Training jobs").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Bool, Dict, Float, Integer, List, Tuple, Unicode
from traitlets.config import Configurable

from ..clusters.job_manifests import DEFAULT_JOB_PRIORITY_CLASS, S3Checkpoints
from ..clusters.kube_config import ClusterSettings
from ..clusters.kube_jobs import ClusterJobs, JobPodSettings
from ..clusters.manifests import KUBE_DNS, Volume
from ..clusters.network_peers import ClusterNetwork, address_endpoint, egress_endpoints
from ..scheduler.errors import SchedulerError
from ..state.clusters import ClusterInventoryStore
from ..state.jobs import JobStore
from .components import LoopComponent
from .notifier import Notifier


class KubeJobState(Protocol):
    """The repositories the managers read their clusters' nodes from and sync their pods
    with (``FleetStore``'s)."""

    jobs: JobStore
    clusters: ClusterInventoryStore


class KubeJobs(LoopComponent):
    """The cluster managers of every configured cluster's training jobs."""

    image = Unicode(
        "",
        help="The container image of job pods: the sessions' image, so a job runs with what "
        "its session had (its python, gpufleet's SDK, torch). Empty: jobs placed on a "
        "Kubernetes cluster fail to start, saying so.",
    ).tag(config=True)

    python = Unicode(
        "/opt/session/bin/python",
        help="The interpreter of a job's ranks in the image, where the submission names "
        "none (one submitted from a session names its own, sys.executable; one from the "
        "CLI or the SDK outside a session names none). The default is the sessions' "
        "image's (helm/images/session).",
    ).tag(config=True)

    interval = Float(
        2.0,
        help="Seconds between passes over each cluster's job pods (a placement, stop or "
        "restart starts one at once).",
    ).tag(config=True)

    start_deadline_seconds = Float(
        180.0,
        help="A job's pods not all running this long after they were created (an image "
        "that cannot be pulled, a node that refuses them) are deleted whole, and the job "
        "goes back to the queue with the reason: no gang ever runs, or holds GPUs, in part.",
    ).tag(config=True)

    keep_pod_seconds = Float(
        30.0,
        help="How long a pod of a gang whose torchrun failed waits to be kept for the "
        "job's next attempt before it ends. When a pod of a gang is lost (deleted, evicted, "
        "its node lost), the restart keeps the others where they run and places only the "
        "lost one again (docs/kubernetes.md, 'What a restart keeps'); their ranks fail "
        "meanwhile, and this is how long their pods wait to be told. A rank's own error "
        "in a job of several pods is reported this much later.",
    ).tag(config=True)

    priority_class = Unicode(
        DEFAULT_JOB_PRIORITY_CLASS,
        help="The PriorityClass of job pods. Create it with preemptionPolicy: Never "
        "(docs/kubernetes.md): gpufleet decides preemption, kube-scheduler never does.",
    ).tag(config=True)

    memory_limit = Unicode(
        "",
        help="Each job pod's memory limit (a quantity such as 64Gi; empty: none). A pod "
        "past it is killed by the kernel, and gpufleet reports the job out of memory.",
    ).tag(config=True)

    cpu_limit = Unicode("", help="Each job pod's CPU limit (empty: none).").tag(config=True)

    volumes = List(
        Dict(),
        help="Volumes of every job pod, as c.KubeGPUSpawner.session_volumes: {name, "
        "mount_path, kind: pvc|hostPath|emptyDir, source, sub_path, read_only, medium, "
        "size_limit}; {username} in source and sub_path is the job's user.",
    ).tag(config=True)

    rendezvous_ports = Tuple(
        Integer(),
        Integer(),
        default_value=(29500, 29500),
        help="The first and last port torchrun's master listens on. One port serves any "
        "number of jobs where every pod has its own network (Kubernetes); a range lets "
        "jobs share one network.",
    ).tag(config=True)

    rendezvous_timeout_seconds = Integer(
        600,
        help="How long pods other than the master wait for its port before the pod fails "
        "with a message naming what it waited for.",
    ).tag(config=True)

    progress_url = Unicode(
        "",
        help="Where a job pod's ranks report progress and checkpoints: the node agent's "
        "progress port on the pod's own node, written with $(GPUFLEET_HOST_IP) (the node's "
        "address), e.g. http://$(GPUFLEET_HOST_IP):9207/progress. Empty: no progress "
        "(no hang detection, no resume from a checkpoint) for jobs on Kubernetes.",
    ).tag(config=True)

    network_hub = Dict(
        help="The hub's API as job pods reach it: {cidr} or {pod_labels, namespace_labels}, "
        "and {ports}. Default: the host and port of the hub's API URL.",
    ).tag(config=True)

    network_controller = Dict(
        help="gpufleet's controller as job pods reach it, as network_hub. Default: the "
        "host and port of the controller's own URL.",
    ).tag(config=True)

    network_egress = List(
        Dict(),
        help="Other places job pods may reach, each {cidr} or {pod_labels, "
        "namespace_labels} with {ports}: the S3 endpoint of checkpoints, the node agents' "
        "progress port, a package mirror.",
    ).tag(config=True)

    network_dns = Bool(
        True, help="Let job pods reach kube-dns in kube-system (UDP and TCP 53)."
    ).tag(config=True)

    checkpoint_credentials_secret = Unicode(
        "",
        help="For jobs whose checkpoints are in S3 (c.FleetController.job_checkpoint_store "
        "= 's3://...'): a Secret in each cluster's jobs namespace holding every user's own "
        "S3 keys, scoped by the admin to that user's prefix, under <user>.access_key and "
        "<user>.secret_key (<user>: the user's KubeSpawner slug, as in home volume paths). "
        "A job pod gets its user's alone, as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. "
        "Empty: such jobs are refused on Kubernetes, saying so.",
    ).tag(config=True)

    checkpoint_s3_endpoint = Unicode(
        "", help="The S3 endpoint of checkpoints for job pods (AWS_ENDPOINT_URL); empty: AWS."
    ).tag(config=True)

    checkpoint_s3_region = Unicode(
        "us-east-1", help="The S3 region of checkpoints for job pods (AWS_DEFAULT_REGION)."
    ).tag(config=True)

    def __init__(
        self,
        clusters: Sequence[ClusterSettings],
        store: KubeJobState,
        *,
        now: Callable[[], datetime],
        kick: Callable[[], None],
        notifier: Notifier,
        hub_url: str,
        controller_url: str,
        lost_nodes: Callable[[], Mapping[str, str]] = dict,
        on_restart: Callable[[str], None] = lambda fault: None,
        parent: Configurable | None = None,
        **kwargs: Any,
    ):
        super().__init__(parent=parent, **kwargs)
        self.store = store
        self.kick = kick
        self.notifier = notifier
        self.on_restart = on_restart  # a job's next attempt began, for this fault class
        self.managers = {
            c.name: ClusterJobs(
                c,
                store,
                self.pod_settings(hub_url, controller_url, c.network),
                now=now,
                lost_nodes=lost_nodes,
                log=self.log,
            )
            for c in clusters
        }

    def pod_settings(
        self, hub_url: str, controller_url: str, own: ClusterNetwork | None = None
    ) -> JobPodSettings:
        """Every job pod's settings on a cluster whose own peers are ``own`` (each over
        this component's network option where given)."""
        own = own or ClusterNetwork()
        volumes = tuple(Volume(**dict(v)) for v in self.volumes)
        egress = self.network_egress if own.job_egress is None else own.job_egress
        return JobPodSettings(
            image=self.image,
            python=self.python,
            hub=address_endpoint(
                hub_url,
                "c.KubeJobs.network_hub or the cluster's network.hub",
                own.hub,
                self.network_hub,
            ),
            controller=address_endpoint(
                controller_url,
                "c.KubeJobs.network_controller or the cluster's network.controller",
                own.controller,
                self.network_controller,
            ),
            dns=KUBE_DNS if self.network_dns else None,
            extra_egress=egress_endpoints(egress),
            priority_class_name=self.priority_class,
            memory_limit=self.memory_limit or None,
            cpu_limit=self.cpu_limit or None,
            volumes=volumes,
            rendezvous_ports=(int(self.rendezvous_ports[0]), int(self.rendezvous_ports[1])),
            rendezvous_timeout_s=self.rendezvous_timeout_seconds,
            start_deadline_s=self.start_deadline_seconds,
            progress_url=self.progress_url,
            keep_wait_s=self.keep_pod_seconds,
            s3=(
                S3Checkpoints(
                    self.checkpoint_credentials_secret,
                    self.checkpoint_s3_endpoint,
                    self.checkpoint_s3_region,
                )
                if self.checkpoint_credentials_secret
                else None
            ),
        )

    async def start(self) -> None:
        for manager in self.managers.values():
            await manager.start()

    async def close(self) -> None:
        for manager in self.managers.values():
            await manager.close()

    async def run(self, is_leader: Callable[[], bool]) -> None:
        """A pass over every cluster whenever a workload changed (a placement, a stop, a
        restart: what wakes the node agents' long polls) and every ``interval``."""
        again = False
        while True:
            if not again:
                await self.notifier.wait_for_any_change(self.interval)
            again = False
            if not is_leader():
                continue
            passes = await asyncio.gather(
                *(self._pass(name, manager) for name, manager in self.managers.items())
            )
            changed = [workload for ids, _ in passes for workload in ids]
            if changed:
                self.notifier.changed(changed)
            if changed or any(released for _, released in passes):
                self.kick()  # GPUs went back, or a job goes back to the queue
            # A restart that kept pods placed the lost ones in this pass's own sync: the
            # next pass makes them at once (this loop's own changes do not wake it).
            restarts = [f for manager in self.managers.values() for f in manager.restarted]
            for fault in restarts:
                self.on_restart(fault)
            again = bool(restarts)

    async def _pass(self, cluster: str, manager: ClusterJobs) -> tuple[list[int], bool]:
        try:
            nodes = await asyncio.to_thread(self.store.clusters.node_names, cluster)
            return await manager.run_pass(nodes)
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("cluster %s: the pass over its job pods failed", cluster)
            return [], False
