"""The plain words of the planner's refusals (``plan._Planner`` mixes this in): what is
happening and what to do first, then the numbers (docs/scheduler.md, "Why is it
pending?"). The numbers are the cycle's, read from the planner's quota book, capacity and
in-flight victims; nothing here changes them."""

from __future__ import annotations

from .placement import Capacity
from .quota import QuotaBook
from .snapshot import Mode, Pending, PreemptionCause, Running


def n_of(gpus: int, gpu_type: str) -> str:
    return f"{gpus} × {gpu_type}"


def gpus_word(count: int) -> str:
    return "1 GPU" if count == 1 else f"{count} GPUs"


class Reasons:
    """What the wording reads of the planner."""

    mode: Mode
    book: QuotaBook
    capacity: Capacity
    user_used: dict[tuple[str, str], int]
    in_flight: dict[int, list[Running]]
    # (project, type, GPUs) -> why it is beyond the limits, or None: the limits do not
    # change in a cycle (the memo keeps them across cycles of one tree and mode).
    limits: dict[tuple[str, str, int], str | None]
    quota_said: dict[tuple[str, str, bool], str]

    def _beyond_limits(self, request: Pending) -> str | None:
        """Why the request exceeds what its project or user may ever hold, if it does."""
        asked = (request.project, request.gpu_type, request.gpus)
        if asked not in self.limits:  # the limits do not change in a cycle
            self.limits[asked] = self._beyond_limits_afresh(*asked)
        return self.limits[asked]

    def _beyond_limits_afresh(self, p: str, t: str, gpus: int) -> str | None:
        if self.mode is Mode.STATIC and gpus > self.book.guarantee(p, t):
            return (
                f"More than project {p} may ever hold; ask for fewer GPUs: needs {n_of(gpus, t)}, "
                f"project {p} is guaranteed {self.book.guarantee(p, t)} and borrowing is off "
                "(static quotas)"
            )
        name, ceiling = self.book.ceiling(p, t)
        if gpus > ceiling:
            whose = f"project {p}" if name == p else f"{self.book.projects[name].kind} {name}"
            return (
                f"More than {whose} may ever hold; ask for fewer GPUs, or for a higher limit: "
                f"needs {n_of(gpus, t)}, {whose} may never hold more than {int(ceiling)} × {t} "
                "(guarantee plus borrow limit)"
            )
        cap = self.book.projects[p].per_user_cap
        if cap is not None and gpus > cap:
            return (
                f"More than one user may hold in project {p}; ask for fewer GPUs: needs "
                f"{n_of(gpus, t)}, the per-user cap in project {p} is {cap} GPUs"
            )
        return None

    def _user_cap_refusal(self, request: Pending) -> str | None:
        cap = self.book.projects[request.project].per_user_cap
        used = self.user_used[(request.project, request.user)]
        if cap is None or used + request.gpus <= cap:
            return None
        return (
            f"Waiting until {request.user} holds fewer GPUs in project {request.project}: "
            f"needs {n_of(request.gpus, request.gpu_type)}, {request.user} uses {used} of the "
            f"{cap}-GPU per-user cap"
        )

    def _quota_refusal(self, request: Pending) -> str | None:
        t, p = request.gpu_type, request.project
        within = self.book.within_guarantee(p, t, request.gpus)
        used, guaranteed = self.book.usage(p, t), self.book.guarantee(p, t)
        if self.mode is Mode.STATIC and not within:
            return (
                f"Waiting for project {p}'s GPUs to free up: needs {n_of(request.gpus, t)}, "
                f"project {p} uses {used}/{guaranteed} guaranteed {t} and borrowing is off "
                "(static quotas)"
            )
        over = self.book.over_cap(p, t, request.gpus)
        if over is None:
            return None
        if over == p:
            return (
                f"Waiting for project {p}'s GPUs to free up: needs {n_of(request.gpus, t)}, "
                f"project {p} uses {used}/{guaranteed} guaranteed {t} and may borrow "
                f"{int(self.book.may_borrow(p, t))} more"
            )
        node = self.book.projects[over]
        return (
            f"Waiting for the GPUs of {node.kind} {over} to free up: needs "
            f"{n_of(request.gpus, t)}, {node.kind} {over} caps its projects at "
            f"{int(self.book.cap(over, t))} × {t} and they use {self.book.usage(over, t)}"
        )

    def _never_fits(self, request: Pending) -> str:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        if t not in self.capacity.zones_by_type and not any(
            zt == t for (_, _, zt) in self.capacity.totals_by_zone
        ):
            return f"Cannot start, the fleet has no {t}: needs {n_of(request.gpus, t)}"
        shape = f"{pods} pods × {k}" if pods > 1 else f"{k} on one node"
        return (
            "Cannot start, no zone of the fleet holds that many even when empty; ask for "
            f"fewer GPUs, or for smaller pods: needs {n_of(request.gpus, t)} ({shape}) in one zone"
        )

    def _no_room_reason(self, request: Pending, block: tuple[int, str] | None, within: bool) -> str:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        if pods > 1:
            where = f"{gpus_word(request.gpus)} in one zone ({pods} pods × {k})"
        else:
            where = f"{gpus_word(k)} on one node"
        if request.particular:
            free = self._particular_free(request)
        elif block is None:
            free = f"every node with {t} is cordoned, unhealthy or silent right now"
        elif block[0] == 0:
            free = f"every {t} is in use" if pods == 1 else f"no node has {k} × {t} free"
        elif pods > 1:
            free = f"the most its pods can get in one zone is {n_of(block[0], t)}, in {block[1]}"
        else:
            free = f"the most free on one node is {n_of(block[0], t)}, in {block[1]}"
        withheld = self.book.withheld_from(request.project, t) if self.mode is not Mode.FIFO else 0
        total = self.capacity.free_by_type[t]
        if withheld and total - withheld < request.gpus:
            # The room is there, but not for this project: say whose it is.
            free = (
                f"{free}, but other projects' lend limits keep {withheld} of the {total} free "
                f"{t} back for themselves"
            )
        return f"Waiting for {where}: {free}{self._quota_said(request.project, t, within)}"

    def _particular_free(self, request: Pending) -> str:
        """What a particular request may use now, and — when nodes or GPUs it avoids (a
        fault of this job blamed them) are what keeps it out — which ones, where."""
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        reach = self.capacity.reach(
            t, k, pods, request.node_selector, request.avoid_nodes, request.avoid_gpus
        )
        block = reach.block
        if block is None:
            matching = " that matches its node selector" if request.node_selector else ""
            free = f"every node with {t}{matching} is cordoned, unhealthy or silent right now"
        elif block[0] == 0:
            free = (
                f"no {t} it may use is free"
                if pods == 1
                else f"no node it may use has {n_of(k, t)} free"
            )
        elif pods > 1:
            free = f"the most its pods may use in one zone is {n_of(block[0], t)}, in {block[1]}"
        else:
            free = f"the most it may use on one node is {n_of(block[0], t)}, in {block[1]}"
        if reach.avoided_at is None:
            return free
        gpus, nodes = reach.avoided_gpus, reach.avoided_nodes
        if pods > 1:
            named = ", ".join((*(f"node {n}" for n in nodes), *gpus))
            are = "is" if len(nodes) + len(gpus) == 1 else "are"
            avoided = (
                f"zone {reach.avoided_at} has room for its {pods} pods, but {named} there "
                f"failed this job before and {are} avoided"
            )
        else:
            if nodes:
                which, are = "the node", "is"
            elif len(gpus) == reach.free_there:
                which = f"{'it' if len(gpus) == 1 else 'all of them'}, {', '.join(gpus)},"
                are = "is" if len(gpus) == 1 else "are"
            elif len(gpus) == 1:
                which, are = f"one of them, {gpus[0]},", "is"
            else:
                which, are = f"{len(gpus)} of them, {', '.join(gpus)},", "are"
            avoided = (
                f"node {reach.avoided_at} has {n_of(reach.free_there, t)} free, but {which} "
                f"failed this job before and {are} avoided"
            )
        return f"{avoided}; {free}"

    def _quota_said(self, p: str, t: str, within: bool) -> str:
        if self.mode is Mode.FIFO:
            return ""
        said = self.quota_said.get((p, t, within))  # per cycle: see _decide on staleness
        if said is not None:
            return said
        used, guaranteed = self.book.usage(p, t), self.book.guarantee(p, t)
        if within:
            said = f"; within project {p}'s guarantee ({used}/{guaranteed} used)"
        else:
            room = self.book.may_borrow(p, t)
            more = "without limit" if room == float("inf") else f"{int(room)} more"
            said = f"; project {p} uses {used}/{guaranteed} guaranteed and may borrow {more}"
        self.quota_said[(p, t, within)] = said
        return said

    def _preempting(self, request: Pending) -> str:
        victims = self.in_flight[request.id]
        gpus = sum(v.gpus for v in victims)
        ids = ", ".join(str(v.id) for v in victims)
        return (
            f"Other work is stopping to make room: needs {n_of(request.gpus, request.gpu_type)}, "
            f"waiting for {gpus} GPU(s) being freed by preempted workload(s) {ids}"
        )

    def _victim_reason(self, victim: Running, request: Pending, cause: PreemptionCause) -> str:
        who = f"workload {request.id} of project {request.project}"
        if cause is PreemptionCause.IDLE:
            return f"idle; its GPUs were reclaimed for {who}"
        if cause is PreemptionCause.GUARANTEE:
            return (
                f"it ran on GPUs borrowed beyond project {victim.project}'s guarantee, which "
                f"{who} needed within its own guarantee"
            )
        if cause is PreemptionCause.PRIORITY:
            return f"preempted by higher-priority ({request.priority}) {who}"
        if cause is PreemptionCause.BACKFILL:
            return (
                f"it started while {who}, ahead of it in the queue, waited for the project's "
                "quota; that workload can start on it now"
            )
        return (
            f"it ran on borrowed GPUs and {who} has a higher priority class "
            f"({request.priority} over {victim.priority})"
        )
