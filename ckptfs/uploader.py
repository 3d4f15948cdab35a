"""Background upload: applies journal ops to the store, data in parallel, publication in order.

Each ``put`` gets a preparation task as soon as it is submitted: it hashes the file
(xxh3 of the whole content) and, for files larger than one part, creates the
multipart upload and sends the parts, several in flight across all files (a
semaphore of ``concurrency`` parts bounds memory and connections). One publisher
task then walks the pending ops in sequence order and makes each visible:
completes the multipart upload, PUTs a small file, deletes, moves, makes a
directory marker. So a file becomes durable only after everything committed
before it (ordered publish), while the bytes of many files travel at once.

Every store call runs in a thread and is retried with jittered exponential
backoff; permanent errors are retried too (slowly), because the data must never
leave the cache before it is in the store. Errors are kept for ``status``.

Concurrency protocol (see docs/architecture.md): ``submit``, ``cancel`` and
``retarget`` run on the trio loop without awaiting, so the namespace changes a
file and its pending op in one step. Once the publisher has started to publish
an op it can no longer be cancelled or retargeted: the namespace then follows
with a compensating op (delete or move) instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

import tenacity
import trio
import xxhash

from .cache import Cache, Content
from .journal import DELETE, MKDIR, MOVE, PUT, Journal, Op
from .store.base import MAX_PARTS, NotFound, ObjectStore, PartInfo, StoreError

log = logging.getLogger(__name__)

UNEXPECTED_RETRY_S = 30


def part_size_for(size: int, base: int, max_parts: int = MAX_PARTS) -> int:
    """The part size for a file: ``base`` doubled until the file fits in ``max_parts`` parts."""
    part = base
    while math.ceil(size / part) > max_parts:
        part *= 2
    return part


class Task:
    """A pending op and its progress."""

    def __init__(self, op: Op, content: Content | None, on_durable: Callable[[Op], None] | None):
        self.op = op
        self.content = content
        self.on_durable = on_durable
        self.ready = trio.Event()  # data prepared: the publisher may go
        self.scope = trio.CancelScope()
        self.publishing = False
        self.cancelled = False
        self.xxh3 = ""
        self.part_size = 0
        self.upload: tuple[str, str] | None = None  # (key, upload_id) of the multipart upload
        self.upload_serial = 0
        self.parts: list[PartInfo] = []
        self.bytes_sent = 0

    @property
    def multipart(self) -> bool:
        return self.op.kind == PUT and self.op.size > self.part_size


class Uploader:
    def __init__(self, store: ObjectStore, cache: Cache, journal: Journal, part_size: int, concurrency: int):
        self.store = store
        self.cache = cache
        self.journal = journal
        self.part_size = part_size
        self.pending: dict[int, Task] = {}  # by seq; insertion order is sequence order
        self.part_slots = trio.Semaphore(concurrency)
        self.store_threads = trio.CapacityLimiter(concurrency + 2)
        self.hash_threads = trio.CapacityLimiter(2)
        self.progress = trio.Event()  # set (and replaced) whenever an op is done
        self.new_work = trio.Event()
        self.errors: deque[dict] = deque(maxlen=20)
        self._logged_errors: set[tuple[str, str]] = set()
        self.uploaded_bytes = 0
        self.durable_files = 0
        self.nursery: trio.Nursery | None = None
        self.retained_ops: Callable[[], list[Op]] = list  # ops the journal keeps besides pending ones

    # -- called by the namespace (no awaits) -----------------------------------------
    def submit(self, op: Op, content: Content | None = None, on_durable: Callable[[Op], None] | None = None) -> Task:
        task = Task(op, content.hold() if content is not None else None, on_durable)
        task.part_size = part_size_for(op.size, self.part_size)
        self.pending[op.seq] = task
        if op.kind == PUT:
            self.nursery.start_soon(self._prepare, task)
        else:
            task.ready.set()
        self.new_work.set()
        return task

    def cancel(self, seq: int) -> bool:
        """Drop a pending op; False if it is already being published (or gone)."""
        task = self.pending.get(seq)
        if task is None or task.publishing:
            return False
        del self.pending[seq]
        task.cancelled = True
        if task.ready.is_set() and task.upload is not None:  # prepared: nobody else will abort it
            self.nursery.start_soon(self._abort, *task.upload, f"{seq}.{task.upload_serial}")
        task.scope.cancel()
        task.ready.set()
        self.journal.cancel(seq)
        self._finish(task)
        self._signal_progress()
        return True

    def retarget(self, seq: int, key: str) -> bool:
        """Point a pending put at a new key (a rename of a file not yet durable)."""
        task = self.pending.get(seq)
        if task is None or task.publishing:
            return False
        task.op.key = key
        self.journal.retarget(seq, key)
        return True

    # -- queries ------------------------------------------------------------------------
    def pending_bytes(self, up_to: int | None = None) -> int:
        return sum(
            max(t.op.size - t.bytes_sent, 0)
            for s, t in self.pending.items()
            if t.op.kind == PUT and (up_to is None or s <= up_to)
        )

    def holds_cache(self) -> bool:
        """Whether a pending upload still holds cache blocks (its end will free some)."""
        return any(t.content is not None for t in self.pending.values())

    def pending_count(self, up_to: int | None = None) -> int:
        return sum(1 for s in self.pending if up_to is None or s <= up_to)

    def last_seq(self) -> int:
        return self.journal.next_seq - 1

    async def wait_durable(self, up_to: int) -> None:
        """Return once every op with seq <= up_to is in the store."""
        while self.pending and next(iter(self.pending)) <= up_to:
            await self.progress.wait()

    # -- the workers --------------------------------------------------------------------
    async def run(self, abort_uploads: list[tuple[str, str, str]] = (), *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for journal_id, key, upload_id in abort_uploads:  # left open by a dead daemon: start over
                nursery.start_soon(self._abort, key, upload_id, journal_id)
            nursery.start_soon(self._publisher)
            task_status.started()

    async def _prepare(self, task: Task) -> None:
        with task.scope:
            await self._until_done(task, self._prepare_once)
            task.ready.set()
        if task.cancelled and task.upload is not None:  # cancelled while preparing
            await self._abort(*task.upload, f"{task.op.seq}.{task.upload_serial}")

    async def _prepare_once(self, task: Task) -> None:
        task.xxh3 = await trio.to_thread.run_sync(self._hash, task.content, limiter=self.hash_threads)
        if task.multipart:
            await self._upload_parts(task)

    async def _until_done(self, task: Task, step) -> None:
        """Run ``step(task)``, retrying after unexpected errors: a bug or a cache read
        failure must not stop the uploader, nor lose the data (it stays in the cache)."""
        while True:
            try:
                return await step(task)
            except Exception as exc:
                log.exception("upload of %s failed unexpectedly; retrying in %d s", task.op.key, UNEXPECTED_RETRY_S)
                self._record_error(task.op.key, exc)
                await trio.sleep(UNEXPECTED_RETRY_S)

    async def _upload_parts(self, task: Task) -> None:
        op = task.op
        key = op.key  # a rename may retarget the op while we wait: the upload stays under this key
        metadata = {"xxh3": task.xxh3, "ckptfs-part-size": str(task.part_size)}
        upload_id = await self._call(key, self.store.create_multipart, key, metadata)
        task.upload_serial += 1
        task.upload = (key, upload_id)
        self.journal.multipart_started(f"{op.seq}.{task.upload_serial}", key, upload_id)
        n_parts = math.ceil(op.size / task.part_size)
        task.parts = [None] * n_parts
        task.bytes_sent = 0
        async with trio.open_nursery() as parts:
            for number in range(1, n_parts + 1):
                await self.part_slots.acquire()
                parts.start_soon(self._send_part, task, upload_id, number)

    async def _send_part(self, task: Task, upload_id: str, number: int) -> None:
        try:
            key = task.upload[0]
            start = (number - 1) * task.part_size
            length = min(task.part_size, task.op.size - start)

            def send() -> PartInfo:
                data = _read_range(task.content, start, length)
                return self.store.upload_part(key, upload_id, number, data)

            task.parts[number - 1] = await self._call(key, send)
            task.bytes_sent += length
            self.uploaded_bytes += length
        finally:
            self.part_slots.release()

    async def _publisher(self) -> None:
        while True:
            if not self.pending:
                self.new_work = trio.Event()
                await self.new_work.wait()
                continue
            seq, task = next(iter(self.pending.items()))
            await task.ready.wait()
            if task.cancelled or self.pending.get(seq) is not task:
                continue
            task.publishing = True
            await self._until_done(task, self._publish)
            del self.pending[seq]
            self.journal.done(seq)
            if self.journal.should_compact():
                self._compact()
            if task.op.kind == PUT:
                self.durable_files += 1
            callback = task.on_durable
            self._finish(task)
            if callback is not None:
                callback(task.op)
            self._signal_progress()

    async def _publish(self, task: Task) -> None:
        op = task.op
        if op.kind == PUT and task.multipart:
            if task.upload is None or task.upload[0] != op.key:  # retargeted after the upload began
                if task.upload is not None:
                    await self._abort(*task.upload, f"{op.seq}.{task.upload_serial}")
                await self._upload_parts(task)
            try:
                await self._call(op.key, self.store.complete_multipart, op.key, task.upload[1], task.parts)
            except NotFound:
                # A retry after a completion whose answer was lost: the upload id is gone.
                info = await self._call(op.key, self.store.head, op.key)
                if info is None or info.metadata.get("xxh3") != task.xxh3:
                    task.upload = None
                    await self._publish(task)  # start over with a new upload
                    return
            self.journal.multipart_ended(f"{op.seq}.{task.upload_serial}")
        elif op.kind == PUT:
            data = await trio.to_thread.run_sync(_read_range, task.content, 0, op.size, limiter=self.hash_threads)
            await self._call(op.key, self.store.put, op.key, data, {"xxh3": task.xxh3})
            task.bytes_sent = op.size
            self.uploaded_bytes += op.size
        elif op.kind == DELETE:
            await self._call(op.key, self.store.delete, op.key)
        elif op.kind == MKDIR:
            await self._call(op.key, self.store.put, op.key, b"", {})
        elif op.kind == MOVE:
            try:
                await self._call(op.key, self.store.copy, op.src, op.key)
            except NotFound:
                # Replayed after a crash between copy and delete, or the source is gone.
                if await self._call(op.key, self.store.head, op.key) is None:
                    log.warning("move %s -> %s: the source is not in the store", op.src, op.key)
            await self._call(op.src, self.store.delete, op.src)

    # -- helpers ---------------------------------------------------------------------------
    def _finish(self, task: Task) -> None:
        if task.content is not None:
            task.content.release()
            task.content = None

    def _signal_progress(self) -> None:
        self.progress.set()
        self.progress = trio.Event()

    def _compact(self) -> None:
        open_uploads = [
            (f"{t.op.seq}.{t.upload_serial}", *t.upload) for t in self.pending.values() if t.upload is not None
        ]
        ops = [t.op for t in self.pending.values()] + self.retained_ops()
        self.journal.compact(sorted(ops, key=lambda op: op.seq), open_uploads)

    async def _abort(self, key: str, upload_id: str, journal_id: str | None) -> None:
        try:
            await self._call(key, self.store.abort_multipart, key, upload_id, attempts=5)
        except StoreError as exc:
            log.warning("could not abort multipart upload of %s: %s", key, exc)
            return
        if journal_id is not None:
            self.journal.multipart_ended(journal_id)

    async def _call(self, key: str, fn, *args, attempts: int | None = None):
        """Run a blocking store call in a thread, retrying failures with backoff (NotFound is final)."""
        retrying = tenacity.AsyncRetrying(
            sleep=trio.sleep,
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, StoreError) and not isinstance(e, NotFound)),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=30),
            stop=tenacity.stop_after_attempt(attempts) if attempts else tenacity.stop_never,
            before_sleep=lambda state: self._record_error(key, state.outcome.exception()),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await trio.to_thread.run_sync(fn, *args, limiter=self.store_threads)

    def _record_error(self, key: str, exc: BaseException) -> None:
        message = str(exc)
        self.errors.append({"time": time.time(), "key": key, "message": message})
        if (key, message) not in self._logged_errors:  # once per key and reason, not per retry
            self._logged_errors.add((key, message))
            log.error("store error on %s (will retry): %s", key, message)

    def _hash(self, content: Content) -> str:
        hasher = xxhash.xxh3_64()
        for index in range(len(content.blocks)):
            length = content.block_length(index)
            ref = content.blocks[index]
            hasher.update(self.cache.view(ref, length) if ref is not None else bytes(length))
        return hasher.hexdigest()


def _read_range(content: Content, start: int, length: int) -> bytes:
    """A part's bytes, copied out of the cache (runs in a worker thread)."""
    return content.read(start, length)
