"""The node agent: the controller's eyes and hands on a GPU node.

This first version reports the node's inventory and a heartbeat. On a machine without
GPUs the inventory is the one declared in the config (``c.NodeAgent.declared_nodes``),
with stable made-up UUIDs, so the whole flow runs on a laptop and in CI. The NVML
inventory, GPU samples and the process runner come with the node agent issue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import uuid
from typing import Any

import httpx
from traitlets import Dict, Float, List, Unicode, default
from traitlets.config import Application

from .. import __version__

DECLARED_UUID_NAMESPACE = uuid.UUID("6c1f2a56-55a5-4b6e-9d0e-9f2b0c9a4d11")


def declared_gpu_uuid(node: str, index: int) -> str:
    """A stable, made-up GPU UUID for a declared GPU (same node and index, same UUID)."""
    return f"GPU-{uuid.uuid5(DECLARED_UUID_NAMESPACE, f'{node}/{index}')}"


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
                "gpus": [
                    {
                        "uuid": declared_gpu_uuid(spec["name"], index),
                        "index": index,
                        "pci_bus_id": f"00000000:{0x10 + index:02X}:00.0",
                        "memory_bytes": memory,
                    }
                    for index in range(count)
                ],
            }
        )
    return inventory


class NodeAgent(Application):
    name = "gpufleet-agent"
    version = __version__
    description = "The gpufleet node agent (one per GPU node)."

    config_file = Unicode(
        help="The JupyterHub configuration file that also configures gpufleet. "
        "Defaults to $GPUFLEET_CONFIG, else ./jupyterhub_config.py.",
    ).tag(config=True)

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get("GPUFLEET_CONFIG", "jupyterhub_config.py")

    aliases = {"config": "NodeAgent.config_file", "log-level": "Application.log_level"}

    controller_api_url = Unicode(
        help="The controller's API; set by gpufleet.hub.setup.configure as "
        "$GPUFLEET_CONTROLLER_API_URL.",
    ).tag(config=True)

    @default("controller_api_url")
    def _default_controller_api_url(self) -> str:
        return os.environ.get("GPUFLEET_CONTROLLER_API_URL", "")

    api_token = Unicode(
        help="The agent's token; JupyterHub gives a managed service $JUPYTERHUB_API_TOKEN."
    ).tag(config=True)

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    declared_nodes = List(
        Dict(),
        help="""Nodes this agent reports when it has no NVML GPUs: [{"name": "node-a",
        "cluster": "local", "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4,
        "labels": {...}}]. GPU UUIDs are made up and stable.""",
    ).tag(config=True)

    heartbeat_interval = Float(
        5.0, help="Seconds between heartbeats; keep it well under node_heartbeat_timeout."
    ).tag(config=True)

    node_name = Unicode(help="This node's name when it reports real GPUs.").tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return socket.gethostname()

    def initialize(self, argv: list[str] | None = None) -> None:
        self.parse_command_line(argv)
        path = os.path.abspath(self.config_file)
        if not os.path.exists(path):
            print(f"{self.name}: configuration file {path} does not exist", file=sys.stderr)
            self.exit(1)
        self.load_config_file(path)
        self.parse_command_line(argv)
        if not self.controller_api_url:
            print(
                f"{self.name}: no controller URL; set c.NodeAgent.controller_api_url",
                file=sys.stderr,
            )
            self.exit(1)
        self.inventory = declared_inventory(self.declared_nodes)

    async def _post(self, client: httpx.AsyncClient, path: str, body: Any) -> dict[str, Any]:
        response = await client.post(f"{self.controller_api_url}{path}", json=body)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    async def run(self) -> None:
        headers = {"Authorization": f"token {self.api_token}"}
        registered = False
        async with httpx.AsyncClient(headers=headers, timeout=10) as client:
            while True:
                try:
                    if not registered:
                        await self._post(client, "/agent/register", {"nodes": self.inventory})
                        registered = True
                        self.log.info(
                            "registered %d node(s) with the controller", len(self.inventory)
                        )
                    else:
                        answer = await self._post(
                            client,
                            "/agent/heartbeat",
                            {"nodes": [n["name"] for n in self.inventory]},
                        )
                        registered = not answer["unknown"]
                except httpx.HTTPError as e:
                    self.log.warning("controller unreachable (%s); retrying", e)
                    await asyncio.sleep(min(self.heartbeat_interval, 1.0))
                    continue
                await asyncio.sleep(self.heartbeat_interval if registered else 0.2)

    def start(self) -> None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(self.run())


def main(argv: list[str] | None = None) -> None:
    app = NodeAgent.instance()
    app.initialize(argv if argv is not None else sys.argv[1:])
    app.start()


if __name__ == "__main__":
    main()
