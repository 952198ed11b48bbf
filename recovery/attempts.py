"""What follows an attempt of a training job that ended before the job did:
``next_attempt(record, verdict, policy) -> Resume | GiveUp``.

Pure: the classifier (``classify.py``) says what the fault was; this module says whether
the job runs again, when, and where not. The store carries the decision out (the job goes
back to the queue as its next attempt, or ends) and the scheduler honours the exclusions
(``Pending.avoid_nodes`` / ``avoid_gpus``).

The rules (docs/recovery.md, "Attempts"):

- a user error ends the job: there is no budget for faults of the job's own code;
- a disruption (a preemption, a drain) restarts at once and spends nothing: the
  scheduler's no-thrashing rule is what bounds how often that can happen;
- every other fault spends one unit of the job's budget of infrastructure faults
  (``fault_budget`` within ``fault_window_s``: a rate, since a large job meets several
  faults a day); the fault past the budget ends the job, saying what it met;
- the budget grows with the job: ``fault_budget`` per ``budget_gpus`` GPUs, since faults
  come per GPU;
- the restart after a fault waits ``backoff_s``, doubled for each fault in a row that
  came within ``backoff_reset_s`` of its attempt's start (at most ``backoff_max_s``): a
  fault that repeats at once does not spin, and a job that ran well starts afresh; but
  the first such restart away from hardware newly blamed goes at once, since what failed
  is left out (a second quick fault in a row waits as usual);
- a restart "elsewhere" never lands on the GPUs and nodes blamed, until they pass
  maintenance (``state/maintenance.py`` then drops them from the job's record);
  a restart "in place" may use the same GPUs again;
- the next attempt resumes from the newest checkpoint any attempt saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from .classify import FaultClass, JobAction, Verdict


@dataclass(frozen=True)
class RetryPolicy:
    fault_budget: int = 3  # infrastructure faults a job restarts from ...
    # ... within this long (None: over its whole life). A rate, not a lifetime count: a
    # 16,384-GPU job meets several faults a day and must survive every one of them.
    fault_window_s: float | None = 86400.0
    backoff_s: float = 10.0  # wait before the restart after a fault ...
    backoff_max_s: float = 600.0  # ... doubled for each fault in a row that came quickly
    # An attempt that ran this long before its fault ends the row: the back-off starts
    # again from backoff_s (as Kubernetes' crash-loop back-off does).
    backoff_reset_s: float = 600.0
    # The budget is per this many GPUs of the job (at least fault_budget): faults come
    # per GPU, so a job 16 times larger meets 16 times as many.
    budget_gpus: int = 1024

    def __post_init__(self) -> None:
        if (
            self.fault_budget < 0
            or self.backoff_s < 0
            or self.backoff_max_s < self.backoff_s
            or (self.fault_window_s is not None and self.fault_window_s <= 0)
            or self.budget_gpus < 1
        ):
            raise ValueError(
                "a retry policy needs fault_budget >= 0, a fault window over 0 s and "
                f"0 <= backoff_s <= backoff_max_s, not {self}"
            )

    def budget_for(self, gpus: int) -> int:
        return max(self.fault_budget, -(-self.fault_budget * gpus // self.budget_gpus))

    def window(self) -> str:
        if self.fault_window_s is None:
            return ""
        hours = self.fault_window_s / 3600
        return f" within {hours:g} h" if hours >= 1 else f" within {self.fault_window_s:g} s"


@dataclass(frozen=True)
class AttemptRecord:
    """A job as its attempt ends: which attempt, when its earlier infrastructure faults
    happened, what they blamed, and the newest checkpoint saved by any attempt."""

    attempt: int
    fault_times: tuple[float, ...] = ()
    avoid_nodes: frozenset[str] = frozenset()
    avoid_gpus: frozenset[str] = frozenset()
    checkpoint: str | None = None
    gpus: int = 1
    ran_s: float = 0.0  # how long the ending attempt ran
    quick_faults: int = 0  # faults in a row before it, each after a short run


@dataclass(frozen=True)
class Resume:
    """The job goes back to the queue as ``attempt``, not before ``delay_s`` from now."""

    attempt: int
    fault_times: tuple[float, ...]  # the faults that still count, this one included
    quick_faults: int  # the row of quick faults this one continues (0: none)
    delay_s: float
    avoid_nodes: frozenset[str]
    avoid_gpus: frozenset[str]
    resume_from: str | None
    message: str  # what a person reads: why it restarts, from where, and when


@dataclass(frozen=True)
class GiveUp:
    message: str  # why it is not retried, in words that say what to change


def next_attempt(
    record: AttemptRecord, verdict: Verdict, policy: RetryPolicy, now: float
) -> Resume | GiveUp:
    if verdict.job is JobAction.KEEP:
        raise ValueError(f"a {verdict.fault} verdict keeps the job running: no attempt ended")
    if verdict.job is JobAction.FAIL:
        return GiveUp(verdict.reason)
    window = policy.fault_window_s
    counted = tuple(t for t in record.fault_times if window is None or now - t < window)
    if verdict.spends_budget:
        counted = (*counted, now)
    faults, budget = len(counted), policy.budget_for(record.gpus)
    if faults > budget:
        return GiveUp(
            f"{verdict.reason}; not retried: this is infrastructure fault {faults} of the "
            f"job{policy.window()}, and it restarts from at most {budget}"
        )
    avoid_nodes, avoid_gpus = record.avoid_nodes, record.avoid_gpus
    if verdict.job is JobAction.RESTART_ELSEWHERE:
        avoid_nodes |= frozenset(verdict.nodes)
        avoid_gpus |= frozenset(verdict.gpus)
    delay, quick = 0.0, 0
    newly_blamed = (avoid_nodes - record.avoid_nodes) or (avoid_gpus - record.avoid_gpus)
    if verdict.spends_budget:
        quick = record.quick_faults + 1 if record.ran_s < policy.backoff_reset_s else 0
        delay = min(policy.backoff_s * 2 ** max(0, quick - 1), policy.backoff_max_s)
        if newly_blamed and quick <= 1:
            delay = 0.0
    attempt = record.attempt + 1
    parts = [f"attempt {attempt}"]
    if record.checkpoint:
        parts.append(f"resumes from {record.checkpoint}")
    else:
        parts.append("starts from the beginning (no checkpoint was saved)")
    if delay:
        parts.append(f"after {delay:.0f} s of back-off")
    if verdict.spends_budget:
        parts.append(f"infrastructure fault {faults} of {budget} allowed{policy.window()}")
    elif verdict.fault is FaultClass.DISRUPTION:
        parts.append("no fault counted")
    blamed = sorted(frozenset(verdict.nodes) | frozenset(verdict.gpus))
    if verdict.job is JobAction.RESTART_ELSEWHERE and blamed:
        parts.append(f"not on {', '.join(blamed)}")
    return Resume(
        attempt=attempt,
        fault_times=counted,
        quick_faults=quick,
        delay_s=delay,
        avoid_nodes=avoid_nodes,
        avoid_gpus=avoid_gpus,
        resume_from=record.checkpoint,
        message=f"{verdict.reason}; {', '.join(parts)}",
    )
