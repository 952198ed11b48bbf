"""The culler's notices as a researcher sees them: in JupyterLab, in headless Chromium, on a
real hub whose vision project stops idle sessions (20 s, warned 6 s before) and whose nlp
project only marks them (``conftest.CULLER_CONFIG``).

Its own module: Playwright's sync API keeps an asyncio loop running while it is started
(see test_browser.py), which test_culler.py's kernels (asyncio.run) must not meet.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from . import browser as ui
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


def events(hub: Hub, workload_id: int, kind: str) -> list[dict[str, Any]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e.get("workload_id") == workload_id and e["kind"] == kind]


def test_the_idle_notice_shows_in_jupyterlab_and_keep_alive_clears_the_mark(
    culling_hub: Hub, chromium: Browser
) -> None:
    hub = culling_hub
    carol = hub.start_session("carol", project="nlp", gpu_type="A100-80GB", gpus=2)
    context = ui.new_context(chromium, hub.url)
    try:
        page = ui.login(context, "carol")
        page.goto("/user/carol/lab")
        expect(page.locator("#jp-main-dock-panel")).to_be_visible(timeout=ui.LAB_TIMEOUT_MS)
        # Idle by every signal with the lab open: warned, then marked; the notice says so.
        notice = page.get_by_text(re.compile(r"Idle for \d+"))
        expect(notice.first).to_be_visible(timeout=60_000)
        wait_for(lambda: events(hub, carol["id"], "session-marked-idle"), 60, "carol marked idle")
        page.get_by_role("button", name="Keep alive 1 hour").first.click()
        wait_for(lambda: events(hub, carol["id"], "session-keep-alive"), 30, "the keep-alive")
        kept = hub.controller("GET", f"/workloads/{carol['id']}").json()
        assert kept["state"] == "running"
        keep_alive = events(hub, carol["id"], "session-keep-alive")[0]["message"]
        assert keep_alive.startswith("kept alive by carol until")
        # The notice is gone with the mark, and the session says until when it is kept.
        state = hub.controller(
            "GET", f"/sessions/{carol['id']}/activity", token=hub.user_token("carol")
        ).json()
        assert state["notices"] == [] and state["keep_alive_until"]
    finally:
        context.close()
        hub.stop_all_servers()


def test_the_warning_shows_in_jupyterlab_before_the_stop_and_the_resume_says_what_happened(
    culling_hub: Hub, chromium: Browser
) -> None:
    hub = culling_hub
    alice = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    context = ui.new_context(chromium, hub.url)
    try:
        page = ui.login(context, "alice")
        page.goto("/user/alice/lab")
        expect(page.locator("#jp-main-dock-panel")).to_be_visible(timeout=ui.LAB_TIMEOUT_MS)
        # The warning stands for 6 s: the lab looks every 1.5 s (the controller's poll_s).
        warning = page.get_by_text(re.compile(r"Idle for \d+.*snapshotted and stopped at"))
        expect(warning.first).to_be_visible(timeout=60_000)
        ended = hub.wait_ended(alice, 90)
        assert ended["outcome"] == "stopped"
        warned = events(hub, alice["id"], "session-idle-warning")
        assert warned and events(hub, alice["id"], "session-snapshot")

        # Back again from the spawn page: the restore shows there, before JupyterLab
        # starts; the restored session's JupyterLab then says what happened.
        ui.open_spawn_form(page)
        ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="2")
        ui.submit_spawn_form(page)
        expect(page.locator("#progress-log")).to_contain_text("Restoring your last snapshot")
        ui.expect_jupyterlab(page, "alice")
        resumed = page.get_by_text(re.compile(r"Culled at .*restored from snapshot"))
        expect(resumed.first).to_be_visible(timeout=30_000)
    finally:
        context.close()
        hub.stop_all_servers()
