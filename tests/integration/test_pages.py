"""The controller's own page, reached through the hub's OAuth in headless Chromium."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from .browser import launch, login, new_context
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            yield browser
        finally:
            browser.close()


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
