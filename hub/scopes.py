"""gpufleet's custom JupyterHub scopes; docs/roles-and-scopes.md says who holds which."""

USE = "custom:gpufleet:use"
ADMIN = "custom:gpufleet:admin"
SPAWN = "custom:gpufleet:spawn"
AGENT = "custom:gpufleet:agent"

DESCRIPTIONS = {
    USE: {
        "description": "Ask for GPUs, see and act on your own workloads and your projects' usage.",
    },
    ADMIN: {
        "description": "See and change everything: projects, quotas, nodes, every workload.",
    },
    SPAWN: {
        "description": "Open, renew and release session requests on behalf of any user's spawn.",
    },
    AGENT: {
        "description": "Register nodes and their GPUs and report heartbeats.",
    },
}
