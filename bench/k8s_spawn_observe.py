"""What ``k8s_spawn.py`` watches while a spawn runs, each on a thread of its own: the pods of
gpufleet's namespace in one cluster (a list, then a watch, as the tier's admin), and the
hub's progress event stream of one spawn. Every observation is stamped with
``time.monotonic()`` the moment it arrives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

WATCH_TIMEOUT_S = 30  # the API server ends each watch after this; the thread watches again


@dataclass
class PodSeen:
    """When the watch first saw a pod (``None``: not yet, or before the watch began)."""

    cluster: str
    name: str
    added: float | None
    node: str = ""
    bound: float | None = None  # spec.nodeName set: kube-scheduler's binding
    running: float | None = None  # phase Running: the kubelet started its container
    ready: float | None = None  # the Ready condition True
    deleted: float | None = None  # gone from the API server


class PodWatch:
    """The pods of ``namespace`` in one cluster, as its API server reports them."""

    def __init__(self, cluster: str, client: Callable[[], httpx.Client], namespace: str):
        self.cluster = cluster
        self._client = client
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._pods: dict[str, PodSeen] = {}  # by uid
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name=f"watch-{cluster}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def pods(self) -> list[PodSeen]:
        with self._changed:
            return list(self._pods.values())

    def wait(self, condition: Callable[[], Any], timeout: float) -> Any:
        """Whatever truthy ``condition()`` returns once the watch makes it so; None after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (found := condition()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, 1.0))
            return found

    def _run(self) -> None:
        with self._client() as api:
            version = ""
            while not self._stopped.is_set():
                try:
                    if not version:
                        version = self._list(api)
                    version = self._follow(api, version)
                except (httpx.HTTPError, ValueError) as e:
                    self.last_error = f"{type(e).__name__}: {e}"
                    version = ""
                    self._stopped.wait(0.2)

    def _list(self, api: httpx.Client) -> str:
        r = api.get(self._path)
        r.raise_for_status()
        listed = r.json()
        for pod in listed.get("items") or []:
            self._see("LISTED", pod)
        return str(listed["metadata"]["resourceVersion"])

    def _follow(self, api: httpx.Client, version: str) -> str:
        params = {
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = httpx.Timeout(5.0, read=WATCH_TIMEOUT_S + 15.0)
        with api.stream("GET", self._path, params=params, timeout=timeout) as response:
            if response.status_code == 410:
                return ""
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = str(event.get("type")), event.get("object") or {}
                if kind == "ERROR":
                    return ""
                version = str(pod.get("metadata", {}).get("resourceVersion", version))
                if kind != "BOOKMARK":
                    self._see(kind, pod)
        return version

    def _see(self, kind: str, pod: dict[str, Any]) -> None:
        now = time.monotonic()
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        with self._changed:
            seen = self._pods.get(meta["uid"])
            if seen is None:
                added = now if kind == "ADDED" else None  # listed: it was there before
                seen = self._pods[meta["uid"]] = PodSeen(self.cluster, meta["name"], added)
            if seen.bound is None and spec.get("nodeName"):
                seen.bound, seen.node = now, str(spec["nodeName"])
            if seen.running is None and status.get("phase") == "Running":
                seen.running = now
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            )
            if seen.ready is None and ready:
                seen.ready = now
            if kind == "DELETED":
                seen.deleted = now
            self._changed.notify_all()


@dataclass
class ProgressStream:
    """The hub's progress events of one spawn (``GET /hub/api/users/<u>/server/progress``),
    each with the moment it arrived; ends with the ``ready`` or ``failed`` event."""

    url: str
    token: str
    opened: float = 0.0
    status: int = 0
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    error: str = ""

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="progress", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        headers = {"Authorization": f"token {self.token}"}
        timeout = httpx.Timeout(10.0, read=None)
        try:
            with httpx.stream("GET", self.url, headers=headers, timeout=timeout) as response:
                self.opened, self.status = time.monotonic(), response.status_code
                if response.status_code != 200:
                    self.error = response.read().decode(errors="replace")
                    return
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[len("data:") :])
                    self.events.append((time.monotonic(), event))
                    if event.get("ready") or event.get("failed"):
                        return
        except (httpx.HTTPError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"

    def first(self, starts_with: str) -> float | None:
        """When the first message beginning with ``starts_with`` arrived."""
        for at, event in self.events:
            if str(event.get("message", "")).startswith(starts_with):
                return at
        return None

    def ready(self) -> float | None:
        for at, event in self.events:
            if event.get("ready"):
                return at
        return None
