"""The snapshotter: snapshot format, capture, restore, S3 and local stores, retention.

A project's repository (``repository.py``) holds encrypted packs of content-defined chunks
(``crypto.py``, ``pack.py``), an index of where each blob lives (``index.py``), one tree
blob per directory (``tree.py``) and a manifest per snapshot, written last
(``manifest.py``). ``capture.py`` takes a snapshot, skipping what the stat cache vouches
for (``statcache.py``); ``restore.py`` puts one back, its stat cache primed
(``primed.py``). Stores are an object-store protocol (``objects.py``) with a local
directory and S3 behind it (``store.py``, ``s3.py``). ``retention.py`` decides which
snapshots to keep and ``gc.py`` collects, checks and repairs. Sources: the local
backend's overlay sandbox (``sandbox.py``, ``overlay.py``), a container's changes against
its image (``baseline.py``) or its overlay layer (``node_operations.py``), environment
prefixes (``envspec.py``).

Around them, what the rest of gpufleet calls: ``settings.py``, where snapshots go, declared
once (``c.SnapshotSettings``); ``runner.py``, a session's passes and restores run as
``gpufleet snapshot`` processes (the culler, the spawners and the node agent use it);
``node_operations.py``, what a node agent runs for a Kubernetes session; ``listing.py``,
the controller's index of snapshots (a scan of the store, what the pages list). This
package imports nothing of gpufleet but ``api``. Docs: docs/snapshots.md.
"""
