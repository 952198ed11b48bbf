"""Faults in the trace replay (``gpufleet simulate --fault-rate``): every training job of
the trace meets infrastructure faults as a Poisson process per GPU (Llama 3 405B's rate by
default in the CLI: 419 interruptions in 54 days on 16,384 GPUs), and recovers as the
recovery loop makes it: the fault is detected ``fault_detect_s`` later (its GPUs held
meanwhile, doing nothing useful), the job goes back to the queue at once with its place
(a restart away from what failed does not back off), loses the work since its last
checkpoint, and spends ``fault_restart_s`` of its next run starting and loading that
checkpoint before it progresses again. Past the controller's retry budget
(``fault_budget`` faults per 1,024 GPUs within a day) the job ends, failed.

Choices (docs/simulator.md, "Faults"): the faulty node — one of the job's, drawn — is out
of service for ``fault_repair_s`` once found, as if cordoned (what else runs there runs
on), or repaired at once with 0; a job restarting after a fault may use the recovery
spares (``spare_nodes_per_zone``);
sessions meet none (they are not checkpointed training); a job that is stopping for a
preemption when a fault strikes ends by the preemption, and one that a fault struck before
its preemption ends by the fault; one struck does not finish (its work since the last
checkpoint is redone). The draws come from one seeded generator, so a replay is
repeatable.

``RecoveringReplay`` is mixed into ``simulator._Replay``; it owns the fault bookkeeping,
and the replay calls ``_maybe_fault`` from each start and ``_faulted``/``_fault_detected``
from its event loop.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .snapshot import Running

DAY_S = 86_400.0
# Llama 3 405B: 419 unexpected interruptions over 54 days of 16,384 GPUs.
LLAMA3_FAULTS_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)


class RecoveringReplay:
    """The replay's faults (see the module docstring)."""

    jobs: dict[int, Any]
    running: Any
    options: Any
    rng: random.Random
    nodes: dict[str, Any]  # name -> NodeState
    # Nodes out of service for repair: name -> until when (the latest fault's repair).
    repairing: dict[str, float]
    node_names: list[str]

    if TYPE_CHECKING:  # the replay's own

        def _push(self, at: float, kind: int, wid: int, attempt: int) -> None: ...
        def _release(
            self, job: Any, now: float, preempted: bool, faulted: bool = False
        ) -> Running: ...
        def _enqueue(self, job: Any) -> None: ...

    def _maybe_fault(self, job: Any, now: float, fault_kind: int) -> None:
        """At a job's start: when its next fault strikes, if before it would finish."""
        rate = self.options.fault_rate_per_gpu_hour
        if rate <= 0 or job.trace.kind != "job":
            return
        after = self.rng.expovariate(rate * job.trace.num_gpus / 3600.0)
        if after < job.remaining:
            self._push(now + after, fault_kind, job.wid, job.attempt)

    def _faulted(self, job: Any, now: float, detected_kind: int) -> None:
        """A fault strikes a running job: nothing it does from now on counts; it is found
        ``fault_detect_s`` later."""
        running = self.running[job.wid]
        if running.stopping:
            return  # preempted meanwhile: it ends by that
        job.fault_at = now
        self._push(now + self.options.fault_detect_s, detected_kind, job.wid, job.attempt)

    def _fault_detected(self, job: Any, now: float, repaired_kind: int) -> None:
        """The recovery loop stops the job, takes its faulty node out of service for
        ``fault_repair_s`` (if any), and queues its next attempt."""
        fault_at = job.fault_at if job.fault_at is not None else now
        running = self._release(job, now, preempted=False, faulted=True)
        repair = self.options.fault_repair_s
        if repair > 0:
            nodes = sorted({pod.node for pod in running.pods})
            self._out_of_service(self.rng.choice(nodes), now + repair, repaired_kind)
        interval = self.options.checkpoint_interval_s
        done = math.floor((fault_at - running.started_at) / interval) * interval
        # Redone: what it did since its checkpoint, and the time it held its GPUs after.
        job.fault_lost_gpu_s += running.gpus * (now - running.started_at - done)
        job.remaining += self.options.fault_restart_s - done
        job.faults += 1
        job.fault_at = None
        job.fault_times = [t for t in job.fault_times if now - t < DAY_S] + [now]
        budget = self.options.fault_budget * max(1, math.ceil(job.trace.num_gpus / 1024))
        if len(job.fault_times) > budget:
            # As the controller does: a job that faults this often is failing for a
            # reason a restart will not fix. (It also bounds a replay whose jobs fault
            # faster than they checkpoint: they would never finish.)
            job.gave_up = (
                f"failed: {len(job.fault_times)} infrastructure faults within a day, past "
                f"its budget of {budget}"
            )
            return
        job.pending = replace(job.pending, recovering=True)  # it may use the spares
        self._enqueue(job)

    def _out_of_service(self, name: str, until: float, repaired_kind: int) -> None:
        """The node takes no new work until ``until`` (what runs there runs on)."""
        self.repairing[name] = max(until, self.repairing.get(name, until))
        self.nodes[name] = replace(self.nodes[name], schedulable=False)
        self._push(until, repaired_kind, self.node_names.index(name), 0)

    def _repaired(self, index: int, now: float) -> bool:
        """A repair is over: the node is back in service unless a later fault keeps it
        out. Returns whether it came back."""
        name = self.node_names[index]
        if self.repairing.get(name, now) > now:
            return False
        del self.repairing[name]
        self.nodes[name] = replace(self.nodes[name], schedulable=True)
        return True
