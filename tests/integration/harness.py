"""A real JupyterHub (with its proxy, the controller and the node agent) on loopback.

The hub runs ``jupyterhub_config.py`` from the repository through a small test config
that adds an admin service token and shortens intervals. Everything listens on a free
block of five ports, under a temporary data directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gpufleet.agent.network_guard import table_name

from ..ports import free_port_block

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25
) -> T:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value {last!r}")


TEST_CONFIG = """
import os
c = get_config()
load_subconfig({repo_config!r})
c.JupyterHub.services.append(
    {{"name": "test-admin", "api_token": os.environ.get("GPUFLEET_TEST_TOKEN", "")}}
)
c.JupyterHub.load_roles.append({{
    "name": "test-admin",
    "scopes": ["admin:users", "admin:servers", "tokens", "admin:groups", "read:users",
               "custom:gpufleet:admin"],
    "services": ["test-admin"],
}})
c.AdmissionCycles.interval = 0.5
c.AdmissionCycles.min_run_time_seconds = 0
c.AdmissionCycles.preemption_retry_seconds = 2
c.FleetController.request_lease_seconds = 6
c.FleetController.log_style = "text"
c.Reconciling.interval = 1
c.Reconciling.grace = 3
c.FleetController.job_restart_backoff_seconds = 1
c.FleetController.job_restart_backoff_max_seconds = 4
c.FleetController.job_hang_floor_seconds = 10
c.RecoveryLoop.hang_check_interval = 1
# Faults only cordon on the shared hubs: a fake GPU's reset rewrites the control file the
# tests write. test_recovery.py's own hub does the maintenance.
c.FleetController.recovery_maintenance = False
c.LocalGPUSpawner.lease_renew_interval = 1
c.NodeAgent.heartbeat_interval = 1
c.NodeAgent.sample_interval = 1
c.JupyterHub.log_level = "INFO"
# JupyterHub starts a managed service again once its poll of the service's process finds
# it dead: every Spawner.poll_interval (30 s) of the spawner each service gets
# (_ServiceSpawner), which the hub makes without its config, so no c.* option reaches it
# (c.JupyterHub.service_check_interval only logs whether a service answers). The node
# agent's is 2 s here: test_agent_restarts.py and test_agent.py kill it and wait for the new
# one. The controller's stays 30 s: test_controller_down.py and test_reconciler.py stop a
# server while it is away and count on it staying away for as long as that takes. Only the
# hub itself does this: the controller and the agent read this file too.
import sys
_app = sys.modules.get("jupyterhub.app")
if _app is not None and _app.JupyterHub.initialized():
    from jupyterhub.services import service as _service
    from traitlets import default as _default

    class _ServiceSpawner(_service._ServiceSpawner):
        @_default("poll_interval")
        def _quick_agent_poll(self):
            return 2 if self._service_name == "gpufleet-agent" else 30

    _service._ServiceSpawner = _ServiceSpawner
# Sandbox uids of this hub's own (docs/containment.md): several test hubs, and a demo at the
# default range, may run on this machine at once, and a range another holds stops the start.
# The hub's base port is its own while it runs, so the block of 1000 uids numbered by it is
# too; every process of the hub reads the same block, across restarts of the controller.
_block = 1_000_000 + 1_000 * int(os.environ.get("GPUFLEET_BASE_PORT", "8000"))
c.FleetController.sandbox_uids = [_block, _block + 999]
"""


@dataclass
class Hub:
    data_dir: Path
    base_port: int
    token: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.base_port}"

    @property
    def api(self) -> str:
        return f"{self.url}/hub/api"

    @property
    def controller_api(self) -> str:
        return f"{self.url}/services/gpufleet/api/v1"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            GPUFLEET_CONFIG=str(self.log_path.parent / "test_config.py"),
            GPUFLEET_DATA_DIR=str(self.data_dir),
            GPUFLEET_BASE_PORT=str(self.base_port),
            GPUFLEET_TEST_TOKEN=self.token,
            GPUFLEET_FAILPOINTS_DIR=str(self.data_dir / "failpoints"),
            PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        )
        return env

    @classmethod
    def create(cls, root: Path, extra_config: str = "") -> Hub:
        """A hub under ``root``; ``extra_config`` is appended to the test config."""
        data_dir = root / "data"
        (data_dir / "failpoints").mkdir(parents=True)
        (root / "test_config.py").write_text(
            textwrap.dedent(TEST_CONFIG).format(repo_config=str(REPO / "jupyterhub_config.py"))
            + textwrap.dedent(extra_config)
        )
        return cls(data_dir, free_port_block(5), uuid.uuid4().hex, root / "hub.log")

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterhub",
                "-f",
                str(self.log_path.parent / "test_config.py"),
            ],
            cwd=self.log_path.parent,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self._ready, 90, "the hub, the controller and two healthy nodes")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the hub exited ({self.proc.returncode}); see {self.log_path}")
        try:
            nodes = self.controller("GET", "/nodes").json()["items"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return sum(n["health"] == "ok" for n in nodes) >= 2

    def stop(self) -> None:
        """Stop the hub gracefully (it stops its services and proxy), then every server."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def kill_everything(self) -> None:
        """Last resort at the end of the session: nothing of this hub may outlive the tests
        (its services, its sessions, whose homes and sandboxes are in its data directory,
        its job ranks), nor its agent's loopback guard."""
        self.stop()
        for pid in pids_mentioning(str(self.data_dir)):
            try:
                group = os.getpgid(pid)
                if group != os.getpgid(0):  # never the test run's own
                    os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
        nft = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")
        if nft:
            table = table_name(str(self.data_dir / "agent"))
            subprocess.run(
                [nft, "delete", "table", "inet", table], capture_output=True, check=False
            )

    # ------------------------------------------------------------- HTTP
    def hub_api(
        self, method: str, path: str, token: str | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"token {token or self.token}"}
        return httpx.request(method, f"{self.api}{path}", headers=headers, timeout=60, **kw)

    def controller(
        self, method: str, path: str, token: str | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"token {token or self.token}"}
        return httpx.request(
            method, f"{self.controller_api}{path}", headers=headers, timeout=60, **kw
        )

    def user_token(self, username: str) -> str:
        response = self.hub_api(
            "POST", f"/users/{username}/tokens", json={"note": "gpufleet tests", "expires_in": 3600}
        )
        response.raise_for_status()
        return str(response.json()["token"])

    # ------------------------------------------------------------- servers
    def spawn(self, username: str, server: str = "", **options: Any) -> httpx.Response:
        path = f"/users/{username}/servers/{server}" if server else f"/users/{username}/server"
        return self.hub_api("POST", path, json=options)

    def stop_server(self, username: str, server: str = "") -> httpx.Response:
        path = f"/users/{username}/servers/{server}" if server else f"/users/{username}/server"
        return self.hub_api("DELETE", path)

    def server_model(self, username: str, server: str = "") -> dict[str, Any] | None:
        user = self.hub_api("GET", f"/users/{username}").json()
        model: dict[str, Any] | None = user.get("servers", {}).get(server)
        return model

    def wait_ready(self, username: str, server: str = "", timeout: float = 120) -> dict[str, Any]:
        return wait_for(
            lambda: (m := self.server_model(username, server)) and m.get("ready") and m,
            timeout,
            f"server {username}/{server or '(default)'} ready",
        )

    def wait_gone(self, username: str, server: str = "", timeout: float = 60) -> bool:
        return wait_for(
            lambda: self.server_model(username, server) is None,
            timeout,
            f"server {username}/{server or '(default)'} gone",
        )

    def workloads(self, **params: Any) -> list[dict[str, Any]]:
        response = self.controller("GET", "/workloads", params={"limit": 1000, **params})
        response.raise_for_status()
        items: list[dict[str, Any]] = response.json()["items"]
        return items

    def start_session(self, username: str, server: str = "", **options: Any) -> dict[str, Any]:
        """Spawn a server, wait until it answers, and return its running workload."""
        self.spawn(username, server, **options)
        self.wait_ready(username, server)
        workload = self.workload_of(username, server)
        assert workload is not None, f"{username}/{server} is up without a workload"
        return workload

    def workload_of(self, username: str, server: str = "") -> dict[str, Any] | None:
        """The live session of the user's server (never one of the user's jobs)."""
        for w in self.workloads(username=username):
            if w["kind"] == "session" and w["server_name"] == server and w["state"] != "ended":
                return w
        return None

    def wait_ended(self, workload: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        """The workload once it has ended (its ``outcome`` says how)."""

        def ended() -> dict[str, Any] | None:
            response = self.controller("GET", f"/workloads/{workload['id']}")
            response.raise_for_status()
            body: dict[str, Any] = response.json()
            return body if body["state"] == "ended" else None

        return wait_for(ended, timeout, f"workload {workload['id']} to end")

    def stop_all_servers(self) -> None:
        """Stop every server and cancel every job; wait until every workload has ended."""
        users = self.hub_api("GET", "/users", params={"state": "active"}).json()
        for user in users:
            for name in user.get("servers", {}):
                self.stop_server(user["name"], name)
        for job in self.workloads():
            if job["kind"] == "job" and job["state"] not in ("ended", "stopping"):
                self.controller("POST", f"/jobs/{job['id']}/cancel")
        wait_for(
            lambda: not [w for w in self.workloads() if w["state"] != "ended"],
            60,
            "every workload ended",
        )
        # A spawner may still be stopping after its workload ended (its final snapshot,
        # its processes); the hub refuses a spawn for that server until it is done.
        wait_for(
            lambda: not self.hub_api("GET", "/users", params={"state": "active"}).json(),
            60,
            "every server stopped in the hub",
        )
        # What a test's faults took out of service comes back for the next test.
        for node in self.controller("GET", "/nodes").json()["items"]:
            if node["cordoned"] or node["cordoned_gpus"]:
                self.controller("POST", f"/nodes/{node['name']}/uncordon")
        for breaker in self.controller("GET", "/recovery/breakers").json()["items"]:
            if breaker["open"]:
                self.controller("POST", f"/recovery/breakers/{breaker['cluster']}/reset")

    def service_pid(self, script: str) -> int | None:
        """The pid of this hub's ``gpufleet-controller`` or ``gpufleet-agent``."""
        pids = [
            p
            for p in pids_with_env("GPUFLEET_DATA_DIR", str(self.data_dir))
            if script in cmdline(p)
        ]
        return pids[0] if pids else None

    def controller_pid(self) -> int | None:
        return self.service_pid("gpufleet-controller")

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.base_port + 4}/metrics"

    @property
    def fake_nvml_control(self) -> Path:
        return self.data_dir / "agent" / "fake-nvml" / "control"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def pids_mentioning(text: str) -> list[int]:
    """Processes with ``text`` anywhere in their environment (a path of theirs)."""
    wanted = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if wanted in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


def pids_with_env(name: str, value: str) -> list[int]:
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


def server_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def host_pid(session_pid: int, marker: str) -> int:
    """The host pid of a session's process that calls itself ``session_pid``: a sandboxed
    session has a pid namespace of its own (the last NSpid entry is its pid there)."""
    found = []
    for pid in pids_with_env("GPUFLEET_SESSION_MARKER", marker):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        nspid = next(
            (line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), []
        )
        if nspid[-1:] == [str(session_pid)]:
            found.append(pid)
    assert len(found) == 1, f"expected one process {session_pid} of the session, found {found}"
    return found[0]


def run_in_kernel(hub: Hub, username: str, server: str, code: str, token: str) -> str:
    """Execute ``code`` in a new kernel of the user's server; returns what it printed."""
    import asyncio

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    prefix = f"/user/{username}/{server + '/' if server else ''}"
    headers = {"Authorization": f"token {token}"}
    kernel = httpx.post(f"{hub.url}{prefix}api/kernels", headers=headers, json={}, timeout=60)
    kernel.raise_for_status()
    kernel_id = kernel.json()["id"]

    async def execute() -> str:
        ws_url = f"ws://127.0.0.1:{hub.base_port}{prefix}api/kernels/{kernel_id}/channels"
        conn = await websocket_connect(HTTPRequest(ws_url, headers=headers))
        msg_id = uuid.uuid4().hex
        conn.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": username,
                        "session": uuid.uuid4().hex,
                        "msg_type": "execute_request",
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": False,
                        "user_expressions": {},
                        "allow_stdin": False,
                    },
                }
            )
        )
        out = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            raw = await conn.read_message()
            if raw is None:
                break
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                raise AssertionError("kernel error: " + "\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        conn.close()
        return "".join(out)

    try:
        # In a thread of its own: Playwright's sync API may hold this thread's event loop.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, execute()).result()
    finally:
        httpx.delete(f"{hub.url}{prefix}api/kernels/{kernel_id}", headers=headers, timeout=30)


def running_hub(root: Path, extra_config: str = "") -> Iterator[Hub]:
    """A hub of its own under ``root`` for a fixture to yield, killed with all it started
    afterwards (``yield from running_hub(...)``)."""
    instance = Hub.create(root, extra_config)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()
