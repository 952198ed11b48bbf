"""The admin panel's rows, computed without a server: an organisation or team counts what
its projects hold and wait for, against the guarantee and cap the scheduler gives it; a
GPU's latest sample reads as utilisation, memory and temperature; a node's row draws each
GPU's holder, its scheduled drains, and the confirmations of Cordon, Drain and Recycle."""

from __future__ import annotations

from datetime import UTC, datetime

from gpufleet.api.schemas import NodeOut, ProjectUsageOut, QuotaUsageOut
from gpufleet.hub.admin import (
    GIB,
    GpuState,
    Holder,
    NodeRow,
    TreeUse,
    gpu_reading,
    project_rows,
    tree_use,
)
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.pages import environment, page_context
from gpufleet.hub.timed import TimedJob

A100 = "A100-80GB"
H100 = "H100"


def node(
    name: str, parent: str | None, kind: str = "project", **quotas: tuple[int, int | None]
) -> ProjectUsageOut:
    """A tree node as GET /projects lists it; ``quotas``: GPU type -> (guaranteed,
    borrow limit). Its own ``used`` is left 0: the panel does not read it."""
    return ProjectUsageOut(
        name=name,
        display_name=name,
        kind=kind,
        parent=parent,
        fair_share_weight=1.0,
        per_user_gpu_cap=None,
        default_priority="standard",
        quotas=[
            QuotaUsageOut(
                gpu_type=gpu_type.replace("_", "-"),
                guaranteed=guaranteed,
                borrow_limit=borrow,
                lend_limit=None,
                used=0,
                waiting=0,
            )
            for gpu_type, (guaranteed, borrow) in quotas.items()
        ],
    )


# The demo's tree: an organisation with no quota of its own over two projects.
DEMO = [
    node("research", None, "organisation"),
    node("vision", "research", A100_80GB=(4, 0)),
    node("nlp", "research", A100_80GB=(4, None)),
]


def test_an_organisation_counts_what_its_projects_hold_against_their_guarantees() -> None:
    use = tree_use(DEMO, held={("vision", A100): 2, ("nlp", A100): 1}, waiting={("nlp", A100): 4})
    assert use[("research", A100)] == TreeUse(used=3, waiting=4, guaranteed=8, cap=None)
    assert use[("vision", A100)] == TreeUse(used=2, waiting=0, guaranteed=4, cap=4)
    assert use[("nlp", A100)] == TreeUse(used=1, waiting=4, guaranteed=4, cap=None)


def test_an_organisations_row_shows_its_projects_sums_not_nothing() -> None:
    rows = project_rows(DEMO, [A100], held={("vision", A100): 2, ("nlp", A100): 1})
    research = rows[0]
    assert (research.label, research.inner) == ("research", True)
    (quota,) = research.quotas
    assert (quota.use.used, quota.use.guaranteed, quota.cap_text) == (3, 8, "no cap")
    assert quota.guaranteed_input == ""  # it declares none itself: the input stays empty
    assert (quota.percent, quota.borrowing) == (38, False)
    assert [(r.label, r.inner, r.quotas[0].use.used) for r in rows[1:]] == [
        ("nlp", False, 1),
        ("vision", False, 2),
    ]


def test_a_declared_guarantee_above_the_childrens_sum_and_a_borrow_limit_make_the_cap() -> None:
    tree = [
        node("org", None, "organisation", H100=(10, 2)),
        node("team", "org", "team", H100=(0, 1)),
        node("a", "team", H100=(3, None)),
        node("b", "team", H100=(2, None)),
        node("solo", "org", H100=(1, None)),
    ]
    use = tree_use(tree, held={("a", H100): 4, ("solo", H100): 1}, waiting={})
    # The team declares no guarantee: its projects' 5, capped at 5 + its borrow limit 1.
    assert use[("team", H100)] == TreeUse(used=4, waiting=0, guaranteed=5, cap=6)
    # The organisation declares 10, more than its children's 6: 10 counts, cap 10 + 2.
    assert use[("org", H100)] == TreeUse(used=5, waiting=0, guaranteed=10, cap=12)
    assert use[("a", H100)] == TreeUse(used=4, waiting=0, guaranteed=3, cap=None)


def test_gpus_a_project_holds_beyond_any_quota_show_up_to_the_top() -> None:
    # nlp has no H100 quota, yet borrows one (it has no borrow limit there).
    rows = project_rows(DEMO, [A100], held={("nlp", H100): 1}, waiting={("vision", H100): 2})
    by_name = {r.project.name: {q.gpu_type: q for q in r.quotas} for r in rows}
    borrowed = by_name["research"][H100]
    assert borrowed.use == TreeUse(used=1, waiting=2, guaranteed=0, cap=None)
    assert (borrowed.percent, borrowed.borrowing) == (100, True)  # an orange, full bar
    assert by_name["nlp"][H100].use.used == 1
    assert by_name["vision"][H100].use == TreeUse(used=0, waiting=2, guaranteed=0, cap=None)
    assert by_name["vision"][A100].use == TreeUse(used=0, waiting=0, guaranteed=4, cap=4)


def test_a_gpus_reading_is_its_utilisation_memory_and_temperature() -> None:
    sample = {
        "utilization_gpu_pct": 73,
        "memory_used_bytes": 12 * GIB,
        "memory_total_bytes": 80 * GIB,
        "temperature_c": 45,
    }
    assert gpu_reading(sample) == "73% util · 12/80 GiB · 45 °C"
    assert gpu_reading({"utilization_gpu_pct": 0}) == "0% util"
    # What the GPU does not report is left out, never shown as zero.
    assert gpu_reading({"temperature_c": 50, "memory_used_bytes": GIB}) == "50 °C"
    assert gpu_reading({"uuid": "GPU-1", "index": 0}) == "no readings"
    assert gpu_reading({}) == "no sample yet"


def test_a_nodes_row_names_each_gpus_holder_its_drains_and_asks_before_it_acts() -> None:
    out = NodeOut(
        name="gpu-node-a",
        cluster="local",
        zone="zone-a",
        gpu_type=A100,
        health="ok",
        cordoned=False,
        gpus=2,
        free_gpus=1,
        last_heartbeat_at=None,
    )
    at = datetime(2026, 12, 4, 2, 0, tzinfo=UTC)
    row = NodeRow(
        out,
        "cordon",
        [
            GpuState(0, "GPU-0", False, "73% util", None, Holder(12, "session", "bob", "")),
            GpuState(1, "GPU-1", False, "0% util", None, Holder(14, "job", "carol", "resnet")),
        ],
        [TimedJob("j1", "drain gpu-node-a (firmware), asked by admin", at)],
    )
    identity = Identity("user", "admin", frozenset({"custom:gpufleet:admin"}), by_cookie=True)
    page = page_context(identity, "gpufleet admin", "admin", base="/services/gpufleet/")
    html = (
        environment()
        .get_template("gpufleet-admin.html")
        .render(
            **page,
            projects=[],
            priorities=[],
            nodes=[row],
            unreachable=[],
            breakers={},
            lemons=[],
            queue=[],
            events=[],
        )
    )
    assert '#0 73% util</span> <span class="holder" data-holder="12">— bob · session #12' in html
    assert '<a href="/services/gpufleet/jobs/14">carol · job resnet #14</a>' in html
    assert "1 / 2" in html  # free of the node's GPUs
    assert 'data-timed="j1">drain at <time datetime="2026-12-04T02:00:00Z"' in html
    assert 'action="/services/gpufleet/admin/timed/j1/cancel"' in html
    assert html.count("data-confirm=") == 3  # Cordon, Recycle, Drain
    assert 'data-confirm-at="Drain gpu-node-a at {at} (UTC)?' in html
    assert "window.confirm(message)" in html
