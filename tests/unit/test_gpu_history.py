"""Each GPU's history of utilisation and memory (``gpu_history``): the thinning rule from
literal times, then the store writing, thinning, bounding and reading it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine

from gpufleet.hub.gpu_charts import JobCharts, job_charts, session_charts
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import (
    HISTORY_MAX_POINTS,
    GpuPoint,
    HistoryTier,
    history_to_drop,
)
from gpufleet.state.models import GpuHistoryPoint

from .test_store import allocations, ask, cycle, make_store, t

NOW = datetime(2026, 1, 12, 12, 0, tzinfo=UTC)  # on a 10-minute boundary


def ago(**delta: float) -> datetime:
    return NOW - timedelta(**delta)


# ------------------------------------------------------------------ the rule
def test_every_point_of_the_last_hour_is_kept() -> None:
    times = [ago(minutes=59, seconds=59), ago(minutes=30, seconds=5), ago(minutes=30), ago()]
    assert history_to_drop(times, NOW) == []


def test_older_than_an_hour_one_point_a_minute_the_earliest_of_each_minute() -> None:
    times = [
        ago(hours=2, seconds=0),  # 10:00:00 — first of its minute
        ago(hours=2, seconds=-20),  # 10:00:20
        ago(hours=2, seconds=-40),  # 10:00:40
        ago(hours=2, seconds=-60),  # 10:01:00 — next minute
        ago(minutes=61),  # 10:59:00
        ago(minutes=60, seconds=30),  # 10:59:30: same minute, still older than an hour
        ago(minutes=59, seconds=50),  # 11:00:10: younger than an hour, kept
    ]
    assert history_to_drop(times, NOW) == [1, 2, 5]


def test_older_than_a_day_one_point_per_ten_minutes_and_nothing_after_a_week() -> None:
    times = [
        ago(days=7, seconds=1),  # older than a week
        ago(days=7),  # exactly a week: gone too
        ago(days=2),  # 10 Jan 12:00
        ago(days=2, minutes=-3),  # 12:03, same 10 minutes
        ago(days=2, minutes=-10),  # 12:10
        ago(hours=24, minutes=1),  # 11 Jan 11:59 (the 11:50 bucket)
        ago(hours=23, minutes=59, seconds=30),  # 11 Jan 12:00:30: within a day
    ]
    assert history_to_drop(times, NOW) == [0, 1, 3]


def test_the_point_kept_for_a_minute_is_the_one_kept_for_its_ten_minutes() -> None:
    # 20-second samples over 10:00-10:20; an hour and a half later, then a day later.
    times = [
        datetime(2026, 1, 12, 10, 0, tzinfo=UTC) + timedelta(seconds=20 * i) for i in range(60)
    ]
    soon = datetime(2026, 1, 12, 11, 30, tzinfo=UTC)
    kept = [t for i, t in enumerate(times) if i not in history_to_drop(times, soon)]
    assert kept == [times[0] + timedelta(minutes=m) for m in range(20)]
    later = soon + timedelta(days=1)
    kept_later = [t for i, t in enumerate(kept) if i not in history_to_drop(kept, later)]
    assert kept_later == [times[0], times[0] + timedelta(minutes=10)]
    # Thinning all at once gives the same points; thinning again drops nothing.
    assert [t for i, t in enumerate(times) if i not in history_to_drop(times, later)] == kept_later
    assert history_to_drop(kept_later, later) == []


def test_tiers_are_a_parameter() -> None:
    tiers = [HistoryTier(timedelta(seconds=10), None), HistoryTier(timedelta(minutes=1), None)]
    assert history_to_drop([ago(seconds=61), ago(seconds=30), ago()], NOW, tiers) == [0]


# ----------------------------------------------------------------- the store
UUID = "GPU-a1-0"


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def sample(utilization: int, used: int = 2**30, **extra: object) -> dict[str, object]:
    return {
        "uuid": UUID,
        "index": 0,
        "at": 0.0,
        "utilization_gpu_pct": utilization,
        "memory_used_bytes": used,
        "memory_total_bytes": 80 * 2**30,
        **extra,
    }


def history_times(store: FleetStore) -> list[datetime]:
    return [
        p.at for p in store.nodes.gpu_history([UUID], ago(days=30), NOW + timedelta(days=30))[UUID]
    ]


def test_samples_become_history_read_back_within_a_window(store: FleetStore) -> None:
    store.nodes.record_samples(ago(seconds=20), "agent-1", [sample(10)])
    store.nodes.record_samples(ago(seconds=10), "agent-1", [sample(90, used=3 * 2**30)])
    store.nodes.record_samples(NOW, "agent-1", [sample(0, lost=True)])  # lost: no reading
    history = store.nodes.gpu_history([UUID, "GPU-a1-1"], ago(seconds=15), NOW)
    assert history == {
        UUID: [GpuPoint(ago(seconds=10), 90, 3 * 2**30, 80 * 2**30)],
        "GPU-a1-1": [],
    }
    assert store.nodes.gpu_history([], ago(days=1), NOW) == {}


def test_the_store_thins_a_gpus_history_once_a_minute_as_it_ages(store: FleetStore) -> None:
    start = ago(minutes=90)
    for i in range(90 * 3):  # every 20 s for an hour and a half
        store.nodes.record_samples(start + timedelta(seconds=20 * i), "agent-1", [sample(i % 100)])
    times = history_times(store)
    # The half hour older than an hour: one point a minute; the last hour: every sample
    # (thinned at the first sample of the current minute).
    # The last pass ran at 11:59:00 (the last sample is at 11:59:40).
    old = [t for t in times if t <= ago(minutes=61)]
    assert old == [start + timedelta(minutes=m) for m in range(30)]
    assert len(times) - len(old) == 182  # 10:59:20 to 11:59:40


def test_after_a_silence_a_day_old_history_is_thinned_to_ten_minutes(store: FleetStore) -> None:
    start = ago(days=1, minutes=40)
    for i in range(15):  # every 2 minutes for half an hour
        store.nodes.record_samples(start + timedelta(minutes=2 * i), "agent-1", [sample(50)])
    store.nodes.record_samples(NOW, "agent-1", [sample(50)])
    assert history_times(store) == [start + timedelta(minutes=m) for m in (0, 10, 20)] + [NOW]
    store.nodes.record_samples(NOW + timedelta(days=7), "agent-1", [sample(50)])
    assert history_times(store) == [NOW + timedelta(days=7)]


def test_a_gpus_history_never_holds_more_than_the_bound(store: FleetStore) -> None:
    # Seeded directly: an agent sampling far faster than the default would take hours.
    with store.read() as session:
        session.add_all(
            GpuHistoryPoint(gpu_uuid=UUID, at=ago(minutes=50, seconds=-i / 10), utilization_pct=1)
            for i in range(HISTORY_MAX_POINTS + 5)
        )
        session.commit()
    store.nodes.record_samples(NOW, "agent-1", [sample(50)])
    times = history_times(store)
    assert len(times) == HISTORY_MAX_POINTS and times[-1] == NOW
    assert times[0] == ago(minutes=50, seconds=-0.6)  # the six oldest went


def test_a_sessions_chart_draws_its_gpus_while_it_held_them(store: FleetStore) -> None:
    wid = ask(store, t(1), "alice", gpus=2)
    waiting = ask(store, t(1), "alice", server="more")  # vision's 2 are taken, no borrowing
    cycle(store, t(2))
    held = sorted(u for w, u, _ in allocations(store) if w == wid)
    readings = [
        {"uuid": u, "index": int(u[-1]), "at": 0.0, "utilization_gpu_pct": 30} for u in held
    ]
    for second in (1, 5, 10, 15):  # the first before the allocations opened
        store.nodes.record_samples(t(second), "agent-1", readings)
    charts = session_charts(store.nodes, [wid, waiting], t(20))
    assert list(charts) == [wid]  # a pending session holds no GPU: no chart
    for uuid in held:
        line = charts[wid].split(f'class="series utilization" data-gpu="{uuid}"')[1]
        assert len(line.split('points="')[1].split('"')[0].split()) == 3
    assert f"GPUs of session {wid}" in charts[wid]
    assert all(f"GPU {u[-1]} ({u})</text>" in charts[wid] for u in held)
    assert job_charts(store.nodes, waiting, t(20)) == JobCharts("", "")
