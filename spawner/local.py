"""LocalGPUSpawner: JupyterHub's local process spawner behind the gpufleet queue.

The handshake is :mod:`.handshake`'s. Once placed, the server starts with exactly its GPUs
(by UUID, PCI bus order) and the workload marker in its environment. ``stop`` stops the
server, then ends every process that carries the marker (kernels live in sessions of their
own) and only then releases the GPUs. If some process survives SIGKILL the GPUs stay
allocated.

Where the machine allows, the server runs in the session sandbox of
:mod:`gpufleet.snapshotter.sandbox` (``sandbox``): its ``/`` is an overlay whose upper
directory (``<sandbox_dir>/<user>/<server>/upper``, see :mod:`.sandboxing`) collects what the
session changes outside its home, and keeps it across restarts of the same server.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
from tornado import web
from traitlets import Float, Unicode

from ..clusters import workload_processes
from ..snapshotter.runner import SnapshotFailed, Sources
from .client import RequestRejected, WorkloadStatus
from .handshake import (
    GPUQueueSpawner,
    InvalidGPURequest,
)
from .resume import SnapshottingMixin
from .sandboxing import Containment, SandboxedProcessSpawner

__all__ = ["InvalidGPURequest", "LocalGPUSpawner"]


class LocalGPUSpawner(GPUQueueSpawner, SnapshottingMixin, SandboxedProcessSpawner):
    readiness_interval = Float(
        0.02,
        help="Seconds between active readiness probes of a starting server. The hub's own "
        "check backs off; probing here lets the hub find the server up on its first try.",
    ).tag(config=True)

    death_interval = Float(
        0.05,
        help="Seconds between checks that a stopping server has exited. The hub's own wait "
        "backs off (0.1, 0.2, 0.4, 0.8, 1.6 s…), which let a culled session's GPUs reach the "
        "waiting workload up to a back-off step after its server was gone.",
    ).tag(config=True)

    fake_nvml_dir = Unicode(
        "",
        help="Where the node agent keeps gpufleet's fake NVML library, on machines without "
        "GPUs (set by gpufleet.hub.setup.configure). When the library is there, sessions "
        "load it too, so NVML inside a session (nvidia-ml-py, dashboards) shows exactly "
        "the session's GPUs.",
    ).tag(config=True)

    # -------------------------------------------------------------- state
    snapshot_holds: Sources = Sources()  # what this session's snapshots hold

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.snapshot_holds = Sources.from_json(state.get("gpufleet_snapshot_sources", {}))

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.workload_id is not None and self.snapshot_holds:
            state["gpufleet_snapshot_sources"] = self.snapshot_holds.to_json()
        return state

    async def containment(self) -> Containment:
        """The user's account from the controller (made on their first start), retried
        while the controller restarts."""
        try:
            account = await self._until_answered(
                lambda: self.controller.account(self.user.name), self.queue_timeout
            )
        except RequestRejected as e:
            raise InvalidGPURequest(str(e)) from e
        self.account_home = str(account.get("home") or "")
        return Containment(
            username=self.user.name,
            uid=int(account["uid"]),
            gid=int(account["gid"]),
            mode=str(account["mode"]),
            base_env=Path(self.session_base_env),
            prefix=Path(self.session_prefix),
        )

    def sandbox_read_only(self) -> list[str]:
        # Read-only: a session must not forge its GPUs' readings or XIDs. A bind of the
        # directory, not of its files: the agent replaces the control file by a rename.
        return [self.fake_nvml_dir] if self.fake_nvml_dir else []

    account_home: str = ""  # the system account's home, in system mode

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        env = super().user_env(env)
        if self.account_home:
            env["HOME"] = self.account_home
        env["USER"] = env["LOGNAME"] = self.user.name
        return env

    def get_args(self) -> list[str]:
        args: list[str] = super().get_args()
        # Reports kernel and terminal activity to the culler, relays its notices
        # (culler/session_extension.py, docs/session-extension.md).
        args.append("--ServerApp.jpserver_extensions=gpufleet.culler.session_extension=True")
        return args

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        if self.workload_id is not None:
            env[workload_processes.MARKER_VARIABLE] = self.marker
            env["GPUFLEET_WORKLOAD_ID"] = str(self.workload_id)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_uuids)
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(self.gpu_uuids)
            env["GPUFLEET_GPU_UUIDS"] = ",".join(self.gpu_uuids)
            env["GPUFLEET_NODE"] = self.node_name
            env["GPUFLEET_PROJECT"] = str(self.user_options.get("project", ""))
            # For the session extension (culler/session_extension.py): activity, notices.
            env["GPUFLEET_CONTROLLER_API_URL"] = self.controller_api_url
            fake = os.path.join(self.fake_nvml_dir, "libnvidia-ml.so.1")
            if self.fake_nvml_dir and os.path.exists(fake):
                # It honours NVIDIA_VISIBLE_DEVICES, as a container runtime would.
                env["LD_LIBRARY_PATH"] = os.pathsep.join(
                    p for p in (self.fake_nvml_dir, env.get("LD_LIBRARY_PATH", "")) if p
                )
                env["GPUFLEET_FAKE_NVML_CONTROL"] = os.path.join(self.fake_nvml_dir, "control")
        return env

    # -------------------------------------------------------------- start
    async def start(self) -> Any:
        return await self._start_when_placed(self._start_placed)

    async def _start_placed(self, status: WorkloadStatus) -> tuple[str, int]:
        self._report(
            f"GPUs assigned: {len(self.gpu_uuids)} × {status.gpu_type} on {self.node_name}", 25
        )
        resumed = await self._restore_snapshot()
        self._report("Starting the server", 60)
        ip, port = await super().start()
        # A start that failed half-way left processes at most: the release ends them.
        self._server_started = True
        self._stop_renewing()
        workload_id = status.id
        if self.snapshots_enabled:
            self.snapshot_holds = self.snapshot_sources(self.get_env().get("HOME", ""))
        holds = self.snapshot_holds.to_json() if self.snapshot_holds else None
        await self._until_answered(
            lambda: self.controller.running(workload_id, holds, resumed), 120
        )
        await self._wait_ready(ip, port)
        self._report(f"Server is up. {resumed}" if resumed else "Server is up", 100)
        return ip, port

    async def _nothing_left_running(self) -> bool:
        if self.marker and not await workload_processes.end_all(self.marker):
            self.log.error(
                "processes of workload %s survived SIGKILL; its GPUs stay allocated until an "
                "admin releases them",
                self.workload_id,
            )
            return False
        return True

    async def _wait_ready(self, ip: str, port: int) -> None:
        """Probe the new server until it answers, so the hub's first check finds it up."""
        url = f"http://{ip or '127.0.0.1'}:{port}{self.server.base_url}api"
        deadline = time.monotonic() + self.http_timeout
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    return  # it died: the hub's own check reports the failure
                try:
                    if (await client.get(url)).status_code < 500:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(self.readiness_interval)

    # -------------------------------------------------------------- stop
    async def wait_for_death(self, timeout: float = 10) -> bool:  # noqa: ASYNC109 (hub API)
        """Whether the server exited within ``timeout``, polled every ``death_interval``."""
        deadline = time.monotonic() + timeout
        while await self.poll() is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.death_interval)
        return True

    async def stop(self, now: bool = False) -> None:
        await super().stop(now=now)
        if self.workload_id is not None and self.snapshots_enabled and self.snapshot_holds:
            if self.marker and not await workload_processes.end_all(self.marker):
                await self._release("stopped", "")  # says why the GPUs stay allocated
                return
            await self._save_then_release()
            return
        await self._release("stopped", "")

    # -------------------------------------------------------------- snapshots
    async def _restore_snapshot(self) -> str:
        """Bring back what the last snapshot holds and is missing here; what happened."""
        if not self.snapshots_enabled:
            return ""
        try:
            return await self.restore_missing(
                str(self.user_options.get("project", "")),
                self.user.name,
                self.name,
                self._report,
            )
        except SnapshotFailed as e:
            # A session that cannot get its snapshot back must not start without it: the
            # user would take an empty home for lost work.
            raise web.HTTPError(503, f"could not restore your last snapshot: {e}") from e

    async def _final_snapshot(self) -> str:
        """The final pass; what it did, for the workload's end event."""
        started = time.monotonic()
        result = await self.final_snapshot(
            str(self.user_options.get("project", "")),
            self.user.name,
            self.name,
            self.snapshot_holds,
        )
        seconds = time.monotonic() - started
        self.log.info(
            "final snapshot %s of %s in %.1f s", result.get("id"), self._log_name, seconds
        )
        return f"final snapshot {result.get('id')} in {seconds:.2f} s"
