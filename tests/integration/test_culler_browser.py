"""The culler's notices as a researcher sees them: in JupyterLab, in headless Chromium, on a
real hub whose vision project stops idle sessions (20 s, warned 10 s before), whose speech
project stops them (40 s) warned 25 s before, and whose nlp project only marks them
(``conftest.CULLER_CONFIG``, the culler looking every second).

An open JupyterLab polls its server on its own (kernels, sessions, contents, terminals,
notices): a tab left open and untouched is idle, and is warned and stopped at the time
the warning gave; a cell run in it is use.

Its own module: Playwright's sync API keeps an asyncio loop running while it is started
(see test_browser.py), which test_culler.py's kernels (asyncio.run) must not meet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from . import browser as ui
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CULL_INTERVAL = timedelta(seconds=1)  # conftest.CULLER_CONFIG
# What a busy two-core machine adds to a step: the culler's round running late, the stop
# request, the hub's answer, this test's look.
STOP_LATENCY = timedelta(seconds=2)
NOTEBOOK = {
    "type": "notebook",
    "content": {
        "cells": [
            {
                "cell_type": "code",
                "source": "",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
            }
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    },
}


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


def events(hub: Hub, workload_id: int, kind: str) -> list[dict[str, Any]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e.get("workload_id") == workload_id and e["kind"] == kind]


def open_lab(hub: Hub, chromium: Browser, username: str, path: str = "") -> Page:
    context = ui.new_context(chromium, hub.url)
    page = ui.login(context, username)
    page.goto(f"/user/{username}/lab{path}")
    expect(page.locator("#jp-main-dock-panel")).to_be_visible(timeout=ui.LAB_TIMEOUT_MS)
    return page


def stopping(hub: Hub, username: str) -> datetime | None:
    """Now, if the hub says the server is no longer up (stopping or gone)."""
    model = hub.server_model(username)
    if model is None or not model.get("ready") or model.get("pending") == "stop":
        return datetime.now(UTC)
    return None


def activity(hub: Hub, session: dict[str, Any]) -> dict[str, Any]:
    """What the session's own page asks for: its notices and keep-alive, as its owner."""
    username = session["username"]
    response = hub.controller(
        "GET", f"/sessions/{session['id']}/activity", token=hub.user_token(username)
    )
    state: dict[str, Any] = response.json()
    return state


def warnings(hub: Hub, session: dict[str, Any]) -> list[dict[str, Any]]:
    """The session's notices that warn (an idle mark, a coming stop), not those that inform."""
    return [n for n in activity(hub, session)["notices"] if n["level"] == "warning"]


def toasts(page: Page) -> list[str]:
    """The notifications on screen, top to bottom."""
    texts: list[str] = page.locator(".jp-toast-message").all_inner_texts()
    return [" ".join(text.split()) for text in texts]


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
        assert warnings(hub, carol)
        page.get_by_role("button", name="Keep alive 1 hour").first.click()
        wait_for(lambda: events(hub, carol["id"], "session-keep-alive"), 30, "the keep-alive")
        kept = hub.controller("GET", f"/workloads/{carol['id']}").json()
        assert kept["state"] == "running"
        keep_alive = events(hub, carol["id"], "session-keep-alive")[0]["message"]
        assert keep_alive.startswith("kept alive by carol until")
        # The idle warning is gone with the mark, and the session says until when it is kept.
        # Notices that only inform may stay: where an earlier test culled carol's nlp
        # session, this one is its restore and says so.
        assert warnings(hub, carol) == []
        assert activity(hub, carol)["keep_alive_until"]
    finally:
        context.close()
        hub.stop_all_servers()


def test_an_untouched_jupyterlab_tab_is_warned_and_culled_at_the_time_it_was_told(
    culling_hub: Hub, chromium: Browser
) -> None:
    hub = culling_hub
    bob = hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    page = open_lab(hub, chromium, "bob")
    try:
        # Nothing touches the page from here: only JupyterLab's own requests reach the
        # server, and the hub's last_activity moves with them. The session is idle anyway.
        warning = page.get_by_text(re.compile(r"Idle for \d+ s .*snapshotted and stopped at"))
        expect(warning.first).to_be_visible(timeout=60_000)
        (warned,) = events(hub, bob["id"], "session-idle-warning")
        assert "(last in use: the session started)" in warned["message"]
        due = datetime.fromisoformat(warned["data"]["due_at"])
        # A warning this short gives its time to the second, as the toast says it.
        assert warned["message"].endswith(f"stopped at {due:%H:%M:%S} UTC"), warned["message"]
        assert any(text.endswith(f"stopped at {due:%H:%M:%S} UTC") for text in toasts(page))
        # JupyterLab's own question about its news has no place in a session.
        expect(page.get_by_text("official Jupyter news")).to_have_count(0)

        stopped = wait_for(lambda: stopping(hub, "bob"), 60, "the server to stop")
        assert hub.wait_ended(bob, 90)["outcome"] == "stopped"
        assert not events(hub, bob["id"], "session-warning-withdrawn")
        # The culler acted at the time it gave, within its round (its own clock, which a
        # busy machine disturbs least); the hub said so soon after.
        (cull,) = events(hub, bob["id"], "session-cull")
        culled = datetime.fromisoformat(cull["at"])
        assert timedelta(0) <= culled - due <= CULL_INTERVAL + STOP_LATENCY, (culled, due)
        assert stopped - due <= CULL_INTERVAL + 2 * STOP_LATENCY, f"stopped at {stopped}"
        # Its live snapshot was taken while the warning stood, not after the time it gave.
        (live,) = events(hub, bob["id"], "session-snapshot")
        assert datetime.fromisoformat(live["at"]) <= culled
    finally:
        page.context.close()
        hub.stop_all_servers()


def test_a_cell_run_in_jupyterlab_withdraws_the_warning_and_keeps_the_session(
    culling_hub: Hub, chromium: Browser
) -> None:
    hub = culling_hub
    bob = hub.start_session("bob", project="speech", gpu_type="A100-80GB", gpus=1)
    token = hub.user_token("bob")
    created = httpx.put(
        f"{hub.url}/user/bob/api/contents/work.ipynb",
        headers={"Authorization": f"token {token}"},
        content=json.dumps(NOTEBOOK),
        timeout=30,
    )
    assert created.status_code == 201, created.text
    page = open_lab(hub, chromium, "bob", "/tree/work.ipynb")
    try:
        warning = page.get_by_text(re.compile(r"Idle for \d+ s .*snapshotted and stopped at"))
        expect(warning.first).to_be_visible(timeout=60_000)

        # A warning given before the session's report of the notebook's creation arrived
        # is withdrawn by that report (the creation was use): the one that stands counts.
        def standing() -> list[dict[str, Any]] | None:
            warned = events(hub, bob["id"], "session-idle-warning")
            withdrawn = events(hub, bob["id"], "session-warning-withdrawn")
            return warned if len(warned) > len(withdrawn) else None

        warned = wait_for(standing, 60, "a warning that stands")[0]  # the newest
        expect(warning.first).to_be_visible(timeout=30_000)
        withdrawn_before = len(events(hub, bob["id"], "session-warning-withdrawn"))
        due = datetime.fromisoformat(warned["data"]["due_at"])
        # The researcher comes back and runs a cell: the warning goes, the session stays.
        page.locator(".jp-Notebook .jp-Cell .jp-InputArea-editor").first.click()
        page.keyboard.type("print(6 * 7)")
        page.keyboard.press("Shift+Enter")
        expect(page.locator(".jp-OutputArea-output").first).to_have_text("42")
        withdrawn = wait_for(
            lambda: (
                (found := events(hub, bob["id"], "session-warning-withdrawn"))
                and len(found) > withdrawn_before
                and found
            ),
            30,
            "the withdrawal",
        )
        # The researcher's use withdraws it: the kernel's report (it says "running" when it
        # came while the cell ran, "ran" after), or a save of the notebook JupyterLab made
        # meanwhile, whichever reaches the controller first.
        said = withdrawn[0]["message"]
        use = r"(a kernel (ran|is running) code|a file saved or changed in JupyterLab)$"
        assert re.search(use, said), said
        expect(warning).to_have_count(0)
        wait_for(
            lambda: datetime.now(UTC) > due + CULL_INTERVAL + STOP_LATENCY,
            30,
            "the time the warning gave, and the culler's round after it, to pass",
        )
        assert (hub.workload_of("bob") or {}).get("state") == "running"
        assert not events(hub, bob["id"], "session-cull")
    finally:
        page.context.close()
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
        # The warning stands for 10 s: the lab looks every 1.5 s (the controller's poll_s).
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
        again = hub.workload_of("alice")
        assert again is not None
        notices = hub.controller(
            "GET", f"/sessions/{again['id']}/activity", token=hub.user_token("alice")
        ).json()["notices"]
        # (The culler's warning may stand beside it by now: this hub's time-out is 20 s.)
        (notice,) = [n for n in notices if n["level"] == "info"]
        message = notice["message"]
        # Its home stayed on the node; its emptied overlay (all it changed outside the home)
        # came back, said in words rather than by a snapshot's id.
        assert "restored from snapshot: the packages you installed and other system" in message
        assert message.endswith("Kernels were restarted.")
        # Said in full: longer than a notification holds, so in parts, none cut short.
        expect(page.get_by_text("Kernels were restarted.").first).to_be_visible(timeout=30_000)
        shown = [text for text in toasts(page) if text in message]
        assert " ".join(shown) == message, shown
        assert len(shown) > 1 and not any("…" in text for text in toasts(page))
        # The notification centre lists the same parts, as whole.
        page.locator(".jp-Notification-Status").click()
        listed = page.locator(".jp-Notification-List .jp-toast-message")
        expect(listed.filter(has_text="Kernels were restarted.")).to_have_count(1)
        in_centre = [" ".join(t.split()) for t in listed.all_inner_texts()]
        assert " ".join(t for t in in_centre if t in message) == message, in_centre
    finally:
        context.close()
        hub.stop_all_servers()
