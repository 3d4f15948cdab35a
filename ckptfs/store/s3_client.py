"""The S3 store's connection: the boto3 session and its clients, how a request goes out and how
its errors come back (the only module that imports boto3 itself).

One low-level client, shared by all threads (botocore clients are thread-safe). botocore
retries a little ("standard" mode, few attempts); the real retry policy with backoff lives
above this layer and decides from ``StoreError.transient``. Two more clients on the same
session: one that never retries (CreateMultipartUpload) and one that sends bodies without the
SHA-256 payload signature when they carry a CRC32C the server verifies (UNSIGNED-PAYLOAD).
``S3Client`` also holds the server-checksum probe (``detect_server_checksums``), ``check``
(can this bucket be used), the health hooks on every HTTP attempt, and the requests that carry a
body (``put``, ``send_part``: botocore or the CRT) and ``head``, which the multipart uploads use
too. ``S3Store`` (s3.py) holds one and hands it to its ``S3Multipart`` (s3_multipart.py).
"""

from __future__ import annotations

import base64
import errno
import functools
import logging
import os
import re
import threading
import uuid
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote, unquote, urlsplit

import boto3  # (ckptfs/store/__init__.py has set BOTO_DISABLE_CRT)
import botocore.exceptions as bex
from botocore.config import Config

from ckptfs.errors import NotFound, StoreError, one_line
from ckptfs.store.base import MAX_KEY_BYTES, ObjectInfo, PartInfo, redact_url
from ckptfs.store.s3_crt import Answer, Body, CrtTransport
from ckptfs.store.s3_crt import available as crt_available

if TYPE_CHECKING:
    from ckptfs.store.health import StoreHealth

TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestTimeTooSkewed",
    "OperationAborted",
    # The body did not match its checksum (CRC32C, Content-MD5, the signed SHA-256; Swift says
    # BadDigest for all, Ceph RGW names each): damaged on the way, send it again.
    "BadDigest",
    "XAmzContentChecksumMismatch",
    "XAmzContentSHA256Mismatch",
}
DENIED_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
PERMANENT_ERRNO = {
    "KeyTooLongError": errno.ENAMETOOLONG,
    "EntityTooLarge": errno.EFBIG,
    "InvalidArgument": errno.EINVAL,
    "InvalidPart": errno.EINVAL,
    "InvalidPartOrder": errno.EINVAL,
    "EntityTooSmall": errno.EINVAL,
    "MalformedXML": errno.EINVAL,
}

log = logging.getLogger("ckptfs.store.s3")  # (one logger for the S3 store's modules)

# S3's own per-part checksum, sent where the server verifies it (detect_server_checksums): the
# server then refuses a part damaged on the way (BadDigest) and the uploader sends it again.
# CRC32C: the cheapest the server checks (docs/benchmarks.md, checksum cost), computed with awscrt.
CHECKSUM_ALGORITHM = "CRC32C"
# Set to "crc32c": take the server as one that verifies CRC32C without probing it (what an AWS
# bucket gets: unsigned bodies with their CRC32C). For measurements only (scripts/bench's
# ckptfs-s3-crc32c, on Swift, which ignores the header): on a server that does not verify it, a
# part bent on the wire is no longer refused (the manifests still catch it at every read).
ASSUME_CHECKSUMS_ENV = "CKPTFS_S3_CHECKSUMS"
# Where the support probe goes: under the reserved prefix the mount hides (integrity.MANIFEST_PREFIX).
PROBE_PREFIX = ".ckptfs-manifest/checksum-probe-"
PROBE_BODY = b"ckptfs: does this server verify x-amz-checksum-crc32c?\n"
# What a server that checks the checksum answers to a wrong one (AWS: BadDigest).
CHECKSUM_REFUSED = {
    "BadDigest",
    "InvalidDigest",
    "XAmzContentChecksumMismatch",
    "InvalidRequest",
    "InvalidChecksum",
}


def crc32c_b64(data) -> str | None:
    """The CRC32C of ``data`` as S3 headers carry it (base64 of the big-endian 4 bytes); None
    without awscrt (the server checksums are then not used)."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


def brief(text: object) -> str:
    return one_line(text, limit=300)  # (a proxy's answer can be a whole HTML page)


def connection_reason(e: BaseException) -> str:
    """The useful part of a connection error ("Connection refused"), without object reprs."""
    inner = getattr(e, "kwargs", {}).get("error", e)
    m = re.findall(r"\[Errno -?\d+\] ([^'\"\]\)]+)", str(inner))
    if m:
        return m[-1].strip()
    if isinstance(e, bex.ConnectTimeoutError):
        return "connect timeout"
    if isinstance(e, bex.ReadTimeoutError):
        return "read timeout"
    return brief(inner) or type(e).__name__


def part_token(etag: str, crc32c: str | None) -> str:
    """A part's token (journaled, handed back to complete_multipart): its ETag, and the CRC32C
    the server verified if one was sent (the completion must list it; base64 has no spaces)."""
    return f"{etag} {crc32c}" if crc32c else etag


def checksum_headers(crc32c: str | None) -> list[tuple[str, str]]:
    """The headers of a body's CRC32C, as botocore sends ``ChecksumAlgorithm``/``ChecksumCRC32C``."""
    if not crc32c:
        return []
    return [("x-amz-sdk-checksum-algorithm", CHECKSUM_ALGORITHM), ("x-amz-checksum-crc32c", crc32c)]


def etag_of(answer: dict[str, Any]) -> str:
    return str(answer.get("ETag", "")).strip('"')


class S3Client:
    """The session, the clients and the request plumbing the S3 store's verbs share: one bucket
    and prefix (keys given to it are relative to the prefix)."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, max_connections: int = 16
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.base = self.prefix + "/" if self.prefix else ""  # what goes before every key
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
        self.endpoint_url = endpoint_url
        try:  # (the client every request goes through unless said otherwise; botocore retries it)
            self.boto = self._session.client("s3", endpoint_url=endpoint_url, config=self._config)
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise StoreError(
                f"bad S3 endpoint URL {redact_url(endpoint_url or '')!r}: {brief(redact_url(str(e)))}",
                errno_=errno.EINVAL,
            ) from None
        # CreateMultipartUpload is not idempotent: a retry after a lost answer makes a second
        # upload. It goes through a client that never retries, so the caller sees every attempt.
        self.boto_once = self._session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=self._config.merge(Config(retries={"mode": "standard", "total_max_attempts": 1})),
        )
        # Bodies that carry a CRC32C the server verifies go without the SHA-256 payload signature
        # (UNSIGNED-PAYLOAD, as botocore itself does over https): the server refuses a damaged body
        # by its CRC32C, the xxh3 manifest checks every read, and the signature would cost 0.7 CPU
        # s/GiB (docs/architecture.md, Integrity). Everything else stays signed.
        self._boto_unsigned = self._session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=self._config.merge(
                Config(s3={**(self._config.s3 or {}), "payload_signing_enabled": False})
            ),
        )
        self.endpoint = redact_url(self.boto.meta.endpoint_url)  # as printed: without a password
        self._attempt = threading.local()  # (token, op, key) of this thread's HTTP attempt
        self.server_checksums = False  # whether the server verifies CRC32C (detect_server_checksums)
        self.checksums_assumed = False  # ... taken as so without the probe (ASSUME_CHECKSUMS_ENV)
        self._health: StoreHealth | None = None
        self._max_connections = max_connections
        # The CRT transport is opt-in (CKPTFS_S3_CLIENT=crt): it holds the GIL half as long per
        # GiB sent, but on the measured machine it cost more CPU, time and memory than botocore
        # (docs/architecture.md, "What runs where").
        self._crt_wanted = crt_available() and os.environ.get("CKPTFS_S3_CLIENT") == "crt"
        self._crt_transport: CrtTransport | None = None
        self._crt_lock = threading.Lock()

    def report_to(self, health: StoreHealth) -> None:
        """Tell ``health`` about every HTTP attempt, botocore's own retries included: an outage
        shows from the first failed attempt, not once the last retry gave up."""
        self._health = health  # (the CRT's requests report to it in _crt_send)
        for client in (self.boto, self.boto_once, self._boto_unsigned):
            client.meta.events.register("before-send.s3", functools.partial(self._attempt_starts, health))
            client.meta.events.register("needs-retry.s3", functools.partial(self._attempt_ends, health))

    def _attempt_starts(self, health: StoreHealth, request, event_name: str, **_) -> None:
        path = unquote(urlsplit(request.url).path).lstrip("/")  # (no query: no upload ids, no signatures)
        if path.startswith(self.bucket + "/") or path == self.bucket:  # path-style addressing
            path = path[len(self.bucket) + 1 :]
        key = path[len(self.base) :] if path.startswith(self.base) else path
        op = event_name.rsplit(".", 1)[-1]
        self._attempt.current = (health.attempt_started(op, key), op, key)

    def _attempt_ends(self, health: StoreHealth, response=None, caught_exception=None, **_) -> None:
        token, op, key = getattr(self._attempt, "current", (None, "", ""))
        self._attempt.current = (None, "", "")
        health.attempt_ended(token)
        status = response[0].status_code if response else 0
        code = str((((response or (None, None))[1] or {}).get("Error") or {}).get("Code") or "")
        self._judge_attempt(health, op, key, status, code, caught_exception)

    def _judge_attempt(
        self, health: StoreHealth, op: str, key: str, status: int, code: str, caught: BaseException | None
    ) -> None:
        """Tell ``health`` what one HTTP attempt (botocore's or the CRT's) says about the store."""
        if caught is not None and not isinstance(caught, bex.ClientError):
            if isinstance(caught, (bex.BotoCoreError, OSError)):
                health.failed(
                    op, key, f"cannot reach {self.endpoint}: {connection_reason(caught)}", reachable=False
                )
            return
        if status >= 500 or status == 429:
            health.failed(op, key, f"HTTP {status} {code}".rstrip(), reachable=True)
        elif status < 400 or status in (404, 416):  # (404: a HEAD that misses; 416: a read past the end)
            health.answered()

    # -- the byte path through the CRT (s3_crt.py) ---------------------------------------------

    def _crt(self) -> CrtTransport | None:
        """The CRT transport for part uploads and puts, where chosen (CKPTFS_S3_CLIENT=crt and
        awscrt installed); None where botocore sends them (the default)."""
        if self._crt_transport is None and self._crt_wanted:
            with self._crt_lock:
                if self._crt_transport is None:
                    self._crt_transport = CrtTransport(
                        self.bucket,
                        self.endpoint_url,
                        self._config.region_name or "us-east-1",
                        self._frozen_credentials,
                        self._max_connections,
                        connect_timeout_s=10,
                    )
        return self._crt_transport

    def _frozen_credentials(self) -> tuple[str, str, str | None] | None:
        found = self._session.get_credentials()  # (botocore refreshes expiring ones)
        if found is None:
            return None
        frozen = found.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    def _crt_path(self, key: str, query: str = "") -> str:
        crt = self._crt()
        assert crt is not None
        return crt.path(self.key(key), query)

    def _crt_send(self, op: str, key: str, method: str, path: str, headers, **kwargs: Any) -> Answer:
        """One request through the CRT, reported to the store's health as one attempt, its
        errors mapped as botocore's are (``fail``)."""
        crt = self._crt()
        assert crt is not None
        token = self._health.attempt_started(op, key) if self._health else None
        try:
            answer = crt.send(method, op, path, headers, **kwargs)
        except (bex.ClientError, OSError) as e:
            if self._health:
                self._health.attempt_ended(token)
                answered = e.response if isinstance(e, bex.ClientError) else {}
                status = answered.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                code = str(answered.get("Error", {}).get("Code", ""))
                self._judge_attempt(self._health, op, key, status, code, e)
            raise
        if self._health:
            self._health.attempt_ended(token)
            self._judge_attempt(self._health, op, key, answer.status, "", None)
        return answer

    # -- helpers ---------------------------------------------------------------

    def key(self, key: str) -> str:
        """The S3 key of the store's ``key`` (its prefix before it)."""
        if not key or key.startswith("/"):
            raise ValueError(f"invalid store key {key!r}")
        full = self.base + key
        if len(full.encode()) > MAX_KEY_BYTES:
            raise StoreError(
                f"s3://{self.bucket}/{full[:64]}...: key longer than {MAX_KEY_BYTES} bytes",
                errno_=errno.ENAMETOOLONG,
            )
        return full

    def fail(self, op: str, key: str, e: Exception) -> NoReturn:
        """Raise ``e`` as a one-line StoreError naming the bucket and key (never credentials)."""
        where = f"s3://{self.bucket}/{self.base}{key}"
        if isinstance(e, bex.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            # HEAD answers have no body: the code is then just the status ("404").
            detail = brief(err.get("Message") or code or f"HTTP {status}")
            if code in ("NoSuchUpload",):
                raise NotFound(f"{op} {where}: no such upload") from None
            if code == "NoSuchBucket":
                raise StoreError(
                    f"{op} {where}: bucket '{self.bucket}' does not exist at {self.endpoint}"
                ) from None
            if code in NOT_FOUND_CODES or status == 404:
                raise NotFound(f"{op} {where}: no such key") from None
            if code in DENIED_CODES or status == 403:
                raise StoreError(
                    f"{op} {where}: access denied ({code}): check the AWS credentials", errno_=errno.EACCES
                ) from None
            transient = status >= 500 or status == 429 or code in TRANSIENT_CODES
            raise StoreError(
                f"{op} {where}: {code or status}: {detail}",
                transient=transient,
                errno_=PERMANENT_ERRNO.get(code, errno.EIO),
                code=code,
            ) from None
        if isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            raise StoreError(
                f"{op} {where}: no AWS credentials found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or configure an AWS profile",
                errno_=errno.EACCES,
            ) from None
        if isinstance(e, bex.ParamValidationError):
            raise StoreError(f"{op} {where}: invalid request: {brief(e)}", errno_=errno.EINVAL) from None
        if isinstance(e, bex.SSLError):
            raise StoreError(
                f"{op} {where}: TLS error talking to {self.endpoint}: {connection_reason(e)}"
            ) from None
        if isinstance(e, (bex.ConnectionError, bex.HTTPClientError, OSError)):
            # Refused, timed out, dropped mid-body: trying again may work.
            raise StoreError(
                f"{op} {where}: cannot reach {self.endpoint}: {connection_reason(e)}", transient=True
            ) from None
        # Anything else from botocore (truncated body, checksum mismatch in flight, ...):
        # assume a retry may help; the retry layer above gives up eventually.
        raise StoreError(f"{op} {where}: {type(e).__name__}: {brief(e)}", transient=True) from None

    def call(self, op: str, key: str, method: str, client=None, **kwargs: Any) -> dict[str, Any]:
        """The botocore ``method`` on the bucket (through ``client``, else the retrying one), its
        errors raised as by ``fail``."""
        try:
            return getattr(client or self.boto, method)(Bucket=self.bucket, **kwargs)
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            self.fail(op, key, e)

    # -- the requests the store and its multipart uploads share ---------------------------

    def head(self, key: str) -> ObjectInfo | None:
        """HeadObject: the object's size, mtime, metadata and ETag, or None if absent."""
        try:
            r = self.boto.head_object(Bucket=self.bucket, Key=self.key(key))
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            self.fail("head", key, e)
        except (bex.BotoCoreError, OSError) as e:
            self.fail("head", key, e)
        return ObjectInfo(
            key, r["ContentLength"], r["LastModified"].timestamp(), dict(r.get("Metadata", {})), etag_of(r)
        )

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        """PutObject, with its CRC32C where the server verifies it, through the CRT where chosen."""
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
                self.fail("put", key, e)
            return
        body = Body(data)
        extra = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "ChecksumCRC32C": crc} if crc else {}
        self.call(
            "put",
            key,
            "put_object",
            client=self._body_client(crc),
            Key=self.key(key),
            Body=body,
            Metadata=metadata or {},
            **extra,
        )

    def send_part(
        self, key: str, upload_id: str, number: int, data: bytes | memoryview, crc: str | None
    ) -> PartInfo:
        """UploadPart, with ``crc`` (its CRC32C, where the upload carries them), through the CRT
        where chosen."""
        if self._crt() is not None:
            query = f"partNumber={number}&uploadId={quote(upload_id, safe='')}"
            try:
                answer = self._crt_send(
                    "upload_part",
                    key,
                    "PUT",
                    self._crt_path(key, query),
                    checksum_headers(crc),
                    body=data,
                    signed_payload=crc is None,
                )
            except (bex.ClientError, OSError) as e:
                self.fail("upload_part", key, e)
            return PartInfo(number, part_token(answer.headers.get("etag", ""), crc))
        body = Body(data)
        extra = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "ChecksumCRC32C": crc} if crc else {}
        r = self.call(
            "upload_part",
            key,
            "upload_part",
            client=self._body_client(crc),
            Key=self.key(key),
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            **extra,
        )
        return PartInfo(number, part_token(r["ETag"], crc))

    def _body_client(self, crc32c: str | None):
        """The client for a request with a body: unsigned when the server verifies its CRC32C."""
        return self._boto_unsigned if crc32c else self.boto

    # -- the bucket, the server's checksums, closing ------------------------------

    def check(self) -> None:
        if self._session.get_credentials() is None:
            raise StoreError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "or configure an AWS profile",
                errno_=errno.EACCES,
            )
        # A client of its own with a short connect timeout and no retries, so a dead
        # endpoint fails `ckptfs mount` in seconds rather than after a retry storm.
        quick = self._session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=self._config.merge(
                Config(
                    connect_timeout=3, read_timeout=5, retries={"mode": "standard", "total_max_attempts": 1}
                )
            ),
        )
        where = f"bucket '{self.bucket}' at {self.endpoint}"
        try:
            quick.head_bucket(Bucket=self.bucket)
        except bex.ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 404 or code in ("NoSuchBucket", "404", "NotFound"):
                raise StoreError(
                    f"bucket '{self.bucket}' does not exist at {self.endpoint}", errno_=errno.ENOENT
                ) from None
            if status == 403 or code in DENIED_CODES:
                raise StoreError(
                    f"access denied to {where}: check the AWS credentials", errno_=errno.EACCES
                ) from None
            raise StoreError(
                f"cannot use {where}: {code or status} {brief(err.get('Message', ''))}".rstrip(),
                transient=status >= 500,
            ) from None
        except (bex.NoCredentialsError, bex.PartialCredentialsError):
            raise StoreError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "or configure an AWS profile",
                errno_=errno.EACCES,
            ) from None
        except (bex.BotoCoreError, OSError) as e:
            raise StoreError(
                f"cannot reach {self.endpoint}: {connection_reason(e)}", transient=True
            ) from None
        finally:
            quick.close()

    def detect_server_checksums(self) -> bool:
        """Find out once (at mount) whether the server verifies ``x-amz-checksum-crc32c``: PUT a
        tiny probe with a wrong CRC32C (a server that verifies refuses it, one that ignores the
        header stores it), then with the right one (a server that refuses the header itself must
        not get it); delete the probe. Sets and returns ``server_checksums``. Any other answer
        (no write access, an error) leaves them off: uploads work as without."""
        self.server_checksums = False
        right = crc32c_b64(PROBE_BODY)
        if right is None:
            log.info("awscrt is not installed: S3 checksums (CRC32C) not sent; xxh3 manifests only")
            return False
        if os.environ.get(ASSUME_CHECKSUMS_ENV) == "crc32c":
            # (a measurement's knob: the mode an AWS bucket gets, on a server that may not check)
            log.warning(
                "%s=crc32c: parts go as UNSIGNED-PAYLOAD with their CRC32C, unprobed", ASSUME_CHECKSUMS_ENV
            )
            self.server_checksums = self.checksums_assumed = True
            return True
        wrong = crc32c_b64(PROBE_BODY + b"x")
        probe = PROBE_PREFIX + uuid.uuid4().hex[:16]
        verifies = False
        try:
            try:
                self.boto.put_object(
                    Bucket=self.bucket,
                    Key=self.key(probe),
                    Body=PROBE_BODY,
                    ChecksumAlgorithm=CHECKSUM_ALGORITHM,
                    ChecksumCRC32C=wrong,
                )
            except bex.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 400 and code in CHECKSUM_REFUSED:
                    self.boto.put_object(
                        Bucket=self.bucket,
                        Key=self.key(probe),
                        Body=PROBE_BODY,
                        ChecksumAlgorithm=CHECKSUM_ALGORITHM,
                        ChecksumCRC32C=right,
                    )
                    verifies = True
                else:
                    log.info("S3 checksum probe answered %s %s: checksums not sent", status, code)
        except (bex.BotoCoreError, bex.ClientError, OSError) as e:
            log.info("S3 checksum probe failed (%s): checksums not sent", brief(e))
        finally:
            try:
                self.boto.delete_object(Bucket=self.bucket, Key=self.key(probe))
            except (
                bex.BotoCoreError,
                bex.ClientError,
                OSError,
            ) as e:  # (a leftover is collected as an orphan)
                log.info("could not delete the S3 checksum probe %s: %s", probe, brief(e))
        self.server_checksums = verifies
        log.info(
            "%s %s CRC32C checksums: %s",
            self.endpoint,
            "verifies" if verifies else "does not verify",
            "sent with every part" if verifies else "not sent (xxh3 manifests only)",
        )
        return verifies

    def close(self) -> None:
        if self._crt_transport is not None:
            self._crt_transport.close()
            self._crt_transport = None
        self.boto.close()
        self.boto_once.close()
        self._boto_unsigned.close()
