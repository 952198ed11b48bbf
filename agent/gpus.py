"""Where an agent's GPUs come from, and which node each belongs to.

- real NVML: every GPU of this machine, on this one node;
- declared nodes served by the fake NVML library (a machine without GPUs: the demo and
  the tests): the agent writes the library's control file from ``declared_nodes`` and
  loads it, so inventory, samples, XIDs and metrics take the same NVML code path;
- declared only (``nvml = "off"``): the inventory as declared, no samples.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..recovery.nvml import GpuInfo, Nvml, NvmlUnavailable

if TYPE_CHECKING:
    from ..recovery.fake_nvml import FakeGpu


DECLARED_UUID_NAMESPACE = uuid.UUID("6c1f2a56-55a5-4b6e-9d0e-9f2b0c9a4d11")


def declared_gpu_uuid(node: str, index: int) -> str:
    """A stable, made-up GPU UUID for a declared GPU (same node and index, same UUID)."""
    return f"GPU-{uuid.uuid5(DECLARED_UUID_NAMESPACE, f'{node}/{index}')}"


def declared_mig_uuid(node: str, index: int, slice_index: int) -> str:
    """A stable, made-up UUID for MIG slice ``slice_index`` of a declared GPU."""
    return f"MIG-{uuid.uuid5(DECLARED_UUID_NAMESPACE, f'{node}/{index}/mig/{slice_index}')}"


def mig_memory_bytes(profile: str) -> int:
    """Memory of a MIG profile from its name: "3g.40gb" → 40 GB (10 GB if it says none)."""
    size = re.search(r"(\d+)gb", profile.lower())
    return int(size.group(1)) * 10**9 if size else 10 * 10**9


def declared_inventory(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The registration body for declared nodes: {name, zone, gpu_type, gpus: N, ...}."""
    inventory = []
    for spec in nodes:
        missing = {"name", "zone", "gpu_type", "gpus"} - spec.keys()
        if missing:
            raise ValueError(
                f"declared node {spec.get('name', spec)!r} lacks {', '.join(sorted(missing))}"
            )
        count = int(spec["gpus"])
        memory = int(spec.get("gpu_memory_bytes", 80 * 10**9))
        inventory.append(
            {
                "name": spec["name"],
                "cluster": spec.get("cluster", "local"),
                "zone": spec["zone"],
                "gpu_type": spec["gpu_type"],
                "cpus": float(spec.get("cpus", os.cpu_count() or 1)),
                "memory_bytes": int(spec.get("memory_bytes", 0)),
                "labels": dict(spec.get("labels", {})),
                "gpus": _declared_devices(spec, count, memory),
            }
        )
    return inventory


def _declared_devices(spec: Mapping[str, Any], count: int, memory: int) -> list[dict[str, Any]]:
    """A declared node's devices: its GPUs, or with ``"mig": [profiles]`` each GPU's slices."""
    devices: list[dict[str, Any]] = []
    for index in range(count):
        pci = f"00000000:{0x10 + index:02X}:00.0"
        if not spec.get("mig"):
            devices.append(
                {
                    "uuid": declared_gpu_uuid(spec["name"], index),
                    "index": index,
                    "pci_bus_id": pci,
                    "memory_bytes": memory,
                }
            )
            continue
        for j, profile in enumerate(spec["mig"]):
            devices.append(
                {
                    "uuid": declared_mig_uuid(spec["name"], index, j),
                    "index": len(devices),
                    "pci_bus_id": pci,
                    "memory_bytes": mig_memory_bytes(profile),
                    "gpu_type": f"{spec['gpu_type']}:{profile}",
                }
            )
    return devices


@dataclass(frozen=True)
class NodePlace:
    """Where a GPU's node sits in the fleet."""

    name: str
    cluster: str
    zone: str
    gpu_type: str
    labels: Mapping[str, str]


def gpu_type_of(model: str, memory_bytes: int, names: Mapping[str, str]) -> str:
    """The fleet's GPU type for an NVML model name: from ``names``, else derived.

    "NVIDIA A100-SXM4-80GB" → "A100-80GB"; "NVIDIA H100 80GB HBM3" → "H100-80GB".
    """
    if model in names:
        return names[model]
    base = model.removeprefix("NVIDIA ").split()[0].split("-")[0]
    size = re.search(r"(\d+)\s*GB", model)
    gigabytes = int(size.group(1)) if size else round(memory_bytes / 10**9)
    return f"{base}-{gigabytes}GB"


def whole_gpus(inventory: Sequence[GpuInfo]) -> dict[str, GpuInfo]:
    """UUID → whole GPU, for samples and metrics (which are per GPU, not per MIG slice)."""
    whole: dict[str, GpuInfo] = {}
    for gpu in inventory:
        if gpu.parent_uuid is None:
            whole[gpu.uuid] = gpu
        elif gpu.parent_uuid not in whole:
            whole[gpu.parent_uuid] = GpuInfo(
                uuid=gpu.parent_uuid,
                index=gpu.index,
                name=gpu.name.split(" MIG ")[0],
                pci_bus_id=gpu.pci_bus_id,
                memory_total_bytes=0,
            )
    return whole


def nodes_body(
    gpus: Sequence[GpuInfo], place_of: Mapping[str, NodePlace], cpus: float, memory: int
) -> list[dict[str, Any]]:
    """The registration body: GPUs grouped under the node each belongs to."""
    nodes: dict[str, dict[str, Any]] = {}
    for gpu in gpus:
        # A MIG slice sits where its GPU sits, as a GPU type of its own.
        place = place_of.get(gpu.parent_uuid or gpu.uuid)
        if place is None:
            continue
        node = nodes.setdefault(
            place.name,
            {
                "name": place.name,
                "cluster": place.cluster,
                "zone": place.zone,
                "gpu_type": place.gpu_type,
                "cpus": cpus,
                "memory_bytes": memory,
                "labels": dict(place.labels),
                "gpus": [],
            },
        )
        entry: dict[str, Any] = {
            "uuid": gpu.uuid,
            "index": len(node["gpus"]),
            "pci_bus_id": gpu.pci_bus_id,
            "memory_bytes": gpu.memory_total_bytes,
        }
        if gpu.mig_profile:
            entry["gpu_type"] = f"{place.gpu_type}:{gpu.mig_profile}"
        node["gpus"].append(entry)
    return list(nodes.values())


def declared_fake_gpus(declared: Sequence[Mapping[str, Any]]) -> list[FakeGpu]:
    """The fake NVML devices for the declared nodes, in declaration order."""
    from ..recovery.fake_nvml import FakeGpu, FakeMig

    gpus: list[FakeGpu] = []
    for spec in declared:
        for i in range(int(spec["gpus"])):
            gpus.append(
                FakeGpu(
                    uuid=declared_gpu_uuid(spec["name"], i),
                    index=len(gpus),
                    pci_bus_id=f"00000000:{0x10 + len(gpus):02X}:00.0",
                    memory_total_bytes=int(spec.get("gpu_memory_bytes", 80 * 10**9)),
                    mig_devices=[
                        FakeMig(
                            declared_mig_uuid(spec["name"], i, j),
                            profile,
                            mig_memory_bytes(profile),
                        )
                        for j, profile in enumerate(spec.get("mig", []))
                    ],
                )
            )
    return gpus


def start_fake_nvml(declared: Sequence[Mapping[str, Any]], directory: Path) -> Nvml:
    """Build and load the fake NVML library serving the declared GPUs; returns a session.

    The control file ``<directory>/control`` is written afresh; tests (and a curious
    operator) change it to set utilisation, lose a GPU or deliver an XID.
    """
    from ..recovery import fake_nvml

    directory.mkdir(parents=True, exist_ok=True)
    library = fake_nvml.build(directory)
    control = directory / "control"
    fake_nvml.write_control(control, declared_fake_gpus(declared))
    fake_nvml.load_in_process(library, control)
    return Nvml()


def try_real_nvml() -> Nvml | None:
    try:
        nvml = Nvml()
    except NvmlUnavailable:
        return None
    if not nvml.inventory():
        nvml.close()
        return None
    return nvml
