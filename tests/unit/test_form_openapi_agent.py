"""The spawn form (pure HTML), the OpenAPI document, and the agent's declared inventory."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import jsonschema
import pytest
from tornado import web

from gpufleet.agent.gpus import declared_gpu_uuid, declared_inventory
from gpufleet.api import schemas
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.openapi import OPERATIONS, openapi_document
from gpufleet.spawner.form import options_from_form, render_form


# ------------------------------------------------------------------ spawn form
class FormParser(HTMLParser):
    """What a browser would show: each select's options, each input, each element id."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.selects: dict[str, list[tuple[str, str, bool]]] = {}
        self.inputs: dict[str, dict[str, str | None]] = {}
        self.ids: set[str] = set()
        self.items: dict[str, str] = {}  # <li data-project=...> text
        self._select: str | None = None
        self._option: tuple[str, bool] | None = None
        self._item: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.add(str(attributes["id"]))
        if tag == "select":
            self._select = str(attributes["name"])
            self.selects[self._select] = []
        elif tag == "option":
            self._option = (str(attributes["value"]), "selected" in attributes)
            self._text = []
        elif tag == "input":
            self.inputs[str(attributes["name"])] = attributes
        elif tag == "li":
            self._item = str(attributes["data-project"])
            self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "option" and self._select is not None and self._option is not None:
            value, selected = self._option
            self.selects[self._select].append((value, "".join(self._text), selected))
            self._option = None
        elif tag == "select":
            self._select = None
        elif tag == "li" and self._item is not None:
            self.items[self._item] = "".join(self._text)
            self._item = None


def parse(html: str) -> FormParser:
    parser = FormParser()
    parser.feed(html)
    parser.close()
    return parser


def profile(name: str, display_name: str, default: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "display_name": display_name,
        "description": "",
        "gpu_types": [],
        "projects": [],
        "default": default,
    }


OPTIONS: dict[str, Any] = {
    "username": "alice",
    "projects": [
        {
            "name": "vision",
            "display_name": "Computer vision",
            "quotas": [{"gpu_type": "A100", "guaranteed": 2, "used": 1}],
        },
        {"name": "nlp", "display_name": "NLP <team> & friends", "quotas": []},
    ],
    "profiles": [profile("jax", "JAX"), profile("pytorch", "PyTorch 2", default=True)],
    "gpu_types": {"A100": 4, "H100": 8},
}


def test_the_form_offers_the_users_projects_types_and_profiles() -> None:
    form = parse(render_form(OPTIONS))
    assert form.selects == {
        "profile": [("jax", "JAX", False), ("pytorch", "PyTorch 2", True)],
        "project": [
            ("vision", "Computer vision", True),
            ("nlp", "NLP <team> & friends", False),  # escaped: text, not a tag
        ],
        "gpu_type": [
            ("A100", "A100 (up to 4 per session)", True),
            ("H100", "H100 (up to 8 per session)", False),
        ],
    }
    gpus = form.inputs["gpus"]
    assert (gpus["type"], gpus["min"], gpus["max"], gpus["value"]) == ("number", "1", "8", "1")
    assert form.items == {
        "vision": "Computer vision: 1 of 2 A100 in use",
        "nlp": "NLP <team> & friends: no guaranteed GPUs",
    }


def test_the_form_preselects_the_previous_choices() -> None:
    previous = {"profile": "jax", "project": "nlp", "gpu_type": "H100", "gpus": "3"}
    form = parse(render_form(OPTIONS, previous))
    selected = {name: [v for v, _, chosen in opts if chosen] for name, opts in form.selects.items()}
    assert selected == {"profile": ["jax"], "project": ["nlp"], "gpu_type": ["H100"]}
    assert form.inputs["gpus"]["value"] == "3"


def test_without_profiles_there_is_no_environment_choice() -> None:
    form = parse(render_form(OPTIONS | {"profiles": []}))
    assert set(form.selects) == {"project", "gpu_type"}


def test_a_user_in_no_project_sees_a_warning_and_no_form() -> None:
    html = render_form(OPTIONS | {"projects": []})
    form = parse(html)
    assert form.ids == {"gpufleet-no-project"}
    assert form.selects == {} and form.inputs == {}
    assert "You are in no gpufleet project yet" in html
    assert "Ask an admin to add you to a project's group" in html


def test_a_fleet_without_gpus_says_so() -> None:
    html = render_form(OPTIONS | {"gpu_types": {}})
    assert parse(html).ids == {"gpufleet-no-gpus"}
    assert "No GPU node has reported to gpufleet yet" in html


def test_options_from_form_keeps_only_the_known_fields_trimmed() -> None:
    form_data = {
        "project": ["vision", "nlp"],
        "gpus": [" 2 "],
        "gpu_type": ["A100"],
        "profile": [],
        "cmd": ["rm -rf /"],
        "_xsrf": ["token"],
    }
    assert options_from_form(form_data) == {"project": "vision", "gpus": "2", "gpu_type": "A100"}


# --------------------------------------------------------------------- OpenAPI
def refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref":
                yield item
            else:
                yield from refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from refs(item)


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    # A deep copy through JSON: the document is cached, and it must serialise anyway.
    return json.loads(json.dumps(openapi_document("1.2.3")))


def test_the_document_is_openapi_3_1_with_the_given_version(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    assert document["info"]["version"] == "1.2.3"
    assert document["servers"] == [{"url": "/services/gpufleet/api/v1"}]


def test_every_ref_resolves_to_a_component_schema(document: dict[str, Any]) -> None:
    found = list(refs(document))
    components = document["components"]["schemas"]
    assert len(found) > len(OPERATIONS)  # every operation refers at least to ErrorOut
    for ref in found:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in components, ref
    assert "$defs" not in json.dumps(document)


def test_every_component_is_a_valid_json_schema(document: dict[str, Any]) -> None:
    for name, schema in document["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:  # name the component, not only the problem
            pytest.fail(f"components/schemas/{name}: {e.message}")


def test_every_operation_is_documented_with_parameters_and_scopes(
    document: dict[str, Any],
) -> None:
    for op in OPERATIONS:
        operation = document["paths"][op.path][op.method]
        assert operation["summary"] == op.summary
        assert operation["x-scopes"] == list(op.scopes)
        assert str(op.status) in operation["responses"]
        assert ("security" in operation) == bool(op.scopes)
        path_params = {p["name"] for p in operation["parameters"] if p["in"] == "path"}
        # Every placeholder of the path, and nothing else, is a documented parameter.
        assert path_params == set(re.findall(r"\{(\w+)\}", op.path)), op.path
    sessions = document["paths"]["/sessions"]["post"]
    assert sessions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SessionRequestIn"
    }
    assert sessions["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/WorkloadOut"
    }


API = "/services/gpufleet/api/v1"
METHODS = ("get", "post", "put", "patch", "delete")


def route_paths(pattern: str) -> Iterator[str]:
    """The OpenAPI paths a route's pattern serves, each parameter as ``{}``:
    ``/workloads/(\\d+)/(renew|hold)`` gives ``/workloads/{}/renew`` and ``.../hold``."""
    path = pattern.removeprefix(API).removesuffix("/?") or "/"
    path = path.replace(r"(\d+)", "{}").replace("([^/]+)", "{}")
    parts = re.split(r"\(([^()]*)\)", path)  # odd items: alternatives like renew|hold
    choices = [p.split("|") if i % 2 else [p] for i, p in enumerate(parts)]
    for chosen in itertools.product(*choices):
        yield "".join(chosen)


def test_every_route_and_method_the_api_serves_is_in_the_document(
    document: dict[str, Any],
) -> None:
    # What the document lists is what schemathesis tests; a route left out goes untested.
    documented = {
        (re.sub(r"\{[a-z_]+\}", "{}", path), method)
        for path, operations in document["paths"].items()
        for method in operations
    }
    served = {
        (path, method)
        for pattern, handler, _ in routes("/services/gpufleet/", None)
        if pattern.startswith(API)
        for path in route_paths(pattern)
        for method in METHODS
        if getattr(handler, method) is not getattr(web.RequestHandler, method)
    }
    assert ("/sessions/{}/keep-alive", "put") in served  # the patterns were read
    assert served - documented == set()
    assert documented - served == set()


@pytest.mark.parametrize(
    ("method", "path", "body", "answer"),
    [
        ("post", "/sessions/{workload_id}/activity", "ActivityIn", "SessionStateOut"),
        ("get", "/sessions/{workload_id}/activity", None, "SessionStateOut"),
        ("put", "/sessions/{workload_id}/keep-alive", "KeepAliveIn", "SessionStateOut"),
        ("post", "/workloads/{workload_id}/hold", "HoldIn", "WorkloadOut"),
    ],
)
def test_the_culler_and_hold_routes_are_documented_with_their_bodies(
    document: dict[str, Any], method: str, path: str, body: str | None, answer: str
) -> None:
    operation = document["paths"][path][method]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": f"#/components/schemas/{answer}"
    }
    if body is None:
        assert "requestBody" not in operation
    else:
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{body}"
        }
        assert "415" in operation["responses"]  # a body that is not JSON


# ----------------------------------------------------------------------- agent
def test_declared_gpu_uuids_are_stable_across_versions_and_runs() -> None:
    # Changing these would make every declared GPU look new and every old one vanish.
    assert declared_gpu_uuid("node-a", 0) == "GPU-da1fb2fb-f25e-5943-9b96-fc5a602d913e"
    assert declared_gpu_uuid("node-a", 1) == "GPU-ab255c20-d9f2-5922-8914-8329f6179afd"


def test_declared_inventory_gives_distinct_gpus_in_index_order() -> None:
    nodes = [
        {"name": "node-a", "zone": "zone-a", "gpu_type": "A100", "gpus": 4},
        {"name": "node-b", "zone": "zone-b", "gpu_type": "H100", "gpus": "2", "cluster": "c2"},
    ]
    inventory = declared_inventory(nodes)
    assert declared_inventory(nodes) == inventory  # the same config, the same inventory
    assert [(n["name"], n["cluster"], n["zone"], n["gpu_type"]) for n in inventory] == [
        ("node-a", "local", "zone-a", "A100"),
        ("node-b", "c2", "zone-b", "H100"),
    ]
    assert [[g["index"] for g in n["gpus"]] for n in inventory] == [[0, 1, 2, 3], [0, 1]]
    uuids = [g["uuid"] for n in inventory for g in n["gpus"]]
    assert len(set(uuids)) == 6
    assert uuids[0] == declared_gpu_uuid("node-a", 0)
    assert [g["pci_bus_id"] for g in inventory[1]["gpus"]] == [
        "00000000:10:00.0",
        "00000000:11:00.0",
    ]
    schemas.RegisterIn.model_validate({"nodes": inventory})  # the controller accepts it


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "node-a", "zone": "zone-a"}, "declared node 'node-a' lacks gpu_type, gpus"),
        (
            {"zone": "zone-a", "gpu_type": "A100", "gpus": 1},
            "declared node {'zone': 'zone-a', 'gpu_type': 'A100', 'gpus': 1} lacks name",
        ),
    ],
)
def test_a_declared_node_without_required_keys_names_them(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        declared_inventory([spec])
    assert str(caught.value) == message
