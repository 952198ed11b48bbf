"""What a researcher sees in the browser: the spawn form, its errors, the queue, JupyterLab."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect

from . import browser as ui
from .harness import Hub, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]

QUEUE_TIMEOUT_MS = 30_000
# For checks on a page that has finished loading: a failure need not wait 30 s.
SETTLED_MS = 2_000


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


@pytest.fixture
def context(chromium: Browser, fleet: Hub) -> Iterator[BrowserContext]:
    """A fresh browser profile; closed before ``fleet`` stops the servers."""
    instance = ui.new_context(chromium, fleet.url)
    try:
        yield instance
    finally:
        instance.close()


def project_choices(page: Page) -> list[str]:
    options = page.locator("#gpufleet-project option")
    return [str(value) for value in options.evaluate_all("els => els.map(e => e.value)")]


def test_researcher_starts_a_gpu_session_from_the_form(
    fleet: Hub, context: BrowserContext, tmp_path: Path
) -> None:
    page = ui.login(context, "alice")
    ui.open_spawn_form(page)
    assert sorted(project_choices(page)) == ["nlp", "vision"]
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="2")
    page.screenshot(path=tmp_path / "spawn-form.png", full_page=True)

    ui.submit_spawn_form(page)
    ui.expect_jupyterlab(page, "alice")

    workload = fleet.workload_of("alice")
    assert workload is not None
    assert workload["state"] == "running"
    assert workload["project"] == "vision"
    assert workload["gpu_type"] == "A100-80GB"
    assert len(workload["allocations"]) == 2
    model = fleet.server_model("alice")
    assert model is not None and model["ready"]


@pytest.mark.parametrize(
    ("gpus", "fix"),
    [
        ("0", "at least 1 GPU"),
        ("9", "largest A100-80GB node has 4"),
        ("two", "must be a whole number"),
    ],
)
def test_bad_gpu_count_is_explained_and_allocates_nothing(
    fleet: Hub, context: BrowserContext, gpus: str, fix: str
) -> None:
    before = len(fleet.workloads(username="alice"))
    page = ui.login(context, "alice")
    ui.open_spawn_form(page)
    count = page.locator("#gpufleet-gpus")
    if gpus.isdigit():
        # The browser refuses this itself; a hand-crafted POST gets past that.
        count.fill(gpus)
        assert count.evaluate("el => el.checkValidity()") is False
    ui.drop_client_side_checks(page)
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus=gpus)

    ui.submit_spawn_form(page)

    # Normally the form comes back with the message. When the controller needs more than
    # JupyterHub's one second to reject, the spawn-pending page shows it instead; that
    # case has a test of its own below, so a busy machine does not fail this one.
    shown = page.locator(".spawn-error-msg, #progress-message")
    expect(shown).to_contain_text(fix)
    if "/hub/spawn-pending/" not in page.url:
        expect(page).to_have_url(re.compile(r"/hub/spawn(\?|$)"))
        # The form is offered again with the choices made, ready to be corrected.
        expect(page.locator("#gpufleet-spawn-form")).to_be_visible()
        expect(page.locator("#gpufleet-project")).to_have_value("vision")
        expect(page.locator("#gpufleet-gpu-type")).to_have_value("A100-80GB")
    wait_for(lambda: fleet.server_model("alice") is None, 30, "alice's failed spawn cleaned up")
    assert fleet.workload_of("alice") is None
    assert len(fleet.workloads(username="alice")) == before, "a GPU request was opened"


def test_rejection_reads_as_an_invalid_gpu_request_without_http_jargon(
    fleet: Hub, context: BrowserContext
) -> None:
    page = ui.login(context, "alice")
    ui.open_spawn_form(page)
    ui.drop_client_side_checks(page)
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="0")

    ui.submit_spawn_form(page)

    error = page.locator(".spawn-error-msg")
    expect(error).to_contain_text("at least 1 GPU")
    # The spawner raises HTTPError(400, reason="Invalid GPU request"); what a researcher
    # reads should be that, not "HTTP 400: error (...)".
    expect(error).to_contain_text("Invalid GPU request", timeout=SETTLED_MS)
    expect(error).not_to_contain_text("HTTP 400", timeout=SETTLED_MS)


def test_rejection_comes_back_on_the_form_even_when_the_controller_is_slow(
    fleet: Hub, context: BrowserContext
) -> None:
    """JupyterHub waits one second for a spawn before it sends the browser to the pending
    page; a rejection that takes longer must still come back on the form."""
    page = ui.login(context, "alice")
    ui.open_spawn_form(page)
    ui.drop_client_side_checks(page)
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="0")
    controller = fleet.controller_pid()
    assert controller is not None

    def resume() -> None:
        os.kill(controller, signal.SIGCONT)

    # Fault injection, not synchronisation: the controller answers 2 s late.
    os.kill(controller, signal.SIGSTOP)
    late = threading.Timer(2.0, resume)
    late.start()
    try:
        ui.submit_spawn_form(page)
        expect(page.locator(".spawn-error-msg, #progress-message")).to_contain_text(
            "at least 1 GPU"
        )
    finally:
        late.cancel()
        resume()

    expect(page).to_have_url(re.compile(r"/hub/spawn(\?|$)"), timeout=SETTLED_MS)
    expect(page.locator(".spawn-error-msg")).to_contain_text("at least 1 GPU")
    expect(page.locator("#gpufleet-spawn-form")).to_be_visible()
    wait_for(lambda: fleet.server_model("alice") is None, 30, "alice's failed spawn cleaned up")
    assert fleet.workload_of("alice") is None


def test_queued_session_shows_its_place_and_starts_by_itself(
    fleet: Hub, context: BrowserContext, tmp_path: Path
) -> None:
    assert fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=4).status_code in (
        201,
        202,
    )
    fleet.wait_ready("alice")

    page = ui.login(context, "bob")
    ui.open_spawn_form(page)
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="2")
    ui.submit_spawn_form(page)

    expect(page).to_have_url(re.compile(r"/hub/spawn-pending/bob"))
    message = page.locator("#progress-message")
    expect(message).to_contain_text("position 1", timeout=QUEUE_TIMEOUT_MS)
    expect(message).to_contain_text("4/4 guaranteed")
    expect(message).to_contain_text("needs 2 × A100-80GB")
    log = page.locator("#progress-log")
    expect(log).to_contain_text("Queued: position 1")
    expect(log).to_contain_text("project vision uses 4/4 guaranteed A100-80GB and may borrow 0")
    page.screenshot(path=tmp_path / "queued.png", full_page=True)
    waiting = fleet.workload_of("bob")
    assert waiting is not None and waiting["state"] == "pending"
    assert waiting["queue_position"] == 1

    assert fleet.stop_server("alice").status_code in (202, 204)

    ui.expect_jupyterlab(page, "bob")
    started = wait_for(
        lambda: (w := fleet.workload_of("bob")) and w["state"] == "running" and w,
        30,
        "bob's workload running",
    )
    assert len(started["allocations"]) == 2
    assert fleet.workload_of("alice") is None


def test_form_offers_only_the_users_own_projects(fleet: Hub, context: BrowserContext) -> None:
    page = ui.login(context, "carol")
    ui.open_spawn_form(page)

    assert project_choices(page) == ["nlp"]
    project = page.locator("#gpufleet-project")
    expect(project).to_have_value("nlp")
    expect(project.locator("option")).to_have_text(["Language models"])
    expect(page.locator("#gpufleet-spawn-form")).not_to_contain_text("Computer vision")
    quota_lines = page.locator("#gpufleet-spawn-form li[data-project]")
    expect(quota_lines).to_have_count(1)
    expect(quota_lines).to_have_attribute("data-project", "nlp")


def test_form_note_about_the_queue_renders_as_one_block(
    fleet: Hub, context: BrowserContext
) -> None:
    """The muted note holds the project quotas and the queue explanation together."""
    page = ui.login(context, "carol")
    ui.open_spawn_form(page)

    note = page.locator("#gpufleet-spawn-form .text-muted")
    expect(note).to_have_count(1, timeout=SETTLED_MS)
    expect(note).to_contain_text("Your projects", timeout=SETTLED_MS)
    expect(note.locator("li[data-project]")).to_have_count(1, timeout=SETTLED_MS)
    expect(note).to_contain_text("your session waits in a queue", timeout=SETTLED_MS)


def test_a_user_in_no_project_is_told_whom_to_ask_and_offered_no_start_button(
    fleet: Hub, context: BrowserContext
) -> None:
    # The demo's admin is a gpufleet admin in no project; any new name is in none either.
    for username in ("admin", "dora"):
        page = ui.login(context, username)
        page.goto("/hub/spawn")
        warning = page.locator("#gpufleet-no-project")
        expect(warning).to_be_visible()
        expect(warning).to_contain_text("You are in no gpufleet project yet")
        expect(warning).to_contain_text("gpufleet-admins")
        expect(page.locator("#spawn_form").get_by_role("button", name="Start")).to_be_hidden()
        page.goto("/hub/logout")
    assert fleet.workload_of("admin") is None and fleet.workload_of("dora") is None
