"""Where the node agent listens for its ranks' progress: the same port across its restarts
(the ranks it left running know that URL), and, as root, a privileged one, which no
researcher's process can take while the agent is away."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from gpufleet.agent.progress import PRIVILEGED_PORTS, bind_progress

LOG = logging.getLogger("test")


def port_of(sockets: list[socket.socket]) -> int:
    port: int = sockets[0].getsockname()[1]
    for sock in sockets:
        sock.close()
    return port


def test_a_restarted_agent_listens_where_the_one_before_did(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sockets, url = bind_progress(tmp_path, "127.0.0.1", 0, LOG)
    first = port_of(sockets)
    assert url == f"http://127.0.0.1:{first}/progress"
    if os.geteuid() == 0:
        assert first in PRIVILEGED_PORTS  # no researcher's process may bind it
    assert port_of(bind_progress(tmp_path, "127.0.0.1", 0, LOG)[0]) == first

    with socket.create_server(("127.0.0.1", first)):  # taken meanwhile
        again = port_of(bind_progress(tmp_path, "127.0.0.1", 0, LOG)[0])
    assert again != first
    assert f"the progress port of the agent before ({first}) cannot be had again" in caplog.text
    assert (tmp_path / "progress-port").read_text() == f"{again}\n"


def test_a_configured_port_is_that_port_and_minus_one_is_none(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert port_of(bind_progress(tmp_path, "127.0.0.1", free, LOG)[0]) == free
    assert bind_progress(tmp_path, "127.0.0.1", -1, LOG) == ([], "")
    assert not (tmp_path / "progress-port").exists()
