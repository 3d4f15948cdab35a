"""A store worker: a process of its own that moves the bytes of an S3 store between the cache's
files and the store (issue 42). Started by ``workers.StoreWorkers`` as
``python -m ckptfs.transfer.worker_process``.

The daemon keeps every decision (what to send or fetch, when a file is durable, retries, the
journal); a worker does the bytes of one request at a time per channel: for a part it
``pread``s the pieces from the file descriptors that came with the request (arena or working
files), hashes them (xxh3, the manifest's), signs and sends them through its own S3 client, and
answers the part's token and digest; for a fetch it GETs a range, checks each part against the
xxh3 the daemon gave, and only then writes the blocks into the cache slots the daemon gave. Its
GIL is not the daemon's, so none of that holds up FUSE requests or the trio loop.

Start-up: the store's description (bucket, prefix, endpoint, whether the server verifies CRC32C)
comes as one JSON line on stdin (never in argv, which any local user can read); the channels are
the inherited ``SOCK_SEQPACKET`` sockets named in argv; the worker says ``ready`` on the first
once its client is built. It ignores SIGINT (the daemon decides when it ends), dies with the
daemon's spawning thread (``PR_SET_PDEATHSIG``) and ends when its channels close.

The protocol, per channel (one request at a time; pieces are [fd index or -1 for zeros,
position, length, zeros past the file's end allowed]):

    daemon -> {"op": "part", "key", "upload_id", "number", "crc", "pieces"}, with the request's
              descriptors (SCM_RIGHTS); or {"op": "xxh3", "pieces"}: the hash of a whole file
    worker -> {"read": true}          once every piece is read (the daemon may close the cache)
    worker -> {"token", "xxh3"} or {"xxh3"}

    daemon -> {"op": "fetch", "key", "start", "length", "parts": [[offset, len, xxh3], ...],
               "blocks": [[fd index, pos, offset, len], ...]}, with the slots' descriptors
    worker -> {"got", "metadata"[, "mismatch": offset]}: written only when whole and matching

Every answer may instead be {"error": ...} (``error_to_wire``), and carries "health": what each
HTTP attempt said about the store, for the daemon's ``StoreHealth``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import sys
import threading

import xxhash

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.objects.integrity import part_hash
from ckptfs.util.background import NICE

MAX_MESSAGE = 1 << 20  # (the daemon sends at most workers.MAX_REQUEST)
PR_SET_PDEATHSIG = 1


class HealthRecorder:
    """What the S3 client tells a ``StoreHealth`` about each HTTP attempt, kept per thread (a
    channel's) and sent with its answer; the daemon's own health replays it."""

    def __init__(self):
        self._local = threading.local()

    def drain(self) -> list:
        events, self._local.events = getattr(self._local, "events", []), []
        return events

    def _add(self, event: list) -> None:
        if not hasattr(self._local, "events"):
            self._local.events = []
        self._local.events.append(event)

    def attempt_started(self, op: str, key: str) -> int:
        return 0  # (the daemon times the whole request as one attempt)

    def attempt_ended(self, token) -> None:
        pass

    def failed(self, op: str, key: str, reason: str, reachable: bool | None = None) -> None:
        self._add(["failed", op, key, reason, reachable])

    def answered(self) -> None:
        self._add(["answered"])


def error_to_wire(exc: BaseException) -> dict:
    if isinstance(exc, StoreError):
        kinds = ((NotFound, "NotFound"), (PartsLeftOut, "PartsLeftOut"))
        kind = next((name for cls, name in kinds if isinstance(exc, cls)), "StoreError")
        return {
            "type": kind,
            "message": str(exc),
            "errno": exc.errno,
            "transient": exc.transient,
            "code": exc.code,
        }
    if isinstance(exc, OSError):  # (reading or writing the cache's files)
        return {"type": "OSError", "message": str(exc), "errno": exc.errno or errno.EIO}
    return {"type": "bug", "message": f"{type(exc).__name__}: {exc}"}


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def read_pieces(fds: list[int], pieces: list[list[int]], out: memoryview) -> None:
    """The pieces' bytes into ``out``: each from its file, or zeros (-1). A read that ends
    early is zeros where the piece allows it (a working file's end: its hole), else EIO (an
    arena is never short), as the daemon's own reads of the cache do."""
    done = 0
    for index, pos, length, zeros_past_end in pieces:
        chunk = out[done : done + length]
        if index < 0:
            chunk[:] = bytes(length)
        else:
            got = os.preadv(fds[index], [chunk], pos)
            if got < length:
                if not zeros_past_end:
                    raise OSError(errno.EIO, f"short read from the cache: {got} of {length} bytes")
                chunk[got:] = bytes(length - got)
        done += length
    if done != len(out):
        raise ValueError(f"pieces cover {done} bytes of a {len(out)}-byte part")


class Buffers:
    """Part-sized buffers shared by a worker's channels: made when first needed and reused, as
    many as requests needed them at once (a part, a hash, a fetch), never one per
    channel (channels outnumber the parts in flight)."""

    def __init__(self, part_size: int):
        self.part_size = part_size
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def body(self, length: int):
        if length > self.part_size:  # (a grown part: a buffer of its own, freed after)
            yield memoryview(bytearray(length))
            return
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None:
            buffer = bytearray(self.part_size)
        try:
            yield memoryview(buffer)[:length]
        finally:
            with self._lock:
                self._free.append(buffer)


class Channel:
    """One socket to the daemon and the thread that serves it, with its reused part buffer."""

    def __init__(self, sock: socket.socket, store, health: HealthRecorder, buffers: Buffers):
        self.sock = sock
        self.store = store
        self.health = health
        self.buffers = buffers
        self.nice = 0

    def prioritize(self, nice: int) -> None:
        """This channel's thread at ``nice`` (raising it back needs CAP_SYS_NICE: root has it)."""
        if nice != self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                self.nice = nice
            except OSError:
                pass

    def serve(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 253)
            except OSError:
                return
            if not data:
                return  # the daemon closed it
            try:
                answer = self.handle(json.loads(data), fds)
            except BaseException as exc:  # (every failure goes back as an answer)
                answer = {"error": error_to_wire(exc)}
            finally:
                for fd in fds:
                    os.close(fd)
            answer["health"] = self.health.drain()
            try:
                self.sock.send(json.dumps(answer).encode())
            except OSError:
                return

    def handle(self, request: dict, fds: list[int]) -> dict:
        # Uploads give way to the save, as the daemon's store threads do (background.py); a
        # fetch is what a reader waits for, as the daemon's fetch threads are (normal priority).
        self.prioritize(0 if request["op"] == "fetch" else NICE)
        if request["op"] == "fetch":
            return self.fetch(request, fds)
        if request["op"] == "xxh3":
            return {"xxh3": self.xxh3(fds, request["pieces"])}
        pieces = request["pieces"]
        with self.buffers.body(sum(p[2] for p in pieces)) as body:
            try:
                read_pieces(fds, pieces, body)
            finally:
                self.sock.send(b'{"read": true}')
            digest = part_hash(body)  # (the manifest's, of the bytes sent)
            info = self.store.upload_part(
                request["key"], request["upload_id"], request["number"], body, checksummed=request["crc"]
            )
        return {"token": info.token, "xxh3": digest}

    def fetch(self, request: dict, fds: list[int]) -> dict:
        """A ranged GET, each part of it checked against its xxh3, then its whole blocks written
        into the cache slots the daemon allocated for them. Nothing is written unless every
        part matched and the body is whole."""
        with self.buffers.body(request["length"]) as view:
            got, metadata = self.store.get_range_into(request["key"], request["start"], view)
            answer: dict = {"got": got, "metadata": metadata}
            if got != request["length"]:
                return answer  # (short: the daemon asks again)
            for offset, length, expected in request["parts"]:
                if part_hash(view[offset : offset + length]) != expected:
                    return {**answer, "mismatch": offset}
            for index, pos, offset, length in request["blocks"]:
                pwrite_all(fds[index], view[offset : offset + length], pos)
            return answer

    def xxh3(self, fds: list[int], pieces: list[list[int]]) -> str:
        """The xxh3-64 of the pieces' bytes, read a part-sized buffer at a time."""
        hasher = xxhash.xxh3_64()
        part = self.buffers.part_size
        try:
            with self.buffers.body(part) as buffer:
                for index, pos, length, zeros_past_end in pieces:
                    for at in range(0, length, part):
                        chunk = buffer[: min(part, length - at)]
                        read_pieces(fds, [[index, pos + at, len(chunk), zeros_past_end]], chunk)
                        hasher.update(chunk)
        finally:
            self.sock.send(b'{"read": true}')
        return hasher.hexdigest()


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the daemon's spawning thread ends (a killed daemon takes its workers along:
    none goes on sending from cache slots a restarted daemon may reuse)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(1)
    if os.getppid() != parent:  # (it died before the call above)
        os._exit(1)


def main(argv: list[str]) -> int:
    parent, fds = int(argv[0]), [int(a) for a in argv[1:]]
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = json.loads(sys.stdin.readline())
    from ckptfs.store.s3 import S3Store

    store = S3Store.connect(
        config["bucket"], config["prefix"], endpoint_url=config["endpoint_url"], max_connections=len(fds) + 2
    )
    store.client.server_checksums = config["server_checksums"]
    health = HealthRecorder()
    store.report_to(health)  # type: ignore[arg-type]  # (what StoreHealth hears, recorded)
    sockets = [socket.socket(fileno=fd) for fd in fds]
    sockets[0].send(b'{"ready": true}')
    buffers = Buffers(config["part_size"])
    channels = [Channel(s, store, health, buffers) for s in sockets]
    threads = [
        threading.Thread(target=c.serve, name=f"ckptfs-worker-{i}", daemon=True)
        for i, c in enumerate(channels)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
