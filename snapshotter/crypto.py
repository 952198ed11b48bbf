"""Keys and sealing: every object a repository writes is encrypted and authenticated.

Key hierarchy:
- the **master key** (32 bytes) is the platform's secret, from the controller's
  configuration (a file); it never leaves the controller and the node agents;
- each project has its own **data key** (64 random bytes), stored in its repository as
  ``keys/data``, sealed with the master key (AES-256-GCM, the project's name as associated
  data, so a key file copied to another project does not open);
- from the data key: ``id_key`` (the first 32 bytes) keys BLAKE3 for content ids, and
  ``seal_key`` (the last 32) is the AES-256-GCM key that seals the project's objects.

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
import os
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import CorruptObject, KeyUnavailable

MAGIC = b"GFS1"
NONCE_BYTES = 12
ID_BYTES = 32
OVERHEAD = len(MAGIC) + NONCE_BYTES + 16


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
        if len(data) != 64:
            raise KeyUnavailable("a project data key is 64 bytes")
        return cls(data[:32], data[32:])

    def to_bytes(self) -> bytes:
        return self.id_key + self.seal_key

    def content_id(self, data: bytes | memoryview) -> bytes:
        return blake3.blake3(data, key=self.id_key).digest()

    def wrap(self, master: bytes, project: str) -> bytes:
        return seal(master, b"key:" + project.encode(), self.to_bytes())

    @classmethod
    def unwrap(cls, master: bytes, project: str, sealed: bytes) -> ProjectKeys:
        try:
            return cls.from_bytes(unseal(master, b"key:" + project.encode(), sealed, "keys/data"))
        except CorruptObject:
            raise KeyUnavailable(
                f"the master key does not open project {project}'s data key: is this the "
                f"master key the repository was created with?"
            ) from None
