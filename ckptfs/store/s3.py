"""The S3 store: any S3-compatible endpoint through boto3.

``S3Store``: the object verbs (ranged get, listings, delete, metadata, copy) here; it holds two
collaborators: an ``S3Client`` (s3_client.py: the session and its clients, signing, CRC32C
checksums, error mapping, the server-checksum probe, ``check``, the health hooks, and the PUT and
HEAD the multipart uploads need too) and an ``S3Multipart`` (s3_multipart.py: the multipart
uploads), built on that client.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import TYPE_CHECKING

import botocore.exceptions as bex

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.store.base import DirListing, ObjectInfo, ObjectStore, PartInfo
from ckptfs.store.s3_client import S3Client, etag_of, part_token
from ckptfs.store.s3_multipart import S3Multipart

if TYPE_CHECKING:
    from ckptfs.store.health import StoreHealth

GiB = 1 << 30


class S3Store(ObjectStore):
    """The store a ``client`` reaches (a bucket, a prefix): the object verbs here, through the
    client; the multipart verbs handed to its ``multipart`` (built on the same client).
    ``S3Store.connect(bucket, prefix, ...)`` builds both."""

    # Above 5 GiB CopyObject is refused: copy in ranges instead (class attrs so tests can shrink them).
    max_single_copy = 5 * GiB
    sends_from_workers = True
    copy_part_size = 1 * GiB

    def __init__(self, client: S3Client, multipart: S3Multipart):
        self.client = client
        self.multipart = multipart
        self.url = client.url

    @classmethod
    def connect(
        cls, bucket: str, prefix: str = "", endpoint_url: str | None = None, max_connections: int = 16
    ) -> S3Store:
        """The store in ``bucket`` under ``prefix`` (no request is sent yet)."""
        client = S3Client(bucket, prefix, endpoint_url=endpoint_url, max_connections=max_connections)
        return cls(client, S3Multipart(client))

    @property
    def server_checksums(self) -> bool:  # type: ignore[override]  # (the client's, found by the probe)
        return self.client.server_checksums

    def detect_server_checksums(self) -> bool:
        return self.client.detect_server_checksums()

    def report_to(self, health: StoreHealth) -> None:
        self.client.report_to(health)

    def key_room(self) -> int:
        return self.limits.max_key_bytes - len(self.client.base.encode())

    def check(self) -> None:
        self.client.check()

    def close(self) -> None:
        self.client.close()

    # -- ObjectStore -------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        self.client.put(key, data, metadata)

    def head(self, key: str) -> ObjectInfo | None:
        return self.client.head(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get_range_meta(key, start, length)[0]

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        """One ranged GET: the bytes and the object's user metadata from its answer."""
        if length <= 0:
            info = self.head(key)
            if info is None:
                raise NotFound(f"get s3://{self.client.bucket}/{self.client.base}{key}: no such key")
            return b"", info.metadata
        return self._ranged_get(key, start, length, _read_whole, b"")

    def get_range_into(self, key: str, start: int, out: memoryview) -> tuple[int, dict[str, str]]:
        """``get_range_meta`` into ``out`` (a reused buffer): the bytes received, at most
        ``len(out)`` (fewer: a short body), and the object's metadata. The body goes from the
        socket straight into ``out`` (http.client's ``readinto``, under botocore and urllib3):
        no new object per GET, whose first touch and copy cost about as much again (measured:
        0.46 against 0.87 CPU s per GiB)."""
        return self._ranged_get(key, start, len(out), lambda body: _read_into(body, out), 0)

    def _ranged_get(self, key: str, start: int, length: int, take, nothing):
        """One ranged GET: what ``take`` makes of its body, and the object's user metadata;
        ``nothing`` where the object has no byte at ``start``. Errors mapped as every call's."""
        try:
            resp = self.client.boto.get_object(
                Bucket=self.client.bucket,
                Key=self.client.key(key),
                Range=f"bytes={start}-{start + length - 1}",
            )
            return take(resp["Body"]), dict(resp.get("Metadata", {}))
        except bex.ClientError as e:
            # 416: the object exists but starts before `start` (or is empty): nothing to read.
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                info = self.head(key)
                return nothing, info.metadata if info is not None else {}
            self.client.fail("get", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self.client.fail("get", key, e)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        try:
            pages = self.client.boto.get_paginator("list_objects_v2").paginate(
                Bucket=self.client.bucket, Prefix=self.client.base + prefix
            )
            for page in pages:
                for o in page.get("Contents", []):
                    key = o["Key"][len(self.client.base) :]
                    if key:  # skip the "prefix/" marker itself
                        yield ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=etag_of(o))
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self.client.fail("list", prefix, e)

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        """ListObjectsV2 with Delimiter='/': one level, sub-directories as common prefixes."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir needs a directory prefix, not {prefix!r}")
        full = self.client.base + prefix
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        exists = not prefix
        try:
            if limit is not None:
                pages = [
                    self.client.boto.list_objects_v2(
                        Bucket=self.client.bucket, Prefix=full, Delimiter="/", MaxKeys=max(limit, 1)
                    )
                ]
            else:
                pages = self.client.boto.get_paginator("list_objects_v2").paginate(
                    Bucket=self.client.bucket, Prefix=full, Delimiter="/"
                )
            for page in pages:
                for o in page.get("Contents", []):
                    exists = True
                    key = o["Key"][len(self.client.base) :]
                    if key != prefix:  # (not the directory's own marker)
                        files.append(
                            ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=etag_of(o))
                        )
                for p in page.get("CommonPrefixes", []):
                    exists = True
                    dirs.append(p["Prefix"][len(full) : -1])
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self.client.fail("list", prefix, e)
        if limit is not None:
            del files[limit:]
            del dirs[max(limit - len(files), 0) :]
        return DirListing(files, dirs, exists)

    def delete(self, key: str) -> None:
        try:
            self.client.boto.delete_object(Bucket=self.client.bucket, Key=self.client.key(key))
        except bex.ClientError as e:
            if (
                e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404
                or e.response.get("Error", {}).get("Code") == "NoSuchBucket"
            ):
                self.client.fail("delete", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self.client.fail("delete", key, e)

    def set_metadata(self, key: str, metadata: dict[str, str]) -> None:
        """A server-side copy of the object onto itself (CopyObject, MetadataDirective=REPLACE)
        with its metadata merged; a directory marker is written again."""
        if key.endswith("/"):
            self.put(key, b"", metadata)
            return
        info = self.head(key)
        if info is None:
            raise NotFound(f"set_metadata s3://{self.client.bucket}/{self.client.base}{key}: no such key")
        if info.size > self.max_single_copy:
            self.copy(key, key, metadata)
            return
        source = {"Bucket": self.client.bucket, "Key": self.client.key(key)}
        merged = {**info.metadata, **metadata}
        try:
            # If-Match: a version another mount wrote since the HEAD keeps its own metadata (ckptfs's
            # checksums and hash belong to the bytes).
            self.client.call(
                "set_metadata",
                key,
                "copy_object",
                Key=self.client.key(key),
                CopySource=source,
                CopySourceIfMatch=info.etag,
                MetadataDirective="REPLACE",
                Metadata=merged,
            )
        except StoreError as exc:
            if "PreconditionFailed" not in str(exc):
                raise
            # Swift compares a multipart object's ETag in If-Match unlike S3 and always refuses it:
            # still the same object, copy it unconditionally; else a later retry starts over.
            now = self.head(key)
            if now is None or now.etag != info.etag or now.metadata != info.metadata:
                raise StoreError(
                    f"set_metadata {key}: the object changed meanwhile", transient=True
                ) from None
            self.client.call(
                "set_metadata",
                key,
                "copy_object",
                Key=self.client.key(key),
                CopySource=source,
                MetadataDirective="REPLACE",
                Metadata=merged,
            )

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> None:
        """Server-side copy; ``metadata``: entries that replace the source's (others are kept)."""
        info = self.head(src)
        if info is None:
            raise NotFound(f"copy s3://{self.client.bucket}/{self.client.base}{src}: no such key")
        source = {"Bucket": self.client.bucket, "Key": self.client.key(src)}
        if info.size <= self.max_single_copy:
            self.client.call(
                "copy",
                f"{src} -> {dst}",
                "copy_object",
                Key=self.client.key(dst),
                CopySource=source,
                MetadataDirective="COPY",
            )
            return
        upload_id = self.create_multipart(dst, {**info.metadata, **(metadata or {})})
        try:
            parts = []
            for n, off in enumerate(range(0, info.size, self.copy_part_size), start=1):
                end = min(off + self.copy_part_size, info.size) - 1
                r = self.client.call(
                    "copy",
                    f"{src} -> {dst}",
                    "upload_part_copy",
                    Key=self.client.key(dst),
                    UploadId=upload_id,
                    PartNumber=n,
                    CopySource=source,
                    CopySourceRange=f"bytes={off}-{end}",
                )
                parts.append(
                    PartInfo(
                        n, part_token(r["CopyPartResult"]["ETag"], r["CopyPartResult"].get("ChecksumCRC32C"))
                    )
                )
            self.complete_multipart(dst, upload_id, parts)
        except BaseException:
            try:
                self.abort_multipart(dst, upload_id)
            except StoreError:
                pass  # the original error matters more; a stale upload shows in list_multipart
            raise

    # -- multipart uploads: the client's S3Multipart -------------------------------------------

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        return self.multipart.create(key, metadata)

    def upload_part(
        self, key: str, upload_id: str, number: int, data: bytes | memoryview, checksummed: bool | None = None
    ) -> PartInfo:
        return self.multipart.upload_part(key, upload_id, number, data, checksummed)

    def part_checksums(self, key: str, upload_id: str) -> bool:
        """Whether the upload's parts carry their CRC32C (told to a store worker with each part)."""
        return self.multipart.uses_checksums(key, upload_id)

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        return self.multipart.upload_zero_part(key, upload_id, number, length)

    def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[PartInfo]) -> None:
        try:
            self.multipart.complete(key, upload_id, parts)
        except PartsLeftOut:
            self.refuses_parts_left_out = True
            raise

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.multipart.abort(key, upload_id)

    def list_multipart(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        return self.multipart.unfinished(prefix)

    def list_multipart_started(self, prefix: str = "") -> builtins.list[float]:
        return self.multipart.unfinished_started(prefix)


def _read_whole(body) -> bytes:
    try:
        # StreamingBody.read (not the raw stream its context manager hands out) turns a reset
        # or a short body into a botocore error, which the caller maps.
        return body.read()
    finally:
        body.close()


def _read_into(body, out: memoryview) -> int:
    """The body into ``out``: the bytes received (fewer than ``len(out)``: a short body)."""
    length = len(out)
    raw = getattr(body, "_raw_stream", None)
    wire = getattr(raw, "_fp", None)  # (urllib3's HTTPResponse: its http.client response)
    if raw is None or wire is None or not hasattr(raw, "release_conn"):  # (other versions: one copy more)
        data = _read_whole(body)
        out[: min(len(data), length)] = data[:length]
        return min(len(data), length)
    got = 0
    try:
        while got < length and (n := wire.readinto(out[got:])):
            got += n
    except BaseException:
        body.close()  # (the connection is in no state to be reused)
        raise
    if got == length and wire.isclosed():
        raw.release_conn()  # (the whole body read: the connection serves the next request)
    else:
        body.close()
    return got
