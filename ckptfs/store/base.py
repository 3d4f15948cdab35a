"""The object-store interface every backend implements.

All methods are blocking (callers run them in threads via ``trio.to_thread``)
and idempotent where the verb allows it: retrying a call after a crash or a
timeout must be safe. Keys are relative to the store's prefix, use ``/`` as
separator and never start with ``/``. A key ending in ``/`` is a directory
marker (a zero-byte object, as S3 tools make for empty folders).
"""

from __future__ import annotations

import builtins
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptfs.errors import NotFound

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40


@dataclass(frozen=True)
class StoreLimits:
    """What a store accepts: keys of at most ``max_key_bytes`` bytes (UTF-8), multipart uploads of
    at most ``max_parts`` parts, each of ``min_part_size``..``max_part_size`` bytes but the last
    (which may be smaller), objects of at most ``max_object_size`` bytes. A store declares its
    own in ``ObjectStore.limits``."""

    max_key_bytes: int = 1024
    max_parts: int = 10_000
    min_part_size: int = 5 * MiB
    max_part_size: int = 5 * GiB
    max_object_size: int = 5 * TiB

    @property
    def max_file_size(self) -> int:
        """The largest file a mount can store: one object, in at most ``max_parts`` parts."""
        return min(self.max_object_size, self.max_parts * self.max_part_size)


# S3's (and what every ckptfs store keeps to, so that a mount's files fit any of them): at most
# 10,000 parts per upload, parts of 5 MiB..5 GiB (but the last), objects of at most 5 TiB, keys
# of at most 1024 bytes.
# (User metadata: at most 2 KiB.)
S3_LIMITS = StoreLimits()
MAX_PARTS = S3_LIMITS.max_parts
MAX_KEY_BYTES = S3_LIMITS.max_key_bytes
# Top-level keys starting with this are ckptfs's own (checksum manifests, the local store's files):
# never a path on a mount, never listed, verified or collected as a checkpoint.
RESERVED_PREFIX = ".ckptfs-"


def redact_url(url: str) -> str:
    """The URL as it may be printed or logged: any user:password@ part masked."""
    return re.sub(r"//[^/?#]*@", "//***@", url)  # (to the authority's last @: a password may hold one)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch
    metadata: dict[str, str] = field(default_factory=dict)
    etag: str = ""  # the store's identity of this content (S3 ETag), "" where the store has none


@dataclass(frozen=True)
class DirListing:
    """One level of the store under a directory prefix (``list_dir``)."""

    files: list[ObjectInfo]  # objects right under the prefix (not its own marker)
    dirs: list[str]  # names of the sub-directories: common prefixes, markers included
    exists: bool  # whether anything is under the prefix at all (its own marker counts)


@dataclass(frozen=True)
class PartInfo:
    number: int  # 1-based, as in S3
    token: str  # what complete_multipart needs back (the ETag on S3)
    xxh3: str = ""  # ckptfs's checksum of the part's bytes (for the manifest), "" where unknown


class ObjectStore(ABC):
    """One bucket/prefix (S3) or one directory (local)."""

    # Whether transfer/workers.py can send this store's parts from worker processes (S3's).
    sends_from_workers = False

    url: str  # printable location, never with credentials
    limits: StoreLimits = S3_LIMITS  # what it accepts (keys, part count, part sizes)
    # Learned: the server refused a completion that left uploaded parts out (PartsLeftOut).
    refuses_parts_left_out = False

    def key_room(self) -> int:
        """How long (UTF-8 bytes) a key may be: the key limit less what the store puts before
        every key (S3's prefix)."""
        return self.limits.max_key_bytes

    server_checksums = False  # whether parts carry a checksum the server verifies (S3: CRC32C)

    def detect_server_checksums(self) -> bool:
        """Find out (once, at mount) whether the store verifies checksums sent with each upload,
        and send them from then on if so. Stores with nothing to detect return False."""
        return False

    def report_to(self, health) -> None:
        """Report each request attempt to ``health`` (a StoreHealth) where the backend can see
        them (S3: botocore's retries); others are reported by their callers."""

    @abstractmethod
    def check(self) -> None:
        """Fail with a clear one-line StoreError if the store cannot be used
        (unreachable endpoint, missing bucket, wrong credentials, bad path)."""

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        """Write a whole object; it appears atomically."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object (shorter at its end). NotFound if absent."""

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        """``get_range`` and the object's user metadata as the same answer saw it (stores
        whose GET carries the metadata override this with one request)."""
        info = self.head(key)
        if info is None:
            raise NotFound(f"get {key}: no such key")
        return self.get_range(key, start, length), info.metadata

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size, mtime and user metadata, or None if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively, directory
        markers included (metadata may be left empty)."""

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        """One level under ``prefix`` ("" or ending in ``/``): the objects right under it and
        the names of its sub-directories, in key order. ``limit``: stop after that many entries
        (``list_dir(key + "/", limit=1).exists`` asks whether a directory exists). This generic
        version walks ``list``; stores override it with a one-level listing."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir needs a directory prefix, not {prefix!r}")
        files: builtins.list[ObjectInfo] = []
        dirs: builtins.list[str] = []
        exists = not prefix
        for info in self.list(prefix):
            exists = True
            rest = info.key[len(prefix) :]
            if not rest:
                continue  # the directory's own marker
            name, sep, _ = rest.partition("/")
            if not sep:
                files.append(info)
            elif not dirs or dirs[-1] != name:  # keys under one name are contiguous in key order
                dirs.append(name)
            else:
                continue
            if limit is not None and len(files) + len(dirs) >= limit:
                break
        return DirListing(files, dirs, exists)

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; absent is not an error."""

    @abstractmethod
    def set_metadata(self, key: str, metadata: dict[str, str]) -> None:
        """Set these user metadata entries on ``key`` (others are kept), without copying its data
        through the client. A directory key ("x/") gets a marker carrying them. NotFound if absent."""

    @abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Server-side copy with metadata. NotFound if ``src`` is absent."""

    @abstractmethod
    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        """Start a multipart upload; returns its upload id."""

    @abstractmethod
    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        """Upload part ``number`` (1-based); uploading the same number again replaces it."""

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        """Part ``number`` made of ``length`` zero bytes (a sparse file's hole). Stores that can
        make one without being sent the bytes override this (a server-side copy, a punched hole)."""
        return self.upload_part(key, upload_id, number, bytes(length))

    @abstractmethod
    def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[PartInfo]) -> None:
        """Make the object appear under ``key``, made of ``parts`` in order."""

    @abstractmethod
    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts; unknown ids are not an error."""

    @abstractmethod
    def list_multipart(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        """Unfinished uploads under ``prefix`` as (key, upload_id)."""

    def list_multipart_started(self, prefix: str = "") -> builtins.list[float]:
        """When each unfinished upload under ``prefix`` was started (seconds since the epoch).
        Stores that cannot tell say every one started at 0 (before anything)."""
        return [0.0 for _ in self.list_multipart(prefix)]

    def close(self) -> None:
        """Release connections."""
