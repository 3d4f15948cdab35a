"""The peer channel: mutual TLS over TCP between the members of a cluster, in threads of its
own, so that neither encryption nor sending ever runs on the trio thread that serves FUSE.

One request at a time per connection; a client keeps a few idle connections per peer.

    request:  length (4 bytes, big endian) + JSON {"url", "key", "size", "tag", "begin", "span"}
    answers:  b"W"                          still working (fetching from the store): keep waiting
              b"N" + length (2) + reason    not served (the client reads from the store)
              b"D" + length (8) + bytes     the bytes [begin, begin + span) of that version

A request naming ``records`` carries the writer records a node pushes to its peers
(cluster/peer_records.py), answered ``D`` with no bytes when taken. The server adds ``from``,
the fingerprint of the client's certificate, to every request it passes on.

A request naming ``replica`` opens a replica stream instead (cluster/replicas.py says its
messages): the connection is that stream's until it ends.

The server sends a ``W`` every ``KEEPALIVE_S`` while it gathers the bytes, so a client tells a
slow peer (working) from a lost one (silent for ``IDLE_S``) without a total timeout that a
large part on a slow link would trip. Bytes are sent straight from the cache's arena (a view
of the RAM tier's mapping, no copy in Python); they cannot go through ``sendfile`` because TLS
encrypts them in user space.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptfs.cluster import peer_tls
from ckptfs.cluster.members import Member

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0
IDLE_S = 5.0  # a peer silent this long (no keepalive) is lost
CONNECT_S = 2.0
HANDSHAKE_S = 3.0  # (a stranger holds a connection slot at most this long)
SERVER_IDLE_S = 30.0  # a connection with no request for this long is closed by the server
SLOT_WAIT_S = 2.0  # a connection arriving while every slot is taken waits this long for one
REQUEST_MAX = 8 << 10  # (a pushed set of writer records is at most 5 KiB of it)
IDLE_CONNECTIONS = 2  # kept open per peer by a client (each holds one of that peer's slots)
MAX_IDLE = 8  # kept open by a client in all, whatever the number of peers (``PeerClient(max_idle=)``)


class PeerError(Exception):
    """The peer could not be reached or broke off (the client reads from the store instead).
    ``lost``: it looks gone (refused, silent, broke off), not merely busy or refusing us."""

    def __init__(self, message: str, lost: bool = True):
        super().__init__(message)
        self.lost = lost


@dataclass
class Served:
    """What the server's trio side gathered for a request: block slices to send, pinned until
    ``release`` (or why not)."""

    slices: list[tuple[Callable[[ssl.SSLSocket], None], int]]  # (send the slice to a socket, its length)
    release: Callable[[], None]
    refused: str = ""


# -- the server -----------------------------------------------------------------------------
class PeerServer:
    """Accepts peers (``max_connections`` at once, each in its own thread) and answers their
    requests with what ``gather`` (a call into the trio side, returning a Future of ``Served``)
    finds."""

    def __init__(
        self,
        context: Callable[[], ssl.SSLContext],
        admitted: Callable[[str], bool],
        gather: Callable[[dict], concurrent.futures.Future],
        released: Callable[[Callable[[], None]], None],
        max_connections: int,
        session: Callable[[dict, ssl.SSLSocket, str], None] | None = None,
    ):
        self.context = context  # the current server context (trusts the live members' certificates)
        self.admitted = admitted  # whether a client certificate's fingerprint is a member's
        self.gather = gather
        self.released = released  # run a Served.release on the trio side
        # A request with "replica" hands the connection over to this for its life (with the
        # client's certificate fingerprint): a node's stream of replicas (cluster/replicas.py).
        self.session = session
        self.slots = threading.BoundedSemaphore(max_connections)
        self.sock: socket.socket | None = None
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopping = False
        self.counts = threading.Lock()  # (the counters below are bumped from many threads)
        self.served_bytes = 0
        self.requests = 0
        self.refused_clients = 0  # connections that did not prove a member's certificate
        self.busy_refusals = 0  # connections closed at once: all slots taken
        self.broken_off = 0  # asks broken off (the asker left, or a stop) before fully answered
        self.threads: list[threading.Thread] = []

    def start(self, host: str, port: int) -> int:
        """Listen on (host, port); the port (0: any free one)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        self.sock = sock
        thread = threading.Thread(target=self._accept, name="ckptfs-peer-accept", daemon=True)
        thread.start()
        self.threads.append(thread)
        return sock.getsockname()[1]

    def stop(self, timeout: float = 5.0) -> int:
        """Stop accepting, break every connection off, wait for their threads (they may be
        sending from the arena, which must outlive them); the number still running after
        ``timeout`` (0: all ended), with a warning if any."""
        self.stopping = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = sum(thread.is_alive() for thread in self.threads)
        if left:
            log.warning("peer server: %d threads still running %g s after the stop", left, timeout)
        return left

    def _accept(self) -> None:
        assert self.sock is not None
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self.slots.acquire(timeout=SLOT_WAIT_S):
                self._count("busy_refusals")
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="ckptfs-peer-serve", daemon=True)
            with self.lock:
                self.conns.add(conn)
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        tls: ssl.SSLSocket | None = None
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                tls = self.context().wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError) as exc:
                self._count("refused_clients")
                log.info("refused a peer connection: %s", exc)
                return
            with self.lock:  # (``stop`` shuts down what is registered: now the TLS socket)
                self.conns.discard(conn)
                self.conns.add(tls)
                if self.stopping:
                    return
            der = tls.getpeercert(binary_form=True)
            fingerprint = peer_tls.der_fingerprint(der) if der is not None else ""
            if not fingerprint or not self.admitted(fingerprint):
                self._count("refused_clients")
                log.info("refused a peer connection: not a member's certificate")
                return
            while not self.stopping and self._answer(tls, fingerprint):
                pass
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.debug("peer connection ended: %s", exc)
        finally:
            with self.lock:
                self.conns.discard(conn)
                if tls is not None:
                    self.conns.discard(tls)
            if tls is not None:
                tls.close()
            conn.close()
            self.slots.release()

    def _count(self, name: str, n: int = 1) -> None:
        with self.counts:
            setattr(self, name, getattr(self, name) + n)

    def _answer(self, tls: ssl.SSLSocket, fingerprint: str) -> bool:
        """Answer one request; False when the client is done (or sent nonsense)."""
        tls.settimeout(SERVER_IDLE_S)
        head = recv_exact(tls, 4)
        if head is None:
            return False
        (length,) = struct.unpack(">I", head)
        if length > REQUEST_MAX:
            return False
        raw = recv_exact(tls, length)
        if raw is None:
            return False
        request = json.loads(raw)
        if not isinstance(request, dict):
            return False
        self._count("requests")
        if "replica" in request:
            if self.session is not None:
                self.session(request, tls, fingerprint)
            return False
        future = self.gather({**request, "from": fingerprint})
        try:
            while True:
                try:
                    served: Served = future.result(timeout=KEEPALIVE_S)
                    break
                except concurrent.futures.TimeoutError:
                    tls.sendall(b"W")
        except BaseException:
            # The client is gone: the trio side must not pin blocks for nobody. If it already
            # answered (or is answering), let what it pinned go.
            if not future.cancel():
                with contextlib.suppress(Exception):
                    self.released(future.result(timeout=10).release)
            self._count("broken_off")  # (once cancelled, or let go)
            raise
        if served.refused:
            reason = served.refused.encode()[:1000]
            tls.sendall(b"N" + struct.pack(">H", len(reason)) + reason)
            return True
        try:
            total = sum(length for _, length in served.slices)
            tls.sendall(b"D" + struct.pack(">Q", total))
            for send, length in served.slices:
                send(tls)
                self._count("served_bytes", length)
        except BaseException:
            self._count("broken_off")
            raise
        finally:
            self.released(served.release)
        return True


# -- the client -----------------------------------------------------------------------------
class PeerClient:
    """Requests to peers, from worker threads; a few idle connections kept per peer."""

    def __init__(self, context: Callable[[Member], ssl.SSLContext], max_idle: int = MAX_IDLE):
        self.context = context  # a client context that trusts exactly that member's certificate
        self.idle: dict[str, list[ssl.SSLSocket]] = {}
        self.max_idle = max_idle  # (daemon/limits.py counts them: not one pool per member of a big cluster)
        self.lock = threading.Lock()

    def take(self, member: Member, request: dict, span: int, deadline: float) -> bytearray | str:
        """The bytes ``request`` asks of ``member`` (exactly ``span``), or the peer's reason for
        not serving them. Raises PeerError when the peer cannot be reached, falls silent for
        ``IDLE_S``, breaks off, or has not answered by ``deadline`` (time.monotonic())."""
        body = json.dumps(request).encode()
        tls, reused = self._connection(member)
        try:
            return self._exchange(member, tls, body, span, deadline)
        except PeerError:
            if not reused:
                raise
        # (an idle connection the peer had closed meanwhile: once more, on a new one)
        tls, _ = self._connection(member, reuse=False)
        return self._exchange(member, tls, body, span, deadline)

    def _exchange(self, member: Member, tls: ssl.SSLSocket, body: bytes, span: int, deadline: float):
        try:
            tls.settimeout(IDLE_S)
            tls.sendall(struct.pack(">I", len(body)) + body)
            while True:
                tls.settimeout(max(0.01, min(IDLE_S, deadline - time.monotonic())))
                kind = recv_exact(tls, 1)
                if kind == b"W":
                    if time.monotonic() >= deadline:
                        raise PeerError("no answer in time")
                    continue
                if kind == b"N":
                    head = recv_exact(tls, 2)
                    reason = recv_exact(tls, struct.unpack(">H", head)[0]) if head else None
                    if reason is None:
                        raise PeerError("broke off")
                    self._keep(member, tls)
                    return reason.decode(errors="replace")
                if kind != b"D":
                    raise PeerError("broke off" if kind is None else "spoke nonsense")
                head = recv_exact(tls, 8)
                if head is None or struct.unpack(">Q", head)[0] != span:
                    raise PeerError("sent another length")
                data = bytearray(span)
                view = memoryview(data)
                got = 0
                while got < span:
                    tls.settimeout(max(0.01, min(IDLE_S, deadline - time.monotonic())))
                    n = tls.recv_into(view[got:], min(span - got, 1 << 20))
                    if not n:
                        raise PeerError("broke off mid-transfer")
                    got += n
                self._keep(member, tls)
                return data
        except (OSError, ssl.SSLError, ValueError, struct.error) as exc:
            tls.close()
            raise PeerError(str(exc) or type(exc).__name__) from None
        except BaseException:
            tls.close()
            raise

    def open(self, member: Member) -> ssl.SSLSocket:
        """A new connection to ``member`` (PeerError if it cannot be made)."""
        return self._connection(member, reuse=False)[0]

    def _connection(self, member: Member, reuse: bool = True) -> tuple[ssl.SSLSocket, bool]:
        with self.lock:
            pool = self.idle.get(member.fingerprint)
            if pool and reuse:
                return pool.pop(), True
        try:
            raw = socket.create_connection((member.host, member.port), timeout=CONNECT_S)
        except OSError as exc:
            raise PeerError(f"cannot connect: {exc.strerror or exc}") from None  # (refused: gone)
        try:
            raw.settimeout(HANDSHAKE_S)
            tls = self.context(member).wrap_socket(raw)
            der = tls.getpeercert(binary_form=True)
            if der is None or peer_tls.der_fingerprint(der) != member.fingerprint:
                tls.close()
                raise PeerError("showed another certificate than its record's", lost=False)
            return tls, False
        except (OSError, ssl.SSLError) as exc:
            raw.close()  # (busy, or it does not know this node yet: not gone)
            raise PeerError(f"TLS handshake failed: {exc}", lost=False) from None

    def _keep(self, member: Member, tls: ssl.SSLSocket) -> None:
        with self.lock:
            pool = self.idle.setdefault(member.fingerprint, [])
            if len(pool) < IDLE_CONNECTIONS and sum(map(len, self.idle.values())) < self.max_idle:
                pool.append(tls)
                return
        tls.close()

    def forget(self, fingerprints: set[str]) -> None:
        """Close the idle connections to peers no longer members."""
        with self.lock:
            for fp in [fp for fp in self.idle if fp not in fingerprints]:
                for tls in self.idle.pop(fp):
                    tls.close()

    def close(self) -> None:
        self.forget(set())


def recv_exact(sock: ssl.SSLSocket, n: int) -> bytes | None:
    """``n`` bytes, or None if the connection ended first."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


# -- replica streams (cluster/replication.py sends, cluster/replicas.py holds) -----------------
FRAME_HEADER_MAX = 4 << 20  # an op's record (its block list) fits: 12,800 blocks is 100 GiB


def send_frame(
    tls: ssl.SSLSocket, header: dict, slices: list[tuple[Callable[[ssl.SSLSocket], None], int]]
) -> None:
    """One message of a replica stream: its JSON header (with ``n``, the body's length), then
    the body, sent slice by slice."""
    raw = json.dumps({**header, "n": sum(length for _, length in slices)}, separators=(",", ":")).encode()
    tls.sendall(struct.pack(">I", len(raw)) + raw)
    for send, _ in slices:
        send(tls)


def read_frame_length(tls: ssl.SSLSocket) -> int | None:
    """The length of the next message's header (None: the stream ended); ``read_frame_body``
    reads the header, then its body (``n`` bytes) follows. (Two steps: the holder reads a large
    header only while no other large one is in memory, daemon/limits.py.)"""
    head = recv_exact(tls, 4)
    if head is None:
        return None
    (length,) = struct.unpack(">I", head)
    if length > FRAME_HEADER_MAX:
        raise ValueError("header too large")
    return length


def read_frame_body(tls: ssl.SSLSocket, length: int) -> dict | None:
    """The header of ``length`` bytes whose length ``read_frame_length`` read."""
    raw = recv_exact(tls, length)
    if raw is None:
        return None
    header = json.loads(raw)
    if not isinstance(header, dict) or not isinstance(header.get("n"), int) or header["n"] < 0:
        raise ValueError("not a message header")
    return header


def recv_into(tls: ssl.SSLSocket, out: memoryview) -> None:
    """Fill ``out`` from the stream (ValueError if it ends first)."""
    got = 0
    while got < len(out):
        n = tls.recv_into(out[got:], min(len(out) - got, 1 << 20))
        if not n:
            raise ValueError("the stream ended mid-message")
        got += n


def send_answer(tls: ssl.SSLSocket, value: int | str) -> None:
    """A message's answer: ``A`` + a number (the op acknowledged, or 0), or ``N`` + why not."""
    if isinstance(value, int):
        tls.sendall(b"A" + struct.pack(">Q", value))
    else:
        reason = value.encode()[:1000]
        tls.sendall(b"N" + struct.pack(">H", len(reason)) + reason)


def read_answer(tls: ssl.SSLSocket) -> int:
    """The number a message was answered with; PeerError if refused or the stream ended."""
    kind = recv_exact(tls, 1)
    if kind == b"A":
        raw = recv_exact(tls, 8)
        if raw is not None:
            return struct.unpack(">Q", raw)[0]
    elif kind == b"N":
        head = recv_exact(tls, 2)
        reason = recv_exact(tls, struct.unpack(">H", head)[0]) if head else None
        if reason is not None:
            raise PeerError(f"refused: {reason.decode(errors='replace')}", lost=False)
    raise PeerError("broke off")


def send_request(tls: ssl.SSLSocket, request: dict) -> None:
    """The request that opens a stream (the server's ``_answer`` reads it)."""
    body = json.dumps(request).encode()
    tls.sendall(struct.pack(">I", len(body)) + body)
