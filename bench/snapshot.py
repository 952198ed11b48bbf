"""Snapshots of a real Python environment on a local S3 server, against tar | zstd.

Data: a virtualenv of ``torch==2.13.0`` (the CPU build), numpy, scipy, pandas, jupyterlab,
matplotlib, scikit-learn and pyarrow — about 1.7 GB in 47,000 files — created once with pip
and cached in ``--data-dir`` (outside the repository). The store: a SeaweedFS ``weed mini``
S3 server on loopback (``tests/s3server.py``), or a local directory with ``--local``.

Baseline, in the same run: ``tar -C ENV -cf - . | zstd -3 -T0`` streamed into one S3
multipart upload (boto3 ``upload_fileobj`` from the pipe), and its restore: the download
streamed into ``zstd -d | tar -x`` in an empty directory on tmpfs. gpufleet's figures, each
against its target:

- full snapshot (fresh stat cache) ≤ 1.25 × the baseline upload's time;
- the same environment unchanged ≤ 0.1 × the baseline upload's time;
- after ``pip install`` of one more package: bytes uploaded ≤ 1.2 × that package's
  compressed size (every path the install added or changed, tarred, ``zstd -3``);
- a second user's copy of the environment with another package: bytes uploaded ≤ 30% of
  that environment's ``tar | zstd -3`` size;
- restore into an empty tmpfs directory ≤ 1.0 × the baseline restore's time.

The cached environment is never changed: each user works on a ``cp -a`` copy, read once
before anything is timed. The timed steps run in ``--rounds`` rounds (each round a project
of its own, so nothing deduplicates across rounds), baseline and gpufleet alternating; the
table shows medians. Each step also prints the CPU time of this process, of tar and zstd, of
the S3 server and of every other process on the machine: a shared machine's other work is
what makes rounds differ. ``--profile`` runs py-spy (native frames) on the first round's
three gpufleet steps and prints where the threads spent their time.

    .venv/bin/python bench/snapshot.py [--data-dir DIR] [--rounds 3] [--workers N]
        [--level 3] [--local] [--keep] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from gpufleet.snapshotter import envspec
from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.crypto import new_master_key
from gpufleet.snapshotter.manifest import Manifest, SourceKind
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.restore import restore_snapshot
from gpufleet.snapshotter.store import LocalStore, Store

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "torch==2.13.0",  # pinned: the CPU build pip finds here; others pull gigabytes of CUDA
    "numpy",
    "scipy",
    "pandas",
    "jupyterlab",
    "matplotlib",
    "scikit-learn",
    "pyarrow",
)
ONE_MORE = ("openpyxl",)  # what the first user adds: 2.3 MB installed, with et-xmlfile
SECOND_USER_EXTRA = ("rich",)  # what makes the second user's copy differ
MIN_BYTES, MIN_FILES = 1_500_000_000, 20_000
PROTOTYPE = {"full": 16.6, "unchanged": 3.7, "restore": 4.5}  # seconds, 1.68 GB in 47k files
MiB = 1 << 20


# ---------------------------------------------------------------- helpers
def say(text: str = "") -> None:
    print(text, flush=True)


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def run(cmd: list[str], **kwargs: Any) -> None:
    subprocess.run(cmd, check=True, **kwargs)


def tree_size(root: Path) -> tuple[int, int, float]:
    """Regular files, their bytes, and the seconds a stat walk of ``root`` took."""
    started = time.perf_counter()
    files = total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                files += 1
                total += st.st_size
    return files, total, time.perf_counter() - started


def warm(root: Path) -> None:
    """Read every file under ``root`` once, so that every timed step starts with it cached."""
    buffer = bytearray(MiB)
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buffer):
                        pass


def stat_map(root: Path) -> dict[str, tuple[int, int, int, int, int]]:
    found = {}
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            found[rel] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return found


def zstd_size(root: Path, paths: list[str] | None = None) -> int:
    """Bytes of ``tar -C root -cf - . | zstd -3 -T0`` (or of just ``paths``, unrecursed)."""
    with tempfile.NamedTemporaryFile("w", suffix=".list") as listing:
        tar_cmd = ["tar", "-C", str(root), "-cf", "-"]
        if paths is None:
            tar_cmd.append(".")
        else:
            listing.write("".join(p + "\n" for p in paths))
            listing.flush()
            tar_cmd += ["--no-recursion", "-T", listing.name]
        tar = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE)
        zstd = subprocess.Popen(
            ["zstd", "-3", "-T0", "-q", "-c"], stdin=tar.stdout, stdout=subprocess.PIPE
        )
        assert tar.stdout is not None and zstd.stdout is not None
        tar.stdout.close()
        total = 0
        while block := zstd.stdout.read(MiB):
            total += len(block)
        if tar.wait() or zstd.wait():
            raise RuntimeError(f"{' '.join(tar_cmd)} | zstd failed")
        return total


def load_s3server() -> ModuleType:
    """``tests/s3server.py``, loaded from its file: the repository root must not go on
    ``sys.path`` (its directories would shadow the installed ``gpufleet`` package)."""
    name = "gpufleet_bench_s3server"
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "s3server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------- the environment
def ensure_env(env: Path) -> None:
    marker = env / ".gpufleet-bench"
    wanted = " ".join(PACKAGES)
    if marker.is_file() and marker.read_text().strip() == wanted:
        return
    say(f"creating {env} (pip install {wanted}); this takes a few minutes")
    if env.exists():
        shutil.rmtree(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(env)])
    run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", *PACKAGES], cwd="/")
    marker.write_text(wanted + "\n")


def pip_install(env: Path, packages: tuple[str, ...]) -> None:
    # The copy's own interpreter: its bin/pip still names the cached environment's.
    run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", *packages],
        cwd="/",
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )


# ------------------------------------------------------------------ tmpfs
@contextlib.contextmanager
def scratch(work: Path) -> Iterator[tuple[Path, str]]:
    """An empty directory for restores: a tmpfs of its own when root, else a plain one."""
    mount = work / "tmpfs"
    mount.mkdir()
    mounted = False
    if os.geteuid() == 0:
        try:
            run(["mount", "-t", "tmpfs", "-o", "size=8g", "tmpfs", str(mount)])
            mounted = True
        except (subprocess.CalledProcessError, OSError) as e:
            say(f"(mounting a tmpfs failed: {e})")
    if mounted:
        kind = f"tmpfs mounted at {mount}"
    elif _fs_type(mount) == "tmpfs":
        kind = f"{mount}, already on tmpfs"
    else:
        kind = f"plain directory {mount} ({_fs_type(mount)}; not root, so no tmpfs)"
    try:
        yield mount, kind
    finally:
        if mounted:
            run(["umount", str(mount)])


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


# ----------------------------------------------------------------- baseline
class Baseline:
    """tar | zstd -3 -T0 into one object, and back: into S3 (boto3's managed multipart
    transfer, its defaults) or, with ``--local``, into a file that is fsynced."""

    def __init__(self, client: Any, bucket: str, local_dir: Path | None):
        self.client, self.bucket, self.local_dir = client, bucket, local_dir
        self.key = "baseline/env.tar.zst"

    def upload(self, env: Path) -> None:
        tar = subprocess.Popen(["tar", "-C", str(env), "-cf", "-", "."], stdout=subprocess.PIPE)
        zstd = subprocess.Popen(
            ["zstd", "-3", "-T0", "-q", "-c"], stdin=tar.stdout, stdout=subprocess.PIPE
        )
        assert tar.stdout is not None and zstd.stdout is not None
        tar.stdout.close()
        if self.local_dir is None:
            from boto3.s3.transfer import TransferConfig

            self.client.upload_fileobj(zstd.stdout, self.bucket, self.key, Config=TransferConfig())
        else:
            with open(self.local_dir / "env.tar.zst", "wb") as out:
                shutil.copyfileobj(zstd.stdout, out, MiB)
                out.flush()
                os.fsync(out.fileno())
        if tar.wait() or zstd.wait():
            raise RuntimeError("baseline: tar | zstd failed")

    def stored(self) -> int:
        if self.local_dir is None:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.key)["ContentLength"])
        return (self.local_dir / "env.tar.zst").stat().st_size

    def restore(self, target: Path) -> None:
        zstd = subprocess.Popen(
            ["zstd", "-d", "-q", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        tar = subprocess.Popen(["tar", "-C", str(target), "-xf", "-"], stdin=zstd.stdout)
        assert zstd.stdin is not None and zstd.stdout is not None
        zstd.stdout.close()
        if self.local_dir is None:
            from boto3.s3.transfer import TransferConfig

            self.client.download_fileobj(self.bucket, self.key, zstd.stdin, Config=TransferConfig())
        else:
            with open(self.local_dir / "env.tar.zst", "rb") as source:
                shutil.copyfileobj(source, zstd.stdin, MiB)
        zstd.stdin.close()
        if zstd.wait() or tar.wait():
            raise RuntimeError("baseline: zstd -d | tar -x failed")


# ---------------------------------------------------------------- gpufleet
def snapshot(
    repository: Repository, env: Path, user: str, cache: Path, args: argparse.Namespace
) -> Manifest:
    """What ``gpufleet snapshot create --prefix ENV`` does: the env's spec, then the run."""
    source = SourceSpec(f"env:{env}", env, SourceKind.PREFIX, spec=envspec.spec(env))
    return create_snapshot(
        repository,
        [source],
        user=user,
        cache_dir=cache,
        workers=args.workers,
        compression_level=args.level,
    )


def describe(manifest: Manifest) -> str:
    s = manifest.stats
    return (
        f"{s.files} files, {size(s.bytes)}; {s.reused_files} unchanged; {size(s.new_bytes)} new; "
        f"{size(s.uploaded_bytes)} uploaded"
    )


def verify(expected: Path, restored: Path) -> list[str]:
    """Differences between two trees: type, mode, owner, size, mtime, link target, bytes."""
    problems: list[str] = []
    want, got = stat_map(expected), stat_map(restored)
    for rel in sorted(want.keys() ^ got.keys()):
        problems.append(f"{rel}: only in {'the source' if rel in want else 'the restore'}")
    for rel in sorted(want.keys() & got.keys()):
        a, b = os.lstat(expected / rel), os.lstat(restored / rel)
        fields: tuple[str, ...] = ("st_mode", "st_uid", "st_gid", "st_mtime_ns")
        fields += ("st_size",) if not stat.S_ISDIR(a.st_mode) else ()
        bad = [f for f in fields if getattr(a, f) != getattr(b, f)]
        if stat.S_ISLNK(a.st_mode) and os.readlink(expected / rel) != os.readlink(restored / rel):
            bad.append("target")
        if not bad and stat.S_ISREG(a.st_mode) and not _same_bytes(expected / rel, restored / rel):
            bad.append("content")
        if bad:
            problems.append(f"{rel}: {', '.join(bad)} differ")
    return problems


def _same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(4 * MiB), fb.read(4 * MiB)
            if x != y:
                return False
            if not x:
                return True


# ----------------------------------------------------------------- CPU time
class Clock:
    """Wall time, and CPU time split between this process, its waited-for children (tar,
    zstd; gpufleet's restore workers), the S3 server and every other process on the
    machine; and the steal time (what the VM's neighbours took). Other processes and steal
    are why rounds differ."""

    def __init__(self, server_pid: int | None):
        self.server_pid = server_pid

    def read(self) -> tuple[float, ...]:
        t = os.times()
        tick = os.sysconf("SC_CLK_TCK")
        server = 0.0
        if self.server_pid is not None:
            with open(f"/proc/{self.server_pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            server = (int(fields[11]) + int(fields[12])) / tick
        with open("/proc/stat") as f:
            user, nice, system, _idle, _wait, irq, softirq, steal = map(
                int, f.readline().split()[1:9]
            )
        own, children = t.user + t.system, t.children_user + t.children_system
        others = (user + nice + system + irq + softirq) / tick - own - children - server
        return time.perf_counter(), own, children, server, others, steal / tick

    @contextlib.contextmanager
    def timed(self, into: dict[str, float]) -> Iterator[None]:
        os.sync()  # no write-back of earlier steps while this one runs
        before = self.read()
        yield
        after = self.read()
        names = ("wall", "cpu_self", "cpu_children", "cpu_server", "cpu_others", "steal")
        into.update((n, b - a) for n, a, b in zip(names, before, after, strict=True))


def cpu_note(t: dict[str, float]) -> str:
    note = f"CPU: this process {t['cpu_self']:.1f} s"
    if t["cpu_children"] >= 0.05:
        note += f", child processes {t['cpu_children']:.1f} s"
    if t["cpu_server"]:
        note += f", S3 server {t['cpu_server']:.1f} s"
    return note + f"; other processes {max(0.0, t['cpu_others']):.1f} s; steal {t['steal']:.1f} s"


# ----------------------------------------------------------------- profile
# What a sample was doing: the innermost frame that matches one of these, in this order.
_ACTIVITIES = [
    (r"pthread_cond_timedwait|pthread_mutex_lock|take_gil|PyEval_RestoreThread", "GIL wait"),
    (r"ZstdDecompressor|decompressor\.c", "zstd decompress"),
    (r"ZstdCompressor|compressor\.c", "zstd compress"),
    (r"(?i)blake3|content_id \(", "BLAKE3 (content ids, pack ids)"),
    (r"(?i)sha256|request_checksum \(", "SHA-256 (S3 request checksums)"),
    (r"(?i)aesgcm|aes_gcm|gcm_|aead|EVP_(En|De)crypt|EVP_Cipher|aesni", "AES-GCM"),
    (r"(?i)fastcdc|cut_buf", "FastCDC chunking"),
    (r"memmove|memcpy|PyBytes_Concat|bytes_concat|bytes_join|stringlib_bytes_join", "copies"),
    (r"^(poll|internal_select|sock_call)", "HTTP: waiting for the server"),
    (r"botocore|urllib3|http/client|http\.client|socket\.py|ssl\.py", "HTTP: boto3"),
    (r"pwrite", "pwrite"),
    (r"os_mkdir|os_symlink|os_link|_create \(", "create files and dirs"),
    (r"os_chown|os_chmod|os_utime|os_setxattr|_set_metadata", "chown, chmod, utime"),
    (r"os_listxattr|os_getxattr|_xattrs", "read xattrs"),
    (r"scandir|DirEntry|os_lstat|os_stat|_walk_dir|lstat", "scandir / stat"),
    (r"mmap|os_open|os_close|_io_FileIO|read_file \(|os_pread|^read ", "open, read, close"),
    (r"encode_tree|decode_tree|to_json|from_json|signature \(|_node \(", "tree encode/decode"),
    (r"statcache|new_cache|StatCache", "stat cache"),
    (r"_ship \(", "waiting for an upload slot"),
    (r"acquire_lock|sem_|futex|Condition\.wait|_worker \(|SimpleQueue|Event\.wait", "wait"),
]
# Which part of the run a sample belongs to: the outermost frame that matches.
_PHASES = [
    (r"envspec", "env spec"),
    (r"walk_tree \(|walk_overlay \(", "walk"),
    (r"_read_batch \(|read_all \(", "read, chunk, hash, compress, seal"),
    (r"\.upload \(|write_pack \(", "pack upload"),
    (r"build_trees \(", "trees"),
    (r"flush \(capture", "flush (last packs)"),
    (r"write_index \(", "index write"),
    (r"write_manifest \(", "manifest write"),
    (r"statcache|new_cache \(", "stat cache save"),
    (r"load_index \(|list_packs \(|tombstone|writer_lock|latest \(|has_manifest", "store reads"),
    (r"_plan_source \(|read_tree \(", "plan (read trees)"),
    (r"_missing \(", "check packs exist"),
    (r"_create \(", "create files and dirs"),
    (r"_write_pack \(", "fetch, decrypt, decompress, verify, write"),
    (r"_file_metadata \(", "metadata"),
    (r"_write_data \(", "waiting for the pack workers"),
    (r"_link \(", "hard links"),
    (r"_apply_metadata \(", "metadata"),
    (r"prime_cache \(", "stat cache priming"),
    (r"read_manifest \(|Repository\.open|find \(", "store reads"),
]


@contextlib.contextmanager
def profiled(name: str, out_dir: Path | None, rate: int = 25) -> Iterator[None]:
    """py-spy on this process and its workers (native frames, idle threads) while the
    block runs."""
    if out_dir is None:
        yield
        return
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    spy = shutil.which("py-spy", path=search)
    if spy is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    raw = out_dir / f"{name}.txt"
    cmd = [spy, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--native"]
    cmd += ["--idle", "--threads", "--subprocesses", "--format", "raw", "-o", str(raw)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)  # attached and sampling
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        summarise(name, raw, rate)


def summarise(name: str, raw: Path, rate: int) -> None:
    main: Counter[str] = Counter()
    busy: Counter[tuple[str, str]] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any(f.startswith("profiled ") for f in frames):
            continue  # the profiler attaching
        thread = frames[0].partition(": ")[2]
        phase = next(
            (label for f in frames for rx, label in _PHASES if re.search(rx, f)), "(other)"
        )
        activity = next(
            (label for f in reversed(frames) for rx, label in _ACTIVITIES if re.search(rx, f)),
            "(other)",
        )
        if activity == "wait" and any(re.search(r"_ship \(", f) for f in frames):
            activity = "waiting for an upload slot"
        if thread == "MainThread":
            main[phase] += int(count)
        if activity == "wait" or phase in ("(other)", "waiting for the pack workers"):
            continue  # an idle thread
        busy[(phase, activity)] += int(count)
    total, active = sum(main.values()), sum(busy.values())
    say(f"  profile of {name}: {raw} ({rate} samples/s; py-spy --native slows the run)")
    say(f"    main thread by phase, {total / rate:.1f} s:")
    for phase, n in main.most_common():
        say(f"      {phase:<44} {n / rate:6.2f} s {100 * n / total:5.1f}%")
    say(f"    every thread not idle, {active / rate:.1f} thread-s:")
    for (phase, activity), n in busy.most_common(20):
        say(f"      {phase:<38} {activity:<30} {n / rate:6.2f} s {100 * n / active:5.1f}%")


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path.home() / ".cache" / "gpufleet-bench" / "env",
        help="the cached environment (created on first use; outside the repository)",
    )
    parser.add_argument("--workers", type=int, default=None, help="snapshot and restore workers")
    parser.add_argument("--level", type=int, default=3, help="gpufleet's zstd level")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the timed steps")
    parser.add_argument("--keep", action="store_true", help="keep the S3 server's data dir")
    parser.add_argument("--local", action="store_true", help="a LocalStore instead of S3")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the first round's gpufleet steps"
    )
    args = parser.parse_args(argv)
    env = args.data_dir.expanduser().absolute()
    if env.resolve().is_relative_to(REPO):
        raise SystemExit(f"--data-dir {env} is inside the repository: put it elsewhere")
    ensure_env(env)
    files, total, walk_s = tree_size(env)
    say(f"environment {env}: {size(total)} in {files:,} files (a stat walk: {walk_s:.2f} s)")
    say(f"  pip install {' '.join(PACKAGES)}")
    if total < MIN_BYTES or files < MIN_FILES:
        raise SystemExit("the environment is too small: add packages to PACKAGES")

    work = fresh_workdir(env)
    profile_dir = env.parent / f"{env.name}-profiles" if args.profile else None
    if profile_dir is not None:
        profile_dir.mkdir(exist_ok=True)
    server = None
    try:
        alice, bob = user_copies(env, work)
        started = time.perf_counter()
        if not args.local:
            server = load_s3server().S3Server.start()
        store, baseline = stores(work, server, started)
        clock = Clock(server.process.pid if server is not None else None)
        with scratch(work) as (tmp, tmp_kind):
            say(f"restores go to {tmp_kind}")
            bench = Bench(args, env, alice, bob, store, baseline, tmp, work, clock, profile_dir)
            results = measure(bench)
        report(results, total, files)
    finally:
        if server is not None:
            if args.keep:
                server._terminate()
                say(f"S3 data kept in {server.workdir}")
            else:
                server.stop()
        shutil.rmtree(work, ignore_errors=True)


def fresh_workdir(env: Path) -> Path:
    """An empty working directory beside the cached environment (a previous run's
    removed, its tmpfs unmounted)."""
    work = env.parent / f"{env.name}-work"
    if work.exists():
        with contextlib.suppress(subprocess.CalledProcessError):
            run(["umount", str(work / "tmpfs")], stderr=subprocess.DEVNULL)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def user_copies(env: Path, work: Path) -> tuple[Path, Path]:
    """Two users' copies of the environment (``cp -a``), the second with
    ``SECOND_USER_EXTRA`` installed, both read once so that they are cached."""
    alice, bob = work / "alice" / "env", work / "bob" / "env"
    started = time.perf_counter()
    for copy in (alice, bob):
        copy.parent.mkdir()
        run(["cp", "-a", str(env), str(copy)])
    pip_install(bob, SECOND_USER_EXTRA)
    os.sync()
    for copy in (alice, bob):
        warm(copy)  # cp may copy in the kernel, leaving the copies out of the page cache
    say(
        f"two users' copies (cp -a), the second with {' '.join(SECOND_USER_EXTRA)} "
        f"installed: {time.perf_counter() - started:.1f} s"
    )
    return alice, bob


def stores(work: Path, server: Any | None, started: float) -> tuple[Store, Baseline]:
    """gpufleet's store and the baseline's: on the S3 ``server`` (started at ``started``,
    ``time.perf_counter``), or without one in ``work`` (a ``LocalStore``, and a file)."""
    if server is None:
        (work / "baseline").mkdir()
        say(f"store: LocalStore {work / 'store'}; baseline: a file in {work / 'baseline'}")
        return LocalStore(work / "store"), Baseline(None, "", work / "baseline")
    import boto3

    from gpufleet.snapshotter.s3 import S3Store

    bucket = server.create_bucket("bench")
    options = server.store_options()
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name=options["region"],
        aws_access_key_id=options["access_key"],
        aws_secret_access_key=options["secret_key"],
    )
    say(
        f"store: SeaweedFS S3 at {server.endpoint_url}, bucket {bucket}, data in "
        f"{server.workdir} (started in {time.perf_counter() - started:.1f} s)"
    )
    return S3Store(bucket, "gpufleet", **options), Baseline(client, bucket, None)


@dataclass
class Bench:
    """What the timed steps run on: the users' copies, the stores, the restores' empty
    directory (``tmp``), the working directory, the clock, and the projects' master key."""

    args: argparse.Namespace
    env: Path
    alice: Path
    bob: Path
    store: Store
    baseline: Baseline
    tmp: Path
    work: Path
    clock: Clock
    profile_dir: Path | None
    master: bytes = field(default_factory=new_master_key)


def measure(bench: Bench) -> dict[str, Any]:
    """The rounds, then the changed environment and the second user; the figures."""
    r: dict[str, Any] = {k: [] for k in ("base_up", "full", "unchanged", "base_down", "restore")}
    whole: dict[str, float] = {}
    with bench.clock.timed(whole):
        for i in range(bench.args.rounds):
            say()
            say(f"round {i + 1} of {bench.args.rounds}")
            repository, cache = measure_round(bench, i, r)
        say()
        measure_changes(bench, repository, cache, r)
    cores = os.cpu_count() or 1
    r["steal"] = whole["steal"] / (whole["wall"] * cores)
    r["others"] = max(0.0, whole["cpu_others"]) / (whole["wall"] * cores)
    return r


def measure_round(bench: Bench, i: int, r: dict[str, Any]) -> tuple[Repository, Path]:
    """Round ``i``: the baseline's upload, gpufleet's full and unchanged snapshots of the
    first user's copy, then both restores. The round's repository and stat cache."""
    args, clock, alice = bench.args, bench.clock, bench.alice
    t: dict[str, float] = {}
    with clock.timed(t):
        bench.baseline.upload(alice)
    r["base_up"].append(t)
    r["base_bytes"] = bench.baseline.stored()
    say(f"  baseline tar | zstd -3 -T0 -> upload: {t['wall']:.2f} s; {cpu_note(t)}")

    # Each round a project of its own: nothing to deduplicate against.
    repository = Repository.open(bench.store, f"bench-{i}", bench.master)
    cache = bench.work / f"cache-alice-{i}"
    profile_dir = bench.profile_dir if i == 0 else None
    t = {}
    with profiled("full-snapshot", profile_dir), clock.timed(t):
        full = snapshot(repository, alice, "alice", cache, args)
    r["full"].append(t)
    r["full_bytes"] = full.stats.uploaded_bytes
    say(f"  gpufleet full snapshot: {t['wall']:.2f} s; {describe(full)}; {cpu_note(t)}")
    t = {}
    with profiled("unchanged", profile_dir), clock.timed(t):
        same = snapshot(repository, alice, "alice", cache, args)
    r["unchanged"].append(t)
    say(f"  gpufleet unchanged: {t['wall']:.2f} s; {describe(same)}; {cpu_note(t)}")
    measure_restores(bench, i, full, r)
    return repository, cache


def measure_restores(bench: Bench, i: int, full: Manifest, r: dict[str, Any]) -> None:
    """Round ``i``'s restores into empty directories: the baseline's, then gpufleet's of
    the ``full`` snapshot (checked against the source in the first round)."""
    clock = bench.clock
    target = bench.tmp / f"baseline-{i}"
    target.mkdir()
    t: dict[str, float] = {}
    with clock.timed(t):
        bench.baseline.restore(target)
    r["base_down"].append(t)
    say(f"  baseline download | zstd -d | tar -x: {t['wall']:.2f} s; {cpu_note(t)}")
    shutil.rmtree(target)

    target = bench.tmp / f"gpufleet-{i}"
    t = {}
    with profiled("restore", bench.profile_dir if i == 0 else None), clock.timed(t):
        reader = Repository.open(bench.store, f"bench-{i}", bench.master, create=False)
        manifest = reader.read_manifest(reader.find(full.id))
        restored = restore_snapshot(
            reader,
            manifest,
            targets={manifest.sources[0].name: target},
            workers=bench.args.workers,
            cache_dir=bench.work / f"cache-restore-{i}",
        )
    r["restore"].append(t)
    say(
        f"  gpufleet restore: {t['wall']:.2f} s; {restored.files} files, "
        f"{size(restored.bytes)} from {restored.packs} packs; {cpu_note(t)}"
    )
    if i == 0:
        problems = verify(bench.env, target)
        r["problems"] = len(problems)
        say(f"  the restored tree against the source: {len(problems) or 'no'} differences")
        for problem in problems[:10]:
            say(f"    {problem}")
    shutil.rmtree(target)


def measure_changes(bench: Bench, repository: Repository, cache: Path, r: dict[str, Any]) -> None:
    """What a snapshot uploads after one more package in the first user's copy (its stat
    ``cache`` the last round's), and for the second user's copy, against their size."""
    args, clock, alice, bob = bench.args, bench.clock, bench.alice, bench.bob
    before = stat_map(alice)
    pip_install(alice, ONE_MORE)
    after = stat_map(alice)
    changed = sorted(p for p, sig in after.items() if before.get(p) != sig)
    changed = [p for p in changed if p not in before or not stat.S_ISDIR(after[p][0])]
    r["pkg_bytes"] = zstd_size(alice, changed)
    t: dict[str, float] = {}
    with clock.timed(t):
        added = snapshot(repository, alice, "alice", cache, args)
    r["pkg_up"] = added.stats.uploaded_bytes
    say(
        f"after pip install {' '.join(ONE_MORE)} ({len(changed)} paths added or changed; "
        f"{size(r['pkg_bytes'])} as tar | zstd -3): {t['wall']:.2f} s; {describe(added)}"
    )

    r["bob_bytes"] = zstd_size(bob)
    t = {}
    with clock.timed(t):
        second = snapshot(repository, bob, "bob", bench.work / "cache-bob", args)
    r["bob_up"] = second.stats.uploaded_bytes
    say(
        f"second user (a copy with {' '.join(SECOND_USER_EXTRA)}; {size(r['bob_bytes'])} as "
        f"tar | zstd -3): {t['wall']:.2f} s; {describe(second)}"
    )


def report(r: dict[str, Any], total: int, files: int) -> None:
    def wall(key: str) -> tuple[float, float, float]:
        values = [t["wall"] for t in r[key]]
        return statistics.median(values), min(values), max(values)

    rows = [
        ("full snapshot", wall("full"), wall("base_up"), 1.25, PROTOTYPE["full"]),
        ("nothing changed", wall("unchanged"), wall("base_up"), 0.10, PROTOTYPE["unchanged"]),
        ("one more package: uploaded", r["pkg_up"], r["pkg_bytes"], 1.2, None),
        ("second user: uploaded", r["bob_up"], r["bob_bytes"], 0.30, None),
        ("restore", wall("restore"), wall("base_down"), 1.0, PROTOTYPE["restore"]),
    ]
    rounds = len(r["full"])
    say()
    say(
        f"{size(total)} in {files:,} files; times are medians of {rounds} rounds (min-max); "
        f"other processes took {100 * r['others']:.0f}% and the VM's neighbours "
        f"{100 * r['steal']:.0f}% of the CPU during the run"
    )
    say(f"{'':<27} {'gpufleet':>20} {'baseline':>20} {'ratio':>6} {'target':>7} {'':>5}  prototype")
    for name, value, base, target, proto in rows:
        if isinstance(value, tuple):
            ratio = value[0] / base[0]
            shown = [f"{v[0]:.2f} s ({v[1]:.1f}-{v[2]:.1f})" for v in (value, base)]
        else:
            ratio = value / base
            shown = [size(value), size(base)]
        verdict = "PASS" if ratio <= target else "MISS"
        against = ""
        if proto is not None and isinstance(value, tuple):
            faster = "faster" if value[0] < proto else "slower"
            against = f"{proto:.1f} s: {proto / value[0]:.2f}x ({faster})"
        say(
            f"{name:<27} {shown[0]:>20} {shown[1]:>20} {ratio:>6.3f} {'<= ' + str(target):>7} "
            f"{verdict:>5}  {against}"
        )
    for name, key, base_key in (
        ("full snapshot", "full", "base_up"),
        ("nothing changed", "unchanged", "base_up"),
        ("restore", "restore", "base_down"),
    ):
        ratios = [a["wall"] / b["wall"] for a, b in zip(r[key], r[base_key], strict=True)]
        say(f"{name}: ratio in each round {', '.join(f'{x:.2f}' for x in ratios)}")
    say(
        f"uploaded by the full snapshot {size(r['full_bytes'])}; the baseline's object "
        f"{size(r['base_bytes'])}"
    )
    if r.get("problems"):
        say(f"THE RESTORE DIFFERS FROM THE SOURCE in {r['problems']} paths (see above)")


if __name__ == "__main__":
    main()
