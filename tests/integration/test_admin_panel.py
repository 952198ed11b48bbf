"""The admin panel in headless Chromium, against the shared test hub (two nodes of 4
A100-80GB; the organisation research holds the projects vision, guaranteed 4 and no
borrowing, and nlp, guaranteed 4): an admin lowers a quota and the next spawn queues;
Cordon, Drain and Recycle ask first, and a dismissed question changes nothing; a drain
at a time is scheduled, shown and cancelled; the organisation's row counts its
projects' GPUs; a node's row shows each GPU's utilisation and holder; a refused change
writes nothing; a researcher neither sees the panel nor reaches it, by page or by API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Dialog, Locator, Page, expect

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.recovery.fake_nvml import FakeGpu, write_control

from . import browser as ui
from .browser import login, new_context
from .harness import Hub, wait_for
from .test_agent import DECLARED

pytestmark = [pytest.mark.integration, pytest.mark.browser]

PANEL = "/services/gpufleet/admin"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


@pytest.fixture
def vision_quota(fleet: Hub) -> Iterator[dict[str, Any]]:
    """Vision's A100-80GB quota as it was; put back afterwards."""
    projects = fleet.controller("GET", "/projects").json()["items"]
    vision = next(p for p in projects if p["name"] == "vision")
    quota = next(q for q in vision["quotas"] if q["gpu_type"] == "A100-80GB")
    yield quota
    restore = {k: quota[k] for k in ("guaranteed", "borrow_limit", "lend_limit")}
    fleet.controller("PATCH", "/projects/vision", json={"quotas": {"A100-80GB": restore}})


@pytest.fixture
def admin_page(fleet: Hub, chromium: Browser) -> Iterator[Page]:
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "admin")
        page.goto("/hub/home")
        page.locator("#gpufleet-admin-nav").click()  # the hub's own navigation bar
        expect(page.locator("h1")).to_have_text("gpufleet admin")
        yield page
    finally:
        context.close()


def test_an_admin_lowers_a_quota_and_the_next_spawn_queues(
    fleet: Hub, admin_page: Page, vision_quota: dict[str, Any]
) -> None:
    assert vision_quota["guaranteed"] == 4
    form = admin_page.locator("#project-vision")
    row = form.locator("tr[data-gpu-type='A100-80GB']")
    expect(row).to_contain_text("0 / 4")
    row.locator("input[name='quota-A100-80GB-guaranteed']").fill("1")
    form.get_by_role("button", name="Save vision").click()
    expect(admin_page.locator("#saved")).to_have_text("vision: A100-80GB guaranteed 4 → 1")
    expect(admin_page.locator("#event-log")).to_contain_text(
        "vision: A100-80GB guaranteed 4 → 1 (by admin)"
    )

    def alice_waits() -> str | None:
        w = fleet.workload_of("alice")
        pending = w and w["state"] == "pending" and "may never hold" in w["reason"]
        return str(w["reason"]) if w and pending else None

    spawned = fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    assert spawned.status_code in (201, 202), spawned.text
    waiting = wait_for(alice_waits, 30, "alice's spawn to queue")
    assert "project vision may never hold more than 1 × A100-80GB" in waiting, waiting
    admin_page.goto(PANEL)
    expect(admin_page.locator("#queue")).to_be_visible()
    expect(admin_page.locator("tr[data-workload]").filter(has_text="alice")).to_contain_text(
        "may never hold more than 1 × A100-80GB (guarantee plus borrow limit)"
    )
    # Raising it again admits her on the next cycle.
    row = admin_page.locator("#project-vision tr[data-gpu-type='A100-80GB']")
    row.locator("input[name='quota-A100-80GB-guaranteed']").fill("4")
    admin_page.locator("#project-vision").get_by_role("button", name="Save vision").click()
    expect(admin_page.locator("#saved")).to_have_text("vision: A100-80GB guaranteed 1 → 4")
    fleet.wait_ready("alice")


def test_a_refused_change_says_why_and_writes_nothing(
    fleet: Hub, admin_page: Page, vision_quota: dict[str, Any]
) -> None:
    form = admin_page.locator("#project-vision")
    form.locator("input[name='quota-A100-80GB-lend']").fill("9")
    form.locator("input[name='weight']").fill("3")
    form.get_by_role("button", name="Save vision").click()
    expect(admin_page.locator("#error")).to_contain_text(
        "the lend limit (9) cannot exceed the guarantee (4); nothing was changed"
    )
    vision = next(
        p for p in fleet.controller("GET", "/projects").json()["items"] if p["name"] == "vision"
    )
    assert vision["fair_share_weight"] != 3
    assert vision["quotas"][0]["lend_limit"] == vision_quota["lend_limit"]


def re_words(text: str) -> re.Pattern[str]:
    """``text`` with any run of white space between its words (as the page lays it out)."""
    return re.compile(r"\s*" + r"\s+".join(map(re.escape, text.split())) + r"\s*")


def cordoned(fleet: Hub, node: str) -> bool:
    nodes = fleet.controller("GET", "/nodes").json()["items"]
    return bool(next(n["cordoned"] for n in nodes if n["name"] == node))


def drains_of(fleet: Hub, node: str) -> list[dict[str, Any]]:
    """The node's drains scheduled for later (``GET /timed``)."""
    timed: list[dict[str, Any]] = fleet.controller("GET", "/timed").json()["items"]
    return [job for job in timed if job["what"].startswith(f"drain {node} (")]


def accept_next(page: Page, asked: list[str]) -> None:
    """Accept the next confirmation the page asks, noting its question."""

    def accept(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)


def test_a_dismissed_confirmation_changes_nothing_and_an_accepted_one_cordons(
    fleet: Hub, admin_page: Page
) -> None:
    node = admin_page.locator("tr[data-node='gpu-node-a']")
    expect(node).to_contain_text("#0")  # its GPUs, each with its state
    posted: list[str] = []
    admin_page.on("request", lambda r: posted.append(r.url) if r.method == "POST" else None)
    asked: list[str] = []

    def dismiss(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    admin_page.on("dialog", dismiss)
    for button in ("Cordon", "Drain", "Recycle"):
        node.get_by_role("button", name=button, exact=True).click()
    admin_page.remove_listener("dialog", dismiss)
    assert asked == [
        "Cordon gpu-node-a? It takes no new work until it is uncordoned; what runs there "
        "keeps running.",
        "Drain gpu-node-a now? It is cordoned, its jobs restart elsewhere and its sessions "
        "are snapshotted and stop.",
        "Recycle gpu-node-a? It is drained now (its jobs restart elsewhere, its sessions are "
        "snapshotted and stop), recycled once empty, then diagnosed.",
    ]
    accept_next(admin_page, asked)
    node.get_by_role("button", name="Cordon", exact=True).click()
    expect(admin_page.locator("#saved")).to_have_text("gpu-node-a cordoned")
    # Requests leave in order: the accepted cordon is the first and only one sent.
    assert [url.split("/admin/", 1)[1] for url in posted] == ["nodes/gpu-node-a/cordon"]
    assert len(asked) == 4
    expect(node).to_contain_text("cordoned")
    assert cordoned(fleet, "gpu-node-a")
    assert drains_of(fleet, "gpu-node-a") == []  # no drain either
    node.get_by_role("button", name="Uncordon").click()  # asks nothing: it takes nothing away
    expect(admin_page.locator("#saved")).to_have_text("gpu-node-a uncordoned")
    assert len(asked) == 4


def test_a_drain_at_a_time_is_scheduled_shown_on_the_nodes_row_and_cancelled(
    fleet: Hub, admin_page: Page
) -> None:
    node = admin_page.locator("tr[data-node='gpu-node-b']")
    asked: list[str] = []
    node.locator("input[name='at']").fill("tomorrow")
    accept_next(admin_page, asked)
    node.get_by_role("button", name="Drain", exact=True).click()
    expect(admin_page.locator("#error")).to_contain_text(
        "gpu-node-b: 'tomorrow' is neither HH:MM nor an ISO date and time"
    )
    expect(admin_page.locator("#error")).to_contain_text("nothing was scheduled")
    assert drains_of(fleet, "gpu-node-b") == []

    at = (datetime.now(UTC) + timedelta(days=2)).replace(second=0, microsecond=0)
    written = at.strftime("%Y-%m-%dT%H:%M")
    shown = at.strftime("%Y-%m-%d %H:%M UTC")
    node = admin_page.locator("tr[data-node='gpu-node-b']")
    node.locator("input[name='at']").fill(written)
    node.locator("input[name='reason']").fill("firmware update")
    accept_next(admin_page, asked)
    node.get_by_role("button", name="Drain", exact=True).click()
    try:
        expect(admin_page.locator("#saved")).to_have_text(f"gpu-node-b will be drained at {shown}")
        assert asked[-1].startswith(f"Drain gpu-node-b at {written} (UTC)? Then it is cordoned")
        expect(node.locator(".scheduled-drain")).to_have_text(re_words(f"drain at {shown} Cancel"))
        (job,) = drains_of(fleet, "gpu-node-b")
        assert job["what"] == "drain gpu-node-b (firmware update), asked by admin"
        assert datetime.fromisoformat(job["at"]) == at
        assert not cordoned(fleet, "gpu-node-b")  # until then it works as before
        node.locator(".scheduled-drain").get_by_role("button", name="Cancel").click()
        expect(admin_page.locator("#saved")).to_have_text(
            "cancelled: drain gpu-node-b (firmware update), asked by admin"
        )
        expect(node.locator(".scheduled-drain")).to_have_count(0)
        assert drains_of(fleet, "gpu-node-b") == []
    finally:
        for left in drains_of(fleet, "gpu-node-b"):
            fleet.controller("DELETE", f"/timed/{left['id']}")


def test_a_drain_now_cordons_the_node_and_says_so_in_the_events(
    fleet: Hub, admin_page: Page
) -> None:
    node = admin_page.locator("tr[data-node='gpu-node-b']")
    asked: list[str] = []
    accept_next(admin_page, asked)
    node.get_by_role("button", name="Drain", exact=True).click()
    expect(admin_page.locator("#saved")).to_have_text(
        "gpu-node-b is draining: cordoned, its jobs restart elsewhere and its sessions are "
        "snapshotted and stop"
    )
    assert asked == [
        "Drain gpu-node-b now? It is cordoned, its jobs restart elsewhere and its sessions "
        "are snapshotted and stop."
    ]
    expect(node).to_contain_text("cordoned")
    assert cordoned(fleet, "gpu-node-b")
    expect(admin_page.locator("#event-log")).to_contain_text(
        "node gpu-node-b drained by admin: asked on the admin panel"
    )


def test_an_organisations_row_counts_what_its_projects_hold_while_a_session_runs(
    fleet: Hub, admin_page: Page
) -> None:
    def use(project: str) -> Locator:
        return admin_page.locator(f"#project-{project} tr[data-gpu-type='A100-80GB'] td.use")

    expect(use("research")).to_have_text(re_words("0 / 8 · no cap"))  # vision's 4 + nlp's 4
    fleet.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.start_session("carol", project="nlp", gpu_type="A100-80GB", gpus=1)
    admin_page.reload()
    expect(use("research")).to_have_text(re_words("3 / 8 · no cap"))
    expect(use("vision")).to_have_text(re_words("2 / 4 · cap 4"))
    expect(use("nlp")).to_have_text(re_words("1 / 4 · no cap"))


@pytest.fixture
def fake_gpus(fleet: Hub) -> Iterator[list[FakeGpu]]:
    """The fake NVML devices as the agent declared them; written back as they were."""
    gpus = declared_fake_gpus(DECLARED)
    yield gpus
    write_control(fleet.fake_nvml_control, gpus)


def test_a_nodes_row_shows_each_gpus_utilisation_and_who_holds_it(
    fleet: Hub, admin_page: Page, fake_gpus: list[FakeGpu]
) -> None:
    workload = fleet.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    (held,) = workload["allocations"]
    write_control(
        fleet.fake_nvml_control,
        [replace(g, utilization_gpu=73) if g.uuid == held["uuid"] else g for g in fake_gpus],
    )
    gpu = admin_page.locator(f"tr[data-node='{held['node']}'] li[data-gpu='{held['index']}']")

    def sampled() -> bool:
        admin_page.reload()
        return "73% util" in (gpu.text_content() or "")

    wait_for(sampled, 30, "the GPU's utilisation on the panel (sampled every 5 s)")
    expect(gpu).to_contain_text(f"— bob · session #{workload['id']}")
    expect(gpu).to_contain_text("°C")
    others = admin_page.locator(f"tr[data-node='{held['node']}'] li[data-gpu]")
    expect(others.filter(has_text="bob")).to_have_count(1)  # the free GPUs name nobody
    expect(others.filter(has_text="0% util")).to_have_count(3)
    # Readable at 1280 px: nothing wider than the window.
    assert admin_page.evaluate("document.documentElement.scrollWidth") <= 1280


def test_an_admin_recycles_a_node_from_the_panel_and_it_comes_back(
    fleet: Hub, admin_page: Page
) -> None:
    node = admin_page.locator("tr[data-node='gpu-node-b']")
    asked: list[str] = []
    accept_next(admin_page, asked)
    node.get_by_role("button", name="Recycle").click()
    expect(admin_page.locator("#saved")).to_have_text(
        "gpu-node-b is draining; it is recycled once empty, then diagnosed"
    )

    def back() -> dict[str, object] | None:
        nodes = {n["name"]: n for n in fleet.controller("GET", "/nodes").json()["items"]}
        b = nodes["gpu-node-b"]
        return b if not b["cordoned"] and b["maintenance"] is None else None

    wait_for(back, 30, "gpu-node-b recycled, diagnosed and back in service")
    passed = [
        str(e["message"])
        for e in fleet.controller("GET", "/events", params={"limit": 50}).json()["items"]
        if e["kind"] == "maintenance-passed" and e["node"] == "gpu-node-b"
    ]
    assert passed[:2] == [
        "diagnose of node gpu-node-b passed (4 fake GPU(s) passed): it takes work again",
        "recycle of node gpu-node-b passed (4 fake GPU(s) reset): its diagnostics follow",
    ]


def test_a_researcher_neither_sees_nor_reaches_the_admin_panel(
    fleet: Hub, chromium: Browser
) -> None:
    context = new_context(chromium, fleet.url)
    try:
        page = login(context, "alice")
        page.goto("/hub/home")
        expect(page.locator("#gpufleet-admin-nav")).to_have_count(0)
        page.locator("#gpufleet-nav").click()
        expect(page.locator("#jobs-link")).to_be_visible()
        expect(page.locator("#admin-link")).to_have_count(0)
        # Her projects' quotas, not the whole tree.
        expect(page.locator("#quotas tr[data-project='vision']")).to_contain_text("/ 4")
        expect(page.locator("#quotas")).to_contain_text("nlp")
        response = page.goto(PANEL)
        assert response is not None and response.status == 403
    finally:
        context.close()
    token = fleet.user_token("alice")
    refused = httpx.patch(
        f"{fleet.controller_api}/projects/vision",
        json={"quotas": {"A100-80GB": {"guaranteed": 8}}},
        headers={"Authorization": f"token {token}"},
    )
    assert refused.status_code == 403


def test_an_admin_resets_the_recovery_breaker_and_clears_a_lemon_from_the_panel(
    fleet: Hub, admin_page: Page
) -> None:
    from dataclasses import replace

    from gpufleet.agent.gpus import declared_fake_gpus
    from gpufleet.recovery.fake_nvml import write_control

    from .test_agent import DECLARED

    gpus = declared_fake_gpus(DECLARED)
    # XID 79 on a GPU of each node (the breaker opens at the second), and XID 48 twice on
    # one GPU (its second hardware fault in a week: a lemon).
    faulty = {gpus[0].uuid: [79], gpus[4].uuid: [79], gpus[5].uuid: [48, 48]}
    try:
        write_control(
            fleet.fake_nvml_control,
            [replace(g, xid_events=list(faulty.get(g.uuid, []))) for g in gpus],
        )

        def recorded() -> bool:
            kinds = {e["kind"] for e in fleet.controller("GET", "/events").json()["items"]}
            return {"recovery-breaker-tripped", "gpu-lemon"} <= kinds

        wait_for(recorded, 20, "the breaker tripped and a lemon listed")
        admin_page.reload()
        breaker = admin_page.locator("[data-breaker]")
        expect(breaker).to_contain_text("The recovery breaker of cluster")
        lemon = admin_page.locator(f"[data-lemon='{gpus[5].uuid}']")
        expect(lemon).to_contain_text("gpu-node-b")
        expect(admin_page.locator("tr[data-node='gpu-node-b']")).to_contain_text("lemon")
        breaker.get_by_role("button", name="Reset the breaker").click()
        expect(admin_page.locator("#saved")).to_contain_text("recovery breaker")
        expect(admin_page.locator("[data-breaker]")).to_have_count(0)
        admin_page.locator(f"[data-lemon='{gpus[5].uuid}']").get_by_role(
            "button", name="Clear"
        ).click()
        expect(admin_page.locator("#saved")).to_have_text(f"{gpus[5].uuid} is off the lemon list")
        nodes = fleet.controller("GET", "/nodes").json()["items"]
        assert all(not n["lemon_gpus"] for n in nodes)
        assert [
            b["open"] for b in fleet.controller("GET", "/recovery/breakers").json()["items"]
        ] == [False]
    finally:
        write_control(fleet.fake_nvml_control, gpus)
