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
its image (``baseline.py``), environment prefixes (``envspec.py``). Docs:
docs/snapshots.md.
"""
