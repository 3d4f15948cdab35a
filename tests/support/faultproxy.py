"""A fault-injecting HTTP/1.1 reverse proxy for tests, in front of a real S3 server.

    with FaultProxy(s3_server.endpoint) as proxy:          # listens on 127.0.0.1 (host=...), a free port
        client = boto3.client("s3", endpoint_url=proxy.url, ...)
        proxy.add_rule(Rule(kind="upload_part", action=status(503, "SlowDown"), count=3))
        ...
        proxy.count(kind="get")                             # requests seen

Each client connection is served by a thread and may carry many requests (keep-alive).
Every request goes upstream on a fresh connection with its headers untouched (SigV4 signs
the Host header, which is therefore the proxy's: the server checks it as sent). Bodies are
streamed in 64 KiB pieces, framed by Content-Length or ``Transfer-Encoding: chunked`` (so
aws-chunked bodies pass as they are); ``Expect: 100-continue`` is answered by the proxy.

A request is classified into a *kind* (get, put, upload_part, create_multipart,
complete_multipart, abort, head, list, delete, copy) and counted per (method, kind). The
first rule that matches it (method, path regex, query substring, kind, header regexes; within its count,
probability and time window) decides what happens; with none, it is forwarded as is.
Actions: ``status(code, s3_code)``, ``delay(seconds)``, ``reset_mid_body()``,
``drop_response()``, ``blackhole()``, ``corrupt_request_body()``, ``corrupt_response_body()``,
``hold()``.

``hold()`` is a gate, for tests that must act while a request is in flight (no sleeps):

    rule = proxy.add_rule(Rule(hold(), kind="create_multipart", count=1))
    ...                                   # something sends the request
    held = rule.wait_held()               # the request is at the proxy, not yet sent upstream
    ...                                   # act in the window (kill, rename, ...)
    rule.release()                        # forward it now (forward=False: reset, never sent)
    held.done.wait(10)                    # the server answered (held.status) or it was dropped

Each request's ``done`` event is set once the proxy is through with it (answered, dropped, or
failed), and ``status`` is the server's answer when one came.

``verify_checksums = True`` makes the proxy check what AWS S3 checks and the servers here
(Swift 2.30, moto 5.2) do not: a request body sent with ``x-amz-checksum-crc32c`` that does not
match it (after any corruption the proxy itself applied) is answered 400 BadDigest, unforwarded.

``proxy.rate`` (bytes per second, None: no limit) throttles the whole proxy like a link: request
bodies share one budget upstream, response bodies another downstream, across all connections.
"""

from __future__ import annotations

import base64
import random
import re
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Self
from urllib.parse import urlsplit

PIECE = 64 << 10
KINDS = (
    "get",
    "put",
    "upload_part",
    "create_multipart",
    "complete_multipart",
    "abort",
    "head",
    "list",
    "delete",
    "copy",
)


@dataclass(frozen=True)
class Action:
    name: str
    seconds: float = 0.0  # delay
    code: int = 0  # status
    s3_code: str = ""
    message: str = ""


def status(code: int = 503, s3_code: str = "SlowDown", message: str = "injected by faultproxy") -> Action:
    """Answer with this HTTP status and an S3 XML error, without forwarding."""
    return Action("status", code=code, s3_code=s3_code, message=message)


def delay(seconds: float) -> Action:
    """Wait, then forward."""
    return Action("delay", seconds=seconds)


def reset_mid_body() -> Action:
    """Forward half of the request body then reset both sides (the server never acts); a request
    without a body is forwarded and the connection reset halfway through the response body."""
    return Action("reset_mid_body")


def drop_response() -> Action:
    """Forward the request (the server acts), then close the client connection without an answer."""
    return Action("drop_response")


def blackhole() -> Action:
    """Read the request, never answer; the connection is closed once the rule is gone."""
    return Action("blackhole")


def corrupt_request_body() -> Action:
    """Flip a byte in the middle of the request body (length kept), then forward."""
    return Action("corrupt_request_body")


def hold() -> Action:
    """Keep the request (its head read, its body unread) at the proxy until ``rule.release()``:
    then forward it, or (``release(forward=False)``) reset the connection without sending it."""
    return Action("hold")


def corrupt_response_body() -> Action:
    """Forward, then flip a byte in the middle of the response body (length and headers kept):
    a bit error the transport did not catch, as a client sees it over plain http."""
    return Action("corrupt_response_body")


@dataclass(eq=False)
class Rule:
    action: Action
    method: str | None = None  # "PUT"
    path: str | None = None  # regex searched in the path (still %-encoded)
    query: str | None = None  # substring of the raw query
    kind: str | tuple[str, ...] | None = None  # one of KINDS, or several
    headers: dict[str, str] | None = None  # lower-case name -> regex searched in its value
    count: int | None = None  # fire at most this many times
    probability: float = 1.0
    after_s: float = 0.0  # active from after_s ...
    for_s: float | None = None  # ... for for_s seconds after add_rule (None: for ever)
    hits: int = 0  # times it fired
    added: float = field(default=0.0, repr=False)
    removed: threading.Event = field(default_factory=threading.Event, repr=False)
    held: list[Request] = field(default_factory=list, repr=False)  # requests a hold() rule caught
    _entered: threading.Event = field(default_factory=threading.Event, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _forward: bool = field(default=True, repr=False)

    def wait_held(self, timeout: float = 60) -> Request:
        """Wait until a request is being held by this (hold) rule; the first one held."""
        if not self._entered.wait(timeout):
            raise AssertionError(f"no request matching {self} reached the proxy in {timeout} s")
        return self.held[0]

    def release(self, forward: bool = True) -> None:
        """Let held requests (and any this rule catches later) go: forwarded upstream, or
        (forward=False) the client connection reset with nothing sent upstream."""
        self._forward = forward
        self._released.set()

    def matches(self, req: Request) -> bool:
        kinds = (self.kind,) if isinstance(self.kind, str) else self.kind
        return (
            (self.method is None or req.method == self.method.upper())
            and (kinds is None or req.kind in kinds)
            and (self.query is None or self.query in req.query)
            and (self.path is None or re.search(self.path, req.path) is not None)
            and all(re.search(rx, req.headers.get(name, "")) for name, rx in (self.headers or {}).items())
        )

    def active(self, now: float) -> bool:
        if self.count is not None and self.hits >= self.count:
            return False
        return self.added + self.after_s <= now and not self.over(now)

    def over(self, now: float) -> bool:
        """Removed, or past its time window."""
        return self.removed.is_set() or (
            self.for_s is not None and now >= self.added + self.after_s + self.for_s
        )


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    kind: str = ""
    action: str = "forward"
    status: int = 0  # the answer's status (the server's, or the injected one); 0: none came
    done: threading.Event = field(default_factory=threading.Event, repr=False)  # the proxy is through


def classify(method: str, path: str, query: str, headers: dict[str, str]) -> str:
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    has_key = "/" in path.strip("/")
    if method == "HEAD":
        return "head"
    if method == "PUT":
        return (
            "copy" if "x-amz-copy-source" in headers else "upload_part" if "partNumber" in params else "put"
        )
    if method == "POST":
        return (
            "create_multipart"
            if "uploads" in params
            else "complete_multipart"
            if "uploadId" in params
            else "delete"
        )
    if method == "DELETE":
        return "abort" if "uploadId" in params else "delete"
    if "uploadId" in params or "uploads" in params or not has_key or "list-type" in params:
        return "list"
    return "get"


def _read_head(f) -> list[bytes] | None:
    """The start line and header lines of a message, or None at a clean EOF."""
    lines = []
    while True:
        line = f.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("EOF inside a message head")
            return None
        if line in (b"\r\n", b"\n"):
            if lines:
                return lines
            continue  # tolerate stray CRLFs between messages
        lines.append(line)


def _headers(lines: list[bytes]) -> dict[str, str]:
    out = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _chunked(headers: dict[str, str]) -> bool:
    return "chunked" in headers.get("transfer-encoding", "").lower()


def _body(f, headers: dict[str, str], until_eof: bool = False):
    """Yield a body's raw bytes as (piece, is_payload): chunked framing passes through as is."""
    if _chunked(headers):
        while True:
            size_line = f.readline(65537)
            if not size_line:
                raise ConnectionError("EOF inside a chunked body")
            yield size_line, False
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = f.readline(65537)
                    yield line, False
                    if line in (b"\r\n", b"\n", b""):
                        return
            yield from _exact(f, size)
            yield f.readline(65537), False
    elif "content-length" in headers:
        yield from _exact(f, int(headers["content-length"]))
    elif until_eof:
        while piece := f.read1(PIECE):
            yield piece, True


def _exact(f, n: int):
    while n > 0:
        piece = f.read1(min(n, PIECE))
        if not piece:
            raise ConnectionError("EOF inside a body")
        n -= len(piece)
        yield piece, True


class _Link:
    """One direction of a throttled link: each piece waits for its turn on the wire."""

    def __init__(self, proxy: FaultProxy):
        self.proxy = proxy
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.bytes = 0  # what went through this way (bodies)

    def __call__(self, n: int) -> None:
        with self._lock:
            self.bytes += n
        rate = self.proxy.rate
        if not rate:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


def _copy(body, out: socket.socket, length: int, corrupt: bool = False, cut: bool = False, pace=None) -> bool:
    """Send a body to ``out``, flipping its middle byte (``corrupt``) or stopping at its middle
    (``cut``: then True). Without a length (chunked), the middle of its first payload piece.
    ``pace(n)`` is called before each piece (a throttled link)."""
    middle, sent = length // 2, 0
    for piece, payload in body:
        if pace is not None:
            pace(len(piece))
        if payload and (corrupt or cut) and (not length or sent + len(piece) > middle):
            i = middle - sent if length else len(piece) // 2
            if cut:
                out.sendall(piece[:i])
                return True
            piece = piece[:i] + bytes([piece[i] ^ 0xFF]) + piece[i + 1 :]
            corrupt = False
        out.sendall(piece)
        sent += len(piece) if payload else 0
    return False


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        proxy, sock = self.server.proxy, self.request
        proxy._track(sock, True)
        rfile = sock.makefile("rb")
        try:
            while not proxy._stopping.is_set() and self._one(proxy, sock, rfile):
                pass
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            proxy._track(sock, False)
            rfile.close()
            sock.close()

    @staticmethod
    def _checked_body(body, headers: dict[str, str], corrupt: bool):
        """The whole body (corrupted if asked) and whether it matches its x-amz-checksum-crc32c."""
        from awscrt import checksums

        data = bytearray(b"".join(piece for piece, _ in body))
        if corrupt and data:
            data[len(data) // 2] ^= 0xFF
        crc = base64.b64encode(checksums.crc32c(bytes(data)).to_bytes(4, "big")).decode()
        return bytes(data), crc == headers["x-amz-checksum-crc32c"]

    def _one(self, proxy: FaultProxy, sock: socket.socket, rfile) -> bool:
        """Serve one request; False when the client connection must end."""
        head = _read_head(rfile)
        if head is None:
            return False
        method, target, version = head[0].decode("latin-1").split(None, 2)
        headers = _headers(head)
        path, _, query = target.partition("?")
        req = Request(method, path, query, headers, classify(method, path, query, headers))
        try:
            return self._serve(proxy, sock, rfile, req, head, version)
        finally:
            req.done.set()

    def _serve(self, proxy: FaultProxy, sock: socket.socket, rfile, req: Request, head, version) -> bool:
        method, path, headers = req.method, req.path, req.headers
        rule = proxy._match(req)
        action = rule.action if rule else Action("forward")
        req.action = action.name
        proxy._record(req)
        if rule is not None and action.name == "hold":
            rule.held.append(req)
            rule._entered.set()
            while not (rule._released.wait(0.05) or proxy._stopping.is_set()):
                pass
            if not rule._forward or proxy._stopping.is_set():
                _reset(sock)
                return False
        keep_alive = version.strip() != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        if headers.get("expect", "").lower() == "100-continue":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            head = [h for h in head if not h.lower().startswith(b"expect:")]
        body = _body(rfile, headers)
        if action.name in ("status", "blackhole"):
            for _ in body:
                pass
            if action.name == "blackhole":
                while not (rule.over(time.time()) or proxy._stopping.is_set()):
                    time.sleep(0.05)
                _reset(sock)
                return False
            req.status = action.code
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{action.s3_code}</Code>'
                f"<Message>{action.message}</Message><Resource>{path}</Resource>"
                "<RequestId>faultproxy</RequestId></Error>"
            ).encode()
            sock.sendall(
                f"HTTP/1.1 {action.code} Injected\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(xml)}\r\nx-amz-request-id: faultproxy\r\n\r\n".encode()
                + (b"" if method == "HEAD" else xml)
            )
            return keep_alive
        corrupt = action.name == "corrupt_request_body"
        if (
            proxy.verify_checksums
            and "x-amz-checksum-crc32c" in headers
            and not _chunked(headers)
            and action.name in ("forward", "delay", "corrupt_request_body")
        ):
            data, good = self._checked_body(body, headers, corrupt)
            if not good:
                proxy.refused_checksums += 1
                req.status = 400
                xml = (
                    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadDigest</Code><Message>The '
                    b"CRC32C you specified did not match the calculated checksum.</Message></Error>"
                )
                sock.sendall(
                    f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(xml)}\r\n\r\n".encode()
                    + xml
                )
                return keep_alive
            body, corrupt = iter([(data, True)]), False
        if action.name == "delay":
            time.sleep(action.seconds)
        try:
            up = socket.create_connection(proxy._upstream, timeout=120)
        except OSError:
            sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return False
        with up, up.makefile("rb") as upfile:
            up.sendall(b"".join(head) + b"\r\n")
            length = int(headers.get("content-length", "0") or 0)
            has_body = length > 0 or _chunked(headers)
            if _copy(body, up, length, corrupt=corrupt, cut=action.name == "reset_mid_body", pace=proxy._up):
                _reset(up)
                _reset(sock)
                return False
            return self._relay(sock, upfile, req, action, has_body) and keep_alive

    def _relay(self, sock, upfile, req: Request, action: Action, req_had_body: bool) -> bool:
        """Copy the upstream response to the client (or not, as the action says)."""
        while True:
            head = _read_head(upfile)
            if head is None:
                raise ConnectionError("upstream closed without answering")
            code = int(head[0].split()[1])
            if code != 100:
                break
        req.status = code
        headers = _headers(head)
        no_body = req.method == "HEAD" or code in (204, 304)
        body = iter(()) if no_body else _body(upfile, headers, until_eof=True)
        if action.name == "drop_response":
            for _ in body:
                pass
            _reset(sock)
            return False
        cut = action.name == "reset_mid_body" and not req_had_body
        length = int(headers.get("content-length", "0") or 0)
        if cut and (no_body or not (length or _chunked(headers))):
            _reset(sock)  # nothing to cut in half: the server acted, the client hears a reset
            return False
        sock.sendall(b"".join(head) + b"\r\n")
        if _copy(
            body,
            sock,
            length,
            corrupt=action.name == "corrupt_response_body" and not no_body,
            cut=cut,
            pace=self.server.proxy._down,
        ):
            _reset(sock)
            return False
        framed = no_body or "content-length" in headers or _chunked(headers)
        return framed and headers.get("connection", "").lower() != "close"


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class FaultProxy:
    def __init__(self, upstream_url: str, host: str = "127.0.0.1"):
        parts = urlsplit(upstream_url)
        self.host = host  # the address it listens on (a free port there)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, kind) -> requests seen
        self.verify_checksums = False  # act as AWS: refuse a body that does not match its CRC32C
        self.refused_checksums = 0  # bodies refused so (BadDigest)
        self.requests: list[Request] = []  # every request seen, in order, with the action taken
        self.url = ""
        self.rate: float | None = None  # bytes per second each way, all connections together
        self._up, self._down = _Link(self), _Link(self)

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> Self:
        self._server = _Server((self.host, 0), _Handler)
        self._server.proxy = self
        self.url = f"http://{self.host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- rules -----------------------------------------------------------------------------
    def add_rule(self, rule: Rule) -> Rule:
        rule.added = time.time()
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        rule.removed.set()  # also releases the connections it blackholes
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        with self._lock:
            rules, self._rules = self._rules, []
        for rule in rules:
            rule.removed.set()

    # -- counters --------------------------------------------------------------------------
    @property
    def sent_bytes(self) -> int:
        """Response body bytes the proxy passed to its clients (what the store sent them)."""
        return self._down.bytes

    def count(self, method: str | None = None, kind: str | None = None) -> int:
        """Requests seen (whatever was done with them) of this method and/or kind."""
        with self._lock:
            return sum(
                n
                for (m, k), n in self.counts.items()
                if (method is None or m == method.upper()) and (kind is None or k == kind)
            )

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.requests.clear()

    # -- internals -------------------------------------------------------------------------
    def _match(self, req: Request) -> Rule | None:
        now = time.time()
        with self._lock:
            for rule in self._rules:
                if rule.active(now) and rule.matches(req) and random.random() < rule.probability:
                    rule.hits += 1
                    return rule
        return None

    def _record(self, req: Request) -> None:
        with self._lock:
            self.counts[(req.method, req.kind)] += 1
            self.requests.append(req)

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(sock)
