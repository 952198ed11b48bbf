"""Where a job's checkpoints may be, and which checkpoints are its own. Pure.

A job names its checkpoint location at submit (``checkpoint_uri``; the controller's
``job_checkpoint_store`` by default): a local directory or an ``s3://bucket/prefix``. A
local one must lie in one of the places its user may write (their home, their directory
under the node's checkpoint root): the node agent runs as root and binds it into the ranks'
sandbox, so a location elsewhere (``/etc``, another user's home) is refused at submit and
again on the node. Its ranks later report checkpoints they saved; only one inside the
location counts (:func:`within`), so no rank makes a job resume from what is not its own.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable


def filled(template: str, user: str, job: str, job_id: int) -> str:
    """An admin's checkpoint store template (``c.FleetController.job_checkpoint_store``)
    for one job: ``{user}``, ``{job}`` (its name) and ``{id}`` replaced, nothing else read
    into it (a submission's own location is taken as it is written)."""
    return template.replace("{user}", user).replace("{job}", job).replace("{id}", str(job_id))


def location_problem(uri: str, places: Iterable[str]) -> str | None:
    """What is wrong with checkpoint location ``uri`` for a user whose local checkpoints
    may go under ``places`` (absolute directories); None when nothing is."""
    if "\0" in uri or any(ord(c) < 32 for c in uri):
        return "checkpoint_uri holds a control character"
    if uri.startswith("s3://"):
        bucket, _, key = uri[5:].partition("/")
        if not bucket or any(part in (".", "..") for part in key.split("/") if key):
            return f"checkpoint_uri {uri!r} must be s3://<bucket>/<prefix> without . or .. parts"
        return None
    if "://" in uri:
        return f"checkpoint_uri {uri!r}: only s3:// locations and local directories are taken"
    if not uri.startswith("/") or ".." in uri.split("/"):
        return f"checkpoint_uri {uri!r} must be an absolute path without .. parts"
    allowed = [posixpath.normpath(p) for p in places]
    if not any(_inside(posixpath.normpath(uri), place) for place in allowed):
        return f"checkpoint_uri {uri} must be in {' or '.join(allowed) or 'an S3 bucket'}"
    return None


def within(uri: str, location: str) -> bool:
    """Whether checkpoint ``uri`` lies inside a job's checkpoint ``location`` (an
    absolute directory or an ``s3://bucket/prefix``), so an attempt may resume from it.
    Compared as written, ``..`` resolved."""
    if not uri or not location or "\0" in uri:
        return False
    if location.startswith("s3://"):
        if not uri.startswith("s3://"):
            return False
        bucket, _, key = uri[5:].partition("/")
        where, _, prefix = location[5:].partition("/")
        if bucket != where or any(part in (".", "..") for part in key.split("/")):
            return False
        prefix = prefix.rstrip("/")
        return not prefix or key == prefix or key.startswith(prefix + "/")
    if not (uri.startswith("/") and location.startswith("/")):
        return False
    return _inside(posixpath.normpath(uri), posixpath.normpath(location))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
