"""``configure(c)``: everything JupyterHub needs to run gpufleet, from one call.

``jupyterhub_config.py`` calls it, then declares the fleet (nodes, projects, profiles).
The hub, the controller and the agent all evaluate that file; only the hub acts on the
``c.JupyterHub`` part. Ports and folders come from the environment so that several
deployments (and the test suite) can run side by side on one machine:

- ``GPUFLEET_DATA_DIR``: databases, cookie secret, the spawner's token, user homes, session
  sandboxes (``sessions/``);
  default ``.gpufleet`` beside the config file;
- ``GPUFLEET_BASE_PORT``: the public URL listens on it, the proxy's API on +1, the hub's
  API on +2, the controller on +3, the node agent's Prometheus exporter on +4; default 8000;
- ``GPUFLEET_BIND_IP``: default 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..snapshotter.errors import SnapshotError
from ..snapshotter.settings import master_key
from . import scopes
from .secrets import SecretFileError, check_secret_file, secret_file

CONTROLLER_SERVICE = "gpufleet"
AGENT_SERVICE = "gpufleet-agent"
SPAWNER_SERVICE = "gpufleet-spawner"
ADMIN_GROUP = "gpufleet-admins"


@dataclass(frozen=True)
class Deployment:
    data_dir: Path
    config_file: Path
    bind_ip: str
    public_port: int
    proxy_api_port: int
    hub_api_port: int
    controller_port: int

    @property
    def public_url(self) -> str:
        return f"http://{self.bind_ip}:{self.public_port}"

    @property
    def controller_url(self) -> str:
        return f"http://{self.bind_ip}:{self.controller_port}"

    @property
    def controller_api_url(self) -> str:
        return f"{self.controller_url}/services/{CONTROLLER_SERVICE}/api/v1"


def deployment(config_file: str) -> Deployment:
    config_path = Path(config_file).resolve()
    data_dir = Path(os.environ.get("GPUFLEET_DATA_DIR", config_path.parent / ".gpufleet"))
    base = int(os.environ.get("GPUFLEET_BASE_PORT", "8000"))
    return Deployment(
        data_dir=data_dir.resolve(),
        config_file=config_path,
        bind_ip=os.environ.get("GPUFLEET_BIND_IP", "127.0.0.1"),
        public_port=base,
        proxy_api_port=base + 1,
        hub_api_port=base + 2,
        controller_port=base + 3,
    )


def _platform_secrets(data_dir: Path) -> str:
    """Make and check the platform's secret files (hub/secrets.py); the spawner's token.
    A secret others may read stops the hub here, with the command that fixes it."""
    try:
        token = secret_file(data_dir / "spawner-token", "the spawner's token")
        key = data_dir / "snapshot-master.key"
        master_key(key, create=True)
        check_secret_file(key, "the snapshot master key")
        cookie = data_dir / "jupyterhub_cookie_secret"
        if cookie.exists():
            check_secret_file(cookie, "JupyterHub's cookie secret")
    except (SecretFileError, SnapshotError) as e:
        print(f"gpufleet: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return token


def _script(name: str) -> str:
    # The console script of the environment the hub runs from, whatever PATH says.
    return str(Path(sys.executable).parent / name)


def configure(c: Any, config_file: str, admin_users: tuple[str, ...] = ()) -> Deployment:
    """Set up the hub, the spawner and the gpufleet services; returns where things live."""
    d = deployment(config_file)
    # Databases, secrets, homes and sandboxes: the platform's alone (sessions see their
    # own home and nothing else of it, through their sandbox's binds).
    d.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d.data_dir, 0o700)
    spawner_token = _platform_secrets(d.data_dir)
    _configure_hub(c, d)
    _configure_spawner(c, d, spawner_token)
    _configure_services(c, d, spawner_token)
    _configure_access(c, admin_users)
    return d


def _service_environment(d: Deployment) -> dict[str, str]:
    """What the controller and the agent are started with: where the deployment lives."""
    env = {
        # The controller and agent read the file the hub was started with: the one that
        # called configure(), unless $GPUFLEET_CONFIG names an outer file that loads it.
        "GPUFLEET_CONFIG": os.environ.get("GPUFLEET_CONFIG", str(d.config_file)),
        "GPUFLEET_DATA_DIR": str(d.data_dir),
        "GPUFLEET_BASE_PORT": str(d.public_port),
        "GPUFLEET_BIND_IP": d.bind_ip,
        "GPUFLEET_CONTROLLER_API_URL": d.controller_api_url,
    }
    if "GPUFLEET_FAILPOINTS_DIR" in os.environ:  # crash tests (scheduler/failpoints.py)
        env["GPUFLEET_FAILPOINTS_DIR"] = os.environ["GPUFLEET_FAILPOINTS_DIR"]
    if os.environ.get("GPUFLEET_SESSION_ENV"):
        # The agent's job ranks run from the environment the spawner's sessions run from.
        env["GPUFLEET_SESSION_ENV"] = os.environ["GPUFLEET_SESSION_ENV"]
    return env


def _configure_hub(c: Any, d: Deployment) -> None:
    """The hub and its proxy: their addresses, database, cookie secret and pages."""
    c.JupyterHub.bind_url = d.public_url
    c.JupyterHub.hub_bind_url = f"http://{d.bind_ip}:{d.hub_api_port}"
    c.ConfigurableHTTPProxy.api_url = f"http://{d.bind_ip}:{d.proxy_api_port}"
    c.ConfigurableHTTPProxy.pid_file = str(d.data_dir / "proxy.pid")
    # scripts/install puts the proxy inside the repository when it is not on PATH.
    local_proxy = d.config_file.parent / ".tools/node_modules/.bin/configurable-http-proxy"
    if shutil.which("configurable-http-proxy") is None and local_proxy.exists():
        c.ConfigurableHTTPProxy.command = [str(local_proxy)]
    c.JupyterHub.db_url = f"sqlite:///{d.data_dir / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(d.data_dir / "jupyterhub_cookie_secret")
    c.JupyterHub.allow_named_servers = True
    # Queued spawns are pending spawns: a limit here would block users who are not queued.
    c.JupyterHub.concurrent_spawn_limit = 0
    c.JupyterHub.cleanup_servers = False  # sessions survive a hub restart
    # gpufleet's pages in the hub's navigation bar (templates/page.html extends the hub's).
    c.JupyterHub.template_paths = [str(Path(__file__).parent / "templates")]


def _configure_spawner(c: Any, d: Deployment, spawner_token: str) -> None:
    """Both backends' spawners: the controller they ask, their folders and tokens' scopes."""
    c.JupyterHub.spawner_class = "gpufleet.spawner.local.LocalGPUSpawner"
    c.LocalGPUSpawner.controller_api_url = d.controller_api_url
    c.LocalGPUSpawner.controller_token = spawner_token
    # The Kubernetes backend (docs/kubernetes.md) talks to the same controller, as the same
    # identity: switching c.JupyterHub.spawner_class is all it takes.
    c.KubeGPUSpawner.controller_api_url = d.controller_api_url
    c.KubeGPUSpawner.controller_token = spawner_token
    c.LocalGPUSpawner.home_dir_template = str(d.data_dir / "homes" / "{username}")
    c.NodeAgent.home_dir_template = c.LocalGPUSpawner.home_dir_template
    c.LocalGPUSpawner.fake_nvml_dir = str(d.data_dir / "agent" / "fake-nvml")
    c.LocalGPUSpawner.sandbox_dir = str(d.data_dir / "sessions")
    # The same store, key and stat caches as the controller's defaults (docs/culler.md).
    c.SnapshotSettings.store = str(d.data_dir / "snapshots")
    c.SnapshotSettings.key_file = str(d.data_dir / "snapshot-master.key")
    c.SnapshotSettings.cache_dir = str(d.data_dir / "statcache")
    c.Spawner.default_url = "/lab"
    c.Spawner.http_timeout = 120
    c.Spawner.server_token_scopes = [
        "users:activity!user",
        "access:servers!server",
        scopes.USE,
        # The session extension reports activity to the controller with this token.
        f"access:services!service={CONTROLLER_SERVICE}",
    ]


def _configure_services(c: Any, d: Deployment, spawner_token: str) -> None:
    """The gpufleet services the hub starts (controller, agent) or knows (the spawner)."""
    env = _service_environment(d)
    c.JupyterHub.services = [
        {
            "name": CONTROLLER_SERVICE,
            "display": True,
            "url": d.controller_url,
            "command": [_script("gpufleet-controller")],
            "environment": env,
            "oauth_no_confirm": True,
            "oauth_client_allowed_scopes": [scopes.USE, scopes.ADMIN],
        },
        {
            "name": AGENT_SERVICE,
            "command": [_script("gpufleet-agent")],
            "environment": env,
        },
        {"name": SPAWNER_SERVICE, "api_token": spawner_token},
    ]


def _configure_access(c: Any, admin_users: tuple[str, ...]) -> None:
    """gpufleet's scopes, the admins' group, and the roles of users and services."""
    c.JupyterHub.custom_scopes = scopes.DESCRIPTIONS
    # Projects map to hub groups of the same name (docs/roles-and-scopes.md); add yours with
    # c.JupyterHub.load_groups.update(...) after this call.
    c.JupyterHub.load_groups = {ADMIN_GROUP: {"users": list(admin_users)}}
    c.JupyterHub.load_roles = [
        # access:services lets a user's browser complete the controller's OAuth (its pages).
        {
            "name": "user",
            "scopes": ["self", scopes.USE, f"access:services!service={CONTROLLER_SERVICE}"],
        },
        {
            "name": "gpufleet-admin",
            "description": "Administer gpufleet: projects, quotas, nodes, every workload",
            "scopes": [scopes.ADMIN, scopes.USE, "admin-ui", "list:users", "admin:servers"],
            "groups": [ADMIN_GROUP],
            "users": list(admin_users),
        },
        {
            "name": "gpufleet-controller",
            "description": "The fleet controller: reads users and groups, stops servers",
            "scopes": [
                "list:users",
                "read:users",
                "list:groups",
                "read:groups",
                "admin:servers",
                "read:users:activity",
            ],
            "services": [CONTROLLER_SERVICE],
        },
        {
            "name": "gpufleet-spawner",
            "description": "The spawner's identity: acts for any user's spawn, nothing else",
            "scopes": [scopes.SPAWN],
            "services": [SPAWNER_SERVICE],
        },
        {
            "name": "gpufleet-agent",
            "description": "Node agents: register nodes, report heartbeats",
            "scopes": [scopes.AGENT],
            "services": [AGENT_SERVICE],
        },
    ]
