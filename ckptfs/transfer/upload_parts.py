"""The uploader's data path: a put's preparation (the whole file's hash, the parts of an upload
evicted from the cache, a stream's parts adopted), its multipart parts sent in parallel
(``part_slots`` of them at once), the streamed parts of files still open for writing, a put's
publication (one PUT, or the completion of its multipart upload), and the multipart bookkeeping
that keeps no upload unknown (journaled before it is created, swept when its answer was lost,
aborted when given up). See uploader.py's module doc.

``PartSender`` is built and held by ``uploader.Uploader``; it makes its store calls through the
``StoreCalls`` it is given and encodes through the ``Encoder`` it is given (compressed frames,
manifests), both shared with the uploader. The uploader sets ``nursery`` when it runs.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace

import trio

from ckptfs.blocks import BlockRef, content_xxh3, zeros_xxh3
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import Journal
from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.objects import compression, integrity
from ckptfs.parts import PartSchedule
from ckptfs.store.base import PartInfo
from ckptfs.transfer.store_calls import StoreCalls
from ckptfs.transfer.upload_encoding import Encoder
from ckptfs.transfer.upload_tasks import INLINE_BYTES, PartBuffers, Stream, Task, Upload, in_thread_if_large
from ckptfs.transfer.workers import Piece, StoreWorkers, WorkerGone
from ckptfs.util.background import Gate
from ckptfs.util.byte_budget import ByteBudget
from ckptfs.util.stats import RateMeter

YIELD_POLL_S = 0.02  # how often a part given way looks again (``yield_to``)

log = logging.getLogger(__name__)


class PartSender:
    """The uploader's preparation of puts, streamed and multipart parts, multipart uploads, and
    the data of a put's publication."""

    def __init__(
        self,
        calls: StoreCalls,
        encoder: Encoder,
        cache: Cache,
        journal: Journal,
        schedule: PartSchedule,
        concurrency: int,
        hash_threads: trio.CapacityLimiter,
        yield_to: Callable[[], bool] | None = None,
        workers: StoreWorkers | None = None,
    ):
        self.calls = calls
        self.store = calls.store
        self.encoder = encoder
        self.cache = cache
        self.journal = journal
        self.schedule = schedule
        self.hash_threads = hash_threads
        self.streams: set[Stream] = set()
        self.uploads: dict[str, Upload] = {}  # live multipart uploads by journal id
        self.creating: dict[str, str] = {}  # journal id -> key, while CreateMultipartUpload runs
        self.part_slots = trio.Semaphore(concurrency)
        self.concurrency = concurrency
        # True while another transfer must go first (--replicas: a commit waits for its replicas,
        # not for the store): parts then go one at a time.
        self.yield_to = yield_to
        self.part_buffers = PartBuffers(schedule.base, concurrency)  # (parts of the base size)
        # Bytes of part bodies being read, hashed and sent at once: ``concurrency`` parts of the
        # base size, or one of the grown layout's largest (up to 4 GiB: it goes alone).
        self.body_bytes = ByteBudget(max(concurrency * schedule.base, schedule.largest_part))
        self.cache_gate = Gate("the cache")  # store threads copy parts out of the cache through it
        self._uploaded_bytes = 0
        self.upload_rate = RateMeter()  # recent bytes/s, fed by uploaded_bytes
        self.streamed_bytes = 0
        # Streamed parts of passthrough writes read and hashed again at their commit (and how
        # long that took), and those found changed and sent again.
        self.verified_bytes = 0
        self.verify_seconds = 0.0
        self.changed_parts = 0
        self.nursery: trio.Nursery | None = None  # the uploader's (Uploader.run)
        # Processes that read, hash and send a part themselves (transfer/workers.py); None: the
        # store threads do, here. Compressed parts stay here (the frames and the seek table).
        self.workers = workers

    @property
    def uploaded_bytes(self) -> int:
        return self._uploaded_bytes

    @uploaded_bytes.setter
    def uploaded_bytes(self, value: int) -> None:
        self.upload_rate.add(value - self._uploaded_bytes)
        self._uploaded_bytes = value

    # -- a put's preparation (a task of its own from submit on) ---------------------------------
    async def prepare(self, task: Task) -> None:
        try:
            with task.scope:
                await self.calls.until_done(task, self._prepare_once)
        finally:
            task.preparing = False
            task.ready.set()
            if task.cancelled:
                if task.upload is not None:
                    assert self.nursery is not None  # set in Uploader.run, before any submit
                    self.nursery.start_soon(self.abort, task.upload)
                    task.upload = None
                self.finish(task)

    async def _prepare_once(self, task: Task) -> None:
        if task.op.upload and task.upload is None:  # parts evicted from the cache are only there
            task.upload = Upload(*task.op.upload)
            task.parts = [None] * task.n_parts()
            for index, token in task.op.parts.items():
                task.parts[index] = PartInfo(index + 1, token, task.op.hashes.get(index, ""))
                task.bytes_sent += task.part_bounds(index)[1]
            # (those parts say whether the upload holds frames, whatever this mount's --compress)
            task.compressed = any(compression.untag(h)[1] is not None for h in task.op.hashes.values())
        if not task.multipart:  # (its hash goes in its object's metadata: first)
            if task.stream is not None:
                await self._adopt_stream(task)
            await self._hash_whole_file(task)
            return
        # A multipart object's whole-file hash goes in its manifest, put once every part is sent
        # (its CreateMultipartUpload has none, as a stream's): the hash reads the file beside the
        # uploads, not before them, where it delayed the first part by a pass over the file. The
        # committed content holds its blocks until the object is complete, so no part sent
        # meanwhile frees what the hash reads.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._hash_whole_file, task)
            nursery.start_soon(self._send_parts, task)

    async def _send_parts(self, task: Task) -> None:
        if task.stream is not None:  # (which of a stream's parts still match: re-read, kept)
            await self._adopt_stream(task)
        await self._upload_parts(task)

    async def _hash_whole_file(self, task: Task) -> None:
        """The whole file's xxh3, for its object's metadata (one PUT) or manifest (multipart). Not
        where it would cost more than it tells: parts evicted to the store (not here to hash), or
        a multipart file with holes (hashing them reads a byte per byte of hole; the part
        checksums cover every byte anyway)."""
        content = task.content
        assert content is not None  # a put's task holds its content until finish()
        if task.xxh3 or content.remote or (task.multipart and content.sparse()):
            return
        if self.workers is not None and content.size > INLINE_BYTES:  # (off the daemon's GIL)
            pieces = content.pieces(0, content.size)
            if self.workers.hashable(pieces):
                task.xxh3 = await self.calls.call(task.op.key, self._hash_by_worker, content, pieces)
                return
        task.xxh3 = await in_thread_if_large(self.hash_threads, content.size, self._hash, content)

    async def _adopt_stream(self, task: Task) -> None:
        """Take over the parts a stream sent that still match the committed content."""
        stream = task.stream
        assert stream is not None  # called only when the task has one (_prepare_once)
        stream.closed = True
        await stream.idle.wait()  # (cancelled here, the stream is still the task's to abandon)
        self._drop_filling(stream)
        task.stream = None
        self.streams.discard(stream)
        if stream.upload is None:
            return
        usable = (
            task.multipart and task.layout.base == self.cache.block_size and stream.upload.key == task.op.key
        )
        if stream.upload != task.upload and (task.upload is not None or not usable):
            assert self.nursery is not None  # set in Uploader.run, before any submit
            self.nursery.start_soon(self.abort, stream.upload)
            return
        if task.upload is None:
            task.upload = stream.upload
            task.parts = [None] * task.n_parts()
            task.compressed = self.encoder.codec is not None
        content = task.content
        assert content is not None  # a put's task holds its content until finish()
        bs = self.cache.block_size
        # A streamed part is kept where the commit's layout has a part of the same bytes, full,
        # and none of its blocks changed since it was sent (past the parts the grown layout
        # shares with the uniform one, a file that took the uniform layout sends them again).
        kept: list[tuple[int, int, PartInfo]] = []  # (index, length, the part sent)
        for index in sorted({part.number - 1 for _, part in stream.sent.values()}):
            if index >= len(task.parts) or task.parts[index] is not None:
                continue
            if task.compressed and index == len(task.parts) - 1:
                continue  # the last part carries the seek table: sent at commit
            start, length = task.part_bounds(index)
            if stream.layout.start(index) != start or stream.layout.size(index) != length:
                continue
            blocks = range(start // bs, (start + length) // bs)
            sent = [stream.sent.get(block) for block in blocks]
            if all(
                entry is not None
                and entry[1].number == index + 1
                and (stream.verify or (block < len(task.stamps) and task.stamps[block] == entry[0]))
                and content.block_length(block) == bs
                for block, entry in zip(blocks, sent)
            ):
                kept.append((index, length, sent[0][1]))  # type: ignore[index]
        if stream.verify:  # (no stamps: each part's bytes read and hashed again, in parallel)
            same: dict[int, bool] = {}
            began = trio.current_time()
            async with trio.open_nursery() as nursery:
                for index, length, _ in kept:
                    start = task.part_bounds(index)[0]
                    digest = stream.digests.get(index)
                    nursery.start_soon(self._unchanged, content, start, length, digest, same, index)
            self.verify_seconds += trio.current_time() - began  # (the commit's wall time for it)
            self.changed_parts += sum(1 for index, *_ in kept if not same[index])
            kept = [k for k in kept if same[k[0]]]  # (one written again since: sent again with the others)
        for index, length, part in kept:
            task.parts[index] = part
            task.bytes_sent += length

    async def _unchanged(
        self, content: Content, start: int, length: int, digest: str | None, out: dict[int, bool], index: int
    ) -> None:
        """``out[index]``: whether bytes [start, start + length) of ``content`` hash as ``digest`` still."""
        out[index] = False
        if digest is None:
            return
        # A store worker reads and hashes them where there are workers, as it does the bytes it
        # sends: a streamed save's second pass costs the daemon's process no more than its first.
        workers = self.workers if self.workers is not None and self.workers.usable else None
        pieces: list[Piece] = []

        def read(out: memoryview) -> None:
            self._from_cache(content.read_into, start, out)

        def check() -> bool:
            if workers is not None and workers.hashable(pieces):
                try:
                    return self._xxh3_by_worker(pieces) == digest
                except WorkerGone:  # (it died meanwhile: hashed here instead)
                    pass
            with self.part_buffers.body(length, read) as body:
                return integrity.part_hash(body) == digest

        async with self.body_bytes.take(length):
            if workers is not None:
                pieces = content.pieces(start, length)
            same = await trio.to_thread.run_sync(check, limiter=self.hash_threads)
        self.verified_bytes += length
        out[index] = same

    async def _upload_parts(self, task: Task) -> None:
        if task.upload is None:
            # A rename may retarget the op while we work: the upload stays under this key.
            task.compressed = self.encoder.codec is not None
            task.upload = await self._create_upload(
                task.op.key,
                {
                    **task.op.meta,
                    "ckptfs-part-size": str(task.layout.base),
                    integrity.MANIFEST_META: integrity.ALGORITHM,
                    **self.encoder.format_meta(task.compressed),
                },
            )
            task.parts = [None] * task.n_parts()
            task.bytes_sent = 0
        upload = task.upload
        gone: list[int] = []
        # A compressed object's last part holds the seek table, made of every frame's size: it
        # goes once the others are sent (sent before, as by an earlier try, it goes again).
        last = len(task.parts)
        if task.compressed and task.parts[last - 1] is not None:
            task.parts[last - 1] = None
            task.bytes_sent -= task.part_bounds(last - 1)[1]
        async with trio.open_nursery() as parts:
            for number in range(1, last + (not task.compressed)):
                if task.parts[number - 1] is None:
                    await self._take_slot()
                    parts.start_soon(self._send_part, task, upload, number, gone)
        if task.compressed and not gone:
            await self._take_slot()
            await self._send_part(task, upload, last, gone)
        if gone and await self._is_complete(upload):  # completed just before a crash
            task.completed = True
            return
        if gone:  # the store lost the upload (expired, aborted by hand): start over
            log.warning("multipart upload of %s vanished; uploading it again", upload.key)
            self._forget(upload)
            task.upload = None
            await self._upload_parts(task)

    async def _take_slot(self) -> None:
        """A part slot; only one part at a time while ``yield_to`` says another transfer goes
        first (on 2 cores the store's server and the replicas' TLS share the CPU with the
        writer: the upload, which no close waits for, gives way)."""
        while self.yield_to is not None and self.concurrency - self.part_slots.value >= 1 and self.yield_to():
            await trio.sleep(YIELD_POLL_S)
        await self.part_slots.acquire()

    async def _send_part(self, task: Task, upload: Upload, number: int, gone: list[int]) -> None:
        try:
            start, length = task.part_bounds(number - 1)
            content = task.content
            assert content is not None  # a put's task holds its content until finish()
            hole = content.holes(start, length)
            async with self.body_bytes.take(0 if hole else length):
                await self._send_part_body(task, upload, number, gone, start, length, hole)
        finally:
            self.part_slots.release()

    async def _send_part_body(
        self, task: Task, upload: Upload, number: int, gone: list[int], start: int, length: int, hole: bool
    ) -> None:
        content = task.content
        assert content is not None  # a put's task holds its content until finish()

        def send() -> PartInfo:
            if hole:  # a sparse file's hole: neither read, hashed nor sent byte by byte
                if task.compressed:
                    return self.encoder.send_frame(
                        upload,
                        number,
                        None,
                        zeros_xxh3(length),
                        self.encoder.seek_table_after(task, number),
                        zeros=length,
                    )
                return replace(
                    self.store.upload_zero_part(upload.key, upload.upload_id, number, length),
                    xxh3=zeros_xxh3(length),
                )
            if self.workers is not None and self.workers.usable and not task.compressed:
                return self._by_worker(upload, number, lambda: content.pieces(start, length))
            with self.part_buffers.body(
                length, lambda out: self._from_cache(content.read_into, start, out)
            ) as body:
                digest = integrity.part_hash(body)  # sealed: what the manifest records
                if task.compressed:
                    return self.encoder.send_frame(
                        upload, number, body, digest, self.encoder.seek_table_after(task, number)
                    )
                return replace(
                    self.store.upload_part(upload.key, upload.upload_id, number, body), xxh3=digest
                )

        try:
            task.parts[number - 1] = await self.calls.call(upload.key, send)
        except NotFound:
            gone.append(number)
            return
        task.bytes_sent += length
        self.uploaded_bytes += length
        if not task.compressed and not hole:  # (a hole's bytes were never sent)
            self.encoder.count_stored(length)

    # -- streams: parts of files still open for writing ------------------------------------------
    def open_stream(self, key: str) -> Stream:
        stream = Stream(key, self.schedule.grown)
        self.streams.add(stream)
        return stream

    def stream_part(self, stream: Stream, index: int, ref: BlockRef, stamp: int) -> None:
        """Take block ``index``, full, of a file still being written: once every block of its part
        (the stream's layout: one block, or a power of two of them past the parts the grown
        layout shares with the uniform one) is handed over, the part is sent. A handed block is
        held (a write copies it) until its part is sent; a block handed again replaces it."""
        bs = self.cache.block_size
        part = stream.layout.index(index * bs)
        if stream.closed or part in stream.sending or part >= self.store.limits.max_parts:
            return  # (a part already on its way: the commit re-sends it if a block changed since)
        self.cache.incref(ref)  # the bytes stay put while they wait and travel; a write copies the block
        filling = stream.filling.setdefault(part, {})
        old = filling.get(index)
        filling[index] = (ref, stamp)
        if old is not None:
            self.cache.decref(old[0])
        if len(filling) < len(stream.layout.blocks(part, bs)):
            return
        del stream.filling[part]
        stream.sending.add(part)
        if stream.idle.is_set():
            stream.idle = trio.Event()
        assert self.nursery is not None  # set in Uploader.run, before any submit
        self.nursery.start_soon(self._stream_part, stream, part, filling)

    def _drop_filling(self, stream: Stream) -> None:
        """Let go of the blocks held for parts never completed (the stream is closed)."""
        for filling in stream.filling.values():
            for ref, _ in filling.values():
                self.cache.decref(ref)
        stream.filling.clear()
        self.cache.notify_space()

    async def _stream_part(self, stream: Stream, part: int, filling: dict[int, tuple[BlockRef, int]]) -> None:
        bs = self.cache.block_size
        blocks = sorted(filling)
        try:
            with trio.CancelScope() as scope:
                stream.scopes.add(scope)
                if stream.abandoned:
                    scope.cancel()
                await self._take_slot()
                async with _released(self.part_slots):
                    async with stream.creating:
                        if stream.upload is None:
                            stream.upload = await self._create_upload(
                                stream.key,
                                {
                                    **stream.meta,
                                    "ckptfs-part-size": str(self.schedule.base),
                                    integrity.MANIFEST_META: integrity.ALGORITHM,
                                    **self.encoder.format_meta(self.encoder.codec is not None),
                                },
                            )
                    upload, size = stream.upload, len(blocks) * bs
                    compressed = self.encoder.codec is not None

                    def fill(out: memoryview) -> None:
                        for k, block in enumerate(blocks):
                            self._from_cache(
                                self.cache.read_into, filling[block][0], 0, out[k * bs : (k + 1) * bs]
                            )

                    def pieces() -> list[Piece]:
                        located = [self.cache.locate(filling[block][0], 0) for block in blocks]
                        return [(fd, pos, bs, short) for fd, pos, short in located]

                    def send() -> tuple[PartInfo, str]:
                        if self.workers is not None and self.workers.usable and not compressed:
                            info = self._by_worker(upload, part + 1, pieces)
                            return info, info.xxh3
                        with self.part_buffers.body(size, fill) as body:
                            digest = integrity.part_hash(body)  # sealed: what the manifest records
                            if compressed:
                                return self.encoder.send_frame(upload, part + 1, body, digest, None), digest
                            info = self.store.upload_part(upload.key, upload.upload_id, part + 1, body)
                            return replace(info, xxh3=digest), digest

                    try:
                        async with self.body_bytes.take(size):
                            info, digest = await self.calls.call(upload.key, send)
                    except NotFound:
                        return  # the upload vanished: the commit sends this part again
                    for block in blocks:
                        stream.sent[block] = (filling[block][1], info)
                    stream.digests[part] = digest
                    self.uploaded_bytes += size
                    if not compressed:
                        self.encoder.count_stored(size)
                    self.streamed_bytes += size
        finally:
            stream.scopes.discard(scope)
            for ref, _ in filling.values():
                self.cache.decref(ref)
            stream.sending.discard(part)
            if not stream.sending:
                stream.idle.set()
            self.cache.notify_space()  # the blocks may be reclaimable now (or a waiter must give up)

    def abandon(self, stream: Stream) -> None:
        """The file was closed without a commit (or unlinked): abort its upload."""
        if stream.abandoned:
            return
        stream.closed = True
        stream.cancel()
        assert self.nursery is not None  # set in Uploader.run, before any submit
        self.nursery.start_soon(self._close_stream, stream)

    async def _close_stream(self, stream: Stream) -> None:
        await stream.idle.wait()
        self._drop_filling(stream)
        self.streams.discard(stream)
        if stream.upload is not None:
            await self.abort(stream.upload)

    # -- publication of a put's data ---------------------------------------------------------
    async def publish_one(self, task: Task) -> None:
        op = task.op
        data, metadata, checksums = await self.encoder.one_put(task)
        await self.calls.call(op.key, self.store.put, op.key, data, metadata)
        task.bytes_sent = op.size
        self.uploaded_bytes += op.size
        self.encoder.count_stored(len(data))
        content = task.content
        assert content is not None  # a put's task holds its content until finish()
        content.checksums = checksums

    async def publish_multipart(self, task: Task) -> None:
        op = task.op
        if task.upload is None or task.upload.key != op.key:  # retargeted after the upload began
            if task.upload is not None:
                await self.abort(task.upload)
                task.upload = None
            await self._hash_whole_file(task)
            await self._upload_parts(task)
        elif None in task.parts:  # (a try that failed midway, after starting over: what it left unsent)
            await self._upload_parts(task)
        upload = task.upload
        assert upload is not None  # _upload_parts made one if there was none (kept when found complete)
        checksums = None if task.completed else self.encoder.checksums(task)
        try:
            if not task.completed:
                # The manifest first: an object that is visible has its part checksums.
                # (Found already complete: the manifest was written before that completion.)
                if task.compressed:
                    await self.encoder.mark_compressed(op.key)
                if checksums is not None:
                    await self.encoder.put_manifest(op.key, checksums)
                await self.calls.call(
                    op.key, self.store.complete_multipart, op.key, upload.upload_id, task.parts
                )
        except NotFound:
            # A retry after a completion whose answer was lost: the upload id is gone.
            if not await self._is_complete(upload):
                self._forget(upload)
                task.upload = None
                if checksums is not None:  # (that upload never became an object)
                    await self.encoder.drop_manifest(op.key, checksums.upload)
                await self.publish_multipart(task)  # start over with a new upload
                return
        except PartsLeftOut as e:
            # Parts sent while the file was longer (a streamed file truncated before its close),
            # on a server that will not leave them out: the file again, in a new upload. Not
            # when blocks of it were evicted from the cache: their only copy is in this upload
            # (the file stays pending, the error in status; Files refuses such truncates once
            # the server was seen refusing).
            if task.op.upload:
                raise StoreError(f"{e}: not possible, parts of it live only in that upload") from None
            log.warning("%s", e)
            await self.abort(upload)
            task.upload = None
            if checksums is not None:
                await self.encoder.drop_manifest(op.key, checksums.upload)
            await self.publish_multipart(task)
            return
        self._forget(upload)
        task.upload = None
        if task.content is not None and checksums is not None:
            task.content.checksums = checksums  # reads of evicted blocks need no manifest GET

    def finish(self, task: Task) -> None:
        """The task is done with (durable or cancelled): its content goes, and its stream if never adopted."""
        if task.content is not None:
            task.content.release()
            task.content = None
        if task.stream is not None:  # never adopted (cancelled first)
            self.abandon(task.stream)
            task.stream = None

    # -- the cache, from store threads -----------------------------------------------------------
    def close(self) -> None:
        """Refuse copies out of the cache from now on (waits for those under way)."""
        self.cache_gate.close()

    def _from_cache(self, read, *args):
        """A copy (or hash) out of the cache from a store thread, refused once shutdown closed
        the cache: what ``read`` returns."""
        with self.cache_gate.use():
            return read(*args)

    def _by_worker(self, upload: Upload, number: int, pieces: Callable[[], list]) -> PartInfo:
        """Part ``number`` sent by a store worker, which reads its ``pieces`` from the cache's
        files itself (store thread: it waits, the GIL released). The cache stays open for it
        until it has read them."""
        assert self.workers is not None
        with contextlib.ExitStack() as hold:
            hold.enter_context(self.cache_gate.use())
            return self.workers.upload_part(
                upload.key, upload.upload_id, number, pieces(), read_done=hold.close
            )

    def _hash_by_worker(self, content: Content, pieces: list[Piece]) -> str:
        assert self.workers is not None
        if not self.workers.usable:  # (they could not start: here, then)
            return self._from_cache(self._hash, content)
        return self._xxh3_by_worker(pieces)

    def _xxh3_by_worker(self, pieces: list[Piece]) -> str:
        """The xxh3 of ``pieces`` from a store worker (store or hash thread: it waits); the cache
        stays open for it until it has read them."""
        assert self.workers is not None
        with contextlib.ExitStack() as hold:
            hold.enter_context(self.cache_gate.use())
            return self.workers.xxh3(pieces, read_done=hold.close)

    def _hash(self, content: Content) -> str:
        return content_xxh3(self.cache.view, content.size, content.blocks, self.cache.block_size)

    # -- multipart bookkeeping ---------------------------------------------------------------
    async def _create_upload(self, key: str, metadata: dict[str, str]) -> Upload:
        """CreateMultipartUpload, journaled first: it is not idempotent, so a crash or a lost
        answer could otherwise leave an upload nobody knows about."""
        journal_id = uuid.uuid4().hex[:16]
        # (None: not created yet. Journal.multipart_started's ``upload_id: str`` is too narrow: the
        # journal reads None back as "find it by its key", see Uploader.run)
        self.journal.multipart_started(journal_id, key, None)
        self.creating[journal_id] = key
        attempts = 0

        def create() -> str:
            nonlocal attempts
            attempts += 1
            return self.store.create_multipart(key, {**metadata, "ckptfs-upload": journal_id})

        try:
            upload_id = await self.calls.call(key, create)
        except BaseException:
            del self.creating[journal_id]
            # Cancelled or failed mid-call: the store may have created it anyway.
            assert self.nursery is not None  # set in Uploader.run, before any submit
            self.nursery.start_soon(self.sweep, key, journal_id)
            raise
        del self.creating[journal_id]
        upload = Upload(key, upload_id, journal_id)
        self.uploads[journal_id] = upload
        self.journal.multipart_started(journal_id, key, upload_id)
        if attempts > 1:  # an earlier attempt may have created one whose answer was lost
            await self.sweep(key)
        return upload

    async def _is_complete(self, upload: Upload) -> bool:
        info = await self.calls.call(upload.key, self.store.head, upload.key)
        return info is not None and info.metadata.get("ckptfs-upload") == upload.journal_id

    async def sweep(self, key: str, journal_id: str | None = None) -> None:
        """Abort the uploads under ``key`` that nobody here knows (created, answer never heard)."""
        while key in self.creating.values():  # let creates in flight record their ids first
            await trio.sleep(0.05)
        try:
            found = await self.calls.call(key, self.store.list_multipart, key, attempts=5)
        except StoreError as exc:
            log.warning("could not list multipart uploads of %s: %s", key, exc)
            return
        known = {u.upload_id for u in self.uploads.values()}
        for found_key, upload_id in found:
            if found_key == key and upload_id not in known:
                await self.abort(Upload(key, upload_id, ""))
        if journal_id:
            self.journal.multipart_ended(journal_id)

    async def abort(self, upload: Upload) -> None:
        try:
            await self.calls.call(
                upload.key, self.store.abort_multipart, upload.key, upload.upload_id, attempts=5
            )
        except StoreError as exc:
            log.warning("could not abort multipart upload of %s: %s", upload.key, exc)
            return
        self._forget(upload)

    def _forget(self, upload: Upload) -> None:
        """The upload is finished (completed, aborted or gone)."""
        self.uploads.pop(upload.journal_id, None)
        if upload.journal_id:
            self.journal.multipart_ended(upload.journal_id)


@contextlib.asynccontextmanager
async def _released(slots: trio.Semaphore):
    """Release a slot taken before (``_take_slot``) when the block ends."""
    try:
        yield
    finally:
        slots.release()
