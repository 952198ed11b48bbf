"""Timed work through APScheduler: what an admin schedules for later, such as a node's
maintenance drain (``gpufleet drain NODE --at 02:00``), and what recurs on a schedule the
admin sets, such as snapshot retention and garbage collection.

Jobs are kept in the database (``apscheduler_jobs``, made by a migration), so a controller
restart or a takeover by another controller loses none. The scheduler runs only on the
controller that holds the database lease, and each job only starts a fenced action through
that controller: a controller that lost the lease mid-way commits nothing. A run missed
while no controller held the lease runs once when one does (within ``MISFIRE_GRACE_S``).
The scheduling cycle, the culler and the reconciler stay on their own loops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger
from sqlalchemy import Engine
from traitlets import Float, Integer, Unicode
from traitlets.config import Configurable

from .components import LoopComponent


class TimedController(Protocol):
    """What a timed job asks of the controller (``hub/context.py``'s, in part)."""

    is_leader: bool

    async def drain(self, node: str, by: str, why: str) -> None: ...

    async def run_snapshot_retention(self) -> None: ...


MISFIRE_GRACE_S = 6 * 3600
log = logging.getLogger("gpufleet.timed")
# The controller whose timed jobs run here: APScheduler keeps a job as a reference to a
# module-level function and its arguments, never as an object.
_controller: TimedController | None = None


async def drain_node(node: str, by: str, why: str) -> None:
    """A scheduled drain, as ``POST /nodes/<node>/drain`` would do it now."""
    controller = _controller
    if controller is None or not controller.is_leader:
        log.warning("a scheduled drain of %s found no controller holding the lease", node)
        return
    try:
        await controller.drain(node, by, why)
    except Exception:
        log.exception("the scheduled drain of %s failed", node)


async def snapshot_retention() -> None:
    """The scheduled snapshot retention and garbage collection."""
    controller = _controller
    if controller is None or not controller.is_leader:
        log.warning("scheduled snapshot retention found no controller holding the lease")
        return
    try:
        await controller.run_snapshot_retention()
    except Exception:
        log.exception("scheduled snapshot retention failed")


RETENTION_JOB = "snapshot-retention"


def retention_trigger(schedule: str) -> CronTrigger | None:
    """The retention schedule, or None when off; ValueError says what is wrong with it."""
    if not schedule.strip():
        return None
    try:
        return CronTrigger.from_crontab(schedule, timezone=UTC)
    except ValueError as e:
        raise ValueError(
            f"c.TimedWork.snapshot_retention_schedule {schedule!r} is not a crontab line "
            f"(minute hour day month weekday, e.g. '0 3 * * *'): {e}"
        ) from None


@dataclass(frozen=True)
class TimedJob:
    id: str
    what: str
    at: datetime | None  # its next run


class TimedWork(LoopComponent):
    snapshot_retention_schedule = Unicode(
        "",
        help="When to apply snapshot retention and collect unused snapshot data, as a "
        "crontab line in UTC (e.g. '0 3 * * *', every day at 03:00); empty: never (run "
        "`gpufleet snapshot gc` by hand). Each user's server keeps its snapshot_keep_last "
        "latest snapshots and one a day for snapshot_keep_daily days; its latest is always "
        "kept.",
    ).tag(config=True)

    snapshot_keep_last = Integer(3, min=1, help="Snapshots of each server always kept.").tag(
        config=True
    )

    snapshot_keep_daily = Integer(
        7, min=0, help="Days for which each server keeps its last snapshot of the day."
    ).tag(config=True)

    snapshot_gc_margin_seconds = Float(
        3600.0,
        min=0,
        help="Unused snapshot data younger than this is left for the next collection (a "
        "snapshot being written may still need it).",
    ).tag(config=True)

    def __init__(
        self,
        controller: TimedController,
        engine: Engine,
        parent: Configurable | None = None,
        **kwargs: Any,
    ):
        """ValueError when the retention schedule is not a crontab line."""
        super().__init__(parent=parent, **kwargs)
        self.retention = retention_trigger(self.snapshot_retention_schedule)
        self.scheduler = AsyncIOScheduler(
            jobstores={"default": SQLAlchemyJobStore(engine=engine)},
            timezone=UTC,
            job_defaults={"misfire_grace_time": MISFIRE_GRACE_S, "coalesce": True},
        )
        self.controller = controller

    def lead(self) -> None:
        """This controller now holds the lease: run the timed jobs here."""
        global _controller
        _controller = self.controller
        if not self.scheduler.running:
            self.scheduler.start()
        else:
            self.scheduler.resume()
        # The schedule is the configuration's: replaced at every takeover, gone when unset.
        if self.retention is not None:
            self.scheduler.add_job(
                snapshot_retention,
                self.retention,
                id=RETENTION_JOB,
                name="snapshot retention and garbage collection",
                replace_existing=True,
            )
        elif self.scheduler.get_job(RETENTION_JOB) is not None:
            self.scheduler.remove_job(RETENTION_JOB)

    def follow(self) -> None:
        """Another controller holds the lease: run nothing here."""
        if self.scheduler.running:
            self.scheduler.pause()

    def schedule_drain(self, node: str, by: str, why: str, at: datetime) -> TimedJob:
        job = self.scheduler.add_job(
            drain_node,
            "date",
            run_date=at,
            args=(node, by, why),
            name=f"drain {node} ({why or 'no reason given'}), asked by {by}",
        )
        return TimedJob(job.id, job.name, at)

    def jobs(self) -> list[TimedJob]:
        return [
            TimedJob(job.id, job.name, getattr(job, "next_run_time", None))
            for job in self.scheduler.get_jobs()
        ]

    def cancel(self, job_id: str) -> bool:
        if self.scheduler.get_job(job_id) is None:
            return False
        self.scheduler.remove_job(job_id)
        return True


# The last second Python's datetime holds in UTC, which APScheduler converts every run
# time to: a later one ("9999-12-31T23:59:59-14:00") cannot be kept.
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


def when(text: str, now: datetime) -> datetime:
    """``HH:MM`` (the next such time, UTC) or an ISO date and time (UTC unless it says),
    in UTC; ValueError says what to write instead."""
    now = now if now.tzinfo else now.replace(tzinfo=UTC)
    try:
        hours, minutes = (int(part) for part in text.split(":"))
    except ValueError:
        pass
    else:
        if not (0 <= hours < 24 and 0 <= minutes < 60):
            raise ValueError(f"{text!r} is not a time of day (HH:MM, 00:00-23:59)")
        at = now.replace(hour=hours, minute=minutes, second=0, microsecond=0)
        return at if at > now else at + timedelta(days=1)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither HH:MM nor an ISO date and time (2026-12-04T02:00)"
        ) from None
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    latest = f"{text} is later than {LATEST:%Y-%m-%dT%H:%M:%S}Z, the latest time a drain takes"
    try:
        at = at.astimezone(UTC)
    except OverflowError:
        # Only the first day of year 1 (ahead of UTC) and the last of 9999 (behind it)
        # fall outside what datetime holds once in UTC.
        passed = f"{text} has passed; give a time to come"
        raise ValueError(latest if at.year == 9999 else passed) from None
    if at > LATEST:
        raise ValueError(latest)
    if at <= now:
        raise ValueError(f"{text} has passed; give a time to come")
    return at
