"""Charts drawn as SVG on the server (no JavaScript): each GPU's utilisation and memory
over time, from the history the controller keeps of the node agents' samples
(``gpu_history``; docs/monitoring.md says what it keeps), and a job's steps and loss, from
the thinned history its progress keeps (state/progress.py, ``history``).

:func:`chart_svg` and :func:`progress_svg` are pure: series in, an SVG string out, every
text escaped. Their time labels never overlap, whatever the window: how many there are
and how they read (seconds, minutes, days) follow from the window and the width the
labels take (:func:`time_ticks`). The rest reads what a chart needs: the GPUs a
workload's allocations held, and their points while they held them. The job page draws
:func:`job_charts` (its progress and its GPUs over one window); the sessions page
:func:`session_charts`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Protocol, TypeVar

from markupsafe import Markup
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..state.inventory import GpuPoint, InventoryStore
from ..state.models import Allocation, Gpu, JobProgress, Node
from ..state.progress import ProgressPoint, history_points

# The usage page's colours, in the same order (hub/pages.py).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6")
WIDTH, LEFT, RIGHT = 640, 64, 16
PLOT_W = WIDTH - LEFT - RIGHT
PANEL_H = 100
UTIL_TOP, MEM_TOP = 24, 158  # each panel's plot area: top to top + PANEL_H
AXIS_Y = MEM_TOP + PANEL_H + 16  # the time labels
LEGEND_Y, LEGEND_LINE = AXIS_Y + 22, 18
GIB = 2**30
SESSION_WINDOW = timedelta(hours=24)
# Round times a time label may stand at, in seconds: from one second to four weeks.
TICK_STEPS_S: tuple[int, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
TICK_STEPS_S += (7200, 10800, 21600, 43200, 86400, 2 * 86400, 7 * 86400, 14 * 86400, 28 * 86400)
# The labels' font is 11 px. A time label's characters (digits, ':', ' ', 'UTC', a month)
# average under 0.62 em even in the widest sans-serif fonts (DejaVu Sans sets "09:00 UTC"
# in 57 px, this reckons 61), and ``LABEL_GAP`` leaves room besides.
FONT_PX = 11
CHAR_PX = 0.62 * FONT_PX
LABEL_GAP = 12  # the least room between two time labels
# The progress chart's panels lie where the GPU chart's do, so the two read as one.
STEP_TOP, LOSS_TOP = UTIL_TOP, MEM_TOP
PROGRESS_H = AXIS_Y + 8


@dataclass(frozen=True)
class GpuSeries:
    """One GPU's points, with the name the legend gives it."""

    uuid: str
    label: str
    points: Sequence[GpuPoint]


def gpu_label(node: str, index: int, uuid: str) -> str:
    """``gpu-node-a GPU 0 (GPU-3f2a9b1c…)``: where it is, and enough of its UUID."""
    short = uuid if len(uuid) <= 13 else uuid[:12] + "…"
    return f"{node} GPU {index} ({short})"


def chart_svg(series: Sequence[GpuSeries], since: datetime, until: datetime, title: str) -> Markup:
    """Two panels over ``[since, until]``: utilisation (0–100 %) and memory used (GiB, up
    to the largest GPU's total), one line per GPU in each, times as ``HH:MM UTC`` and a
    legend naming each GPU. Points outside the window are left out; a line has at most
    one point per pixel column (the mean of the points that fall in it).

    Every text in it is escaped here, so it is ``Markup``: a Jinja2 template with
    autoescape inserts it as it is, a Tornado one with ``{% raw %}``."""
    if until <= since:
        until = since + timedelta(minutes=1)
    span = (until - since).total_seconds()

    def x_of(at: datetime) -> float:
        return LEFT + (at - since).total_seconds() / span * PLOT_W

    inside = [[p for p in s.points if since <= p.at <= until] for s in series]
    memory_max = max(
        [
            float(p.memory_total_bytes or p.memory_used_bytes or 0) / GIB
            for points in inside
            for p in points
        ]
        + [1.0]
    )
    parts = [
        *_svg_open("gpu-chart", _height(len(series)), title, since, until),
        f'<text x="{LEFT}" y="{UTIL_TOP - 8}" font-weight="bold">GPU utilisation (%)</text>',
        f'<text x="{LEFT}" y="{MEM_TOP - 8}" font-weight="bold">Memory used (GiB)</text>',
    ]
    parts += _y_axis(UTIL_TOP, 0.0, 100.0, lambda v: f"{v:.0f} %")
    parts += _y_axis(MEM_TOP, 0.0, memory_max, _gib)
    parts += _time_axis(since, until)
    if not any(inside):
        for top in (UTIL_TOP, MEM_TOP):
            parts.append(
                f'<text class="no-samples" x="{LEFT + PLOT_W / 2}" y="{top + PANEL_H / 2}" '
                'text-anchor="middle">No samples in this window yet</text>'
            )
    parts.append("</g>")
    for i, (one, points) in enumerate(zip(series, inside, strict=True)):
        color = PALETTE[i % len(PALETTE)]
        label = escape(one.label)
        lines = (
            ("utilization", UTIL_TOP, 100.0, lambda p: p.utilization_pct, "utilisation"),
            ("memory", MEM_TOP, memory_max, _used_gib, "memory used"),
        )
        for kind, top, full, value, what in lines:
            xy = _columns(points, x_of, value)
            coords = " ".join(
                f"{x:.1f},{top + PANEL_H - min(v / full, 1.0) * PANEL_H:.1f}" for x, v in xy
            )
            parts.append(
                f'<polyline class="series {kind}" data-gpu="{escape(one.uuid)}" fill="none" '
                f'stroke="{color}" stroke-width="1.5" points="{coords}">'
                f"<title>{label}: {what}</title></polyline>"
            )
        y = LEGEND_Y + i * LEGEND_LINE
        parts.append(
            f'<g class="legend" data-gpu="{escape(one.uuid)}">'
            f'<rect x="{LEFT}" y="{y - 9}" width="10" height="10" fill="{color}"></rect>'
            f'<text x="{LEFT + 16}" y="{y}" font-family="system-ui, sans-serif" '
            f'font-size="12">{label}</text></g>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def progress_svg(
    points: Sequence[ProgressPoint], since: datetime, until: datetime, title: str
) -> Markup:
    """Two panels over ``[since, until]``, laid out as :func:`chart_svg`'s: the step
    number each report gave (a new attempt resuming from an older checkpoint drops back; a
    counter that restarts every epoch saws, with a faint line where each epoch begins),
    and the loss (the ``loss`` metric; a NaN is a gap). Points outside the window are left
    out. Every text in it is escaped here, so it is ``Markup``."""
    if until <= since:
        until = since + timedelta(minutes=1)
    span = (until - since).total_seconds()

    def x_of(at: datetime) -> float:
        return LEFT + (at - since).total_seconds() / span * PLOT_W

    inside = [p for p in points if since <= p.at <= until]
    steps = [float(p.step) for p in inside if p.step is not None]
    losses = [p.loss for p in inside if p.loss is not None]
    step_high = max([*steps, 1.0])
    loss_low, loss_high = (min(losses), max(losses)) if losses else (0.0, 1.0)
    if loss_high - loss_low < 1e-12:
        loss_low, loss_high = loss_low - 0.5, loss_high + 0.5
    parts = [
        *_svg_open("progress-chart", PROGRESS_H, title, since, until),
        f'<text x="{LEFT}" y="{STEP_TOP - 8}" font-weight="bold">Step</text>',
        f'<text x="{LEFT}" y="{LOSS_TOP - 8}" font-weight="bold">Loss</text>',
    ]
    parts += _y_axis(STEP_TOP, 0.0, step_high, _count)
    parts += _y_axis(LOSS_TOP, loss_low, loss_high, lambda v: f"{v:.3g}")
    parts += _time_axis(since, until)
    for top, drawn, what in ((STEP_TOP, steps, "step numbers"), (LOSS_TOP, losses, "loss")):
        if not drawn:
            parts.append(
                f'<text class="no-samples" x="{LEFT + PLOT_W / 2}" y="{top + PANEL_H / 2}" '
                f'text-anchor="middle">No {what} reported in this window</text>'
            )
    parts.append("</g>")
    parts += _epoch_lines(inside, x_of)

    def y_of(top: int, low: float, high: float, value: float) -> float:
        return top + PANEL_H - min(max((value - low) / (high - low), 0.0), 1.0) * PANEL_H

    lines = (
        ("steps", STEP_TOP, 0.0, step_high, lambda p: None if p.step is None else float(p.step)),
        ("loss", LOSS_TOP, loss_low, loss_high, lambda p: p.loss),
    )
    for kind, top, low, high, value in lines:
        for run in _runs(inside, value):
            coords = " ".join(f"{x_of(at):.1f},{y_of(top, low, high, v):.1f}" for at, v in run)
            parts.append(
                f'<polyline class="series {kind}" fill="none" stroke="{PALETTE[0]}" '
                f'stroke-width="1.5" points="{coords}"><title>{kind}</title></polyline>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def _runs(
    points: Sequence[ProgressPoint], value: Callable[[ProgressPoint], float | None]
) -> list[list[tuple[datetime, float]]]:
    """The points with a value, as runs broken where a point has none (a NaN loss); always
    at least one run, perhaps empty, so that every panel has its line."""
    runs: list[list[tuple[datetime, float]]] = [[]]
    for point in points:
        reading = value(point)
        if reading is None:
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append((point.at, reading))
    return [r for r in runs if r] or [[]]


def _epoch_lines(points: Sequence[ProgressPoint], x_of: Callable[[datetime], float]) -> list[str]:
    """A faint line down the step panel where each epoch after the first begins."""
    lines = []
    numbered = [p for p in points if p.epoch is not None]
    for before, after in itertools.pairwise(numbered):
        if after.epoch != before.epoch:
            x = round(x_of(after.at), 1)
            lines.append(
                f'<line class="epoch" x1="{x}" x2="{x}" y1="{STEP_TOP}" '
                f'y2="{STEP_TOP + PANEL_H}" stroke="#bbb" stroke-dasharray="3 3">'
                f"<title>epoch {after.epoch} begins</title></line>"
            )
    return lines


def _count(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.3g}M"
    return f"{value / 1e3:.3g}k" if value >= 1e4 else f"{value:.0f}"


def _height(gpus: int) -> int:
    return LEGEND_Y + max(gpus, 1) * LEGEND_LINE - 4


def _gib(value: float) -> str:
    return f"{value:.0f} GiB" if value >= 10 or value == 0 else f"{value:.1f} GiB"


def _used_gib(point: GpuPoint) -> float | None:
    return None if point.memory_used_bytes is None else point.memory_used_bytes / GIB


def _svg_open(kind: str, height: int, title: str, since: datetime, until: datetime) -> list[str]:
    return [
        f'<svg class="{kind}" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
        f'height="{height}" role="img" aria-label="{escape(title)}, from '
        f'{since.astimezone(UTC):%Y-%m-%d %H:%M} to {until.astimezone(UTC):%Y-%m-%d %H:%M} UTC">',
        f"<title>{escape(title)}</title>",
        f'<g font-family="system-ui, sans-serif" font-size="{FONT_PX}" fill="#444">',
    ]


def _y_axis(top: int, low: float, high: float, text: Callable[[float], str]) -> list[str]:
    """Grid lines and labels at the bottom (``low``), half way and the top (``high``)."""
    parts = []
    for fraction in (0.0, 0.5, 1.0):
        y = top + PANEL_H - fraction * PANEL_H
        value = low + (high - low) * fraction
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y}" y2="{y}" stroke="#ddd"></line>'
            f'<text x="{LEFT - 6}" y="{y + 4}" text-anchor="end">{text(value)}</text>'
        )
    return parts


def _time_axis(since: datetime, until: datetime) -> list[str]:
    """A grid line down both panels and a label under them at each of ``time_ticks``."""
    span = (until - since).total_seconds()
    parts = []
    for tick, anchor, label in time_ticks(since, until):
        x = round(LEFT + (tick - since).total_seconds() / span * PLOT_W, 1)
        parts.append(
            f'<line class="time-tick" x1="{x}" x2="{x}" y1="{UTIL_TOP}" '
            f'y2="{MEM_TOP + PANEL_H}" stroke="#eee"></line>'
            f'<text class="time" x="{x}" y="{AXIS_Y}" text-anchor="{anchor}">'
            f"{escape(label)}</text>"
        )
    return parts


class _Timed(Protocol):
    @property
    def at(self) -> datetime: ...


P = TypeVar("P", bound=_Timed)


def _columns(
    points: Iterable[P],
    x_of: Callable[[datetime], float],
    value: Callable[[P], float | None],
) -> list[tuple[float, float]]:
    """(x, value) per pixel column that has a reading: the mean of its points' x and value."""
    columns: dict[int, list[tuple[float, float]]] = {}
    for point in points:
        reading = value(point)
        if reading is None:
            continue
        x = x_of(point.at)
        columns.setdefault(int(x), []).append((x, float(reading)))
    return [
        (sum(x for x, _ in column) / len(column), sum(v for _, v in column) / len(column))
        for _, column in sorted(columns.items())
    ]


def time_format(span: timedelta, step_s: int) -> str:
    """How a time label reads: to the second where labels stand seconds apart, with the
    day where the window is longer than a day; always in UTC."""
    if step_s < 60:
        return "%H:%M:%S UTC"
    return "%H:%M UTC" if span <= timedelta(days=1) else "%d %b %H:%M UTC"


def label_px(text: str) -> float:
    """The most width ``text`` takes as a time label."""
    return len(text) * CHAR_PX


def time_ticks(
    since: datetime, until: datetime, width: float = PLOT_W
) -> list[tuple[datetime, str, str]]:
    """The time labels of a chart ``width`` wide: both ends, and between them the round
    times of the finest step that leaves each label half its width again of room, less
    any that would come closer than ``LABEL_GAP`` to a neighbour (next to an end). Each
    with its text anchor and its text."""
    span = until - since
    seconds = span.total_seconds() or 1.0
    for step_s in TICK_STEPS_S:
        widest = label_px(since.astimezone(UTC).strftime(time_format(span, step_s)))
        if step_s / seconds * width >= 1.5 * (widest + LABEL_GAP):
            return _ticks_of(since, until, width, step_s)
    return _ticks_of(since, until, width, TICK_STEPS_S[-1])


def _ticks_of(
    since: datetime, until: datetime, width: float, step_s: int
) -> list[tuple[datetime, str, str]]:
    """Both ends, and the multiples of ``step_s`` between them whose labels keep
    ``LABEL_GAP`` from their neighbours'."""
    span = until - since
    seconds = span.total_seconds() or 1.0
    fmt = time_format(span, step_s)

    def label(moment: datetime) -> str:
        return moment.astimezone(UTC).strftime(fmt)

    ticks = [(since, "start", label(since))]
    right = label_px(ticks[0][2])  # where the last label kept ends
    last = (until, "end", label(until))
    end_left = width - label_px(last[2])
    step = timedelta(seconds=step_s)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    tick = epoch + ((since - epoch) // step + 1) * step
    while tick < until:
        text = label(tick)
        half = label_px(text) / 2
        x = (tick - since).total_seconds() / seconds * width
        if x - half >= right + LABEL_GAP and x + half <= end_left - LABEL_GAP:
            ticks.append((tick, "middle", text))
            right = x + half
        tick += step
    return [*ticks, last]


# ----------------------------------------------------------------- the reads
@dataclass(frozen=True)
class HeldGpu:
    """One allocation of a workload: which GPU, where, and while when."""

    uuid: str
    index: int
    node: str
    opened: datetime
    closed: datetime | None


def held_gpus(session: Session, workload_ids: Iterable[int]) -> dict[int, list[HeldGpu]]:
    """Every allocation of each workload (open or closed), by node and GPU index."""
    found: dict[int, list[HeldGpu]] = {}
    rows = session.execute(
        select(
            Allocation.workload_id,
            Allocation.gpu_uuid,
            Gpu.index,
            Node.name,
            Allocation.opened_at,
            Allocation.closed_at,
        )
        .join(Gpu, Allocation.gpu_uuid == Gpu.uuid)
        .join(Node, Allocation.node_id == Node.id)
        .where(Allocation.workload_id.in_(list(workload_ids)))
        .order_by(Node.name, Gpu.index, Allocation.opened_at)
    )
    for workload_id, uuid, index, node, opened, closed in rows:
        found.setdefault(workload_id, []).append(HeldGpu(uuid, index, node, opened, closed))
    return found


def workload_series(held: Sequence[HeldGpu], history: dict[str, list[GpuPoint]]) -> list[GpuSeries]:
    """One series per GPU the workload held, with only the points of its own allocations
    (another workload may have held the GPU in between)."""
    series = []
    for uuid in dict.fromkeys(h.uuid for h in held):
        mine = [h for h in held if h.uuid == uuid]
        points = [
            p
            for p in history.get(uuid, [])
            if any(h.opened <= p.at and (h.closed is None or p.at <= h.closed) for h in mine)
        ]
        series.append(GpuSeries(uuid, gpu_label(mine[0].node, mine[0].index, uuid), points))
    return series


def workload_charts(
    store: InventoryStore,
    workload_ids: Iterable[int],
    now: datetime,
    title: str,
    window: timedelta | None = None,
) -> dict[int, Markup]:
    """A chart per workload that held GPUs, over its allocations' lifetime (the last
    ``window`` of it, if given); ``title`` is formatted with ``id``."""
    with store.read() as session:
        held = held_gpus(session, workload_ids)
    spans = {}
    for workload_id, gpus in held.items():
        until = max(h.closed or now for h in gpus)
        since = min(h.opened for h in gpus)
        spans[workload_id] = (since if window is None else max(since, until - window), until)
    if not spans:
        return {}
    history = store.gpu_history(
        {h.uuid for gpus in held.values() for h in gpus},
        min(since for since, _ in spans.values()),
        max(until for _, until in spans.values()),
    )
    return {
        workload_id: chart_svg(
            workload_series(held[workload_id], history), since, until, title.format(id=workload_id)
        )
        for workload_id, (since, until) in spans.items()
    }


@dataclass(frozen=True)
class JobCharts:
    """The job page's charts, over one window so that they line up."""

    progress: Markup  # empty before its first report
    gpus: Markup  # empty while it has held no GPU


def job_charts(store: InventoryStore, job_id: int, now: datetime) -> JobCharts:
    """The job's progress and its GPUs over its whole life: from its first allocation or
    report to now while it holds GPUs, else to the last of either."""
    with store.read() as session:
        held = held_gpus(session, [job_id]).get(job_id, [])
        row = session.get(JobProgress, job_id)
        points = history_points(row) if row is not None else []
    moments = [
        *(h.opened for h in held),
        *(h.closed or now for h in held),
        *(p.at for p in points),
    ]
    if not moments:
        return JobCharts(Markup(), Markup())
    since, until = min(moments), max(moments)
    gpus = Markup()
    if held:
        history = store.gpu_history({h.uuid for h in held}, since, until)
        gpus = chart_svg(workload_series(held, history), since, until, f"GPUs of job {job_id}")
    progress = (
        progress_svg(points, since, until, f"Progress of job {job_id}") if points else Markup()
    )
    return JobCharts(progress, gpus)


def session_charts(
    store: InventoryStore, workload_ids: Iterable[int], now: datetime
) -> dict[int, Markup]:
    """The sessions page's charts: each session's GPUs over the last day it held them
    (a pending one, holding none, has no chart)."""
    return workload_charts(store, workload_ids, now, "GPUs of session {id}", SESSION_WINDOW)
