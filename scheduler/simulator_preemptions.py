"""How the replay measures each preemption decision it applies (``PreemptionDecision``):
where the preemptor lands, the GPUs free there, the fewest it needed freed (by its gang's
shape and by the caps on its project's path) and the GPUs its victims held.

``MeasuredPreemptions`` is mixed into ``simulator._Replay``; the replay calls
``_measure_preemption`` once per preemptor as it applies a plan, on the fleet as the plan
left it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .simulator_measures import PreemptionDecision, QuotaCeiling, free_for, gang_fits, pod_need

if TYPE_CHECKING:
    from .model import ProjectTree
    from .simulator_jobs import BookedJob
    from .snapshot import NodeState, Plan, Running


class MeasuredPreemptions:
    """The replay's preemption decisions, measured (see the module docstring)."""

    jobs: dict[int, BookedJob]
    running: Any  # workload id -> Running
    nodes: dict[str, NodeState]
    # (GPU type, cluster, zone) -> the names of its nodes
    zone_nodes: dict[tuple[str, str, str], list[str]]
    tree: ProjectTree
    ceiling: QuotaCeiling
    decisions: list[PreemptionDecision]

    def _measure_preemption(
        self, job: BookedJob, victims: list[Running], plan: Plan, now: float, for_a_cap: bool
    ) -> None:
        """One decision's figures (``PreemptionDecision``), on the fleet as the plan left
        it. A gang's victims share one zone; the first victim's is the one measured.
        ``for_a_cap``: a cap on its path asked for victims (backfill taken back)."""
        others_kept = [pod for k in plan.kept if k.workload_id != job.wid for pod in k.pods]
        free_in: dict[tuple[str, str], dict[str, int]] = {}
        for (gpu_type, cluster, zone), names in self.zone_nodes.items():
            if gpu_type == job.gpu_type:
                nodes = (self.nodes[n] for n in names)
                free_in[(cluster, zone)] = free_for(nodes, others_kept)
        own = [pod for k in plan.kept if k.workload_id == job.wid for pod in k.pods]
        where = self.nodes[own[0].node] if own else victims[0]  # where it lands
        cluster, zone = where.cluster, where.zone
        free = sum(free_in.get((cluster, zone), {}).values())
        # Zones kept for another request (the plan's held zones) are not the preemptor's.
        usable = {
            key: per_node
            for key, per_node in free_in.items()
            if plan.held.get((*key, job.gpu_type), job.wid) == job.wid
        }
        evicted = sum(v.gpus for v in victims)
        quota_need = self._quota_need(job, victims, plan)
        need = max(
            min(
                pod_need(
                    ((count, self.nodes[name].total) for name, count in per_node.items()),
                    job.gpus_per_pod,
                    job.pods,
                )
                for per_node in free_in.values()
            ),
            quota_need,
        )
        decision = PreemptionDecision(
            at_s=now,
            job_id=job.trace.job_id,
            victims=tuple(self.jobs[v.id].trace.job_id for v in victims),
            cluster=cluster,
            zone=zone,
            gpus=job.trace.num_gpus,
            free_gpus=free,
            need_gpus=need,
            evicted_gpus=evicted,
            fitted=quota_need <= 0
            and not for_a_cap
            and any(
                gang_fits(per_node.values(), job.gpus_per_pod, job.pods)
                for per_node in usable.values()
            ),
        )
        self.decisions.append(decision)
        job.preemptor_of += 1
        job.evicted_gpus += evicted
        job.evicted_beyond_need_gpus += decision.beyond_need_gpus

    def _quota_need(self, job: BookedJob, victims: list[Running], plan: Plan) -> int:
        """The GPUs the preemptor's caps asked its victims to free, as the plan left the
        rest: the most, over the capped nodes on its project's path, by which its GPUs
        would take the subtree over its cap once what stops there (but its own victims)
        is gone — the other preemptors' kept placements counted as their projects'."""
        t = job.gpu_type
        mine = {v.id for v in victims}
        path = (job.project, *self.tree.ancestors(job.project))
        used: dict[str, int] = defaultdict(int)
        for r in self.running.values():
            if r.gpu_type == t and not (r.stopping and r.id not in mine):
                for name in (r.project, *self.tree.ancestors(r.project)):
                    used[name] += r.gpus
        for kept in plan.kept:
            other = self.jobs[kept.workload_id]
            if kept.workload_id != job.wid and other.gpu_type == t:
                for name in (other.project, *self.tree.ancestors(other.project)):
                    used[name] += other.trace.num_gpus
        need = 0
        for name in path:
            cap = self.ceiling.limit.get((name, t), math.inf)
            if cap != math.inf:
                need = max(need, int(used[name] + job.trace.num_gpus - cap))
        return need
