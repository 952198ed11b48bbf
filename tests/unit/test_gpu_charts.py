"""The GPU charts (``hub/gpu_charts.py``) from literal series: their structure, where the
points land in the view box, the labels, and which points a workload's chart shows."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

from gpufleet.hub.gpu_charts import (
    LEFT,
    MEM_TOP,
    PANEL_H,
    PLOT_W,
    UTIL_TOP,
    GpuSeries,
    HeldGpu,
    chart_svg,
    gpu_label,
    workload_series,
)
from gpufleet.scheduler.store.inventory import GpuPoint

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
