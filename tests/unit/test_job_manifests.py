"""The objects of a job's attempt on Kubernetes (``clusters/job_manifests.py``): literal
results, the API's schemas (``kubernetes-validate --strict``), who may reach the pods (the
pure NetworkPolicy evaluator, over the namespace's policy and the gang's together), what a
job of one pod is made of, and refusals that say what to fix."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from gpufleet.clusters.job_manifests import (
    INLINE_SCRIPT_BYTES,
    JobGang,
    S3Checkpoints,
    gang_config_map,
    gang_network_policy,
    gang_objects,
    gang_pod,
    gang_service,
    jobs_network_policy,
    keep_patch,
    launcher_config_map,
    launcher_config_map_name,
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
        s3=S3Checkpoints("gpufleet-s3", user_key="ann-example-org"),
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
                "gpufleet.io/script": "print('hi')\n",
                "gpufleet.io/assignment": (
                    '{"attempt": 2, "marker": "5f0c3b6a.1", "master_addr": '
                    '"p0.gf-job-12-a2.gpufleet.svc.cluster.local", "master_port": 29500, '
                    '"resume_from": "s3://ckpt/jobs/ann/resnet/step-100"}'
                ),
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
                        {
                            "name": "GPUFLEET_POD_NAME",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
                            },
                        },
                        {
                            "name": "GPUFLEET_POD_NAMESPACE",
                            "valueFrom": {
                                "fieldRef": {
                                    "apiVersion": "v1",
                                    "fieldPath": "metadata.namespace",
                                }
                            },
                        },
                        {"name": "GPUFLEET_CONTAINER_NAME", "value": "torchrun"},
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
                        {"name": "GPUFLEET_KEEP_WAIT_S", "value": "30"},
                        {
                            "name": "GPUFLEET_PROGRESS_URL",
                            "value": "http://$(GPUFLEET_HOST_IP):9207/progress",
                        },
                        {
                            "name": "AWS_ACCESS_KEY_ID",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": "gpufleet-s3",
                                    "key": "ann-example-org.access_key",
                                }
                            },
                        },
                        {
                            "name": "AWS_SECRET_ACCESS_KEY",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": "gpufleet-s3",
                                    "key": "ann-example-org.secret_key",
                                }
                            },
                        },
                        {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"},
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
                    "projected": {
                        "defaultMode": 0o444,
                        "sources": [
                            {"configMap": {"name": launcher_config_map_name()}},
                            {
                                "downwardAPI": {
                                    "items": [
                                        {
                                            "path": "train.py",
                                            "fieldRef": {
                                                "apiVersion": "v1",
                                                "fieldPath": (
                                                    "metadata.annotations['gpufleet.io/script']"
                                                ),
                                            },
                                        },
                                        {
                                            "path": "assignment",
                                            "fieldRef": {
                                                "apiVersion": "v1",
                                                "fieldPath": (
                                                    "metadata.annotations['gpufleet.io/assignment']"
                                                ),
                                            },
                                        },
                                    ]
                                }
                            },
                        ],
                    },
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


def test_the_launcher_is_one_config_map_named_after_its_content() -> None:
    made = launcher_config_map("gpufleet")
    assert made["metadata"]["name"] == launcher_config_map_name()
    assert launcher_config_map_name().startswith("gf-job-launcher-")
    assert made["data"] == {"gpufleet-launch.py": launcher_text()}
    assert "def wait_for_port" in made["data"]["gpufleet-launch.py"]
    # Not a gang's: the cluster manager never takes it for an attempt's leftover.
    assert made["metadata"]["labels"]["app.kubernetes.io/component"] == "job-shared"


def test_the_jobs_policy_is_named_after_what_it_allows() -> None:
    def named(*egress: Endpoint) -> str:
        made = jobs_network_policy(
            "gpufleet", hub=HUB, controller=CONTROLLER, extra_egress=list(egress)
        )
        assert made["metadata"]["labels"]["app.kubernetes.io/component"] == "job-shared"
        return str(made["metadata"]["name"])

    assert named(S3) == named(S3) and named(S3).startswith("gf-jobs-")
    assert named(S3) != named()  # other settings: another policy, the old one deleted


def test_a_job_of_one_pod_is_that_pod_alone() -> None:
    alone = gang(nodes=("a-gpu-1",))
    assert gang_objects(alone) == []
    pod = gang_pod(alone, 0)
    assert "hostname" not in pod["spec"] and "subdomain" not in pod["spec"]
    assert "ports" not in pod["spec"]["containers"][0]  # its torchrun picks its own port
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["GPUFLEET_PODS"] == "1" and env["GPUFLEET_MASTER_ADDR"] == "localhost"
    assert pod["metadata"]["annotations"]["gpufleet.io/script"] == "print('hi')\n"
    assert "gpufleet.io/assignment" not in pod["metadata"]["annotations"]  # nothing to keep
    assert "GPUFLEET_KEEP_WAIT_S" not in env
    assert [o["kind"] for o in gang_objects(gang())] == ["Service", "NetworkPolicy"]


def test_a_script_too_large_for_an_annotation_goes_in_a_config_map() -> None:
    script = "x = 1\n" * (INLINE_SCRIPT_BYTES // 6 + 1)
    large = gang(nodes=("a-gpu-1",), script=script)
    [config_map] = gang_objects(large)
    assert config_map == gang_config_map(large)
    assert config_map["metadata"]["name"] == "gf-job-12-a2"
    assert config_map["data"] == {"train.py": script}
    pod = gang_pod(large, 0)
    assert "gpufleet.io/script" not in pod["metadata"]["annotations"]
    sources = pod["spec"]["volumes"][0]["projected"]["sources"]
    assert sources == [
        {"configMap": {"name": launcher_config_map_name()}},
        {"configMap": {"name": "gf-job-12-a2"}},
    ]
    at_the_limit = gang(script="é" * (INLINE_SCRIPT_BYTES // 2))  # bytes, not characters
    assert gang_objects(replace(at_the_limit, nodes=("a-gpu-1",))) == []
    over = gang(nodes=("a-gpu-1",), script="é" * (INLINE_SCRIPT_BYTES // 2) + "x")
    assert [o["kind"] for o in gang_objects(over)] == ["ConfigMap"]


def _policies() -> list[dict[str, Any]]:
    namespace = jobs_network_policy("gpufleet", hub=HUB, controller=CONTROLLER, extra_egress=[S3])
    return [namespace, gang_network_policy(gang())]


OWN = {"gpufleet.io/workload": "12", "gpufleet.io/attempt": "2"}
JOB = {"app.kubernetes.io/managed-by": "gpufleet", "app.kubernetes.io/component": "job"}


def allows(direction: str, remote: Remote, port: int, own: dict[str, str] = OWN) -> bool:
    return policy_allows(
        _policies(),
        namespace="gpufleet",
        pod_labels={**JOB, **own, "gpufleet.io/pod-index": "0"},
        direction=direction,  # type: ignore[arg-type]
        remote=remote,
        port=port,
    )


def pod(**labels: str) -> Remote:
    return Remote(ip="10.1.0.9", namespace="gpufleet", pod_labels=labels)


def test_the_gangs_pods_reach_each_other_and_the_platform_but_no_one_else() -> None:
    own = pod(**JOB, **OWN)
    assert allows("ingress", own, 29500)
    assert allows("ingress", own, 41234)  # the collectives' own ports
    assert allows("egress", own, 29500)
    for stranger in (
        pod(**JOB, **{"gpufleet.io/workload": "13", "gpufleet.io/attempt": "2"}),
        pod(**JOB, **{"gpufleet.io/workload": "12", "gpufleet.io/attempt": "1"}),  # before
    ):
        assert not allows("ingress", stranger, 29500)
        assert not allows("egress", stranger, 29500)
    assert allows("egress", Remote(ip="10.0.0.5"), 8081)
    assert allows("egress", Remote(ip="10.0.0.6"), 8090)
    assert allows("egress", Remote(ip="10.0.0.7"), 8333)
    assert not allows("egress", Remote(ip="169.254.169.254"), 80)
    assert not allows("egress", Remote(ip="10.0.0.5"), 22)
    assert not allows("ingress", Remote(ip="10.0.0.5"), 29500)


def test_a_pod_of_a_job_without_a_gang_policy_reaches_only_the_platform() -> None:
    alone = {"gpufleet.io/workload": "14", "gpufleet.io/attempt": "1"}
    other = pod(**JOB, **OWN)
    assert not allows("ingress", other, 29500, own=alone)
    assert not allows("egress", other, 29500, own=alone)
    assert allows("egress", Remote(ip="10.0.0.6"), 8090, own=alone)
    assert not allows("egress", Remote(ip="169.254.169.254"), 80, own=alone)


ALL = {
    "pod 0": lambda: gang_pod(gang(), 0),
    "pod 1": lambda: gang_pod(gang(), 1),
    "service": lambda: gang_service(gang()),
    "one pod alone": lambda: gang_pod(gang(nodes=("a-gpu-1",)), 0),
    "config map": lambda: gang_config_map(gang()),
    "launcher": lambda: launcher_config_map("gpufleet"),
    "network policy": lambda: gang_network_policy(gang()),
    "jobs network policy": lambda: _policies()[0],
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
        (
            {"s3": None},
            "no credentials for it: name the Secret .* c.KubeJobs.checkpoint_credentials_secret",
        ),
    ],
)
def test_bad_input_is_refused_with_what_to_fix(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        gang(**changes)


def test_a_pod_of_a_job_checkpointing_to_s3_gets_its_own_user_s_keys_from_the_secret() -> None:
    s3 = S3Checkpoints("gpufleet-s3", "http://s3.storage:8333", "eu-west-1", user_key="ann")
    pod = gang_pod(gang(checkpoint_uri="s3://ckpt/jobs/ann/12", s3=s3), 0)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "gpufleet-s3", "key": "ann.access_key"}
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "gpufleet-s3", "key": "ann.secret_key"}
    }
    assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://s3.storage:8333"
    # Checkpoints on a volume: no S3 keys reach the pod, even where the fleet has them.
    local = gang_pod(gang(checkpoint_uri="/checkpoints/ann/12", s3=s3), 0)
    names = {e["name"] for e in local["spec"]["containers"][0]["env"]}
    assert not {n for n in names if n.startswith("AWS_")}


def test_a_pod_index_outside_the_gang_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of the gang's 2 pods"):
        gang_pod(gang(), 2)


def test_a_pod_kept_into_the_next_attempt_is_told_it_by_its_labels_and_assignment() -> None:
    """Pod 0 of attempt 2 was kept; attempt 3's pod 1 is new. The kept pod's patch moves it
    into attempt 3 (its Service and policy select it) under its new marker, and both pods'
    assignments name the kept master by its address."""
    after = gang(attempt=3, marker="77aa", kept=frozenset({0}), master_addr="10.1.2.3")
    patch = keep_patch(after, 0)
    assert patch == {
        "metadata": {
            "labels": {"gpufleet.io/attempt": "3", "gpufleet.io/marker": "77aa.0"},
            "annotations": {
                "gpufleet.io/marker": "77aa.0",
                "gpufleet.io/assignment": after.assignment(0),
            },
        }
    }
    told = json.loads(after.assignment(0))
    assert told == {
        "attempt": 3,
        "marker": "77aa.0",
        "master_addr": "10.1.2.3",
        "master_port": 29500,
        "resume_from": "s3://ckpt/jobs/ann/resnet/step-100",
    }
    new = gang_pod(after, 1)
    assert json.loads(new["metadata"]["annotations"]["gpufleet.io/assignment"])["attempt"] == 3
    env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
    assert env["GPUFLEET_MASTER_ADDR"] == "10.1.2.3"
    with pytest.raises(ValueError, match="kept pods"):
        gang(kept=frozenset({2}))
