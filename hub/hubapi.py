"""The few JupyterHub REST calls the controller makes, in one place."""

from __future__ import annotations

from urllib.parse import quote

import httpx


def server_path(username: str, server_name: str) -> str:
    user = quote(username, safe="")
    if server_name:
        return f"/users/{user}/servers/{quote(server_name, safe='')}"
    return f"/users/{user}/server"


async def stop_server(
    client: httpx.AsyncClient, api_url: str, username: str, server_name: str
) -> httpx.Response:
    """Ask the hub to stop a server. 202/204: stopping or stopped; 404: there is none;
    400: the hub cannot stop it now (being renamed, say). The controller stops servers
    through ``stopper.ServerStopper`` alone, which calls this."""
    return await client.delete(f"{api_url}{server_path(username, server_name)}")
