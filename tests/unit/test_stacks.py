"""A rank's stacks: py-spy's dump read for where each rank is (pure), and the node agent
taking them of real processes by their pod's marker with the real py-spy."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.agent.stacks import NO_RANK_PROCESS, StackTaker, dump, rank_pids
from gpufleet.recovery.processes import MARKER_VARIABLE, new_marker, part_marker
from gpufleet.recovery.stacks import RankWhere, summary, threads_of, where_of

DUMP = """\
Process 4242: /usr/bin/python3 train.py
Python v3.11.2 (/usr/bin/python3.11)

Thread 4250 (idle): "pin_memory"
    wait (threading.py:327)
    run (threading.py:975)
Thread 4242 (active+gil): "MainThread"
    wait_for_nothing (train.py:12)
    train (train.py:30)
    <module> (train.py:41)
"""


def test_a_ranks_where_is_its_main_threads_innermost_frame() -> None:
    assert [name for name, _ in threads_of(DUMP)] == ["pin_memory", "MainThread"]
    assert where_of(DUMP) == "wait_for_nothing (train.py:12)"
    unnamed = "Thread 0x7F3A (idle)\n    poll (selectors.py:468)\n"
    assert where_of(unnamed) == "poll (selectors.py:468)"
    assert where_of("Error: Failed to find python version from target process") == ""


def test_a_summary_says_every_rank_in_order_and_why_one_has_no_stacks() -> None:
    said = summary(
        [
            RankWhere(1, "", "no process of this rank runs here"),
            RankWhere(0, "all_reduce (distributed_c10d.py:2501)"),
            RankWhere(2, ""),
        ]
    )
    assert said == (
        "rank 0 in all_reduce (distributed_c10d.py:2501); rank 1: no stacks (no process "
        "of this rank runs here); rank 2 in no Python frame"
    )


HANGS = textwrap.dedent(
    """
    import sys, time

    def wait_for_nothing():
        sys.stdout.write("waiting\\n"); sys.stdout.flush()
        while True:
            time.sleep(0.05)

    wait_for_nothing()
    """
)
PY_SPY = str(Path(sys.executable).parent / "py-spy")


@pytest.fixture
def pod_ranks(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """Ranks 2 and 3 of pod 1 of a job, as torchrun starts them (RANK, the pod's marker)."""
    script = tmp_path / "train.py"
    script.write_text(HANGS)
    marker = new_marker()
    started = []
    for rank in (2, 3):
        env = {**os.environ, MARKER_VARIABLE: part_marker(marker, 1), "RANK": str(rank)}
        child = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
        started.append(child)
    for child in started:
        assert child.stdout is not None and child.stdout.readline() == b"waiting\n"
    yield marker, started
    for child in started:
        child.kill()
        child.wait()


def test_the_agent_takes_each_ranks_stacks_of_its_pod_and_only_of_it(
    pod_ranks: tuple[str, list[subprocess.Popen[bytes]]],
) -> None:
    marker, started = pod_ranks
    assert rank_pids(part_marker(marker, 1), range(2, 4)) == {2: started[0].pid, 3: started[1].pid}
    assert rank_pids(part_marker(marker, 0), range(0, 2)) == {}  # another pod's marker
    assert rank_pids(part_marker(marker, 1), range(0, 2)) == {}  # not this pod's ranks

    taker = StackTaker(PY_SPY, logging.getLogger("test"))
    listed = {"workload_id": 7, "pod_index": 1, "gpus_per_pod": 2, "marker": marker, "trace": 5}
    asyncio.run(taker.answer([listed, {**listed, "pod_index": 0, "trace": None}]))
    [answer] = taker.take()
    assert (answer["trace_id"], answer["workload_id"], answer["pod_index"]) == (5, 7, 1)
    assert [(r["rank"], r["pid"], r["where"], r["error"]) for r in answer["ranks"]] == [
        (2, started[0].pid, "wait_for_nothing (train.py:7)", ""),
        (3, started[1].pid, "wait_for_nothing (train.py:7)", ""),
    ]
    assert "<module> (train.py:9)" in answer["ranks"][0]["text"]  # the whole stack
    asyncio.run(taker.answer([listed]))
    assert taker.take() == []  # answered once

    started[1].kill()
    started[1].wait()
    asyncio.run(taker.answer([{**listed, "trace": 6}]))
    [again] = taker.take()
    assert again["ranks"][1] == {"rank": 3, "error": NO_RANK_PROCESS}


def test_what_py_spy_cannot_do_is_said_not_raised() -> None:
    text, error = asyncio.run(dump("/nonexistent/py-spy", 1))
    assert text == "" and error.startswith("py-spy could not be run (/nonexistent/py-spy")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    text, error = asyncio.run(dump(PY_SPY, gone.pid))
    assert error.startswith("py-spy exited 1: "), error
