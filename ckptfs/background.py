"""Threads for background work, scheduled after the training job and the FUSE loop.

Uploads stream while a checkpoint is being written. On a machine with few free cores the part
uploads (hashing, sockets, the store's own processes) would take CPU from ``torch.save`` and
from the FUSE loop that serves it, so the save stall would grow by the upload's work. These
threads run at a lower CPU priority (nice +10, which any process may set): where cores are
free nothing changes; where they are not, the save goes first and the upload uses the rest.

Like ``trio.to_thread.run_sync`` (without abandoning), a call that has started always runs to
completion before ``run`` returns or raises; a call cancelled before a thread took it never runs.
"""

from __future__ import annotations

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
            if not state["cancelled"]:
                with trio.CancelScope(shield=True):
                    await done.wait()  # it runs: the caller's data must outlive the call
            raise
        return result[0].unwrap()
