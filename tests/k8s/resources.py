"""What a test kubelet's pod workers share: the pause gate, the tier's pod addresses, the
node's device table, its memory cgroups and peer directory, and the rest of the node's
context (``NodeContext``).

Each is safe to use from every worker thread at once (a lock each, the gate a condition).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .containers import SandboxSettings
from .memory import MemoryCgroups
from .names import PeerDirectory
from .podspec import Manifest, allocate_devices


class Gate:
    """Pod handling happens between ``enter()`` and ``leave()``; ``close()`` returns once no
    handler is inside, and lets none in until ``open()``: how a kubelet pauses."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._inside = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def enter(self) -> bool:
        with self._cond:
            if not self._open:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False
            while self._inside:
                self._cond.wait()

    def open(self) -> None:
        with self._cond:
            self._open = True


class PodAddresses:
    """Pod IPs: 127.<block>.y.z loopback addresses, each held by one live pod of the tier
    at a time. Every address of 127.0.0.0/8 is local, so a pod's server binds its own; the
    block is chosen at random so two tiers on one machine rarely share addresses."""

    def __init__(self, block: int | None = None) -> None:
        self.block = block if block is not None else 64 + uuid.uuid4().int % 190
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._next = 0

    def take(self) -> str:
        with self._lock:
            for _ in range(256 * 254):
                self._next = self._next % (256 * 254) + 1
                y, z = divmod(self._next - 1, 254)
                address = f"127.{self.block}.{y}.{z + 1}"  # z in 1..254
                if address not in self._held:
                    self._held.add(address)
                    return address
        raise RuntimeError("no pod address left")

    def release(self, address: str) -> None:
        with self._lock:
            self._held.discard(address)


class DeviceTable:
    """The devices a node serves, by resource name, and which pod holds which."""

    def __init__(self, served: Mapping[str, Sequence[str]]) -> None:
        self.served = {name: tuple(ids) for name, ids in served.items()}
        self._lock = threading.Lock()
        self._held: dict[str, frozenset[str]] = {}

    def allocate(self, uid: str, pod: Manifest) -> dict[str, tuple[str, ...]]:
        """Each container's devices; raises :class:`AdmissionError`."""
        with self._lock:
            held = {d for owner, ids in self._held.items() if owner != uid for d in ids}
            chosen = allocate_devices(pod, self.served, held)
            self._held[uid] = frozenset(d for ids in chosen.values() for d in ids)
            return chosen

    def release(self, uid: str) -> None:
        with self._lock:
            self._held.pop(uid, None)

    def held(self) -> dict[str, frozenset[str]]:
        with self._lock:
            return dict(self._held)


@dataclass
class NodeContext:
    """What a pod worker shares with its kubelet."""

    node: str
    api: httpx.Client  # as the node's kubelet identity; shared by the workers
    sandbox: SandboxSettings
    directory: Path  # pods/<uid>/ below it
    logs: Path  # <namespace>_<pod>_<uid>/<container>/<restart>.log below it (CRI format)
    devices: DeviceTable
    addresses: PodAddresses
    fake_nvml_dir: Path | None
    # None where the machine has no cgroup v1 memory controller (``memory_problem`` says
    # why): containers then run without their memory limits.
    memory: MemoryCgroups | None = None
    memory_problem: str = ""
    peers: PeerDirectory | None = None  # None: hosts files hold no peers
    gate: Gate = field(default_factory=Gate)
    stopping: threading.Event = field(default_factory=threading.Event)
    problems: list[str] = field(default_factory=list)  # kubelet bugs, for the tests to see
    forget: Callable[[str], None] = lambda uid: None
    # KUBERNETES_SERVICE_HOST and _PORT, as a kubelet gives every container (the API
    # server's own address: the tier has no Service proxy for its ClusterIP)
    api_service_env: Mapping[str, str] = field(default_factory=dict)
