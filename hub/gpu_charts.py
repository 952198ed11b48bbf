"""Each GPU's utilisation and memory over time, drawn as SVG on the server (no JavaScript),
from the history the controller keeps of the node agents' samples (``gpu_history``;
docs/monitoring.md says what it keeps).

:func:`chart_svg` is pure: series in, an SVG string out, every text escaped. The rest reads
what it needs for a workload's chart: the GPUs its allocations held, and their points
while they held them. The job page draws :func:`job_chart`; the sessions page
:func:`session_charts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape

from markupsafe import Markup
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..scheduler.store.inventory import GpuPoint, InventoryStore
from ..scheduler.store.models import Allocation, Gpu, Node

# The usage page's colours, in the same order (hub/pages.py).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6")
WIDTH, LEFT, RIGHT = 640, 64, 16
PLOT_W = WIDTH - LEFT - RIGHT
PANEL_H = 100
UTIL_TOP, MEM_TOP = 24, 158  # each panel's plot area: top to top + PANEL_H
AXIS_Y = MEM_TOP + PANEL_H + 16  # the time labels
LEGEND_Y, LEGEND_LINE = AXIS_Y + 22, 18
GIB = 2**30
TICK_STEPS_MIN = (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440)
SESSION_WINDOW = timedelta(hours=24)


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


def hhmm(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M UTC")


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
        f'<svg class="gpu-chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {_height(len(series))}" width="{WIDTH}" '
        f'height="{_height(len(series))}" role="img" aria-label="{escape(title)}, from '
        f'{since.astimezone(UTC):%Y-%m-%d %H:%M} to {until.astimezone(UTC):%Y-%m-%d %H:%M} UTC">',
        f"<title>{escape(title)}</title>",
        '<g font-family="system-ui, sans-serif" font-size="11" fill="#444">',
        f'<text x="{LEFT}" y="{UTIL_TOP - 8}" font-weight="bold">GPU utilisation (%)</text>',
        f'<text x="{LEFT}" y="{MEM_TOP - 8}" font-weight="bold">Memory used (GiB)</text>',
    ]
    parts += _y_axis(UTIL_TOP, 100.0, lambda v: f"{v:.0f} %")
    parts += _y_axis(MEM_TOP, memory_max, _gib)
    for tick, anchor in _time_ticks(since, until):
        x = round(x_of(tick), 1)
        parts.append(
            f'<line class="time-tick" x1="{x}" x2="{x}" y1="{UTIL_TOP}" '
            f'y2="{MEM_TOP + PANEL_H}" stroke="#eee"></line>'
            f'<text class="time" x="{x}" y="{AXIS_Y}" text-anchor="{anchor}">'
            f"{hhmm(tick)}</text>"
        )
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


def _height(gpus: int) -> int:
    return LEGEND_Y + max(gpus, 1) * LEGEND_LINE - 4


def _gib(value: float) -> str:
    return f"{value:.0f} GiB" if value >= 10 or value == 0 else f"{value:.1f} GiB"


def _used_gib(point: GpuPoint) -> float | None:
    return None if point.memory_used_bytes is None else point.memory_used_bytes / GIB


def _y_axis(top: int, full: float, text: Callable[[float], str]) -> list[str]:
    """Grid lines and labels at 0, half and full."""
    parts = []
    for fraction in (0.0, 0.5, 1.0):
        y = top + PANEL_H - fraction * PANEL_H
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y}" y2="{y}" stroke="#ddd"></line>'
            f'<text x="{LEFT - 6}" y="{y + 4}" text-anchor="end">{text(full * fraction)}</text>'
        )
    return parts


def _columns(
    points: Iterable[GpuPoint],
    x_of: Callable[[datetime], float],
    value: Callable[[GpuPoint], float | None],
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


def _time_ticks(since: datetime, until: datetime) -> list[tuple[datetime, str]]:
    """Both ends, and the round times between them (at most five intervals) that are
    not too close to an end to be read; with each label's text anchor."""
    span = until - since
    step = next(
        (timedelta(minutes=m) for m in TICK_STEPS_MIN if span / timedelta(minutes=m) <= 5),
        timedelta(days=1),
    )
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    tick = epoch + ((since - epoch) // step + 1) * step
    ticks = [(since, "start")]
    while tick < until:
        if min(tick - since, until - tick) >= span * 0.12:
            ticks.append((tick, "middle"))
        tick += step
    return [*ticks, (until, "end")]


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


def job_chart(store: InventoryStore, job_id: int, now: datetime) -> Markup:
    """The job's GPUs over its whole life; empty while it has held none."""
    return workload_charts(store, [job_id], now, "GPUs of job {id}").get(job_id, Markup())


def session_charts(
    store: InventoryStore, workload_ids: Iterable[int], now: datetime
) -> dict[int, Markup]:
    """The sessions page's charts: each session's GPUs over the last day it held them
    (a pending one, holding none, has no chart)."""
    return workload_charts(store, workload_ids, now, "GPUs of session {id}", SESSION_WINDOW)
