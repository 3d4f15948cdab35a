"""The store's byte path in worker processes (issue 42): ``StoreWorkers``, the daemon's side.

Every part a mount uploads to S3 is read from the cache, hashed (xxh3 for the manifest, CRC32C
where the server verifies it, SHA-256 for the signature), signed and sent; every block it
fetches is received, checked and written into the cache. In one interpreter that work holds
the GIL the FUSE handlers and the trio loop need (docs/architecture.md, "What runs where").
Here it runs in ``processes`` worker processes (``worker_process.py``), each serving
``channels`` requests at once, one per socket. A store thread of the daemon takes a free
channel, sends the request with the descriptors of the cache files it names, and waits, its GIL
released, for the answer. The daemon keeps every decision: retries (a failure is a
``StoreError`` as before), the journal, what is durable, which slots a fetch fills.

Processes start once the mount is up (``start_soon``), from one long-lived thread, so that
``PR_SET_PDEATHSIG`` ties them to the daemon. A worker that dies (killed, out of memory) fails
the requests it held with ``WorkerGone``, a transient error, so they are made again, and is
started again by the next request that needs it. A wait on a worker is bounded: a minute plus
its bytes at 64 KiB/s (a hash: at 16 MiB/s), past which the worker is killed. Workers that
cannot start (three times running) leave the work to the daemon's threads (``usable``), with
one error in the log.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.store.base import PartInfo
from ckptfs.store.health import StoreHealth

log = logging.getLogger(__name__)

DEADLINE_S = 60.0  # a worker's answer: this long plus its bytes at the request's rate
STORE_RATE = 64 * 1024  # (a part, a fetch: the store's slowest acceptable)
DISK_RATE = 16 << 20  # (a hash: the cache's files)
READY_S = 30.0  # a new worker's "ready"
MAX_FAILED_STARTS = 3
MAX_FDS = 200  # descriptors one request may carry (SCM_RIGHTS takes 253)
MAX_REQUEST = 128 << 10  # bytes of one request (a SOCK_SEQPACKET message fits the socket's buffer)
MAX_PIECES = 3000  # pieces of one request (~30 bytes each): a whole file over more is hashed here

Piece = tuple[int | None, int, int, bool]  # (fd or None for zeros, position, length, zeros past its end)


@dataclass
class _Process:
    index: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    popen: subprocess.Popen | None = None
    sockets: list[socket.socket] = field(default_factory=list)
    generation: int = 0


class WorkerGone(StoreError):
    """The worker died, could not start or stopped answering while it held a request: the
    request is made again. Not the store's fault (StoreCalls does not count it against it)."""

    def __init__(self, message: str):
        super().__init__(message, transient=True)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one file as one (a working file's blocks are contiguous)."""
    merged: list[Piece] = []
    for piece in pieces:
        if merged:
            fd, pos, length, zeros = merged[-1]
            if fd == piece[0] and zeros == piece[3] and (fd is None or pos + length == piece[1]):
                merged[-1] = (fd, pos, length + piece[2], zeros)
                continue
        merged.append(piece)
    return merged


class StoreWorkers:
    """``processes`` worker processes of ``channels`` channels each, for ``store`` (an S3Store)."""

    def __init__(
        self, store, processes: int, channels: int, part_size: int, health: StoreHealth | None = None
    ):
        client = store.client
        self._config = {
            "bucket": client.bucket,
            "prefix": client.prefix,
            "endpoint_url": client.endpoint_url,
            "part_size": part_size,
        }
        self.store = store
        self.health = health or StoreHealth()
        self.processes = [_Process(i) for i in range(processes)]
        self.channels = channels
        self._free: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        for c in range(channels):  # (round robin: requests spread over the processes)
            for p in range(processes):
                self._free.put((p, c))
        self._spawns: queue.SimpleQueue = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None
        self._count_lock = threading.Lock()
        self.closed = False
        self.failed_starts = 0  # in a row: at MAX_FAILED_STARTS the daemon's threads take over
        self.restarts = 0  # workers started again after one died
        self.parts = 0  # parts sent through them
        self.fetches = 0  # ranges fetched through them
        self.hashes = 0  # files hashed and streamed parts checked again through them

    @property
    def usable(self) -> bool:
        return not self.closed and self.failed_starts < MAX_FAILED_STARTS

    # -- the requests ---------------------------------------------------------------------------
    def upload_part(
        self,
        key: str,
        upload_id: str,
        number: int,
        pieces: list[Piece],
        read_done: Callable[[], None] | None = None,
    ) -> PartInfo:
        """Send part ``number`` made of ``pieces``: its PartInfo with the xxh3 of its bytes.
        ``read_done()`` is called once the worker has read them all (the caller's hold on the
        cache ends there)."""
        request = {
            "op": "part",
            "key": key,
            "upload_id": upload_id,
            "number": number,
            "crc": self.store.part_checksums(key, upload_id),
        }
        what = f"part {number} of {key}"
        answer = self._request_pieces(request, pieces, read_done, what, ("upload_part", key))
        with self._count_lock:
            self.parts += 1
        return PartInfo(number, answer["token"], answer["xxh3"])

    def xxh3(self, pieces: list[Piece], read_done: Callable[[], None] | None = None) -> str:
        """The xxh3-64 of the bytes of ``pieces`` (a whole file's, for its metadata or manifest,
        or a streamed part's, checked again at its commit): see ``hashable``."""
        digest = self._request_pieces({"op": "xxh3"}, pieces, read_done, "a hash", None)["xxh3"]
        with self._count_lock:
            self.hashes += 1
        return digest

    @staticmethod
    def hashable(pieces: list[Piece]) -> bool:
        """Whether ``xxh3`` takes these pieces in one request."""
        return len(coalesce(pieces)) <= MAX_PIECES

    def fetch(
        self,
        key: str,
        start: int,
        length: int,
        parts: list[tuple[int, int, str]],
        blocks: list[tuple[int, int, int, int]],
    ) -> dict:
        """Bytes [start, start + length) of ``key``, each of ``parts`` (offset in the range,
        length, xxh3) checked, then each of ``blocks`` (fd, position, offset in the range,
        length) written there; only when the body is whole and every part matched. The answer:
        ``got`` (the body's length), ``metadata`` (the object's, from the GET), ``mismatch``
        (the offset of a part that did not match) when it did not."""
        fds: list[int] = []
        for fd, *_ in blocks:
            if fd not in fds:
                fds.append(fd)
        request = {
            "op": "fetch",
            "key": key,
            "start": start,
            "length": length,
            "parts": parts,
            "blocks": [[fds.index(fd), pos, offset, n] for fd, pos, offset, n in blocks],
        }
        answer = self._request(request, fds, length / STORE_RATE, None, f"a read of {key}", ("get", key))
        with self._count_lock:
            self.fetches += 1
        return answer

    def _request_pieces(
        self,
        request: dict,
        pieces: list[Piece],
        read_done: Callable[[], None] | None,
        what: str,
        attempt: tuple[str, str] | None,
    ) -> dict:
        fds: list[int] = []
        wire: list[list[int]] = []
        for fd, pos, length, zeros in coalesce(pieces):
            if fd is None:
                wire.append([-1, 0, length, 1])
                continue
            if fd not in fds:
                fds.append(fd)
            wire.append([fds.index(fd), pos, length, int(zeros)])
        nbytes = sum(p[2] for p in pieces)
        seconds = nbytes / (STORE_RATE if attempt is not None else DISK_RATE)
        return self._request({**request, "pieces": wire}, fds, seconds, read_done, what, attempt)

    def _request(
        self,
        request: dict,
        fds: list[int],
        seconds: float,
        read_done: Callable[[], None] | None,
        what: str,
        attempt: tuple[str, str] | None,
    ) -> dict:
        """Send ``request`` on a free channel and wait for its answer: ``read_done()`` once the
        worker has read what it names (or has died), the store's health told about each of its
        HTTP attempts, an error raised as the store call itself would have."""
        payload = json.dumps(request).encode()
        if len(payload) > MAX_REQUEST or len(fds) > MAX_FDS:  # (callers keep within: a bug)
            raise ValueError(f"{what}: a request of {len(payload)} bytes and {len(fds)} descriptors")
        read = False
        slot = self._free.get()
        token = self.health.attempt_started(*attempt) if attempt is not None else None
        try:
            process, sock, generation = self._channel(slot)
            try:
                sock.settimeout(DEADLINE_S + seconds)
                socket.send_fds(sock, [payload], fds)
                answer = self._answer(sock)
                if answer.get("read"):
                    read = True
                    if read_done is not None:
                        read_done()
                    answer = self._answer(sock)
            except (OSError, ValueError) as exc:  # (timeout, reset, EOF, a garbled answer)
                why = self._lost(process, generation, exc)
                raise WorkerGone(f"store worker {why} while on {what}") from None
            self._replay(answer.get("health", []))
            if "error" in answer:
                raise _error(answer["error"])
            return answer
        finally:
            if token is not None:
                self.health.attempt_ended(token)
            if not read and read_done is not None:  # (the worker failed first: it is dead now)
                read_done()
            self._free.put(slot)

    def _answer(self, sock: socket.socket) -> dict:
        data = sock.recv(65536)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, "the worker closed its channel")
        return json.loads(data)

    def _replay(self, events: list) -> None:
        """What the worker's HTTP attempts said about the store, told to the daemon's health."""
        for event in events:
            if event[0] == "failed":
                self.health.failed(event[1], event[2], event[3], reachable=event[4])
            elif event[0] == "answered":
                self.health.answered()

    # -- the processes ------------------------------------------------------------------------
    def start_soon(self) -> None:
        """Start the workers now, in a thread (the mount is up): a restore's first reads, or a
        save's first parts, then find them ready rather than pay their start (0.5 CPU s each)."""

        def start_all() -> None:
            for process in self.processes:
                with process.lock:
                    if process.popen is None and not self.closed:
                        try:
                            self._start(process)
                        except WorkerGone as exc:
                            log.warning("%s", exc)

        threading.Thread(target=start_all, name="ckptfs-worker-start", daemon=True).start()

    def _channel(self, slot: tuple[int, int]) -> tuple[_Process, socket.socket, int]:
        p, c = slot
        process = self.processes[p]
        with process.lock:
            if self.closed:
                raise WorkerGone("the mount is shutting down")
            if process.popen is None or process.popen.poll() is not None:
                if process.popen is not None:
                    self.restarts += 1
                    log.warning(
                        "store worker %d (pid %d) ended (%s): starting another",
                        p,
                        process.popen.pid,
                        _how(process.popen.returncode),
                    )
                    _close_all(process.sockets)
                    process.sockets = []
                self._start(process)
            return process, process.sockets[c], process.generation

    def _start(self, process: _Process) -> None:
        """A new worker for ``process`` (its lock held): ready, or WorkerGone and nothing left."""
        if not self.usable:
            raise WorkerGone("store workers cannot start")
        mine: list[socket.socket] = []
        theirs: list[socket.socket] = []
        popen: subprocess.Popen | None = None
        try:
            for _ in range(self.channels):
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                mine.append(a)
                theirs.append(b)
            argv = [sys.executable, "-m", "ckptfs.transfer.worker_process", str(os.getpid())]
            popen = self._spawn(argv + [str(s.fileno()) for s in theirs], [s.fileno() for s in theirs])
            _close_all(theirs)
            assert popen.stdin is not None
            config = {**self._config, "server_checksums": self.store.server_checksums}
            popen.stdin.write((json.dumps(config) + "\n").encode())
            popen.stdin.close()
            mine[0].settimeout(READY_S)
            if mine[0].recv(64) != b'{"ready": true}':
                raise ConnectionResetError(errno.ECONNRESET, f"it ended ({_how(popen.wait(5))})")
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            _close_all(theirs + mine)
            if popen is not None:
                _kill(popen)
            self.failed_starts += 1
            if not self.usable:
                log.error(
                    "store workers cannot start (%s, %d times): the daemon's threads send and fetch from now on",
                    exc,
                    self.failed_starts,
                )
            raise WorkerGone(f"a store worker could not start: {exc}") from None
        self.failed_starts = 0
        process.popen, process.sockets = popen, mine
        process.generation += 1
        log.info("store worker %d started (pid %d, %d channels)", process.index, popen.pid, self.channels)

    def _spawn(self, argv: list[str], fds: list[int]) -> subprocess.Popen:
        """Popen from the spawner thread, which lives as long as the daemon (PR_SET_PDEATHSIG
        follows the thread that forked)."""
        if self._spawner is None:
            self._spawner = threading.Thread(target=self._spawning, name="ckptfs-worker-spawner", daemon=True)
            self._spawner.start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._spawns.put((argv, fds, answer))
        result = answer.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _spawning(self) -> None:
        while True:
            argv, fds, answer = self._spawns.get()
            try:
                answer.put(
                    subprocess.Popen(
                        argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=fds, close_fds=True
                    )
                )
            except BaseException as exc:
                answer.put(exc)

    def _lost(self, process: _Process, generation: int, exc: BaseException) -> str:
        """The worker stopped answering on one channel: kill it (its other requests fail too
        and are made again), so the next request starts a fresh one. What happened, in words.
        It is dead when this returns (what it read or wrote of the cache is over)."""
        popen = process.popen
        if popen is None or process.generation != generation:
            return "was replaced"
        if popen.poll() is None:
            _kill(popen)
            return f"stopped answering ({exc}) and was killed"
        return f"ended ({_how(popen.returncode)})"

    def pids(self) -> list[int]:
        """The live workers' PIDs (no lock: ``status`` runs on the trio loop)."""
        popens = [p.popen for p in self.processes]
        return [popen.pid for popen in popens if popen is not None and popen.returncode is None]

    def close(self) -> None:
        """Shutdown: end every worker (requests in flight are abandoned, as the store threads'
        are); they are dead when this returns, before the cache closes."""
        self.closed = True
        for process in self.processes:
            for s in process.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # (wakes the threads waiting on it)
                except OSError:
                    pass
        for process in self.processes:
            with process.lock:
                if process.popen is not None:
                    _kill(process.popen)
                _close_all(process.sockets)
                process.sockets = []

    def status(self) -> dict:
        return {
            "processes": len(self.processes),
            "pids": self.pids(),
            "restarts": self.restarts,
            "parts": self.parts,
            "fetches": self.fetches,
            "hashes": self.hashes,
            "usable": self.usable,
        }


def _error(error: dict) -> BaseException:
    """The exception a worker's answer describes (worker_process.error_to_wire)."""
    kind, message = error["type"], error["message"]
    if kind == "NotFound":
        return NotFound(message)
    if kind in ("StoreError", "PartsLeftOut"):
        cls = PartsLeftOut if kind == "PartsLeftOut" else StoreError
        return cls(message, transient=error["transient"], errno_=error["errno"], code=error["code"])
    if kind == "OSError":
        return OSError(error["errno"], message)
    return RuntimeError(f"store worker: {message}")


def _close_all(sockets: list[socket.socket]) -> None:
    for s in sockets:
        s.close()


def _kill(popen: subprocess.Popen) -> None:
    """End a worker by its PID and reap it."""
    if popen.poll() is None:
        try:
            os.kill(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        popen.wait(timeout=30)
    except subprocess.TimeoutExpired:  # (uninterruptible I/O: D state)
        log.warning("store worker pid %d did not end 30 s after SIGKILL", popen.pid)


def _how(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"
