"""A memo carried across cycles gives the plans a fresh one gives (``scheduler/memo.py``),
whether it follows each snapshot's changes or reads it whole; runs of repeated refusals
read as the rows written one by one (``waits.py``); and deciding a frozen queue's rest at
once gives the decisions deciding it request by request gives (``plan.py``,
``frozen.py``).

The worlds are those of ``test_plan_properties.py``: random fleets, project trees and
many cycles of arrivals, completions, cancellations, idle marks, node failures and quota
changes; each cycle's snapshot is planned with one memo kept for the whole world, and
afresh. Some worlds allow few preemption searches per cycle, so that the state freezes
early and the memo's frozen tails and verdicts are used and compared.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.scheduler.memo import PlanMemo
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.snapshot import Plan

from .test_plan_properties import FAST, Scenario, World, contended, scenarios

searches = st.sampled_from((0, 1, 2, 64))


def run_world(scenario: Scenario, max_searches: int, check: str) -> None:
    world = World(scenario)
    world.policy = replace(world.policy, max_preemption_searches=max_searches)
    memo, reading_whole = PlanMemo(), PlanMemo()
    for number, cycle in enumerate(scenario.cycles + scenario.quiet):
        world.begin(cycle)
        snapshot = world.snapshot()
        fresh = plan(snapshot, world.now)
        if check == "memo":
            # One memo follows the snapshots' changes, the other reads each one whole.
            carried = plan(snapshot, world.now, memo)
            assert carried == fresh, f"cycle {number}: memo {carried!r}\nfresh {fresh!r}"
            whole = plan(replace(snapshot, changes=None), world.now, reading_whole)
            assert whole == fresh, f"cycle {number}: memo {whole!r}\nfresh {fresh!r}"
        elif check == "rows":
            rows = plan(snapshot, world.now, PlanMemo(settled_runs=False))
            assert tuple(rows.waiting) == tuple(fresh.waiting), f"cycle {number}"
        else:
            one_by_one = plan(snapshot, world.now, PlanMemo(frozen_tails=False))
            assert decisions(one_by_one) == decisions(fresh), f"cycle {number}"
        world.apply(fresh, cycle.delays)
        world.cycle += 1
        world.now += cycle.step


def decisions(result: Plan) -> tuple[object, ...]:
    return (
        result.admissions,
        result.preemptions,
        result.kept,
        sorted((w.workload_id, w.position, w.cause) for w in result.waiting),
    )


@FAST
@given(scenarios(), searches)
def test_a_carried_memo_plans_as_a_fresh_one(scenario: Scenario, max_searches: int) -> None:
    run_world(scenario, max_searches, "memo")


@FAST
@given(contended(), searches)
def test_a_carried_memo_plans_as_a_fresh_one_under_contention(
    scenario: Scenario, max_searches: int
) -> None:
    run_world(scenario, max_searches, "memo")


@FAST
@given(scenarios(), searches)
def test_frozen_tails_decide_as_one_by_one(scenario: Scenario, max_searches: int) -> None:
    run_world(scenario, max_searches, "frozen")


@FAST
@given(contended(), searches)
def test_settled_runs_read_as_rows_written_one_by_one(
    scenario: Scenario, max_searches: int
) -> None:
    """Runs of repeated refusals (``waits.py``) expand to exactly the rows, positions and
    reasons that writing each row at once gives."""
    run_world(scenario, max_searches, "rows")
