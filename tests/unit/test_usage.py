"""GPU-hours per project, user and week (``hub/usage.py``), from literal intervals."""

from __future__ import annotations

from datetime import UTC, date, datetime

from gpufleet.hub.usage import Span, WeekUsage, to_csv_rows, usage_by_week, week_start


def at(day: int, hour: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, tzinfo=UTC)  # 2026-11-30 is a Monday


SINCE, UNTIL = at(2), at(30, 12)  # Monday 2 Nov to Monday 30 Nov, noon


def test_a_week_starts_on_monday_at_midnight_utc() -> None:
    assert week_start(at(29, 23)) == at(23) and week_start(at(30, 1)) == at(30)


def test_hours_across_a_week_boundary_count_in_both_weeks() -> None:
    spans = [Span("vision", "alice", at(29, 20), at(30, 2))]  # Sunday 20:00 to Monday 02:00
    assert usage_by_week(spans, SINCE, UNTIL) == [
        WeekUsage("vision", "alice", date(2026, 11, 23), 4.0),
        WeekUsage("vision", "alice", date(2026, 11, 30), 2.0),
    ]


def test_each_gpu_counts_and_open_allocations_run_until_now_within_the_window() -> None:
    spans = [
        Span("vision", "bob", at(30, 9), None),  # two GPUs, still open at noon
        Span("vision", "bob", at(30, 9), None),
        Span("nlp", "carol", at(1), at(3)),  # began before the window: clipped to 2 Nov
        Span("nlp", "carol", at(30, 12), None),  # opened at the window's end: nothing
    ]
    assert usage_by_week(spans, SINCE, UNTIL) == [
        WeekUsage("nlp", "carol", date(2026, 11, 2), 24.0),
        WeekUsage("vision", "bob", date(2026, 11, 30), 6.0),
    ]


def test_the_csv_has_a_header_and_a_row_per_project_week_and_user() -> None:
    rows = to_csv_rows([WeekUsage("vision", "alice", date(2026, 11, 23), 4.0)])
    assert rows == [
        ["project", "week", "username", "gpu_hours"],
        ["vision", "2026-11-23", "alice", "4.0000"],
    ]
