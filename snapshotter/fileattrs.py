"""What a snapshot records of a file beyond its stat: the data ranges of a sparse file,
its owner's and group's names, its extended attributes. Blocking (reads the file system
and the machine's user and group databases)."""

from __future__ import annotations

import grp
import os
import pwd
from functools import cache

# Overlay's own bookkeeping, never part of a file's attributes.
_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")


def data_ranges(fd: int, size: int) -> tuple[tuple[int, int], ...]:
    """The (offset, length) ranges of a sparse file that hold data."""
    ranges = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:
            break  # no data after offset: the rest is a hole
        end = os.lseek(fd, start, os.SEEK_HOLE)
        ranges.append((start, min(end, size) - start))
        offset = end
    if not ranges:
        ranges.append((0, 0))  # all hole: one empty range marks it sparse
    return tuple(ranges)


@cache
def user_name(uid: int) -> str:
    """The name of ``uid`` on this machine; "" for a uid without one."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


@cache
def group_name(gid: int) -> str:
    """The name of ``gid`` on this machine; "" for a gid without one."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


def xattrs(path: str) -> dict[str, bytes]:
    """The extended attributes of ``path`` (not followed), but overlay's own."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    found = {}
    for name in names:
        if name.startswith(_OVERLAY_XATTRS):
            continue
        try:
            found[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile, or not readable: nothing to restore
    return found
