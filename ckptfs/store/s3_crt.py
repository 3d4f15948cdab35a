"""The S3 store's request bodies in C, opt-in (``CKPTFS_S3_CLIENT=crt``): part uploads and puts
through the AWS CRT's S3 client (awscrt), the client s3torchconnector and Mountpoint are built on.

Why (issue 32; docs/architecture.md, "What runs where"): botocore builds, signs and sends each
request in Python, under the interpreter lock the FUSE request loop needs too. Measured here
(1 GiB of 8 MiB parts, 8 threads, Swift): botocore held the GIL 0.56-0.73 s, this path 0.14 s,
for about the same client CPU (1.5 s/GiB, mostly the payload's SHA-256 and the socket copies).
In a whole save on the 2-core machine it cost more than botocore (daemon CPU, time to durable,
and about 60 MiB of RSS for its own buffers), which is why botocore stays the default.
The CRT's native threads send and receive without the GIL; the calling thread hashes the body
(hashlib releases the GIL), hands it over in one ``readinto`` (a copy with the GIL released)
and waits. Ranged GETs stay in botocore: through the CRT they cost more CPU here (1.4-1.6
against 0.9-1.3 s/GiB) and held the GIL longer (each answer's copy out of the CRT's buffer).

Every other verb (listings, HEAD, GET, multipart create/complete, copies, deletes) stays in
botocore. The CRT never retries: the retry policy above decides, from the same ``ClientError``
or ``OSError`` botocore raises (so ``S3Client._fail`` maps both alike), and each request is one
HTTP attempt, reported to the store's health like botocore's.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

import botocore.exceptions as bex

# What each request may take at most: a minute to start answering (botocore's read timeout)
# plus the body at a crawl (64 KiB/s), so a hung server frees the thread, a slow link does not.
FIRST_BYTE_S = 60.0
CRAWL_BYTES_PER_S = 64 << 10
GIL_FREE_COPY = 256 << 10  # a body copied into the CRT's buffer with the GIL released from this size on
ERROR_BODY_MAX = 64 << 10  # (an error answer is a short XML document; a proxy's may be a page)
# The CRT's reasons, as botocore's connection errors read (connection_reason in s3_client.py).
CRT_REASONS = {
    "AWS_IO_SOCKET_CONNECTION_REFUSED": "Connection refused",
    "AWS_IO_SOCKET_TIMEOUT": "connect timeout",
    "AWS_IO_SOCKET_CLOSED": "connection closed",
    "AWS_ERROR_HTTP_CONNECTION_CLOSED": "connection closed",
    "AWS_ERROR_HTTP_SERVER_CLOSED": "connection closed",
    "AWS_IO_SOCKET_NETWORK_DOWN": "network down",
    "AWS_IO_DNS_INVALID_NAME": "unknown host",
    "AWS_IO_DNS_QUERY_FAILED": "unknown host",
}

# A 5xx answer reaches us as one of these names only: 503 (any code) reads SlowDown, 500-504
# InternalError. Both are transient (s3_client.TRANSIENT_CODES).
CRT_SERVER_ERRORS = {
    "AWS_ERROR_S3_SLOW_DOWN": (503, "SlowDown"),
    "AWS_ERROR_S3_INTERNAL_ERROR": (500, "InternalError"),
}


def available() -> bool:
    try:
        import awscrt.s3  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names lower-case
    error: BaseException | None = None
    error_body: bytes = b""
    done: threading.Event = field(default_factory=threading.Event)


class Body(io.RawIOBase):
    """A request body over bytes already in memory, read without copies under the GIL, by both
    of the S3 store's clients (issue 32):

    - botocore turns a bytes body into a BytesIO, hashes it 1 MiB at a time for the SigV4
      payload signature and sends it 16 KiB at a time, each read a copy and a turn of Python
      with the GIL held (0.6-0.7 s of GIL per GiB of parts here). ``read`` hands it the rest of
      the bytes as one view, so the hash is one hashlib call and the send one ``sendall``, both
      with the GIL released (a ``read`` that returns more than asked for is what both of its
      readers accept: they only hash and send it);
    - the CRT reads it in one ``readinto``, a copy made with the GIL released."""

    def __init__(self, data: bytes | bytearray | memoryview):
        self._view = memoryview(data).cast("B")
        self._pos = 0
        self._address = _address(data, self._view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view) - self._pos

    def read(self, size: int | None = -1) -> memoryview:
        chunk = self._view[self._pos :]
        self._pos = len(self._view)
        return chunk

    def readinto(self, out) -> int:
        n = min(len(out), len(self._view) - self._pos)
        if n >= GIL_FREE_COPY and self._address is not None:
            # ctypes calls into C with the GIL released: the 8 MiB copy into the CRT's buffer
            # does not hold up the FUSE loop (a slice assignment would hold the GIL throughout).
            ctypes.memmove((ctypes.c_char * n).from_buffer(out), self._address + self._pos, n)
        else:
            out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _address(data: bytes | bytearray | memoryview, view: memoryview) -> int | None:
    """Where ``data``'s bytes start in memory (None where Python does not say)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    return None


class CrtTransport:
    """One CRT S3 client for one bucket at one endpoint, made in the process that uses it (its
    native threads do not survive a fork)."""

    def __init__(
        self,
        bucket: str,
        endpoint_url: str | None,
        region: str,
        credentials: Callable[[], tuple[str, str, str | None] | None],
        max_connections: int,
        connect_timeout_s: float,
    ):
        from awscrt import auth, s3
        from awscrt import io as crt_io

        self._s3 = s3
        self.bucket = bucket
        if endpoint_url:
            url = urlsplit(endpoint_url)
            self.host = url.netloc.rpartition("@")[2]  # (user:password@ never goes on the wire)
            self._path = url.path.rstrip("/") + "/" + quote(bucket, safe="")  # path-style, as botocore
            tls = url.scheme == "https"
        else:  # AWS itself: virtual-hosted style, as botocore (path-style for dotted names)
            aws = f"s3.{region}.amazonaws.com"
            self.host, self._path = (
                (f"{bucket}.{aws}", "") if "." not in bucket else (aws, "/" + quote(bucket, safe=""))
            )
            tls = True

        def provide() -> auth.AwsCredentials:
            got = credentials()
            if got is None:
                raise RuntimeError("no AWS credentials")
            return auth.AwsCredentials(*got)

        provider = auth.AwsCredentialsProvider.new_delegate(provide)
        self._signing = auth.AwsSigningConfig(
            algorithm=auth.AwsSigningAlgorithm.V4,
            signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
            credentials_provider=provider,
            region=region,
            service="s3",
            # S3 signs the path as sent: neither encoded twice nor normalized.
            use_double_uri_encode=False,
            should_normalize_uri_path=False,
            signed_body_value=auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
            signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
        )
        tls_options = None
        if tls:
            import os

            context = crt_io.TlsContextOptions()
            bundle = os.environ.get("AWS_CA_BUNDLE")
            if bundle:
                context.override_default_trust_store_from_path(ca_filepath=bundle)
            tls_options = crt_io.ClientTlsContext(context).new_connection_options()
        self._client = s3.S3Client(
            region=region,
            tls_mode=s3.S3RequestTlsMode.ENABLED if tls else s3.S3RequestTlsMode.DISABLED,
            tls_connection_options=tls_options,
            signing_config=self._signing,
            part_size=8 << 20,
            max_active_connections_override=max_connections,
            retry_config=s3.S3RetryConfig(retry_mode=s3.S3RetryMode.NONE),
            connect_timeout_ms=int(connect_timeout_s * 1000),
        )

    def path(self, full_key: str, query: str = "") -> str:
        return f"{self._path}/{quote(full_key, safe='/~')}" + (f"?{query}" if query else "")

    def send(
        self,
        method: str,
        operation: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | bytearray | memoryview | None = None,
        signed_payload: bool = True,
    ) -> Answer:
        """One HTTP request with a body (or none), no answer body: the answer of a 2xx, else
        raise what botocore would (ClientError for an error answer, an OSError for none)."""
        from awscrt import exceptions as crt_exceptions
        from awscrt import http

        length = len(memoryview(body).cast("B")) if body is not None else 0
        all_headers = [("Host", self.host), *headers]
        if method in ("PUT", "POST"):
            all_headers.append(("Content-Length", str(length)))
        request = http.HttpRequest(
            method, path, http.HttpHeaders(all_headers), Body(body) if body is not None else None
        )
        answer = Answer(0, {})

        def on_headers(status_code: int, headers, **_) -> None:
            answer.status = status_code
            answer.headers = {k.lower(): v for k, v in headers}

        def on_done(error=None, status_code=None, error_body=None, **_) -> None:
            answer.error = error
            if status_code:
                answer.status = status_code
            answer.error_body = bytes(error_body or b"")[:ERROR_BODY_MAX]
            answer.done.set()

        pending = self._client.make_request(
            type=self._s3.S3RequestType.DEFAULT,
            operation_name=operation,
            request=request,
            signing_config=self._signing.replace(signed_body_value=_payload_hash(body, signed_payload)),
            on_headers=on_headers,
            on_done=on_done,
        )
        if not answer.done.wait(FIRST_BYTE_S + length / CRAWL_BYTES_PER_S):
            pending.cancel()
            answer.done.wait(10)
            raise TimeoutError("read timeout")
        if 200 <= answer.status < 300 and answer.error is None:
            return answer
        if answer.status >= 300:
            raise _client_error(answer, operation)
        name = getattr(answer.error, "name", "") or type(answer.error).__name__
        if isinstance(answer.error, crt_exceptions.AwsCrtError) and answer.status:
            raise _client_error(answer, operation)
        if name in CRT_SERVER_ERRORS:  # (the CRT keeps neither the status nor the body of these)
            answer.status, code = CRT_SERVER_ERRORS[name]
            answer.error_body = f"<Error><Code>{code}</Code><Message>{name}</Message></Error>".encode()
            raise _client_error(answer, operation)
        raise ConnectionError(CRT_REASONS.get(name, name))

    def close(self) -> None:
        shutdown = self._client.shutdown_event
        del self._client
        shutdown.wait(5)


def _payload_hash(body: bytes | bytearray | memoryview | None, signed: bool) -> str:
    """What the signature says of the body: its SHA-256 where the body is signed (the server
    then refuses a body damaged on the way: Swift verifies no other checksum), else
    UNSIGNED-PAYLOAD. The CRT's S3 client never hashes a body itself (it signs every body
    UNSIGNED-PAYLOAD); hashlib does, with the GIL released."""
    if not signed:
        return "UNSIGNED-PAYLOAD"
    return hashlib.sha256(body if body is not None else b"").hexdigest()


def _client_error(answer: Answer, operation: str) -> bex.ClientError:
    """An error answer as botocore raises it (code and message from the XML body)."""
    code, message = "", ""
    if answer.error_body:
        try:
            root = ElementTree.fromstring(answer.error_body)
            code = root.findtext("Code") or ""
            message = root.findtext("Message") or ""
        except ElementTree.ParseError:
            message = answer.error_body[:200].decode("utf-8", "replace")
    response = {
        "Error": {"Code": code or str(answer.status), "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": answer.status},
    }
    return bex.ClientError(response, operation)
