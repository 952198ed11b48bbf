"""Read an overlayfs upper directory as the list of changes it makes to the layers below.

A container's (or a sandboxed session's) filesystem changes live in the upper directory of an
overlay mount. This module turns that directory into :class:`Change` values the capture consumes:

- ``PRESENT``: the path exists in the merged view and must be captured (its content and metadata);
- ``DELETED``: a whiteout: the path, a file or a whole directory tree, is gone from the merged view;
- ``OPAQUE``: a directory that exists and hides everything the lower layers had under it; its
  present children are listed as ``PRESENT`` too.

How the kernel records changes (Documentation/filesystems/overlayfs.rst), and what we make of it:

- **whiteout**: a character device 0/0, or a zero-size regular file with the ``overlay.whiteout``
  xattr ("xwhiteout"). The kernel honours an xwhiteout only in a directory marked
  ``overlay.opaque=x`` (which does *not* make it opaque; it says "may hold xwhiteouts") in a
  layer whose root is marked the same way, and only in lower layers; such a tree is one composed
  to be stacked (a restored snapshot reused as a layer). We follow the on-disk rule: root and
  parent marked ``x``, then an xwhiteout is ``DELETED``; otherwise it is an ordinary empty file.
- **opaque directory**: ``overlay.opaque=y``: ``OPAQUE``. The kernel marks every directory that
  is created inside a merged directory opaque (so a later lower layer cannot leak into it), so
  new directories usually come out ``OPAQUE``; that is exact, not noise.
- **renamed directory** (``redirect_dir=on``): the upper directory carries ``overlay.redirect``
  naming where its content lives in the lower layers, and the upper holds only what changed
  under it since. We report it as ``OPAQUE`` and then list its *whole* merged content as
  ``PRESENT`` (read from ``merged``): relative to the lower layers, everything at the new path
  is new, and an ``OPAQUE`` directory whose children are all listed is complete without the
  lower. The old path is gone: the kernel leaves a whiteout there, reported as ``DELETED`` in
  its own right (we do not derive it from the redirect, which may also point at a path that a
  later rename or delete already whited out).
- **metadata-only copy-up** (``metacopy=on``): a regular file with ``overlay.metacopy`` has the
  new metadata in the upper but its data still in a lower layer. It is ``PRESENT`` and its data
  must be read through ``merged``.

The capture reads every ``PRESENT`` path through ``merged`` when one is given (it is the truth
about content), and through ``upper`` otherwise. :func:`read_upper` therefore insists on
``merged`` as soon as it meets a redirect or a metacopy file, and raises :class:`CaptureError`
saying so when ``merged`` is None. An upper written with ``redirect_dir=off,metacopy=off`` (the
sandbox in :mod:`.sandbox` mounts with those) is self-contained and readable after its mount
is gone.

The overlay's own xattrs (``trusted.overlay.*``, and ``user.overlay.*`` used by ``userxattr``
mounts in user namespaces) are bookkeeping, not part of a file: :func:`is_overlay_xattr` and
:func:`merged_xattr_name` tell the capture which xattrs to skip when it reads them from the
upper (through ``merged`` the kernel hides them itself). Limitation: on a ``trusted`` mount a
real ``user.overlay.*`` xattr set by a user is indistinguishable from the ``userxattr``
bookkeeping and is skipped too.

The pure part, :func:`classify`, decides what one entry is from ``(mode, rdev, size, xattrs)``;
the walk (:func:`read_upper`) only lists directories, reads xattrs and follows the decisions.
"""

from __future__ import annotations

import enum
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import CaptureError

__all__ = [
    "OVERLAY_XATTR_PREFIXES",
    "Change",
    "ChangeKind",
    "EntryKind",
    "classify",
    "is_overlay_xattr",
    "marks_xwhiteouts",
    "merged_xattr_name",
    "read_upper",
]

OVERLAY_XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
"""Namespaces the overlay keeps its bookkeeping in (``trusted``, or ``user`` with userxattr)."""

# The kernel escapes a file's own overlay.* xattrs as overlay.overlay.* (nested overlays).
_ESCAPE = "overlay."


class ChangeKind(enum.StrEnum):
    """What a path's entry in the upper directory means for the merged view."""

    PRESENT = "present"
    DELETED = "deleted"
    OPAQUE = "opaque"


@dataclass(frozen=True)
class Change:
    """One path changed by the upper layer.

    Invariants: ``path`` is relative to the container root, ``/``-separated, with no leading
    ``/`` and never empty (the root itself is never reported). ``OPAQUE`` is always a directory
    that exists in the merged view.
    """

    path: str
    kind: ChangeKind


class EntryKind(enum.Enum):
    """What one entry of an upper directory is, as :func:`classify` decides it."""

    WHITEOUT = "whiteout"  # DELETED
    OPAQUE_DIR = "opaque-dir"  # OPAQUE; its upper children are all there is
    MERGE_DIR = "dir"  # PRESENT; a new or copied-up directory merged with the lower's
    REDIRECT_DIR = "redirect-dir"  # OPAQUE; content read in full from the merged view
    METACOPY = "metacopy"  # PRESENT; data lives in a lower layer: read through merged
    PLAIN = "plain"  # PRESENT; a file, symlink or special file whole in the upper


def _overlay_attr(xattrs: Mapping[str, bytes], key: str) -> bytes | None:
    for prefix in OVERLAY_XATTR_PREFIXES:
        value = xattrs.get(prefix + key)
        if value is not None:
            return value
    return None


def marks_xwhiteouts(xattrs: Mapping[str, bytes]) -> bool:
    """Whether a directory with these xattrs is marked to hold xwhiteouts (``opaque=x``)."""
    return _overlay_attr(xattrs, "opaque") == b"x"


def classify(
    mode: int, rdev: int, size: int, xattrs: Mapping[str, bytes], *, xwhiteouts: bool = False
) -> EntryKind:
    """What an upper-directory entry is, from its ``lstat`` fields and its xattrs.

    ``xattrs`` may hold every xattr of the entry or only the overlay ones; values are the raw
    bytes. ``xwhiteouts`` is True when the layer root and the entry's parent directory are both
    marked ``opaque=x`` (see the module docstring); only then is a zero-size regular file with
    ``overlay.whiteout`` a whiteout. Pure: no I/O.
    """
    if stat.S_ISCHR(mode) and rdev == 0:
        return EntryKind.WHITEOUT
    if stat.S_ISDIR(mode):
        if _overlay_attr(xattrs, "opaque") == b"y":
            return EntryKind.OPAQUE_DIR  # the kernel stops at an opaque dir; a redirect is moot
        if _overlay_attr(xattrs, "redirect") is not None:
            return EntryKind.REDIRECT_DIR
        return EntryKind.MERGE_DIR
    if stat.S_ISREG(mode):
        if xwhiteouts and size == 0 and _overlay_attr(xattrs, "whiteout") is not None:
            return EntryKind.WHITEOUT
        if _overlay_attr(xattrs, "metacopy") is not None:
            return EntryKind.METACOPY
    return EntryKind.PLAIN


def merged_xattr_name(name: str) -> str | None:
    """The name under which an upper entry's xattr ``name`` appears in the merged view.

    None for the overlay's own bookkeeping; an escaped ``trusted.overlay.overlay.X`` (a real
    ``trusted.overlay.X`` of a file in a nested overlay) comes back unescaped; any other name
    is returned as is.
    """
    for prefix in OVERLAY_XATTR_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest.startswith(_ESCAPE) and len(rest) > len(_ESCAPE):
                return prefix + rest[len(_ESCAPE) :]
            return None
    return name


def is_overlay_xattr(name: str) -> bool:
    """True for the overlay's own xattrs, which are not part of a file and must be skipped."""
    return merged_xattr_name(name) is None


def _overlay_xattrs(path: str) -> dict[str, bytes]:
    """The overlay-namespace xattrs of ``path`` (not followed if a symlink)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}  # no xattr support here: nothing can be marked
    found: dict[str, bytes] = {}
    for name in names:
        if name.startswith(OVERLAY_XATTR_PREFIXES):
            try:
                found[name] = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
    return found


def _sorted_entries(path: str) -> list[os.DirEntry[str]]:
    """The entries of directory ``path`` in name byte order; [] if it vanished meanwhile."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise CaptureError(f"cannot list {path}: {e}; check its permissions") from e
    entries.sort(key=lambda e: os.fsencode(e.name))
    return entries


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _need_merged(upper: Path, rel: str, what: str) -> CaptureError:
    return CaptureError(
        f"{upper / rel} is {what}: its content lives partly in the lower layers, so the upper "
        "directory alone cannot be read; pass the mounted merged path (merged=...) to "
        "read_upper, or mount the overlay with redirect_dir=off,metacopy=off"
    )


def read_upper(upper: Path, merged: Path | None = None) -> Iterator[Change]:
    """The changes an overlay upper directory makes, in path order, parents before children.

    Path order: depth first, siblings by the bytes of their names. ``merged`` is the mounted
    overlay (needed for renamed directories and metacopy files, see the module docstring).

    Raises :class:`CaptureError` at the call when ``upper`` (or a given ``merged``) is not a
    directory; during the iteration, after earlier changes were yielded, when a directory
    cannot be listed or when a redirect or metacopy entry is met and ``merged`` is None.
    Entries that vanish while the walk runs (a live session) are skipped; under a renamed
    directory the upper's own entries (whiteouts included) are not reported, since the merged
    listing is complete.
    """
    if not upper.is_dir():
        raise CaptureError(f"overlay upper directory {upper} does not exist or is not a directory")
    if merged is not None and not merged.is_dir():
        raise CaptureError(
            f"merged overlay path {merged} does not exist or is not a directory; "
            "pass the overlay's mount point, or merged=None"
        )
    root_x = marks_xwhiteouts(_overlay_xattrs(str(upper)))
    return _walk_upper(upper, merged, root_x)


def _walk_upper(upper: Path, merged: Path | None, root_x: bool) -> Iterator[Change]:
    # A stack of per-directory iterators gives depth-first order without recursion.
    frames: list[tuple[str, bool, Iterator[os.DirEntry[str]]]] = [
        ("", root_x, iter(_sorted_entries(str(upper))))
    ]
    while frames:
        dir_rel, dir_x, entries = frames[-1]
        entry = next(entries, None)
        if entry is None:
            frames.pop()
            continue
        rel = _join(dir_rel, entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        xattrs = _overlay_xattrs(entry.path)
        kind = classify(st.st_mode, st.st_rdev, st.st_size, xattrs, xwhiteouts=dir_x)
        if kind is EntryKind.WHITEOUT:
            yield Change(rel, ChangeKind.DELETED)
        elif kind is EntryKind.REDIRECT_DIR:
            if merged is None:
                raise _need_merged(upper, rel, "a renamed directory (overlay.redirect)")
            yield Change(rel, ChangeKind.OPAQUE)
            yield from _walk_merged_tree(merged, rel)
        elif kind is EntryKind.METACOPY:
            if merged is None:
                raise _need_merged(upper, rel, "a metadata-only copy (overlay.metacopy)")
            yield Change(rel, ChangeKind.PRESENT)
        elif kind in (EntryKind.OPAQUE_DIR, EntryKind.MERGE_DIR):
            opaque = kind is EntryKind.OPAQUE_DIR
            yield Change(rel, ChangeKind.OPAQUE if opaque else ChangeKind.PRESENT)
            child_x = root_x and marks_xwhiteouts(xattrs)
            frames.append((rel, child_x, iter(_sorted_entries(entry.path))))
        else:
            yield Change(rel, ChangeKind.PRESENT)


def _walk_merged_tree(merged: Path, rel: str) -> Iterator[Change]:
    """Every path under ``merged/rel`` as PRESENT, depth first (``rel`` itself excluded)."""
    frames: list[tuple[str, Iterator[os.DirEntry[str]]]] = [
        (rel, iter(_sorted_entries(os.path.join(merged, rel))))
    ]
    while frames:
        dir_rel, entries = frames[-1]
        entry = next(entries, None)
        if entry is None:
            frames.pop()
            continue
        child = _join(dir_rel, entry.name)
        yield Change(child, ChangeKind.PRESENT)
        if entry.is_dir(follow_symlinks=False):
            frames.append((child, iter(_sorted_entries(entry.path))))
