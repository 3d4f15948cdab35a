"""Threads for background work, scheduled after the training job and the FUSE loop.

Uploads stream while a checkpoint is being written. On a machine with few free cores the part
uploads (hashing, sockets, the store's own processes) would take CPU from ``torch.save`` and
from the FUSE loop that serves it, so the save stall would grow by the upload's work. These
threads run at a lower CPU priority (nice +10, which any process may set): where cores are
free nothing changes; where they are not, the save goes first and the upload uses the rest.

Like ``trio.to_thread.run_sync`` (without abandoning), a call that has started always runs to
completion before ``run`` returns or raises; a call cancelled before a thread took it never runs.
Except at shutdown: after ``abandon()`` a cancelled caller no longer waits for its call (a store
call may hang for minutes on a dead endpoint); the thread finishes on its own and its result is
dropped. Whatever the call reads must then be guarded by a ``Gate`` its owner closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable

import outcome
import trio

log = logging.getLogger(__name__)

NICE = 10
IDLE_EXIT_S = 10.0  # a thread with nothing to do for this long ends


class BackgroundThreads:
    def __init__(self, count: int, name: str, nice: int = NICE):
        self.count, self.name, self.nice = count, name, nice
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = self._idle = 0
        self.abandoning = False
        self._waiting: set[trio.Event] = set()  # callers shielded until their call ends

    def abandon(self) -> None:
        """Shutdown: callers cancelled from now on (or waiting already) stop waiting for their calls."""
        self.abandoning = True
        for done in self._waiting:
            done.set()

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.put(job)
            if self._jobs.qsize() > self._idle and self._live < self.count:
                self._live += 1  # daemon threads: a process exit never waits for a store call
                threading.Thread(target=self._work, name=f"{self.name}-{self._live}", daemon=True).start()

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError as exc:
            log.debug("cannot lower the priority of a background thread: %s", exc)
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._jobs.empty():  # (a job is put under this lock: none is left behind)
                        self._live -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
            job()

    async def run(self, fn: Callable, *args):
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        state = {"started": False, "cancelled": False}
        lock = threading.Lock()
        result: list[outcome.Outcome] = []

        def job() -> None:
            with lock:
                if state["cancelled"]:
                    return
                state["started"] = True
            result.append(outcome.capture(fn, *args))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._submit(job)
        try:
            await done.wait()
        except trio.Cancelled:
            with lock:
                state["cancelled"] = not state["started"]
            if not state["cancelled"] and not self.abandoning:
                self._waiting.add(done)
                try:
                    with trio.CancelScope(shield=True):
                        await done.wait()  # it runs: the caller's data must outlive the call
                finally:
                    self._waiting.discard(done)
            raise
        return result[0].unwrap()


class Closed(Exception):
    """The resource behind a ``Gate`` was closed (shutdown): an abandoned call may not use it."""


class Gate:
    """Lets threads use a resource (the cache's memory and files) until ``close``, which waits
    for the uses in progress (short copies) and refuses later ones."""

    def __init__(self, what: str):
        self.what = what
        self._cond = threading.Condition()
        self._users = 0
        self._closed = False

    @contextlib.contextmanager
    def use(self):
        with self._cond:
            if self._closed:
                raise Closed(f"{self.what} is closed (shutting down)")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: self._users == 0, timeout):
                log.warning("%s: %d threads still using it at close", self.what, self._users)
