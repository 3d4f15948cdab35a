"""Background upload: applies journal ops to the store, data in parallel, publication in order.

Each ``put`` gets a preparation task as soon as it is submitted: for files larger
than one part it creates the multipart upload and sends the parts, several in
flight across all files (a semaphore of ``concurrency`` parts bounds memory and
connections). One publisher task then walks the pending ops in sequence order and
makes each visible: completes the multipart upload, PUTs a small file, deletes,
moves, makes a directory marker. So a file becomes durable only after everything
committed before it (ordered publish), while the bytes of many files travel at once.

Streaming: while a file is still open for writing, the namespace hands every full
block the writer has moved past to the file's ``Stream``, whose parts go out at
once. The commit passes the stream to its put, which keeps each part whose block
is unchanged since it was sent (a change stamp says so) and sends the others.

Every store call runs in a thread and is retried with jittered exponential
backoff; permanent errors are retried too (slowly), because the data must never
leave the cache before it is in the store. Errors are kept for ``status``.

Multipart uploads are journaled before they are created (an intent without an id),
so no crash or lost answer leaks one: an intent whose id never arrived makes the
uploader sweep that key's unknown uploads away.

Concurrency protocol (see docs/architecture.md): ``submit``, ``cancel``,
``retarget``, ``stream_part`` and ``abandon`` run on the trio loop without
awaiting, so the namespace changes a file and its pending op in one step. Once
the publisher has started to publish an op it can no longer be cancelled or
retargeted: the namespace then follows with a compensating op (delete or move).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import trio
import xxhash

from . import compression, integrity, retry
from .background import BackgroundThreads, Gate
from .cache import BlockRef, Cache, Content
from .health import StoreHealth
from .stats import LATENCY_BUCKETS, Histogram, RateMeter
from .journal import ATTR, DELETE, MKDIR, MOVE, PUT, Journal, Op
from .store.base import MAX_PARTS, NotFound, ObjectStore, PartInfo, StoreError

log = logging.getLogger(__name__)


def part_size_for(size: int, base: int, max_parts: int = MAX_PARTS) -> int:
    """The part size for a file: ``base`` doubled until the file fits in ``max_parts`` parts."""
    part = base
    while math.ceil(size / part) > max_parts:
        part *= 2
    return part


class PartBuffers:
    """Request bodies for parts, reused: botocore takes bytes-like bodies, not views of the
    arena, and a fresh 8 MiB copy per part costs more here than the copy itself (first touch
    of new memory, docs/machine-facts.md). A pool that grows on demand up to ``count`` buffers
    (the parts in flight), so an idle daemon holds none and a busy one only as many as it used
    at once (bytearray(n) writes n zeros: all its pages at once). Never waits: with every buffer
    busy, a part gets a fresh copy. Called from store threads (the lock guards the count)."""

    def __init__(self, size: int, count: int):
        self.size = size
        self.count = count
        self.made = 0
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def _take(self, length: int) -> bytearray | None:
        if length != self.size:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
            if self.made >= self.count:
                return None
            self.made += 1
        return bytearray(self.size)  # first need: kept in the pool from now on

    @contextlib.contextmanager
    def body(self, length: int, fill: Callable[[memoryview], None]):
        """A buffer of ``length`` bytes that ``fill`` wrote, for the duration of one request."""
        buf = self._take(length)
        if buf is None:
            body = bytearray(length)
            fill(memoryview(body))
            yield body
            return
        try:
            fill(memoryview(buf))
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)


@dataclass(frozen=True)
class Upload:
    """A multipart upload in the store; ``journal_id`` names it in the journal (and in the
    object's metadata, so a completion whose answer was lost can be recognised)."""

    key: str
    upload_id: str
    journal_id: str


class Stream:
    """The parts of a file still open for writing, sent before its close."""

    def __init__(self, key: str):
        self.key = key  # the upload goes under the key the file had when streaming began
        self.meta: dict[str, str] = {}  # the file's attributes for the upload's metadata (no mtime yet)
        self.upload: Upload | None = None
        self.sent: dict[int, tuple[int, PartInfo]] = {}  # block index -> (change stamp, part)
        self.sending: set[int] = set()
        self.idle = trio.Event()
        self.idle.set()
        self.creating = trio.Lock()
        self.scopes: set[trio.CancelScope] = set()  # one per part on its way
        self.closed = False  # adopted by a commit or abandoned: no new parts
        self.abandoned = False

    def cancel(self) -> None:
        self.abandoned = True
        for scope in self.scopes:
            scope.cancel()


class Task:
    """A pending op and its progress."""

    def __init__(self, op: Op, content: Content | None, on_durable: Callable[[Op], None] | None):
        self.op = op
        self.content = content
        self.on_durable = on_durable
        self.ready = trio.Event()  # data prepared: the publisher may go
        self.scope = trio.CancelScope()
        self.preparing = False  # the preparation task still runs (it owns content and upload)
        self.publishing = False
        self.cancelled = False
        self.xxh3 = ""
        self.part_size = 0
        self.upload: Upload | None = None
        self.parts: list[PartInfo | None] = []
        self.bytes_sent = 0
        self.stream: Stream | None = None
        self.stamps: list[int] = []  # the staged file's block change stamps at commit
        self.completed = False  # found already complete (a restart after the completion)
        self.submitted = time.monotonic()  # committed (or resumed at mount): its pending age
        self.compressed = False  # its parts are zstd frames (decided when its upload is made)

    @property
    def multipart(self) -> bool:
        return self.op.kind == PUT and self.op.size > self.part_size

    def n_parts(self) -> int:
        return math.ceil(self.op.size / self.part_size)


class Uploader:
    def __init__(self, store: ObjectStore, cache: Cache, journal: Journal, part_size: int, concurrency: int,
                 compress_level: int | None = None):
        self.store = store
        # --compress: parts go up as zstd frames (compression.py), compressed in the store threads
        self.codec = compression.Codec(compress_level) if compress_level else None
        self.governor = compression.Governor(behind=lambda: cache.waiters > 0)
        # Bytes the store received for file data (compressed size where compressed; uploaded_bytes
        # counts the files' own bytes). Frames are counted from store threads: under a lock.
        self.stored_bytes = 0
        self._stored_lock = threading.Lock()
        self._marked = False  # compression.MARKER_KEY is in the store
        self.cache = cache
        self.journal = journal
        self.part_size = part_size
        self.pending: dict[int, Task] = {}  # by seq; insertion order is sequence order
        self.streams: set[Stream] = set()
        self.uploads: dict[str, Upload] = {}  # live multipart uploads by journal id
        self.creating: dict[str, str] = {}  # journal id -> key, while CreateMultipartUpload runs
        self.part_slots = trio.Semaphore(concurrency)
        self.part_buffers = PartBuffers(part_size, concurrency)
        self.store_threads = BackgroundThreads(concurrency + 2, "ckptfs-store")
        self.cache_gate = Gate("the cache")  # store threads copy parts out of the cache through it
        self.health = StoreHealth()  # the daemon shares one with the fetcher and the namespace
        self.hash_threads = trio.CapacityLimiter(2)
        self.progress = trio.Event()  # set (and replaced) whenever an op is done
        self.new_work = trio.Event()
        self.errors: deque[dict] = deque(maxlen=20)
        self._logged_errors: set[tuple[str, str]] = set()
        self._uploaded_bytes = 0
        self.upload_rate = RateMeter()  # recent bytes/s, fed by uploaded_bytes
        self.streamed_bytes = 0
        self.committed_bytes = 0  # put ops submitted (commits, and those resumed at mount)
        self.retries = 0  # failed store calls retried
        self.call_latency = Histogram(LATENCY_BUCKETS)  # each store call attempt, failed ones too
        self.clear_since = time.monotonic()  # the last moment nothing committed was pending
        self.durable_files = 0
        self.nursery: trio.Nursery | None = None
        self.retained_ops: Callable[[], list[Op]] = list  # ops the journal keeps besides pending ones

    @property
    def uploaded_bytes(self) -> int:
        return self._uploaded_bytes

    @uploaded_bytes.setter
    def uploaded_bytes(self, value: int) -> None:
        self.upload_rate.add(value - self._uploaded_bytes)
        self._uploaded_bytes = value

    # -- called by the namespace (no awaits) -----------------------------------------
    def submit(self, op: Op, content: Content | None = None, on_durable: Callable[[Op], None] | None = None,
               stream: Stream | None = None, stamps: list[int] | None = None) -> Task:
        task = Task(op, content.hold() if content is not None else None, on_durable)
        task.part_size = part_size_for(op.size, self.part_size)
        task.stream, task.stamps = stream, stamps or []
        if op.upload:  # parts evicted from the cache live in this upload: it must be the one
            task.part_size = self.part_size
            self.uploads[op.upload[2]] = Upload(*op.upload)
        if not self.pending:
            self.clear_since = time.monotonic()
        self.pending[op.seq] = task
        if op.kind == PUT:
            self.committed_bytes += op.size
            task.preparing = True
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
        task.scope.cancel()
        task.ready.set()
        self.journal.cancel(seq)
        if task.content is not None and task.content.remote:
            task.content.orphaned = True  # its evicted parts go with the upload
        if not task.preparing:  # otherwise the preparation task cleans up once its threads are done
            if task.upload is not None:
                self.nursery.start_soon(self._abort, task.upload)
                task.upload = None
            self._finish(task)
        self._signal_progress()
        return True

    def retarget(self, seq: int, key: str) -> bool:
        """Point a pending put at a new key (a rename of a file not yet durable)."""
        task = self.pending.get(seq)
        if task is None or task.publishing or task.op.upload:
            return False  # (evicted parts cannot move to another key's upload: a move follows)
        task.op.key = key
        task.op.replaces = ""  # (the old key's object goes with its delete, manifest and all)
        self.journal.retarget(seq, key)
        return True

    def open_stream(self, key: str) -> Stream:
        stream = Stream(key)
        self.streams.add(stream)
        return stream

    def stream_part(self, stream: Stream, index: int, ref: BlockRef, stamp: int) -> None:
        """Send a full block of a file still being written as part ``index + 1``."""
        if stream.closed or index in stream.sending or index >= MAX_PARTS:
            return  # (a block already on its way: the commit re-sends it if it changed since)
        self.cache.incref(ref)  # the bytes stay put while they travel; a write copies the block
        stream.sending.add(index)
        if stream.idle.is_set():
            stream.idle = trio.Event()
        self.nursery.start_soon(self._stream_part, stream, index, ref, stamp)

    def abandon(self, stream: Stream) -> None:
        """The file was closed without a commit (or unlinked): abort its upload."""
        if stream.abandoned:
            return
        stream.closed = True
        stream.cancel()
        self.nursery.start_soon(self._close_stream, stream)

    # -- queries ------------------------------------------------------------------------
    def pending_bytes(self, up_to: int | None = None) -> int:
        return sum(
            max(t.op.size - t.bytes_sent, 0)
            for s, t in self.pending.items()
            if t.op.kind == PUT and (up_to is None or s <= up_to)
        )

    def holds_cache(self) -> bool:
        """Whether a pending upload still holds cache blocks (its end will free some)."""
        return any(t.content is not None for t in self.pending.values()) or any(s.sending for s in self.streams)

    def pending_count(self, up_to: int | None = None) -> int:
        return sum(1 for s in self.pending if up_to is None or s <= up_to)

    def oldest_pending_age(self) -> float:
        """Seconds since the oldest pending op was committed (0 if none)."""
        oldest = min((t.submitted for t in self.pending.values()), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def at_risk_seconds(self) -> float:
        """Training at risk: 0 while everything committed is in the store, otherwise the seconds
        since the last moment it was (a node lost now rolls the job back to that moment's state)."""
        return time.monotonic() - self.clear_since if self.pending else 0.0

    def pending_files_and_size(self, up_to: int | None = None) -> tuple[int, int]:
        """Files (put ops) pending up to ``up_to``, and their whole size."""
        puts = [t.op.size for s, t in self.pending.items() if t.op.kind == PUT and (up_to is None or s <= up_to)]
        return len(puts), sum(puts)

    def last_seq(self) -> int:
        return self.journal.next_seq - 1

    async def wait_durable(self, up_to: int) -> None:
        """Return once every op with seq <= up_to is in the store."""
        while self.pending and next(iter(self.pending)) <= up_to:
            await self.progress.wait()

    # -- the workers --------------------------------------------------------------------
    async def run(self, open_uploads: list[tuple[str, str, str | None]] = (), *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for journal_id, key, upload_id in open_uploads:  # left open by a dead daemon: start over
                if upload_id is None:  # it died while creating one: find it by its key
                    nursery.start_soon(self._sweep, key, journal_id)
                else:
                    nursery.start_soon(self._abort, Upload(key, upload_id, journal_id))
            nursery.start_soon(self._publisher)
            task_status.started()

    async def _prepare(self, task: Task) -> None:
        try:
            with task.scope:
                await self._until_done(task, self._prepare_once)
        finally:
            task.preparing = False
            task.ready.set()
            if task.cancelled:
                if task.upload is not None:
                    self.nursery.start_soon(self._abort, task.upload)
                    task.upload = None
                self._finish(task)

    async def _prepare_once(self, task: Task) -> None:
        if task.op.upload and task.upload is None:  # parts evicted from the cache are only there
            task.upload = Upload(*task.op.upload)
            task.parts = [None] * task.n_parts()
            for index, token in task.op.parts.items():
                task.parts[index] = PartInfo(index + 1, token, task.op.hashes.get(index, ""))
                task.bytes_sent += task.part_size
            # (those parts say whether the upload holds frames, whatever this mount's --compress)
            task.compressed = any(compression.untag(h)[1] is not None for h in task.op.hashes.values())
        if task.stream is not None:
            await self._adopt_stream(task)
        if not task.xxh3 and not task.content.remote:  # the whole file's hash (not streamed: in the metadata)
            task.xxh3 = await trio.to_thread.run_sync(self._hash, task.content, limiter=self.hash_threads)
        if task.multipart:
            await self._upload_parts(task)

    async def _adopt_stream(self, task: Task) -> None:
        """Take over the parts a stream sent that still match the committed content."""
        stream = task.stream
        stream.closed = True
        await stream.idle.wait()  # (cancelled here, the stream is still the task's to abandon)
        task.stream = None
        self.streams.discard(stream)
        if stream.upload is None:
            return
        usable = task.multipart and task.part_size == self.cache.block_size and stream.upload.key == task.op.key
        if stream.upload != task.upload and (task.upload is not None or not usable):
            self.nursery.start_soon(self._abort, stream.upload)
            return
        if task.upload is None:
            task.upload = stream.upload
            task.parts = [None] * task.n_parts()
            task.compressed = self.codec is not None
        for index, (stamp, part) in stream.sent.items():
            full = task.content.block_length(index) == task.part_size
            if task.compressed and index == len(task.parts) - 1:
                continue  # the last part carries the seek table: sent at commit
            if index < len(task.parts) and task.parts[index] is None and index < len(task.stamps) \
                    and task.stamps[index] == stamp and full:
                task.parts[index] = part
                task.bytes_sent += task.part_size

    async def _until_done(self, task: Task, step) -> None:
        """Run ``step(task)``, retrying after unexpected errors: a bug or a cache read
        failure must not stop the uploader, nor lose the data (it stays in the cache)."""
        def failed(exc: BaseException) -> None:
            log.error("upload of %s failed unexpectedly; retrying in %g s", task.op.key, retry.AFTER_BUG.interval_s,
                      exc_info=exc)
            self._record_error(task.op.key, exc)

        return await retry.call(lambda: retry.AFTER_BUG.retrying(failed), lambda: step(task))

    async def _upload_parts(self, task: Task) -> None:
        if task.upload is None:
            # A rename may retarget the op while we work: the upload stays under this key.
            task.compressed = self.codec is not None
            task.upload = await self._create_upload(task.op.key, {
                **task.op.meta, "xxh3": task.xxh3, "ckptfs-part-size": str(task.part_size),
                integrity.MANIFEST_META: integrity.ALGORITHM, **self._format_meta(task.compressed)})
            task.parts = [None] * task.n_parts()
            task.bytes_sent = 0
        upload = task.upload
        gone: list[int] = []
        # A compressed object's last part holds the seek table, made of every frame's size: it
        # goes once the others are sent (sent before, as by an earlier try, it goes again).
        last = len(task.parts)
        if task.compressed and task.parts[last - 1] is not None:
            task.parts[last - 1] = None
            task.bytes_sent -= task.op.size - (last - 1) * task.part_size
        async with trio.open_nursery() as parts:
            for number in range(1, last + (not task.compressed)):
                if task.parts[number - 1] is None:
                    await self.part_slots.acquire()
                    parts.start_soon(self._send_part, task, upload, number, gone)
        if task.compressed and not gone:
            await self.part_slots.acquire()
            await self._send_part(task, upload, last, gone)
        if gone and await self._is_complete(upload):  # completed just before a crash
            task.completed = True
            return
        if gone:  # the store lost the upload (expired, aborted by hand): start over
            log.warning("multipart upload of %s vanished; uploading it again", upload.key)
            self._forget(upload)
            task.upload = None
            await self._upload_parts(task)

    async def _send_part(self, task: Task, upload: Upload, number: int, gone: list[int]) -> None:
        try:
            start = (number - 1) * task.part_size
            length = min(task.part_size, task.op.size - start)
            content = task.content

            def send() -> PartInfo:
                with self.part_buffers.body(length, lambda out: self._from_cache(content.read_into, start, out)) as body:
                    digest = integrity.part_hash(body)  # sealed: what the manifest records
                    if task.compressed:
                        return self._send_frame(upload, number, body, digest, self._seek_table_after(task, number))
                    return replace(self.store.upload_part(upload.key, upload.upload_id, number, body), xxh3=digest)

            try:
                task.parts[number - 1] = await self._call(upload.key, send)
            except NotFound:
                gone.append(number)
                return
            task.bytes_sent += length
            self.uploaded_bytes += length
            if not task.compressed:
                self._count_stored(length)
        finally:
            self.part_slots.release()

    async def _stream_part(self, stream: Stream, index: int, ref: BlockRef, stamp: int) -> None:
        try:
            with trio.CancelScope() as scope:
                stream.scopes.add(scope)
                if stream.abandoned:
                    scope.cancel()
                async with self.part_slots:
                    async with stream.creating:
                        if stream.upload is None:
                            stream.upload = await self._create_upload(stream.key, {
                                **stream.meta, "ckptfs-part-size": str(self.part_size),
                                integrity.MANIFEST_META: integrity.ALGORITHM,
                                **self._format_meta(self.codec is not None)})
                    upload, size = stream.upload, self.cache.block_size
                    compressed = self.codec is not None

                    def send() -> PartInfo:
                        with self.part_buffers.body(size, lambda out: self._from_cache(self.cache.read_into, ref, 0, out)) as body:
                            digest = integrity.part_hash(body)  # sealed: what the manifest records
                            if compressed:
                                return self._send_frame(upload, index + 1, body, digest, None)
                            return replace(self.store.upload_part(upload.key, upload.upload_id, index + 1, body),
                                           xxh3=digest)

                    try:
                        part = await self._call(upload.key, send)
                    except NotFound:
                        return  # the upload vanished: the commit sends this part again
                    stream.sent[index] = (stamp, part)
                    self.uploaded_bytes += size
                    if not compressed:
                        self._count_stored(size)
                    self.streamed_bytes += size
        finally:
            stream.scopes.discard(scope)
            self.cache.decref(ref)
            stream.sending.discard(index)
            if not stream.sending:
                stream.idle.set()
            self.cache.notify_space()  # the block may be reclaimable now (or a waiter must give up)

    async def _close_stream(self, stream: Stream) -> None:
        await stream.idle.wait()
        self.streams.discard(stream)
        if stream.upload is not None:
            await self._abort(stream.upload)

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
        if op.kind == PUT:
            replaced = await self._replaced_manifest(task)
            if task.multipart:
                await self._publish_multipart(task)
            else:
                await self._publish_one(task)
            if replaced:  # the object it replaced is gone: so is the need for its manifest
                await self._drop_manifest(op.key, replaced)
        elif op.kind == DELETE:
            # A multipart object's manifest goes with it (after it: never an object without one).
            info = None if op.small else await self._call(op.key, self.store.head, op.key)
            await self._call(op.key, self.store.delete, op.key)
            upload_id = info.metadata.get(integrity.UPLOAD_META) if info is not None else None
            if upload_id and info.metadata.get(integrity.MANIFEST_META):
                await self._drop_manifest(op.key, upload_id)
        elif op.kind == MKDIR:
            await self._call(op.key, self.store.put, op.key, b"", dict(op.meta))
        elif op.kind == ATTR:
            try:
                await self._call(op.key, self.store.set_metadata, op.key, op.meta)
            except NotFound:
                log.info("attributes of %s: no longer in the store", op.key)
        elif op.kind == MOVE:
            try:
                await self._call(op.key, self.store.copy, op.src, op.key)
            except NotFound:
                # Replayed after a crash between copy and delete, or the source is gone.
                if await self._call(op.key, self.store.head, op.key) is None:
                    log.warning("move %s -> %s: the source is not in the store", op.src, op.key)
            await self._call(op.src, self.store.delete, op.src)

    async def _publish_multipart(self, task: Task) -> None:
        op = task.op
        if task.upload is None or task.upload.key != op.key:  # retargeted after the upload began
            if task.upload is not None:
                await self._abort(task.upload)
                task.upload = None
            if not task.xxh3:
                task.xxh3 = await trio.to_thread.run_sync(self._hash, task.content, limiter=self.hash_threads)
            await self._upload_parts(task)
        upload = task.upload
        checksums = None if task.completed else self._checksums(task)
        try:
            if not task.completed:
                # The manifest first: an object that is visible has its part checksums.
                # (Found already complete: the manifest was written before that completion.)
                if task.compressed:
                    await self._mark_compressed(op.key)
                if checksums is not None:
                    await self._put_manifest(op.key, checksums)
                await self._call(op.key, self.store.complete_multipart, op.key, upload.upload_id, task.parts)
        except NotFound:
            # A retry after a completion whose answer was lost: the upload id is gone.
            if not await self._is_complete(upload):
                self._forget(upload)
                task.upload = None
                if checksums is not None:  # (that upload never became an object)
                    await self._drop_manifest(op.key, checksums.upload)
                await self._publish_multipart(task)  # start over with a new upload
                return
        self._forget(upload)
        task.upload = None
        if task.content is not None and checksums is not None:
            task.content.checksums = checksums  # reads of evicted blocks need no manifest GET

    async def _publish_one(self, task: Task) -> None:
        op = task.op
        data = await trio.to_thread.run_sync(task.content.read, 0, op.size, limiter=self.hash_threads)
        metadata = {**op.meta, integrity.XXH3_META: task.xxh3}
        checksums = integrity.Checksums.whole_file(op.size, task.xxh3)
        if self.codec is not None and op.size >= compression.ONE_PUT_MIN:
            frame, by = await trio.to_thread.run_sync(compression.encode_part, self.codec, None, data,
                                                      limiter=self.hash_threads)
            if by != compression.RAW:  # (one that does not compress stays a plain object)
                data = frame + compression.seek_table([(len(frame), op.size)])
                metadata.update(self._format_meta(True), **{compression.SIZE_META: str(op.size),
                                                           compression.FRAMES_META: f"{len(frame)}:{by}"})
                checksums = replace(checksums, frames=((len(frame), by),))
                await self._mark_compressed(op.key)
        await self._call(op.key, self.store.put, op.key, data, metadata)
        task.bytes_sent = op.size
        self.uploaded_bytes += op.size
        self._count_stored(len(data))
        task.content.checksums = checksums

    # -- compression ---------------------------------------------------------------------------
    def _count_stored(self, size: int) -> None:
        with self._stored_lock:
            self.stored_bytes += size

    @staticmethod
    def _format_meta(compressed: bool) -> dict[str, str]:
        return {compression.FORMAT_META: compression.FORMAT} if compressed else {}

    def _send_frame(self, upload: Upload, number: int, body, digest: str, table: Callable[[int], bytes] | None):
        """Upload part ``number`` as a zstd frame (in a store thread). ``table``: this is the last
        part, followed by the seek table that ``table(its frame's size)`` gives; the others are
        padded to S3's smallest part. PartInfo.xxh3 carries the frame (compression.tag)."""
        if self.codec is None:  # an upload resumed from the journal of a mount that compressed
            frame, by = compression.raw_frame(body), compression.RAW
        else:
            frame, by = compression.encode_part(self.codec, self.governor, body)
        stored = len(frame)
        if table is None:
            frame = compression.pad_to(frame, min(compression.MIN_PART, self.part_size))
            stored = len(frame)
        else:
            frame += table(stored)
        started = time.perf_counter()
        part = self.store.upload_part(upload.key, upload.upload_id, number, frame)
        self.governor.uploaded(len(frame), time.perf_counter() - started)
        self._count_stored(len(frame))
        return replace(part, xxh3=compression.tag(digest, stored, by))

    def _seek_table_after(self, task: Task, number: int) -> Callable[[int], bytes] | None:
        """For the last part of a compressed upload: the seek table, given the last frame's size."""
        if number != len(task.parts):
            return None
        frames = [compression.untag(part.xxh3)[1][0] for part in task.parts[:-1]]
        sizes = [task.part_size] * len(frames) + [task.op.size - len(frames) * task.part_size]
        return lambda last: compression.seek_table(list(zip(frames + [last], sizes)))

    async def _mark_compressed(self, key: str) -> None:
        """Before the bucket's first compressed object: the marker that tells mounts to look for
        uncompressed sizes (logical_store.LogicalStore)."""
        if not self._marked:
            await self._call(key, self.store.put, compression.MARKER_KEY, b"", {})
            self._marked = True

    # -- checksums ---------------------------------------------------------------------------
    def _checksums(self, task: Task) -> integrity.Checksums | None:
        """The manifest of a multipart put: every part's xxh3 (None if one is unknown: a part
        resumed from the journal of an older version; the object then reads as unverified)."""
        tags = [compression.untag(part.xxh3) if part is not None else ("", None) for part in task.parts]
        hashes = [digest for digest, _ in tags]
        frames = tuple(frame for _, frame in tags) if task.compressed else ()
        if not all(hashes) or None in frames:
            log.warning("%s: part checksums unknown (journal of an older version): no manifest", task.op.key)
            return None
        return integrity.Checksums(task.op.size, task.part_size, hashes, task.xxh3, task.upload.journal_id,
                                   "manifest", frames)

    async def _put_manifest(self, key: str, checksums: integrity.Checksums) -> None:
        mkey = integrity.manifest_key(checksums.upload)
        await self._call(key, self.store.put, mkey, checksums.to_manifest(), {})

    async def _drop_manifest(self, key: str, upload_id: str) -> None:
        """Delete the manifest of an object that is gone (a few tries: an orphan is harmless)."""
        mkey = integrity.manifest_key(upload_id)
        try:
            await self._call(key, self.store.delete, mkey, attempts=5)
        except StoreError as exc:
            log.warning("could not delete %s (the manifest of a replaced or deleted %s): %s", mkey, key, exc)

    async def _replaced_manifest(self, task: Task) -> str:
        """The upload id of the manifest the put's object replaces ("" if none). The namespace
        knows it, or says "?": then the object in the store now tells (a HEAD)."""
        if task.op.replaces != "?":
            return task.op.replaces
        info = await self._call(task.op.key, self.store.head, task.op.key)
        if info is None or not info.metadata.get(integrity.MANIFEST_META):
            return ""
        upload_id = info.metadata.get(integrity.UPLOAD_META, "")
        # (replayed after our own completion: that manifest is this put's own)
        return "" if task.upload is not None and upload_id == task.upload.journal_id else upload_id

    # -- multipart bookkeeping ---------------------------------------------------------------
    async def _create_upload(self, key: str, metadata: dict[str, str]) -> Upload:
        """CreateMultipartUpload, journaled first: it is not idempotent, so a crash or a lost
        answer could otherwise leave an upload nobody knows about."""
        journal_id = uuid.uuid4().hex[:16]
        self.journal.multipart_started(journal_id, key, None)
        self.creating[journal_id] = key
        attempts = 0

        def create() -> str:
            nonlocal attempts
            attempts += 1
            return self.store.create_multipart(key, {**metadata, "ckptfs-upload": journal_id})

        try:
            upload_id = await self._call(key, create)
        except BaseException:
            del self.creating[journal_id]
            # Cancelled or failed mid-call: the store may have created it anyway.
            self.nursery.start_soon(self._sweep, key, journal_id)
            raise
        del self.creating[journal_id]
        upload = Upload(key, upload_id, journal_id)
        self.uploads[journal_id] = upload
        self.journal.multipart_started(journal_id, key, upload_id)
        if attempts > 1:  # an earlier attempt may have created one whose answer was lost
            await self._sweep(key)
        return upload

    async def _is_complete(self, upload: Upload) -> bool:
        info = await self._call(upload.key, self.store.head, upload.key)
        return info is not None and info.metadata.get("ckptfs-upload") == upload.journal_id

    async def _sweep(self, key: str, journal_id: str | None = None) -> None:
        """Abort the uploads under ``key`` that nobody here knows (created, answer never heard)."""
        while key in self.creating.values():  # let creates in flight record their ids first
            await trio.sleep(0.05)
        try:
            found = await self._call(key, self.store.list_multipart, key, attempts=5)
        except StoreError as exc:
            log.warning("could not list multipart uploads of %s: %s", key, exc)
            return
        known = {u.upload_id for u in self.uploads.values()}
        for found_key, upload_id in found:
            if found_key == key and upload_id not in known:
                await self._abort(Upload(key, upload_id, ""))
        if journal_id:
            self.journal.multipart_ended(journal_id)

    async def _abort(self, upload: Upload) -> None:
        try:
            await self._call(upload.key, self.store.abort_multipart, upload.key, upload.upload_id, attempts=5)
        except StoreError as exc:
            log.warning("could not abort multipart upload of %s: %s", upload.key, exc)
            return
        self._forget(upload)

    def _forget(self, upload: Upload) -> None:
        """The upload is finished (completed, aborted or gone)."""
        self.uploads.pop(upload.journal_id, None)
        if upload.journal_id:
            self.journal.multipart_ended(upload.journal_id)

    # -- shutdown ----------------------------------------------------------------------------
    def abandon_calls(self) -> None:
        """Shutdown begins: store calls in flight are no longer waited for (see background.py).
        Safe because every store call is idempotent or journaled before it is made (a multipart
        intent, a pending op): what an abandoned call does or not, the next mount redoes or sweeps."""
        self.store_threads.abandon()

    def close(self) -> None:
        """Shutdown ends (the trio loop is gone): abandoned calls may no longer read the cache,
        which is closed next. (They never touch the journal: only the trio loop writes it.)"""
        self.cache_gate.close()

    def _from_cache(self, read, *args) -> None:
        """A copy out of the cache from a store thread, refused once shutdown closed the cache."""
        with self.cache_gate.use():
            read(*args)

    # -- helpers ---------------------------------------------------------------------------
    def _finish(self, task: Task) -> None:
        if task.content is not None:
            task.content.release()
            task.content = None
        if task.stream is not None:  # never adopted (cancelled first)
            self.abandon(task.stream)
            task.stream = None

    def _signal_progress(self) -> None:
        self.progress.set()
        self.progress = trio.Event()

    def _compact(self) -> None:
        open_uploads = [(u.journal_id, u.key, u.upload_id) for u in self.uploads.values()]
        open_uploads += [(i, key, None) for i, key in self.creating.items()]
        ops = [t.op for t in self.pending.values()] + self.retained_ops()
        self.journal.compact(sorted(ops, key=lambda op: op.seq), open_uploads)

    async def _call(self, key: str, fn, *args, attempts: int | None = None):
        """Run a blocking store call in a thread, retrying failures with backoff (retry.publishing)."""
        async def once():
            started = time.monotonic()
            try:
                result = await self.store_threads.run(fn, *args)
            finally:
                self.call_latency.observe(time.monotonic() - started)
            self.health.answered()
            return result

        return await retry.call(lambda: retry.publishing(lambda exc: self._record_error(key, exc), attempts), once)

    def _record_error(self, key: str, exc: BaseException) -> None:
        message = str(exc)
        self.retries += 1
        self.errors.append({"time": time.time(), "key": key, "message": message})
        self.health.failed("", key, message)
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
