from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Hub


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One real hub for the whole session: starting one costs several seconds."""
    instance = Hub.create(Path(tmp_path_factory.mktemp("hub")))
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


@pytest.fixture
def fleet(hub: Hub) -> Iterator[Hub]:
    """The shared hub, with every server stopped and every workload ended afterwards."""
    yield hub
    if hub.proc is None:
        hub.start()
    hub.stop_all_servers()
