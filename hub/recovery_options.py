"""The controller's recovery options (docs/recovery.md): how often a job
restarts from infrastructure faults and how long it waits between attempts, when a job
that stopped progressing counts as hung, how long a silent node agent's jobs wait for it,
and where a job's checkpoints may lie (the place it resumes from). Mixed into
``FleetController``, so they are set as ``c.FleetController.<name>``."""

from __future__ import annotations

import contextlib
import os
import pwd

from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Configurable

from ..recovery.attempts import RetryPolicy
from ..recovery.breaker import BreakerPolicy
from ..recovery.classify import RecoveryPolicy


class RecoveryOptions(Configurable):
    # The controller's own (hub/app.py), which these options' defaults read.
    data_dir: str
    user_mode: str

    recovery_spares = Dict(
        {},
        help="Spare nodes held back for jobs restarting after a fault, per zone: "
        "{'zone-a': 1} keeps one node of each GPU type of zone-a; a key may also be "
        "'cluster/zone' (that zone of that cluster) or '*' (every zone), the most "
        "specific first. A job's next attempt after a fault goes first, onto a spare and "
        "the free GPUs of its zone, so it does not wait in the queue; meanwhile the "
        "spares are lent to preemptible work (a preemptible class, idle sessions anyone "
        "may reclaim), which a restarting job stops however young. Ordinary work never "
        "lands on a spare, and guarantees are shares of the rest of the fleet.",
    ).tag(config=True)

    @validate("recovery_spares")
    def _valid_spares(self, proposal: dict[str, object]) -> dict[str, int]:
        spares = proposal["value"]
        assert isinstance(spares, dict)
        for zone, nodes in spares.items():
            if not isinstance(zone, str) or not zone:
                raise TraitError(f"recovery_spares: {zone!r} is not a zone name")
            if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
                raise TraitError(
                    f"recovery_spares[{zone!r}] must be a whole number of nodes (0 or "
                    f"more), not {nodes!r}"
                )
        return spares

    job_fault_budget = Integer(
        3,
        min=0,
        help="Infrastructure faults a job of up to 1,024 GPUs restarts from within "
        "job_fault_window_seconds (a larger job: as many per 1,024 GPUs): a "
        "GPU, node, hang or unexplained failure sends it back to the queue as its next "
        "attempt, resuming from its last checkpoint; the fault past this many ends it. "
        "The job's own errors are never retried; preemptions and drains restart it "
        "without spending any.",
    ).tag(config=True)

    job_fault_window_seconds = Float(
        86400.0,
        min=0,
        help="The window job_fault_budget counts faults in: a rate, because a large job "
        "meets several faults a day and must survive each; 0 counts them over the job's "
        "whole life.",
    ).tag(config=True)

    job_restart_backoff_seconds = Float(
        10.0,
        min=0,
        help="Seconds a job's next attempt waits after an infrastructure fault; doubled "
        "for each further fault in a row whose attempt ran less than 10 minutes, up to "
        "job_restart_backoff_max_seconds.",
    ).tag(config=True)

    job_restart_backoff_max_seconds = Float(
        600.0, min=0, help="The longest wait before a job's next attempt after a fault."
    ).tag(config=True)

    job_hang_factor = Float(
        10.0,
        min=1,
        help="A job that reports progress (gpufleet.progress) is hung after no step for "
        "this many times its p99 step time, and at least job_hang_floor_seconds.",
    ).tag(config=True)

    job_hang_floor_seconds = Float(
        600.0,
        min=0,
        help="The shortest silence between steps that counts as a hang (NCCL's own "
        "collective timeout is 10 minutes). Before an attempt's first step (starting, "
        "loading its checkpoint) it is judged by job_silent_idle_seconds instead.",
    ).tag(config=True)

    job_stacks_wait_seconds = Float(
        20.0,
        min=1,
        max=600,
        help="How long a trace of a job's ranks (on a hang, before the gang is stopped, "
        "or asked for with gpufleet trace) waits for the node agents' stacks: a hung "
        "gang is stopped once every pod's stacks are in, or after this long without them.",
    ).tag(config=True)

    job_checkpoint_limit_seconds = Float(
        1800.0,
        min=0,
        help="A checkpoint started (gpufleet.checkpoint_started) and not saved within this "
        "long is a hang.",
    ).tag(config=True)

    job_silent_idle_seconds = Float(
        1800.0,
        min=0,
        help="A job that never reports progress is hung after no output for this long "
        "while its GPUs idle.",
    ).tag(config=True)

    recovery_breaker_share = Float(
        0.5,
        min=0.01,
        max=1.0,
        help="The recovery loop stops cordoning a cluster's nodes once those it cordoned "
        "within recovery_breaker_window_seconds would pass this share of the cluster; it "
        "cordons none there again until an admin resets the breaker (gpufleet "
        "reset-breaker CLUSTER).",
    ).tag(config=True)

    recovery_breaker_window_seconds = Float(
        300.0, min=1, help="The window recovery_breaker_share counts cordons in."
    ).tag(config=True)

    recovery_maintenance = Bool(
        True,
        help="Have the node agents do the maintenance a fault leaves due: recycle and "
        "diagnose a node that fell off, reset a GPU with a hardware fault (a degraded one "
        "at its next idle point), diagnose a GPU blamed twice; a pass returns it to "
        'service (docs/recovery.md, "Maintenance"). Off: faults only cordon, and an '
        "admin recycles or uncordons by hand.",
    ).tag(config=True)

    def recovery_policies(self) -> tuple[RetryPolicy, RecoveryPolicy, BreakerPolicy]:
        """The policies the store applies; ValueError names what cannot work."""
        retry = RetryPolicy(
            self.job_fault_budget,
            self.job_fault_window_seconds or None,
            self.job_restart_backoff_seconds,
            self.job_restart_backoff_max_seconds,
        )
        recovery = RecoveryPolicy(
            hang_factor=self.job_hang_factor,
            hang_floor_s=self.job_hang_floor_seconds,
            checkpoint_limit_s=self.job_checkpoint_limit_seconds,
            silent_idle_s=self.job_silent_idle_seconds,
            stacks_wait_s=self.job_stacks_wait_seconds,
        )
        breaker = BreakerPolicy(self.recovery_breaker_share, self.recovery_breaker_window_seconds)
        return retry, recovery, breaker

    job_agent_lost_seconds = Float(
        120.0,
        help="A job with a pod on a node whose agent has been silent this long (at least "
        "c.NodeWatch.heartbeat_timeout) stops as agent-lost and resumes elsewhere, charged one "
        "fault. Longer than the heartbeat timeout because an agent that restarts (a crash, "
        "kill -9, an upgrade; JupyterHub restarts its managed agent within about 30 s) takes "
        "over the pods it finds running, which costs them nothing; a node that is really "
        "gone costs its jobs this long before they resume.",
    ).tag(config=True)

    job_checkpoint_places = List(
        Unicode(),
        help="Where a job's local checkpoint location may lie, with {user}: a submission "
        "naming any other directory is refused (the node agent binds the location into the "
        "ranks' sandbox as root, and refuses it too). Default: the user's home (the node "
        "agent's home_dir_template; the account's own home in 'system' user mode) and the "
        "agent's checkpoint_root/{user}. s3:// locations are always taken.",
    ).tag(config=True)

    @default("job_checkpoint_places")
    def _default_job_checkpoint_places(self) -> list[str]:
        agent = self.config.NodeAgent
        data = os.path.abspath(self.data_dir)
        home = str(agent.get("home_dir_template") or os.path.join(data, "homes", "{username}"))
        root = str(agent.get("checkpoint_root") or os.path.join(data, "checkpoints"))
        return [home.replace("{username}", "{user}"), os.path.join(root, "{user}")]

    def checkpoint_places(self, username: str) -> list[str]:
        """The directories ``username``'s local checkpoint locations may lie in."""
        places = [p.replace("{user}", username) for p in self.job_checkpoint_places]
        if self.user_mode == "system":
            with contextlib.suppress(KeyError):
                places.append(pwd.getpwnam(username).pw_dir)
        return places
