"""The first process of a training job's pod on Kubernetes: wait for the master, then torchrun.

It runs inside the researcher's pod, with the job's own interpreter, so it uses the
standard library alone and never imports gpufleet: the cluster manager puts this file's
text into a ConfigMap the pods mount beside the script (``clusters/job_manifests.py``).

Why wait at all: a pod's stable name (``p0.<service>``) resolves as soon as the master pod
has an address, seconds before its torchrun listens; torchrun's workers that connect too
early give up in a rendezvous time-out, the most frequent complaint of JobSet and Kubeflow
users. So every pod but the master waits for the master's **port** to accept a connection,
asking again every ``POLL_S``, until ``GPUFLEET_RENDEZVOUS_TIMEOUT`` seconds have passed.
A probe is a bare connect and close, which torch's TCPStore server ignores. Then it
replaces itself (``exec``) with::

    <python> -m torch.distributed.run --nnodes=<pods> --node-rank=<pod index>
        --nproc-per-node=<gpus per pod> --master-addr=<addr> --master-port=<port>
        --tee=3 <script> <args...>

(a job of one pod: ``--nnodes=1 --standalone`` in place of the rank and the master).

A master that never listens ends the pod with exit status ``RENDEZVOUS_EXIT`` and a last
line on stderr naming what it waited for and how long, which becomes the job's reason.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence

POLL_S = 0.2
SAY_EVERY_S = 10.0
RENDEZVOUS_EXIT = 3
DEFAULT_TIMEOUT_S = 600.0


class RendezvousTimeout(Exception):
    """The master's port did not accept a connection within the deadline."""


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:  # not resolvable yet, refused, unreachable, timed out: not yet
        return False


def wait_for_port(
    host: str,
    port: int,
    timeout_s: float,
    say: Callable[[str], None],
    accepts: Callable[[str, int], bool] = _accepts,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> float:
    """Return once ``host:port`` accepts a connection (the seconds it took), saying every
    ``SAY_EVERY_S`` that it still waits; raise :class:`RendezvousTimeout` after
    ``timeout_s``."""
    start = clock()
    said = start
    while True:
        if accepts(host, port):
            return clock() - start
        now = clock()
        if now - start >= timeout_s:
            raise RendezvousTimeout(
                f"rendezvous: waited {now - start:.0f} s for the master pod {host} to accept "
                f"connections on port {port}; it never did (is pod 0 running? its events and "
                "output say why not)"
            )
        if now - said >= SAY_EVERY_S:
            say(f"waiting for the master pod {host}:{port} ({now - start:.0f} s)")
            said = now
        pause(POLL_S)


def torchrun_argv(python: str, env: Mapping[str, str], args: Sequence[str]) -> list[str]:
    """torchrun's command line for this pod, from the variables its manifest sets. A job
    of one pod rendezvouses with itself (``--standalone``: on a port its torchrun picks)."""
    pods = int(env["GPUFLEET_PODS"])
    gpus = f"--nproc-per-node={int(env['GPUFLEET_GPUS_PER_POD'])}"
    if pods == 1:
        placement = ["--nnodes=1", "--standalone", gpus]
    else:
        placement = [
            f"--nnodes={pods}",
            f"--node-rank={int(env['GPUFLEET_POD_INDEX'])}",
            gpus,
            f"--master-addr={env['GPUFLEET_MASTER_ADDR']}",
            f"--master-port={int(env['GPUFLEET_MASTER_PORT'])}",
        ]
    return [
        python,
        "-m",
        "torch.distributed.run",
        *placement,
        # Each rank's stdout and stderr on the pod's own, each line marked with its rank
        # (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE): the node agent reads them from there.
        "--tee=3",
        env["GPUFLEET_SCRIPT"],
        *args,
    ]


def main(argv: Sequence[str]) -> int:
    env = os.environ
    if int(env["GPUFLEET_POD_INDEX"]) > 0:
        timeout_s = float(env.get("GPUFLEET_RENDEZVOUS_TIMEOUT") or DEFAULT_TIMEOUT_S)
        host, port = env["GPUFLEET_MASTER_ADDR"], int(env["GPUFLEET_MASTER_PORT"])
        try:
            took = wait_for_port(host, port, timeout_s, lambda m: print(m, flush=True))
        except RendezvousTimeout as e:
            print(e, file=sys.stderr, flush=True)
            return RENDEZVOUS_EXIT
        print(f"the master pod {host}:{port} accepted after {took:.1f} s", flush=True)
    command = torchrun_argv(sys.executable, env, argv)
    os.execv(command[0], command)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
