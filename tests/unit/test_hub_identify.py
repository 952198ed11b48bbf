"""The controller checks a caller's token with the hub (JupyterHub's HubAuth). A hub that
cannot answer, as while the platform starts and the hub's name does not resolve yet, is a
503 the caller may retry, saying why; not a 500 that reads as the controller's own bug."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tornado import web

from gpufleet.hub.app import FleetController
from gpufleet.hub.errors import HubUnavailable


class Hub:
    """HubAuth's ``get_user`` as it ends: with the error HubAuth raises."""

    def __init__(self, error: web.HTTPError) -> None:
        self.error = error

    async def get_user(self, handler: Any, sync: bool = True) -> dict[str, Any]:
        raise self.error


async def identify(error: web.HTTPError) -> None:
    controller = SimpleNamespace(hub_auth=Hub(error))
    await FleetController.identify(controller, handler=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (500, "Failed to connect to Hub API at 'http://hub:8081/hub/api'."),
        (502, "Failed to check authorization (upstream problem)"),
    ],
)
async def test_a_hub_that_cannot_check_the_token_is_a_503_that_says_so(
    status: int, said: str
) -> None:
    with pytest.raises(HubUnavailable) as caught:
        await identify(web.HTTPError(status, said))
    assert caught.value.status == 503 and caught.value.code == "hub-unavailable"
    assert str(caught.value).startswith(f"the hub could not check the request's token: {said}")


async def test_the_hub_s_other_answers_pass_as_they_are() -> None:
    with pytest.raises(web.HTTPError) as caught:
        await identify(web.HTTPError(403, "no"))
    assert caught.value.status_code == 403
