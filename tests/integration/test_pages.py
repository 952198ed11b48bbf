"""The controller's own pages, reached through the hub's OAuth in headless Chromium: my
sessions and the queue; GPU usage per project, user and week; a job's page with its steps
and loss beside its GPUs, and time labels that Chromium lays out apart at any window."""

from __future__ import annotations

import csv
import io
import itertools
import re
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, expect

from gpufleet.client import Client
from gpufleet.hub.gpu_charts import progress_svg
from gpufleet.state.progress import ProgressPoint

from . import browser as ui
from .browser import login, new_context
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


def page_rows(chromium: Browser, hub: Hub, username: str) -> tuple[list[str], str]:
    context = new_context(chromium, hub.url)
    try:
        page = login(context, username)
        page.goto("/services/gpufleet/")
        expect(page.locator("h1")).to_have_text("gpufleet")
        expect(page.get_by_text(f"Signed in as {username}")).to_be_visible()
        rows = page.locator("#workloads tr[data-workload]").all_inner_texts()
        return rows, page.content()
    finally:
        context.close()


def test_my_sessions_page_shows_the_queue_position_and_reason_to_its_owner_only(
    fleet: Hub, chromium: Browser
) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("alice")
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    bob = wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["queue_position"] == 1 and w, 30, "bob queued"
    )

    rows, _ = page_rows(chromium, fleet, "bob")
    assert len(rows) == 1
    assert str(bob["id"]) in rows[0] and "pending" in rows[0]
    assert "project vision uses 4/4 guaranteed A100-80GB and may borrow 0 more" in rows[0]

    rows, html = page_rows(chromium, fleet, "alice")
    assert len(rows) == 1 and "running" in rows[0] and "4 × A100-80GB" in rows[0]
    assert "bob" not in "".join(rows)
    assert 'id="nodes"' not in html  # the node table is for admins

    rows, html = page_rows(chromium, fleet, "admin")
    assert {r.split()[1] for r in rows} == {"alice", "bob"}
    assert 'id="nodes"' in html and "gpu-node-a" in html


def test_pages_need_a_login(fleet: Hub, chromium: Browser) -> None:
    context = new_context(chromium, fleet.url)
    try:
        page = context.new_page()
        page.goto("/services/gpufleet/")
        expect(page).to_have_url(re.compile(r"/hub/login"))
        expect(page.locator("#workloads")).to_have_count(0)
    finally:
        context.close()


def test_usage_page_charts_gpu_hours_per_week_for_the_projects_members(
    fleet: Hub, chromium: Browser
) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    fleet.stop_server("alice")
    fleet.wait_gone("alice")
    # bob shares vision with alice: he sees her GPU-hours; carol (nlp only) does not.
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "bob")
        page.goto("/services/gpufleet/")
        page.locator("#usage-link").click()
        expect(page.locator("h1")).to_have_text("GPU usage")
        vision = page.locator('section[data-project="vision"]')
        expect(vision.locator("svg.chart rect.bar").first).to_be_visible()
        expect(vision.locator(".legend")).to_contain_text("alice")
        assert "week of" in (vision.locator("svg.chart title").first.text_content() or "")
        with page.expect_download() as download:
            page.locator("#csv").click()
        rows = list(csv.reader(io.StringIO(download.value.path().read_text())))
        assert rows[0] == ["project", "week", "username", "gpu_hours"]
        assert any(r[0] == "vision" and r[2] == "alice" and float(r[3]) > 0 for r in rows[1:])

    finally:
        context.close()
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "carol")
        page.goto("/services/gpufleet/usage")
        expect(page.locator("h1")).to_have_text("GPU usage")
        expect(page.locator('section[data-project="vision"]')).to_have_count(0)
    finally:
        context.close()
    # The same figures through the SDK; a bad window is refused with what to fix.
    token = fleet.user_token("bob")
    with Client(fleet.controller_api, token) as client:
        assert ("vision", "alice") in {(u.project, u.username) for u in client.usage(weeks=2)}
    exported = httpx.get(
        f"{fleet.controller_api}/usage",
        params={"format": "csv"},
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    assert exported.headers["content-type"].startswith("text/csv")
    assert exported.text.splitlines()[0] == "project,week,username,gpu_hours"
    bad = httpx.get(
        f"{fleet.controller_api}/usage",
        params={"weeks": 500},
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    assert bad.status_code == 400 and "weeks" in bad.json()["message"]


TIME = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC$")


def test_the_pages_wear_the_hubs_navigation_and_styles_and_name_projects_as_the_spawn_page(
    fleet: Hub, chromium: Browser
) -> None:
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("bob")
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "bob")
        stylesheets: list[str] = []
        page.on(
            "response",
            lambda r: stylesheets.append(r.url) if r.ok and r.url.endswith(".css") else None,
        )
        for path, title in (
            ("/services/gpufleet/", "gpufleet"),
            ("/services/gpufleet/usage", "GPU usage"),
        ):
            page.goto(path)
            expect(page.locator("h1")).to_have_text(title)
            # The hub's own navigation bar (its logo, Home, Token, the user, Logout) ...
            expect(page.locator("#jupyterhub-logo")).to_be_visible()
            expect(page.locator("#login_widget")).to_contain_text("bob")
            expect(page.locator("#gpufleet-nav")).to_be_visible()
        # ... and its stylesheet, from the hub's static files.
        assert any("/hub/static/css/style.min.css" in url for url in stylesheets), stylesheets
        page.goto("/services/gpufleet/")
        # Display names, as on the spawn page; the name (what --project takes) beside it.
        expect(page.locator("#quotas tr[data-project='vision'] td").first).to_have_text(
            "Computer vision vision"
        )
        row = page.locator("#workloads tr[data-workload]")
        expect(row).to_contain_text("Computer vision")
        since = row.locator("time").first.text_content() or ""
        assert TIME.match(since), since
    finally:
        context.close()


def test_the_admin_panel_says_each_kind_once_and_every_time_one_way(
    fleet: Hub, chromium: Browser
) -> None:
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "admin")
        page.goto("/services/gpufleet/admin")
        expect(page.locator("h1")).to_have_text("gpufleet admin")
        research = page.locator("#project-research")
        expect(research.locator(".project-kind")).to_have_text("organisation")
        assert "organisation) (organisation" not in (research.text_content() or "")
        assert "(organisation)" not in (research.text_content() or "")
        expect(page.locator("#project-vision .project-label")).to_have_text("Computer vision")
        times = page.locator("#event-log time").all_text_contents()
        assert times and all(TIME.match(t) for t in times), times[:3]
    finally:
        context.close()


EPOCHS = textwrap.dedent(
    """
    import os, time
    import gpufleet

    where = os.environ["GPUFLEET_CHECKPOINT_URI"]
    for epoch in range(2):
        for step in range(25):  # the counter restarts every epoch
            time.sleep(0.2)
            gpufleet.progress(step, epoch=epoch, loss=3.0 / (1 + 25 * epoch + step))
        gpufleet.checkpoint_saved(f"{where}/epoch-{epoch}", 24, epoch=epoch)
    print("trained", flush=True)
    """
)
# The charts' time labels, each one's box as Chromium lays it out, with the chart's.
LABEL_BOXES = """svgs => svgs.map(svg => {
    const box = r => { const b = r.getBoundingClientRect(); return [b.left, b.right]; };
    return {chart: box(svg), labels: [...svg.querySelectorAll("text.time")].map(box)};
})"""


def assert_apart(charts: list[dict[str, Any]]) -> None:
    """No two time labels of a chart overlap (nor touch), and each lies within its chart."""
    for chart in charts:
        left, right = chart["chart"]
        labels = sorted(chart["labels"])
        assert len(labels) >= 2, chart
        assert all(left - 0.5 <= a and b <= right + 0.5 for a, b in labels), chart
        for (_, end), (start, _) in itertools.pairwise(labels):
            assert start - end >= 2, chart


def test_the_job_page_charts_steps_and_loss_beside_its_gpus_with_labels_apart(
    fleet: Hub, chromium: Browser
) -> None:
    with Client(fleet.controller_api, fleet.user_token("alice")) as alice:
        job = alice.submit(
            EPOCHS,
            gpus=2,
            gpu_type="A100-80GB",
            project="vision",
            name="epochs",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.3"},
        )
        ended = alice.wait(job.id, timeout=120)
    assert ended.outcome == "succeeded", ended.reason
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "alice")
        page.goto(f"/services/gpufleet/jobs/{job.id}")
        expect(page.locator("#last-step")).to_contain_text("Epoch 1, step 24")
        expect(page.locator("#checkpoints")).to_contain_text("2 checkpoint(s) saved")
        expect(page.locator("#checkpoints")).to_contain_text("epoch 1, step 24")
        steps = page.locator("#progress-chart svg polyline.series.steps")
        loss = page.locator("#progress-chart svg polyline.series.loss")
        expect(steps).to_have_count(1)
        expect(loss).to_have_count(1)
        # A point for each report: the saw of two epochs, and the loss falling.
        assert len((steps.get_attribute("points") or "").split()) >= 6
        assert len((loss.get_attribute("points") or "").split()) >= 6
        expect(page.locator("#progress-chart svg line.epoch")).to_have_count(1)
        expect(page.locator("#gpu-chart svg polyline.series.utilization").first).to_be_attached()
        # Both charts span one window: the same time labels, none overlapping.
        charts = page.locator("#charts svg").evaluate_all(LABEL_BOXES)
        assert len(charts) == 2
        assert_apart(charts)
        texts = [
            page.locator(f"{c} svg text.time").all_text_contents()
            for c in ("#progress-chart", "#gpu-chart")
        ]
        assert texts[0] == texts[1] and all(
            re.fullmatch(r"\d\d:\d\d(:\d\d)? UTC", t) for t in texts[0]
        )
        kinds = page.locator("#timeline tr[class^=event-]").evaluate_all(
            "rows => rows.map(r => r.className)"
        )
        assert "event-job-checkpoint-saved" not in kinds and "event-ended" in kinds
    finally:
        context.close()


def test_time_labels_stay_apart_in_chromium_at_every_window(chromium: Browser) -> None:
    since = datetime(2026, 1, 12, 9, 0, 55, 250_000, tzinfo=UTC)
    spans = [timedelta(seconds=s) for s in (1, 5, 12, 40, 95, 200, 420, 1000, 3600, 5400)]
    spans += [timedelta(hours=h) for h in (9, 24, 30)] + [timedelta(days=d) for d in (4, 20, 60)]
    svgs = []
    for span in spans:
        for offset in (timedelta(0), timedelta(seconds=10), timedelta(minutes=59, seconds=5)):
            start = since + offset
            points = [ProgressPoint(start, 1, None, 1.0), ProgressPoint(start + span, 9, None, 0.5)]
            svgs.append(progress_svg(points, start, start + span, "t"))
    page = chromium.new_page()
    try:
        page.set_content("<!doctype html><body>" + "".join(f"<div>{s}</div>" for s in svgs))
        charts = page.locator("svg").evaluate_all(LABEL_BOXES)
    finally:
        page.close()
    assert len(charts) == len(svgs)
    assert_apart(charts)
