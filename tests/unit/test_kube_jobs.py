"""The training jobs' loop on Kubernetes (``hub/kube_jobs.py``) and its cluster managers'
gangs (``clusters/kube_jobs.py``): options with their defaults, what a gang is made of from
the store's pods, refusals that say what to fix, and a kept pod's patch."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from traitlets.config import Config

from gpufleet.clusters.gang_plan import plan_pass
from gpufleet.clusters.kube_config import ClusterSettings
from gpufleet.clusters.manifests import Endpoint, Peer, Volume
from gpufleet.hub.kube_jobs import KubeJobs
from gpufleet.hub.notifier import Notifier
from gpufleet.state.jobs import DesiredPod

CLUSTER = ClusterSettings(name="cluster-a", kubeconfig="/dev/null", namespace="jobs")


def loop(config: Config | None = None) -> KubeJobs:
    return KubeJobs(
        [CLUSTER],
        store=None,  # type: ignore[arg-type]  # nothing here reaches the store
        now=lambda: datetime.now(UTC),
        kick=lambda: None,
        notifier=Notifier(),
        hub_url="http://10.0.0.5:8081/hub/api",
        controller_url="http://10.0.0.6:8090/services/gpufleet/",
        config=config or Config(),
    )


def placed(index: int, **changes: Any) -> DesiredPod:
    fields: dict[str, Any] = dict(
        workload_id=9,
        pod_index=index,
        pods=2,
        gpus_per_pod=4,
        node=f"a-gpu-{index + 1}",
        gpu_uuids=(),
        marker="abc",
        run=True,
        started=False,
        username="ann@example.org",
        name="bert",
        spec={"python": "/opt/conda/bin/python", "script": "print(1)\n", "grace_s": 45},
        account={"uid": 1500, "gid": 1500, "mode": "system"},
        attempt=3,
        project="nlp",
    )
    fields.update(changes)
    return DesiredPod(**fields)


def test_the_defaults_make_job_pods_that_reach_the_hub_and_the_controller() -> None:
    settings = loop().pod_settings("http://10.0.0.5:8081/hub/api", "http://10.0.0.6:8090/")
    assert settings.rendezvous_ports == (29500, 29500)
    assert settings.hub == Endpoint(Peer(cidr="10.0.0.5/32"), (8081,))
    assert settings.controller == Endpoint(Peer(cidr="10.0.0.6/32"), (8090,))
    assert settings.start_deadline_s == 180.0 and settings.image == ""


def test_the_options_reach_every_gang() -> None:
    config = Config()
    config.KubeJobs.image = "lab:1"
    config.KubeJobs.memory_limit = "64Gi"
    config.KubeJobs.rendezvous_ports = (30000, 30009)
    config.KubeJobs.volumes = [
        {
            "name": "home",
            "kind": "hostPath",
            "source": "/homes/{username}",
            "mount_path": "/home/jovyan",
        }
    ]
    config.KubeJobs.network_egress = [{"cidr": "10.0.0.7/32", "ports": [8333]}]
    manager = loop(config).managers["cluster-a"]
    gang = manager.gang_of([placed(1), placed(0)], 30002)
    assert (gang.name, gang.namespace, gang.nodes) == (
        "gf-job-9-a3",
        "jobs",
        ("a-gpu-1", "a-gpu-2"),
    )
    assert (gang.uid, gang.gid, gang.grace_seconds, gang.project) == (1500, 1500, 45, "nlp")
    assert (gang.image, gang.memory_limit, gang.rendezvous_port) == ("lab:1", "64Gi", 30002)
    # The homes the user's sessions mount: KubeSpawner's slug of the name.
    assert gang.volumes == (
        Volume("home", "/home/jovyan", "hostPath", "/homes/ann-example-org---438c4c7a"),
    )
    assert manager.settings.extra_egress == (Endpoint(Peer(cidr="10.0.0.7/32"), (8333,)),)


def test_a_cluster_s_own_peers_win_over_the_options_for_its_job_pods() -> None:
    config = Config()
    config.KubeJobs.network_egress = [{"cidr": "10.0.0.7/32", "ports": [8333]}]
    remote = ClusterSettings(
        name="cluster-b",
        kubeconfig="/dev/null",
        network={
            "hub": {"cidr": "10.20.0.10/32", "ports": [443]},
            "job_egress": [{"cidr": "10.20.0.20/32", "ports": [9000]}],
        },
    )
    jobs = KubeJobs(
        [CLUSTER, remote],
        store=None,  # type: ignore[arg-type]  # nothing here reaches the store
        now=lambda: datetime.now(UTC),
        kick=lambda: None,
        notifier=Notifier(),
        hub_url="http://10.0.0.5:8081/hub/api",
        controller_url="http://10.0.0.6:8090/services/gpufleet/",
        config=config,
    )
    here, there = (jobs.managers[name].settings for name in ("cluster-a", "cluster-b"))
    assert here.hub == Endpoint(Peer(cidr="10.0.0.5/32"), (8081,))
    assert here.extra_egress == (Endpoint(Peer(cidr="10.0.0.7/32"), (8333,)),)
    assert there.hub == Endpoint(Peer(cidr="10.20.0.10/32"), (443,))
    assert there.controller == here.controller  # not its own: the fleet-wide one
    assert there.extra_egress == (Endpoint(Peer(cidr="10.20.0.20/32"), (9000,)),)


def test_a_hub_known_by_a_service_name_is_allowed_as_its_peer_option_says() -> None:
    """In a cluster the hub is a Service name, which no policy can name: the option's peer
    stands for it, and without one the error says which option to give."""
    config = Config()
    config.KubeJobs.network_hub = {"pod_labels": {"app": "hub"}, "ports": [8081]}
    settings = loop(config).pod_settings(
        "http://gf-gpufleet-hub.gpufleet.svc:8081/hub/api", "http://10.0.0.6:8090/"
    )
    assert settings.hub == Endpoint(Peer(pod_labels={"app": "hub"}), (8081,))
    with pytest.raises(ValueError, match=r"give c\.KubeJobs\.network_hub"):
        loop().pod_settings("http://gf-gpufleet-hub.gpufleet.svc:8081/hub/api", "http://x/")


def test_a_job_checkpointing_to_s3_reads_its_user_s_keys_by_the_user_s_slug() -> None:
    config = Config()
    config.KubeJobs.image = "lab:1"
    config.KubeJobs.checkpoint_credentials_secret = "gpufleet-s3"
    config.KubeJobs.checkpoint_s3_endpoint = "http://10.0.0.7:8333"
    s3_spec = {"python": "/opt/conda/bin/python", "checkpoint_uri": "s3://ckpt/jobs/ann/9"}
    pods = [placed(0, spec=s3_spec), placed(1, spec=s3_spec)]
    gang = loop(config).managers["cluster-a"].gang_of(pods, 29500)
    assert gang.s3 is not None
    assert (gang.s3.secret, gang.s3.user_key) == ("gpufleet-s3", "ann-example-org---438c4c7a")
    assert gang.s3.endpoint == "http://10.0.0.7:8333"
    # Without the Secret, such a job cannot be made on Kubernetes, and says what to set.
    del config.KubeJobs.checkpoint_credentials_secret
    with pytest.raises(ValueError, match=r"c\.KubeJobs\.checkpoint_credentials_secret"):
        loop(config).managers["cluster-a"].gang_of(pods, 29500)


@pytest.mark.parametrize(
    ("image", "pods", "says"),
    [
        ("", [placed(0), placed(1)], "no image is configured for job pods"),
        ("lab:1", [placed(0)], "1 of the job's 2 pods are placed here"),
        ("lab:1", [placed(0, account=None), placed(1, account=None)], "no account"),
        ("lab:1", [placed(0, spec={"python": "python3"}), placed(1)], "not an absolute path"),
    ],
)
def test_a_gang_that_cannot_be_made_says_why(image: str, pods: list[DesiredPod], says: str) -> None:
    config = Config()
    config.KubeJobs.image = image
    with pytest.raises(ValueError, match=says):
        loop(config).managers["cluster-a"].gang_of(pods, 29500)


class PoliciesOfANamespace:
    """The jobs' NetworkPolicies a namespace holds, as the Kubernetes client lists them."""

    def __init__(self, *names: str) -> None:
        self.names = list(names)
        self.selectors: list[str] = []

    async def list_namespaced_network_policy(
        self, namespace: str, label_selector: str, **_: Any
    ) -> Any:
        self.selectors.append(label_selector)
        return SimpleNamespace(
            items=[SimpleNamespace(metadata=SimpleNamespace(name=n)) for n in self.names]
        )

    async def delete_namespaced_network_policy(self, name: str, namespace: str, **_: Any) -> None:
        self.names.remove(name)


async def test_the_jobs_policies_of_settings_before_go_once_the_current_one_is_made() -> None:
    manager = loop().managers["cluster-a"]
    # The current one, one made with another egress, and one that is not the jobs' at all.
    policies = PoliciesOfANamespace("gf-jobs-0123456789ab", "gf-jobs-ba9876543210", "other")
    await manager._delete_older_jobs_policies(policies, "gf-jobs-0123456789ab")
    assert policies.names == ["gf-jobs-0123456789ab", "other"]
    assert policies.selectors == [
        "app.kubernetes.io/component=job-shared,app.kubernetes.io/managed-by=gpufleet"
    ]


class Refusing:
    """A CoreV1Api whose API server answers a pod's patch with ``status``."""

    patched: list[tuple[str, dict[str, Any], str]] = []
    deleted: list[str] = []
    status = 403

    def __init__(self, api: Any) -> None:
        pass

    async def patch_namespaced_pod(
        self, name: str, namespace: str, body: dict[str, Any], **options: Any
    ) -> None:
        Refusing.patched.append((name, body, options["_content_type"]))
        raise ApiException(status=Refusing.status, reason="Forbidden")

    async def delete_namespaced_pod(self, name: str, namespace: str, **_: Any) -> None:
        Refusing.deleted.append(name)


@pytest.mark.parametrize(("status", "refused"), [(403, True), (500, False)])
async def test_a_kept_pod_the_cluster_refuses_to_patch_is_deleted_so_the_whole_gang_restarts(
    monkeypatch: pytest.MonkeyPatch, status: int, refused: bool
) -> None:
    """RBAC or admission refusing the patch stands: the pod, which still runs, is deleted
    and reported (``CreateRefused``) only once gone, so its GPUs never go back under it.
    A passing failure is tried again by the next pass instead."""
    from kubernetes_asyncio import client

    monkeypatch.setattr(client, "CoreV1Api", Refusing)
    Refusing.patched, Refusing.deleted, Refusing.status = [], [], status
    config = Config()
    config.KubeJobs.image = "lab:1"
    manager = loop(config).managers["cluster-a"]
    kept, new = placed(0, started=True, created_attempt=2), placed(1)
    await manager._keep((9, 3), 0, "gf-job-9-a2-0", [kept, new], 29500, "10.0.0.9")
    [(name, body, content_type)] = Refusing.patched
    assert (name, content_type) == ("gf-job-9-a2-0", "application/merge-patch+json")
    assert body["metadata"]["labels"]["gpufleet.io/attempt"] == "3"
    assert '"master_addr": "10.0.0.9"' in body["metadata"]["annotations"]["gpufleet.io/assignment"]
    assert manager.refusals == []  # nothing is reported of a pod that still runs
    if refused:
        assert Refusing.deleted == ["gf-job-9-a2-0"]
        assert manager.memory.ending == {"gf-job-9-a2-0": "CreateRefused"}
        manager.memory.created_at[(9, 3)] = 0.0  # pod 1 was made in the pass before
        gone = plan_pass([kept, new], [], [], [], manager.memory, 1.0, 60.0)
        [report, _] = gone.reports
        assert (report.pod_index, report.cause, report.attempt) == (0, "CreateRefused", 3)
        assert "pod gf-job-9-a2-0 could not be kept" in report.reason
    else:
        assert Refusing.deleted == [] and not manager.memory.ending


def test_a_refused_gang_does_not_report_the_pod_it_kept_which_still_runs() -> None:
    manager = loop().managers["cluster-a"]
    kept, new = placed(0, started=True, created_attempt=2), placed(1)
    manager._refuse((9, 3), [kept, new], "cluster cluster-a refused the job's pods (403)")
    assert [(r.pod_index, r.cause) for r in manager.refusals] == [(1, "CreateRefused")]


class Answering:
    """A CoreV1Api whose API server answers a pod listing with ``status``."""

    status = 403

    def __init__(self, api: Any) -> None:
        pass

    async def list_namespaced_pod(self, namespace: str, **_: Any) -> Any:
        status = Answering.status

        class Response:
            reason = "Forbidden"

            def __init__(self) -> None:
                self.status = status

            async def __aenter__(self) -> Any:
                return self

            async def __aexit__(self, *_: Any) -> None:
                return None

            async def read(self) -> bytes:
                return b'{"kind": "Status", "message": "forbidden"}'

        return Response()


async def test_a_pod_listing_the_server_refuses_is_no_listing_not_a_cluster_without_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read unchecked, a 403 would be an empty list, and every running pod would seem
    deleted."""
    from kubernetes_asyncio import client

    monkeypatch.setattr(client, "CoreV1Api", Answering)
    manager = loop().managers["cluster-a"]
    assert await manager._list() is None
