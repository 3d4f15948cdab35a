"""The uploader's store calls, shared by ``uploader.Uploader`` and its two collaborators
(``upload_parts.PartSender``, ``upload_encoding.Encoder``).

Every call runs in a store thread and is retried with jittered exponential backoff
(retry.publishing); permanent errors are retried too (slowly), because the data must never leave
the cache before it is in the store. Failures are kept for ``status`` (``errors``, ``retries``)
and reported to the store's health; each attempt's duration goes to ``call_latency``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from ckptfs.store.base import ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer import retry
from ckptfs.transfer.upload_tasks import Task
from ckptfs.transfer.workers import WorkerGone
from ckptfs.util.background import BackgroundThreads
from ckptfs.util.stats import LATENCY_BUCKETS, Histogram

log = logging.getLogger("ckptfs.transfer.uploader")  # (the uploader's lines: they keep its name)


class StoreCalls:
    """Store calls in threads, their retries, and what their failures leave behind."""

    def __init__(self, store: ObjectStore, threads: BackgroundThreads, health: StoreHealth):
        self.store = store
        self.threads = threads  # abandoned at shutdown (Uploader.abandon_calls)
        self.health = health  # the daemon shares one with the fetcher and the namespace
        self.errors: deque[dict] = deque(maxlen=20)
        self.retries = 0  # failed store calls retried
        self.call_latency = Histogram(LATENCY_BUCKETS)  # each store call attempt, failed ones too
        self._logged_errors: set[tuple[str, str]] = set()

    async def call(self, key: str, fn, *args, attempts: int | None = None):
        """Run a blocking store call in a thread, retrying failures with backoff (retry.publishing)."""

        async def once():
            started = time.monotonic()
            try:
                result = await self.threads.run(fn, *args)
            finally:
                self.call_latency.observe(time.monotonic() - started)
            self.health.answered()
            return result

        return await retry.call(
            lambda: retry.publishing(lambda exc: self.record_error(key, exc), attempts), once
        )

    async def until_done(self, task: Task, step: Callable[[Task], Awaitable[None]]) -> None:
        """Run ``step(task)``, retrying after unexpected errors: a bug or a cache read
        failure must not stop the uploader, nor lose the data (it stays in the cache)."""

        def failed(exc: BaseException) -> None:
            log.error(
                "upload of %s failed unexpectedly; retrying in %g s",
                task.op.key,
                retry.AFTER_BUG.interval_s,
                exc_info=exc,
            )
            self.record_error(task.op.key, exc)

        return await retry.call(lambda: retry.AFTER_BUG.retrying(failed), lambda: step(task))

    def record_error(self, key: str, exc: BaseException) -> None:
        message = str(exc)
        self.retries += 1
        self.errors.append({"time": time.time(), "key": key, "message": message})
        if not isinstance(exc, WorkerGone):  # (a worker of ours, not the store)
            self.health.failed("", key, message)
        if (key, message) not in self._logged_errors:  # once per key and reason, not per retry
            self._logged_errors.add((key, message))
            log.error("store error on %s (will retry): %s", key, message)
