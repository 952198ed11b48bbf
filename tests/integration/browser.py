"""Headless Chromium for the browser tests, driven through Playwright's sync API.

Playwright's own browser download is not available everywhere these tests run, so they
launch the system's Chromium ($GPUFLEET_CHROMIUM, default /usr/bin/chromium). The
fixtures that use these helpers live in test_browser.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    Playwright,
    expect,
    sync_playwright,
)

CHROMIUM = Path(os.environ.get("GPUFLEET_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # the tests may run as root
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# jupyterhub_config.py reads the same variable for SharedPasswordAuthenticator.
PASSWORD = os.environ.get("GPUFLEET_DEMO_PASSWORD", "gpufleet-demo")

# Generous: the tests must hold on a slow two-core machine running other tests too.
PAGE_TIMEOUT_MS = 30_000
LAB_TIMEOUT_MS = 90_000


def launch(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
    )


@contextmanager
def chromium() -> Iterator[Browser]:
    """One Chromium for a test module; skips when there is none. Wrap it in a
    module-scoped fixture: while Playwright's sync API is started it keeps an asyncio loop
    running in the main thread, so asyncio.run() (harness.run_in_kernel) and
    pytest-asyncio tests in other modules would fail if it outlived the module."""
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (set GPUFLEET_CHROMIUM)")
    # Assertions wait for the hub and the controller: far longer than Playwright's 5 s
    # default on a busy two-core machine.
    expect.set_options(timeout=PAGE_TIMEOUT_MS)
    with sync_playwright() as playwright:
        instance = launch(playwright)
        try:
            yield instance
        finally:
            instance.close()


def new_context(browser: Browser, base_url: str) -> BrowserContext:
    context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    context.set_default_navigation_timeout(PAGE_TIMEOUT_MS)
    return context


def login(context: BrowserContext, username: str) -> Page:
    """Log ``username`` in through the hub's login form; returns the page, logged in."""
    page = context.new_page()
    page.goto("/hub/login")
    page.locator("#username_input").fill(username)
    page.locator("#password_input").fill(PASSWORD)
    page.locator("#login_submit").click()
    expect(page).not_to_have_url(re.compile(r"/hub/login"), timeout=PAGE_TIMEOUT_MS)
    expect(page.locator("#login_submit")).to_have_count(0)
    return page


def open_spawn_form(page: Page) -> None:
    page.goto("/hub/spawn")
    expect(page).to_have_url(re.compile(r"/hub/spawn(\?|$)"))
    expect(page.locator("#gpufleet-spawn-form")).to_be_visible()


def fill_spawn_form(page: Page, *, project: str, gpu_type: str, gpus: str) -> None:
    page.locator("#gpufleet-project").select_option(project)
    page.locator("#gpufleet-gpu-type").select_option(gpu_type)
    page.locator("#gpufleet-gpus").fill(gpus)


def submit_spawn_form(page: Page) -> None:
    page.locator("#spawn_form").get_by_role("button", name="Start").click()


def drop_client_side_checks(page: Page) -> None:
    """Let anything through the browser, as a hand-crafted POST would."""
    page.evaluate(
        """() => {
            const input = document.getElementById("gpufleet-gpus");
            for (const attribute of ["min", "max", "step"]) input.removeAttribute(attribute);
            input.type = "text";
            document.getElementById("spawn_form").noValidate = true;
        }"""
    )


def expect_jupyterlab(page: Page, username: str) -> None:
    """The page ends up in the user's JupyterLab with its shell rendered."""
    expect(page).to_have_url(re.compile(rf"/user/{username}/lab"), timeout=LAB_TIMEOUT_MS)
    expect(page.locator("#jp-main-dock-panel")).to_be_visible(timeout=LAB_TIMEOUT_MS)
    expect(page.locator("#jp-menu-panel")).to_be_visible(timeout=LAB_TIMEOUT_MS)
