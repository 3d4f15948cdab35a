"""The S3 store: any S3-compatible endpoint through boto3 (the only module that imports it).

One low-level client, shared by all threads (botocore clients are thread-safe). botocore
retries a little ("standard" mode, few attempts); the real retry policy with backoff lives
above this layer and decides from ``StoreError.transient``.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit

# botocore signs with the AWS CRT whenever awscrt is importable (ckptfs installs it for CRC32C
# alone): measured here, the daemon's RSS while uploading 8 MiB parts went from 210 to 326 MiB
# (tests/test_e2e.py backpressure test). botocore's own signer is kept unless the user chose.
os.environ.setdefault("BOTO_DISABLE_CRT", "true")

import boto3  # noqa: E402  (after the switch above, which botocore reads at import)
import botocore.exceptions as bex  # noqa: E402
from botocore.config import Config  # noqa: E402

from ..errors import one_line
from .base import (
    MAX_KEY_BYTES,
    DirListing,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PartInfo,
    StoreError,
    redact_url,
)

_TRANSIENT_CODES = {
    "SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling",
    "ThrottlingException", "TooManyRequests", "RequestTimeTooSkewed", "OperationAborted",
    # The body did not match its checksum (CRC32C, Content-MD5): damaged on the way, send it again.
    "BadDigest", "XAmzContentChecksumMismatch",
}
_DENIED_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
_PERMANENT_ERRNO = {"KeyTooLongError": errno.ENAMETOOLONG, "EntityTooLarge": errno.EFBIG,
                    "InvalidArgument": errno.EINVAL, "InvalidPart": errno.EINVAL,
                    "InvalidPartOrder": errno.EINVAL, "EntityTooSmall": errno.EINVAL,
                    "MalformedXML": errno.EINVAL}
GiB = 1 << 30
log = logging.getLogger(__name__)

# S3's own per-part checksum, sent where the server verifies it (detect_server_checksums): the
# server then refuses a part damaged on the way (BadDigest) and the uploader sends it again.
# CRC32C: the cheapest the server checks (docs/benchmarks.md, checksum cost), computed with awscrt.
CHECKSUM_ALGORITHM = "CRC32C"
# Where the support probe goes: under the reserved prefix the mount hides (integrity.MANIFEST_PREFIX).
PROBE_PREFIX = ".ckptfs-manifest/checksum-probe-"
_PROBE_BODY = b"ckptfs: does this server verify x-amz-checksum-crc32c?\n"
# What a server that checks the checksum answers to a wrong one (AWS: BadDigest).
_CHECKSUM_REFUSED = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidRequest",
                     "InvalidChecksum"}


def crc32c_b64(data) -> str | None:
    """The CRC32C of ``data`` as S3 headers carry it (base64 of the big-endian 4 bytes); None
    without awscrt (the server checksums are then not used)."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


def _brief(text: object) -> str:
    return one_line(text, limit=300)  # (a proxy's answer can be a whole HTML page)


def _reason(e: BaseException) -> str:
    """The useful part of a connection error ("Connection refused"), without object reprs."""
    inner = getattr(e, "kwargs", {}).get("error", e)
    m = re.findall(r"\[Errno -?\d+\] ([^'\"\]\)]+)", str(inner))
    if m:
        return m[-1].strip()
    if isinstance(e, bex.ConnectTimeoutError):
        return "connect timeout"
    if isinstance(e, bex.ReadTimeoutError):
        return "read timeout"
    return _brief(inner) or type(e).__name__


def _as_bytes(data: bytes | memoryview) -> bytes | bytearray:
    """botocore refuses memoryview bodies (ParamValidationError): pass the underlying
    bytes when the view covers all of it, else copy once (an 8 MiB copy is ~1 ms)."""
    if isinstance(data, (bytes, bytearray)):
        return data
    obj = data.obj
    if isinstance(obj, (bytes, bytearray)) and data.contiguous and data.nbytes == len(obj):
        return obj
    return data.tobytes()


def _token(etag: str, crc32c: str | None) -> str:
    """A part's token (journaled, handed back to complete_multipart): its ETag, and the CRC32C
    the server verified if one was sent (the completion must list it; base64 has no spaces)."""
    return f"{etag} {crc32c}" if crc32c else etag


def _etag(answer: dict[str, Any]) -> str:
    return str(answer.get("ETag", "")).strip('"')


class S3Store(ObjectStore):
    # Above 5 GiB CopyObject is refused: copy in ranges instead (class attrs so tests can shrink them).
    max_single_copy = 5 * GiB
    copy_part_size = 1 * GiB

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 max_connections: int = 16):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._base = self.prefix + "/" if self.prefix else ""
        self._session = boto3.session.Session()
        self._config = Config(
            region_name=self._session.region_name or "us-east-1",
            connect_timeout=10,
            read_timeout=60,
            retries={"mode": "standard", "max_attempts": 3},
            max_pool_connections=max_connections,
            s3={"addressing_style": "path"} if endpoint_url else None,
            # boto3 >= 1.36 adds CRC checksums to every PutObject/UploadPart by default:
            # extra CPU, and some S3-compatible servers reject them. We checksum (xxh3) ourselves.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._endpoint_url = endpoint_url
        try:
            self._client = self._session.client("s3", endpoint_url=endpoint_url, config=self._config)
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise StoreError(f"bad S3 endpoint URL {redact_url(endpoint_url or '')!r}: {_brief(redact_url(str(e)))}",
                             errno_=errno.EINVAL) from None
        # CreateMultipartUpload is not idempotent: a retry after a lost answer makes a second
        # upload. It goes through a client that never retries, so the caller sees every attempt.
        self._client_once = self._session.client("s3", endpoint_url=endpoint_url, config=self._config.merge(
            Config(retries={"mode": "standard", "total_max_attempts": 1})))
        # Bodies that carry a CRC32C the server verifies go without the SHA-256 payload signature
        # (UNSIGNED-PAYLOAD, as botocore itself does over https): the server refuses a damaged body
        # by its CRC32C, the xxh3 manifest checks every read, and the signature would cost 0.7 CPU
        # s/GiB (docs/architecture.md, Integrity). Everything else stays signed.
        self._client_unsigned = self._session.client("s3", endpoint_url=endpoint_url, config=self._config.merge(
            Config(s3={**(self._config.s3 or {}), "payload_signing_enabled": False})))
        self.endpoint = redact_url(self._client.meta.endpoint_url)  # as printed: without a password
        self._health = None
        self._attempt = threading.local()  # (token, op, key) of this thread's HTTP attempt
        # Whether the server verifies CRC32C (detect_server_checksums; off until detected), whether
        # it takes it on multipart uploads too, and which uploads were created with it (by id).
        self.server_checksums = False
        self._multipart_checksums = True
        self._checksummed: dict[str, bool] = {}
        self._checksummed_lock = threading.Lock()

    def report_to(self, health) -> None:
        """Tell ``health`` about every HTTP attempt, botocore's own retries included: an outage
        shows from the first failed attempt, not once the last retry gave up."""
        self._health = health
        for client in (self._client, self._client_once, self._client_unsigned):
            client.meta.events.register("before-send.s3", self._attempt_starts)
            client.meta.events.register("needs-retry.s3", self._attempt_ends)

    def _attempt_starts(self, request, event_name: str, **_) -> None:
        path = unquote(urlsplit(request.url).path).lstrip("/")  # (no query: no upload ids, no signatures)
        if path.startswith(self.bucket + "/") or path == self.bucket:  # path-style addressing
            path = path[len(self.bucket) + 1:]
        key = path[len(self._base):] if path.startswith(self._base) else path
        op = event_name.rsplit(".", 1)[-1]
        self._attempt.current = (self._health.attempt_started(op, key), op, key)

    def _attempt_ends(self, response=None, caught_exception=None, **_) -> None:
        token, op, key = getattr(self._attempt, "current", (None, "", ""))
        self._attempt.current = (None, "", "")
        self._health.attempt_ended(token)
        if caught_exception is not None:
            if isinstance(caught_exception, (bex.BotoCoreError, OSError)):
                self._health.failed(op, key, f"cannot reach {self.endpoint}: {_reason(caught_exception)}",
                                    reachable=False)
            return
        status = response[0].status_code if response else 0
        if status >= 500 or status == 429:
            code = str(((response[1] or {}).get("Error") or {}).get("Code") or "")
            self._health.failed(op, key, f"HTTP {status} {code}".rstrip(), reachable=True)
        elif status < 400 or status in (404, 416):  # (404: a HEAD that misses; 416: a read past the end)
            self._health.answered()

    # -- helpers ---------------------------------------------------------------

    def key_room(self) -> int:
        return self.limits.max_key_bytes - len(self._base.encode())

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"invalid store key {key!r}")
        full = self._base + key
        if len(full.encode()) > MAX_KEY_BYTES:
            raise StoreError(f"s3://{self.bucket}/{full[:64]}...: key longer than {MAX_KEY_BYTES} bytes",
                             errno_=errno.ENAMETOOLONG)
        return full

    def _fail(self, op: str, key: str, e: Exception) -> NoReturn:
        """Raise ``e`` as a one-line StoreError naming the bucket and key (never credentials)."""
        where = f"s3://{self.bucket}/{self._base}{key}"
        if isinstance(e, bex.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            # HEAD answers have no body: the code is then just the status ("404").
            detail = _brief(err.get("Message") or code or f"HTTP {status}")
            if code in ("NoSuchUpload",):
                raise NotFound(f"{op} {where}: no such upload") from None
            if code == "NoSuchBucket":
                raise StoreError(f"{op} {where}: bucket '{self.bucket}' does not exist at {self.endpoint}") from None
            if code in _NOT_FOUND_CODES or status == 404:
                raise NotFound(f"{op} {where}: no such key") from None
            if code in _DENIED_CODES or status == 403:
                raise StoreError(f"{op} {where}: access denied ({code}): check the AWS credentials",
                                 errno_=errno.EACCES) from None
            transient = status >= 500 or status == 429 or code in _TRANSIENT_CODES
            raise StoreError(f"{op} {where}: {code or status}: {detail}", transient=transient,
                             errno_=_PERMANENT_ERRNO.get(code, errno.EIO)) from None
        if isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            raise StoreError(f"{op} {where}: no AWS credentials found: set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY or configure an AWS profile", errno_=errno.EACCES) from None
        if isinstance(e, bex.ParamValidationError):
            raise StoreError(f"{op} {where}: invalid request: {_brief(e)}", errno_=errno.EINVAL) from None
        if isinstance(e, bex.SSLError):
            raise StoreError(f"{op} {where}: TLS error talking to {self.endpoint}: {_reason(e)}") from None
        if isinstance(e, (bex.ConnectionError, bex.HTTPClientError, OSError)):
            # Refused, timed out, dropped mid-body: trying again may work.
            raise StoreError(f"{op} {where}: cannot reach {self.endpoint}: {_reason(e)}", transient=True) from None
        # Anything else from botocore (truncated body, checksum mismatch in flight, ...):
        # assume a retry may help; the retry layer above gives up eventually.
        raise StoreError(f"{op} {where}: {type(e).__name__}: {_brief(e)}", transient=True) from None

    def _call(self, op: str, key: str, method: str, client=None, **kwargs: Any) -> dict[str, Any]:
        try:
            return getattr(client or self._client, method)(Bucket=self.bucket, **kwargs)
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail(op, key, e)

    # -- ObjectStore -------------------------------------------------------------

    def check(self) -> None:
        if self._session.get_credentials() is None:
            raise StoreError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                             "or configure an AWS profile", errno_=errno.EACCES)
        # A client of its own with a short connect timeout and no retries, so a dead
        # endpoint fails `ckptfs mount` in seconds rather than after a retry storm.
        quick = self._session.client("s3", endpoint_url=self._endpoint_url, config=self._config.merge(
            Config(connect_timeout=3, read_timeout=5, retries={"mode": "standard", "total_max_attempts": 1})))
        where = f"bucket '{self.bucket}' at {self.endpoint}"
        try:
            quick.head_bucket(Bucket=self.bucket)
        except bex.ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 404 or code in ("NoSuchBucket", "404", "NotFound"):
                raise StoreError(f"bucket '{self.bucket}' does not exist at {self.endpoint}",
                                 errno_=errno.ENOENT) from None
            if status == 403 or code in _DENIED_CODES:
                raise StoreError(f"access denied to {where}: check the AWS credentials",
                                 errno_=errno.EACCES) from None
            raise StoreError(f"cannot use {where}: {code or status} {_brief(err.get('Message', ''))}".rstrip(),
                             transient=status >= 500) from None
        except (bex.NoCredentialsError, bex.PartialCredentialsError):
            raise StoreError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                             "or configure an AWS profile", errno_=errno.EACCES) from None
        except (bex.BotoCoreError, OSError) as e:
            raise StoreError(f"cannot reach {self.endpoint}: {_reason(e)}", transient=True) from None
        finally:
            quick.close()

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        body = _as_bytes(data)
        crc = crc32c_b64(body) if self.server_checksums else None
        extra = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "ChecksumCRC32C": crc} if crc else {}
        self._call("put", key, "put_object", client=self._body_client(crc), Key=self._key(key), Body=body,
                   Metadata=metadata or {}, **extra)

    def _body_client(self, crc32c: str | None):
        """The client for a request with a body: unsigned when the server verifies its CRC32C."""
        return self._client_unsigned if crc32c else self._client

    def detect_server_checksums(self) -> bool:
        """Find out once (at mount) whether the server verifies ``x-amz-checksum-crc32c``: PUT a
        tiny probe with a wrong CRC32C (a server that verifies refuses it, one that ignores the
        header stores it), then with the right one (a server that refuses the header itself must
        not get it); delete the probe. Sets and returns ``server_checksums``. Any other answer
        (no write access, an error) leaves them off: uploads work as without."""
        self.server_checksums = False
        right = crc32c_b64(_PROBE_BODY)
        if right is None:
            log.info("awscrt is not installed: S3 checksums (CRC32C) not sent; xxh3 manifests only")
            return False
        wrong = crc32c_b64(_PROBE_BODY + b"x")
        probe = PROBE_PREFIX + uuid.uuid4().hex[:16]
        verifies = False
        try:
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._key(probe), Body=_PROBE_BODY,
                                        ChecksumAlgorithm=CHECKSUM_ALGORITHM, ChecksumCRC32C=wrong)
            except bex.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 400 and code in _CHECKSUM_REFUSED:
                    self._client.put_object(Bucket=self.bucket, Key=self._key(probe), Body=_PROBE_BODY,
                                            ChecksumAlgorithm=CHECKSUM_ALGORITHM, ChecksumCRC32C=right)
                    verifies = True
                else:
                    log.info("S3 checksum probe answered %s %s: checksums not sent", status, code)
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            log.info("S3 checksum probe failed (%s): checksums not sent", _brief(e))
        finally:
            try:
                self._client.delete_object(Bucket=self.bucket, Key=self._key(probe))
            except (bex.BotoCoreError, bex.ClientError, OSError) as e:  # (a leftover is collected as an orphan)
                log.info("could not delete the S3 checksum probe %s: %s", probe, _brief(e))
        self.server_checksums = verifies
        log.info("%s %s CRC32C checksums: %s", self.endpoint, "verifies" if verifies else "does not verify",
                 "sent with every part" if verifies else "not sent (xxh3 manifests only)")
        return verifies

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
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                           Range=f"bytes={start}-{start + length - 1}")
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
        return ObjectInfo(key, r["ContentLength"], r["LastModified"].timestamp(), dict(r.get("Metadata", {})),
                          _etag(r))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._base + prefix)
            for page in pages:
                for o in page.get("Contents", []):
                    key = o["Key"][len(self._base):]
                    if key:  # skip the "prefix/" marker itself
                        yield ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=_etag(o))
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
                pages = [self._client.list_objects_v2(Bucket=self.bucket, Prefix=full, Delimiter="/",
                                                      MaxKeys=max(limit, 1))]
            else:
                pages = self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full, Delimiter="/")
            for page in pages:
                for o in page.get("Contents", []):
                    exists = True
                    key = o["Key"][len(self._base):]
                    if key != prefix:  # (not the directory's own marker)
                        files.append(ObjectInfo(key, o["Size"], o["LastModified"].timestamp(), etag=_etag(o)))
                for p in page.get("CommonPrefixes", []):
                    exists = True
                    dirs.append(p["Prefix"][len(full):-1])
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail("list", prefix, e)
        if limit is not None:
            del files[limit:]
            del dirs[max(limit - len(files), 0):]
        return DirListing(files, dirs, exists)

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404 or \
                    e.response.get("Error", {}).get("Code") == "NoSuchBucket":
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
            self._call("set_metadata", key, "copy_object", Key=self._key(key), CopySource=source,
                       CopySourceIfMatch=info.etag, MetadataDirective="REPLACE", Metadata=merged)
        except StoreError as exc:
            if "PreconditionFailed" not in str(exc):
                raise
            # Swift compares a multipart object's ETag in If-Match unlike S3 and always refuses it:
            # still the same object, copy it unconditionally; else a later retry starts over.
            now = self.head(key)
            if now is None or now.etag != info.etag or now.metadata != info.metadata:
                raise StoreError(f"set_metadata {key}: the object changed meanwhile", transient=True) from None
            self._call("set_metadata", key, "copy_object", Key=self._key(key), CopySource=source,
                       MetadataDirective="REPLACE", Metadata=merged)

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> None:
        """Server-side copy; ``metadata``: entries that replace the source's (others are kept)."""
        info = self.head(src)
        if info is None:
            raise NotFound(f"copy s3://{self.bucket}/{self._base}{src}: no such key")
        source = {"Bucket": self.bucket, "Key": self._key(src)}
        if info.size <= self.max_single_copy:
            self._call("copy", f"{src} -> {dst}", "copy_object", Key=self._key(dst), CopySource=source,
                       MetadataDirective="COPY")
            return
        upload_id = self.create_multipart(dst, {**info.metadata, **(metadata or {})})
        try:
            parts = []
            for n, off in enumerate(range(0, info.size, self.copy_part_size), start=1):
                end = min(off + self.copy_part_size, info.size) - 1
                r = self._call("copy", f"{src} -> {dst}", "upload_part_copy", Key=self._key(dst),
                               UploadId=upload_id, PartNumber=n, CopySource=source,
                               CopySourceRange=f"bytes={off}-{end}")
                parts.append(PartInfo(n, _token(r["CopyPartResult"]["ETag"],
                                              r["CopyPartResult"].get("ChecksumCRC32C"))))
            self.complete_multipart(dst, upload_id, parts)
        except BaseException:
            try:
                self.abort_multipart(dst, upload_id)
            except StoreError:
                pass  # the original error matters more; a stale upload shows in list_multipart
            raise

    # -- multipart ---------------------------------------------------------------

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        args = {"Key": self._key(key), "Metadata": metadata or {}}
        checksummed = self.server_checksums and self._multipart_checksums
        r = None
        if checksummed:
            try:
                r = self._client_once.create_multipart_upload(Bucket=self.bucket, ChecksumAlgorithm=CHECKSUM_ALGORITHM,
                                                              **args)
            except bex.ClientError as e:
                # A server that checks a PUT's CRC32C but refuses it on multipart uploads (400,
                # 501: nothing was created): its multipart uploads go without, from now on.
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (400, 501):
                    self._fail("create_multipart", key, e)
                checksummed = False
            except (bex.BotoCoreError, OSError) as e:
                self._fail("create_multipart", key, e)
        if r is None:
            r = self._call("create_multipart", key, "create_multipart_upload", client=self._client_once, **args)
            if self.server_checksums and self._multipart_checksums:
                log.warning("%s refuses CRC32C on multipart uploads: their parts go without S3 checksums",
                            self.endpoint)
                self._multipart_checksums = False
        with self._checksummed_lock:
            self._checksummed[r["UploadId"]] = checksummed
        return r["UploadId"]

    def _uses_checksums(self, key: str, upload_id: str) -> bool:
        """Whether the upload was created with CRC32C (then each part and the completion carry
        theirs). Known for the uploads this process created; for one resumed from the journal,
        the server's list of unfinished uploads says (once)."""
        if not self.server_checksums:
            return False
        with self._checksummed_lock:
            known = self._checksummed.get(upload_id)
        if known is None:
            try:
                pages = self._client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=self._key(key))
                known = any(str(u.get("ChecksumAlgorithm") or "").upper() == CHECKSUM_ALGORITHM
                            for page in pages for u in page.get("Uploads", [])
                            if u["UploadId"] == upload_id and u["Key"] == self._key(key))
            except (bex.BotoCoreError, bex.ClientError, OSError) as e:
                self._fail("upload_part", key, e)
            with self._checksummed_lock:
                self._checksummed[upload_id] = known
        return known

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        body = _as_bytes(data)
        crc = crc32c_b64(body) if self._uses_checksums(key, upload_id) else None
        extra = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "ChecksumCRC32C": crc} if crc else {}
        r = self._call("upload_part", key, "upload_part", client=self._body_client(crc), Key=self._key(key),
                       UploadId=upload_id, PartNumber=number, Body=body, **extra)
        return PartInfo(number, _token(r["ETag"], crc))

    def complete_multipart(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        def entry(p: PartInfo) -> dict[str, Any]:
            etag, _, crc = p.token.partition(" ")
            return {"PartNumber": p.number, "ETag": etag, **({"ChecksumCRC32C": crc} if crc else {})}

        self._call("complete_multipart", key, "complete_multipart_upload", Key=self._key(key),
                   UploadId=upload_id, MultipartUpload={"Parts": [entry(p) for p in parts]})
        with self._checksummed_lock:
            self._checksummed.pop(upload_id, None)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart", key, "abort_multipart_upload", Key=self._key(key), UploadId=upload_id)
        except NotFound:
            pass  # unknown or already finished upload
        with self._checksummed_lock:
            self._checksummed.pop(upload_id, None)

    def list_multipart(self, prefix: str = "") -> list[tuple[str, str]]:
        out = []
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._base + prefix)
            for page in pages:
                for u in page.get("Uploads", []):
                    out.append((u["Key"][len(self._base):], u["UploadId"]))
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail("list_multipart", prefix, e)
        return out

    def list_multipart_started(self, prefix: str = "") -> list[float]:
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._base + prefix)
            return [u["Initiated"].timestamp() for page in pages for u in page.get("Uploads", [])]
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self._fail("list_multipart", prefix, e)

    def close(self) -> None:
        self._client.close()
        self._client_once.close()
        self._client_unsigned.close()
