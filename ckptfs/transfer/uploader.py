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

The work is split among collaborators the uploader builds and holds: ``StoreCalls``
(store_calls.py: threads, retries, errors, health), shared by the ``PartSender``
(upload_parts.py: a put's data, its parts and streams, multipart uploads) and the
``Encoder`` (upload_encoding.py: one-PUT objects, compressed frames, manifests). Each is
handed what it uses when built; none calls back into the uploader.

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

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import trio

from ckptfs.blocks import BlockRef
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import ATTR, DELETE, MKDIR, MOVE, PUT, Journal, Op
from ckptfs.errors import NotFound
from ckptfs.objects import compression, integrity
from ckptfs.parts import PartSchedule
from ckptfs.store.base import ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer.store_calls import StoreCalls
from ckptfs.transfer.upload_encoding import Encoder
from ckptfs.transfer.upload_parts import PartSender
from ckptfs.transfer.upload_tasks import Stream, Task, Upload
from ckptfs.transfer.workers import StoreWorkers
from ckptfs.util.background import BackgroundThreads
from ckptfs.util.stats import Histogram, RateMeter

log = logging.getLogger(__name__)

RECHECK_MIN_S, RECHECK_MAX_S = 0.2, 2.0  # how often a held marker is asked about again


class PublishGate(Protocol):
    """What the uploader asks before it publishes a checkpoint marker (the model's ``MarkerGate``:
    model/gate.py): a marker waits until what it stands for is in the store, whichever node
    wrote it, held aside meanwhile so that the ops after it publish as usual."""

    def gated(self, op: Op) -> bool:
        """Whether ``op`` puts a checkpoint marker (by its key alone)."""
        ...

    async def clear(self, task: Task, earlier: Iterable[Op]) -> bool:
        """Whether the marker may be published now; ``earlier``: this node's ops committed before
        it and still pending."""
        ...

    def drops(self, op: Op, held: Op, published: bool) -> str | None:
        """Why ``op`` (submitted, or just ``published``) makes the held marker ``held`` obsolete."""
        ...

    def forget(self, seq: int) -> None:
        """The op ``seq`` is published, dropped or cancelled."""
        ...


class Uploader:
    """The op queue, its publication in commit order, journal compaction and figures. A put's
    data before and at publication is its ``PartSender``'s (``sender``), how objects are encoded
    its ``Encoder``'s (``encoder``); both make their store calls through ``calls``."""

    def __init__(
        self,
        store: ObjectStore,
        cache: Cache,
        journal: Journal,
        part_size: int,
        concurrency: int,
        compress_level: int | None = None,
        health: StoreHealth | None = None,
        retained_ops: Callable[[], list[Op]] = list,
        gate: PublishGate | None = None,
        yield_to: Callable[[], bool] | None = None,
        workers: StoreWorkers | None = None,
    ):
        self.store = store
        self.cache = cache
        self.journal = journal
        self.part_size = part_size
        limits = store.limits
        # Each file's part layout (ckptfs/parts.py): uniform up to max_parts parts, grown beyond.
        self.schedule = PartSchedule(
            part_size, limits.max_parts, limits.max_part_size, limits.max_object_size
        )
        # (the daemon shares one StoreHealth with the fetcher and the namespace)
        health = health if health is not None else StoreHealth()
        self.calls = StoreCalls(store, BackgroundThreads(concurrency + 2, "ckptfs-store"), health)
        hash_threads = trio.CapacityLimiter(2)
        self.encoder = Encoder(
            self.calls,
            part_size,
            hash_threads,
            # --compress: parts go up as zstd frames (compression.py), compressed in the store threads
            compression.Codec(compress_level) if compress_level else None,
            compression.Governor(behind=lambda: cache.waiters > 0),
        )
        self.sender = PartSender(
            self.calls,
            self.encoder,
            cache,
            journal,
            self.schedule,
            concurrency,
            hash_threads,
            yield_to,
            workers,
        )
        self.pending: dict[int, Task] = {}  # by seq; insertion order is sequence order
        self.progress = trio.Event()  # set (and replaced) whenever an op is done
        self.new_work = trio.Event()
        self.committed_bytes = 0  # put ops submitted (commits, and those resumed at mount)
        self.clear_since = time.monotonic()  # the last moment nothing committed was pending
        self.durable_files = 0
        self.nursery: trio.Nursery | None = None
        self.retained_ops = retained_ops  # ops the journal keeps besides pending ones
        self.gate = gate
        self.held: dict[int, Task] = {}  # markers waiting for files of other nodes (or of ours held)
        self.held_added = trio.Event()
        self.dropped: deque[dict] = deque(maxlen=20)  # markers given up: what and why (status)
        self.dropped_count = 0

    # -- the collaborators' state, under the names status and the daemon use ---------------------
    @property
    def health(self) -> StoreHealth:
        return self.calls.health

    @health.setter
    def health(self, health: StoreHealth) -> None:
        self.calls.health = health

    @property
    def codec(self) -> compression.Codec | None:
        """--compress's codec, the encoder's (None: parts go up as they are)."""
        return self.encoder.codec

    @codec.setter
    def codec(self, codec: compression.Codec | None) -> None:
        self.encoder.codec = codec

    @property
    def retries(self) -> int:
        return self.calls.retries

    @property
    def errors(self) -> deque[dict]:
        return self.calls.errors

    @property
    def call_latency(self) -> Histogram:
        return self.calls.call_latency

    @property
    def part_slots(self) -> trio.Semaphore:
        return self.sender.part_slots

    @property
    def stored_bytes(self) -> int:
        return self.encoder.stored_bytes

    @property
    def upload_rate(self) -> RateMeter:
        return self.sender.upload_rate

    @property
    def uploaded_bytes(self) -> int:
        return self.sender.uploaded_bytes

    # -- called by the namespace (no awaits) -----------------------------------------
    def submit(
        self,
        op: Op,
        content: Content | None = None,
        on_durable: Callable[[Op], None] | None = None,
        stream: Stream | None = None,
        stamps: list[int] | None = None,
    ) -> Task:
        if self.held:
            self._drop_obsolete(op, published=False)
        task = Task(op, content.hold() if content is not None else None, on_durable)
        # (a streamed file whose grown parts were evicted keeps that layout: op.grown)
        task.layout = self.schedule.layout(op.size, op.grown)
        task.stream, task.stamps = stream, stamps or []
        if op.upload:  # parts evicted from the cache live in this upload: it must be the one
            self.sender.uploads[op.upload[2]] = Upload(*op.upload)
        if not self.pending:
            self.clear_since = time.monotonic()
        self.pending[op.seq] = task
        if op.kind == PUT:
            self.committed_bytes += op.size
            task.preparing = True
            assert self.nursery is not None  # set in run, before any submit
            self.nursery.start_soon(self.sender.prepare, task)
        else:
            task.ready.set()
        self.new_work.set()
        return task

    def cancel(self, seq: int, reason: str = "replaced") -> bool:
        """Drop a pending op; False if it is already being published (or gone). A held marker
        dropped so is said once in the log and in status, with ``reason`` (the namespace
        cancels a pending put when its file is written again, truncated or taken out)."""
        task = self.pending.get(seq)
        if task is None or task.publishing:
            return False
        del self.pending[seq]
        if self.held.pop(seq, None) is not None:
            self.dropped_count += 1
            self.dropped.append({"marker": task.op.key, "reason": reason, "at": time.time()})
            log.warning("marker %s will not be published: %s", task.op.key, reason)
        if self.gate is not None:  # (a marker described, held or not)
            self.gate.forget(seq)
        task.cancelled = True
        task.scope.cancel()
        task.ready.set()
        self.journal.cancel(seq)
        if task.content is not None and task.content.remote:
            task.content.orphaned = True  # its evicted parts go with the upload
        if not task.preparing:  # otherwise the preparation task cleans up once its threads are done
            if task.upload is not None:
                assert self.nursery is not None  # set in run: a pending task was submitted after it
                self.nursery.start_soon(self.sender.abort, task.upload)
                task.upload = None
            self.sender.finish(task)
        self._signal_progress()
        return True

    def retarget(self, seq: int, key: str) -> bool:
        """Point a pending put at a new key (a rename of a file not yet durable)."""
        task = self.pending.get(seq)
        if task is None or task.publishing or task.op.upload:
            return False  # (evicted parts cannot move to another key's upload: a move follows)
        if any(later > seq and key in (t.op.key, t.op.src) for later, t in self.pending.items()):
            return False  # a later op there (a move of another file to it) would land on top: a move follows
        task.op.key = key
        task.op.replaces = ""  # (the old key's object goes with its delete, manifest and all)
        self.journal.retarget(seq, key)
        return True

    def open_stream(self, key: str) -> Stream:
        return self.sender.open_stream(key)

    def stream_part(self, stream: Stream, index: int, ref: BlockRef, stamp: int) -> None:
        """Hand a full block of a file still being written to its stream (its part goes once
        every block of it is handed over)."""
        self.sender.stream_part(stream, index, ref, stamp)

    def abandon(self, stream: Stream) -> None:
        """The file was closed without a commit (or unlinked): abort its upload."""
        self.sender.abandon(stream)

    # -- queries ------------------------------------------------------------------------
    def pending_bytes(self, up_to: int | None = None) -> int:
        return sum(
            max(t.op.size - t.bytes_sent, 0)
            for s, t in self.pending.items()
            if t.op.kind == PUT and (up_to is None or s <= up_to)
        )

    def holds_cache(self) -> bool:
        """Whether a pending upload still holds cache blocks (its end will free some)."""
        return any(t.content is not None for t in self.pending.values()) or any(
            s.sending for s in self.sender.streams
        )

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
        puts = [
            t.op.size for s, t in self.pending.items() if t.op.kind == PUT and (up_to is None or s <= up_to)
        ]
        return len(puts), sum(puts)

    def last_seq(self) -> int:
        return self.journal.next_seq - 1

    async def wait_durable(self, up_to: int, held_counts: Callable[[Op], bool] | None = None) -> None:
        """Return once every op with seq <= up_to is in the store. ``held_counts``: which held
        markers count (a sync of some paths does not wait for an older step's marker held
        elsewhere); None: all of them."""
        while True:
            for seq, task in self.pending.items():
                if seq > up_to:
                    return
                if seq not in self.held or held_counts is None or held_counts(task.op):
                    break
            else:
                return
            await self.progress.wait()

    # -- the workers --------------------------------------------------------------------
    async def run(
        self,
        open_uploads: Sequence[tuple[str, str, str | None]] = (),
        *,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        if self.sender.workers is not None:
            self.sender.workers.start_soon()
        async with trio.open_nursery() as nursery:
            self.nursery = self.sender.nursery = nursery
            for journal_id, key, upload_id in open_uploads:  # left open by a dead daemon: start over
                if upload_id is None:  # it died while creating one: find it by its key
                    nursery.start_soon(self.sender.sweep, key, journal_id)
                else:
                    nursery.start_soon(self.sender.abort, Upload(key, upload_id, journal_id))
            nursery.start_soon(self._publisher)
            if self.gate is not None:
                nursery.start_soon(self._recheck_held)
            task_status.started()

    async def _publisher(self) -> None:
        while True:
            task = self._next_task()
            if task is None:
                self.new_work = trio.Event()
                await self.new_work.wait()
                continue
            seq = task.op.seq
            await task.ready.wait()
            if task.cancelled or self.pending.get(seq) is not task:
                continue
            if self.gate is not None and self.gate.gated(task.op):
                cleared = await self.gate.clear(task, self._earlier(seq))
                if task.cancelled or self.pending.get(seq) is not task:
                    continue
                if not cleared:  # aside: the ops after it go on
                    self.held[seq] = task
                    self.held_added.set()
                    self._signal_progress()  # (a sync of other paths need not wait for it)
                    continue
            await self._publish_task(seq, task)

    def _next_task(self) -> Task | None:
        """The first pending op that is not a held marker nor about a key one of them holds."""
        if not self.held:
            return next(iter(self.pending.values()), None)
        blocked: set[str] = set()
        for seq, task in self.pending.items():
            if seq in self.held or task.op.key in blocked or (task.op.src and task.op.src in blocked):
                blocked.update(k for k in (task.op.key, task.op.src) if k)
                continue
            return task
        return None

    def _earlier(self, seq: int) -> list[Op]:
        return [t.op for s, t in self.pending.items() if s < seq]

    async def _recheck_held(self) -> None:
        """Ask about each held marker again, less and less often while none clears."""
        assert self.gate is not None
        delay = RECHECK_MIN_S
        while True:
            if not self.held:
                self.held_added = trio.Event()
                await self.held_added.wait()
            with trio.move_on_after(delay):
                self.held_added = trio.Event()
                await self.held_added.wait()  # (a new held marker: the backoff starts again)
                delay = RECHECK_MIN_S
                continue
            cleared = False
            for seq, task in sorted(self.held.items()):
                if self.held.get(seq) is not task or self.pending.get(seq) is not task:
                    continue
                if await self.gate.clear(task, self._earlier(seq)) and self.held.get(seq) is task:
                    await self._publish_task(seq, task)
                    cleared = True
            delay = RECHECK_MIN_S if cleared else min(delay * 2, RECHECK_MAX_S)

    async def _publish_task(self, seq: int, task: Task) -> None:
        task.publishing = True
        await self.calls.until_done(task, self._publish)
        del self.pending[seq]
        self.journal.done(seq)
        if self.journal.should_compact():
            self._compact()
        if task.op.kind == PUT:
            self.durable_files += 1
        callback = task.on_durable
        self.sender.finish(task)
        if callback is not None:
            callback(task.op)
        if self.gate is not None:
            was_held = self.held.pop(seq, None) is not None
            if self.held:
                self._drop_obsolete(task.op, published=True)
            self.gate.forget(seq)
            if was_held:
                log.info("marker %s published", task.op.key)
                self.new_work.set()  # (ops about its key may go now)
        self._signal_progress()

    def _drop_obsolete(self, op: Op, published: bool) -> None:
        """Held markers that ``op`` (submitted or just published) leaves nothing to do: dropped,
        the journal forgets them; said once in the log and in status."""
        assert self.gate is not None
        for seq, held in list(self.held.items()):
            reason = self.gate.drops(op, held.op, published)
            if reason is not None and not held.publishing:
                self.cancel(seq, reason)
        self.new_work.set()

    async def _publish(self, task: Task) -> None:
        op = task.op
        if op.kind == PUT:
            replaced = await self.encoder.replaced_manifest(task)
            if task.multipart:
                await self.sender.publish_multipart(task)
            else:
                await self.sender.publish_one(task)
            if replaced:  # the object it replaced is gone: so is the need for its manifest
                await self.encoder.drop_manifest(op.key, replaced)
        elif op.kind == DELETE:
            # A multipart object's manifest goes with it (after it: never an object without one).
            info = None if op.small else await self.calls.call(op.key, self.store.head, op.key)
            await self.calls.call(op.key, self.store.delete, op.key)
            upload_id = info.metadata.get(integrity.UPLOAD_META) if info is not None else None
            if upload_id and info is not None and info.metadata.get(integrity.MANIFEST_META):
                await self.encoder.drop_manifest(op.key, upload_id)
        elif op.kind == MKDIR:
            await self.calls.call(op.key, self.store.put, op.key, b"", dict(op.meta))
        elif op.kind == ATTR:
            try:
                await self.calls.call(op.key, self.store.set_metadata, op.key, op.meta)
            except NotFound:
                log.info("attributes of %s: no longer in the store", op.key)
        elif op.kind == MOVE:
            try:
                await self.calls.call(op.key, self.store.copy, op.src, op.key)
            except NotFound:
                # Replayed after a crash between copy and delete, or the source is gone.
                if await self.calls.call(op.key, self.store.head, op.key) is None:
                    log.warning("move %s -> %s: the source is not in the store", op.src, op.key)
            await self.calls.call(op.src, self.store.delete, op.src)

    # -- shutdown ----------------------------------------------------------------------------
    def abandon_calls(self) -> None:
        """Shutdown begins: store calls in flight are no longer waited for (see background.py).
        Safe because every store call is idempotent or journaled before it is made (a multipart
        intent, a pending op): what an abandoned call does or not, the next mount redoes or sweeps."""
        self.calls.threads.abandon()

    def close(self) -> None:
        """Shutdown ends (the trio loop is gone): abandoned calls may no longer read the cache,
        which is closed next. (They never touch the journal: only the trio loop writes it.)"""
        self.sender.close()
        if self.sender.workers is not None:
            self.sender.workers.close()

    # -- helpers ---------------------------------------------------------------------------
    def _signal_progress(self) -> None:
        self.progress.set()
        self.progress = trio.Event()

    def _compact(self) -> None:
        open_uploads: list[tuple[str, str, str | None]] = [
            (u.journal_id, u.key, u.upload_id) for u in self.sender.uploads.values()
        ]
        open_uploads += [(i, key, None) for i, key in self.sender.creating.items()]
        ops = [t.op for t in self.pending.values()] + self.retained_ops()
        # (None: an upload still being created; the journal reads it back as "find it by its key")
        self.journal.compact(sorted(ops, key=lambda op: op.seq), open_uploads)
