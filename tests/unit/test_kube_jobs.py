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
    status = 403

    def __init__(self, api: Any) -> None:
        pass

    async def patch_namespaced_pod(
        self, name: str, namespace: str, body: dict[str, Any], **options: Any
    ) -> None:
        Refusing.patched.append((name, body, options["_content_type"]))
        raise ApiException(status=Refusing.status, reason="Forbidden")


@pytest.mark.parametrize(("status", "reported"), [(403, True), (500, False)])
async def test_a_kept_pod_the_cluster_refuses_to_patch_fails_so_the_whole_gang_restarts(
    monkeypatch: pytest.MonkeyPatch, status: int, reported: bool
) -> None:
    """RBAC or admission refusing the patch stands: the pod is reported failed
    (``CreateRefused``) and the job restarts whole. A passing failure is tried again by
    the next pass instead."""
    from kubernetes_asyncio import client

    monkeypatch.setattr(client, "CoreV1Api", Refusing)
    Refusing.patched, Refusing.status = [], status
    config = Config()
    config.KubeJobs.image = "lab:1"
    manager = loop(config).managers["cluster-a"]
    kept, new = placed(0, started=True, created_attempt=2), placed(1)
    await manager._keep((9, 3), 0, "gf-job-9-a2-0", [kept, new], 29500, "10.0.0.9")
    [(name, body, content_type)] = Refusing.patched
    assert (name, content_type) == ("gf-job-9-a2-0", "application/merge-patch+json")
    assert body["metadata"]["labels"]["gpufleet.io/attempt"] == "3"
    assert '"master_addr": "10.0.0.9"' in body["metadata"]["annotations"]["gpufleet.io/assignment"]
    if reported:
        [report] = manager.refusals
        assert (report.pod_index, report.state, report.cause, report.attempt) == (
            0,
            "failed",
            "CreateRefused",
            3,
        )
        assert "refused to keep pod gf-job-9-a2-0" in report.reason
    else:
        assert manager.refusals == []
