"""Snapshots around a session's life: the final pass at stop, the restore at start.

At stop, once every process of the session is gone, the spawner takes a final
incremental snapshot (the culler took a live one while the server ran; this one adds what
changed since) and only then releases the GPUs. A final pass that fails is retried; the
GPUs stay with the session meanwhile, so nothing unsaved is lost to a waiting workload.
After a committed snapshot the session's overlay upper directory may be freed
(``free_upper_after_snapshot``): the snapshot holds it.

At start, before the notebook server runs, whatever the latest snapshot holds that is
missing here (an emptied upper directory, a home on a fresh node, an environment prefix
gone) is restored, with its progress on the spawn page; the user is told what came back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

from prometheus_client import Histogram
from traitlets import Bool, Float, Integer, List, Unicode, default
from traitlets.config import LoggingConfigurable

from ..snapshotter import runner as snapshots
from ..snapshotter.envspec import home_excludes
from ..snapshotter.settings import RenamedSnapshotOptions, StoreAccess, renamed_help

# In the hub's own registry: JupyterHub serves it at /hub/metrics.
_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
FINAL_SNAPSHOT_SECONDS = Histogram(
    "gpufleet_session_final_snapshot_seconds",
    "Duration of the final snapshot pass when a session stops",
    buckets=_BUCKETS,
)
RESTORE_SECONDS = Histogram(
    "gpufleet_session_restore_seconds",
    "Duration of restoring a session's snapshot before its server starts",
    buckets=_BUCKETS,
)


class SnapshotOptions(LoggingConfigurable):
    """What every backend's snapshots share: what is left out, how a failed final pass is
    retried."""

    snapshot_excludes = List(
        Unicode(),
        help="Patterns left out of a home's snapshot (caches). Default: pip, conda, "
        "Hugging Face and torch caches, npm's cache, the trash.",
    ).tag(config=True)

    @default("snapshot_excludes")
    def _default_snapshot_excludes(self) -> list[str]:
        return list(home_excludes())

    final_snapshot_retry_seconds = Float(
        60.0, help="Seconds between background retries of a failed final snapshot."
    ).tag(config=True)


class SnapshottingMixin(SnapshotOptions, RenamedSnapshotOptions):
    snapshots_enabled = Bool(
        True,
        help="Snapshot a session's home, its container changes and its environments when it "
        "stops, and restore what is missing when it starts (docs/culler.md).",
    ).tag(config=True)

    # Where snapshots go: c.SnapshotSettings (snapshotter/settings.py), which the
    # controller and the node agents read too. The earlier c.LocalGPUSpawner.snapshot_*
    # names come with RenamedSnapshotOptions, and this one:
    snapshot_cache_dir = Unicode(None, allow_none=True, help=renamed_help("cache_dir")).tag(
        config=True
    )

    free_upper_after_snapshot = Bool(
        True,
        help="Empty the session's overlay upper directory once the final snapshot holds it "
        "(it is restored at the next start): frees the node's disk.",
    ).tag(config=True)

    final_snapshot_attempts = Integer(
        3, help="Tries of the final snapshot at stop before it is retried in the background."
    ).tag(config=True)

    # Provided by the spawner this is mixed into.
    sandbox_upper: str
    sandbox_mode: str

    def snapshot_access(self) -> StoreAccess:
        """Where this session's final passes and restores go: c.SnapshotSettings, under
        the deployment's data directory."""
        return self.snapshot_settings().access(_data_dir())

    def snapshot_sources(self, home: str) -> snapshots.Sources:
        """What this local session's snapshots hold (``runner.local_sources``)."""
        return snapshots.local_sources(home, self.sandbox_upper, self.snapshot_excludes)

    async def final_snapshot(
        self, project: str, user: str, server: str, sources: snapshots.Sources
    ) -> dict[str, Any]:
        """The final pass, tried ``final_snapshot_attempts`` times; raises the last
        failure. Frees the upper directory once the snapshot is committed."""
        settings = self.snapshot_access()
        failure: snapshots.SnapshotFailed | None = None
        for attempt in range(self.final_snapshot_attempts):
            started = time.monotonic()
            try:
                result = await snapshots.create(
                    settings, project, user, server, sources, tags=["final"]
                )
            except snapshots.SnapshotFailed as e:
                failure = e
                self.log.warning(
                    "final snapshot of %s/%s failed (try %d): %s", user, server, attempt + 1, e
                )
                await asyncio.sleep(min(2.0 * (attempt + 1), 10.0))
                continue
            FINAL_SNAPSHOT_SECONDS.observe(time.monotonic() - started)
            if self.free_upper_after_snapshot:
                for upper in sources.overlays:
                    await asyncio.to_thread(_empty, Path(upper.partition(":")[0]))
            return result
        assert failure is not None
        raise failure

    async def restore_missing(self, project: str, user: str, server: str, report: Any) -> str:
        """Restore what the latest snapshot holds and is missing here; what the user should
        read about it ("" when nothing was restored)."""
        restored = await snapshots.restore_missing(
            self.snapshot_access(),
            project,
            user,
            server,
            announce=lambda missing: report(restoring_message(missing), 30),
            on_progress=lambda line: report(*restore_progress(line)),
        )
        if restored is None:
            return ""
        RESTORE_SECONDS.observe(restored.seconds)
        self.log.info(
            "restored snapshot %s of %s/%s (%s) in %.1f s",
            restored.snapshot_id,
            user,
            server,
            ", ".join(s["name"] for s in restored.sources),
            restored.seconds,
        )
        return restored.notice()


def restoring_message(missing: Any) -> str:
    return f"Restoring your last snapshot ({', '.join(snapshots.source_label(s) for s in missing)})"


def restore_progress(line: dict[str, Any]) -> tuple[str, int]:
    """A restore's progress line as the spawn page shows it (30-55 %)."""
    total, done = line.get("total") or 0, line.get("done") or 0
    share = f"{done / total:.0%}" if total else line.get("phase", "")
    return f"Restoring your last snapshot: {share}", 30 + int(25 * done / total) if total else 30


def _empty(directory: Path) -> None:
    """Remove what a directory holds, keeping the directory (its owner and mode)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def _data_dir() -> str:
    return os.environ.get("GPUFLEET_DATA_DIR") or os.path.abspath(".gpufleet")
