# The one configuration file of a gpufleet deployment: JupyterHub, the spawner, the fleet
# controller and the node agent all read it. Start everything with
#     jupyterhub -f jupyterhub_config.py
# (scripts/run does that after installing). Every c.FleetController / c.NodeAgent /
# c.LocalGPUSpawner option is documented: `gpufleet-controller --help-all`.
import os

from gpufleet.hub.setup import configure

c = get_config()  # noqa: F821 -- provided by JupyterHub's config loader

# Hub, proxy, spawner, services, scopes and roles. Ports from $GPUFLEET_BASE_PORT (8000),
# files under $GPUFLEET_DATA_DIR (./.gpufleet).
fleet = configure(c, __file__, admin_users=("admin",))

# --- Who may log in. The demo takes any user name with one shared password; use your
# site's authenticator (OAuthenticator, LDAP, ...) in production. The user "admin" is a
# gpufleet admin (the gpufleet-admins group and its gpufleet-admin role): the admin panel,
# and the hub's Admin page, where it sees every user and starts and stops their servers.
# It is not a JupyterHub admin: adding or deleting users, making admins and editing groups
# need one (c.Authenticator.admin_users = {"name"}).
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = os.environ.get(
    "GPUFLEET_DEMO_PASSWORD", "gpufleet-demo"
)
c.Authenticator.allow_all = True

# --- Projects. A project's members are the members of the hub group of the same name.
c.JupyterHub.load_groups.update(
    {
        "vision": {"users": ["alice", "bob"]},
        "nlp": {"users": ["carol", "alice"]},
    }
)
c.FleetController.projects = [
    {"name": "research", "kind": "organisation"},
    {
        "name": "vision",
        "parent": "research",
        "display_name": "Computer vision",
        # vision keeps to its guarantee; nlp may borrow vision's idle GPUs, and gives them
        # back (its borrowing sessions are stopped) when vision asks within its guarantee.
        "quotas": {"A100-80GB": {"guaranteed": 4, "borrow_limit": 0}},
        "per_user_gpu_cap": 4,
    },
    {
        "name": "nlp",
        "parent": "research",
        "display_name": "Language models",
        "quotas": {"A100-80GB": {"guaranteed": 4}},
    },
]
c.FleetController.profiles = [
    {
        "name": "lab",
        "display_name": "JupyterLab with PyTorch (the sessions' environment)",
        "default": True,
    },
]

# --- The GPUs. With NVIDIA GPUs the agent reads them through NVML; without, it serves
# these declared nodes (two nodes of 4 × A100-80GB in two zones) so the whole flow runs
# on a laptop and in CI.
c.NodeAgent.declared_nodes = [
    {"name": "gpu-node-a", "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4},
    {"name": "gpu-node-b", "zone": "zone-b", "gpu_type": "A100-80GB", "gpus": 4},
]
