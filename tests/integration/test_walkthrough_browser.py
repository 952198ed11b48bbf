"""The README's demo, end to end in Chromium, as a newcomer follows it: log in as alice, pick
a project and 2 GPUs, JupyterLab opens; in a new notebook, ``%load_ext gpufleet`` and a
``%%train`` cell train with PyTorch on 2 GPUs (the sessions' environment has it), and the
``gpufleet`` command answers from the session's shell with nothing to configure."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect

from . import browser as ui
from .harness import Hub

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TRAIN = """%%train --gpus 2 --gpu-type A100-80GB --project vision --name demo
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} sum {total.item():.0f} gpus {os.environ['CUDA_VISIBLE_DEVICES']}")
dist.destroy_process_group()"""

WAIT = """from gpufleet.client import Client
with Client() as fleet:
    job = next(j for j in fleet.jobs() if j.name == "demo")
    job = fleet.wait(job, timeout=180)
    print("job", job.outcome, "".join(fleet.logs(job, rank=1)).strip())"""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


@pytest.fixture
def context(chromium: Browser, fleet: Hub) -> Iterator[BrowserContext]:
    instance = ui.new_context(chromium, fleet.url)
    try:
        yield instance
    finally:
        instance.close()


def run_cell(page: Page, index: int, code: str) -> None:
    """Type ``code`` into the notebook's cell ``index`` and run it (Shift+Enter)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".cm-content").click()
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")


def output_of(page: Page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


def test_the_readme_demo_trains_from_a_notebook_and_the_cli_answers_in_the_session(
    fleet: Hub, context: BrowserContext
) -> None:
    page = ui.login(context, "alice")
    ui.open_spawn_form(page)
    ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="2")
    ui.submit_spawn_form(page)
    ui.expect_jupyterlab(page, "alice")

    # A new notebook from the launcher, on the session's own Python.
    page.locator('.jp-LauncherCard[data-category="Notebook"]').first.click()
    expect(page.locator(".jp-Notebook .jp-Cell").first).to_be_visible(timeout=ui.LAB_TIMEOUT_MS)
    # The kernel is up (cells run before it is are not queued by every JupyterLab).
    expect(page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle"))).to_be_visible(
        timeout=ui.LAB_TIMEOUT_MS
    )
    run_cell(page, 0, "%load_ext gpufleet\nprint('loaded')")
    expect(page.locator(".jp-Notebook .jp-Cell").nth(0).locator(".jp-OutputArea")).to_contain_text(
        "loaded", timeout=ui.LAB_TIMEOUT_MS
    )
    run_cell(page, 1, TRAIN)
    expect(page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea")).to_contain_text(
        "demo", timeout=ui.LAB_TIMEOUT_MS
    )
    run_cell(page, 2, WAIT)
    expect(page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-OutputArea")).to_contain_text(
        "job succeeded", timeout=200_000
    )
    assert re.search(r"rank 1 sum 3 gpus \S+,\S+", output_of(page, 2)), output_of(page, 2)
    # The gpufleet command in the session's shell: on PATH, and configured by the session.
    run_cell(page, 3, "!gpufleet jobs")
    expect(page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-OutputArea")).to_contain_text(
        "demo", timeout=ui.LAB_TIMEOUT_MS
    )
    assert "Traceback" not in output_of(page, 3)
