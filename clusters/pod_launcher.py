"""The first process of a training job's pod on Kubernetes: wait for the master, then torchrun.

It runs inside the researcher's pod, with the job's own interpreter, so it uses the
standard library alone and never imports gpufleet: the cluster manager puts this file's
text into a ConfigMap the pods mount beside the script (``clusters/job_manifests.py``).

Why wait at all: a pod's stable name (``p0.<service>``) resolves as soon as the master pod
has an address, seconds before its torchrun listens; torchrun's workers that connect too
early give up in a rendezvous time-out, the most frequent complaint of JobSet and Kubeflow
users. So every pod but the master waits for the master's **port** to accept a connection,
asking again every ``POLL_S``, until ``GPUFLEET_RENDEZVOUS_TIMEOUT`` seconds have passed.
A probe is a bare connect and close, which torch's TCPStore server ignores. Then it runs::

    <python> -m torch.distributed.run --nnodes=<pods> --node-rank=<pod index>
        --nproc-per-node=<gpus per pod> --master-addr=<addr> --master-port=<port>
        --tee=3 <script> <args...>

A job of one pod replaces itself with it (``exec``; ``--nnodes=1 --standalone`` in place
of the rank and the master): there is nothing of it to keep across attempts.

A pod of a gang of several **supervises** its torchrun instead, so that a restart after
another pod's loss keeps it (docs/kubernetes.md, "What a restart keeps"). Which attempt it
runs, under which process marker, with which master and from which checkpoint is the
file ``assignment`` beside it: the pod's annotation ``gpufleet.io/assignment``, which the
kubelet's downward API brings up to date when the cluster manager changes it. So:

- a newer attempt in the file while torchrun runs: torchrun gets SIGTERM (its ranks' checkpoint
  signal), then SIGKILL after ``STOP_WAIT_S``, to it and to every process that carries the
  attempt's marker (its ranks), and the new attempt's torchrun starts once they are gone;
- torchrun exits with 0: so does the pod (the job succeeded);
- torchrun fails: the pod waits up to ``GPUFLEET_KEEP_WAIT_S`` for a newer attempt (its
  gang lost a pod, and the controller keeps this one), and otherwise ends with torchrun's
  status, which the controller reads as the attempt's end;
- SIGTERM to the pod (a cancel, a preemption, a whole restart): passed on to torchrun, and
  the pod ends with it.

Its torchrun is ``torch.distributed.run``'s ``main`` in a fork of the launcher, which
imported torch once, in the background, while it waited for the master
(:class:`PreloadedTorchrun`): a kept pod's next attempt does not import torch again.

A master that never listens ends the pod with exit status ``RENDEZVOUS_EXIT`` and a last
line on stderr naming what it waited for and how long, which becomes the job's reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

POLL_S = 0.2
SAY_EVERY_S = 10.0
RENDEZVOUS_EXIT = 3
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_KEEP_WAIT_S = 30.0
STOP_WAIT_S = 10.0  # from torchrun's SIGTERM to the SIGKILL of it and its ranks
ASSIGNMENT_FILE = "assignment"
MARKER_VARIABLE = "GPUFLEET_SESSION_MARKER"  # recovery/processes.py's: how ranks are found


class Child(Protocol):
    """A running torchrun (``subprocess.Popen`` or :class:`Forked`)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self) -> int: ...
    def send_signal(self, signum: int) -> None: ...


class RendezvousTimeout(Exception):
    """The master's port did not accept a connection within the deadline."""


class Superseded(Exception):
    """A newer attempt was assigned while this one waited."""


@dataclass(frozen=True)
class Assignment:
    """The attempt this pod runs, and what its torchrun needs of it."""

    attempt: int
    marker: str
    master_addr: str
    master_port: int
    resume_from: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Assignment:
        return cls(
            attempt=int(env.get("GPUFLEET_ATTEMPT") or 1),
            marker=env.get(MARKER_VARIABLE, ""),
            master_addr=env.get("GPUFLEET_MASTER_ADDR", ""),
            master_port=int(env.get("GPUFLEET_MASTER_PORT") or 0),
            resume_from=env.get("GPUFLEET_RESUME_FROM", ""),
        )

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` as the attempt's ranks see it."""
        return {
            **env,
            "GPUFLEET_ATTEMPT": str(self.attempt),
            MARKER_VARIABLE: self.marker,
            "GPUFLEET_MASTER_ADDR": self.master_addr,
            "GPUFLEET_MASTER_PORT": str(self.master_port),
            "GPUFLEET_RESUME_FROM": self.resume_from,
        }


def read_assignment(path: Path, before: Assignment) -> Assignment:
    """The assignment in ``path`` if it names a later attempt than ``before``; else
    ``before`` (a missing, half-written or older file changes nothing)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        found = Assignment(
            attempt=int(data["attempt"]),
            marker=str(data["marker"]),
            master_addr=str(data["master_addr"]),
            master_port=int(data["master_port"]),
            resume_from=str(data.get("resume_from") or ""),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return before
    return found if found.attempt > before.attempt else before


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
    superseded: Callable[[], bool] = lambda: False,
) -> float:
    """Return once ``host:port`` accepts a connection (the seconds it took), saying every
    ``SAY_EVERY_S`` that it still waits; raise :class:`RendezvousTimeout` after
    ``timeout_s``, :class:`Superseded` as soon as ``superseded()``."""
    start = clock()
    said = start
    while True:
        if accepts(host, port):
            return clock() - start
        if superseded():
            raise Superseded()
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


class Supervisor:
    """A gang pod's torchrun, attempt after attempt (see the module docstring). The
    process calls are parameters, for the tests."""

    def __init__(
        self,
        env: Mapping[str, str],
        args: Sequence[str],
        assignment_path: Path,
        *,
        start: Callable[[list[str], dict[str, str]], Child] | None = None,
        accepts: Callable[[str, int], bool] = _accepts,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
        say: Callable[[str], None] = lambda m: print(m, flush=True),
        kill_marked: Callable[[str], None] | None = None,
    ):
        self.env = env
        self.args = args
        self.path = assignment_path
        self.start = start or _start_torchrun
        self.accepts = accepts
        self.clock = clock
        self.pause = pause
        self.say = say
        self.keep_wait_s = float(env.get("GPUFLEET_KEEP_WAIT_S") or DEFAULT_KEEP_WAIT_S)
        self.timeout_s = float(env.get("GPUFLEET_RENDEZVOUS_TIMEOUT") or DEFAULT_TIMEOUT_S)
        self.current = read_assignment(assignment_path, Assignment.from_env(env))
        # The pod itself was told to stop (a cancel, a preemption, a whole restart): the
        # signal handler only notes it; the loops pass it on to the torchrun running then.
        self.stopping = False
        self.stop_signal = signal.SIGTERM
        self.child: Child | None = None
        self.kill_marked = kill_marked or _kill_marked

    def newer(self) -> Assignment | None:
        found = read_assignment(self.path, self.current)
        return found if found is not self.current else None

    def stop(self, signum: int) -> None:
        """The pod's SIGTERM or SIGINT (a signal handler: it only notes it). Passed on
        to the torchrun that runs; no attempt follows."""
        self.stop_signal = signal.Signals(signum)
        self.stopping = True

    def run(self) -> int:
        while True:
            status = self._attempt(self.current)
            if status is None:  # superseded: the newer attempt is now current
                continue
            if status == 0 or self.stopping:
                return status
            deadline = self.clock() + self.keep_wait_s
            while self.clock() < deadline and not self.stopping:
                newer = self.newer()
                if newer is not None:
                    self.say(
                        f"gpufleet: attempt {self.current.attempt} ended with status "
                        f"{status}; this pod is kept for attempt {newer.attempt}"
                    )
                    self.current = newer
                    break
                self.pause(POLL_S)
            else:
                return status

    def _attempt(self, assignment: Assignment) -> int | None:
        """Run one attempt's torchrun: its exit status, or None when a newer attempt
        superseded it (``self.current`` is then that one)."""
        index = int(self.env["GPUFLEET_POD_INDEX"])
        host, port = assignment.master_addr, assignment.master_port
        if index > 0:
            try:
                took = wait_for_port(
                    host,
                    port,
                    self.timeout_s,
                    self.say,
                    self.accepts,
                    self.clock,
                    self.pause,
                    superseded=lambda: self.newer() is not None or self.stopping,
                )
            except RendezvousTimeout as e:
                print(e, file=sys.stderr, flush=True)
                return RENDEZVOUS_EXIT
            except Superseded:
                return self._superseded(None)
            self.say(f"the master pod {host}:{port} accepted after {took:.1f} s")
        if self.stopping:
            return 128 + signal.SIGTERM
        env = assignment.environment(self.env)
        self.child = child = self.start(torchrun_argv(sys.executable, env, self.args), env)
        passed_on = False
        while (status := child.poll()) is None:
            if self.stopping and not passed_on:
                child.send_signal(self.stop_signal)
                passed_on = True
            elif not self.stopping and self.newer() is not None:
                return self._superseded(child)
            self.pause(POLL_S)
        return status if status >= 0 else 128 - status

    def _superseded(self, child: Child | None) -> int | None:
        """Stop what runs of the current attempt, its ranks included, before the newer
        one becomes current: the next torchrun gets the pod's GPUs to itself."""
        newer = self.newer()
        if child is not None:
            child.send_signal(signal.SIGTERM)  # torchrun passes it to the ranks
            deadline = self.clock() + STOP_WAIT_S
            while child.poll() is None and self.clock() < deadline:
                self.pause(POLL_S)
            # torchrun starts each rank in a session of its own: they are found by the
            # attempt's marker, which they carry, as the node agent finds them.
            if child.poll() is None:
                _kill_group(child)
            self.kill_marked(self.current.marker)
            child.wait()
        if newer is None or self.stopping:
            return 128 + signal.SIGTERM
        self.say(f"gpufleet: attempt {newer.attempt} begins; this pod is kept for it")
        self.current = newer
        return None


def _start_torchrun(argv: list[str], env: dict[str, str]) -> Child:
    # A group of its own, as the forked one's: killed whole when superseded (its ranks,
    # each in a session of its own, by the attempt's marker).
    return subprocess.Popen(argv, env=env, start_new_session=True)


class Forked:
    """A forked child, as ``subprocess.Popen`` shows one."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _load_torchrun() -> Callable[[list[str]], object] | None:
    try:
        from torch.distributed.run import main as torchrun  # the job's own torch

        return torchrun
    except Exception:  # noqa: BLE001 - no torch here: torchrun as a command says why
        return None


class PreloadedTorchrun:
    """torchrun started in a fork of the launcher, which imported torch once, in the
    background, while it waited: a kept pod's next attempt does not import it again (on
    a busy node that is seconds), and a new pod imports it while it waits for the master.
    Without torch to import, torchrun is started as a command, which says why it fails."""

    def __init__(self, load: Callable[[], Callable[[list[str]], object] | None] = _load_torchrun):
        self.torchrun: Callable[[list[str]], object] | None = None
        self._loading = threading.Thread(target=self._load, args=(load,), daemon=True)
        self._loading.start()

    def _load(self, load: Callable[[], Callable[[list[str]], object] | None]) -> None:
        self.torchrun = load()

    def __call__(self, argv: list[str], env: dict[str, str]) -> Child:
        self._loading.join()  # no fork while another thread imports
        if self.torchrun is None:
            return _start_torchrun(argv, env)
        sys.stdout.flush()
        sys.stderr.flush()
        # Held until the child has reset the launcher's handlers, which it inherits: a stop
        # sent at once is then the default's, which ends it.
        stops = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        pid = os.fork()
        if pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            return Forked(pid)
        os._exit(self._child(argv[3:], env))  # argv: python -m torch.distributed.run ...

    def _child(self, args: list[str], env: dict[str, str]) -> int:
        status = 1
        try:
            os.setsid()  # a group of its own, as _start_torchrun's
            stops = {signal.SIGTERM, signal.SIGINT}
            for signum in stops:  # the launcher's handlers are not its own
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["torchrun", *args]
            assert self.torchrun is not None
            self.torchrun(args)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:  # noqa: BLE001 - said as torchrun says it, then its status
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return status


def _kill_marked(marker: str, proc: Path = Path("/proc"), wait_s: float = 5.0) -> None:
    """SIGKILL every process of this pod's user but the launcher that carries ``marker``
    in its environment (an attempt's ranks), and wait until none is left."""
    if not marker:
        return
    wanted = f"{MARKER_VARIABLE}={marker}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not found or time.monotonic() >= deadline:
            return
        time.sleep(POLL_S)


def _kill_group(child: Child) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.killpg(child.pid, signal.SIGKILL)


def main(argv: Sequence[str]) -> int:
    env = os.environ
    if int(env["GPUFLEET_PODS"]) == 1:
        command = torchrun_argv(sys.executable, env, argv)
        os.execv(command[0], command)
    # Beside the script, not resolved: the kubelet swaps the volume's files by a link.
    launch_dir = Path(env["GPUFLEET_SCRIPT"]).parent
    supervisor = Supervisor(env, argv, launch_dir / ASSIGNMENT_FILE, start=PreloadedTorchrun())
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _frame: supervisor.stop(s))
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
