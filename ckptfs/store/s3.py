"""The S3 store: any S3-compatible endpoint through boto3.

``S3Store``: the object verbs (put, ranged get, head, listings, delete, metadata, copy) on top of
the S3 store's two other modules: s3_client.py (``S3Client``: the session and its clients,
signing, CRC32C checksums, error mapping, the server-checksum probe, ``check``, the health
hooks) and s3_multipart.py (``S3Multipart``: the multipart uploads).
"""

from __future__ import annotations

from collections.abc import Iterator

import botocore.exceptions as bex

from ckptfs.errors import NotFound, StoreError
from ckptfs.store.base import DirListing, ObjectInfo, PartInfo
from ckptfs.store.s3_client import (
    CHECKSUM_ALGORITHM,
    checksum_headers,
    crc32c_b64,
    etag_of,
    part_token,
)
from ckptfs.store.s3_crt import Body
from ckptfs.store.s3_multipart import S3Multipart

GiB = 1 << 30


class S3Store(S3Multipart):
    # Above 5 GiB CopyObject is refused: copy in ranges instead (class attrs so tests can shrink them).
    max_single_copy = 5 * GiB
    copy_part_size = 1 * GiB

    # -- ObjectStore -------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        crc = crc32c_b64(data) if self.server_checksums else None
        if self._crt() is not None:
            meta = [(f"x-amz-meta-{k}", v) for k, v in (metadata or {}).items()]
            try:
                self._crt_send(
                    "put",
                    key,
                    "PUT",
                    self._crt_path(key),
                    [*meta, *checksum_headers(crc)],
                    body=data,
                    signed_payload=crc is None,
                )
            except (bex.ClientError, OSError) as e:
                self._fail("put", key, e)
            return
        body = Body(data)
        extra = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "ChecksumCRC32C": crc} if crc else {}
        self._call(
            "put",
            key,
            "put_object",
            client=self._body_client(crc),
            Key=self._key(key),
            Body=body,
            Metadata=metadata or {},
            **extra,
        )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get_range_meta(key, start, length)[0]

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        """One ranged GET: the bytes and the object's user metadata from its answer."""
        if length <= 0:
            info = self.head(key)
            if info is None:
                raise NotFound(f"get s3://{self.bucket}/{self._base}{key}: no such key")
            return b"", info.metadata
        try:
            resp = self._client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            body = resp["Body"]
            try:
                # StreamingBody.read (not the raw stream its context manager hands out) turns
                # a reset or a short body into a botocore error, which we map below.
                return body.read(), dict(resp.get("Metadata", {}))
            finally:
                body.close()
        except bex.ClientError as e:
            # 416: the object exists but starts before `start` (or is empty): nothing to read.
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                info = self.head(key)
                return b"", info.metadata if info is not None else {}
            self._fail("get", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self._fail("get", key, e)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            self._fail("head", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self._fail("head", key, e)
        return ObjectInfo(
            key, r["ContentLength"], r["LastModified"].timestamp(), dict(r.get("Metadata", {})), etag_of(r)
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._base + prefix
            )
            for page in pages:
                for o in page.get("Contents", []):
                    key = o["Key"][len(self._base) :]
                    if key:  # skip the "prefix/" marker itself
                        yield ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=etag_of(o))
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail("list", prefix, e)

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        """ListObjectsV2 with Delimiter='/': one level, sub-directories as common prefixes."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir needs a directory prefix, not {prefix!r}")
        full = self._base + prefix
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        exists = not prefix
        try:
            if limit is not None:
                pages = [
                    self._client.list_objects_v2(
                        Bucket=self.bucket, Prefix=full, Delimiter="/", MaxKeys=max(limit, 1)
                    )
                ]
            else:
                pages = self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full, Delimiter="/"
                )
            for page in pages:
                for o in page.get("Contents", []):
                    exists = True
                    key = o["Key"][len(self._base) :]
                    if key != prefix:  # (not the directory's own marker)
                        files.append(
                            ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=etag_of(o))
                        )
                for p in page.get("CommonPrefixes", []):
                    exists = True
                    dirs.append(p["Prefix"][len(full) : -1])
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail("list", prefix, e)
        if limit is not None:
            del files[limit:]
            del dirs[max(limit - len(files), 0) :]
        return DirListing(files, dirs, exists)

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except bex.ClientError as e:
            if (
                e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404
                or e.response.get("Error", {}).get("Code") == "NoSuchBucket"
            ):
                self._fail("delete", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self._fail("delete", key, e)

    def set_metadata(self, key: str, metadata: dict[str, str]) -> None:
        """A server-side copy of the object onto itself (CopyObject, MetadataDirective=REPLACE)
        with its metadata merged; a directory marker is written again."""
        if key.endswith("/"):
            self.put(key, b"", metadata)
            return
        info = self.head(key)
        if info is None:
            raise NotFound(f"set_metadata s3://{self.bucket}/{self._base}{key}: no such key")
        if info.size > self.max_single_copy:
            self.copy(key, key, metadata)
            return
        source = {"Bucket": self.bucket, "Key": self._key(key)}
        merged = {**info.metadata, **metadata}
        try:
            # If-Match: a version another mount wrote since the HEAD keeps its own metadata (ckptfs's
            # checksums and hash belong to the bytes).
            self._call(
                "set_metadata",
                key,
                "copy_object",
                Key=self._key(key),
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
            self._call(
                "set_metadata",
                key,
                "copy_object",
                Key=self._key(key),
                CopySource=source,
                MetadataDirective="REPLACE",
                Metadata=merged,
            )

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> None:
        """Server-side copy; ``metadata``: entries that replace the source's (others are kept)."""
        info = self.head(src)
        if info is None:
            raise NotFound(f"copy s3://{self.bucket}/{self._base}{src}: no such key")
        source = {"Bucket": self.bucket, "Key": self._key(src)}
        if info.size <= self.max_single_copy:
            self._call(
                "copy",
                f"{src} -> {dst}",
                "copy_object",
                Key=self._key(dst),
                CopySource=source,
                MetadataDirective="COPY",
            )
            return
        upload_id = self.create_multipart(dst, {**info.metadata, **(metadata or {})})
        try:
            parts = []
            for n, off in enumerate(range(0, info.size, self.copy_part_size), start=1):
                end = min(off + self.copy_part_size, info.size) - 1
                r = self._call(
                    "copy",
                    f"{src} -> {dst}",
                    "upload_part_copy",
                    Key=self._key(dst),
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
