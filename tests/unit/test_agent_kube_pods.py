"""The node agent's relay of Kubernetes job pods' output (``agent/kube_pods.py``): a pod's
CRI log file split into each rank's streams, at offsets that continue across reads, sent
again until acknowledged, a new attempt read afresh, and a pod kept into the next attempt
read on from where the last one's output ended."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpufleet.agent.kube_pods import KubePods

T = "2026-12-05T10:00:00.000000001Z"


def listed(attempt: int = 1) -> dict[str, Any]:
    return {
        "workload_id": 7,
        "pod_index": 1,
        "attempt": attempt,
        "marker": "m",
        "account": {"uid": 1500},
        "spec": {"checkpoint_uri": "/ckpt/ann/job"},
    }


def log_file(root: Path, attempt: int = 1) -> Path:
    path = root / f"gpufleet_gf-job-7-a{attempt}-1_0f0e/torchrun/0.log"
    path.parent.mkdir(parents=True)
    return path


def write(path: Path, *records: str) -> None:
    with path.open("a") as f:
        f.write("".join(f"{T} {r}\n" for r in records))


def by_stream(chunks: list[dict[str, Any]]) -> dict[tuple[int, str], str]:
    out: dict[tuple[int, str], str] = {}
    for chunk in chunks:
        key = (chunk["rank"], chunk["stream"])
        assert chunk["offset"] == len(out.get(key, "").encode())  # contiguous
        out[key] = out.get(key, "") + chunk["data"]
    return out


def test_a_pods_output_splits_into_each_ranks_streams(tmp_path: Path) -> None:
    pods = KubePods([tmp_path], logging.getLogger("test"))
    pods.watch([listed()])
    path = log_file(tmp_path)
    write(
        path,
        "stdout F waiting for the master pod",
        "stdout F [gpufleet rank 2]:step 1 é",
        "stderr F [gpufleet rank 3]:Traceback (most recent call last):",
        "stdout P [gpufleet rank 3]:a long li",
        "stdout F ne in two parts",
        "stdout F [gpufleet rank 2]:step 2",
    )
    streams = by_stream(pods.chunks())
    assert streams == {
        (-2, "stdout"): "waiting for the master pod\n",  # torchrun's own: pod 1's -1-1
        (2, "stdout"): "step 1 é\nstep 2\n",
        (3, "stderr"): "Traceback (most recent call last):\n",
        (3, "stdout"): "a long line in two parts\n",
    }


def test_chunks_are_sent_again_until_acknowledged_and_go_on_from_there(tmp_path: Path) -> None:
    pods = KubePods([tmp_path], logging.getLogger("test"))
    pods.watch([listed()])
    path = log_file(tmp_path)
    write(path, "stdout F [gpufleet rank 2]:one")
    first = pods.chunks()
    assert pods.chunks() == first  # the sync failed: the same again
    pods.acknowledged(len(first))
    write(path, "stdout F [gpufleet rank 2]:two")
    with path.open("a") as f:
        f.write(f"{T} stdout F [gpufleet rank 2]:half a rec")  # still being written
    second = pods.chunks()
    assert [(c["offset"], c["data"]) for c in second] == [(4, "two\n")]


def test_a_new_attempt_is_read_afresh_once_the_last_ones_output_is_acknowledged(
    tmp_path: Path,
) -> None:
    pods = KubePods([tmp_path], logging.getLogger("test"))
    pods.watch([listed(1)])
    write(log_file(tmp_path, 1), "stdout F [gpufleet rank 2]:attempt one")
    pods.watch([listed(2)])  # its last output is still to be sent
    assert [c["attempt"] for c in pods.chunks()] == [1]
    pods.acknowledged(1)
    pods.watch([listed(2)])
    write(log_file(tmp_path, 2), "stdout F [gpufleet rank 2]:attempt two")
    chunks = pods.chunks()
    assert [(c["attempt"], c["offset"], c["data"]) for c in chunks] == [(2, 0, "attempt two\n")]


def test_a_pod_whose_files_the_kubelet_removed_is_forgotten_without_failing(
    tmp_path: Path,
) -> None:
    pods = KubePods([tmp_path], logging.getLogger("test"))
    pods.watch([listed(1)])
    path = log_file(tmp_path, 1)
    write(path, "stdout F [gpufleet rank 2]:the last words")
    assert [c["data"] for c in pods.chunks()] == ["the last words\n"]
    pods.acknowledged(1)
    path.unlink()  # the pod was deleted, and its kubelet removed its output
    pods.watch([])
    assert pods.known() == [] and pods.chunks() == []


def test_a_pod_kept_into_the_next_attempt_reads_on_where_the_last_one_stopped(
    tmp_path: Path,
) -> None:
    pods = KubePods([tmp_path], logging.getLogger("test"))
    pods.watch([listed(1)])
    path = log_file(tmp_path, 1)
    write(path, "stdout F [gpufleet rank 2]:attempt 1 step 9")
    pods.acknowledged(len(pods.chunks()))
    # The restart keeps the pod: same name and file, the output after is attempt 2's.
    kept = {**listed(2), "created_attempt": 1}
    write(path, "stdout F [gpufleet rank 2]:attempt 1 step 10")
    pods.watch([kept])  # attempt 1's last words are read; not yet acknowledged
    write(path, "stdout F [gpufleet rank 2]:attempt 2 starts at step 5")
    last = pods.chunks()
    assert [(c["attempt"], c["data"]) for c in last] == [(1, "attempt 1 step 10\n")]
    pods.acknowledged(len(last))
    pods.watch([kept])  # attempt 1's pod is forgotten, and the pod watched afresh
    first = pods.chunks()
    pods.acknowledged(len(first))
    write(path, "stdout F [gpufleet rank 2]:attempt 2 step 6")
    then = pods.chunks()
    assert [(c["attempt"], c["offset"], c["data"]) for c in [*first, *then]] == [
        (2, 0, "attempt 2 starts at step 5\n"),
        (2, 27, "attempt 2 step 6\n"),
    ]
