"""GPU-hours per project, user and week, from allocation intervals: a pure core for the
usage API, its CSV export and the usage page.

Each allocation is one GPU from ``opened`` until ``closed`` (or now, while it is open); its
hours are split at week boundaries (ISO weeks: Monday 00:00 UTC) and clipped to the window
asked for, so a session running across midnight on Sunday counts in both weeks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

WEEK = timedelta(days=7)


@dataclass(frozen=True)
class Span:
    project: str
    username: str
    opened: datetime
    closed: datetime | None  # None: still open


@dataclass(frozen=True)
class WeekUsage:
    project: str
    username: str
    week: date  # the Monday it starts on
    gpu_hours: float


def week_start(moment: datetime) -> datetime:
    """Monday 00:00 UTC of the ISO week holding ``moment``."""
    day = moment.astimezone(UTC).date()
    return datetime.combine(day - timedelta(days=day.weekday()), time(), UTC)


def usage_by_week(spans: Iterable[Span], since: datetime, until: datetime) -> list[WeekUsage]:
    """GPU-hours per (project, user, week) within ``[since, until)``, sorted by project,
    week, then user; a pair with no hours in a week is left out."""
    hours: dict[tuple[str, str, date], float] = defaultdict(float)
    for span in spans:
        start = max(span.opened, since)
        end = min(span.closed or until, until)
        week = week_start(start)
        while start < end:
            boundary = min(end, week + WEEK)
            hours[(span.project, span.username, week.date())] += (
                boundary - start
            ).total_seconds() / 3600
            start, week = boundary, week + WEEK
    return [
        WeekUsage(project, user, week, round(value, 4))
        for (project, user, week), value in sorted(
            hours.items(), key=lambda i: (i[0][0], i[0][2], i[0][1])
        )
        if value > 0
    ]


def to_csv_rows(usage: Iterable[WeekUsage]) -> list[list[str]]:
    """The CSV export: a header, then one row per project, week and user."""
    rows = [["project", "week", "username", "gpu_hours"]]
    rows += [[u.project, u.week.isoformat(), u.username, f"{u.gpu_hours:.4f}"] for u in usage]
    return rows
