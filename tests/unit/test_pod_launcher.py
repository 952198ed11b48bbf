"""The job pods' launcher (``clusters/pod_launcher.py``): it waits for the master's port,
not its name, with a deadline and words that say what it waited for."""

from __future__ import annotations

import socket
import threading

import pytest

from gpufleet.clusters.pod_launcher import RendezvousTimeout, torchrun_argv, wait_for_port


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_it_returns_once_the_port_accepts() -> None:
    clock = Clock()
    answers = iter([False] * 60 + [True])
    said: list[str] = []
    took = wait_for_port(
        "p0.job", 29500, 600, said.append, lambda h, p: next(answers), clock, clock.pause
    )
    assert took == pytest.approx(12.0)
    assert said == ["waiting for the master pod p0.job:29500 (10 s)"]


def test_it_gives_up_at_its_deadline_naming_what_it_waited_for() -> None:
    clock = Clock()
    with pytest.raises(
        RendezvousTimeout,
        match=r"waited 30 s for the master pod p0.job to accept connections on port 29500",
    ):
        wait_for_port("p0.job", 29500, 30, lambda m: None, lambda h, p: False, clock, clock.pause)


def test_a_real_listener_that_appears_late_is_found() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ready = threading.Event()

    def listen_after_the_first_probe() -> None:
        ready.wait(10)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    said: list[str] = []

    def accepts(host: str, p: int) -> bool:
        from gpufleet.clusters.pod_launcher import _accepts

        ok = _accepts(host, p)
        ready.set()  # the first probe was refused: now the master starts listening
        return ok

    thread = threading.Thread(target=listen_after_the_first_probe)
    thread.start()
    try:
        assert wait_for_port("127.0.0.1", port, 30, said.append, accepts) < 30
    finally:
        thread.join()
        listener.close()


def test_torchrun_gets_the_pods_place_in_the_gang() -> None:
    env = {
        "GPUFLEET_PODS": "4",
        "GPUFLEET_POD_INDEX": "3",
        "GPUFLEET_GPUS_PER_POD": "2",
        "GPUFLEET_MASTER_ADDR": "p0.gf-job-1-a1.ns.svc.cluster.local",
        "GPUFLEET_MASTER_PORT": "29500",
        "GPUFLEET_SCRIPT": "/var/run/gpufleet/job/train.py",
    }
    assert torchrun_argv("/usr/bin/python3", env, ["--lr", "0.1"]) == [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=4",
        "--node-rank=3",
        "--nproc-per-node=2",
        "--master-addr=p0.gf-job-1-a1.ns.svc.cluster.local",
        "--master-port=29500",
        "--tee=3",
        "/var/run/gpufleet/job/train.py",
        "--lr",
        "0.1",
    ]


def test_a_job_of_one_pod_rendezvouses_with_itself() -> None:
    env = {
        "GPUFLEET_PODS": "1",
        "GPUFLEET_POD_INDEX": "0",
        "GPUFLEET_GPUS_PER_POD": "4",
        "GPUFLEET_MASTER_ADDR": "localhost",
        "GPUFLEET_MASTER_PORT": "29500",
        "GPUFLEET_SCRIPT": "/var/run/gpufleet/job/train.py",
    }
    assert torchrun_argv("/usr/bin/python3", env, []) == [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--standalone",
        "--nproc-per-node=4",
        "--tee=3",
        "/var/run/gpufleet/job/train.py",
    ]
