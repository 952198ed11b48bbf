"""The charts (``hub/gpu_charts.py``) from literal series: their structure, where the
points land in the view box, the labels (time labels that never overlap, whatever the
window), which points a workload's chart shows, and a job's steps and loss."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest

from gpufleet.hub.gpu_charts import (
    LABEL_GAP,
    LEFT,
    LOSS_TOP,
    MEM_TOP,
    PANEL_H,
    PLOT_W,
    STEP_TOP,
    UTIL_TOP,
    GpuSeries,
    HeldGpu,
    chart_svg,
    gpu_label,
    label_px,
    progress_svg,
    time_ticks,
    workload_series,
)
from gpufleet.state.inventory import GpuPoint
from gpufleet.state.progress import ProgressPoint

SVG = "{http://www.w3.org/2000/svg}"
T0 = datetime(2026, 1, 12, 9, 0, tzinfo=UTC)
GIB = 2**30


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def point(minutes: float, utilization: int | None, used_gib: float | None) -> GpuPoint:
    used = None if used_gib is None else int(used_gib * GIB)
    return GpuPoint(at(minutes), utilization, used, 80 * GIB)


SERIES = [
    GpuSeries(
        "GPU-3f2a9b1c-0000-4000-8000-000000000000",
        gpu_label("node-a", 0, "GPU-3f2a9b1c-0000-4000-8000-000000000000"),
        [point(0, 0, 0), point(30, 50, 40), point(60, 100, 80)],
    ),
    GpuSeries("GPU-b", "node-b GPU 1 <&>", [point(15, 20, None), point(90, 10, 8)]),
]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # well-formed XML, or this raises


def coords(polyline: ET.Element) -> list[tuple[float, float]]:
    return [
        (float(x), float(y))
        for x, y in (pair.split(",") for pair in polyline.get("points", "").split())
    ]


def test_one_line_per_gpu_in_each_panel_and_a_legend_naming_each_gpu() -> None:
    root = parse(chart_svg(SERIES, T0, at(60), "GPUs of job 7"))
    assert root.tag == f"{SVG}svg" and root.get("class") == "gpu-chart"
    lines = root.findall(f"{SVG}polyline")
    assert [(p.get("class"), p.get("data-gpu")) for p in lines] == [
        ("series utilization", SERIES[0].uuid),
        ("series memory", SERIES[0].uuid),
        ("series utilization", "GPU-b"),
        ("series memory", "GPU-b"),
    ]
    assert lines[0].get("stroke") != lines[2].get("stroke")
    legend = ["".join(g.itertext()) for g in root.iter(f"{SVG}g") if g.get("class") == "legend"]
    assert legend == ["node-a GPU 0 (GPU-3f2a9b1c…)", "node-b GPU 1 <&>"]
    assert root.findtext(f"{SVG}title") == "GPUs of job 7"
    escaped = chart_svg(SERIES, T0, at(60), "<script>")
    assert "<script" not in escaped and "&lt;script&gt;" in escaped


def test_points_are_scaled_into_the_view_box() -> None:
    root = parse(chart_svg(SERIES, T0, at(60), "GPUs of job 7"))
    util, memory, util_b, memory_b = root.findall(f"{SVG}polyline")
    bottom = UTIL_TOP + PANEL_H
    assert coords(util) == [
        (LEFT, bottom),
        (LEFT + PLOT_W / 2, bottom - PANEL_H / 2),
        (LEFT + PLOT_W, UTIL_TOP),
    ]
    # Memory is scaled to the largest total (80 GiB).
    assert coords(memory) == [
        (LEFT, MEM_TOP + PANEL_H),
        (LEFT + PLOT_W / 2, MEM_TOP + PANEL_H / 2),
        (LEFT + PLOT_W, MEM_TOP),
    ]
    # The second GPU's point at 90 min lies outside the window; its first has no memory.
    assert coords(util_b) == [(LEFT + PLOT_W / 4, bottom - PANEL_H / 5)]
    assert coords(memory_b) == []
    width, height = (float(v) for v in root.get("viewBox", "").split()[2:])
    assert all(
        0 <= x <= width and 0 <= y <= height for line in (util, memory) for x, y in coords(line)
    )


def test_times_read_hh_mm_utc_from_the_start_to_the_end_of_the_window() -> None:
    root = parse(chart_svg(SERIES, T0, at(60), "GPUs of job 7"))
    times = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "time"]
    assert times == ["09:00 UTC", "09:15 UTC", "09:30 UTC", "09:45 UTC", "10:00 UTC"]
    assert all(re.fullmatch(r"\d\d:\d\d UTC", t or "") for t in times)
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert {"0 %", "50 %", "100 %", "0 GiB", "40 GiB", "80 GiB"} <= set(labels)
    assert root.get("aria-label") == "GPUs of job 7, from 2026-01-12 09:00 to 2026-01-12 10:00 UTC"


def test_many_points_in_one_pixel_column_are_drawn_as_their_mean() -> None:
    dense = [point(i / 600, 10 * (i % 2), 1) for i in range(10)]  # 10 points within 1 s
    root = parse(chart_svg([GpuSeries("GPU-c", "c", dense)], T0, at(60), "t"))
    util = root.findall(f"{SVG}polyline")[0]
    ((x, y),) = coords(util)
    assert abs(x - LEFT) < 0.2 and y == UTIL_TOP + PANEL_H - PANEL_H * 0.05


def test_a_window_without_samples_says_so() -> None:
    root = parse(chart_svg([GpuSeries("GPU-c", "c", [])], T0, T0, "t"))
    assert [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "no-samples"] == [
        "No samples in this window yet"
    ] * 2
    assert len(root.findall(f"{SVG}polyline")) == 2


def test_a_workloads_series_hold_only_the_points_of_its_own_allocations() -> None:
    held = [
        HeldGpu("GPU-a", 0, "node-a", at(0), at(10)),
        HeldGpu("GPU-b", 1, "node-a", at(0), None),
        HeldGpu("GPU-a", 0, "node-a", at(20), None),  # preempted, then placed there again
    ]
    history = {
        "GPU-a": [point(m, 1, 1) for m in (5, 15, 25)],  # at 15 another workload held it
        "GPU-b": [point(5, 1, 1)],
    }
    assert workload_series(held, history) == [
        GpuSeries("GPU-a", "node-a GPU 0 (GPU-a)", [point(5, 1, 1), point(25, 1, 1)]),
        GpuSeries("GPU-b", "node-a GPU 1 (GPU-b)", [point(5, 1, 1)]),
    ]


# ------------------------------------------------------------ time labels
SPANS = [
    timedelta(seconds=s)
    for s in (1, 3, 5, 12, 40, 95, 200, 420, 1000, 3600, 5400, 9 * 3600, 86400, 30 * 3600)
] + [timedelta(days=d) for d in (2, 4, 9, 20, 60, 400)]


@pytest.mark.parametrize("span", SPANS, ids=str)
@pytest.mark.parametrize("width", [PLOT_W, 300])
def test_time_labels_never_overlap_whatever_the_window_and_width(
    span: timedelta, width: float
) -> None:
    for offset_s in (0, 1, 7, 55, 65, 3599, 86399):
        since = T0 + timedelta(seconds=offset_s, microseconds=250_000)
        ticks = time_ticks(since, since + span, width)
        assert ticks[0][0] == since and ticks[-1][0] == since + span
        boxes = []
        for tick, anchor, text in ticks:
            x = (tick - since) / span * width
            w = label_px(text)
            left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
            boxes.append((left, left + w))
        assert boxes[0][0] == 0 and abs(boxes[-1][1] - width) < 1e-6
        for (_, right), (left, _) in itertools.pairwise(boxes):
            assert left - right >= LABEL_GAP - 1e-6, (span, offset_s, ticks)


def test_time_labels_read_to_the_second_in_a_short_window_and_with_the_day_in_a_long_one() -> None:
    short = [text for _, _, text in time_ticks(T0, T0 + timedelta(seconds=40))]
    assert short == ["09:00:00 UTC", "09:00:15 UTC", "09:00:30 UTC", "09:00:40 UTC"]
    long = [text for _, _, text in time_ticks(T0, T0 + timedelta(days=4))]
    assert long[0] == "12 Jan 09:00 UTC" and long[-1] == "16 Jan 09:00 UTC"


# ------------------------------------------------------------ a job's progress
def step(
    minutes: float, number: int | None, loss: float | None, epoch: int | None = None
) -> ProgressPoint:
    return ProgressPoint(at(minutes), number, epoch, loss)


def test_the_progress_chart_draws_steps_and_loss_on_the_gpu_charts_time_axis() -> None:
    points = [step(0, 0, 4.0), step(30, 500, 2.0), step(60, 1000, 1.0)]
    root = parse(progress_svg(points, T0, at(60), "Progress of job 7 <&>"))
    assert root.get("class") == "progress-chart"
    [steps] = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "series steps"]
    [loss] = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "series loss"]
    assert coords(steps) == [
        (LEFT, STEP_TOP + PANEL_H),
        (LEFT + PLOT_W / 2, STEP_TOP + PANEL_H / 2),
        (LEFT + PLOT_W, STEP_TOP),
    ]
    # The loss from its lowest (bottom) to its highest (top).
    assert coords(loss) == [
        (LEFT, LOSS_TOP),
        (LEFT + PLOT_W / 2, round(LOSS_TOP + PANEL_H * 2 / 3, 1)),
        (LEFT + PLOT_W, LOSS_TOP + PANEL_H),
    ]
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert {"Step", "Loss", "0", "500", "1000", "1", "2.5", "4"} <= set(labels)
    times = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "time"]
    gpu = parse(chart_svg(SERIES, T0, at(60), "GPUs of job 7"))
    assert times == [t.text for t in gpu.iter(f"{SVG}text") if t.get("class") == "time"]
    assert root.findtext(f"{SVG}title") == "Progress of job 7 <&>"


def test_an_epoch_counter_saws_with_a_line_at_each_epoch_and_a_nan_loss_is_a_gap() -> None:
    points = [
        step(0, 0, 3.0, epoch=0),
        step(10, 90, 2.0, epoch=0),
        step(20, 10, None, epoch=1),  # the loss went NaN here
        step(30, 90, 1.5, epoch=1),
        step(40, 5, 1.0, epoch=2),
    ]
    root = parse(progress_svg(points, T0, at(40), "t"))
    epochs = [line.findtext(f"{SVG}title") for line in root.iter(f"{SVG}line")]
    assert [e for e in epochs if e] == ["epoch 1 begins", "epoch 2 begins"]
    steps = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "series steps"]
    assert len(steps) == 1 and len(coords(steps[0])) == 5
    losses = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "series loss"]
    assert [len(coords(p)) for p in losses] == [2, 2]


def test_a_job_that_numbers_no_step_has_its_loss_drawn_and_says_so_of_steps() -> None:
    root = parse(progress_svg([step(0, None, 2.0), step(5, None, 1.0)], T0, at(5), "t"))
    missing = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "no-samples"]
    assert missing == ["No step numbers reported in this window"]
    losses = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "series loss"]
    assert len(coords(losses[0])) == 2
