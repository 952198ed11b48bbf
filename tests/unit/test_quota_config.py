"""Children's guarantees may not sum to more than their parent may hold as declared
(``guaranteed + borrow_limit``): the config is refused at load with the projects and the
numbers, and an admin's edit that would break it is refused (the API answers 400) with
nothing changed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from tornado import web

from gpufleet.hub import scopes
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.api.identity import Identity
from gpufleet.scheduler.errors import InputError, InvalidRequest
from gpufleet.scheduler.model import guarantees_over_limits, project_tree
from gpufleet.state import db
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import Event, Project
from gpufleet.state.projects import ProjectEdit, QuotaEdit

from ..schema import migrated_sqlite
from .test_api_input import PREFIX, Controller, serve

RESEARCH = "team research: its projects' guarantees for H100 sum to 400 (vision 160, nlp 128, speech 112), more than the 360 × H100 the team may hold (guaranteed 300 + borrow_limit 60); lower a guarantee or raise the team's limit"  # noqa: E501


def team(guaranteed: int = 300, borrow: int | None = 60, **children: int) -> list[dict[str, Any]]:
    children = children or {"vision": 160, "nlp": 128, "speech": 112}
    quota: dict[str, Any] = {"guaranteed": guaranteed}
    if borrow is not None:
        quota["borrow_limit"] = borrow
    return [
        {"name": "research", "kind": "team", "quotas": {"H100": quota}},
        *(
            {"name": n, "parent": "research", "quotas": {"H100": {"guaranteed": g}}}
            for n, g in children.items()
        ),
    ]


# ------------------------------------------------------------------ config load
def test_a_config_whose_projects_guarantee_more_than_their_team_may_hold_is_refused() -> None:
    with pytest.raises(InputError) as refused:
        project_tree(team())
    assert str(refused.value) == RESEARCH


def test_each_level_is_checked_against_the_one_above() -> None:
    # The teams' guarantees are their projects' sums (above what the teams declare).
    specs: list[dict[str, Any]] = [
        {
            "name": "acme",
            "kind": "organisation",
            "quotas": {"H100": {"guaranteed": 60, "borrow_limit": 40}},
        },
        {"name": "red", "kind": "team", "parent": "acme", "quotas": {"H100": {"guaranteed": 8}}},
        {"name": "blue", "kind": "team", "parent": "acme"},
        {"name": "r1", "parent": "red", "quotas": {"H100": {"guaranteed": 40}}},
        {"name": "r2", "parent": "red", "quotas": {"H100": {"guaranteed": 24}}},
        {"name": "b1", "parent": "blue", "quotas": {"H100": {"guaranteed": 48}}},
        {"name": "solo", "parent": "acme", "quotas": {"H100": {"guaranteed": 0}}},
    ]
    with pytest.raises(InputError) as refused:
        project_tree(specs)
    assert str(refused.value) == (
        "organisation acme: its teams' and projects' guarantees for H100 sum to 112 "
        "(red 64, blue 48), more than the 100 × H100 the organisation may hold "
        "(guaranteed 60 + borrow_limit 40); lower a guarantee or raise the organisation's "
        "limit"
    )
    # A team over its own limit inside an organisation that has room.
    specs[0]["quotas"] = {"H100": {"borrow_limit": 200}}
    specs[1]["quotas"] = {"H100": {"guaranteed": 8, "borrow_limit": 40}}
    with pytest.raises(
        InputError,
        match=r"^team red: its projects' guarantees for H100 sum to "
        r"64 \(r1 40, r2 24\), more than the 48 × H100",
    ):
        project_tree(specs)


@pytest.mark.parametrize(
    "specs",
    [
        team(300, 60, vision=160, nlp=128, speech=72),  # exactly the limit
        team(300, None),  # no borrow limit: no cap to exceed
        team(0, 0, vision=0, nlp=0, speech=0),
        team(400, 0),  # a declared guarantee that covers its projects'
        [  # a limit on another type than the guarantees'
            {"name": "lab", "kind": "team", "quotas": {"A100": {"borrow_limit": 0}}},
            {"name": "v", "parent": "lab", "quotas": {"H100": {"guaranteed": 64}}},
        ],
        [{"name": "leaf", "quotas": {"H100": {"guaranteed": 64, "borrow_limit": 0}}}],
    ],
)
def test_trees_within_their_limits_still_load(specs: list[dict[str, Any]]) -> None:
    tree = project_tree(specs)
    assert guarantees_over_limits(tree) == []


# ---------------------------------------------------------------------- store
NOW = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def fleet_store(path: Path, projects: list[dict[str, Any]] | None = None) -> FleetStore:
    engine = db.make_engine(migrated_sqlite(path))
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(NOW)
    store.projects.apply_config(
        NOW,
        projects if projects is not None else team(300, 60, vision=160, nlp=128, speech=72),
        [{"name": "pytorch", "default": True}],
        [{"name": "standard", "rank": 100}],
    )
    gpus = tuple(GpuSpec(f"GPU-a1-{i}", i) for i in range(8))
    store.nodes.register_nodes(NOW, "agent-1", [NodeSpec("a1", "local", "zone-a", "H100", gpus)])
    return store


def quotas(store: FleetStore) -> dict[str, tuple[int, int | None, int | None]]:
    with store.read() as session:
        return {
            p.name: (q.guaranteed, q.borrow_limit, q.lend_limit)
            for p in session.scalars(select(Project))
            for q in p.quotas
        }


def events(store: FleetStore) -> int:
    with store.read() as session:
        return int(session.scalar(select(func.count()).select_from(Event)) or 0)


def test_the_store_refuses_a_config_over_its_limits_and_writes_nothing(tmp_path: Path) -> None:
    engine = db.make_engine(migrated_sqlite(tmp_path / "fleet.sqlite"))
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(NOW)
    with pytest.raises(InvalidRequest) as refused:
        store.projects.apply_config(NOW, team(), [], [{"name": "standard", "rank": 100}])
    assert str(refused.value) == RESEARCH
    assert quotas(store) == {}


@pytest.mark.parametrize(
    ("project", "quota"),
    [
        ("speech", QuotaEdit(112, None, None)),  # a child's guarantee raised
        ("research", QuotaEdit(300, 59, None)),  # the parent's borrow limit lowered
        ("research", QuotaEdit(250, 60, None)),  # the parent's guarantee lowered
    ],
)
def test_an_edit_that_would_exceed_the_limit_is_refused_and_changes_nothing(
    tmp_path: Path, project: str, quota: QuotaEdit
) -> None:
    store = fleet_store(tmp_path / "fleet.sqlite")
    before, logged = quotas(store), events(store)
    with pytest.raises(InvalidRequest, match=r"^team research: its projects' guarantees"):
        store.projects.edit_project(
            NOW, project, "admin", ProjectEdit(weight=3.0, quotas={"H100": quota})
        )
    assert quotas(store) == before
    assert events(store) == logged
    with store.read() as session:
        weight = session.scalar(select(Project.fair_share_weight).where(Project.name == project))
    assert weight == 1.0


def test_an_edit_within_the_limit_is_taken(tmp_path: Path) -> None:
    store = fleet_store(tmp_path / "fleet.sqlite")
    changes = store.projects.edit_project(
        NOW, "research", "admin", ProjectEdit(quotas={"H100": QuotaEdit(300, 80, None)})
    )
    assert changes == ["research: H100 borrow limit 60 → 80"]
    store.projects.edit_project(
        NOW, "speech", "admin", ProjectEdit(quotas={"H100": QuotaEdit(92, 0, 0)})
    )
    assert quotas(store)["speech"] == (92, 0, 0)


def test_a_tree_already_over_its_limit_may_be_mended_in_steps(tmp_path: Path) -> None:
    # An admin's edit (kept over the config file) and a later config together go over.
    path = tmp_path / "fleet.sqlite"
    store = fleet_store(path)
    store.projects.edit_project(
        NOW, "speech", "admin", ProjectEdit(quotas={"H100": QuotaEdit(72, 0, None)})
    )
    store.projects.edit_project(
        NOW, "nlp", "admin", ProjectEdit(quotas={"H100": QuotaEdit(128, 0, None)})
    )
    store.projects.apply_config(
        NOW, team(300, 20, vision=160, nlp=100, speech=20), [], [{"name": "standard", "rank": 100}]
    )
    assert quotas(store)["research"] == (300, 20, None)  # 160 + 128 + 72 = 360 > 320
    # Unrelated edits and steps that lower the excess are taken; a step up is not.
    store.projects.edit_project(NOW, "vision", "admin", ProjectEdit(weight=2.0))
    store.projects.edit_project(
        NOW, "vision", "admin", ProjectEdit(quotas={"H100": QuotaEdit(150, 0, None)})
    )
    with pytest.raises(InvalidRequest, match=r"sum to 351 \(vision 150, nlp 128, speech 73\)"):
        store.projects.edit_project(
            NOW, "speech", "admin", ProjectEdit(quotas={"H100": QuotaEdit(73, 0, None)})
        )
    assert quotas(store)["speech"] == (72, 0, None)


# ------------------------------------------------------------------------ API
@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    admin = Identity("user", "admin", frozenset({scopes.ADMIN, scopes.USE}), by_cookie=False)
    controller = Controller(fleet_store(tmp_path / "fleet.sqlite"), admin)
    async for url in serve(web.Application(routes(PREFIX, controller))):
        async with httpx.AsyncClient(base_url=f"{url}{PREFIX}api/v1", timeout=30) as client:
            yield client


async def test_the_api_answers_400_with_the_numbers_and_changes_nothing(
    api: httpx.AsyncClient,
) -> None:
    before = (await api.get("/projects")).json()["items"]
    response = await api.patch(
        "/projects/speech", json={"weight": 2, "quotas": {"H100": {"guaranteed": 112}}}
    )
    assert response.status_code == 400, response.text
    assert response.json()["message"] == RESEARCH
    assert (await api.get("/projects")).json()["items"] == before
    taken = await api.patch("/projects/speech", json={"quotas": {"H100": {"guaranteed": 72}}})
    assert taken.status_code == 200, taken.text
