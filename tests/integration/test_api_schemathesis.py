"""Schemathesis against the controller's own OpenAPI document, on a hub of its own (an
admin's generated requests register made-up nodes and edit projects): no generated
input gets a 5xx, with an admin's token or a researcher's, and nothing a researcher's
request answers names another user's workload, job, snapshot or event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from gpufleet.hub.openapi import openapi_document

from .harness import Hub

pytestmark = pytest.mark.integration

schema = schemathesis.openapi.from_dict(openapi_document("test"))
EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same inputs every run: a failure here is reproducible
    suppress_health_check=list(HealthCheck),
)
# Where an answer may name other users by design: the usage of the researcher's projects
# counts their colleagues' GPU-hours (docs/api.md).
SHARED_WITH_COLLEAGUES = {"/usage"}


@pytest.fixture(scope="module")
def api_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    instance = Hub.create(Path(tmp_path_factory.mktemp("schemathesis")))
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


@pytest.fixture(scope="module")
def researcher_token(api_hub: Hub) -> str:
    return api_hub.user_token("alice")


def call(case: Any, hub: Hub, token: str) -> Any:
    # A long poll is valid input but would make each example wait up to a minute.
    if case.query and "wait" in case.query:
        case.query["wait"] = 0
    if isinstance(case.body, dict) and "wait" in case.body:
        case.body["wait"] = 0
    return case.call(
        base_url=hub.controller_api, headers={"Authorization": f"token {token}"}, timeout=60
    )


def usernames(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "username" and isinstance(item, str):
                yield item
            else:
                yield from usernames(item)
    elif isinstance(value, list):
        for item in value:
            yield from usernames(item)


@schema.parametrize()
@EXAMPLES
def test_no_input_gets_a_server_error_with_an_admin_token(case: Any, api_hub: Hub) -> None:
    response = call(case, api_hub, api_hub.token)
    case.validate_response(response, checks=[not_a_server_error])


@schema.parametrize()
@EXAMPLES
def test_a_researcher_gets_no_server_error_and_nothing_of_others(
    case: Any, api_hub: Hub, researcher_token: str
) -> None:
    response = call(case, api_hub, researcher_token)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 300 or case.operation.path in SHARED_WITH_COLLEAGUES:
        return
    if case.method.upper() in ("POST", "PATCH", "PUT", "DELETE"):
        # Only a researcher's own jobs and sessions may change at their request.
        assert case.operation.path.startswith(("/jobs", "/sessions/")), (
            f"{case.method} {case.formatted_path} succeeded for a researcher"
        )
    try:
        answer = response.json()
    except ValueError:
        return
    others = set(usernames(answer)) - {"alice"}
    assert not others, f"{case.method} {case.formatted_path} showed alice {sorted(others)}"
