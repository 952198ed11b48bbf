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
  (``fault_budget``); the fault after the last unit ends the job, saying what it met;
- the restart after a fault waits ``backoff_s``, doubled for each fault spent before
  (at most ``backoff_max_s``): a fault that repeats at once does not spin;
- a restart "elsewhere" never lands on the GPUs and nodes blamed, for the rest of the
  job's life; a restart "in place" may use the same GPUs again;
- the next attempt resumes from the newest checkpoint any attempt saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from .classify import FaultClass, JobAction, Verdict


@dataclass(frozen=True)
class RetryPolicy:
    fault_budget: int = 3  # infrastructure faults a job restarts from
    backoff_s: float = 10.0  # wait before the restart after the first fault ...
    backoff_max_s: float = 600.0  # ... doubled for each later one, up to this

    def __post_init__(self) -> None:
        if self.fault_budget < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                "a retry policy needs fault_budget >= 0 and 0 <= backoff_s <= backoff_max_s, "
                f"not {self}"
            )


@dataclass(frozen=True)
class AttemptRecord:
    """A job as its attempt ends: which attempt, the faults it spent before this one,
    what earlier faults blamed, and the newest checkpoint saved by any attempt."""

    attempt: int
    faults: int = 0
    avoid_nodes: frozenset[str] = frozenset()
    avoid_gpus: frozenset[str] = frozenset()
    checkpoint: str | None = None


@dataclass(frozen=True)
class Resume:
    """The job goes back to the queue as ``attempt``, not before ``delay_s`` from now."""

    attempt: int
    faults: int  # spent, this one included
    delay_s: float
    avoid_nodes: frozenset[str]
    avoid_gpus: frozenset[str]
    resume_from: str | None
    message: str  # what a person reads: why it restarts, from where, and when


@dataclass(frozen=True)
class GiveUp:
    message: str  # why it is not retried, in words that say what to change


def next_attempt(record: AttemptRecord, verdict: Verdict, policy: RetryPolicy) -> Resume | GiveUp:
    if verdict.job is JobAction.KEEP:
        raise ValueError(f"a {verdict.fault} verdict keeps the job running: no attempt ended")
    if verdict.job is JobAction.FAIL:
        return GiveUp(verdict.reason)
    faults = record.faults + (1 if verdict.spends_budget else 0)
    if faults > policy.fault_budget:
        return GiveUp(
            f"{verdict.reason}; not retried: this is infrastructure fault {faults} of the "
            f"job, and it restarts from at most {policy.fault_budget}"
        )
    avoid_nodes, avoid_gpus = record.avoid_nodes, record.avoid_gpus
    if verdict.job is JobAction.RESTART_ELSEWHERE:
        avoid_nodes |= frozenset(verdict.nodes)
        avoid_gpus |= frozenset(verdict.gpus)
    delay = 0.0
    if verdict.spends_budget:
        delay = min(policy.backoff_s * 2 ** (faults - 1), policy.backoff_max_s)
    attempt = record.attempt + 1
    parts = [f"attempt {attempt}"]
    if record.checkpoint:
        parts.append(f"resumes from {record.checkpoint}")
    else:
        parts.append("starts from the beginning (no checkpoint was saved)")
    if delay:
        parts.append(f"after {delay:.0f} s of back-off")
    if verdict.spends_budget:
        parts.append(f"infrastructure fault {faults} of {policy.fault_budget} allowed")
    elif verdict.fault is FaultClass.DISRUPTION:
        parts.append("no fault counted")
    blamed = sorted(frozenset(verdict.nodes) | frozenset(verdict.gpus))
    if verdict.job is JobAction.RESTART_ELSEWHERE and blamed:
        parts.append(f"not on {', '.join(blamed)}")
    return Resume(
        attempt=attempt,
        faults=faults,
        delay_s=delay,
        avoid_nodes=avoid_nodes,
        avoid_gpus=avoid_gpus,
        resume_from=record.checkpoint,
        message=f"{verdict.reason}; {', '.join(parts)}",
    )
