# The chart's configuration file: the hub, the controller and the node agents all start
# with it, as every process reads jupyterhub_config.py on one machine. The chart turns its
# values into each component's settings (templates/_helpers-settings.tpl) and mounts that
# component's alone at $GPUFLEET_CHART_SETTINGS: real options as {Class: {option: value}}
# under "traitlets", applied below as they are. What differs per pod or is secret comes
# from the environment: the tokens (the chart's Secret), the node's name and address.
import os
from pathlib import Path

import yaml

c = get_config()  # noqa: F821 -- provided by the traitlets config loader

settings = yaml.safe_load(
    Path(
        os.environ.get("GPUFLEET_CHART_SETTINGS", "/etc/gpufleet/config/settings.yaml")
    ).read_text()
)
component = settings["component"]

if component == "hub":
    from gpufleet.hub.setup import AGENT_SERVICE, CONTROLLER_SERVICE, SPAWNER_SERVICE, configure

    hub = settings["hub"]
    # The scopes, roles, services and spawner of a deployment (gpufleet.hub.setup), as on
    # one machine; the traitlets below then say what differs in pods. Its files (a spawner
    # token, a snapshot key) land in $GPUFLEET_DATA_DIR and go unused: the chart's stand.
    configure(c, __file__, admin_users=tuple(hub["admin_users"]))
    c.JupyterHub.load_groups.update(
        {name: {"users": list(users)} for name, users in hub["groups"].items()}
    )
    tokens = {
        CONTROLLER_SERVICE: os.environ["GPUFLEET_CONTROLLER_TOKEN"],
        AGENT_SERVICE: os.environ["GPUFLEET_AGENT_TOKEN"],
        SPAWNER_SERVICE: os.environ["GPUFLEET_SPAWNER_TOKEN"],
    }
    services = []
    for service in c.JupyterHub.services:
        # The controller and the agents run in pods of their own, not as the hub's
        # children: the hub knows them by their tokens, the controller by its URL.
        entry = {k: v for k, v in service.items() if k not in ("command", "environment")}
        entry["api_token"] = tokens[entry["name"]]
        if entry["name"] == CONTROLLER_SERVICE:
            entry["url"] = hub["controller_url"]
        services.append(entry)
    c.JupyterHub.services = services
    c.KubeGPUSpawner.controller_token = tokens[SPAWNER_SERVICE]

if component == "agent":
    # One DaemonSet serves every GPU node: each pod learns its node from the downward API.
    c.NodeAgent.node_name = os.environ["GPUFLEET_NODE_NAME"]
    c.NodeAgent.metrics_ip = os.environ["GPUFLEET_NODE_IP"]
    c.NodeAgent.progress_ip = os.environ["GPUFLEET_NODE_IP"]
    if os.environ.get("GPUFLEET_ZONE"):
        c.NodeAgent.zone = os.environ["GPUFLEET_ZONE"]

for section, options in settings["traitlets"].items():
    for name, value in options.items():
        c[section][name] = value

if component == "hub":
    # Who may log in: the projects' members and gpufleet's admins, added to any users
    # hub.config allows (JupyterHub lets nobody in without an allow rule; an
    # authenticator's own rules, such as allowed_groups, add to these).
    members = {user for users in hub["groups"].values() for user in users}
    members |= set(hub["admin_users"])
    allowed = c.Authenticator.allowed_users
    if isinstance(allowed, (set, list, tuple)):
        c.Authenticator.allowed_users = set(allowed) | members
    else:  # not set by hub.config: traitlets' placeholder, which adds to the default
        allowed.update(members)
