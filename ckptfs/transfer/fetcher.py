"""Reads of data that is not cached: ranged GETs of whole blocks into the cache.

A block is fetched once however many readers want it at the same time: the first
one starts the GET, the others wait on its event. Fetched blocks become part of
the file's cached content, so the next read is local. A reader going through a
file sequentially gets the next blocks fetched ahead, in parallel, in the background.
``warm`` (``ckptfs warmup``) fetches every missing block of a set of files the same way.

Every fetched range is checked against its object's part checksums (``integrity``) before a
byte enters the cache: the range is widened to whole parts, the checksums come from the GET's
own metadata (a one-PUT file) or from the object's manifest (fetched once per version). A
mismatch is fetched again (a fault on the wire); one that persists fails the read with EIO and
is kept for ``ckptfs status`` (``integrity_errors``). Objects with no checksums (written by
other tools) are read unchecked and say so (``user.ckptfs.verified``). The checks are part of
the fetch, in the same class: every fetch goes through them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import humanfriendly
import outcome
import trio

from ckptfs.blocks import BlockRef, n_blocks
from ckptfs.cache.arena import in_pages
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.errors import FsError, NotFound, StoreError, StoreUnreachable
from ckptfs.objects import compression, integrity
from ckptfs.objects.integrity import Checksums, IntegrityError
from ckptfs.parts import PartSchedule
from ckptfs.store.base import ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer import retry
from ckptfs.transfer.workers import StoreWorkers, WorkerGone
from ckptfs.util.byte_budget import ByteBudget
from ckptfs.util.single_flight import SingleFlight
from ckptfs.util.stats import LATENCY_BUCKETS, Histogram

log = logging.getLogger(__name__)

READ_ATTEMPTS = retry.READ_ATTEMPTS  # a reader waits through short glitches, not through an outage
MOVE_WAIT = 30.0  # how long a reader that got NotFound waits for content.key to follow a move
VERIFY_ATTEMPTS = 3  # fetches of a range whose bytes do not match their checksum, before EIO
# Files smaller than this are read from the store even in a cluster: a peer would save few bytes
# for the HEAD (the checksums to check its bytes against) and the round trip it costs.
PEER_MIN_SIZE = 1 << 20
# A store worker fetches a range into cache slots allocated before its GET: at most this many
# blocks at once (a grown layout's larger parts go through the daemon's threads, as before).
LANDED_BLOCKS = 4


class _ShortRead(Exception):
    """The store sent fewer bytes than asked for (asked again at once, see retry.reading)."""

    def __init__(self, got: int):
        super().__init__(f"short read: {got} bytes")
        self.got = got


class PeerSource(Protocol):
    """Other nodes of a cluster that may hold a part (cluster/peers.py). Whatever they send is
    checked here against the checksums this node read from the store, as bytes from the store
    are; ``mismatch`` tells it a peer's bytes did not match."""

    def route(self, key: str, tag: str, begin: int) -> tuple[object, bool] | None: ...

    async def take(
        self, peer, fetch: bool, key: str, size: int, tag: str, begin: int, span: int, timeout: float | None
    ) -> bytearray | None: ...

    def mismatch(self, owner, key: str, why: str) -> None: ...


class Fetcher:
    """Ranged GETs of uncached blocks into the cache, and the checks of what they bring: which
    part checksums an object is read against (its GET's metadata for a one-PUT file, its manifest
    for a multipart one, loaded once per upload however many readers ask), and what a range that
    does not match them does (fetched again, then EIO, kept for ``ckptfs status``)."""

    def __init__(
        self,
        store: ObjectStore,
        cache: Cache,
        concurrency: int,
        health: StoreHealth | None = None,
        read_timeout: float | None = None,
        peers: PeerSource | None = None,
        workers: StoreWorkers | None = None,
    ):
        self.store = store
        # Processes that GET, check and write a range into its cache slots themselves
        # (transfer/workers.py); None: this daemon's threads do (and always for a first read,
        # a compressed or an unchecked object, a part of more than LANDED_BLOCKS blocks).
        self.workers = workers
        self.landing_bytes = 0  # of ranges being fetched by workers into slots taken before their GET
        self.cache = cache
        self.threads = trio.CapacityLimiter(concurrency)
        # Fetched blocks held in memory at once, GET to cache (one may wait for cache space):
        # without it, many readers' read-ahead could hold any number of part-sized bodies.
        self.bodies = trio.Semaphore(concurrency)
        # ... and their bytes: a part of a grown layout (ckptfs/parts.py) is fetched whole, up to
        # 4 GiB: ``concurrency`` blocks' worth at once, or one of the largest parts alone.
        limits = store.limits
        schedule = PartSchedule(
            cache.block_size, limits.max_parts, limits.max_part_size, limits.max_object_size
        )
        self.body_bytes = ByteBudget(max(concurrency * cache.block_size, schedule.largest_part))
        self.inflight: dict[tuple[int, int], trio.Event] = {}
        # Parts asked of a peer: their own bound, so a node waiting on a peer never holds what
        # its own fetches for that peer's requests need (two nodes asking each other would wait
        # for each other), and their own single flight, which a fetch for a peer passes by.
        self.peers = peers
        self.peer_bodies = trio.Semaphore(concurrency)
        self.peer_body_bytes = ByteBudget(self.body_bytes.limit)
        self.asking: dict[tuple[int, int], trio.Event] = {}
        self._learning = SingleFlight()  # HEADs for the checksums a peer's bytes are checked against
        self.fetched_bytes = 0
        self.store_bytes = 0  # bytes the store sent (GET bodies, compressed as stored)
        self.peer_bytes = 0  # bytes of parts peers sent that matched their checksums
        self.get_latency = Histogram(LATENCY_BUCKETS)  # each ranged GET that answered
        self.retries = 0  # GETs tried again after a transient failure
        self.read_ahead = concurrency  # blocks fetched ahead of a sequential reader
        self.nursery: trio.Nursery | None = None
        self.health = health or StoreHealth()  # the daemon shares one with the uploader and the namespace
        self.read_timeout = read_timeout  # see MountConfig.read_timeout; None: wait for the store
        self.integrity_errors: deque[dict] = deque(maxlen=20)  # reads failed: bytes never matched
        self.integrity_retries = 0  # ranges that did not match once and were fetched again
        self.unverified_reads = 0  # ranges of objects with no checksums, read unchecked
        self._logged: set[tuple[str, str]] = set()
        self._manifests: dict[str, trio.Event] = {}  # manifest loads in flight, by upload id

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Host the background read-ahead tasks."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def prefetch(self, content: Content, first: int) -> None:
        """Start fetching the blocks after ``first`` that are neither cached nor on their way."""
        if self.nursery is None or not content.in_store:
            return
        last = min(len(content.blocks), first + self.read_ahead)
        # A part of a grown layout is fetched whole: read ahead into one only if it takes at most
        # a quarter of the cache, or its blocks could push out the part being read (fetched
        # again, and again: the cache evicts a file's clean blocks in no particular order).
        room = sum(tier.budget for tier in self.cache.tiers) // 4
        for index in range(first, last):
            slot = self._slot(content, index)
            if content.blocks[index] is None and slot not in self.inflight and slot not in self.asking:
                if self._fetch_size(content, index) > max(room, self.cache.block_size):
                    break
                self.nursery.start_soon(self._prefetch_block, content.hold(), index)

    async def _prefetch_block(self, content: Content, index: int) -> None:
        try:
            await self._fetch_block(content, index)
        except Exception as exc:  # the reader fetches it again itself and sees any error
            log.debug("read-ahead of %s block %d failed: %s", content.key, index, exc)
        finally:
            content.release()

    async def fill(self, content: Content, indexes: list[int], from_peers: bool = True) -> None:
        """Make sure the given blocks of ``content`` are cached. ``from_peers=False``: from the
        store only (what a peer asked this node for: an owner never forwards)."""
        if not indexes:
            return
        if len(indexes) == 1:
            await self._fetch_block(content, indexes[0], from_peers)
            return
        async with trio.open_nursery() as nursery:
            for index in indexes:
                nursery.start_soon(self._fetch_block, content, index, from_peers)

    async def fill_from_store(self, content: Content, indexes: list[int]) -> None:
        await self.fill(content, indexes, from_peers=False)

    async def warm(
        self, contents: list[Content], progress: Callable[[dict], Awaitable[None]], interval: float = 0.5
    ) -> dict:
        """Fetch every block of ``contents`` that is not cached (``ckptfs warmup``).

        Blocks go in file order, a bounded number at a time (the GETs themselves share the
        readers' thread limiter), through ``_fetch_block``: a block a reader is already fetching
        is waited for, not fetched again. Contents not in the store (local only) are fully
        cached already. ``progress`` gets {"done_bytes", "total_bytes", "files", "files_done"}
        every ``interval`` seconds. The caller holds the contents and keeps them from eviction
        until this returns: a file warmed early must not make room for the ones after it.
        Raises FsError: ENOSPC when the cache cannot hold them all, or the store's error.
        """
        total = sum(c.size for c in contents)
        if not self._fits(contents):
            capacity = sum(tier.budget for tier in self.cache.tiers)
            raise FsError(
                errno.ENOSPC,
                f"{_fmt(total)} asked but the cache holds at most {_fmt(capacity)} "
                "(--ram-cache + --cache-size): warm fewer files or mount with a larger cache",
            )
        todo = [c.missing(0, c.size) for c in contents]
        left = [len(indexes) for indexes in todo]
        missing = sum(c.block_length(i) for c, indexes in zip(contents, todo) for i in indexes)
        state = {
            "done_bytes": total - missing,
            "total_bytes": total,
            "files": len(contents),
            "files_done": left.count(0),
        }
        failure: BaseException | None = None
        # blocks on their way at once (total_tokens: the int ``concurrency`` given to __init__)
        window = trio.Semaphore(2 * cast(int, self.threads.total_tokens))

        async def one(blocks: trio.Nursery, i: int, index: int) -> None:
            nonlocal failure
            try:
                await self._fetch_block(contents[i], index)
            except (OSError, FsError) as exc:
                failure = failure or exc
                blocks.cancel_scope.cancel()
                return
            finally:
                window.release()
            state["done_bytes"] += contents[i].block_length(index)
            left[i] -= 1
            if not left[i]:
                state["files_done"] += 1

        async def report() -> None:
            while True:
                await progress(dict(state))
                await trio.sleep(interval)

        async with trio.open_nursery() as outer:
            outer.start_soon(report)
            async with trio.open_nursery() as blocks:
                for i, indexes in enumerate(todo):
                    for index in indexes:
                        await window.acquire()
                        blocks.start_soon(one, blocks, i, index)
            outer.cancel_scope.cancel()
        if failure is not None:
            if isinstance(failure, OSError) and failure.errno == errno.ENOSPC:
                raise FsError(
                    errno.ENOSPC,
                    f"the cache is full of data not yet in the store or open for writing "
                    f"(warmed {_fmt(state['done_bytes'])} of {_fmt(total)}): "
                    "raise --ram-cache/--cache-size or warm fewer files",
                ) from None
            raise FsError(getattr(failure, "errno", None) or errno.EIO, str(failure)) from None
        # A file closed by a reader meanwhile is clean data again, and may have been evicted.
        lost = sum(c.block_length(i) for c in contents if c.holders > 0 for i in c.missing(0, c.size))
        if lost:
            raise FsError(
                errno.ENOSPC,
                f"{_fmt(lost)} of the {_fmt(total)} warmed was evicted again to make room "
                "for other data: raise --ram-cache/--cache-size or warm fewer files",
            )
        await progress(dict(state))
        return {"files": len(contents), "total_bytes": total, "fetched_bytes": missing}

    def _part_of(self, content: Content, index: int) -> tuple[int, int]:
        """The bytes a fetch of block ``index`` gets: its whole part where the checksums are
        known (a part of a grown layout holds many blocks), else the block."""
        start, length = index * self.cache.block_size, content.block_length(index)
        checks = cast("Checksums | None", content.checksums)
        return checks.span(start, length) if checks is not None else (start, length)

    def _slot(self, content: Content, index: int) -> tuple[int, int]:
        """What fetches are single-flight by: the first block of the part they get."""
        return (id(content), self._part_of(content, index)[0] // self.cache.block_size)

    def _fetch_size(self, content: Content, index: int) -> int:
        return self._part_of(content, index)[1]

    async def _fetch_block(self, content: Content, index: int, from_peers: bool = True) -> None:
        ask_peers = (
            from_peers and self.peers is not None and content.in_store and content.size >= PEER_MIN_SIZE
        )
        while content.blocks[index] is None:
            slot = self._slot(content, index)
            event = self.inflight.get(slot)
            if event is None and from_peers:
                event = self.asking.get(slot)
            if event is not None:  # someone is fetching it: wait, then look again
                await event.wait()
                continue
            if ask_peers:  # once; then (the block still missing) from the store
                ask_peers = False
                if content.checksums is None:  # (from the store: what a peer's bytes must match)
                    await self._learning.run(id(content), lambda: self._learn_checksums(content))
                    ask_peers = content.checksums is not None  # (and the slot is now the part's)
                else:
                    await self._ask_peer(content, index, slot)
                continue
            event = self.inflight[slot] = trio.Event()
            try:
                async with self.bodies, self.body_bytes.take(self._fetch_size(content, index)):
                    await self._download_in_time(content, index)
            finally:
                del self.inflight[slot]
                event.set()
            if content.blocks[index] is None and content.holders <= 0:
                # _attach keeps no block for a content nobody holds: fetching again would spin
                # forever (seen once in the model test: a read of a content whose holders had
                # dropped to 0 while the kernel still read it). Fail the read instead.
                log.error(
                    "%s: block %d fetched for a version no open file holds (holders %d): read fails",
                    content.key,
                    index,
                    content.holders,
                )
                raise FsError(errno.EIO, f"{content.key}: this version is no longer held open")

    async def _ask_peer(self, content: Content, index: int, slot: tuple[int, int]) -> None:
        """Take the part holding block ``index`` from the peer that owns it (or, if this node
        does, from the peer that may hold it), checked; when the peer gives no matching bytes
        the block stays missing and the caller reads it from the store."""
        peers = self.peers
        assert peers is not None and content.key is not None
        checks = cast("Checksums | None", content.checksums)
        if checks is None or not checks.verified:
            return  # nothing to check a peer's bytes against
        tag = checks.version
        begin, span = checks.span(index * self.cache.block_size, content.block_length(index))
        route = peers.route(content.key, tag, begin)
        if route is None:
            return
        owner, fetch = route
        event = self.asking[slot] = trio.Event()
        try:
            async with self.peer_bodies, self.peer_body_bytes.take(span):
                data = await peers.take(
                    owner, fetch, content.key, content.size, tag, begin, span, self.read_timeout
                )
                if data is None:
                    return
                try:
                    await trio.to_thread.run_sync(checks.check, begin, data, limiter=self.threads)
                except IntegrityError as exc:
                    peers.mismatch(owner, content.key, str(exc))
                    return
                if content.checksums != checks:
                    return  # (the version changed under us: read it from the store)
                self.peer_bytes += len(data)
                await self._attach(content, begin, data, index)
        finally:
            del self.asking[slot]
            event.set()

    async def _learn_checksums(self, content: Content) -> None:
        with contextlib.suppress(FsError):  # (then the store serves the read, and says why it fails)
            await self.checksums_of(content)

    async def _download_in_time(self, content: Content, index: int) -> None:
        """``_download``, given up with EIO once the store has been in trouble for ``read_timeout``
        seconds of this read: a reader never waits out a whole outage (the GETs in flight are
        abandoned: their threads touch nothing shared)."""
        if self.read_timeout is None or self.nursery is None:
            return await self._download(content, index)
        watch = trio.CancelScope()
        with trio.CancelScope() as download:
            self.nursery.start_soon(self._give_up_in_an_outage, download, watch, time.time())
            try:
                await self._download(content, index)
            finally:
                watch.cancel()
        if download.cancelled_caught:
            message = (
                f"{content.key}: the store has failed or not answered for {self.read_timeout:g} s "
                "(--read-timeout); the read fails, later reads try again"
            )
            self._log_once(content.key or "", "read timeout", logging.ERROR, "%s", message)
            self.health.failed("read", content.key or "", f"EIO: {message}")
            raise StoreUnreachable(errno.EIO, message)

    async def _give_up_in_an_outage(
        self, download: trio.CancelScope, watch: trio.CancelScope, started: float
    ) -> None:
        with watch:
            while True:
                await trio.sleep(0.25)
                since = self.health.trouble_since()
                read_timeout = self.read_timeout
                assert read_timeout is not None  # started only with a read timeout (_download_in_time)
                if since is not None and time.time() - max(since, started) >= read_timeout:
                    download.cancel()
                    return

    async def _download(self, content: Content, index: int) -> None:
        bs = self.cache.block_size
        start, length = index * bs, content.block_length(index)
        attempt = 0
        if content.checksums is None:
            await self._known_compressed(content)
        for _ in range(2 * VERIFY_ATTEMPTS):  # (a changing object must not keep us here)
            # (Content types checksums ``object``: it holds integrity.Checksums or None)
            checks = cast("Checksums | None", content.checksums)
            begin, span = checks.span(start, length) if checks is not None else (start, length)
            parts = self._landable(checks, begin, span, content.landing is not None)
            if parts is not None:
                try:
                    if await self._land(content, index, begin, span, parts):
                        return
                    continue  # the object changed under the GET: its checksums again
                except IntegrityError as exc:
                    attempt += 1
                    content.checksums = None
                    self._mismatch(content, index, exc, final=attempt == VERIFY_ATTEMPTS)
                    continue
            if checks is not None and checks.compressed:  # the frames holding those parts
                stored, stored_length, first, last = checks.stored_range(begin, span)
                data, metadata = await self._get(content, stored, stored_length)
            else:
                data, metadata = await self._get(content, begin, span)
            try:
                fresh = await self._checksums(content, metadata)
                layout = checks.frames if checks is not None else ()
                if fresh.span(start, length) != (begin, span) or layout != fresh.frames:
                    continue  # first fetch of this object: the parts (or frames) cover another range
                if not fresh.compressed and metadata.get(compression.FORMAT_META) == compression.FORMAT:
                    raise IntegrityError(
                        "stored compressed, but its frames are not recorded: it cannot be decoded"
                    )
                if fresh.compressed:
                    data = await trio.to_thread.run_sync(
                        fresh.decompress, first, last, data, limiter=self.threads
                    )
                if fresh.verified:
                    await trio.to_thread.run_sync(fresh.check, begin, data, limiter=self.threads)
                break
            except IntegrityError as exc:
                attempt += 1
                content.checksums = None  # (a manifest bent on the wire is read again too)
                self._mismatch(content, index, exc, final=attempt == VERIFY_ATTEMPTS)
        else:
            self._mismatch(content, index, IntegrityError("the object kept changing while read"), final=True)
        if not fresh.verified:
            self.unverified_reads += 1
        await self._attach(content, begin, data, index)

    # -- a range a store worker fetches, checks and writes into the cache itself -----------------
    def _landable(
        self, checks: Checksums | None, begin: int, span: int, into_file: bool = False
    ) -> list[tuple[int, int, str]] | None:
        """The parts a store worker checks a fetch of [begin, begin + span) against, where one
        can do it: the checksums known and plain (not frames), a range of a few blocks.
        ``into_file``: the blocks land in a file of their own (``Content.landing``), not slots."""
        if self.workers is None or not self.workers.usable or checks is None or checks.compressed:
            return None
        if span > LANDED_BLOCKS * self.cache.block_size:
            return None
        # Slots taken before their GET: a quarter of the cache at most (as ``_attach`` keeps),
        # so fetches ahead of a reader never hold what the reader's own blocks need.
        room = max(self.cache.block_size, sum(tier.budget for tier in self.cache.tiers) // 4)
        if not into_file and self.landing_bytes + span > room:
            return None
        return checks.parts_in(begin, span)

    async def _land(
        self, content: Content, wanted: int, begin: int, span: int, parts: list[tuple[int, int, str]]
    ) -> bool:
        """Fetch [begin, begin + span) through a store worker, straight into fresh cache slots
        for the blocks it covers whole that are missing, then attach them. False when the
        object's checksums changed under the GET (nothing attached: the caller looks again);
        IntegrityError when a part did not match (nothing was written)."""
        bs = self.cache.block_size
        self.landing_bytes += span
        landing = _Landing(self.cache, lambda: self._landed(span))
        try:
            # (the blocks of the range already here stay while the others are allocated)
            with content.reading(begin, span):
                index = n_blocks(begin, bs)
                while (
                    index < len(content.blocks) and index * bs + content.block_length(index) <= begin + span
                ):
                    if content.blocks[index] is None:
                        landing.refs[index] = await self.cache.alloc_for(content, index)
                    index += 1
            blocks = []
            for i, ref in landing.refs.items():
                fd, pos, _ = self.cache.locate(ref, 0)
                blocks.append((fd, pos, i * bs - begin, content.block_length(i)))
            try:
                answer, metadata = await self._get(content, begin, span, (landing, parts, blocks))
            except _NoWorkers:
                return False  # (the caller looks again, and reads through its threads)
            fresh = await self._checksums(content, metadata)
            if (
                fresh.span(begin, span) != (begin, span)
                or fresh.compressed
                or fresh.parts_in(begin, span) != parts
            ):
                return False
            if metadata.get(compression.FORMAT_META) == compression.FORMAT:
                raise IntegrityError(
                    "stored compressed, but its frames are not recorded: it cannot be decoded"
                )
            if "mismatch" in answer:
                at = begin + answer["mismatch"]
                raise IntegrityError(f"the part at byte {at} does not match its checksum")
            for i, ref in landing.take().items():
                self.cache.fit(ref, content.block_length(i))
                if content.blocks[i] is None and content.holders > 0:
                    content.blocks[i] = ref
                else:  # raced, or the content was dropped meanwhile
                    self.cache.decref(ref)
            self.fetched_bytes += span
            return True
        finally:
            landing.release()

    def _landed(self, span: int) -> None:
        self.landing_bytes -= span

    async def _by_worker(
        self, key: str, start: int, length: int, landed: tuple
    ) -> tuple[dict, dict[str, str]]:
        """One GET by a store worker into the landing's slots. The worker may write them until
        it answers, so the call runs in a task of its own that holds them until then: a reader
        that gives up (interrupted, timed out) does not free slots a worker still writes."""
        landing, parts, blocks = landed
        assert self.workers is not None and self.nursery is not None
        if not self.workers.usable:
            raise _NoWorkers
        box: list = []
        done = trio.Event()
        fetch = self.workers.fetch

        async def call() -> None:
            landing.busy += 1
            try:
                # (abandoned only at shutdown, when the fetcher's nursery is cancelled: its slots
                # are then never freed, and the workers are killed before the cache closes)
                box.append(
                    await trio.to_thread.run_sync(
                        lambda: outcome.capture(fetch, key, start, length, parts, blocks),
                        limiter=self.threads,
                        abandon_on_cancel=True,
                    )
                )
            finally:
                done.set()
            landing.busy -= 1
            landing.release_if_done()

        self.nursery.start_soon(call)
        await done.wait()
        if not box:  # (its task was cancelled: the mount is shutting down)
            raise WorkerGone("the mount is shutting down")
        answer = box[0].unwrap()
        return answer, answer["metadata"]

    async def _attach(self, content: Content, begin: int, data: bytes | bytearray, wanted: int) -> None:
        """Put the blocks that ``data`` (checked bytes from ``begin``) covers whole into the cache.
        Block ``wanted`` (the one asked for) and those after it, up to a quarter of the cache, are
        kept from eviction meanwhile: a part of a grown layout holds many blocks, and the
        allocations of its later blocks must not evict its first ones (fetched again, forever)."""
        bs = self.cache.block_size
        room = max(bs, sum(tier.budget for tier in self.cache.tiers) // 4)
        with content.reading(wanted * bs, min(begin + len(data) - wanted * bs, room)):
            await self._attach_blocks(content, begin, data)

    async def _attach_blocks(self, content: Content, begin: int, data: bytes | bytearray) -> None:
        bs = self.cache.block_size
        end = begin + len(data)
        self.fetched_bytes += len(data)
        for index in range(n_blocks(begin, bs), len(content.blocks)):
            lo, length = index * bs, content.block_length(index)
            if lo + length > end:
                break
            if content.blocks[index] is not None:
                continue
            ref = await self.cache.alloc_for(content, index)
            try:  # (copied in a thread: 8 MiB on the trio thread would hold up every request)
                await trio.to_thread.run_sync(
                    self.cache.fill,
                    ref,
                    memoryview(data)[lo - begin : lo - begin + length],
                    limiter=self.threads,
                )
            except BaseException:
                self.cache.decref(ref)
                raise
            self.cache.fit(ref, length)
            if content.blocks[index] is None and content.holders > 0:
                content.blocks[index] = ref
            else:  # raced, or the content was dropped meanwhile
                self.cache.decref(ref)

    async def _get(
        self, content: Content, start: int, length: int, landed: tuple | None = None
    ) -> tuple[Any, dict[str, str]]:
        """Bytes [start, start + length) of ``content``'s object and the metadata of that answer,
        through transient failures and short bodies (retry.reading). ``landed``: a store worker
        GETs them into cache slots (``_land``), and the answer is the worker's, not the bytes."""
        key = content.key
        assert key is not None  # only contents in the store are fetched: they have a key

        async def once() -> tuple[Any, dict[str, str]]:
            nonlocal key
            key = content.key
            started = time.monotonic()
            data, metadata = await self._get_range(content, start, length, landed)
            self.get_latency.observe(time.monotonic() - started)
            got = data["got"] if landed is not None else len(data)
            self.store_bytes += got
            if got != length:
                raise _ShortRead(got)
            return data, metadata

        def retrying(exc: BaseException) -> None:
            self.retries += 1

        try:
            return await retry.call(lambda: retry.reading(retrying, at_once=(_ShortRead,)), once)
        except StoreError as exc:
            log.error("read of %s failed: %s", key, exc)
            self.health.failed("read", key, f"{_errno_name(exc.errno)}: {exc}")
            raise FsError(exc.errno, str(exc)) from exc
        except _ShortRead as short:
            message = f"{key}: short read from the store ({short.got} of {length} bytes)"
            self.health.failed("read", key, f"EIO: {message}")
            raise FsError(errno.EIO, message) from None

    def _fits(self, contents: list[Content]) -> bool:
        """Whether the cache can hold all of ``contents`` at once, at worst: a RAM slot takes a
        whole block, the disk the pages of one, and RAM may get the shortest blocks."""
        ram, disk = self.cache.tiers
        lengths = sorted(
            (in_pages(c.block_length(i)) for c in contents for i in range(len(c.blocks))), reverse=True
        )
        return sum(lengths[: max(0, len(lengths) - ram.budget // self.cache.block_size)]) <= disk.budget

    async def _get_range(
        self, content: Content, start: int, length: int, landed: tuple | None = None
    ) -> tuple[Any, dict[str, str]]:
        """A ranged GET of ``content``, following its key when a rename moves the object.

        The server-side move of a rename (copy, then delete) may run under the GET, which then
        answers NotFound. The namespace points content.key at the new key once the move is
        durable (after the delete), so on NotFound: read at the new key, waiting a while for
        the key to change if the move is still in flight.
        """
        key = content.key
        deadline = None
        while True:
            assert key is not None  # only contents in the store are fetched: they have a key
            try:
                # Abandoned when cancelled (shutdown, an interrupted reader): the thread touches no
                # shared state, its answer is dropped; the limiter still counts it until it ends.
                if landed is not None:
                    return await self._by_worker(key, start, length, landed)
                return await trio.to_thread.run_sync(
                    self.store.get_range_meta,
                    key,
                    start,
                    length,
                    limiter=self.threads,
                    abandon_on_cancel=True,
                )
            except NotFound as exc:
                if deadline is None:
                    deadline = trio.current_time() + MOVE_WAIT
                while content.key == key and trio.current_time() < deadline:
                    await trio.sleep(0.05)
                if content.key == key:
                    self.health.failed("read", key, "EIO: gone from the store")
                    raise FsError(errno.EIO, f"{key} is gone from the store") from exc
                log.info("%s moved to %s during a read: reading there", key, content.key)
                key = content.key

    # -- integrity checks ------------------------------------------------------------------------
    async def _known_compressed(self, content: Content) -> None:
        """Before the first fetch of an object the store layer already HEADed (a listing of a bucket
        with compressed objects): if it is compressed, learn its frames first, so that fetch asks
        for them and not for bytes of the stored stream that are of no use."""
        known = getattr(self.store, "known_metadata", None)
        metadata = known(content.key) if known is not None and content.key else None
        if metadata and metadata.get(compression.FORMAT_META) == compression.FORMAT:
            with contextlib.suppress(IntegrityError):  # (the fetch finds it again, and says so)
                await self._checksums(content, metadata)

    async def _checksums(self, content: Content, metadata: dict[str, str]) -> Checksums:
        """The checksums of the object a GET answered from (its metadata says which), kept on
        ``content``. Raises IntegrityError when the manifest it names is missing or unreadable."""
        found = integrity.from_metadata(content.size, metadata)
        current = cast("Checksums | None", content.checksums)
        if isinstance(found, Checksums):
            if current != found:
                if not found.verified:
                    self._log_once(
                        content.key or "",
                        found.source,
                        logging.INFO,
                        "%s: read unchecked: %s",
                        content.key,
                        found.source,
                    )
                content.checksums = found
            return found
        if current is not None and current.source == "manifest" and current.upload == found:
            return current
        content.checksums = await self._manifest(content, found)
        return content.checksums

    async def _manifest(self, content: Content, upload: str) -> Checksums:
        """The manifest of upload ``upload`` (one load at a time per upload; others wait for it)."""
        while (event := self._manifests.get(upload)) is not None:
            await event.wait()
            current = cast("Checksums | None", content.checksums)
            if current is not None and current.source == "manifest" and current.upload == upload:
                return current
        event = self._manifests[upload] = trio.Event()
        mkey = integrity.manifest_key(upload)
        try:
            try:
                raw = await retry.call(
                    retry.reading,
                    lambda: trio.to_thread.run_sync(
                        self.store.get_range,
                        mkey,
                        0,
                        integrity.MANIFEST_MAX,
                        limiter=self.threads,
                        abandon_on_cancel=True,
                    ),
                )
            except NotFound:
                raise IntegrityError(f"its manifest {mkey} is missing from the store") from None
            except StoreError as exc:
                raise FsError(exc.errno, f"{content.key}: cannot read its manifest: {exc}") from exc
            return Checksums.from_manifest(raw, content.size)
        finally:
            del self._manifests[upload]
            event.set()

    async def checksums_of(self, content: Content) -> Checksums | None:
        """What ``content``'s object is checked against (a HEAD, and its manifest, if not known
        yet); None while it is not in the store. For the ``user.ckptfs.verified`` xattr."""
        if content.checksums is not None or not content.in_store or not content.key:
            return cast("Checksums | None", content.checksums)
        try:
            info = await trio.to_thread.run_sync(
                self.store.head, content.key, limiter=self.threads, abandon_on_cancel=True
            )
        except StoreError as exc:
            raise FsError(exc.errno, str(exc)) from exc
        if info is None:
            return None
        try:
            return await self._checksums(content, info.metadata)
        except IntegrityError as exc:
            return Checksums.unverified(content.size, str(exc))

    def _mismatch(self, content: Content, index: int, exc: IntegrityError, final: bool) -> None:
        """Fetched bytes did not match: count, log once per key and part; EIO when ``final``."""
        key = content.key or ""
        if not final:
            self.integrity_retries += 1
            self._log_once(
                key,
                f"retry block {index}",
                logging.WARNING,
                "%s: bytes from the store do not match their checksum (%s); fetching again",
                key,
                exc,
            )
            return
        self.integrity_errors.append({"time": time.time(), "key": key, "block": index, "message": str(exc)})
        self._log_once(
            key,
            f"failed block {index}",
            logging.ERROR,
            "%s: bytes from the store do not match their checksum (%s), %d fetches: read fails (EIO)",
            key,
            exc,
            VERIFY_ATTEMPTS,
        )
        raise FsError(errno.EIO, f"{key}: integrity check failed: {exc}")

    def _log_once(self, key: str, reason: str, level: int, msg: str, *args) -> None:
        if (key, reason) not in self._logged:
            if len(self._logged) > 10_000:
                self._logged.clear()
            self._logged.add((key, reason))
            log.log(level, msg, *args)


class _NoWorkers(Exception):
    """The store workers can no longer start: the fetch goes through the daemon's threads."""


class _Landing:
    """Cache slots a store worker writes a fetched range into (``Fetcher._land``): freed when
    both the fetch that took them is done with them and no worker call still holds them."""

    def __init__(self, cache: Cache, freed: Callable[[], None]):
        self.cache = cache
        self.freed: Callable[[], None] | None = freed  # (called once, when its slots are given up)
        self.refs: dict[int, BlockRef] = {}  # block index -> its fresh slot
        self.busy = 0  # worker calls under way
        self.released = False

    def take(self) -> dict[int, BlockRef]:
        """The slots, for the content: no longer the landing's to free."""
        refs, self.refs = self.refs, {}
        return refs

    def release(self) -> None:
        self.released = True
        self.release_if_done()

    def release_if_done(self) -> None:
        if self.released and not self.busy and self.freed is not None:
            for ref in self.refs.values():
                self.cache.decref(ref)
            self.refs = {}
            self.freed()
            self.freed = None
            self.cache.notify_space()


def _fmt(n: int) -> str:
    return humanfriendly.format_size(n, binary=True)


def _errno_name(number: int) -> str:
    return errno.errorcode.get(number, str(number))
