"""The S3 store's multipart uploads: create (through the client that never retries, with CRC32C
where the server verifies it), parts, completion, abort, and the listing of unfinished uploads.
``S3Multipart`` is built on the store's ``S3Client`` and sends every request through it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any

import botocore.exceptions as bex

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.store.base import RESERVED_PREFIX, PartInfo
from ckptfs.store.s3_client import CHECKSUM_ALGORITHM, S3Client, crc32c_b64, log, part_token

ZEROS_PREFIX = RESERVED_PREFIX + "zeros/"  # objects of zeros that hole parts are copied from
ZEROS_MIN = 8 << 20  # the smallest such object (sizes are powers of two from here)
# The largest: made by one PUT of a calloc'd buffer. A hole part longer than this (a file over
# ~640 GiB has parts that long) is sent as zeros, as any part is.
ZEROS_MAX = 64 << 20


def zeros_size(length: int) -> int:
    """The size of the zeros object a hole part of ``length`` bytes is copied from."""
    return max(ZEROS_MIN, 1 << (length - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _zeros_etag(size: int) -> str:
    return hashlib.md5(bytes(size), usedforsecurity=False).hexdigest()  # (a one-PUT object's ETag)


class S3Multipart:
    """The multipart uploads of the bucket and prefix of ``client`` (``S3Store``'s multipart verbs
    call these)."""

    def __init__(self, client: S3Client):
        self.client = client
        # Whether the server takes CRC32C on multipart uploads too (where it verifies them at all:
        # client.server_checksums), and which uploads were created with it (by id).
        self._multipart_checksums = True
        self._checksummed: dict[str, bool] = {}
        self._checksummed_lock = threading.Lock()
        self._zeros_made: set[int] = set()  # sizes of the zeros objects known in the bucket
        self._zeros_lock = threading.Lock()
        self._zeros_refused = False  # the server refused UploadPartCopy: holes are sent as zeros

    def create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        args = {"Key": self.client.key(key), "Metadata": metadata or {}}
        checksummed = self.client.server_checksums and self._multipart_checksums
        r = None
        if checksummed:
            try:
                r = self.client.boto_once.create_multipart_upload(
                    Bucket=self.client.bucket, ChecksumAlgorithm=CHECKSUM_ALGORITHM, **args
                )
            except bex.ClientError as e:
                # A server that checks a PUT's CRC32C but refuses it on multipart uploads (400,
                # 501: nothing was created): its multipart uploads go without, from now on.
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (400, 501):
                    self.client.fail("create_multipart", key, e)
                checksummed = False
            except (bex.BotoCoreError, OSError) as e:
                self.client.fail("create_multipart", key, e)
        if r is None:
            r = self.client.call(
                "create_multipart", key, "create_multipart_upload", client=self.client.boto_once, **args
            )
            if self.client.server_checksums and self._multipart_checksums:
                log.warning(
                    "%s refuses CRC32C on multipart uploads: their parts go without S3 checksums",
                    self.client.endpoint,
                )
                self._multipart_checksums = False
        with self._checksummed_lock:
            self._checksummed[r["UploadId"]] = checksummed
        return r["UploadId"]

    def uses_checksums(self, key: str, upload_id: str) -> bool:
        """Whether the upload was created with CRC32C (then each part and the completion carry
        theirs). Known for the uploads this process created; for one resumed from the journal,
        the server's list of unfinished uploads says (once)."""
        if not self.client.server_checksums:
            return False
        with self._checksummed_lock:
            known = self._checksummed.get(upload_id)
        if known is None:
            try:
                pages = self.client.boto.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.client.bucket, Prefix=self.client.key(key)
                )
                known = any(
                    str(u.get("ChecksumAlgorithm") or "").upper() == CHECKSUM_ALGORITHM
                    for page in pages
                    for u in page.get("Uploads", [])
                    if u["UploadId"] == upload_id and u["Key"] == self.client.key(key)
                )
            except (bex.BotoCoreError, bex.ClientError, OSError) as e:
                self.client.fail("upload_part", key, e)
            with self._checksummed_lock:
                self._checksummed[upload_id] = known
        return known

    def upload_part(
        self, key: str, upload_id: str, number: int, data: bytes | memoryview, checksummed: bool | None = None
    ) -> PartInfo:
        """UploadPart; ``checksummed``: whether the upload carries CRC32C, where the caller knows
        (a store worker: the daemon that created the upload does), else found out."""
        if checksummed is None:
            checksummed = self.uses_checksums(key, upload_id)
        crc = crc32c_b64(data) if checksummed else None
        return self.client.send_part(key, upload_id, number, data, crc)

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        """A hole: UploadPartCopy of a range of a zeros object in the bucket (made once, at the
        first hole of its size), so no byte of it crosses the wire. A zeros object deleted or
        changed by hand is made again; a server that refuses the copy gets the zeros sent."""
        if length > ZEROS_MAX or self._zeros_refused:
            return self.upload_part(key, upload_id, number, bytes(length))
        for attempt in range(2):
            source = self._zeros_object(zeros_size(length), again=attempt > 0)
            try:
                r = self.client.call(
                    "upload_part",
                    key,
                    "upload_part_copy",
                    Key=self.client.key(key),
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource={"Bucket": self.client.bucket, "Key": self.client.key(source)},
                    CopySourceRange=f"bytes=0-{length - 1}",
                )
            except NotFound:
                if attempt or self.client.head(source) is not None:
                    raise  # the upload is gone, not the zeros
                continue
            except StoreError as exc:
                if exc.transient:
                    raise
                log.warning(
                    "%s refuses to copy a part from %s (%s): holes are sent as zeros from now on",
                    self.client.endpoint,
                    source,
                    exc,
                )
                self._zeros_refused = True
                return self.upload_part(key, upload_id, number, bytes(length))
            result = r["CopyPartResult"]
            return PartInfo(number, part_token(result["ETag"], result.get("ChecksumCRC32C")))
        raise AssertionError("unreachable")

    def _zeros_object(self, size: int, again: bool = False) -> str:
        """The key of the bucket's zeros object of ``size`` bytes, checked (its ETag is the MD5
        of that many zeros) and made where it is missing or not that, once per size at a time."""
        key = f"{ZEROS_PREFIX}{size}"
        with self._zeros_lock:
            if again or size not in self._zeros_made:
                info = self.client.head(key)
                if info is None or info.size != size or info.etag.strip('"') != _zeros_etag(size):
                    self.client.put(key, bytes(size))  # (calloc'd, at most ZEROS_MAX; once per bucket)
                self._zeros_made.add(size)
        return key

    def complete(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        # (checksums assumed, not probed: a server that may not know them, Swift, refuses a
        # completion that lists them; its parts carried theirs all the same)
        listed = not self.client.checksums_assumed

        def entry(p: PartInfo) -> dict[str, Any]:
            etag, _, crc = p.token.partition(" ")
            return {
                "PartNumber": p.number,
                "ETag": etag,
                **({"ChecksumCRC32C": crc} if crc and listed else {}),
            }

        try:
            self.client.call(
                "complete_multipart",
                key,
                "complete_multipart_upload",
                Key=self.client.key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": [entry(p) for p in parts]},
            )
        except StoreError as e:
            if e.code == "InvalidPart" and self._uploaded_numbers(key, upload_id) - {p.number for p in parts}:
                raise PartsLeftOut(
                    f"complete_multipart s3://{self.client.bucket}/{self.client.key(key)}: the server "
                    "refuses to leave uploaded parts out of an object: sending it again in a new upload"
                ) from None
            raise
        with self._checksummed_lock:
            self._checksummed.pop(upload_id, None)

    def _uploaded_numbers(self, key: str, upload_id: str) -> set[int]:
        """The part numbers an unfinished upload holds (ListParts, every page)."""
        numbers: set[int] = set()
        marker = 0
        while True:
            page = self.client.call(
                "list_parts",
                key,
                "list_parts",
                Key=self.client.key(key),
                UploadId=upload_id,
                PartNumberMarker=marker,
            )
            numbers.update(p["PartNumber"] for p in page.get("Parts", ()))
            following = int(page.get("NextPartNumberMarker") or 0)
            if not page.get("IsTruncated") or following <= marker:  # (a marker that does not advance: done)
                return numbers
            marker = following

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self.client.call(
                "abort_multipart", key, "abort_multipart_upload", Key=self.client.key(key), UploadId=upload_id
            )
        except NotFound:
            pass  # unknown or already finished upload
        with self._checksummed_lock:
            self._checksummed.pop(upload_id, None)

    def unfinished(self, prefix: str = "") -> list[tuple[str, str]]:
        out = []
        try:
            pages = self.client.boto.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.client.bucket, Prefix=self.client.base + prefix
            )
            for page in pages:
                for u in page.get("Uploads", []):
                    out.append((u["Key"][len(self.client.base) :], u["UploadId"]))
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self.client.fail("list_multipart", prefix, e)
        return out

    def unfinished_started(self, prefix: str = "") -> list[float]:
        try:
            pages = self.client.boto.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.client.bucket, Prefix=self.client.base + prefix
            )
            return [u["Initiated"].timestamp() for page in pages for u in page.get("Uploads", [])]
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self.client.fail("list_multipart", prefix, e)
