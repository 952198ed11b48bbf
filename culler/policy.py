"""The idle policy, as a pure function: ``decide(session, signals, policy, now) -> Decision``.

A session is *active* while anything says a person or a program uses it: a kernel
executing or having executed, a terminal, what its user did in JupyterLab (typing,
clicking, a file saved), or its GPUs doing work; a kernel the session extension reports
busy is active now, whatever the browser does. A user may also keep it alive until a time
within what the project allows.

JupyterHub's own activity (browser, API) counts only for a session whose extension never
reported: the hub's ``last_activity`` moves with every request through the proxy, and an
open JupyterLab's own polling of kernels, sessions, contents and notices is not use.

Once it has been idle for ``idle_timeout_s`` the policy acts, after a warning
``warn_before_s`` ahead:

- ``always``: the session is culled (snapshotted, stopped, its GPUs released);
- ``on-demand``: it is only *marked* idle; the scheduler reclaims it first when a waiting
  workload needs GPUs (and never while nobody waits). Activity clears the mark.

``max_age_s`` stops a session that old whatever its activity, with the same warning.

A warning's time is kept: the action comes at the time it announced (the culler looks
again then), unless the session is used in a way that makes it due later, which withdraws
the warning or replaces it with one that gives the new time.

Nothing here reads a clock, a database or the network: the culler loop gathers the inputs
and carries out the decision.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from typing import Any

from .errors import PolicyError

# The longest a session's JupyterLab waits between two looks at its notices.
NOTICE_POLL_MAX_S = 10.0
# A warning at least this long announces a whole minute, which "at 14:02 UTC" then says
# exactly; a shorter one announces its time to the second.
WHOLE_MINUTES_FROM_S = 60.0
# What the session extension reports its user did (``Signals.user_action``), in words.
USER_ACTIONS = {
    "input": "typing, clicks or scrolling in JupyterLab",
    "file": "a file saved or changed in JupyterLab",
}


class ReclaimMode(enum.StrEnum):
    ALWAYS = "always"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True)
class IdlePolicy:
    """What a project (or one of its profiles) allows; every time is in seconds."""

    mode: ReclaimMode = ReclaimMode.ON_DEMAND
    idle_timeout_s: float = 3600.0
    warn_before_s: float = 600.0
    max_age_s: float | None = None
    # How far ahead of now a user may keep a session alive.
    keep_alive_max_s: float = 8 * 3600.0
    # In on-demand mode: whether an idle session may be reclaimed by anyone's workload
    # (it comes back whole from its snapshot). False: it is left alone.
    reclaim_by_anyone: bool = True
    # Stop even when the live snapshot fails (the admin accepts losing what is unsaved).
    stop_without_snapshot: bool = False

    @property
    def notice_poll_s(self) -> float:
        """How often a browser should look for this session's notices: often enough that a
        warning is on screen for most of its time (a quarter of it), never more than every
        second, never less than every NOTICE_POLL_MAX_S."""
        return min(NOTICE_POLL_MAX_S, max(1.0, self.warn_before_s / 4))

    def validate(self, where: str) -> IdlePolicy:
        problems = []
        if self.idle_timeout_s <= 0:
            problems.append("idle_timeout_s must be more than 0")
        if self.warn_before_s < 0:
            problems.append("warn_before_s must not be negative")
        if self.warn_before_s >= self.idle_timeout_s:
            problems.append("warn_before_s must be less than idle_timeout_s")
        if self.max_age_s is not None and self.max_age_s <= self.warn_before_s:
            problems.append("max_age_s must be more than warn_before_s")
        if self.keep_alive_max_s < 0:
            problems.append("keep_alive_max_s must not be negative")
        if problems:
            raise PolicyError(f"idle policy for {where}: " + "; ".join(problems))
        return self


def policy_from(raw: Mapping[str, Any], base: IdlePolicy, where: str) -> IdlePolicy:
    """``base`` with the keys of ``raw`` (a config mapping) applied, validated."""
    known = {f.name for f in fields(IdlePolicy)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PolicyError(
            f"idle policy for {where}: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    changes: dict[str, Any] = dict(raw)
    if "mode" in changes:
        try:
            changes["mode"] = ReclaimMode(changes["mode"])
        except ValueError:
            modes = ", ".join(m.value for m in ReclaimMode)
            raise PolicyError(
                f"idle policy for {where}: mode {changes['mode']!r} is not one of {modes}"
            ) from None
    for name in known - {"mode", "reclaim_by_anyone", "stop_without_snapshot", "max_age_s"}:
        if name in changes and not isinstance(changes[name], int | float):
            raise PolicyError(f"idle policy for {where}: {name} must be a number of seconds")
    return replace(base, **changes).validate(where)


def resolve(config: Mapping[str, Any], project: str, profile: str = "") -> IdlePolicy:
    """The policy of a session: the defaults, then its project's, then its profile's.

    ``config``: ``{"default": {...}, "projects": {name: {...}}, "profiles": {name: {...}}}``.
    """
    policy = policy_from(config.get("default", {}), IdlePolicy(), "the default")
    if project in config.get("projects", {}):
        policy = policy_from(config["projects"][project], policy, f"project {project}")
    if profile and profile in config.get("profiles", {}):
        policy = policy_from(config["profiles"][profile], policy, f"profile {profile}")
    return policy


@dataclass(frozen=True)
class Session:
    """What the culler knows of one running session."""

    workload_id: int
    started_at: datetime
    idle_marked: bool = False  # the scheduler may reclaim it (Workload.idle_since)
    warned_at: datetime | None = None  # the warning the user was shown, if any
    warned_stop_at: datetime | None = None  # the time that warning announced


@dataclass(frozen=True)
class Signals:
    """The latest time each source saw the session in use (None: never or unknown)."""

    # JupyterHub's last_activity of the server: heeded only while ``reported_at`` is None.
    hub_activity: datetime | None = None
    kernel_activity: datetime | None = None
    terminal_activity: datetime | None = None
    # What its user last did in JupyterLab, and when: a key of USER_ACTIONS.
    user_activity: datetime | None = None
    user_action: str = ""
    gpu_activity: datetime | None = None
    # At ``reported_at`` the session extension saw a kernel executing. It reports every
    # change at once and everything at least every interval, so a busy report stands
    # for ``report_holds_for`` after it was made (the session is in use until then).
    kernels_busy: bool = False
    reported_at: datetime | None = None
    report_holds_for: timedelta = timedelta(seconds=90)
    keep_alive_until: datetime | None = None


class Action(enum.StrEnum):
    KEEP = "keep"
    WARN = "warn"  # tell the user what will happen, and when
    MARK_IDLE = "mark-idle"  # on-demand: the scheduler may reclaim it
    UNMARK = "unmark"  # active again: no longer reclaimable as idle
    WITHDRAW = "withdraw"  # used since its warning: the warning and its notice go
    CULL = "cull"  # snapshot, stop, release


class Cause(enum.StrEnum):
    NONE = ""
    IDLE = "idle"
    MAX_AGE = "max-age"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # for a person: what was seen, and what happens next
    cause: Cause = Cause.NONE
    last_active: datetime | None = None
    # When the session will be culled (always, max age) or marked (on-demand), and which
    # of the two ``pending`` comes then unless the session is used.
    due_at: datetime | None = None
    pending: Action | None = None
    # When, without any new signal, the decision would change: the culler looks again then
    # rather than at its next round, so no session waits a round past its threshold.
    recheck_at: datetime | None = None


def last_activity(session: Session, signals: Signals, now: datetime) -> tuple[datetime, str]:
    """The latest sign of use, and which source gave it. A kernel reported busy is in use
    now, as long as the report holds (an extension that stopped reporting vouches for no
    more than that). The hub's activity counts only for a session whose extension never
    reported: for the others it is the open page's polling as much as any use."""
    seen = [
        (session.started_at, "the session started"),
        (signals.kernel_activity, "a kernel ran code"),
        (signals.terminal_activity, "terminal activity"),
        (signals.user_activity, USER_ACTIONS.get(signals.user_action, "its user's actions")),
        (signals.gpu_activity, "its GPUs did work"),
    ]
    if signals.reported_at is None:
        seen.append((signals.hub_activity, "browser or API activity"))
    if signals.kernels_busy and signals.reported_at is not None:
        holds_until = signals.reported_at + signals.report_holds_for
        seen.append((min(holds_until, now), "a kernel is running code"))
    when, what = max(((t, w) for t, w in seen if t is not None), key=lambda item: item[0])
    return when, what


def decide(session: Session, signals: Signals, policy: IdlePolicy, now: datetime) -> Decision:
    active_at, source = last_activity(session, signals, now)
    idle_for = now - active_at
    warn_before = timedelta(seconds=policy.warn_before_s)

    if policy.max_age_s is not None:
        end_of_life = session.started_at + timedelta(seconds=policy.max_age_s)
        if now >= end_of_life - warn_before:
            return _toward(
                session,
                Action.CULL,
                Cause.MAX_AGE,
                end_of_life,
                now,
                warn_before,
                active_at,
                f"reached its maximum age of {_span(policy.max_age_s)}",
            )

    keep_alive = signals.keep_alive_until
    if keep_alive is not None and keep_alive > now:
        action = Action.UNMARK if session.idle_marked else Action.KEEP
        return Decision(
            action,
            f"kept alive by its user until {_clock(keep_alive)}",
            last_active=active_at,
            recheck_at=keep_alive,
        )

    due = active_at + timedelta(seconds=policy.idle_timeout_s)
    if now < due - warn_before:
        if session.idle_marked:
            return Decision(
                Action.UNMARK,
                f"in use again: {source} at {_clock(active_at)}",
                last_active=active_at,
            )
        return Decision(
            Action.WITHDRAW if session.warned_at is not None else Action.KEEP,
            f"last in use {_ago(idle_for)} ago: {source}",
            last_active=active_at,
            recheck_at=due - warn_before,
        )
    why = f"idle for {_ago(idle_for)} (last in use: {source})"
    if policy.mode is ReclaimMode.ALWAYS:
        return _toward(session, Action.CULL, Cause.IDLE, due, now, warn_before, active_at, why)
    if not policy.reclaim_by_anyone:
        return Decision(
            Action.KEEP, f"{why}; its project's policy keeps idle sessions", Cause.IDLE, active_at
        )
    if session.idle_marked:
        return Decision(
            Action.KEEP,
            f"{why}: it will be snapshotted and stopped when a waiting workload needs its GPUs",
            Cause.IDLE,
            active_at,
        )
    return _toward(session, Action.MARK_IDLE, Cause.IDLE, due, now, warn_before, active_at, why)


def _toward(
    session: Session,
    action: Action,
    cause: Cause,
    due: datetime,
    now: datetime,
    warn_before: timedelta,
    active_at: datetime,
    why: str,
) -> Decision:
    """Warn first, then ``action`` at the time the warning announced: never sooner than a
    full ``warn_before`` after the warning was shown, and never later, so what the user
    read holds. A session used since its idle warning, or due later than it announced (a
    sign of use reported late), is warned anew with the new time."""
    warned = session.warned_at
    announced = session.warned_stop_at or (warned + warn_before if warned else None)
    if warn_before and (
        warned is None
        or announced is None
        or due > announced
        or (cause is Cause.IDLE and warned < active_at)
    ):
        at = _announceable(max(due, now + warn_before), warn_before)
        reason = f"{why}: {_what(action)} at {_clock(at)}"
        return Decision(Action.WARN, reason, cause, active_at, at, action, at)
    at = announced if warn_before and announced is not None else due
    if now < at:
        reason = f"{why}: {_what(action)} at {_clock(at)}"
        return Decision(Action.KEEP, reason, cause, active_at, at, action, at)
    if action is Action.MARK_IDLE:
        why += ": it will be snapshotted and stopped when a waiting workload needs its GPUs"
    return Decision(action, why, cause, active_at, at)


def _announceable(at: datetime, warn_before: timedelta) -> datetime:
    """``at`` made a time the warning can say exactly: the next whole minute for a warning
    of a minute or more ("at 14:02 UTC"), the next whole second for a shorter one."""
    minutes = warn_before.total_seconds() >= WHOLE_MINUTES_FROM_S
    whole = at.replace(second=0 if minutes else at.second, microsecond=0)
    if whole == at:
        return at
    return whole + (timedelta(minutes=1) if minutes else timedelta(seconds=1))


def _what(action: Action) -> str:
    if action is Action.CULL:
        return "it will be snapshotted and stopped"
    return "it may be snapshotted and stopped when someone needs its GPUs, from"


def _clock(at: datetime) -> str:
    """The time as a warning says it: to the second unless it is a whole minute."""
    if at.second == 0 and at.microsecond == 0:
        return at.strftime("%H:%M UTC")
    return at.strftime("%H:%M:%S UTC")


def _ago(span: timedelta) -> str:
    return _span(span.total_seconds())


def _span(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{int(seconds)} s"
    if minutes < 120:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"
