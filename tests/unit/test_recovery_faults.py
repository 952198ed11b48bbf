"""The fault-injection model (recovery/faults.py): Llama 3's rates, what each policy pays
per fault, and that gpufleet's own rules (classify, next_attempt) decide its restarts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gpufleet.faults_cli import restart_seconds
from gpufleet.recovery.faults import (
    LLAMA3,
    POLICIES,
    Costs,
    FaultKind,
    FaultModel,
    Job,
    ettr_table,
    simulate_job,
)

COSTS = Costs()


def test_llama3s_rates_give_its_mtbf() -> None:
    assert sum(k.count for k in LLAMA3.kinds) == 419
    assert LLAMA3.mtbf_s(16384) / 3600 == pytest.approx(3.09, abs=0.01)
    assert LLAMA3.mtbf_s(1024) == pytest.approx(16 * LLAMA3.mtbf_s(16384))
    # Young's interval for 5 s checkpoints: sqrt(2 x 5 s x MTBF).
    assert Job(16384).checkpoint_interval_s == pytest.approx(math.sqrt(10 * 11135), rel=0.01)


def test_without_faults_only_the_checkpoints_cost_anything() -> None:
    # One fault per billion GPUs and million days: none in a day of 1,024 GPUs.
    rare = FaultModel((FaultKind("rare", 1, "crash"),), gpus=10**9, days=1e6)
    job = Job(1024, days=1.0, model=rare)
    for policy in POLICIES:
        outcome = simulate_job(job, COSTS, policy, seed=1)
        assert outcome.faults == 0 and outcome.down_s == 0
        interval = math.sqrt(2 * COSTS.checkpoint_s * job.model.mtbf_s(job.gpus))
        assert outcome.ettr == pytest.approx(1 - COSTS.checkpoint_s / interval)


def test_one_kind_of_fault_costs_each_policy_what_its_rules_say() -> None:
    gpu_faults = FaultModel((FaultKind("faulty GPU", 100, "gpu"),), gpus=16384, days=54.0)
    job = Job(16384, spares=2, days=10.0, model=gpu_faults)
    runs = {p: simulate_job(job, COSTS, p, seed=3) for p in POLICIES}
    # gpufleet: the XID acts within act_s, the job restarts on a spare (its back-off
    # comes on top); the baselines wait for a person.
    gpufleet = runs["gpufleet"]
    per_fault = gpufleet.down_s / gpufleet.faults
    assert COSTS.act_s + COSTS.restart_s <= per_fault < COSTS.act_s + COSTS.restart_s + 60
    assert runs["restart-any"].down_s / runs["restart-any"].faults > COSTS.nccl_timeout_s
    assert runs["manual"].ettr < gpufleet.ettr and runs["restart-any"].ettr < gpufleet.ettr


def test_the_issues_targets_hold_with_spares() -> None:
    large = ettr_table(16384, 2, replace(COSTS, restart_s=60.0), seeds=10)
    small = ettr_table(1024, 2, replace(COSTS, restart_s=15.0), seeds=10)
    assert large["gpufleet"].ettr >= 0.95 and small["gpufleet"].ettr >= 0.985
    assert large["gpufleet"].ettr > max(large["restart-any"].ettr, large["manual"].ettr)


def test_the_same_seed_gives_the_same_run() -> None:
    job = Job(4096, spares=1, days=5.0)
    assert simulate_job(job, COSTS, "gpufleet", 7) == simulate_job(job, COSTS, "gpufleet", 7)


def test_the_restart_cost_follows_the_issues_fixed_costs() -> None:
    assert [restart_seconds(g) for g in (512, 1024, 8704, 16384, 32768)] == [
        15.0,
        15.0,
        37.5,
        60.0,
        60.0,
    ]
