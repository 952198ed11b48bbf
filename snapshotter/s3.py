"""A store in an S3 bucket (AWS S3 or any S3-compatible endpoint), through boto3.

It keeps the guarantees ``store.py`` states for every store:

- ``put`` is atomic: S3 shows a PUT whole or not at all, and a multipart upload only once it
  is completed; a failed multipart upload is aborted, so nothing half-made is left behind;
- ``put(..., if_absent=True)`` is a conditional write (``If-None-Match: *``): a 412 (or a 409
  for a concurrent conditional write) means another writer got there first, and ``put``
  returns False. Stores without conditional writes take ``conditional_writes=False``: a HEAD
  then a PUT, which races, but a second writer of a content-named object writes the same
  bytes, so the race only costs a needless upload;
- every PUT and every part carries a checksum computed here (``checksum``: SHA256, CRC32C,
  CRC32, SHA1, or MD5 as Content-MD5 for stores without flexible checksums), and the store
  refuses data that does not match it. botocore adds none of its own; reads are checked by
  the repository, which authenticates every object;
- ``list`` pages through ListObjectsV2 and returns names relative to the store's prefix, in
  name order, with each object's size and last-modified time;
- errors are the snapshotter's own (``errors.py``), mapped in ``_edge`` with a message that
  names the setting to check. botocore retries only ``max_attempts`` times: callers retry
  ``Transient`` errors with their own policy.

The client is shared by every thread (boto3 clients are thread-safe; the store keeps no
other mutable state). The tests run against a real SeaweedFS server; SSE-KMS (``sse=
"aws:kms"``) is not tested there, as SeaweedFS offers SSE-S3 (``AES256``) only.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import math
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    SSLError,
    ValidationError,
)

from .errors import ObjectMissing, StoreConfigError, StoreFull, StoreRefused, StoreUnreachable
from .objects import ObjectInfo

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's smallest part (all but the last)
MAX_PART_SIZE = 5 * 1024 * MiB  # and its largest part, and its largest single PUT
MAX_PARTS = 10_000
CHECKSUMS = ("SHA256", "CRC32C", "CRC32", "SHA1", "MD5")
SSE_MODES = ("AES256", "aws:kms")
ADDRESSING_STYLES = ("path", "virtual", "auto")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING = {"NoSuchKey", "NotFound", "404"}
_TRANSIENT = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "503"}
_CREDENTIALS = "access_key/secret_key (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
_CHECKSUM = "checksum (try checksum='MD5' if the store computes flexible checksums otherwise)"
_DENIED = f"access denied: check {_CREDENTIALS} and the bucket's policy"
# An error code the store answered -> (class, what to check). The message adds the request.
_REFUSALS: dict[str, tuple[type[Exception], str]] = {
    "InvalidAccessKeyId": (
        StoreRefused,
        f"the store knows no such access key: check {_CREDENTIALS}",
    ),
    "SignatureDoesNotMatch": (StoreRefused, f"wrong signature: check {_CREDENTIALS} and region"),
    "AccessDenied": (StoreRefused, _DENIED),
    "403": (StoreRefused, _DENIED),
    "AllAccessDisabled": (StoreRefused, "all access to the bucket is disabled: check the bucket"),
    "BadDigest": (StoreRefused, f"the data received does not match its {_CHECKSUM}"),
    "InvalidDigest": (StoreRefused, f"the store rejected the {_CHECKSUM}"),
    "XAmzContentSHA256Mismatch": (StoreRefused, f"the data changed in transit; {_CHECKSUM}"),
    "EntityTooSmall": (StoreRefused, "a part is too small: raise multipart_part_size to 5 MiB"),
    "NotImplemented": (
        StoreRefused,
        "the store lacks a feature: try conditional_writes=False, checksum='MD5' or sse=None",
    ),
    "RequestTimeTooSkewed": (StoreRefused, "this machine's clock is off: fix the clock"),
    "EntityTooLarge": (
        StoreFull,
        "the object is too large for the store: lower multipart_threshold",
    ),
    "InsufficientStorage": (StoreFull, "the store has no room left: free space or raise its quota"),
    "QuotaExceeded": (StoreFull, "the bucket's quota is used up: free space or raise the quota"),
}


class S3Store:
    """Objects under ``prefix`` in ``bucket``; see the module docstring for the guarantees."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        checksum: str = "SHA256",
        conditional_writes: bool = True,
        multipart_threshold: int = 64 * MiB,
        multipart_part_size: int = 16 * MiB,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        connect_timeout: float = 5,
        read_timeout: float = 60,
        max_attempts: int = 3,
        addressing_style: str = "path",
        max_pool_connections: int = 32,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        _validate(bucket, self.prefix, locals())
        self._options = {k: v for k, v in locals().items() if k not in ("self", "bucket")}
        self.endpoint_url = endpoint_url
        self.checksum = checksum
        self.conditional_writes = conditional_writes
        self.multipart_threshold = multipart_threshold
        self.multipart_part_size = multipart_part_size
        self._digest = _digest_function(checksum)
        self._sse: dict[str, str] = {}
        if sse:
            self._sse["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._sse["SSEKMSKeyId"] = sse_kms_key_id
        config = Config(
            region_name=region,
            signature_version="s3v4",
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": addressing_style},
            max_pool_connections=max_pool_connections,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        with self._edge("connect to", ""), _SESSION_LOCK:
            self._client = _shared_session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
                config=config,
            )

    def reopen(self) -> S3Store:
        return type(self)(self.bucket, **self._options)

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> S3Store:
        """A store from ``s3://bucket/some/prefix``; ``options`` are ``S3Store``'s."""
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
            raise StoreConfigError(f"snapshot store {uri!r}: use s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, **options)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    # ------------------------------------------------------------ operations
    def put(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        key = self._key(name)
        conditional = if_absent and self.conditional_writes
        if if_absent and not conditional and self.stat(name) is not None:
            return False  # HEAD then PUT: racy, see the module docstring
        with self._edge("write", name):
            try:
                if len(data) >= self.multipart_threshold:
                    self._put_multipart(key, data, conditional)
                else:
                    self._client.put_object(
                        Bucket=self.bucket,
                        Key=key,
                        Body=data,
                        **self._sse,
                        **self.request_checksum(data),
                        **({"IfNoneMatch": "*"} if conditional else {}),
                    )
            except ClientError as e:
                if conditional and _code(e) in _LOST_RACE:
                    return False
                raise
        return True

    def get(self, name: str) -> bytes:
        with self._edge("read", name):
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(name))
            data: bytes = response["Body"].read()
            return data

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        found: list[ObjectInfo] = []
        with self._edge("list", prefix or "(everything)"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(base) :]
                    found.append(ObjectInfo(name, item["Size"], item["LastModified"].timestamp()))
        # AWS lists keys in UTF-8 byte order (which is str order), but not every S3-compatible
        # store does: SeaweedFS lists a "folder" (a/b) before its siblings (a-c, a.x).
        found.sort()
        yield from found

    def delete(self, name: str) -> None:
        with self._edge("delete", name):
            try:
                self._client.delete_object(Bucket=self.bucket, Key=self._key(name))
            except ClientError as e:
                if _code(e) not in _MISSING:
                    raise

    def stat(self, name: str) -> ObjectInfo | None:
        with self._edge("look up", name):
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
            except ClientError as e:
                if _code(e) in _MISSING:
                    return None
                raise
        return ObjectInfo(name, head["ContentLength"], head["LastModified"].timestamp())

    def clean_abandoned(self, prefix: str, older_than: float) -> int:
        """Abort multipart uploads under ``prefix`` begun before ``older_than`` (a writer
        killed mid-upload leaves one, invisible but billed); how many."""
        base = f"{self.prefix}/" if self.prefix else ""
        aborted = 0
        with self._edge("clean up uploads under", prefix or "(everything)"):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                for upload in page.get("Uploads", ()):
                    if upload["Initiated"].timestamp() < older_than:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        return aborted

    def request_checksum(self, data: bytes) -> dict[str, str]:
        """The checksum parameters of a request that sends ``data`` (a whole object or one
        part), computed here so that the store verifies them. The one place they are made:
        a subclass that overrides it can send a wrong one (the tests do)."""
        digest = base64.b64encode(self._digest(data)).decode("ascii")
        if self.checksum == "MD5":
            return {"ContentMD5": digest}
        return {"ChecksumAlgorithm": self.checksum, f"Checksum{self.checksum}": digest}

    # --------------------------------------------------------------- helpers
    def _put_multipart(self, key: str, data: bytes, conditional: bool) -> None:
        algorithm = {} if self.checksum == "MD5" else {"ChecksumAlgorithm": self.checksum}
        upload = self._client.create_multipart_upload(
            Bucket=self.bucket, Key=key, **self._sse, **algorithm
        )
        upload_id = upload["UploadId"]
        part_size = max(self.multipart_part_size, math.ceil(len(data) / MAX_PARTS))
        try:
            parts = []
            for number, start in enumerate(range(0, len(data), part_size), start=1):
                chunk = data[start : start + part_size]
                checksum = self.request_checksum(chunk)
                answer = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                    **checksum,
                )
                part = {"PartNumber": number, "ETag": answer["ETag"]}
                part.update(
                    (k, v)
                    for k, v in checksum.items()
                    if k.startswith("Checksum") and k != "ChecksumAlgorithm"
                )
                parts.append(part)
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **({"IfNoneMatch": "*"} if conditional else {}),
            )
        except BaseException:
            # Leave nothing half-made; the original error is the one worth reporting.
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _key(self, name: str) -> str:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") for p in parts):
            raise StoreConfigError(f"object name {name!r} is not a relative a/b/c path")
        return f"{self.prefix}/{name}" if self.prefix else name

    @contextlib.contextmanager
    def _edge(self, action: str, name: str) -> Iterator[None]:
        """Map botocore's errors to the snapshotter's, saying what to check."""
        where = f"{action} {name!r} in {self.uri}" if name else f"{action} {self.uri}"
        endpoint = self.endpoint_url or "the AWS S3 endpoint"
        try:
            yield
        except ClientError as e:
            code, status = _code(e), e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = e.response.get("Error", {}).get("Message") or code
            if code in _MISSING and action == "read":
                raise ObjectMissing(name, f"object {name!r} is missing from {self.uri}") from None
            if code == "NoSuchBucket":
                raise StoreRefused(
                    f"cannot {where}: bucket {self.bucket!r} does not exist at {endpoint}; "
                    "create it or fix the bucket in the store URI"
                ) from e
            kind, hint = _REFUSALS.get(code, (None, ""))
            if kind is None and status == 507:
                kind, hint = _REFUSALS["InsufficientStorage"]
            if kind is None and (code in _TRANSIENT or (status or 0) >= 500 or status == 429):
                kind, hint = StoreUnreachable, f"the store at {endpoint} is failing or busy"
            if kind is None and code.startswith("KMS"):
                kind, hint = StoreRefused, "KMS refused the key: check sse_kms_key_id"
            if kind is None:
                kind, hint = StoreRefused, "the store refused the request"
            raise kind(f"cannot {where}: {hint} ({code}: {message})") from e
        except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError) as e:
            raise StoreRefused(
                f"cannot {where}: no usable credentials ({e}); set {_CREDENTIALS}"
            ) from e
        except (ParamValidationError, ValidationError, NoRegionError) as e:
            raise StoreConfigError(f"cannot {where}: {e}; check the store's options") from e
        except SSLError as e:
            raise StoreRefused(f"cannot {where}: TLS failed ({e}); check endpoint_url") from e
        except (HTTPClientError, ConnectionError, IncompleteReadError) as e:
            raise StoreUnreachable(
                f"cannot {where}: {endpoint} did not answer ({e}); check endpoint_url, the "
                "network, and that the store is up"
            ) from e
        except BotoCoreError as e:
            raise StoreRefused(f"cannot {where}: {e}") from e


_SESSION_LOCK = threading.Lock()


def _unlock_in_child() -> None:
    """A process forked while another thread held the lock (a restore's workers are
    forked) would otherwise wait for it forever when it makes its own client."""
    global _SESSION_LOCK
    _SESSION_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


@functools.cache
def _shared_session() -> boto3.session.Session:
    """The one session every store's client is made from, under ``_SESSION_LOCK`` (a session is
    not thread-safe; its clients are). It keeps the parsed S3 model, which takes a tenth of a
    second to load, and the credentials it found when none were given."""
    return boto3.session.Session()


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _digest_function(checksum: str) -> Callable[[bytes], bytes]:
    if checksum == "CRC32":
        return lambda data: zlib.crc32(data).to_bytes(4, "big")
    if checksum == "CRC32C":
        return _crc32c_function()
    name = {"SHA256": "sha256", "SHA1": "sha1", "MD5": "md5"}[checksum]
    return lambda data: hashlib.new(name, data).digest()


def _crc32c_function() -> Callable[[bytes], bytes]:
    """CRC32C from the first library installed (the standard library has none)."""
    with contextlib.suppress(ImportError):
        from awscrt import checksums  # type: ignore[import-not-found,unused-ignore]

        return lambda data: int(checksums.crc32c(data)).to_bytes(4, "big")
    with contextlib.suppress(ImportError):
        import google_crc32c  # type: ignore[import-not-found,unused-ignore]

        return lambda data: int(google_crc32c.value(data)).to_bytes(4, "big")
    raise StoreConfigError(
        "checksum='CRC32C' needs the awscrt or google-crc32c package (pip install awscrt); "
        "or choose checksum='SHA256'"
    )


def _validate(bucket: str, prefix: str, o: dict[str, Any]) -> None:
    """Refuse options S3 or this class cannot honour, saying which one and why."""
    checks = [
        (bool(_BUCKET_NAME.match(bucket)), "a bucket name is 3-63 of a-z, 0-9, '.' and '-'"),
        (
            all(p not in ("", ".", "..") for p in prefix.split("/")) or not prefix,
            f"prefix {prefix!r} is not an a/b/c path",
        ),
        (o["checksum"] in CHECKSUMS, f"checksum {o['checksum']!r} is not one of {CHECKSUMS}"),
        (o["sse"] in (None, *SSE_MODES), f"sse {o['sse']!r} is not None or one of {SSE_MODES}"),
        (not o["sse_kms_key_id"] or o["sse"] == "aws:kms", "sse_kms_key_id needs sse='aws:kms'"),
        (
            MIN_PART_SIZE <= o["multipart_part_size"] <= MAX_PART_SIZE,
            f"multipart_part_size is {o['multipart_part_size']}: S3 wants 5 MiB to 5 GiB",
        ),
        (
            0 < o["multipart_threshold"] <= MAX_PART_SIZE,
            f"multipart_threshold is {o['multipart_threshold']}: use 1 byte to 5 GiB",
        ),
        (
            (o["access_key"] is None) == (o["secret_key"] is None),
            "give both access_key and secret_key, or neither (to use AWS's usual sources)",
        ),
        (
            o["addressing_style"] in ADDRESSING_STYLES,
            f"addressing_style {o['addressing_style']!r} is not one of {ADDRESSING_STYLES}",
        ),
        (
            o["endpoint_url"] is None or urlparse(o["endpoint_url"]).scheme in ("http", "https"),
            f"endpoint_url {o['endpoint_url']!r} is not an http:// or https:// URL",
        ),
        (o["connect_timeout"] > 0 and o["read_timeout"] > 0, "time-outs must be positive"),
        (o["max_attempts"] >= 1, "max_attempts must be at least 1"),
        (o["max_pool_connections"] >= 1, "max_pool_connections must be at least 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise StoreConfigError(f"S3 store {bucket!r}: {message}")
