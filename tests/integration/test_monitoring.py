"""The Grafana dashboard and the recording rules of docs/monitoring/ against what the
controller and a node agent really export (the shared test hub, with a session running so
the agent labels its GPUs with the workload), and ``promtool check rules``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ..exposition import parse
from .harness import REPO, Hub, wait_for

pytestmark = pytest.mark.integration

RULES = REPO / "docs" / "monitoring" / "gpufleet-rules.yml"
DASHBOARD = REPO / "docs" / "monitoring" / "gpufleet-dashboard.json"


def metric_names(expr: str) -> set[str]:
    """The metric (or recorded) names a PromQL expression reads: identifiers outside label
    matchers, grouping clauses and ranges that are not called like functions."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", bare)
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?![a-zA-Z0-9_:]*\s*\()", bare)) - {"le"}


def rules() -> list[dict[str, str]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


HISTOGRAM = ("_bucket", "_sum", "_count")


def exported(hub: Hub) -> dict[str, list[dict[str, str]]]:
    """Every series name the controller and the agent declare, as a server stores them,
    with each sample's labels (a labelled counter has no sample until its first event: its
    series names still count)."""
    samples: dict[str, list[dict[str, str]]] = {}
    for url in (f"{hub.url}/services/gpufleet/metrics", hub.metrics_url):
        scrape = parse(httpx.get(url, timeout=10).text)
        for name, kind in scrape.types.items():
            for suffix in HISTOGRAM if kind == "histogram" else ("",):
                samples.setdefault(name + suffix, [])
        for name, found in scrape.samples.items():
            samples.setdefault(name, []).extend(labels for labels, _ in found)
    return samples


def held_gpus(samples: dict[str, list[dict[str, str]]]) -> list[dict[str, str]]:
    """The GPU series labelled with the workload holding the GPU."""
    return [s for s in samples.get("DCGM_FI_DEV_GPU_UTIL", []) if s.get("hpc_job")]


def test_every_series_the_rules_and_the_dashboard_read_is_exported(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("alice")
    # The agent labels GPUs with their holder from its next heartbeat's assignments.
    samples = wait_for(
        lambda: found if len(held_gpus(found := exported(fleet))) == 2 else None,
        15,
        "alice's two GPUs labelled with their workload",
    )
    recorded = {rule["record"] for rule in rules()}
    read_by_rules = set().union(*(metric_names(rule["expr"]) for rule in rules()))
    missing = sorted(read_by_rules - set(samples))
    assert not missing, f"the rules read series nobody exports: {missing}"
    read_by_dashboard = set().union(*(metric_names(e) for e in dashboard_exprs()))
    unknown = sorted(n for n in read_by_dashboard - set(samples) if n not in recorded)
    assert not unknown, f"the dashboard reads series neither exported nor recorded: {unknown}"
    # The per-workload rules select GPUs by the holder's label: alice's two carry it.
    assert {s["gpufleet_user"] for s in held_gpus(samples)} == {"alice"}
    assert any(s.get("project") == "vision" for s in samples["gpufleet_allocated_gpus"])
    # Series of known labels exist from the start: a dashboard shows 0, not "no data".
    ended = {(s["kind"], s["outcome"]) for s in samples["gpufleet_workloads_ended_total"]}
    assert ("job", "failed") in ended and ("session", "preempted") in ended
    assert {s["reason"] for s in samples["gpufleet_culls_total"]} == {"idle", "max-age"}


def test_the_dashboard_is_a_grafana_dashboard_on_a_chosen_prometheus() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["schemaVersion"] >= 36
    source, job = board["templating"]["list"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    # The workload panels follow the chosen workloads (all of them by default).
    assert (job["name"], job["includeAll"], job["allValue"]) == ("job", True, ".+")
    for panel in board["panels"]:
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"]["uid"] == "${datasource}"


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus; scripts/install --test)")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


# docs/monitoring.md, "Cardinality": the series one GPU costs on its agent's exporter (31
# once it has had an XID), and what a workload adds per node it runs on.
SERIES_PER_GPU = 30
SERIES_PER_WORKLOAD_AND_NODE = 2


def test_the_series_budget_per_gpu_and_per_workload_holds(fleet: Hub) -> None:
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("bob")
    bob = fleet.workload_of("bob")
    assert bob is not None

    def scraped() -> Any:
        found = parse(httpx.get(fleet.metrics_url, timeout=10).text)
        held = [
            labels
            for labels, _ in found.samples.get("DCGM_FI_DEV_GPU_UTIL", [])
            if labels.get("hpc_job") == str(bob["id"])
        ]
        traffic = found.samples.get("gpufleet_workload_network_receive_bytes_total", [])
        mine = [labels for labels, _ in traffic if labels.get("hpc_job") == str(bob["id"])]
        return found if len(held) == 2 and mine else None

    found = wait_for(scraped, 30, "bob's GPUs and traffic on the agent's exporter")
    per_gpu: dict[str, int] = {}
    per_workload: dict[str, int] = {}
    for samples in found.samples.values():
        for labels, _ in samples:
            if "UUID" in labels:
                per_gpu[labels["UUID"]] = per_gpu.get(labels["UUID"], 0) + 1
            elif "hpc_job" in labels:
                per_workload[labels["hpc_job"]] = per_workload.get(labels["hpc_job"], 0) + 1
    # A GPU that had an XID (another test's, on this shared hub) has its last one besides.
    had_xid = {labels["UUID"] for labels, _ in found.samples.get("DCGM_FI_DEV_XID_ERRORS", [])}
    budget = {uuid: SERIES_PER_GPU + (uuid in had_xid) for uuid in per_gpu}
    assert len(per_gpu) == 8 and per_gpu == budget, per_gpu
    assert per_workload[str(bob["id"])] == SERIES_PER_WORKLOAD_AND_NODE
    # Nothing on a per-GPU series changes with a step or an attempt.
    names = {name for samples in found.samples.values() for labels, _ in samples for name in labels}
    assert not names & {"attempt", "step", "checkpoint", "rank"}
