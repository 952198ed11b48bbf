"""The pure parts of the controller's pages and the spawn form: one row per snapshot, a
scan past a damaged manifest, one time format, display names with one kind label, and a
spawn form without a Start button where nothing can start."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet.api.schemas import ProjectUsageOut, QuotaUsageOut
from gpufleet.hub.admin import project_rows
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.pages import environment, page_context, when, when_text
from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.listing import distinct, index_key, scan
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.settings import master_key
from gpufleet.snapshotter.store import LocalStore
from gpufleet.spawner.form import render_form

T0 = datetime(2026, 12, 1, 20, 13, 5, tzinfo=UTC)
PROJECTS = {1: ("vision", "Computer vision"), 2: ("nlp", "Language models")}


def row(project_id: int, key: str, at: datetime, server: str = "") -> SimpleNamespace:
    return SimpleNamespace(
        project_id=project_id,
        username="alice",
        server_name=server,
        manifest_key=key,
        created_at=at,
        file_count=3,
        size_bytes=1000,
    )


def test_a_snapshot_the_culler_recorded_and_the_scan_found_is_listed_once() -> None:
    # The culler's row names the manifest inside its project; the scan's, in the store.
    live = "snapshots/alice/-/20261201T201305-aaaa"
    rows = [
        row(1, live, T0),
        row(1, index_key("vision", live), T0 + timedelta(seconds=1)),
        row(
            1,
            index_key("vision", "snapshots/alice/-/20261201T190000-bbbb"),
            T0 - timedelta(hours=1),
        ),
        row(
            2, index_key("nlp", "snapshots/alice/-/20261202T090000-cccc"), T0 + timedelta(hours=13)
        ),
    ]
    listed = distinct(rows, PROJECTS)
    assert [(s.project, s.created_at) for s in listed] == [
        ("nlp", T0 + timedelta(hours=13)),
        ("vision", T0 + timedelta(seconds=1)),  # the scan's row of the live snapshot
        ("vision", T0 - timedelta(hours=1)),
    ]
    # A start in a project restores that project's newest: one per project is marked.
    assert [s.restored_next for s in listed] == [True, True, False]
    assert [s.project_label for s in listed][:2] == ["Language models", "Computer vision"]


def test_the_scan_skips_a_damaged_manifest_and_lists_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = master_key(tmp_path / "master.key", create=True)
    store = LocalStore(tmp_path / "snapshots")
    home = tmp_path / "home"
    home.mkdir()
    (home / "a.txt").write_text("a")
    repository = Repository.open(store, "vision", key)
    made = [create_snapshot(repository, [SourceSpec("home", home)], user=u) for u in ("ann", "bob")]
    damaged = store.root / index_key("vision", made[0].name)
    damaged.write_bytes(b"not a sealed manifest")
    with caplog.at_level(logging.ERROR):
        records = scan(store, key, ["vision"])
    assert [r.username for r in records] == ["bob"]
    assert "damaged" in caplog.text and made[0].id in caplog.text


def test_every_page_says_a_time_one_way() -> None:
    assert when_text(T0) == "2026-12-01 20:13 UTC"
    assert when_text(T0.replace(tzinfo=None)) == "2026-12-01 20:13 UTC"  # from SQLite
    paris = T0.astimezone(timezone(timedelta(hours=1)))
    assert when_text(paris) == "2026-12-01 20:13 UTC"  # whatever zone it came in
    assert str(when(T0)) == (
        '<time datetime="2026-12-01T20:13:05Z" title="2026-12-01T20:13:05Z">'
        "2026-12-01 20:13 UTC</time>"
    )
    assert when_text(None) == ""


def project(name: str, display: str, kind: str, parent: str | None) -> ProjectUsageOut:
    quota = QuotaUsageOut(
        gpu_type="A100-80GB", guaranteed=4, borrow_limit=None, lend_limit=None, used=0, waiting=0
    )
    return ProjectUsageOut(
        name=name,
        display_name=display,
        kind=kind,
        parent=parent,
        fair_share_weight=1.0,
        per_user_gpu_cap=None,
        default_priority="standard",
        quotas=[quota] if kind == "project" else [],
    )


def test_the_admin_panel_names_projects_by_display_name_with_one_kind_label() -> None:
    rows = project_rows(
        [
            project("research", "", "organisation", None),
            project("vision", "Computer vision", "project", "research"),
        ],
        ["A100-80GB"],
    )
    assert [(r.label, r.depth, r.project.kind) for r in rows] == [
        ("research", 0, "organisation"),
        ("Computer vision", 1, "project"),
    ]
    assert all("(" not in r.label for r in rows)


OPTIONS = {
    "username": "admin",
    "projects": [],
    "profiles": [],
    "gpu_types": {"A100-80GB": 4},
}


def test_a_user_in_no_project_is_told_whom_to_ask_and_offered_no_start_button() -> None:
    html = render_form(OPTIONS)
    assert "You are in no gpufleet project yet" in html
    assert "gpufleet-admins" in html  # who the admins are
    # The hub's Start button follows the form: the form hides it.
    assert "#spawn_form .feedback-container" in html and "display: none" in html
    named = render_form(OPTIONS | {"admins": ["root", "<ops>"]})
    assert "<b>root</b>, <b>&lt;ops&gt;</b>" in named
    no_gpus = render_form(OPTIONS | {"projects": [{"name": "v"}], "gpu_types": {}})
    assert "display: none" in no_gpus


def test_a_user_with_a_project_gets_the_start_button_and_the_restore_note() -> None:
    project_option = {"name": "vision", "display_name": "Computer vision", "quotas": []}
    html = render_form(OPTIONS | {"projects": [project_option]})
    assert "display: none" not in html
    assert 'id="gpufleet-restore"' in html and "services/gpufleet/server.js" in html


def render(template: str, identity_scopes: frozenset[str], **context: object) -> str:
    identity = Identity("user", "alice", identity_scopes, by_cookie=True)
    page = page_context(identity, "Title", "jobs", base="/services/gpufleet/", xsrf_form="<i>x</i>")
    return environment().get_template(template).render(**page, **context)


USE = frozenset({"custom:gpufleet:use"})
ADMIN = USE | {"custom:gpufleet:admin"}


def test_the_pages_are_drawn_in_the_hubs_page_with_gpufleet_in_its_navigation() -> None:
    html = render("gpufleet-sessions.html", USE, workloads=[], nodes=[], snapshots=[], projects=[])
    assert 'href="/hub/static/css/style.min.css' in html  # the hub's styles
    assert 'id="jupyterhub-logo"' in html and 'id="login_widget"' in html  # its bar
    assert 'id="gpufleet-nav"' in html and 'id="gpufleet-admin-nav"' not in html
    assert 'id="admin-link"' not in html
    admin = render(
        "gpufleet-sessions.html", ADMIN, workloads=[], nodes=[], snapshots=[], projects=[]
    )
    assert 'id="gpufleet-admin-nav"' in admin and 'id="admin-link"' in admin


def test_the_job_templates_render_for_job_pages() -> None:
    pod = SimpleNamespace(
        pod=0,
        ranks=[0, 1],
        node="gpu-node-a",
        state="running",
        exit_code=None,
        started_at=T0,
        ended_at=None,
        reason="",
    )
    job = SimpleNamespace(
        id=7,
        effective_training_ratio=0.97,
        name="resnet",
        username="alice",
        project="vision",
        gpus=2,
        gpu_type="A100-80GB",
        state="running",
        outcome=None,
        reason="running on gpu-node-a",
        pods=1,
        gpus_per_pod=2,
        priority_class="standard",
        script_name="train.py",
        args=["--lr", "0.1"],
        checkpoint_uri="file:///ckpt",
        created_at=T0,
        pod_states=[pod],
    )
    names = {"vision": "Computer vision"}
    listed = render(
        "gpufleet-jobs.html", USE, jobs=[job], shown_state=lambda j: j.state, project_names=names
    )
    assert 'data-job="7"' in listed and "Computer vision" in listed
    assert "2026-12-01 20:13 UTC" in listed
    one = render(
        "gpufleet-job.html",
        USE,
        job=job,
        shown_state=lambda j: j.state,
        ranks=[(0, "0")],
        rank=0,
        stream="stdout",
        log="step 1\n",
        truncated=False,
        tail=65536,
        refresh=3,
        error="",
        project_names=names,
    )
    assert 'http-equiv="refresh"' in one and "<i>x</i>" in one  # reloads; the XSRF field
    assert 'id="cancel"' in one and "step 1" in one
