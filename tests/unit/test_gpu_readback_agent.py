"""The node agent's GPU read-back: which GPUs each marker's container was given.

Pure functions with literal processes (agent/placements.py), and the /proc adapter
(``recovery.processes.marked_process_details``) with real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.agent.placements import (
    Conflict,
    PodIdentity,
    Readback,
    changed_placements,
    placements_body,
    pod_identities,
    read_placements,
    served_uuids,
    visible_uuids,
)
from gpufleet.recovery import processes
from gpufleet.recovery.processes import MarkedProcess

SERVED = frozenset({"GPU-a", "GPU-b", "GPU-c", "MIG-d"})


def process(
    pid: int, marker: str, visible: str | None, started: int | None = None
) -> MarkedProcess:
    environ = {} if visible is None else {"NVIDIA_VISIBLE_DEVICES": visible}
    return MarkedProcess(pid, marker, pid if started is None else started, environ)


@pytest.mark.parametrize(
    ("value", "uuids"),
    [
        ("GPU-b,GPU-a", ("GPU-b", "GPU-a")),
        (" GPU-a , GPU-c ,", ("GPU-a", "GPU-c")),
        ("GPU-a,GPU-a", ("GPU-a",)),
        ("MIG-d", ("MIG-d",)),  # a MIG slice, as the device plugin names it
        ("GPU-a,GPU-elsewhere", ("GPU-a",)),  # a GPU another agent serves
        ("GPU-elsewhere", ()),
        ("all", ()),
        ("ALL", ()),
        ("none", ()),
        ("void", ()),
        ("", ()),
        (None, ()),
        ("0,1", ()),  # indexes name no particular GPU
        ("GPU-a,1", ()),  # nor does a list with one: its UUIDs alone would be too few
        ("0:1", ()),  # a MIG device by index
    ],
)
def test_only_uuids_of_served_gpus_are_read(value: str | None, uuids: tuple[str, ...]) -> None:
    assert visible_uuids(value, SERVED) == uuids


def test_each_marker_gets_the_gpus_of_its_first_process() -> None:
    readback = read_placements(
        [
            process(300, "m1", "GPU-a"),
            process(120, "m2", "GPU-b,GPU-c"),
            process(121, "m2", "GPU-b,GPU-c"),  # its kernel, same environment
            process(400, "m1.0", "GPU-c"),  # pod 0 of a job: a marker of its own
            process(500, "m3", "all"),
            process(501, "m4", None),
            process(502, "m5", "GPU-elsewhere"),
        ],
        SERVED,
    )
    assert readback == Readback(
        {"m1": ("GPU-a",), "m2": ("GPU-b", "GPU-c"), "m1.0": ("GPU-c",)}, ()
    )


def test_a_later_process_with_other_gpus_changes_nothing_and_is_a_conflict() -> None:
    # The container's init started first (start time 10) although its pid is higher (pids
    # wrap); a process it started later named other devices for a child of its own.
    readback = read_placements(
        [
            process(50, "m1", "GPU-c", started=90),
            process(7000, "m1", "GPU-a", started=10),
            process(7001, "m1", "GPU-a", started=11),
            process(51, "m1", "none", started=95),
        ],
        SERVED,
    )
    assert readback == Readback({"m1": ("GPU-a",)}, (Conflict("m1", 7000, "GPU-a", 50, "GPU-c"),))


def test_a_first_process_that_names_no_gpu_decides_too() -> None:
    readback = read_placements(
        [process(1, "m1", None, started=1), process(2, "m1", "GPU-a", started=2)], SERVED
    )
    assert readback == Readback({}, (Conflict("m1", 1, None, 2, "GPU-a"),))


def test_the_first_report_is_complete_and_later_ones_only_carry_changes() -> None:
    now = {"m1": ("GPU-a",), "m2": ("GPU-b",)}
    assert changed_placements(now, None) == now
    assert changed_placements(now, now) == {}
    reported = {"m1": ("GPU-c",), "gone": ("GPU-c",)}
    assert changed_placements(now, reported) == {"m1": ("GPU-a",), "m2": ("GPU-b",)}
    assert changed_placements({}, reported) == {}  # a marker that went away is not sent


def test_the_report_body_lists_each_marker_once_in_a_stable_order() -> None:
    assert placements_body({"m2": ("GPU-b", "GPU-a"), "m1": ("GPU-c",)}) == {
        "placements": [
            {"marker": "m1", "gpu_uuids": ["GPU-c"]},
            {"marker": "m2", "gpu_uuids": ["GPU-b", "GPU-a"]},
        ]
    }


def test_the_served_gpus_are_those_the_agent_registers() -> None:
    inventory = [
        {"name": "n1", "gpus": [{"uuid": "GPU-a", "index": 0}, {"uuid": "MIG-d", "index": 1}]},
        {"name": "n2", "gpus": [{"uuid": "GPU-b", "index": 0}]},
    ]
    assert served_uuids(inventory) == {"GPU-a", "MIG-d", "GPU-b"}


# ------------------------------------------------------------------ the adapter
def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")


def test_marked_processes_are_read_with_their_devices_and_start_order(tmp_path: Path) -> None:
    marker = processes.new_marker()
    started: list[subprocess.Popen[bytes]] = []
    for visible in ("GPU-a,GPU-b", "GPU-c"):
        if started:  # the second starts at a later clock tick: poll until one has passed
            deadline = time.monotonic() + 5
            while uptime_ticks() < start_ticks(started[0].pid) + 2:
                assert time.monotonic() < deadline
        env = {**os.environ, processes.MARKER_VARIABLE: marker, "NVIDIA_VISIBLE_DEVICES": visible}
        started.append(subprocess.Popen(["sleep", "60"], env=env, cwd=tmp_path))
    try:
        found = [
            p
            for p in processes.marked_process_details(["NVIDIA_VISIBLE_DEVICES"])
            if p.marker == marker
        ]
        assert sorted((p.pid, dict(p.environ)) for p in found) == [
            (started[0].pid, {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}),
            (started[1].pid, {"NVIDIA_VISIBLE_DEVICES": "GPU-c"}),
        ]
        readback = read_placements(found, SERVED)
        assert readback.placements == {marker: ("GPU-a", "GPU-b")}
        assert [c.other_pid for c in readback.conflicts] == [started[1].pid]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


# Names itself with bytes that are not UTF-8 and a ')' (prctl PR_SET_NAME), then waits.
ODD_NAME = """
import ctypes, sys
ctypes.CDLL(None).prctl(15, b"x) \\xff\\xfe(", 0, 0, 0)
print("named", flush=True)
sys.stdin.read()
"""


def test_a_process_named_with_any_bytes_is_read_like_any_other(tmp_path: Path) -> None:
    """A process chooses its own name: one that is not UTF-8, or holds a ')', must not
    stop the agent reading every other process (its metrics, its read-back)."""
    marker = processes.new_marker()
    env = {**os.environ, processes.MARKER_VARIABLE: marker}
    odd = subprocess.Popen(
        [sys.executable, "-c", ODD_NAME],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert odd.stdout is not None and odd.stdout.readline() == b"named\n"
        assert b"\xff" in Path(f"/proc/{odd.pid}/stat").read_bytes()
        found = [p for p in processes.marked_process_details(()) if p.marker == marker]
        assert [p.pid for p in found] == [odd.pid]
        assert processes.start_ticks(odd.pid) == found[0].started
    finally:
        odd.kill()
        odd.wait()


def pod_process(pid: int, marker: str, visible: str, **pod: str) -> MarkedProcess:
    names = {
        "pod": processes.POD_NAME_VARIABLE,
        "namespace": processes.POD_NAMESPACE_VARIABLE,
        "container": processes.CONTAINER_VARIABLE,
    }
    environ = {"NVIDIA_VISIBLE_DEVICES": visible} | {names[k]: v for k, v in pod.items()}
    return MarkedProcess(pid, marker, pid, environ)


def test_each_gpu_is_named_after_the_pod_its_container_was_given_to() -> None:
    found = pod_identities(
        [
            pod_process(10, "m1.0", "GPU-a", pod="gf-job-1-a1-0", namespace="ns", container="t"),
            pod_process(11, "m1.1", "GPU-b", pod="gf-job-1-a1-1", namespace="ns", container="t"),
            # A later process of the first pod, with another pod's name, changes nothing.
            pod_process(12, "m1.0", "GPU-a", pod="forged", namespace="ns", container="t"),
            process(13, "local", "GPU-c"),  # one machine: no pod variables
            # A process with a marker of its own, naming GPU-a and a pod: not GPU-a's holder.
            pod_process(14, "forger", "GPU-a", pod="fake", namespace="other", container="x"),
        ],
        SERVED,
        {"GPU-a": "m1", "GPU-b": "m1", "GPU-c": "local"},
    )
    assert found == {
        "GPU-a": PodIdentity("gf-job-1-a1-0", "ns", "t"),
        "GPU-b": PodIdentity("gf-job-1-a1-1", "ns", "t"),
    }
