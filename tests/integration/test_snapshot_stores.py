"""The snapshot stores' contract, on a local directory and on a real S3 server (SeaweedFS).

The contract tests run once per store; the S3 tests after them look behind the store with a
plain boto3 client (multipart ETags, pending uploads, encryption headers) and make the
server refuse what it should (a wrong checksum, bad credentials, a missing bucket).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpufleet.snapshotter.errors import (
    ObjectMissing,
    StoreConfigError,
    StoreFull,
    StoreRefused,
    StoreUnreachable,
    Transient,
)
from gpufleet.snapshotter.s3 import S3Store
from gpufleet.snapshotter.store import LocalStore, Store, open_store

from ..s3server import S3Server

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
SMALL_MULTIPART = {"multipart_threshold": 6 * MiB, "multipart_part_size": 5 * MiB}
# Every byte order trap: '-' and '.' sort before '/', which sorts before '0'.
NAMES = ["a-c", "a.x", "a/a/z", "a/b", "a0", "b", "packs/01/x", "packs/02/y"]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    s3_store: S3Store = request.getfixturevalue("s3_store")
    return s3_store


def s3(server: S3Server, **options: Any) -> S3Store:
    """A store under a fresh prefix on ``server``, with ``options`` over the defaults."""
    return S3Store(*server.fresh_place(), **{**server.store_options(), **options})


def head(server: S3Server, store: S3Store, name: str) -> dict[str, Any]:
    """The object's headers, as a plain client sees them."""
    answer: dict[str, Any] = server.client().head_object(
        Bucket=store.bucket, Key=f"{store.prefix}/{name}"
    )
    return answer


def pending_uploads(server: S3Server, store: S3Store) -> list[str]:
    """The keys of multipart uploads begun under the store's prefix and never finished."""
    uploads = server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return [u["Key"] for u in uploads.get("Uploads", [])]


class WrongChecksum(S3Store):
    """Sends the checksum of other bytes than it sends, so the server must refuse them."""

    def request_checksum(self, data: bytes) -> dict[str, str]:
        return super().request_checksum(data + b"!")


# ---------------------------------------------------------------- contract
def test_put_then_get_returns_the_same_bytes(store: Store) -> None:
    assert store.put("packs/ab/cd", b"hello") is True
    assert store.get("packs/ab/cd") == b"hello"
    assert store.put("empty", b"") is True
    assert store.get("empty") == b""


def test_if_absent_keeps_the_first_content(store: Store) -> None:
    assert store.put("index/1", b"first", if_absent=True) is True
    assert store.put("index/1", b"second", if_absent=True) is False
    assert store.get("index/1") == b"first"


def test_put_without_if_absent_replaces(store: Store) -> None:
    store.put("refs/latest", b"one")
    assert store.put("refs/latest", b"two") is True
    assert store.get("refs/latest") == b"two"


def test_racing_if_absent_writers_have_one_winner(store: Store) -> None:
    # Few writers: SeaweedFS makes each losing conditional writer wait a second longer.
    start = threading.Barrier(3)

    def write(i: int) -> bool:
        start.wait(timeout=10)
        return store.put("packs/same", f"writer {i}".encode(), if_absent=True)

    with ThreadPoolExecutor(3) as pool:
        won = list(pool.map(write, range(3)))
    assert won.count(True) == 1
    assert store.get("packs/same") == f"writer {won.index(True)}".encode()


def test_list_returns_names_by_prefix_in_order_with_sizes_and_times(store: Store) -> None:
    before = time.time()
    for name in reversed(NAMES):
        store.put(name, name.encode() * 2)
    after = time.time()
    listed = list(store.list(""))
    assert [o.name for o in listed] == sorted(NAMES)
    assert [o.size for o in listed] == [2 * len(n) for n in sorted(NAMES)]
    # Some stores keep whole seconds only.
    assert all(before - 2 <= o.modified <= after + 2 for o in listed)
    assert [o.name for o in store.list("a/")] == ["a/a/z", "a/b"]
    assert [o.name for o in store.list("a")] == ["a-c", "a.x", "a/a/z", "a/b", "a0"]
    assert [o.name for o in store.list("packs/0")] == ["packs/01/x", "packs/02/y"]
    assert list(store.list("nothing/")) == []


def test_delete_removes_and_a_missing_object_is_fine(store: Store) -> None:
    store.put("a/b", b"x")
    store.delete("a/b")
    assert store.stat("a/b") is None
    store.delete("a/b")
    store.delete("never/was")


def test_get_of_a_missing_object_raises_object_missing(store: Store) -> None:
    with pytest.raises(ObjectMissing) as caught:
        store.get("packs/none")
    assert caught.value.name == "packs/none"


def test_stat_reports_size_and_time_or_none(store: Store) -> None:
    before = time.time()
    store.put("keys/k", b"12345")
    info = store.stat("keys/k")
    assert info is not None
    assert (info.name, info.size) == ("keys/k", 5)
    assert before - 2 <= info.modified <= time.time() + 2
    assert store.stat("keys/none") is None


@pytest.mark.parametrize("name", ["", "/abs", "a//b", "../up", "a/./b", "a/"])
def test_names_outside_the_layout_are_refused(store: Store, name: str) -> None:
    with pytest.raises(StoreConfigError):
        store.put(name, b"x")


# ---------------------------------------------------------------- S3 only
def test_large_objects_go_through_multipart(s3_server: S3Server) -> None:
    store = s3(s3_server, **SMALL_MULTIPART)
    data = os.urandom(12 * MiB)
    assert store.put("packs/big", data) is True
    assert store.get("packs/big") == data
    # A multipart ETag ends with the number of parts: here 5 + 5 + 2 MiB.
    assert head(s3_server, store, "packs/big")["ETag"].strip('"').endswith("-3")
    store.put("packs/small", data[: 6 * MiB - 1])  # just below the threshold: one PUT
    assert "-" not in head(s3_server, store, "packs/small")["ETag"]
    assert pending_uploads(s3_server, store) == []


def test_multipart_if_absent_on_an_existing_key_returns_false_and_leaves_nothing(
    s3_server: S3Server,
) -> None:
    store = s3(s3_server, **SMALL_MULTIPART)
    first = os.urandom(7 * MiB)
    assert store.put("packs/big", first, if_absent=True) is True
    assert store.put("packs/big", os.urandom(7 * MiB), if_absent=True) is False
    assert store.get("packs/big") == first
    assert pending_uploads(s3_server, store) == []


@pytest.mark.parametrize("size", [1000, 7 * MiB], ids=["put", "multipart"])
@pytest.mark.parametrize("checksum", ["SHA256", "CRC32", "SHA1", "MD5"])
def test_every_checksum_mode_round_trips(s3_server: S3Server, checksum: str, size: int) -> None:
    store = s3(s3_server, checksum=checksum, **SMALL_MULTIPART)
    data = os.urandom(size)
    assert store.put("packs/x", data) is True
    assert store.get("packs/x") == data


@pytest.mark.parametrize("size", [1000, 7 * MiB], ids=["put", "multipart"])
@pytest.mark.parametrize("checksum", ["SHA256", "CRC32", "SHA1", "MD5"])
def test_a_wrong_checksum_is_refused_and_nothing_is_stored(
    s3_server: S3Server, checksum: str, size: int
) -> None:
    options = {**s3_server.store_options(), **SMALL_MULTIPART, "checksum": checksum}
    store = WrongChecksum(*s3_server.fresh_place(), **options)
    with pytest.raises(StoreRefused, match="checksum"):
        store.put("packs/x", os.urandom(size))
    assert store.stat("packs/x") is None
    assert pending_uploads(s3_server, store) == []


def test_crc32c_works_or_says_what_to_install(s3_server: S3Server) -> None:
    try:
        store = s3(s3_server, checksum="CRC32C")
    except StoreConfigError as e:
        assert "awscrt" in str(e)  # the standard library has no CRC32C
        return
    assert store.put("packs/x", b"data") is True
    assert store.get("packs/x") == b"data"


@pytest.mark.parametrize("size", [1000, 7 * MiB], ids=["put", "multipart"])
def test_sse_s3_encrypts_objects(s3_server: S3Server, size: int) -> None:
    store = s3(s3_server, sse="AES256", **SMALL_MULTIPART)
    data = os.urandom(size)
    store.put("packs/x", data)
    assert head(s3_server, store, "packs/x")["ServerSideEncryption"] == "AES256"
    assert store.get("packs/x") == data


def test_without_conditional_writes_if_absent_still_keeps_the_first(s3_server: S3Server) -> None:
    store = s3(s3_server, conditional_writes=False)
    assert store.put("packs/x", b"first", if_absent=True) is True
    assert store.put("packs/x", b"second", if_absent=True) is False
    assert store.get("packs/x") == b"first"


def test_names_are_under_the_prefix_of_the_uri(s3_server: S3Server) -> None:
    bucket = s3_server.create_bucket()
    store = open_store(f"s3://{bucket}/team/repo/", **s3_server.store_options())
    assert isinstance(store, S3Store)
    assert store.uri == f"s3://{bucket}/team/repo"
    store.put("packs/x", b"1")
    keys = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [k["Key"] for k in keys] == ["team/repo/packs/x"]
    assert [o.name for o in store.list("")] == ["packs/x"]
    sibling = S3Store.from_uri(f"s3://{bucket}/team/repo2", **s3_server.store_options())
    assert list(sibling.list("")) == []
    whole = S3Store.from_uri(f"s3://{bucket}", **s3_server.store_options())
    assert [o.name for o in whole.list("team/")] == ["team/repo/packs/x"]


def test_an_unreachable_endpoint_is_transient_and_quick() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store(
        "bucket", endpoint_url=f"http://127.0.0.1:{port}", access_key="a", secret_key="b"
    )
    started = time.monotonic()
    for call in (lambda: store.put("x", b"1"), lambda: store.get("x"), lambda: store.stat("x")):
        with pytest.raises(StoreUnreachable, match="endpoint_url") as caught:
            call()
        assert isinstance(caught.value, Transient)
    assert time.monotonic() - started < 10  # three calls, each with botocore's few retries


@pytest.mark.parametrize(
    ("change", "named"),
    [({"secret_key": "wrong"}, "secret_key"), ({"access_key": "nobody"}, "access_key")],
)
def test_bad_credentials_are_refused_naming_them(
    s3_server: S3Server, change: dict[str, str], named: str
) -> None:
    store = S3Store(*s3_server.fresh_place(), **{**s3_server.store_options(), **change})
    for call in (lambda: store.put("x", b"1"), lambda: store.get("x"), lambda: store.stat("x")):
        with pytest.raises(StoreRefused, match=named):
            call()


def test_a_missing_bucket_is_refused_naming_it(s3_server: S3Server) -> None:
    store = S3Store("no-such-bucket", **s3_server.store_options())
    with pytest.raises(StoreRefused, match="bucket 'no-such-bucket' does not exist"):
        store.put("x", b"1")
    with pytest.raises(StoreRefused, match="no-such-bucket"):
        list(store.list(""))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"checksum": "MD4"}, "checksum 'MD4' is not one of"),
        ({"multipart_part_size": MiB}, "multipart_part_size"),
        ({"multipart_threshold": 0}, "multipart_threshold"),
        ({"sse": "AES128"}, "sse 'AES128'"),
        ({"sse_kms_key_id": "key"}, "sse_kms_key_id needs sse='aws:kms'"),
        ({"access_key": "a"}, "both access_key and secret_key"),
        ({"addressing_style": "dns"}, "addressing_style"),
        ({"endpoint_url": "ftp://host"}, "endpoint_url"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"read_timeout": 0}, "time-outs"),
    ],
)
def test_bad_options_say_which_one(options: dict[str, Any], says: str) -> None:
    with pytest.raises(StoreConfigError, match=says):
        S3Store("bucket", **options)


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix", "s3://Bad_Bucket/x", "s3://b/a/../c"])
def test_bad_uris_say_the_form(uri: str) -> None:
    with pytest.raises(StoreConfigError):
        S3Store.from_uri(uri)


# ------------------------------------------------------------- local only
def test_a_full_disk_is_store_full_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs to fill needs root")
    disk = tmp_path / "tiny"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {mount.stderr.strip()}")
    try:
        store = LocalStore(disk / "store")
        with pytest.raises(StoreFull, match="free some space"):
            store.put("packs/big", os.urandom(2 * MiB))
        assert [p.name for p in (disk / "store").rglob("*") if p.is_file()] == []
        assert store.put("packs/small", b"still works") is True
    finally:
        subprocess.run(["umount", str(disk)], check=True)
