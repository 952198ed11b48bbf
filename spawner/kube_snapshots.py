"""Snapshots of Kubernetes sessions, done on the session's node by its node agent.

A session pod's files are on its node: its hostPath volumes (``snapshot_volumes``: the
home, an environment prefix) and its container's layer. The hub cannot read them, and
the snapshot master key must never enter the user's pod, so every pass and restore is a
*node operation* (``state/operations.py``) that the gpufleet agent on that node
runs, holding the key as the platform does (``agent/operations.py``):

- start: once the scheduler chose the node, and before the pod exists, the agent restores
  what the latest snapshot holds of those volumes and is missing on that node (a session
  moved to another node, a node's disk wiped), with its progress on the spawn page; it
  makes a volume directory that is not there yet, owned by the session's user;
- stop: a pass over the volumes and the container's layer while the pod still runs (the
  layer goes with the container), then the pod is deleted (its termination grace lets
  the server save), then the final pass over the volumes, and only then the release. A
  final pass that fails keeps the GPUs and is retried, as on the local backend;
- the culler's live pass before it stops an idle session is the same operation.

What the container changed outside its volumes is captured, not put back: a new pod's
container starts from its image. Packages meant to survive a restart belong on a volume
(``pip install --user`` into the home, conda environments under it): docs/kubernetes.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tornado import web
from traitlets import Bool, Float, List, Unicode

from ..clusters.manifests import Volume
from ..snapshotter import runner as snapshots
from .client import ControllerClient
from .resume import SnapshotOptions, restore_progress, restoring_message


class KubeSnapshotMixin(SnapshotOptions):
    snapshot_volumes = List(
        Unicode(),
        help="Names of session_volumes (hostPath only) whose files are snapshotted when the "
        "session stops or is culled and restored where missing when it starts, by the "
        "gpufleet node agent of the session's node (docs/kubernetes.md). Empty: no "
        "snapshots.",
    ).tag(config=True)

    snapshot_container_layer = Bool(
        True,
        help="Also snapshot what the container changed outside its volumes (its overlay "
        "upper directory, read by the node agent) when the session stops or is culled.",
    ).tag(config=True)

    node_agent_claim_seconds = Float(
        30.0,
        help="How long a snapshot or restore waits for the node agent of the session's node "
        "to take it; then it fails (a start fails, a stop keeps the GPUs and retries).",
    ).tag(config=True)

    # Provided by the spawner this is mixed into (before GPUQueueSpawner, whose
    # ``_final_snapshot`` this one overrides).
    if TYPE_CHECKING:
        controller: ControllerClient
        workload_id: int | None
        _uid: int
        _gid: int

        def _volumes(self) -> list[Volume]: ...

        def _report(self, message: str, percent: int) -> None: ...

    def snapshot_paths(self) -> list[str]:
        """The node's paths of the volumes ``snapshot_volumes`` names (the server's own,
        templates expanded)."""
        if not self.snapshot_volumes:
            return []
        volumes = {v.name: v for v in self._volumes()}
        paths = []
        for name in self.snapshot_volumes:
            volume = volumes.get(name)
            if volume is None:
                raise web.HTTPError(
                    500,
                    f"c.KubeGPUSpawner.snapshot_volumes names {name!r}, which is not in "
                    "c.KubeGPUSpawner.session_volumes",
                )
            if volume.kind != "hostPath":
                raise web.HTTPError(
                    500,
                    f"c.KubeGPUSpawner.snapshot_volumes: volume {name!r} is a {volume.kind} "
                    "volume; only hostPath volumes (the node's own disk) are snapshotted by "
                    "the node agent",
                )
            paths.append(volume.source.rstrip("/") or "/")
        return paths

    def snapshot_sources(self) -> dict[str, Any]:
        """What the culler's live pass asks the node agent for (``POST .../running``)."""
        return {
            "paths": self.snapshot_paths(),
            "exclude": list(self.snapshot_excludes),
            "on_node": True,
            "container": bool(self.snapshot_container_layer),
        }

    async def _on_node(
        self, body: dict[str, Any], what: str, on_progress: snapshots.Progress | None = None
    ) -> dict[str, Any]:
        workload_id = self.workload_id
        assert workload_id is not None
        controller = self.controller
        return await snapshots.on_node(
            lambda: controller.request_node_operation(workload_id, body),
            controller.node_operation,
            controller.abandon_node_operation,
            what=what,
            claim_within=self.node_agent_claim_seconds,
            on_progress=on_progress,
        )

    async def _restore_on_node(self) -> str:
        """Restore what is missing on the chosen node before the pod is made; what the user
        should read about it ("" when nothing was missing)."""
        paths = self.snapshot_paths()
        if not paths:
            return ""
        self._report("Looking for your last snapshot", 28)
        try:
            result = await self._on_node(
                {"kind": "restore", "paths": paths, "owner": [self._uid, self._gid]},
                "restore",
                lambda line: self._report(*restore_progress(line)),
            )
        except snapshots.SnapshotFailed as e:
            # A session that cannot get its snapshot back must not start without it: the
            # user would take an empty home for lost work.
            raise web.HTTPError(503, f"could not restore your last snapshot: {e}") from e
        restored = result.get("restored") or []
        if restored:
            self._report(restoring_message(restored) + ": done", 55)
        return str(result.get("notice", ""))

    async def _pass_on_node(self, tag: str, container: bool) -> dict[str, Any]:
        return await self._on_node(
            {
                "kind": "snapshot",
                "paths": self.snapshot_paths(),
                "exclude": list(self.snapshot_excludes),
                "container": container and bool(self.snapshot_container_layer),
                "tags": [tag],
            },
            f"{tag} snapshot",
        )

    async def _final_snapshot(self) -> str:
        result = await self._pass_on_node("final", container=False)
        if result.get("skipped"):
            return f"no final snapshot: {result['skipped']}"
        return f"final snapshot {result.get('id')} on the node"
