"""The training jobs' loop on Kubernetes (``hub/kube_jobs.py``) and its cluster managers'
gangs (``clusters/kube_jobs.py``): options with their defaults, what a gang is made of from
the store's pods, and refusals that say what to fix."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
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
