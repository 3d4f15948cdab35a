"""The store's byte path in worker processes (issue 42): ``StoreWorkers``, the daemon's side.

Every part a mount uploads to S3 is read from the cache, hashed (xxh3 for the manifest, CRC32C
where the server verifies it, SHA-256 for the signature), signed and sent; in one interpreter
that work holds the GIL the FUSE handlers and the trio loop need (docs/architecture.md, "What
runs where"). Here it runs in ``processes`` worker processes (``worker_process.py``), each
serving ``channels`` requests at once, one per socket. A store thread of the daemon takes a free
channel, sends the part's pieces (file descriptor, position, length) with the descriptors
themselves, and waits, its GIL released, for the answer. The daemon keeps every decision:
retries (a failed part is a ``StoreError`` as before), the journal, what is durable.

Processes start at the first part (a mount that never uploads costs none) from one long-lived
thread, so that ``PR_SET_PDEATHSIG`` ties them to the daemon. A worker that dies (killed, out of
memory) fails the parts it held with a transient error, so they are sent again, and is started
again by the next part that needs it. A wait on a worker is bounded: a minute plus the body at
64 KiB/s, past which the worker is killed (``DEADLINE_*``).
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.store.base import PartInfo

log = logging.getLogger(__name__)

DEADLINE_S = 60.0  # a worker's answer: this long plus its body at DEADLINE_RATE
DEADLINE_RATE = 64 * 1024
MAX_FDS = 200  # descriptors one request may carry (SCM_RIGHTS takes 253)
MAX_PROCESSES = 64


@dataclass
class _Process:
    index: int
    popen: subprocess.Popen | None = None
    sockets: list[socket.socket] = field(default_factory=list)
    generation: int = 0
    started: float = 0.0


class WorkerGone(StoreError):
    """The worker died or stopped answering while it held a part: the part is sent again."""

    def __init__(self, message: str):
        super().__init__(message, transient=True)


class StoreWorkers:
    """``processes`` worker processes of ``channels`` channels each, for ``store`` (an S3Store)."""

    def __init__(self, store, processes: int, channels: int, part_size: int):
        client = store.client
        self._config = {
            "bucket": client.bucket,
            "prefix": client.prefix,
            "endpoint_url": client.endpoint_url,
            "part_size": part_size,
        }
        self.store = store
        self.processes = [_Process(i) for i in range(processes)]
        self.channels = channels
        self._free: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        for c in range(channels):  # (round robin: parts spread over the processes)
            for p in range(processes):
                self._free.put((p, c))
        self._lock = threading.Lock()
        self._spawns: queue.SimpleQueue = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None
        self.closed = False
        self.restarts = 0  # workers started again after one died
        self.parts = 0  # parts sent through them

    # -- a part, a hash ------------------------------------------------------------------------
    def upload_part(
        self,
        key: str,
        upload_id: str,
        number: int,
        pieces: list[tuple[int | None, int, int]],
        read_done: Callable[[], None] | None = None,
    ) -> PartInfo:
        """Send part ``number`` made of ``pieces`` (fd or None for zeros, position, length): its
        PartInfo with the xxh3 of its bytes. ``read_done()`` is called once the worker has read
        them all (the caller's hold on the cache ends there)."""
        request = {
            "op": "part",
            "key": key,
            "upload_id": upload_id,
            "number": number,
            "crc": self.store.part_checksums(key, upload_id),
        }
        answer = self._request(request, pieces, read_done, f"part {number} of {key}")
        self.parts += 1
        return PartInfo(number, answer["token"], answer["xxh3"])

    def xxh3(
        self, pieces: list[tuple[int | None, int, int]], read_done: Callable[[], None] | None = None
    ) -> str:
        """The xxh3-64 of the bytes of ``pieces`` (a whole file's, for its metadata)."""
        return self._request({"op": "xxh3"}, pieces, read_done, "a file's hash")["xxh3"]

    def _request(
        self,
        request: dict,
        pieces: list[tuple[int | None, int, int]],
        read_done: Callable[[], None] | None,
        what: str,
    ) -> dict:
        fds: list[int] = []
        wire: list[list[int]] = []
        for fd, pos, length in pieces:
            if fd is None:
                wire.append([-1, 0, length])
                continue
            if fd not in fds:
                fds.append(fd)
            wire.append([fds.index(fd), pos, length])
        if len(fds) > MAX_FDS:
            raise ValueError(f"{what} is read from {len(fds)} files: at most {MAX_FDS}")
        deadline = DEADLINE_S + sum(p[2] for p in pieces) / DEADLINE_RATE
        read = False
        slot = self._free.get()
        try:
            process, sock, generation = self._channel(slot)
            try:
                sock.settimeout(deadline)
                socket.send_fds(sock, [json.dumps({**request, "pieces": wire}).encode()], fds)
                answer = self._answer(sock)
                if answer == {"read": True}:
                    read = True
                    if read_done is not None:
                        read_done()
                    answer = self._answer(sock)
            except (OSError, ValueError) as exc:  # (timeout, reset, EOF, a garbled answer)
                why = self._lost(process, generation, exc)
                raise WorkerGone(f"store worker {why} while sending {what}") from None
            if "error" in answer:
                raise _error(answer["error"])
            return answer
        finally:
            if not read and read_done is not None:  # (the worker failed first: it is dead now)
                read_done()
            self._free.put(slot)

    def _answer(self, sock: socket.socket) -> dict:
        data = sock.recv(65536)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, "the worker closed its channel")
        return json.loads(data)

    # -- the processes ------------------------------------------------------------------------
    def _channel(self, slot: tuple[int, int]) -> tuple[_Process, socket.socket, int]:
        p, c = slot
        process = self.processes[p]
        with self._lock:
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
                    self._drop(process)
                self._start(process)
            return process, process.sockets[c], process.generation

    def _start(self, process: _Process) -> None:
        mine, theirs = zip(
            *(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(self.channels))
        )
        config = {**self._config, "server_checksums": self.store.server_checksums}
        argv = [sys.executable, "-m", "ckptfs.transfer.worker_process", str(os.getpid())]
        argv += [str(s.fileno()) for s in theirs]
        try:
            popen = self._spawn(argv, [s.fileno() for s in theirs])
            assert popen.stdin is not None
            popen.stdin.write((json.dumps(config) + "\n").encode())
            popen.stdin.close()
        finally:
            for s in theirs:
                s.close()
        process.popen, process.sockets = popen, list(mine)
        process.generation += 1
        process.started = time.monotonic()
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
                        argv,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        pass_fds=fds,
                        close_fds=True,
                    )
                )
            except BaseException as exc:
                answer.put(exc)

    def _lost(self, process: _Process, generation: int, exc: BaseException) -> str:
        """The worker stopped answering on one channel: kill it (its other parts fail too and
        are sent again), so the next part starts a fresh one. What happened, in words."""
        with self._lock:
            popen = process.popen
            if popen is None or process.generation != generation:
                return "was replaced"
            if popen.poll() is None:
                _kill(popen)
                return f"stopped answering ({exc}) and was killed"
            return f"ended ({_how(popen.returncode)})"

    def _drop(self, process: _Process) -> None:
        for s in process.sockets:
            s.close()
        process.sockets = []

    def pids(self) -> list[int]:
        with self._lock:
            return [p.popen.pid for p in self.processes if p.popen is not None and p.popen.poll() is None]

    def close(self) -> None:
        """Shutdown: end every worker (parts in flight are abandoned, as the store threads' are)."""
        with self._lock:
            self.closed = True
            for process in self.processes:
                for s in process.sockets:
                    try:
                        s.shutdown(socket.SHUT_RDWR)  # (wakes the threads waiting on it)
                    except OSError:
                        pass
        for process in self.processes:
            if process.popen is not None:
                _kill(process.popen)
                self._drop(process)

    def status(self) -> dict:
        return {
            "processes": len(self.processes),
            "pids": self.pids(),
            "restarts": self.restarts,
            "parts": self.parts,
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


def _kill(popen: subprocess.Popen) -> None:
    """End a worker by its PID and reap it."""
    if popen.poll() is None:
        try:
            os.kill(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        popen.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.warning("store worker pid %d did not end after SIGKILL", popen.pid)


def _how(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"
