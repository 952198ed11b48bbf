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


@dataclass(frozen=True)
class NodePlace:
    """Where a GPU's node sits in the fleet (and, when declared, its CPUs and memory)."""

    name: str
    cluster: str
    zone: str
    gpu_type: str
    labels: Mapping[str, str]
    cpus: float | None = None  # None: this machine's
    memory_bytes: int | None = None


@dataclass(frozen=True)
class _DeclaredGpu:
    node: Mapping[str, Any]
    index: int  # across every declared node, as the fake library numbers them
    uuid: str
    pci_bus_id: str  # on its node
    memory_bytes: int
    slices: tuple[tuple[str, str, int], ...]  # (uuid, MIG profile, memory)


def _declared(nodes: Sequence[Mapping[str, Any]]) -> list[_DeclaredGpu]:
    """Every declared GPU with its made-up, stable identity; checks the declarations."""
    gpus: list[_DeclaredGpu] = []
    for spec in nodes:
        missing = {"name", "zone", "gpu_type", "gpus"} - spec.keys()
        if missing:
            raise ValueError(
                f"declared node {spec.get('name', spec)!r} lacks {', '.join(sorted(missing))}"
            )
        for i in range(int(spec["gpus"])):
            gpus.append(
                _DeclaredGpu(
                    node=spec,
                    index=len(gpus),
                    uuid=declared_gpu_uuid(spec["name"], i),
                    pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",  # as on its own node
                    memory_bytes=int(spec.get("gpu_memory_bytes", 80 * 10**9)),
                    slices=tuple(
                        (declared_mig_uuid(spec["name"], i, j), profile, mig_memory_bytes(profile))
                        for j, profile in enumerate(spec.get("mig", []))
                    ),
                )
            )
    return gpus


def declared_places(nodes: Sequence[Mapping[str, Any]]) -> dict[str, NodePlace]:
    """GPU UUID → its declared node's place."""
    return {
        gpu.uuid: NodePlace(
            gpu.node["name"],
            gpu.node.get("cluster", "local"),
            gpu.node["zone"],
            gpu.node["gpu_type"],
            dict(gpu.node.get("labels", {})),
            cpus=float(gpu.node["cpus"]) if "cpus" in gpu.node else None,
            memory_bytes=int(gpu.node["memory_bytes"]) if "memory_bytes" in gpu.node else None,
        )
        for gpu in _declared(nodes)
    }


def declared_gpus(nodes: Sequence[Mapping[str, Any]]) -> list[GpuInfo]:
    """The declared devices as NVML would describe them: whole GPUs, or their MIG slices."""
    model = "NVIDIA A100-SXM4-80GB"  # the fake library's default model name
    devices: list[GpuInfo] = []
    for gpu in _declared(nodes):
        if not gpu.slices:
            devices.append(GpuInfo(gpu.uuid, gpu.index, model, gpu.pci_bus_id, gpu.memory_bytes))
        devices.extend(
            GpuInfo(
                uuid,
                gpu.index,
                f"{model} MIG {profile}",
                gpu.pci_bus_id,
                memory,
                parent_uuid=gpu.uuid,
                mig_profile=profile,
            )
            for uuid, profile, memory in gpu.slices
        )
    return devices


def declared_inventory(nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The registration body for declared nodes without NVML (``nvml = "off"``): the same
    body the fake library's inventory gives."""
    return nodes_body(
        declared_gpus(nodes),
        declared_places(nodes),
        float(os.cpu_count() or 1),
        machine_memory_bytes(),
    )


def machine_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


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
                "cpus": place.cpus if place.cpus is not None else cpus,
                "memory_bytes": place.memory_bytes if place.memory_bytes is not None else memory,
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

    return [
        FakeGpu(
            uuid=gpu.uuid,
            index=gpu.index,
            # One library serves every declared node: bus ids must differ across them.
            pci_bus_id=f"00000000:{0x10 + gpu.index:02X}:00.0",
            memory_total_bytes=gpu.memory_bytes,
            mig_devices=[FakeMig(uuid, profile, memory) for uuid, profile, memory in gpu.slices],
        )
        for gpu in _declared(declared)
    ]


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
