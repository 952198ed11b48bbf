"""The spawner's side of the controller handshake, over the controller's REST API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class ControllerError(Exception):
    """Base class for the spawner's errors talking to the controller."""


class RequestRejected(ControllerError):
    """The controller refused the request as written (4xx); the message says what to fix."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ControllerUnavailable(ControllerError):
    """The controller could not be reached or failed (network error or 5xx).

    ``status`` is the HTTP status of a failed answer, None when none came. A 500 is the
    controller's own failure (its log has the traceback), which the same request will
    most likely meet again; a 502/503/504 is a restart or a standby controller.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def error_message(response: httpx.Response) -> str:
    """The controller's own words from an error answer ``{code, message, details}``, else
    the start of whatever else answered (a proxy's page)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return response.text[:300]


@dataclass(frozen=True)
class Placement:
    node: str
    gpu_uuids: tuple[str, ...]
    pci_bus_ids: tuple[str, ...]
    cluster: str = ""


@dataclass(frozen=True)
class WorkloadStatus:
    id: int
    state: str
    version: int
    reason: str
    queue_position: int | None
    gpu_type: str
    gpus: int
    placement: Placement | None
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkloadStatus:
        allocations = body.get("allocations") or []
        placement = None
        if allocations:
            placement = Placement(
                node=allocations[0]["node"],
                gpu_uuids=tuple(a["uuid"] for a in allocations),
                pci_bus_ids=tuple(a["pci_bus_id"] for a in allocations),
                cluster=allocations[0].get("cluster", ""),
            )
        return cls(
            id=body["id"],
            state=body["state"],
            version=body["version"],
            reason=body.get("reason", ""),
            queue_position=body.get("queue_position"),
            gpu_type=body["gpu_type"],
            gpus=body["gpus"],
            placement=placement,
            raw=body,
        )


class ControllerClient:
    def __init__(self, api_url: str, token: str, timeout: float = 10.0):
        self.api_url = api_url.rstrip("/")
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"token {token}"}, timeout=timeout
        )

    async def _call(
        self, method: str, path: str, *, read_seconds: float | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        try:
            response = await self._client.request(
                method,
                f"{self.api_url}{path}",
                timeout=read_seconds if read_seconds is not None else httpx.USE_CLIENT_DEFAULT,
                **kwargs,
            )
        except httpx.HTTPError as e:
            raise ControllerUnavailable(
                f"the gpufleet controller at {self.api_url} did not answer: {e}"
            ) from e
        if 400 <= response.status_code < 500:
            # Final: the same request would be refused again, so it is not retried.
            raise RequestRejected(error_message(response), response.status_code)
        if response.status_code >= 500:
            raise ControllerUnavailable(
                f"the gpufleet controller failed ({response.status_code}): "
                f"{error_message(response)}",
                response.status_code,
            )
        body: dict[str, Any] = response.json()
        return body

    async def spawn_options(self, username: str) -> dict[str, Any]:
        return await self._call("GET", f"/users/{username}/spawn-options")

    async def account(self, username: str) -> dict[str, Any]:
        """Whom the user's processes run as: uid, gid, mode and (system mode) home."""
        return await self._call("POST", f"/users/{username}/account")

    async def open_session(
        self, body: dict[str, Any], *, dry_run: bool = False
    ) -> WorkloadStatus | None:
        answer = await self._call(
            "POST", "/sessions", json=body, params={"dry_run": "1"} if dry_run else None
        )
        return None if dry_run else WorkloadStatus.from_json(answer)

    async def watch(self, workload_id: int, version: int, wait: int) -> WorkloadStatus:
        """The workload, once its version differs from ``version`` or ``wait`` seconds pass."""
        body = await self._call(
            "GET",
            f"/workloads/{workload_id}",
            params={"wait": wait, "version": version},
            read_seconds=wait + 10,
        )
        return WorkloadStatus.from_json(body)

    async def renew(self, workload_id: int) -> WorkloadStatus:
        return WorkloadStatus.from_json(await self._call("POST", f"/workloads/{workload_id}/renew"))

    async def running(
        self, workload_id: int, snapshot: dict[str, Any] | None = None, notice: str = ""
    ) -> WorkloadStatus:
        """The server is up; ``snapshot``: what its snapshots hold (snapshotter/runner.py);
        ``notice``: what the session should tell its user about this start."""
        body: dict[str, Any] = {"snapshot": snapshot} if snapshot else {}
        if notice:
            body["notice"] = notice
        return WorkloadStatus.from_json(
            await self._call("POST", f"/workloads/{workload_id}/running", json=body)
        )

    async def hold(self, workload_id: int, message: str) -> WorkloadStatus:
        """Keep a stopped session's GPUs: its final snapshot failed and is retried."""
        return WorkloadStatus.from_json(
            await self._call("POST", f"/workloads/{workload_id}/hold", json={"message": message})
        )

    async def release(self, workload_id: int, outcome: str, message: str = "") -> WorkloadStatus:
        return WorkloadStatus.from_json(
            await self._call(
                "POST",
                f"/workloads/{workload_id}/release",
                json={"outcome": outcome, "message": message},
            )
        )

    async def request_node_operation(
        self, workload_id: int, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Ask the agent of the session's node for a snapshot pass or a restore."""
        return await self._call("POST", f"/workloads/{workload_id}/node-operations", json=body)

    async def node_operation(self, operation_id: int) -> dict[str, Any]:
        return await self._call("GET", f"/node-operations/{operation_id}")

    async def abandon_node_operation(self, operation_id: int) -> dict[str, Any]:
        return await self._call("POST", f"/node-operations/{operation_id}/abandon")

    async def aclose(self) -> None:
        await self._client.aclose()
