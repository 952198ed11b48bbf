"""The objects of a job's attempt on Kubernetes (``clusters/job_manifests.py``): literal
results, the API's schemas (``kubernetes-validate --strict``), who may reach the pods (the
pure NetworkPolicy evaluator) and refusals that say what to fix."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from gpufleet.clusters.job_manifests import (
    JobGang,
    gang_config_map,
    gang_network_policy,
    gang_pod,
    gang_service,
    launcher_text,
)
from gpufleet.clusters.manifests import Endpoint, Peer

from .netpol import Remote, policy_allows

OLDEST_K8S = "1.25"
NEWEST_K8S = kubernetes_validate.latest_version()
HUB = Endpoint(Peer(cidr="10.0.0.5/32"), (8081,))
CONTROLLER = Endpoint(Peer(cidr="10.0.0.6/32"), (8090,))
S3 = Endpoint(Peer(cidr="10.0.0.7/32"), (8333,))


def gang(**changes: Any) -> JobGang:
    fields: dict[str, Any] = dict(
        workload_id=12,
        attempt=2,
        job_name="resnet",
        user="ann@example.org",
        project="vision",
        marker="5f0c3b6a",
        cluster="cluster-a",
        namespace="gpufleet",
        nodes=("a-gpu-1", "a-gpu-2"),
        image="gpufleet/session:1",
        python="/opt/conda/bin/python",
        script_name="train.py",
        script="print('hi')\n",
        args=("--epochs", "$HOME"),
        env={"WANDB_MODE": "offline"},
        checkpoint_uri="s3://ckpt/jobs/ann/resnet",
        resume_from="s3://ckpt/jobs/ann/resnet/step-100",
        rendezvous_port=29500,
        uid=1001,
        gid=1001,
        gpus_per_pod=2,
        memory_limit="64Gi",
        progress_url="http://$(GPUFLEET_HOST_IP):9207/progress",
    )
    fields.update(changes)
    return JobGang(**fields)


LABELS = {
    "app.kubernetes.io/managed-by": "gpufleet",
    "app.kubernetes.io/component": "job",
    "gpufleet.io/workload": "12",
    "gpufleet.io/attempt": "2",
    "gpufleet.io/user": "ann_40example.org",
    "gpufleet.io/project": "vision",
    "gpufleet.io/cluster": "cluster-a",
}


def test_pod_1_of_a_gang_is_pinned_to_its_node_and_names_the_master() -> None:
    pod = gang_pod(gang(), 1)
    assert pod == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "gf-job-12-a2-1",
            "namespace": "gpufleet",
            "labels": {
                **LABELS,
                "gpufleet.io/pod-index": "1",
                "gpufleet.io/marker": "5f0c3b6a.1",
            },
            "annotations": {
                "gpufleet.io/user": "ann@example.org",
                "gpufleet.io/project": "vision",
                "gpufleet.io/marker": "5f0c3b6a.1",
            },
        },
        "spec": {
            "hostname": "p1",
            "subdomain": "gf-job-12-a2",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": ["a-gpu-2"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "priorityClassName": "gpufleet-job",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1001,
                "runAsGroup": 1001,
                "fsGroup": 1001,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "torchrun",
                    "image": "gpufleet/session:1",
                    "command": [
                        "/opt/conda/bin/python",
                        "/var/run/gpufleet/job/gpufleet-launch.py",
                    ],
                    "args": ["--epochs", "$$HOME"],
                    "env": [
                        {
                            "name": "GPUFLEET_POD_IP",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}
                            },
                        },
                        {
                            "name": "GPUFLEET_HOST_IP",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}
                            },
                        },
                        {"name": "GPUFLEET_WORKLOAD_ID", "value": "12"},
                        {"name": "GPUFLEET_SESSION_MARKER", "value": "5f0c3b6a.1"},
                        {"name": "GPUFLEET_JOB_ID", "value": "12"},
                        {"name": "GPUFLEET_JOB_NAME", "value": "resnet"},
                        {"name": "GPUFLEET_POD_INDEX", "value": "1"},
                        {"name": "GPUFLEET_PODS", "value": "2"},
                        {"name": "GPUFLEET_GPUS_PER_POD", "value": "2"},
                        {
                            "name": "GPUFLEET_MASTER_ADDR",
                            "value": "p0.gf-job-12-a2.gpufleet.svc.cluster.local",
                        },
                        {"name": "GPUFLEET_MASTER_PORT", "value": "29500"},
                        {"name": "GPUFLEET_RENDEZVOUS_TIMEOUT", "value": "600"},
                        {"name": "GPUFLEET_SCRIPT", "value": "/var/run/gpufleet/job/train.py"},
                        {"name": "GPUFLEET_CHECKPOINT_URI", "value": "s3://ckpt/jobs/ann/resnet"},
                        {"name": "GPUFLEET_ATTEMPT", "value": "2"},
                        {
                            "name": "GPUFLEET_RESUME_FROM",
                            "value": "s3://ckpt/jobs/ann/resnet/step-100",
                        },
                        {"name": "PYTHONUNBUFFERED", "value": "1"},
                        {
                            "name": "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
                            "value": "[gpufleet rank $${rank}]:",
                        },
                        {
                            "name": "GPUFLEET_PROGRESS_URL",
                            "value": "http://$(GPUFLEET_HOST_IP):9207/progress",
                        },
                        {"name": "WANDB_MODE", "value": "offline"},
                    ],
                    "resources": {
                        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
                        "requests": {"memory": "64Gi", "nvidia.com/gpu": "2"},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": False,
                    },
                    "volumeMounts": [
                        {
                            "name": "gpufleet-job",
                            "mountPath": "/var/run/gpufleet/job",
                            "readOnly": True,
                        }
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
            "volumes": [
                {
                    "name": "gpufleet-job",
                    "configMap": {"name": "gf-job-12-a2", "defaultMode": 0o444},
                }
            ],
        },
    }


def test_only_the_master_pod_declares_the_rendezvous_port() -> None:
    master = gang_pod(gang(), 0)["spec"]["containers"][0]
    assert master["ports"] == [{"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}]
    assert "ports" not in gang_pod(gang(), 1)["spec"]["containers"][0]


def test_the_service_names_every_pod_before_it_is_ready() -> None:
    assert gang_service(gang()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "gf-job-12-a2",
            "namespace": "gpufleet",
            "labels": LABELS,
            "annotations": {"gpufleet.io/user": "ann@example.org", "gpufleet.io/project": "vision"},
        },
        "spec": {
            "clusterIP": "None",
            "selector": {"gpufleet.io/workload": "12", "gpufleet.io/attempt": "2"},
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "rendezvous", "port": 29500, "targetPort": 29500, "protocol": "TCP"}
            ],
        },
    }


def test_the_config_map_holds_the_script_and_the_launcher() -> None:
    data = gang_config_map(gang())["data"]
    assert data == {"gpufleet-launch.py": launcher_text(), "train.py": "print('hi')\n"}
    assert "def wait_for_port" in data["gpufleet-launch.py"]


def _policy() -> dict[str, Any]:
    return gang_network_policy(gang(), hub=HUB, controller=CONTROLLER, extra_egress=[S3])


OWN = {"gpufleet.io/workload": "12", "gpufleet.io/attempt": "2"}


def allows(direction: str, remote: Remote, port: int) -> bool:
    return policy_allows(
        [_policy()],
        namespace="gpufleet",
        pod_labels={**OWN, "gpufleet.io/pod-index": "0"},
        direction=direction,  # type: ignore[arg-type]
        remote=remote,
        port=port,
    )


def pod(**labels: str) -> Remote:
    return Remote(ip="10.1.0.9", namespace="gpufleet", pod_labels=labels)


def test_the_gangs_pods_reach_each_other_and_the_platform_but_no_one_else() -> None:
    own = pod(**OWN)
    assert allows("ingress", own, 29500)
    assert allows("ingress", own, 41234)  # the collectives' own ports
    assert allows("egress", own, 29500)
    for stranger in (
        pod(**{"gpufleet.io/workload": "13", "gpufleet.io/attempt": "2"}),
        pod(**{"gpufleet.io/workload": "12", "gpufleet.io/attempt": "1"}),  # the attempt before
    ):
        assert not allows("ingress", stranger, 29500)
        assert not allows("egress", stranger, 29500)
    assert allows("egress", Remote(ip="10.0.0.5"), 8081)
    assert allows("egress", Remote(ip="10.0.0.6"), 8090)
    assert allows("egress", Remote(ip="10.0.0.7"), 8333)
    assert not allows("egress", Remote(ip="169.254.169.254"), 80)
    assert not allows("egress", Remote(ip="10.0.0.5"), 22)
    assert not allows("ingress", Remote(ip="10.0.0.5"), 29500)


ALL = {
    "pod 0": lambda: gang_pod(gang(), 0),
    "pod 1": lambda: gang_pod(gang(), 1),
    "service": lambda: gang_service(gang()),
    "config map": lambda: gang_config_map(gang()),
    "network policy": _policy,
}


@pytest.mark.parametrize("version", [OLDEST_K8S, NEWEST_K8S])
@pytest.mark.parametrize("which", sorted(ALL))
def test_every_object_validates_strictly(which: str, version: str) -> None:
    assert version.startswith(kubernetes_validate.validate(ALL[which](), version, strict=True))


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"uid": 0}, "never run as root"),
        ({"python": "python3"}, "not an absolute path"),
        ({"script_name": "../x.py"}, "not a plain file name"),
        ({"script_name": "gpufleet-launch.py"}, "launcher"),
        ({"env": {"GPUFLEET_POD_INDEX": "0"}}, "set by gpufleet"),
        ({"nodes": ()}, "at least one pod"),
        ({"memory_limit": "lots"}, "not a Kubernetes quantity"),
        ({"gpus_per_pod": 0}, "each pod holds a GPU"),
    ],
)
def test_bad_input_is_refused_with_what_to_fix(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        gang(**changes)


def test_a_pod_index_outside_the_gang_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of the gang's 2 pods"):
        gang_pod(gang(), 2)
