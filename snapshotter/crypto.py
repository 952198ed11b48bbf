"""Keys and sealing: every object a repository writes is encrypted and authenticated.

Key hierarchy:
- the **master key** (32 bytes) is the platform's secret, from the controller's
  configuration (a file); it never leaves the controller and the node agents;
- each project has its own **data key** (64 random bytes), stored in its repository as
  ``keys/data``, sealed with the master key (AES-256-GCM, the project's name as associated
  data, so a key file copied to another project does not open);
- from the data key: ``id_key`` (the first 32 bytes) keys BLAKE3 for content ids, and
  ``seal_key`` (the last 32) is the AES-256-GCM key that seals the project's objects;
- ``keys/check`` holds ``key_check(master, project)``, so that a data key that does not
  open can be told apart: a failed AES-GCM tag alone means a wrong master key *or* a
  changed file, and the two call for different remedies (a setting; a backup).

Deduplication is convergent inside a project: a blob's id is the keyed BLAKE3 hash of its
plaintext, so the same content written by any user of the project gets the same id and is
stored once. Across projects the ids differ and nothing is shared, and a store reader
without the key cannot test whether a repository holds a known file.

A sealed object is ``b"GFS1" || nonce (12) || AES-GCM(ciphertext || tag)``; the associated
data names the object's kind (``pack``, ``index``, ``snapshot``, ...), so a valid object of
one kind cannot be passed off as another.
"""

from __future__ import annotations

import base64
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import CorruptObject, DamagedKey, KeyUnavailable, RepositoryError

MAGIC = b"GFS1"
NONCE_BYTES = 12
ID_BYTES = 32
OVERHEAD = len(MAGIC) + NONCE_BYTES + 16
DATA_KEY_BYTES = 64
WRAPPED_KEY_BYTES = OVERHEAD + DATA_KEY_BYTES  # what keys/data holds, always
KEY_CHECK_BYTES = 32


def read_master_key(path: str | os.PathLike[str]) -> bytes:
    """The master key from a file holding it base64-encoded (``openssl rand -base64 32``)."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise KeyUnavailable(
            f"cannot read the snapshot master key from {path}: {e.strerror}; create it with "
            f"`openssl rand -base64 32 > {path}` and keep it secret"
        ) from e
    try:
        key = base64.b64decode(text, validate=True)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise KeyUnavailable(
            f"{path} must hold 32 random bytes, base64-encoded (`openssl rand -base64 32`)"
        )
    return key


def new_master_key() -> bytes:
    return os.urandom(32)


def seal(key: bytes, kind: bytes, plaintext: bytes | memoryview) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, kind)


def unseal(key: bytes, kind: bytes, sealed: bytes | memoryview, name: str) -> bytes:
    view = memoryview(sealed)
    if len(view) < OVERHEAD or view[: len(MAGIC)] != MAGIC:
        raise CorruptObject(name, "not a gpufleet sealed object (bad header or truncated)")
    nonce = view[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    try:
        return AESGCM(key).decrypt(nonce, view[len(MAGIC) + NONCE_BYTES :], kind)
    except InvalidTag:
        raise CorruptObject(
            name, "authentication failed (changed, truncated, or sealed with another key)"
        ) from None


@dataclass(frozen=True)
class ProjectKeys:
    """A project's data key, split into its two uses."""

    id_key: bytes
    seal_key: bytes

    @classmethod
    def generate(cls) -> ProjectKeys:
        return cls.from_bytes(os.urandom(64))

    @classmethod
    def from_bytes(cls, data: bytes) -> ProjectKeys:
        if len(data) != DATA_KEY_BYTES:
            raise KeyUnavailable(f"a project data key is {DATA_KEY_BYTES} bytes")
        return cls(data[:32], data[32:])

    def to_bytes(self) -> bytes:
        return self.id_key + self.seal_key

    def content_id(self, data: bytes | memoryview) -> bytes:
        return blake3.blake3(data, key=self.id_key).digest()

    def wrap(self, master: bytes, project: str) -> bytes:
        return seal(master, b"key:" + project.encode(), self.to_bytes())

    @classmethod
    def unwrap(
        cls, master: bytes, project: str, sealed: bytes, name: str = "keys/data"
    ) -> ProjectKeys:
        """The data key sealed in ``sealed``. ``DamagedKey`` when the file is not the shape
        every sealed data key has (its length and header are fixed: damage, whatever the
        master key); ``KeyUnavailable`` when its tag fails, which by itself cannot say
        whether the master key or the file is wrong (``diagnose_unwrap`` can, with
        ``keys/check``)."""
        if len(sealed) != WRAPPED_KEY_BYTES or sealed[: len(MAGIC)] != MAGIC:
            raise DamagedKey(
                name,
                f"{len(sealed)} bytes, not a sealed data key ({WRAPPED_KEY_BYTES} bytes "
                f"starting {MAGIC.decode()}): restore it from a backup; without it the "
                f"project's snapshots cannot be read",
            )
        try:
            plain = unseal(master, b"key:" + project.encode(), sealed, name)
        except CorruptObject:
            raise KeyUnavailable(
                f"the master key does not open project {project}'s data key"
            ) from None
        return cls.from_bytes(plain)


def key_check(master: bytes, project: str) -> bytes:
    """What ``keys/check`` holds: keyed BLAKE3 of a fixed label and the project's name,
    under the master key. It shows whether a master key is the repository's without
    opening anything; it tells nothing a 256-bit random key has to fear."""
    return blake3.blake3(b"gpufleet key check\0" + project.encode(), key=master).digest()


def diagnose_unwrap(
    master: bytes, project: str, check: bytes | None, name: str = "keys/data"
) -> RepositoryError:
    """Why a data key whose file has the right shape did not open, from ``keys/check``
    (``None``: the repository has none, it predates it): the error to raise."""
    usage = "--key-file or GPUFLEET_SNAPSHOT_KEY_FILE"
    if check is not None and len(check) == KEY_CHECK_BYTES:
        if hmac.compare_digest(check, key_check(master, project)):
            return DamagedKey(
                name,
                "the master key is the repository's (it matches keys/check), yet the data "
                "key does not open: the file was changed; restore it from a backup — "
                "without it the project's snapshots cannot be read",
            )
        return KeyUnavailable(
            f"this is not the master key project {project}'s repository was created with "
            f"(it does not match keys/check): give that one ({usage})"
        )
    why = "has no keys/check" if check is None else "has a damaged keys/check"
    return KeyUnavailable(
        f"the master key does not open project {project}'s data key, and the repository "
        f"{why} to tell why: either this is not the master key it was created with "
        f"({usage}), or {name} is damaged — AES-GCM cannot tell the two apart"
    )
