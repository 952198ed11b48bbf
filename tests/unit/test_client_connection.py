"""Where the SDK finds the controller and the token (``gpufleet.client.Connection``)."""

from __future__ import annotations

import pytest

from gpufleet.client import Connection, NotConfigured

SESSION = {
    "GPUFLEET_CONTROLLER_API_URL": "http://10.0.0.5:8181/services/gpufleet/api/v1",
    "JUPYTERHUB_API_TOKEN": "server-token",
}


def test_inside_a_session_it_needs_nothing() -> None:
    found = Connection.discover(environ=SESSION)
    assert found == Connection("http://10.0.0.5:8181/services/gpufleet/api/v1", "server-token")


def test_arguments_win_over_the_environment_and_a_hub_url_names_the_service() -> None:
    found = Connection.discover(token="mine", hub_url="https://hub.example.org/", environ=SESSION)
    assert found == Connection("https://hub.example.org/services/gpufleet/api/v1", "mine")
    outside = Connection.discover(
        environ={"GPUFLEET_HUB_URL": "https://hub.example.org/", "GPUFLEET_TOKEN": "t"}
    )
    assert outside == Connection("https://hub.example.org/services/gpufleet/api/v1", "t")
    explicit = {**SESSION, "GPUFLEET_API_URL": "http://controller:8181/api/v1/"}
    assert Connection.discover(environ=explicit).api_url == "http://controller:8181/api/v1"


def test_without_a_place_or_a_token_it_says_what_to_set() -> None:
    with pytest.raises(NotConfigured, match=r"\$GPUFLEET_HUB_URL"):
        Connection.discover(environ={"GPUFLEET_TOKEN": "t"})
    with pytest.raises(NotConfigured, match=r"/hub/token.*\$GPUFLEET_TOKEN"):
        Connection.discover(environ={"GPUFLEET_HUB_URL": "https://hub.example.org"})
