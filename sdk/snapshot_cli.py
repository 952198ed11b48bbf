"""``gpufleet snapshot create|list|show|diff|restore|delete|gc|check|rebuild-index``.

Talks to a project's snapshot repository directly (the node agent and admins use it; the
controller's API offers researchers their own snapshots). Where the repository is, and its
master key, come from options or the environment:

- ``--store`` / ``GPUFLEET_SNAPSHOT_STORE``: ``s3://bucket/prefix`` or a local directory;
- ``--key-file`` / ``GPUFLEET_SNAPSHOT_KEY_FILE``: the master key (base64, 32 bytes);
- S3: ``--s3-endpoint`` / ``GPUFLEET_S3_ENDPOINT`` and the usual ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``.

Exit codes: 0 done; 1 a part of gpufleet this install lacks; 2 bad input (a wrong master
key included); 3 the snapshot store failed (unreachable, full, refused); 4 the repository's
data is damaged (a pack, an index file, a manifest, the project's key file). ``list`` and
``check`` print everything they could read before they exit 4; ``--json`` (before or after
the action) prints JSON lines on stdout instead of tables.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from .snapshotter.manifest import Manifest
    from .snapshotter.repository import Repository, SnapshotRef

EXIT_MISSING_EXTRA = 1
EXIT_BAD_INPUT = 2
EXIT_STORE = 3
EXIT_DAMAGED = 4


def add_snapshot(commands: Any) -> None:
    snap = commands.add_parser(
        "snapshot",
        help="snapshots of sessions: create, list, show, diff, restore, delete, gc, check, "
        "rebuild-index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    snap.add_argument("--store", default=os.environ.get("GPUFLEET_SNAPSHOT_STORE"))
    snap.add_argument("--key-file", default=os.environ.get("GPUFLEET_SNAPSHOT_KEY_FILE"))
    snap.add_argument("--s3-endpoint", default=os.environ.get("GPUFLEET_S3_ENDPOINT"))
    snap.add_argument("--project", required=True, help="the project whose repository to use")
    snap.add_argument(
        "--json",
        action="store_true",
        help="for programs: progress and the result as JSON lines on stdout, no bar",
    )
    sub = snap.add_subparsers(dest="snapshot_command", metavar="ACTION", required=True)
    _add_create(sub)
    _add_reading(sub)
    _add_restore(sub)
    _add_upkeep(sub)
    for action in ("create", "list", "show", "restore", "check", "rebuild-index"):
        sub.choices[action].add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,  # absent: the option before the action stands
            help="for programs: JSON lines on stdout",
        )


def _add_create(sub: Any) -> None:
    create = sub.add_parser("create", help="snapshot directories and environment prefixes")
    create.add_argument("paths", nargs="*", type=Path, help="directories (e.g. a home)")
    create.add_argument(
        "--prefix",
        action="append",
        type=Path,
        default=[],
        help="a conda environment or virtualenv prefix (repeatable)",
    )
    create.add_argument(
        "--overlay",
        action="append",
        default=[],
        metavar="UPPER[:MERGED]",
        help="an overlay upper directory, and its mounted view",
    )
    create.add_argument("--exclude", action="append", default=[], metavar="PATTERN")
    create.add_argument("--user", default=os.environ.get("USER", "root"))
    create.add_argument("--server", default="")
    create.add_argument("--tag", action="append", default=[])
    create.add_argument("--cache-dir", type=Path, default=_default_cache())
    create.add_argument("--level", type=int, default=3, help="zstd level (default 3)")


def _add_reading(sub: Any) -> None:
    """The actions that only read: list, show, diff."""
    listing = sub.add_parser("list", help="snapshots, oldest first")
    listing.add_argument("--user")
    listing.add_argument("--server")

    show = sub.add_parser("show", help="one snapshot: sources, figures, environment specs")
    show.add_argument("id", help="an id, its last 8+ characters, or 'latest' with --user")
    show.add_argument("--user")
    show.add_argument("--server", default="")
    show.add_argument("--spec", action="store_true", help="print the environment specs")

    diff = sub.add_parser("diff", help="paths added, removed and changed between two")
    diff.add_argument("first")
    diff.add_argument("second")


def _add_restore(sub: Any) -> None:
    restore = sub.add_parser("restore", help="bring a snapshot back")
    restore.add_argument("id", help="an id, or 'latest' with --user")
    restore.add_argument("--user")
    restore.add_argument("--server", default="")
    restore.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="SOURCE=PATH",
        help="restore a source somewhere else than where it came from",
    )
    restore.add_argument(
        "--overwrite", action="store_true", help="restore into a directory that is not empty"
    )
    restore.add_argument("--cache-dir", type=Path, default=_default_cache())
    restore.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME",
        help="restore only this source (repeatable; default: all)",
    )
    restore.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that fetch and write the data (default: two per core; 1: this one)",
    )


def _add_upkeep(sub: Any) -> None:
    """The actions that keep a repository: delete, gc, check, rebuild-index."""
    delete = sub.add_parser("delete", help="forget snapshots (data goes at the next gc)")
    delete.add_argument("ids", nargs="+")

    gc = sub.add_parser("gc", help="apply retention, then collect unused data")
    gc.add_argument("--keep-last", type=int, default=None)
    gc.add_argument("--keep-daily", type=int, default=None)
    gc.add_argument(
        "--margin",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="keep unreferenced data younger than this (default 3600)",
    )
    gc.add_argument("--dry-run", action="store_true")

    check = sub.add_parser("check", help="verify the repository")
    check.add_argument("--read-data", action="store_true", help="read and verify every pack")

    sub.add_parser(
        "rebuild-index",
        help="write a whole index from the index files that open and the packs' own tables",
    )


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "gpufleet" / "statcache"


def snapshot_command(args: argparse.Namespace, console: Console, err: Console) -> int:
    try:
        from .snapshotter import errors

        # Every action opens the repository, whose hashing and encryption come with the
        # server extra; the extra comes whole, so these stand for what the actions import.
        for part in ("crypto", "repository"):
            importlib.import_module(f"{__package__}.snapshotter.{part}")
    except ImportError as e:
        err.print(
            f"gpufleet snapshot needs the server extra ({e.name} is missing): "
            "pip install 'gpufleet[server]'",
            markup=False,
            highlight=False,
        )
        return EXIT_MISSING_EXTRA
    try:
        repository = _open(args)
        action = getattr(sys.modules[__name__], "_" + args.snapshot_command.replace("-", "_"))
        return int(action(repository, args, console, err))
    except errors.StoreError as e:
        err.print(f"[red]snapshot store:[/] {e}")
        return EXIT_STORE
    except errors.RepositoryError as e:
        err.print(f"[red]{e}[/]", highlight=False)
        # A wrong master key or an unknown id is the caller's to fix; the rest is damage
        # (DamagedKey, a damaged file's CorruptObject, a collection stopped by either).
        usage = isinstance(e, (errors.KeyUnavailable, errors.SnapshotNotFound))
        return EXIT_BAD_INPUT if usage else EXIT_DAMAGED
    except (errors.CaptureError, errors.RestoreRefused, ValueError) as e:
        err.print(f"[red]{e}[/]")
        return EXIT_BAD_INPUT


def _open(args: argparse.Namespace) -> Repository:
    from .snapshotter.crypto import read_master_key
    from .snapshotter.repository import Repository
    from .snapshotter.store import open_store

    if not args.store:
        raise ValueError("say where the snapshots are: --store or GPUFLEET_SNAPSHOT_STORE")
    if not args.key_file:
        raise ValueError("say where the master key is: --key-file or GPUFLEET_SNAPSHOT_KEY_FILE")
    options = {"endpoint_url": args.s3_endpoint} if args.store.startswith("s3://") else {}
    store = open_store(args.store, **options)
    return Repository.open(
        store,
        args.project,
        read_master_key(args.key_file),
        create=args.snapshot_command == "create",
    )


@contextmanager
def _bar(console: Console, what: str, as_json: bool = False) -> Iterator[Callable[[Any], None]]:
    """A progress bar; what it yields takes a capture's or a restore's progress (phase,
    bytes done, bytes in all). ``as_json``: a JSON line instead, at most five a second."""
    if as_json:
        last: dict[str, Any] = {"at": 0.0, "phase": ""}

        def report(p: Any) -> None:
            now = time.monotonic()
            if now - last["at"] < 0.2 and p.phase == last["phase"]:
                return
            last.update(at=now, phase=p.phase)
            _json_line(
                event="progress", what=what, phase=p.phase, done=p.bytes_done, total=p.bytes_total
            )

        yield report
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(what, total=None)

        def show(p: Any) -> None:
            progress.update(
                task, description=p.phase, completed=p.bytes_done, total=p.bytes_total or None
            )

        yield show


def _json_line(**fields: Any) -> None:
    import json

    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _create(
    repository: Repository, args: argparse.Namespace, console: Console, err: Console
) -> int:
    from .scheduler import failpoints
    from .snapshotter import envspec

    failpoints.reach("snapshot-create")  # crash tests: a snapshot process that dies
    from .snapshotter.capture import SourceSpec, create_snapshot
    from .snapshotter.manifest import SourceKind

    sources = [
        SourceSpec(p.name or "root", p.absolute(), exclude=tuple(args.exclude)) for p in args.paths
    ]
    for prefix in args.prefix:
        absolute = prefix.absolute()
        sources.append(
            SourceSpec(
                f"env:{absolute}",
                absolute,
                SourceKind.PREFIX,
                tuple(args.exclude),
                spec=envspec.spec(absolute),
            )
        )
    for overlay in args.overlay:
        upper, _, merged = overlay.partition(":")
        sources.append(
            SourceSpec(
                "rootfs",
                Path(upper).absolute(),
                SourceKind.OVERLAY,
                tuple(args.exclude),
                Path(merged) if merged else None,
            )
        )
    if not sources:
        raise ValueError("name something to snapshot: a directory, --prefix or --overlay")
    with _bar(console, "snapshot", args.json) as show:
        manifest = create_snapshot(
            repository,
            sources,
            user=args.user,
            server=args.server,
            cache_dir=args.cache_dir,
            tags=args.tag,
            compression_level=args.level,
            on_progress=show,
        )
    s = manifest.stats
    if args.json:
        _json_line(event="done", id=manifest.id, name=manifest.name, stats=vars(s))
        return 0
    console.print(
        f"snapshot [bold]{manifest.id}[/] of {s.files} files ({_size(s.bytes)}): "
        f"{s.reused_files} unchanged, {_size(s.new_bytes)} new, {_size(s.uploaded_bytes)} "
        f"uploaded in {s.duration_s:.1f} s"
    )
    console.print(
        f"  restore it: gpufleet snapshot --project {repository.project} restore {manifest.id}"
    )
    return 0


def _list(repository: Repository, args: argparse.Namespace, console: Console, err: Console) -> int:
    """Every snapshot that opens; one that does not is a row marked damaged (and a line on
    stderr naming its manifest), and the exit code says so once the rest are printed."""
    from rich.table import Table

    from .snapshotter.errors import CorruptObject, SnapshotNotFound

    listed: list[tuple[SnapshotRef, Manifest | CorruptObject]] = []
    for ref in repository.snapshots(args.user, args.server):
        try:
            listed.append((ref, repository.read_manifest(ref)))
        except SnapshotNotFound:
            continue  # deleted since it was listed
        except CorruptObject as e:
            listed.append((ref, e))
    damaged = [(ref, m) for ref, m in listed if isinstance(m, CorruptObject)]
    if args.json:
        _json_line(event="done", snapshots=[_listed_json(ref, m) for ref, m in listed])
    else:
        table = Table("user", "server", "created", "files", "size", "uploaded")
        table.add_column("id", no_wrap=True)
        for ref, m in listed:
            if isinstance(m, CorruptObject):
                table.add_row(ref.user, ref.server or "-", "[red]damaged[/]", "", "", "", ref.id)
                continue
            table.add_row(
                m.user,
                m.server or "-",
                _when(m.created_at),
                str(m.stats.files),
                _size(m.stats.bytes),
                _size(m.stats.uploaded_bytes),
                m.id,
            )
        console.print(table)
    for ref, why in damaged:
        err.print(f"[red]snapshot {ref.id} is damaged:[/] {why}", highlight=False)
    return EXIT_DAMAGED if damaged else 0


def _listed_json(ref: SnapshotRef, m: Manifest | Exception) -> dict[str, Any]:
    """A snapshot as ``list --json`` prints it: its manifest's fields, or, for one whose
    manifest does not open, what its name says and why."""
    if isinstance(m, Exception):
        return {
            "id": ref.id,
            "user": ref.user,
            "server": ref.server,
            "name": ref.name,
            "damaged": True,
            "error": str(m),
        }
    return {
        "id": m.id,
        "user": m.user,
        "server": m.server,
        "name": ref.name,
        "damaged": False,
        "created_at": m.created_at,
        "hostname": m.hostname,
        "parent": m.parent,
        "tags": list(m.tags),
        "sources": [{"name": x.name, "path": x.path, "kind": x.kind.value} for x in m.sources],
        "stats": vars(m.stats),
    }


def _resolve(repository: Repository, args: argparse.Namespace, snapshot_id: str) -> Manifest:
    from .snapshotter.errors import SnapshotNotFound

    if snapshot_id == "latest":
        if not getattr(args, "user", None):
            raise ValueError("'latest' needs --user (and --server for a named server)")
        ref = repository.latest(args.user, args.server)
        if ref is None:
            raise SnapshotNotFound(f"{args.user} has no snapshot in project {repository.project}")
        return repository.read_manifest(ref)
    return repository.read_manifest(repository.find(snapshot_id))


def _show(repository: Repository, args: argparse.Namespace, console: Console, err: Console) -> int:
    m = _resolve(repository, args, args.id)
    s = m.stats
    if args.json:
        sources = [{"name": x.name, "path": x.path, "kind": x.kind.value} for x in m.sources]
        _json_line(
            event="done",
            id=m.id,
            name=m.name,
            created_at=m.created_at,
            tags=list(m.tags),
            sources=sources,
            stats=vars(s),
        )
        return 0
    console.print(
        f"[bold]{m.id}[/] of {m.user}/{m.server or '-'} in project {m.project}, "
        f"taken {_when(m.created_at)} on {m.hostname}" + (f", after {m.parent}" if m.parent else "")
    )
    console.print(
        f"  {s.files} files in {s.dirs} directories, {_size(s.bytes)}; "
        f"{_size(s.new_bytes)} new, {_size(s.uploaded_bytes)} uploaded, "
        f"{s.duration_s:.1f} s"
    )
    for source in m.sources:
        console.print(
            f"  {source.kind.value:8} {source.name}: {source.path} "
            f"({source.files} files, {_size(source.bytes)})"
        )
        if args.spec:
            for kind, text in source.spec.items():
                console.print(f"    [dim]{kind}[/]\n{text}", highlight=False)
    return 0


def _diff(repository: Repository, args: argparse.Namespace, console: Console, err: Console) -> int:
    from .snapshotter.restore import read_tree

    index = repository.load_index()
    listed = []
    for snapshot_id in (args.first, args.second):
        manifest = repository.read_manifest(repository.find(snapshot_id))
        paths = {}
        for source in manifest.sources:
            for rel, node in read_tree(repository, index, source.tree):
                paths[f"{source.name}:{rel}"] = node
        listed.append(paths)
    before, after = listed
    for path in sorted(before.keys() | after.keys()):
        old, new = before.get(path), after.get(path)
        if old is None:
            console.print(f"[green]+ {path}[/]", highlight=False)
        elif new is None:
            console.print(f"[red]- {path}[/]", highlight=False)
        elif old != new and old.type.value != "d":
            console.print(f"[yellow]M {path}[/]", highlight=False)
    return 0


def _restore(
    repository: Repository, args: argparse.Namespace, console: Console, err: Console
) -> int:
    from .snapshotter.restore import restore_snapshot

    manifest = _resolve(repository, args, args.id)
    targets = {}
    for item in args.target:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(
                f"--target {item!r}: write SOURCE=PATH (sources: "
                f"{', '.join(s.name for s in manifest.sources)})"
            )
        targets[name] = Path(path).absolute()
    started = time.monotonic()
    with _bar(console, "restore", args.json) as show:
        result = restore_snapshot(
            repository,
            manifest,
            targets=targets,
            overwrite=args.overwrite,
            only=args.source or None,
            workers=args.workers,
            cache_dir=args.cache_dir,
            on_progress=show,
        )
    if args.json:
        _json_line(
            event="done",
            id=manifest.id,
            files=result.files,
            bytes=result.bytes,
            seconds=round(time.monotonic() - started, 3),
        )
        return 0
    console.print(
        f"restored {manifest.id}: {result.files} files, {_size(result.bytes)} in "
        f"{time.monotonic() - started:.1f} s"
    )
    return 0


def _delete(
    repository: Repository, args: argparse.Namespace, console: Console, err: Console
) -> int:
    for snapshot_id in args.ids:
        ref = repository.find(snapshot_id)
        repository.delete_manifest(ref)
        console.print(f"deleted {ref.id}; its data goes at the next `gc`")
    return 0


def _gc(repository: Repository, args: argparse.Namespace, console: Console, err: Console) -> int:
    from .snapshotter import retention
    from .snapshotter.gc import collect_garbage

    if args.keep_last is not None or args.keep_daily is not None:
        policy = retention.RetentionPolicy(args.keep_last or 1, args.keep_daily or 0)
        for snapshot_id in retention.apply(repository, policy, time.time(), args.dry_run):
            console.print(f"forget {snapshot_id}" + (" (dry run)" if args.dry_run else ""))
    if args.dry_run:
        return 0
    report = collect_garbage(repository, margin_s=args.margin)
    console.print(
        f"{report.snapshots} snapshots use {report.live_packs} packs; "
        f"{report.tombstoned} packs marked for deletion, {report.deleted_packs} "
        f"deleted ({_size(report.deleted_bytes)})"
    )
    for lock in report.waiting_for:
        console.print(f"  waiting for a snapshot in progress to finish: {lock}")
    return 0


def _check(repository: Repository, args: argparse.Namespace, console: Console, err: Console) -> int:
    from .snapshotter.gc import check

    report = check(repository, read_data=args.read_data)
    if args.json:
        _json_line(event="done", **vars(report))
        return EXIT_DAMAGED if report.problems else 0
    for problem in report.problems:
        console.print(f"[red]{problem}[/]", highlight=False)
    console.print(
        f"{report.snapshots} snapshots, {report.blobs} blobs"
        + (f", {report.packs_read} packs read" if args.read_data else "")
        + (": no problems" if not report.problems else "")
    )
    return EXIT_DAMAGED if report.problems else 0


def _rebuild_index(
    repository: Repository, args: argparse.Namespace, console: Console, err: Console
) -> int:
    from .snapshotter.gc import rebuild_index

    report = rebuild_index(repository)
    if args.json:
        _json_line(event="done", **vars(report))
    else:
        console.print(
            f"index rebuilt: {report.packs} packs ({report.tables_read} read from their own "
            f"tables) in {report.written or 'no index file (no packs)'}; replaced "
            f"{len(report.replaced)} index files, {len(report.damaged_files)} of them damaged",
            highlight=False,
        )
    for pack_id, why in sorted(report.unreadable_packs.items()):
        err.print(
            f"[red]pack {pack_id}: its own table does not open ({why}) and no index file "
            f"lists it: its data cannot be found[/]",
            highlight=False,
        )
    return EXIT_DAMAGED if report.unreadable_packs else 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))
