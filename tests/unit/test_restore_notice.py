"""What a restored session tells its user came back: in words, never a snapshot's id."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpufleet.snapshotter.runner import Restored

TAKEN = datetime(2026, 11, 30, 14, 2, 31, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("sources", "back"),
    [
        (
            [{"name": "home", "path": "/srv/homes/alice", "kind": "dir"}],
            "your files",
        ),
        (
            [
                {"name": "home", "path": "/srv/homes/alice", "kind": "dir"},
                {"name": "upper", "path": "/var/lib/gpufleet/upper/7", "kind": "overlay"},
            ],
            "your files; the packages you installed and other system changes",
        ),
        (
            [
                {"name": "data", "path": "/mnt/node/vol-a", "kind": "dir"},
                {"name": "work", "path": "/mnt/node/vol-b", "kind": "dir"},
                {"name": "env-0", "path": "/opt/envs/demo", "kind": "prefix"},
            ],
            "your files; the environment /opt/envs/demo",
        ),
    ],
)
def test_the_notice_says_in_words_what_came_back(sources: list[dict[str, str]], back: str) -> None:
    restored = Restored("5f0c2a9e71d4b3c8", TAKEN, tuple(sources), 2.5)
    assert restored.notice() == (
        f"Stopped at 14:02 UTC on 30 Nov and restored from snapshot: {back}. "
        "Kernels were restarted."
    )
    assert "5f0c2a9e" not in restored.notice()
