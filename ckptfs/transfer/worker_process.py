"""A store worker: a process of its own that sends multipart parts read straight from the cache's
files (issue 42). Started by ``workers.StoreWorkers`` as ``python -m ckptfs.transfer.worker_process``.

The daemon keeps every decision (what to send, when a file is durable, retries, the journal);
a worker does the bytes of one part at a time per channel: it ``pread``s the part's pieces from
the file descriptors that came with the request (arena or working files), hashes the part
(xxh3, the manifest's), signs and sends it through its own S3 client, and answers the part's
token and digest. Its GIL is not the daemon's, so none of that holds up FUSE requests or the
trio loop.

Start-up: the store's description (bucket, prefix, endpoint, whether the server verifies CRC32C)
comes as one JSON line on stdin (never in argv, which any local user can read); the channels are
the inherited ``SOCK_SEQPACKET`` sockets named in argv. The worker ignores SIGINT (the daemon
decides when it ends), dies with the daemon's spawning thread (``PR_SET_PDEATHSIG``) and ends
when its channels close.

The protocol, per channel (one request at a time):

    daemon -> {"op": "part", "key", "upload_id", "number", "crc",
               "pieces": [[fd index or -1, pos, len], ...]}, with the request's fds (SCM_RIGHTS)
              or {"op": "xxh3", "pieces": [...]}: the hash of a whole file
    worker -> {"read": true}          once every piece is read (the daemon may close the cache)
    worker -> {"token", "xxh3"}       or {"xxh3"}, or {"error": {...}} (``error_to_wire``)
"""

from __future__ import annotations

import ctypes
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

MAX_MESSAGE = 1 << 20  # a request of a 4 GiB part of 8 MiB blocks is 512 pieces: ~15 KiB
PR_SET_PDEATHSIG = 1


def error_to_wire(exc: BaseException) -> dict:
    if isinstance(exc, StoreError):
        kind = (
            "NotFound"
            if isinstance(exc, NotFound)
            else "PartsLeftOut"
            if isinstance(exc, PartsLeftOut)
            else ""
        )
        return {
            "type": kind or "StoreError",
            "message": str(exc),
            "errno": exc.errno,
            "transient": exc.transient,
            "code": exc.code,
        }
    if isinstance(exc, OSError):  # (reading the cache's files)
        return {"type": "OSError", "message": str(exc), "errno": exc.errno or 5}
    return {"type": "bug", "message": f"{type(exc).__name__}: {exc}"}


def read_pieces(fds: list[int], pieces: list[list[int]], out: memoryview) -> None:
    """The part's bytes into ``out``: each piece from its file (past a file's end: zeros, as the
    working files' holes read) or zeros (-1)."""
    done = 0
    for index, pos, length in pieces:
        chunk = out[done : done + length]
        if index < 0:
            chunk[:] = bytes(length)
        else:
            got = os.preadv(fds[index], [chunk], pos)
            if got < length:
                chunk[got:] = bytes(length - got)
        done += length
    if done != len(out):
        raise ValueError(f"pieces cover {done} bytes of a {len(out)}-byte part")


class Channel:
    """One socket to the daemon and the thread that serves it, with its reused part buffer."""

    def __init__(self, sock: socket.socket, store, part_size: int):
        self.sock = sock
        self.store = store
        self.part_size = part_size
        self.buffer: bytearray | None = None

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
            try:
                self.sock.send(json.dumps(answer).encode())
            except OSError:
                return

    def xxh3(self, fds: list[int], pieces: list[list[int]]) -> str:
        """The xxh3-64 of the pieces' bytes, read a part-sized buffer at a time."""
        hasher = xxhash.xxh3_64()
        try:
            for index, pos, length in pieces:
                for at in range(0, length, self.part_size):
                    n = min(self.part_size, length - at)
                    chunk = self.body(n)
                    read_pieces(fds, [[index, pos + at, n]], chunk)
                    hasher.update(chunk)
        finally:
            self.sock.send(b'{"read": true}')
        return hasher.hexdigest()

    def body(self, length: int) -> memoryview:
        if length > self.part_size:  # (a grown part: a buffer of its own, freed after)
            return memoryview(bytearray(length))
        if self.buffer is None:
            self.buffer = bytearray(self.part_size)
        return memoryview(self.buffer)[:length]

    def handle(self, request: dict, fds: list[int]) -> dict:
        pieces = request["pieces"]
        if request["op"] == "xxh3":
            return {"xxh3": self.xxh3(fds, pieces)}
        body = self.body(sum(p[2] for p in pieces))
        try:
            read_pieces(fds, pieces, body)
        finally:
            self.sock.send(b'{"read": true}')
        digest = part_hash(body)  # (the manifest's, of the bytes sent)
        info = self.store.upload_part(
            request["key"], request["upload_id"], request["number"], body, checksummed=request["crc"]
        )
        return {"token": info.token, "xxh3": digest}


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the daemon's spawning thread ends (a killed daemon takes its workers along:
    none goes on sending from cache slots a restarted daemon may reuse)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # (it died before the call above)
        os._exit(1)


def main(argv: list[str]) -> int:
    parent, fds = int(argv[0]), [int(a) for a in argv[1:]]
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # (as the store threads: the upload gives way to the save, background.py)
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    except OSError:
        pass
    config = json.loads(sys.stdin.readline())
    from ckptfs.store.s3 import S3Store

    store = S3Store.connect(
        config["bucket"], config["prefix"], endpoint_url=config["endpoint_url"], max_connections=len(fds) + 2
    )
    store.client.server_checksums = config["server_checksums"]
    channels = [Channel(socket.socket(fileno=fd), store, config["part_size"]) for fd in fds]
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
