"""After a cull, in headless Chromium: the server's URL says it was culled, when and why,
and offers to start it again with its snapshot; "Your snapshots" lists each snapshot once;
and the spawn form says which project's snapshot a start restores, and where a newer one
is. On a culling hub as the demo's: snapshots in a local directory (the default), and
conftest.CULLER_CONFIG (vision culls after 20 s idle, nlp only marks idle sessions).

Its own module: Playwright's sync API keeps an asyncio loop running while it is started
(see test_browser.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from . import browser as ui
from .conftest import CULLER_CONFIG
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TIME = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


@pytest.fixture(scope="module")
def culling_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    instance = Hub.create(Path(tmp_path_factory.mktemp("local-culler")), CULLER_CONFIG)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


def snapshots(hub: Hub, username: str) -> list[dict[str, Any]]:
    response = hub.controller("GET", "/snapshots", params={"username": username})
    response.raise_for_status()
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def snapshot_ids(items: list[dict[str, Any]]) -> Counter[str]:
    return Counter(s["manifest_key"].rsplit("/", 1)[-1] for s in items)


def test_a_culled_server_says_why_and_the_restore_is_named_per_project(
    culling_hub: Hub, chromium: Browser
) -> None:
    hub = culling_hub
    alice = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=1)
    ended = hub.wait_ended(alice, 120)
    assert ended["outcome"] == "stopped"
    # The culler recorded its live snapshot and the final pass of the stop; the index's
    # scan of the store finds them again, and each stays one row (the culler records them
    # under the names the scan uses).
    wait_for(
        lambda: len(snapshot_ids(snapshots(hub, "alice"))) >= 2,
        90,
        "the live and the final snapshot in the index",
    )
    assert set(snapshot_ids(snapshots(hub, "alice")).values()) == {1}
    context = ui.new_context(chromium, hub.url)
    try:
        page = ui.login(context, "alice")
        page.goto("/user/alice/")
        expect(page.locator("h1")).to_have_text("Server culled")
        told = page.locator("#gpufleet-ended")
        expect(told).to_contain_text(re.compile(rf"was culled \(stopped by gpufleet\) at {TIME}"))
        expect(told).to_contain_text("idle for")
        restores = page.locator("#gpufleet-restores")
        expect(restores).to_contain_text(
            re.compile(
                rf"Start it again in Computer vision to get back what its snapshot of {TIME}"
            )
        )
        start = page.locator("#start")
        expect(start).to_have_text("Start it again (restores its snapshot)")
        expect(start).to_have_attribute("href", re.compile(r"/hub/spawn"))

        # "Your snapshots": each snapshot once, the one a start in vision restores marked.
        page.goto("/services/gpufleet/")
        keys = page.locator("#snapshots tr[data-snapshot]").evaluate_all(
            "rows => rows.map(r => r.dataset.snapshot)"
        )
        assert len(keys) == len(set(keys)) == len(snapshot_ids(snapshots(hub, "alice"))), keys
        expect(page.locator("#snapshots .badge")).to_have_text(
            ["restored at the next start in Computer vision"]
        )

        # Then a session in nlp, stopped: its snapshot is the newest, in another project.
        hub.start_session("alice", project="nlp", gpu_type="A100-80GB", gpus=1)
        hub.stop_server("alice")
        hub.wait_gone("alice")
        wait_for(
            lambda: (
                page.goto("/services/gpufleet/") and page.locator("#snapshots .badge").count() == 2
            ),
            90,
            "the nlp snapshot in the index",
        )
        ui.open_spawn_form(page)
        note = page.locator("#gpufleet-restore")
        page.locator("#gpufleet-project").select_option("vision")
        expect(note).to_contain_text(
            re.compile(rf"Starting in Computer vision restores what its snapshot of {TIME}")
        )
        expect(note).to_contain_text(
            re.compile(rf"Your newest snapshot, of {TIME}, is in Language models")
        )
        page.locator("#gpufleet-project").select_option("nlp")
        expect(note).to_contain_text("Starting in Language models restores")
        expect(note).not_to_contain_text("Your newest snapshot")
    finally:
        context.close()
        hub.stop_all_servers()
