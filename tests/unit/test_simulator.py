"""The what-if simulator: every job accounted for, no GPU used twice, preemption costs
counted as documented, the baselines behaving as their names say, and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.errors import InputError
from gpufleet.scheduler.inputs import TraceJob, read_fleet, read_projects, read_trace
from gpufleet.scheduler.model import FleetNode, ProjectTree, project_tree
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.simulator import (
    SimulationOptions,
    SimulationResult,
    TraceJobError,
    simulate,
)
from gpufleet.scheduler.simulator_measures import largest_sum
from gpufleet.scheduler.simulator_report import (
    percentile,
    result_json,
    within_guarantee_waits,
)
from gpufleet.scheduler.snapshot import (
    Plan,
    Preemption,
    PreemptionCause,
    SchedulingSnapshot,
)

GPUFLEET = str(Path(sys.executable).parent / "gpufleet")
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def fleet(*zones: tuple[str, int, int], gpu_type: str = "V100") -> list[FleetNode]:
    """Nodes of ``(zone, nodes, GPUs per node)`` in one cluster."""
    return [
        FleetNode(f"{zone}-{i}", "c", zone, gpu_type, gpus)
        for zone, count, gpus in zones
        for i in range(count)
    ]


PROJECTS = project_tree(
    [
        {"name": "lab", "kind": "organisation"},
        {"name": "vision", "parent": "lab", "quotas": {"V100": {"guaranteed": 8}}},
        {
            "name": "nlp",
            "parent": "lab",
            "quotas": {"V100": {"guaranteed": 4, "borrow_limit": 4}},
            "weight": 2,
        },
    ]
)
# The same with the lab capped at 16 of the 28 GPUs: its projects' gangs meet its cap.
CAPPED_PROJECTS = project_tree(
    [
        {
            "name": "lab",
            "kind": "organisation",
            "quotas": {"V100": {"guaranteed": 12, "borrow_limit": 4}},
        },
        *(
            {
                "name": p.name,
                "parent": "lab",
                "quotas": {"V100": vars(p.quotas["V100"])},
                "weight": p.weight,
            }
            for p in PROJECTS
            if p.parent == "lab"
        ),
    ]
)
FLEET = fleet(("z1", 2, 8), ("z2", 3, 4))  # 28 GPUs; 16 in z1, 12 in z2


def check_accounting(result: SimulationResult, jobs: Sequence[TraceJob], nodes: list[FleetNode]):
    """The invariants every replay keeps, read back from the JSON form of the result."""
    document = json.loads(json.dumps(result_json(result)))
    records = {r["job_id"]: r for r in document["jobs"]}
    never = {n["job_id"] for n in document["never_fits"]}
    assert len(records) == len(document["jobs"]) and not never & set(records)
    assert set(records) | never == {j.job_id for j in jobs}
    zone_of = {n.name: (n.cluster, n.zone) for n in nodes}
    zone_gpus: dict[tuple[str, str], int] = defaultdict(int)
    for n in nodes:
        zone_gpus[(n.cluster, n.zone)] += n.gpus
    by_id = {j.job_id: j for j in jobs}
    uses: dict[str, list[tuple[float, float]]] = defaultdict(list)
    zone_changes: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    project_changes: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for job_id, r in records.items():
        job = by_id[job_id]
        assert r["submit_s"] == job.submit_s
        if r["start_s"] is None:
            assert r["runs"] == [] and r["end_s"] is None and r["waiting_reason"]
            continue
        assert r["start_s"] >= job.submit_s
        assert r["start_s"] == r["runs"][0]["start_s"]
        previous_end = r["submit_s"]
        for run in r["runs"]:
            assert previous_end <= run["start_s"] < run["end_s"]
            previous_end = run["end_s"]
            assert len(run["gpus"]) == job.num_gpus == len(set(run["gpus"]))
            for gpu in run["gpus"]:
                node = gpu.rsplit("/", 1)[0]
                assert node in run["nodes"] and zone_of[node] == (run["cluster"], run["zone"])
                uses[gpu].append((run["start_s"], run["end_s"]))
            zone = (run["cluster"], run["zone"])
            zone_changes[zone] += [(run["start_s"], job.num_gpus), (run["end_s"], -job.num_gpus)]
            project_changes[r["project"]] += [
                (run["start_s"], job.num_gpus),
                (run["end_s"], -job.num_gpus),
            ]
        finished = [] if r["end_s"] is None else [False]
        ended_by_preemption = [run["preempted"] for run in r["runs"] if not run["faulted"]]
        assert ended_by_preemption == [True] * r["preemptions"] + finished
        assert sum(run["faulted"] for run in r["runs"]) == r["faults"]
        held = sum(run["end_s"] - run["start_s"] for run in r["runs"])
        if r["end_s"] is not None:
            assert r["end_s"] == r["runs"][-1]["end_s"]
            if r["preemptions"] == 0 and r["faults"] == 0:
                assert r["end_s"] - r["start_s"] == pytest.approx(job.duration_s)
            elif job.kind == "job":  # redone work: what was lost, GPUs × seconds
                lost = (r["lost_gpu_s"] + r["fault_lost_gpu_s"]) / job.num_gpus
                restarts = r["faults"] * result.options["fault_restart_s"]
                assert held == pytest.approx(job.duration_s + lost + restarts)
            else:  # sessions lose nothing but their snapshot time
                snapshot_s = result.options["session_snapshot_s"]
                assert held == pytest.approx(job.duration_s + r["preemptions"] * snapshot_s)
    for gpu, intervals in uses.items():
        intervals.sort()
        for (_, end), (start, _) in pairwise(intervals):
            assert end <= start, f"{gpu} held by two jobs at {start}"
    for zone, changes in zone_changes.items():
        in_use = 0
        for _, change in sorted(changes):  # at equal times releases (negative) come first
            in_use += change
            assert in_use <= zone_gpus[zone]
    # The allocation series is the per-project sum of the runs, step for step.
    for project, changes in project_changes.items():
        totals: dict[float, int] = defaultdict(int)
        for at, change in changes:
            totals[at] += change
        expected, held_now = [], 0
        for at in sorted(totals):
            if totals[at]:
                held_now += totals[at]
                expected.append([at, held_now])
        assert document["allocation"][project] == expected
    summary = document["summary"]
    assert summary["jobs"] == len(jobs)
    if summary["allocation_while_waiting"] is not None:  # the quotas bound what is held
        achieved = summary["allocation_while_waiting"]
        within_lend_limits = summary["allocation_ceiling_within_lend_limits_while_waiting"]
        assert achieved <= within_lend_limits + 1e-9
        assert within_lend_limits <= summary["allocation_ceiling_while_waiting"] + 1e-9 <= 1 + 2e-9
        whole = summary["allocation_ceiling_whole_requests_while_waiting"]
        assert achieved <= whole + 1e-9 <= summary["allocation_ceiling_while_waiting"] + 2e-9
        both = summary["allocation_ceiling_whole_within_lend_limits_while_waiting"]
        assert achieved <= both + 1e-9 <= min(whole, within_lend_limits) + 2e-9
    assert summary["never_fits"] == len(never)
    assert summary["started"] == sum(r["start_s"] is not None for r in records.values())
    return records


def usage_over_time(records: dict[str, dict], project: str) -> list[tuple[float, int]]:
    changes = []
    for r in records.values():
        if r["project"] == project:
            for run in r["runs"]:
                changes += [(run["start_s"], len(run["gpus"])), (run["end_s"], -len(run["gpus"]))]
    held, series = 0, []
    for at, change in sorted(changes):
        held += change
        series.append((at, held))
    return series


jobs_strategy = st.lists(
    st.builds(
        TraceJob,
        job_id=st.just(""),
        submit_s=st.integers(0, 2000).map(float),
        duration_s=st.integers(1, 6000).map(float),
        num_gpus=st.sampled_from([1, 2, 4, 8, 16]),
        group=st.sampled_from(["vision", "nlp", "guests"]),
        kind=st.sampled_from(["job", "session"]),
        priority=st.sampled_from([None, "critical", "standard", "opportunistic"]),
    ),
    max_size=25,
).map(lambda jobs: [replace(j, job_id=f"j{i}") for i, j in enumerate(jobs)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=jobs_strategy,
    policy=st.sampled_from(["gpufleet", "fifo", "static"]),
    tree=st.sampled_from([PROJECTS, CAPPED_PROJECTS]),
)
def test_every_job_is_accounted_for_and_no_gpu_is_used_twice(
    jobs: list[TraceJob], policy: str, tree: ProjectTree
) -> None:
    options = SimulationOptions(min_run_time_s=60, checkpoint_interval_s=500)
    result = simulate(jobs, FLEET, tree, policy, options)
    records = check_accounting(result, jobs, FLEET)
    if policy != "gpufleet":
        assert all(r["preemptions"] == 0 for r in records.values())
    if policy == "static":
        for project, guaranteed in (("vision", 8), ("nlp", 4), ("guests", 0)):
            assert all(held <= guaranteed for _, held in usage_over_time(records, project))
    if policy == "fifo":  # nothing is left waiting for a quota
        assert all(r["end_s"] is not None for r in records.values())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=jobs_strategy,
    policy=st.sampled_from(["gpufleet", "fifo"]),
    seed=st.integers(0, 99),
    spares=st.integers(0, 1),
    repair=st.sampled_from([0.0, 600.0]),
)
def test_with_faults_every_job_is_still_accounted_for_and_no_gpu_is_used_twice(
    jobs: list[TraceJob], policy: str, seed: int, spares: int, repair: float
) -> None:
    # About one fault per 2,000 GPU-seconds: most jobs meet some, preemptions too; with
    # a spare node per zone, restarts go first and take back what borrowed it.
    options = SimulationOptions(
        min_run_time_s=60,
        checkpoint_interval_s=500,
        fault_rate_per_gpu_hour=1.8,
        fault_detect_s=40,
        fault_restart_s=25,
        fault_seed=seed,
        spare_nodes_per_zone=spares,
        fault_repair_s=repair,
    )
    result = simulate(jobs, FLEET, PROJECTS, policy, options)
    records = check_accounting(result, jobs, FLEET)
    for r in records.values():
        if r["kind"] == "session":
            assert r["faults"] == 0
        if r["faults"] > 3 * max(1, -(-r["num_gpus"] // 1024)):  # past the budget: it ended
            assert r["end_s"] is None and r["waiting_reason"].startswith("failed: ")
    assert result.summary.faults == sum(r["faults"] for r in records.values())


def test_a_faulty_node_takes_no_work_until_repaired() -> None:
    jobs = [TraceJob("train", 0.0, 20_000.0, 8, "vision")]
    options = SimulationOptions(
        fault_rate_per_gpu_hour=3 / (8 * 5),
        fault_seed=5,
        fault_budget=20,
        fault_repair_s=3_600,
    )
    [train] = simulate(jobs, fleet(("z1", 2, 8)), PROJECTS, "gpufleet", options).records
    assert train.faults >= 2 and train.end_s is not None
    out: list[tuple[str, float]] = []  # (node, repaired at)
    for run in train.runs:
        for node, until in out:
            assert node not in run.nodes or run.start_s >= until, (run, out)
        if run.faulted:
            [node] = run.nodes
            out.append((node, run.end_s + 3_600))
    # Back at once on the other node, unless that one is out too.
    first = train.runs[0]
    assert train.runs[1].start_s == first.end_s and train.runs[1].nodes != first.nodes
    repaired = simulate(
        jobs, fleet(("z1", 2, 8)), PROJECTS, "gpufleet", replace(options, fault_repair_s=0)
    )
    assert all(r.nodes == repaired.records[0].runs[0].nodes for r in repaired.records[0].runs)


def test_with_a_spare_a_restart_goes_first_and_ordinary_work_keeps_off_the_spare() -> None:
    # z1: two 8-GPU nodes, one of them a spare. "queued" waits while "train" runs: the
    # spare is not for it (the borrower gets it). "train" faults: its restart goes first,
    # at once, taking a node — the spare, the first empty one — and the other becomes
    # ordinary, so "queued" starts then (the replay repairs a faulty node at once).
    jobs = [
        TraceJob("train", 0.0, 20_000.0, 8, "vision"),
        TraceJob("queued", 20.0, 1_000.0, 8, "vision"),
        TraceJob("borrower", 30.0, 1_000.0, 8, "nlp", priority="opportunistic"),
    ]
    options = SimulationOptions(
        fault_rate_per_gpu_hour=1 / (8 * 5),
        fault_seed=3,
        fault_budget=10,
        spare_nodes_per_zone=1,
    )
    result = simulate(jobs, fleet(("z1", 2, 8)), PROJECTS, "gpufleet", options)
    by_id = {r.job_id: r for r in result.records}
    train, queued, borrower = by_id["train"], by_id["queued"], by_id["borrower"]
    assert train.faults >= 1 and train.end_s is not None
    for before, after in zip(train.runs, train.runs[1:], strict=False):
        assert before.faulted and after.start_s == before.end_s
    assert queued.start_s == train.runs[0].end_s
    assert borrower.start_s == 30.0  # lent the spare that "queued" may not have
    assert set(borrower.nodes).isdisjoint(train.runs[0].nodes)


def test_a_fault_costs_the_work_since_the_checkpoint_its_detection_and_the_restart() -> None:
    jobs = [TraceJob("long", 0.0, 36_000.0, 8, "vision")]
    options = SimulationOptions(
        checkpoint_interval_s=1800,
        fault_rate_per_gpu_hour=3 / (8 * 10),  # three faults expected in its ten hours
        fault_detect_s=60,
        fault_restart_s=90,
        fault_seed=7,
        fault_budget=10,
    )
    result = simulate(jobs, FLEET, PROJECTS, "gpufleet", options)
    [record] = result.records
    assert record.faults >= 1 and record.end_s is not None and record.start_s is not None
    faulted = [run for run in record.runs if run.faulted]
    assert len(faulted) == record.faults and not record.runs[-1].faulted
    lost = 0.0
    for run in faulted:  # alone on the fleet: each next run starts at once
        struck = run.end_s - 60 - run.start_s
        lost += struck - (struck // 1800) * 1800 + 60 + 90
    assert record.end_s - record.start_s == pytest.approx(36_000 + lost)
    assert record.effective_training_ratio == pytest.approx(36_000 / (36_000 + lost))
    assert result.summary.gpu_weighted_effective_training_ratio == pytest.approx(
        record.effective_training_ratio
    )
    # The same seed, the same faults; without faults, nothing is lost.
    again = simulate(jobs, FLEET, PROJECTS, "gpufleet", options).records[0]
    assert again.runs == record.runs
    calm = simulate(jobs, FLEET, PROJECTS, "gpufleet", replace(options, fault_rate_per_gpu_hour=0))
    assert calm.records[0].faults == 0 and calm.records[0].effective_training_ratio == 1.0
    # Past the controller's budget the job ends, failed, as the controller would end it.
    spent = simulate(jobs, FLEET, PROJECTS, "gpufleet", replace(options, fault_budget=1))
    [gave_up] = spent.records
    assert (gave_up.faults, gave_up.end_s) == (2, None)
    assert gave_up.waiting_reason == (
        "failed: 2 infrastructure faults within a day, past its budget of 1"
    )


def test_a_negative_fault_rate_is_refused() -> None:
    with pytest.raises(
        InputError, match="fault_rate_per_gpu_hour must be a finite number, 0 or more"
    ):
        SimulationOptions(fault_rate_per_gpu_hour=-1)


@settings(max_examples=25, deadline=None)
@given(
    submits=st.lists(st.integers(0, 500), min_size=1, max_size=30),
    durations=st.lists(st.integers(1, 900), min_size=30, max_size=30),
    size=st.sampled_from([1, 4, 8]),
)
def test_fifo_starts_jobs_of_one_size_in_arrival_order(
    submits: list[int], durations: list[int], size: int
) -> None:
    jobs = [
        TraceJob(f"j{i}", float(s), float(d), size, ["vision", "nlp", "x"][i % 3])
        for i, (s, d) in enumerate(zip(submits, durations, strict=False))
    ]
    result = simulate(jobs, FLEET, PROJECTS, "fifo")
    check_accounting(result, jobs, FLEET)
    start = {r.job_id: r.start_s for r in result.records}
    starts = [start[j.job_id] for j in sorted(jobs, key=lambda j: j.submit_s)]  # stable
    assert None not in starts and starts == sorted(starts)


def test_a_borrower_is_preempted_after_its_minimum_run_and_loses_work_since_its_checkpoint():
    nodes = fleet(("z1", 1, 8))
    jobs = [
        TraceJob("guest", 0.0, 10_000.0, 8, "guests"),  # not a project: opportunistic
        TraceJob("owner", 100.0, 1_000.0, 8, "vision"),  # within its guarantee of 8
    ]
    options = SimulationOptions(min_run_time_s=300, checkpoint_interval_s=100)
    result = simulate(jobs, nodes, PROJECTS, "gpufleet", options)
    guest, owner = result.records
    # Waits until the guest has run 300 s, then 30 s of checkpoint grace.
    assert (owner.start_s, owner.end_s) == (330.0, 1330.0)
    assert guest.preemptions == 1
    assert [(r.start_s, r.end_s, r.preempted) for r in guest.runs] == [
        (0.0, 330.0, True),
        (1330.0, 1330.0 + 10_000 - 300, False),  # checkpoints at 100, 200, 300 kept
    ]
    assert guest.lost_gpu_s == 8 * 30
    assert guest.priority == "opportunistic"
    assert result.summary.preemptions == 1
    assert result.summary.lost_gpu_hours == pytest.approx(240 / 3600)
    check_accounting(result, jobs, nodes)


def test_a_preempted_session_keeps_all_its_work():
    nodes = fleet(("z1", 1, 8))
    jobs = [
        TraceJob("guest", 0.0, 10_000.0, 8, "guests", kind="session"),
        TraceJob("owner", 100.0, 1_000.0, 8, "vision"),
    ]
    result = simulate(jobs, nodes, PROJECTS, "gpufleet", SimulationOptions(min_run_time_s=300))
    guest, owner = result.records
    assert owner.start_s == 320.0  # a session's snapshot takes 20 s
    assert [(r.start_s, r.end_s) for r in guest.runs] == [(0.0, 320.0), (1320.0, 11_020.0)]
    assert guest.lost_gpu_s == 0
    check_accounting(result, jobs, nodes)


def test_static_reports_a_group_without_guarantee_as_never_fitting_and_says_why():
    jobs = [TraceJob("a", 0.0, 60.0, 2, "guests"), TraceJob("b", 0.0, 60.0, 8, "vision")]
    result = simulate(jobs, FLEET, PROJECTS, "static")
    (owner,) = result.records
    (guest,) = result.never_fits
    assert guest.job_id == "a"
    assert "borrowing is off (static quotas)" in guest.reason
    assert owner.end_s == 60.0
    # The guest was never queued, so nothing waited: no GPU idled while work waited.
    assert result.summary.waiting_s == 0.0
    assert result.summary.allocation_while_waiting is None


def test_allocation_while_waiting_is_full_when_no_gpu_idles_while_work_queues():
    nodes = fleet(("z1", 1, 8))
    jobs = [TraceJob("a", 0.0, 100.0, 8, "g"), TraceJob("b", 50.0, 100.0, 8, "g")]
    summary = simulate(jobs, nodes, ProjectTree({}), "fifo").summary
    assert summary.allocation_while_waiting == 1.0
    assert summary.waiting_s == 50.0
    assert summary.gpu_utilisation == 1.0
    assert (summary.waits.p50, summary.waits.p99, summary.mean_jct_s) == (25.0, 49.5, 125.0)


def test_jobs_that_can_never_fit_are_reported_with_the_reason():
    jobs = [
        TraceJob("huge", 0.0, 60.0, 24, "vision"),  # z1 holds 16, z2 12
        TraceJob("odd", 0.0, 60.0, 12, "vision"),  # > 8: whole 8-GPU nodes, 12 does not divide
        TraceJob("a100", 0.0, 60.0, 1, "vision", gpu_type="A100"),
        TraceJob("pods", 0.0, 60.0, 12, "vision", gpus_per_pod=4),  # 3 × 4 fits z2
        TraceJob("fine", 0.0, 60.0, 16, "vision"),  # 2 whole nodes of z1
    ]
    result = simulate(jobs, FLEET, PROJECTS, "fifo")
    reasons = {n.job_id: n.reason for n in result.never_fits}
    assert set(reasons) == {"huge", "odd", "a100"}
    assert "largest zone holds 2" in reasons["huge"]
    assert "whole 8-GPU nodes" in reasons["odd"]
    assert "'A100'" in reasons["a100"] and "V100" in reasons["a100"]
    placed = {r.job_id: r for r in result.records}
    assert placed["pods"].zone == "z2" and len(placed["pods"].nodes) == 3
    assert placed["fine"].zone == "z1" and len(placed["fine"].nodes) == 2
    check_accounting(result, jobs, FLEET)


def test_the_gpu_type_defaults_to_the_fleets_most_common_one():
    nodes = fleet(("z1", 1, 8), gpu_type="A100") + fleet(("z2", 1, 4), gpu_type="T4")
    result = simulate([TraceJob("a", 0.0, 1.0, 1, "g")], nodes, ProjectTree({}), "fifo")
    assert result.records[0].gpu_type == "A100"


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (TraceJob("x", 0.0, 1.0, 1, "vision", priority="urgent"), "'urgent' is not one of"),
        (TraceJob("x", 0.0, 1.0, 6, "vision", gpus_per_pod=4), "not a multiple of"),
    ],
)
def test_a_trace_job_that_cannot_be_used_names_itself(job: TraceJob, message: str) -> None:
    with pytest.raises(TraceJobError, match=message) as raised:
        simulate([job], FLEET, PROJECTS)
    assert raised.value.job_id == "x"


def test_bad_options_and_policies_are_input_errors():
    with pytest.raises(InputError, match="checkpoint_interval_s"):
        SimulationOptions(checkpoint_interval_s=0)
    with pytest.raises(InputError, match="policy must be one of"):
        simulate([], FLEET, PROJECTS, "fair")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e11])
@pytest.mark.parametrize(
    "name",
    [
        "session_snapshot_s",
        "job_checkpoint_grace_s",
        "checkpoint_interval_s",
        "min_run_time_s",
        "fault_detect_s",
        "fault_restart_s",
        "fault_repair_s",
    ],
)
def test_a_time_option_the_clock_cannot_reach_is_an_input_error(name: str, value: float) -> None:
    # NaN passed "must be zero or more" (no comparison holds for it); infinity ran forever.
    with pytest.raises(InputError, match=f"{name} must be a number of seconds .* up to 1e10"):
        SimulationOptions(**{name: value})


@pytest.mark.parametrize("rate", [math.nan, math.inf])
def test_a_fault_rate_that_is_no_finite_number_is_an_input_error(rate: float) -> None:
    with pytest.raises(InputError, match="fault_rate_per_gpu_hour must be a finite number"):
        SimulationOptions(fault_rate_per_gpu_hour=rate)


def test_jobs_checkpointing_more_often_than_the_replay_steps_through_are_refused() -> None:
    jobs = [TraceJob("x", 0.0, 1e10, 1, "vision"), TraceJob("y", 0.0, 1e10, 1, "vision")]
    with pytest.raises(InputError, match=r"11,111,111 checkpoints at one every 1800 s"):
        simulate(jobs, FLEET, PROJECTS)
    # Sessions take no checkpoints, and only the gpufleet policy steps through them.
    sessions = [TraceJob("x", 0.0, 1e10, 1, "vision", kind="session")]
    assert simulate(sessions, FLEET, PROJECTS).summary.finished == 1
    assert simulate(jobs, FLEET, PROJECTS, "fifo").summary.finished == 2


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([10.0], 0.99) == 10.0
    assert percentile([0.0, 10.0, 20.0, 30.0], 0.5) == 15.0
    assert percentile([float(i) for i in range(101)], 0.95) == 95.0


# ------------------------------------------------------------------------- CLI
FLEET_YAML = """\
clusters:
  - name: c
    zones:
      - name: z1
        pools: [{name: big, count: 2, gpus_per_node: 8, gpu_type: V100}]
      - name: z2
        pools: [{name: small, count: 3, gpus_per_node: 4, gpu_type: V100}]
"""
PROJECTS_YAML = """\
projects:
  - {name: lab, kind: organisation}
  - {name: vision, parent: lab, quotas: {V100: {guaranteed: 8}}}
  - {name: nlp, parent: lab, quotas: {V100: {guaranteed: 4, borrow_limit: 4}}}
"""
TRACE_CSV = """\
job_id,submit_s,duration_s,num_gpus,group,kind,priority
a,0,600,8,vision,job,
b,10,300,4,nlp,session,critical
c,20,100,64,vision,job,
d,30,900,16,guests,job,
"""


def write_inputs(tmp_path: Path, trace: str = TRACE_CSV, fleet_yaml: str = FLEET_YAML) -> None:
    (tmp_path / "trace.csv").write_text(trace)
    (tmp_path / "fleet.yaml").write_text(fleet_yaml)
    (tmp_path / "projects.yaml").write_text(PROJECTS_YAML)


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd outside the checkout: the strict editable install must find every subpackage.
    return subprocess.run(
        [GPUFLEET, "simulate", "trace.csv", "--fleet", "fleet.yaml", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_writes_the_result_and_prints_the_summary(tmp_path: Path) -> None:
    write_inputs(tmp_path)
    done = run_cli(tmp_path, "--projects", "projects.yaml", "--policy", "static", "--out", "r.json")
    assert done.returncode == 0, done.stderr
    assert "Simulation (static)" in done.stdout and "Waits by project" in done.stdout
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["policy"] == "static"
    # c fits no zone; d's guests have no guarantee, and static quotas lend nothing.
    assert [n["job_id"] for n in document["never_fits"]] == ["c", "d"]
    jobs = {r["job_id"]: r for r in document["jobs"]}
    assert jobs["a"]["start_s"] == 0.0 and jobs["a"]["end_s"] == 600.0
    assert "d" not in jobs
    assert set(document["summary"]) >= {"gpu_utilisation", "allocation_while_waiting", "wait"}


def test_cli_json_to_stdout(tmp_path: Path) -> None:
    write_inputs(tmp_path)
    done = run_cli(tmp_path, "--policy", "fifo", "--out", "-")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["finished"] == 3
    assert "Simulation (fifo)" in done.stderr


@pytest.mark.parametrize(
    ("trace", "fleet_yaml", "expected"),
    [
        (TRACE_CSV.replace("critical", "urgent"), FLEET_YAML, "trace.csv:3: job 'b'"),
        (TRACE_CSV.replace("a,0,600", "a,0,soon"), FLEET_YAML, "trace.csv:2: duration_s"),
        (TRACE_CSV, FLEET_YAML.replace(", gpu_type: V100}]\n  ", "}]\n  ", 1), "gpu_type"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_file(
    tmp_path: Path, trace: str, fleet_yaml: str, expected: str
) -> None:
    write_inputs(tmp_path, trace, fleet_yaml)
    done = run_cli(tmp_path)
    assert done.returncode == 2
    assert expected in done.stderr
    assert not (tmp_path / "simulation.json").exists()


def test_cli_injects_faults_and_reports_what_they_cost(tmp_path: Path) -> None:
    write_inputs(tmp_path)
    done = run_cli(
        tmp_path, "--projects", "projects.yaml", "--fault-rate", "1", "--fault-seed", "3",
        "--out", "r.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "faults (GPU-hours they cost)" in done.stdout
    assert "training ETTR mean (GPU-weighted)" in done.stdout
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["options"]["fault_rate_per_gpu_hour"] == 1.0
    faults = [r["faults"] for r in document["jobs"]]
    assert document["summary"]["faults"] == sum(faults) > 0
    calm = run_cli(tmp_path, "--projects", "projects.yaml", "--out", "calm.json")
    assert "faults (GPU-hours they cost)" not in calm.stdout  # no faults asked, no line
    llama3 = run_cli(tmp_path, "--fault-rate", "llama3", "--out", "l.json")
    assert llama3.returncode == 0, llama3.stderr
    rate = json.loads((tmp_path / "l.json").read_text())["options"]["fault_rate_per_gpu_hour"]
    assert rate == pytest.approx(419 / (54 * 24 * 16384))


def test_cli_refuses_a_fault_rate_it_cannot_read(tmp_path: Path) -> None:
    write_inputs(tmp_path)
    done = run_cli(tmp_path, "--fault-rate", "often")
    assert done.returncode == 2
    refusal = "--fault-rate must be a number of faults per GPU-hour (0 or more) or 'llama3'"
    assert f"{refusal}, not 'often'" in done.stderr
    negative = run_cli(tmp_path, "--fault-rate", "-2")
    assert negative.returncode == 2 and f"{refusal}, not '-2'" in negative.stderr


def test_cli_missing_file_exits_2(tmp_path: Path) -> None:
    done = run_cli(tmp_path)
    assert done.returncode == 2
    assert "trace.csv" in done.stderr


# ------------------------------------------------------------------ the Philly window
@pytest.mark.skipif(not (TRACES / "philly-2017-10-02-5k.csv").exists(), reason="no ../shared")
def test_the_philly_window_replays_with_every_job_accounted_for(tmp_path: Path) -> None:
    jobs = read_trace(TRACES / "philly-2017-10-02-5k.csv")
    (tmp_path / "fleet.yaml").write_text(
        "clusters:\n  - name: philly\n    zones:\n"
        "      - {name: z1, pools: [{name: a, count: 64, gpus_per_node: 8, gpu_type: V100}]}\n"
        "      - {name: z2, pools: [{name: b, count: 60, gpus_per_node: 8, gpu_type: V100}]}\n"
    )
    groups = sorted({j.group for j in jobs})
    (tmp_path / "projects.yaml").write_text(
        "projects:\n"
        + "".join(
            f"  - {{name: {g!r}, quotas: {{V100: {{guaranteed: 96}}}}}}\n" for g in groups[:5]
        )
    )
    nodes = read_fleet(tmp_path / "fleet.yaml")
    result = simulate(jobs, nodes, read_projects(tmp_path / "projects.yaml"), "gpufleet")
    check_accounting(result, jobs, nodes)
    assert result.summary.jobs == 5000
    assert result.summary.finished + result.summary.never_fits == 5000


# ------------------------------------------------ ceiling, never fits, preemption figures
def test_the_ceiling_is_what_the_quota_tree_permits_while_work_waits():
    nodes = fleet(("z1", 4, 8))  # 32 GPUs
    tree = project_tree(
        [
            # Guaranteed 8 (its children's), may borrow 4: the team holds at most 12.
            {
                "name": "team",
                "kind": "team",
                "quotas": {"V100": {"guaranteed": 8, "borrow_limit": 4}},
            },
            {
                "name": "a",
                "parent": "team",
                "quotas": {"V100": {"guaranteed": 4, "borrow_limit": 4}},
            },
            {"name": "b", "parent": "team", "quotas": {"V100": {"guaranteed": 4}}},
        ]
    )
    jobs = [
        TraceJob("a1", 0.0, 100.0, 8, "a"),  # a at its cap of 8
        TraceJob("b1", 0.0, 100.0, 8, "b"),  # the team would hold 16 > 12: waits for a1
        TraceJob("o1", 0.0, 1000.0, 8, "other"),  # unconfigured: no limit
    ]
    result = simulate(jobs, nodes, tree, "gpufleet")
    check_accounting(result, jobs, nodes)
    starts = {r.job_id: r.start_s for r in result.records}
    assert starts == {"a1": 0.0, "b1": 100.0, "o1": 0.0}
    s = result.summary
    assert s.waiting_s == 100.0
    assert s.allocation_while_waiting == pytest.approx(16 / 32)
    # a: min(8, 8), b: min(unbounded, 8), team: min(12, 16) = 12; other: 8. 20 of 32.
    assert s.allocation_ceiling_while_waiting == pytest.approx(20 / 32)
    # Counted whole, b1 fits nothing beside a1 under the team's cap (8 + 8 > 12), as the
    # replay found: team 8, other 8. The 16 free GPUs idle for the team's cap.
    assert s.allocation_ceiling_whole_requests_while_waiting == pytest.approx(16 / 32)
    assert s.idle_while_waiting_by_cause == {"caps": pytest.approx(16 / 32)}
    assert (
        result_json(result)["summary"]["allocation_ceiling_while_waiting"]
        == s.allocation_ceiling_while_waiting
    )


def test_the_ceiling_within_lend_limits_leaves_out_what_a_lender_keeps_idle():
    nodes = fleet(("z1", 4, 8))  # 32 GPUs
    tree = project_tree(
        [
            # Guaranteed 16, lends at most 4: while it runs 2 and asks for nothing, it
            # keeps 16 - 2 - 4 = 10 idle for itself.
            {"name": "lender", "quotas": {"V100": {"guaranteed": 16, "lend_limit": 4}}},
            {"name": "x", "quotas": {"V100": {"guaranteed": 0}}},
        ]
    )
    jobs = [
        TraceJob("l1", 0.0, 1000.0, 2, "lender"),
        TraceJob("x1", 0.0, 1000.0, 16, "x"),
        TraceJob("x2", 0.0, 1000.0, 8, "x"),  # 2 + 16 + 8 = 26 > 32 - 10: waits
    ]
    result = simulate(jobs, nodes, tree, "gpufleet")
    check_accounting(result, jobs, nodes)
    starts = {r.job_id: r.start_s for r in result.records}
    assert starts == {"l1": 0.0, "x1": 0.0, "x2": 1000.0}
    s = result.summary
    assert s.allocation_while_waiting == pytest.approx(18 / 32)
    assert s.allocation_ceiling_while_waiting == pytest.approx(26 / 32)
    assert s.allocation_ceiling_within_lend_limits_while_waiting == pytest.approx(22 / 32)


def test_the_whole_request_ceiling_counts_no_request_in_part():
    nodes = fleet(("z1", 4, 8))  # 32 GPUs
    tree = project_tree([{"name": "a", "quotas": {"V100": {"guaranteed": 4, "borrow_limit": 4}}}])
    jobs = [
        TraceJob("a1", 0.0, 100.0, 6, "a"),
        TraceJob("a2", 1.0, 100.0, 4, "a"),  # 6 + 4 > 8, the project's limit: waits for a1
    ]
    result = simulate(jobs, nodes, tree, "gpufleet")
    check_accounting(result, jobs, nodes)
    assert {r.job_id: r.start_s for r in result.records} == {"a1": 0.0, "a2": 100.0}
    s = result.summary
    assert s.allocation_while_waiting == pytest.approx(6 / 32)
    # The ceiling counts 2 of a2's 4 GPUs under a's limit of 8; counted whole, a2 fits
    # nothing beside a1, as the replay found.
    assert s.allocation_ceiling_while_waiting == pytest.approx(8 / 32)
    assert s.allocation_ceiling_whole_requests_while_waiting == pytest.approx(6 / 32)


def test_the_quotas_tightest_bound_keeps_back_a_lenders_guarantee_it_cannot_use():
    nodes = fleet(("z1", 4, 8))  # 32 GPUs
    tree = project_tree(
        [
            # Guaranteed 16, lends at most 4, may hold 24.
            {
                "name": "lender",
                "quotas": {"V100": {"guaranteed": 16, "borrow_limit": 8, "lend_limit": 4}},
            },
            {"name": "x", "quotas": {"V100": {"guaranteed": 0}}},
        ]
    )
    jobs = [
        TraceJob("l1", 0.0, 1000.0, 2, "lender"),
        TraceJob("l2", 0.0, 1000.0, 24, "lender"),  # 2 + 24 > 24: waits for l1
        TraceJob("x1", 0.0, 1000.0, 16, "x"),
        TraceJob("x2", 0.0, 1000.0, 8, "x"),  # the lender keeps 16 - 2 - 4 = 10 back
    ]
    result = simulate(jobs, nodes, tree, "gpufleet")
    check_accounting(result, jobs, nodes)
    starts = {r.job_id: r.start_s for r in result.records}
    assert starts == {"l1": 0.0, "x1": 0.0, "l2": 1000.0, "x2": 1000.0}
    s = result.summary
    assert s.allocation_while_waiting == pytest.approx(18 / 32)
    # Counted in part, l2 makes the lender ask for its whole guarantee: nothing is kept
    # back. Counted whole, the lender can hold only its 2, and keeps 10 of its 16 back
    # from x's 24: at most 22 of the 32 are held.
    assert s.allocation_ceiling_within_lend_limits_while_waiting == pytest.approx(32 / 32)
    assert s.allocation_ceiling_whole_requests_while_waiting == pytest.approx(26 / 32)
    assert s.allocation_ceiling_whole_within_lend_limits_while_waiting == pytest.approx(22 / 32)
    # The 14 free GPUs idle because x2, the only request that fits them (l2's three pods
    # do not), is kept from them by the lender's lend limit: with what is held, the whole.
    assert s.idle_while_waiting_by_cause == {"lend-limits": pytest.approx(14 / 32)}


# No deadline: the brute force below takes up to 2^16 subsets, slow on a loaded machine.
@settings(deadline=None)
@given(st.dictionaries(st.integers(1, 9), st.integers(1, 4), max_size=4), st.integers(-2, 30))
def test_largest_sum_is_the_best_subset_sum(sizes: dict[int, int], room: int) -> None:
    items = [size for size, count in sizes.items() for _ in range(count)]
    best = max(
        (
            total
            for mask in range(1 << len(items))
            if (total := sum(x for i, x in enumerate(items) if mask >> i & 1)) <= room
        ),
        default=0,
    )
    assert largest_sum(sizes, room) == best


def test_jobs_the_configuration_never_admits_are_never_fits_and_never_queued():
    tree = project_tree(
        [
            {
                "name": "team",
                "kind": "team",
                "quotas": {"V100": {"guaranteed": 4, "borrow_limit": 0}},
            },
            {"name": "small", "parent": "team", "quotas": {"V100": {"guaranteed": 4}}},
            {"name": "capped", "quotas": {"V100": {"guaranteed": 4, "borrow_limit": 4}}},
            {"name": "peruser", "quotas": {"V100": {"guaranteed": 8}}, "per_user_gpu_cap": 2},
        ]
    )
    jobs = [
        TraceJob("team-cap", 0.0, 60.0, 8, "small"),  # the team may hold 4
        TraceJob(
            "own-cap", 0.0, 60.0, 12, "capped", gpus_per_pod=4
        ),  # guarantee 4 + borrow limit 4
        TraceJob("user-cap", 0.0, 60.0, 4, "peruser"),  # one user may hold 2
        TraceJob("no-type", 0.0, 60.0, 1, "capped", gpu_type="A100"),
        TraceJob("zone", 0.0, 60.0, 24, "other"),  # the largest zone holds 16
        TraceJob("fits", 0.0, 60.0, 2, "peruser"),
    ]
    queued: set[str] = set()

    def watching(snapshot: SchedulingSnapshot, now: float) -> Plan:
        queued.update(r.user for r in snapshot.queue)  # each job is its own user
        return plan(snapshot, now)

    result = simulate(jobs, FLEET, tree, "gpufleet", planner=watching)
    check_accounting(result, jobs, FLEET)
    reasons = {n.job_id: n.reason for n in result.never_fits}
    assert list(reasons) == ["team-cap", "own-cap", "user-cap", "no-type", "zone"]
    assert "team team may never hold more than 4" in reasons["team-cap"]
    assert "project capped may never hold more than 8" in reasons["own-cap"]
    assert "per-user cap is 2" in reasons["user-cap"]
    assert "'A100'" in reasons["no-type"] and "largest zone holds" in reasons["zone"]
    assert [r.job_id for r in result.records] == ["fits"]
    assert queued == {"fits"}
    assert result.summary.waiting_s == 0.0 and result.summary.never_started == 0
    # Under static a project's guarantee is all it may hold; under fifo quotas do not count.
    static = simulate(jobs, FLEET, tree, "static")
    assert {n.job_id for n in static.never_fits} == set(reasons)
    fifo = simulate(jobs, FLEET, tree, "fifo")
    assert {n.job_id for n in fifo.never_fits} == {"no-type", "zone"}


def test_a_job_that_could_fit_but_never_started_has_a_record_without_a_start():
    # The owner lends none of its idle guarantee: the guest waits to the end of the trace.
    tree = project_tree([{"name": "owner", "quotas": {"V100": {"guaranteed": 8, "lend_limit": 0}}}])
    nodes = fleet(("z1", 1, 8))
    jobs = [TraceJob("guest", 0.0, 60.0, 4, "guests"), TraceJob("o", 10.0, 50.0, 8, "owner")]
    result = simulate(jobs, nodes, tree, "gpufleet")
    check_accounting(result, jobs, nodes)
    assert result.never_fits == ()
    guest = next(r for r in result.records if r.job_id == "guest")
    assert guest.start_s is None and guest.end_s is None and guest.waiting_reason
    assert result.summary.never_started == 1 and result.summary.started == 1
    assert result_json(result)["jobs"][0]["start_s"] is None


def test_a_gpu_type_nobody_asks_for_is_not_counted_as_idle():
    nodes = fleet(("z1", 1, 8)) + fleet(("z2", 1, 8), gpu_type="T4")
    jobs = [TraceJob("a", 0.0, 100.0, 8, "g"), TraceJob("b", 0.0, 100.0, 8, "g")]
    summary = simulate(jobs, nodes, ProjectTree({}), "fifo").summary
    assert summary.waiting_s == 100.0
    assert summary.allocation_while_waiting == 1.0  # the idle T4 are not what b waits for
    assert summary.allocation_ceiling_while_waiting == 1.0
    assert summary.gpu_utilisation == 0.5


def scripted(preemptions: dict[float, list[tuple[int, int]]]):
    """The core, whose own preemptions are dropped, and at the given times only the
    scripted ones (victim id, preemptor id): workload ids are trace positions from 1."""

    def planner(snapshot: SchedulingSnapshot, now: float) -> Plan:
        if now in preemptions:
            return Plan(
                preemptions=tuple(
                    Preemption(v, p, PreemptionCause.GUARANTEE, "scripted")
                    for v, p in preemptions.pop(now)
                )
            )
        return replace(plan(snapshot, now), preemptions=())

    return planner


def test_each_preemption_decision_is_measured_against_what_its_preemptor_needed():
    nodes = fleet(("z1", 2, 8))  # 16 GPUs
    jobs = [
        TraceJob("g1", 0.0, 10_000.0, 8, "guests"),
        TraceJob("g2", 0.0, 10_000.0, 4, "guests"),  # 4 left free, on g2's node
        TraceJob("owner", 100.0, 500.0, 8, "vision"),
    ]
    result = simulate(
        jobs, nodes, PROJECTS, "gpufleet", planner=scripted({100.0: [(1, 3), (2, 3)]})
    )
    check_accounting(result, jobs, nodes)
    (decision,) = result.preemption_decisions
    assert (decision.job_id, decision.victims, decision.at_s) == ("owner", ("g1", "g2"), 100.0)
    assert (decision.free_gpus, decision.need_gpus, decision.evicted_gpus) == (4, 4, 12)
    assert not decision.fitted  # 4 free GPUs are no 8-GPU pod
    s = result.summary
    assert (s.preemptors, s.evicted_beyond_need_gpus, s.preemptors_over_twice_need) == (1, 8, 1)
    assert (s.preempted_while_fitting, s.max_preemptions_per_job, s.preemptions) == (0, 1, 2)
    owner = next(r for r in result.records if r.job_id == "owner")
    assert (owner.preemptor_of, owner.evicted_gpus, owner.evicted_beyond_need_gpus) == (1, 12, 8)
    assert result_json(result)["preemption_decisions"][0]["need_gpus"] == 4


def test_a_preemption_while_the_gang_fitted_is_counted():
    nodes = fleet(("z1", 2, 8))
    jobs = [
        TraceJob("g1", 0.0, 10_000.0, 8, "guests"),
        TraceJob("owner", 100.0, 500.0, 8, "vision"),
    ]
    result = simulate(jobs, nodes, PROJECTS, "gpufleet", planner=scripted({100.0: [(1, 2)]}))
    (decision,) = result.preemption_decisions
    assert (decision.need_gpus, decision.evicted_gpus, decision.fitted) == (0, 8, True)
    s = result.summary
    assert (
        s.preempted_while_fitting,
        s.preemptors_over_twice_need,
        s.evicted_beyond_need_gpus,
    ) == (1, 1, 8)


def test_the_planner_sees_how_often_a_workload_was_preempted_and_how_often_it_checkpoints():
    nodes = fleet(("z1", 1, 8), ("z2", 1, 4))
    jobs = [
        TraceJob("guest", 0.0, 10_000.0, 8, "guests"),
        TraceJob("owner", 100.0, 1_000.0, 8, "vision"),
        TraceJob("notebook", 0.0, 10_000.0, 4, "nlp", kind="session"),
        TraceJob("late", 2_000.0, 10.0, 4, "guests"),  # a cycle after the restart
    ]
    options = SimulationOptions(min_run_time_s=300, checkpoint_interval_s=100)
    seen: list[SchedulingSnapshot] = []

    def capturing(snapshot: SchedulingSnapshot, now: float) -> Plan:
        seen.append(snapshot)
        return plan(snapshot, now)

    result = simulate(jobs, nodes, PROJECTS, "gpufleet", options, planner=capturing)
    check_accounting(result, jobs, nodes)
    running = [(r.user, r.preemptions, r.checkpoint_interval_s) for s in seen for r in s.running]
    assert ("guest", 0, 100.0) in running and ("notebook", 0, None) in running
    # Restarted after its preemption at 330 s; checkpoints keep the count.
    guest = next(r for r in result.records if r.job_id == "guest")
    assert guest.preemptions == 1 and guest.runs[1].start_s == 1330.0
    assert any(u == "guest" and n == 1 for u, n, _ in running)


def test_within_guarantee_waits_give_the_owners_wait_and_whether_guarantees_blocked_it():
    nodes = fleet(("z1", 1, 8))
    jobs = [
        TraceJob("guest", 0.0, 10_000.0, 8, "guests"),
        TraceJob("owner", 100.0, 1_000.0, 8, "vision"),
    ]
    result = simulate(jobs, nodes, PROJECTS, "gpufleet", SimulationOptions(min_run_time_s=300))
    (wait,) = within_guarantee_waits(result, PROJECTS, nodes)
    assert (wait.job_id, wait.wait_s, wait.blocked, wait.blocked_s) == ("owner", 230.0, False, 0.0)
    # Two guaranteed projects filling a zone: the later one is blocked until room is made.
    tree = project_tree(
        [{"name": n, "quotas": {"V100": {"guaranteed": 8}}} for n in ("first", "second")]
    )
    jobs = [TraceJob("f", 0.0, 500.0, 8, "first"), TraceJob("s", 10.0, 100.0, 8, "second")]
    result = simulate(jobs, nodes, tree, "gpufleet")
    (f, s) = within_guarantee_waits(result, tree, nodes)
    assert (f.wait_s, f.blocked) == (0.0, False)
    assert (s.wait_s, s.blocked, s.blocked_s) == (490.0, True, 490.0)


def test_the_need_of_a_preemption_counts_whole_pods_on_nodes() -> None:
    from gpufleet.scheduler.simulator_measures import pod_need

    # 8-GPU nodes with 2, 3 and 7 free: one 8-GPU pod lacks 1 GPU on the third node;
    # two pods lack 1 + 5; free GPUs spread over nodes do not make a pod.
    nodes = [(2, 8), (3, 8), (7, 8)]
    assert pod_need(nodes, 8, 1) == 1
    assert pod_need(nodes, 8, 2) == 1 + 5
    assert pod_need(nodes, 8, 3) == 1 + 5 + 6
    assert pod_need(nodes, 2, 4) == 0  # 1 + 1 + 3 pods of 2 fit now
    assert pod_need(nodes, 8, 4) > 1000  # three nodes never hold four whole-node pods
