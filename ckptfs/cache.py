"""The write-back cache: file contents as sequences of fixed-size blocks in two arenas.

Each tier is one pre-sized arena file carved into slots of ``block_size`` bytes:
the RAM tier lives on tmpfs (mapped once, so writes are a memcpy), the NVMe tier
in the cache dir (pread/pwrite, so its pages never count against the daemon's
RSS). Slots are reused, never given back to the OS: fresh memory costs 2-3 s/GiB
on first touch here (docs/machine-facts.md), reused slots cost nothing. So that a
save never pays for it, the RAM slots the next save will take are touched ahead
of it, in the background (``populate``): as many as the largest save so far. Both
arenas are files, so committed bytes outlive the daemon; the journal maps each
committed file to its slots.

A block is shared by reference count: committing a staged file snapshots its
block list, and a later write into a shared block copies it first (copy on
write). Budgets are bytes: a RAM slot costs a whole block (its pages stay, for
reuse), a disk slot only the bytes its block holds once that is known for good (a
committed file's last block, a fetched block): the rest of the slot is a hole, so
a directory of 64 KiB files does not take 8 MiB of budget each. The disk arena
grows by a slot whenever its budget has room and no slot is free. A writer that
finds no room waits (backpressure) until an upload finishes or clean data can be
evicted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
import mmap
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import humanfriendly
import trio

from . import private

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14 (the mmap module of Python 3.11 lacks the name)

RAM, DISK = 0, 1
PAGE = mmap.PAGESIZE  # the unit a disk slot's block is charged in
# The disk arena is sparse; past this apparent size small files wait for room (ext4: 16 TiB at most).
MAX_DISK_ARENA = 1 << 40
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
TIER_NAMES = ("ram", "disk")
BlockRef = tuple[int, int]  # (tier, slot)


def in_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: what it costs the disk tier's budget."""
    return -(-nbytes // PAGE) * PAGE


def block_length(size: int, index: int, block_size: int) -> int:
    """Bytes of block ``index`` in a file of ``size`` bytes."""
    return max(0, min(block_size, size - index * block_size))


class Tier:
    """One arena file, its free slots and the bytes charged to its budget."""

    def __init__(self, index: int, path: Path, block_size: int, budget: int, mapped: bool):
        self.index = index
        self.path = path
        self.block_size = block_size
        self.n_slots = max(budget // block_size, 0)
        # RAM: whole slots (their pages stay). Disk: bytes; the arena grows past n_slots.
        self.budget = self.n_slots * block_size if mapped else max(budget, 0)
        self.mapped = mapped
        self.free: list[int] = []
        self.charged: dict[int, int] = {}  # slot -> bytes it costs the budget
        self.charged_bytes = 0
        self.fd = private.open_file(path, os.O_RDWR | os.O_CREAT)  # the caller checked its directory
        # Never shrink: slots beyond a smaller new budget may still hold committed data.
        self.file_size = max(os.fstat(self.fd).st_size, self.n_slots * block_size)
        if self.file_size:
            os.ftruncate(self.fd, self.file_size)
        self.mm = mmap.mmap(self.fd, self.file_size) if mapped and self.file_size else None
        self.touched: set[int] = set()  # RAM slots known to have their pages (see back)
        self.shrunk = False  # the filesystem ran out of room: unbacked slots are retired
        self.backing_error = ""

    def back(self, slot: int) -> bool:
        """Make sure tmpfs holds pages for a RAM slot before anything touches it through the map.

        A page tmpfs cannot supply (its size is reached: a container's 64 MiB /dev/shm, other
        users' files) is a SIGBUS at the writer's memcpy, which kills the daemon; fallocate says
        ENOSPC instead. False then: the caller retires the slot (``retire_unbacked``). A slot
        backed once stays backed (RAM slots are never punched), so reuse costs a set lookup.
        Also called from the populate thread: fallocate is idempotent, ``touched`` a set."""
        if slot in self.touched:
            return True
        for _ in range(5):  # EINTR: tmpfs stops a long fallocate when a signal is pending
            if _libc.fallocate(self.fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_long(slot * self.block_size),
                               ctypes.c_long(self.block_size)) == 0:
                self.touched.add(slot)
                return True
            err = ctypes.get_errno()
            if err != errno.EINTR:
                break
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem that cannot tell: as before
            self.touched.add(slot)
            return True
        self.backing_error = os.strerror(err)
        return False

    def retire_unbacked(self) -> int:
        """The filesystem cannot back more slots: the free ones without pages can never be used
        safely. They leave the budget for this mount (so do unbacked slots in use once they are
        released). Returns the bytes the budget lost."""
        keep = [s for s in self.free if s in self.touched]
        lost = (len(self.free) - len(keep)) * self.block_size
        self.free = keep
        self.budget -= lost
        self.shrunk = True
        return lost

    def populate(self, slot: int) -> bool:
        """Give a RAM slot its pages now (a background thread), not at the writer's first touch.
        Harmless if the slot is taken meanwhile: the pages are made present, not changed.
        False when the filesystem cannot back it (MADV_POPULATE_WRITE is not even tried)."""
        if not self.back(slot):
            return False
        try:
            self.mm.madvise(MADV_POPULATE_WRITE, slot * self.block_size, self.block_size)
        except OSError as exc:  # kernels before 5.14 (a populate failure is an error, never a signal)
            log.debug("cannot populate %s: %s", self.path, exc)
        return True

    def held_bytes(self) -> int:
        """What the arena file already takes on its filesystem (pages kept from the last mount)."""
        return os.fstat(self.fd).st_blocks * 512

    def reset_free(self, used: set[int]) -> None:
        if self.mm is None and used:  # disk slots past the budget's are in use, not retired
            self.n_slots = max(self.n_slots, max(used) + 1)
        # Pop from the end: low slots first, so a small working set stays in touched pages.
        self.free = [s for s in range(self.n_slots - 1, -1, -1) if s not in used]

    def take(self) -> int | None:
        """A free slot, charged a whole block (its final length is not known yet); None when
        the budget has no room for one."""
        if self.charged_bytes + self.block_size > self.budget:
            return None
        if not self.free:
            if self.mm is not None or (self.n_slots + 1) * self.block_size > MAX_DISK_ARENA:
                return None
            self.n_slots += 1  # disk: room in the budget, none in the arena: grow it
            self.file_size = max(self.file_size, self.n_slots * self.block_size)
            os.ftruncate(self.fd, self.file_size)
            self.free.append(self.n_slots - 1)
        slot = self.free.pop()
        self.charge(slot, self.block_size)
        return slot

    def charge(self, slot: int, nbytes: int) -> None:
        self.charged_bytes += nbytes - self.charged.get(slot, 0)
        self.charged[slot] = nbytes

    def fit(self, slot: int, length: int) -> None:
        """The slot's block ends at ``length`` for good: on disk, charge only the pages that
        hold it and give the rest back to the filesystem (RAM keeps its pages: reuse is free)."""
        keep = in_pages(length)
        held = self.charged.get(slot, 0)
        if self.mm is not None or keep >= held:
            return
        self.charge(slot, keep)
        self._punch(slot * self.block_size + keep, held - keep)

    def write(self, slot: int, offset: int, data) -> None:
        pos = slot * self.block_size + offset
        if self.mm is not None:
            self.mm[pos : pos + len(data)] = data
            return
        end = offset + len(data)
        if end > self.charged.get(slot, 0):  # a fitted block written again past its end (rare)
            self.charge(slot, min(in_pages(end), self.block_size))
        os.pwrite(self.fd, data, pos)

    def fill(self, slot: int, data) -> None:
        """Write a freshly taken slot's block from its start through the file, not the map: the
        GIL is released for the copy (callable from a worker thread: no bookkeeping here, the
        slot was charged a whole block when taken) and tmpfs takes the bytes without a page
        fault per page of the map (a fresh mount's RAM slots have never been mapped)."""
        view, pos = memoryview(data), slot * self.block_size
        while view:
            written = os.pwrite(self.fd, view, pos)
            view, pos = view[written:], pos + written

    def read(self, slot: int, offset: int, length: int) -> bytes:
        pos = slot * self.block_size + offset
        if self.mm is not None:
            return self.mm[pos : pos + length]
        return os.pread(self.fd, length, pos)

    def read_into(self, slot: int, offset: int, out: memoryview) -> None:
        """Copy into a caller's buffer: no new bytes object (fresh memory is slow here)."""
        pos = slot * self.block_size + offset
        if self.mm is not None:
            out[:] = memoryview(self.mm)[pos : pos + len(out)]
        elif os.preadv(self.fd, [out], pos) != len(out):
            raise OSError(errno.EIO, f"short read from {self.path}")

    def view(self, slot: int, length: int) -> memoryview | bytes:
        """Zero-copy view for hashing and uploading (RAM tier); a read on disk."""
        if self.mm is not None:
            pos = slot * self.block_size
            return memoryview(self.mm)[pos : pos + length]
        return self.read(slot, 0, length)

    def release(self, slot: int) -> None:
        """A slot is free again. On disk, give its space back to the filesystem, so a full
        cache disk recovers as soon as data is uploaded (the RAM tier keeps its pages: reuse is free).
        RAM slots past a smaller budget than the last mount's, or unbacked once the filesystem
        is full, are retired."""
        held = self.charged.pop(slot, 0)
        self.charged_bytes -= held
        if self.shrunk and slot not in self.touched:
            self.budget -= self.block_size  # (see retire_unbacked)
        elif slot < self.n_slots:
            self.free.append(slot)
        if self.mm is None and held:
            self._punch(slot * self.block_size, held)

    def _punch(self, pos: int, length: int) -> None:
        if _libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                           ctypes.c_long(pos), ctypes.c_long(length)) != 0:
            log.debug("cannot punch a hole in %s: %s", self.path, os.strerror(ctypes.get_errno()))

    def sync(self) -> None:
        if self.mm is not None:
            self.mm.flush()
        else:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive in a thread; the OS cleans up
                pass
        os.close(self.fd)


class CachePolicy:
    """What the cache asks of the model (ckptfs/model/policy.py implements it); this default,
    for a cache on its own: nothing pinned, nothing to reclaim, uploads may free space."""

    def pinned(self, owner: object) -> bool:
        """Whether ``owner``'s clean data goes last (the latest checkpoint)."""
        return False

    def reclaim(self) -> bool:
        """Free one block of a file still being written whose part is already uploaded; False
        when there is none."""
        return False

    def releases_pending(self) -> bool:
        """Whether some holder of blocks will let go of them by itself (an upload in progress).
        When none will, a writer waiting for space would wait forever: it gets ENOSPC instead."""
        return True


class Cache:
    """Slot allocation with budgets, reference counts, clean-data eviction."""

    def __init__(self, cache_dir: Path, ram_dir: Path, block_size: int, ram_budget: int, disk_budget: int,
                 policy: CachePolicy | None = None, write_timeout: float | None = None):
        self.block_size = block_size
        for directory, what in ((cache_dir, "cache dir"), (ram_dir, "RAM tier directory")):
            directory.parent.mkdir(parents=True, exist_ok=True)
            private.ensure_dir(directory, what)
        self.tiers = (
            Tier(RAM, ram_dir / "ram.arena", block_size, ram_budget, mapped=True),
            Tier(DISK, cache_dir / "disk.arena", block_size, disk_budget, mapped=False),
        )
        self.ram_arena_id = _arena_id(ram_dir / "ram.arena.id")
        self.refcounts: dict[BlockRef, int] = {}
        # Clean (durable, unopened) contents that may be dropped to make room, oldest first.
        self.clean: OrderedDict[object, tuple[Content, Callable[[], None]]] = OrderedDict()
        self._space = trio.Event()
        self.waiters = 0
        # A writer waits for space at most this long without a block being freed (the store is
        # down: nothing drains), then gets ENOSPC (--write-timeout; None: as long as it takes).
        self.write_timeout = write_timeout
        self._freed_at = 0.0  # time.monotonic() of the last block given back
        # What only the model knows (model/policy.py): which clean data goes last, blocks of
        # files being written that may go, whether a waiting writer can expect space.
        self.policy: CachePolicy = policy or CachePolicy()
        self.populate_ahead = 0  # free RAM slots to keep touched (the largest save so far)
        self._populate_wanted = trio.Event()
        for tier in self.tiers:
            tier.reset_free(set())

    # -- start-up -----------------------------------------------------------------
    def adopt(self, files: Iterable[tuple[int, list[BlockRef | None]]]) -> None:
        """Take ownership of the blocks of files named by the journal, as (size, blocks):
        one reference each, charged for the bytes they hold."""
        for size, blocks in files:
            for index, ref in enumerate(blocks):
                if ref is not None:
                    self.refcounts[ref] = self.refcounts.get(ref, 0) + 1
                    tier, slot = self.tiers[ref[0]], ref[1]
                    length = block_length(size, index, self.block_size) if tier.mm is None else self.block_size
                    tier.charge(slot, max(tier.charged.get(slot, 0), in_pages(length)))
        for tier in self.tiers:
            tier.reset_free({slot for (t, slot) in self.refcounts if t == tier.index})

    def valid_ref(self, ref: BlockRef) -> bool:
        tier, slot = ref
        return tier in (RAM, DISK) and 0 <= slot < self.tiers[tier].file_size // self.block_size

    # -- allocation -----------------------------------------------------------------
    def try_alloc(self, only: int | None = None) -> BlockRef | None:
        """A free slot: RAM first (evicting clean RAM data), then disk; ``only`` forces a tier."""
        ram, disk = self.tiers
        if only is None and ram.charged_bytes + self.block_size > ram.budget:
            self._evict(prefer_tier=RAM)
        for tier in (ram, disk) if only is None else (self.tiers[only],):
            if (slot := tier.take()) is not None:
                if tier.mm is not None and not tier.back(slot):
                    tier.release(slot)
                    self._ram_full()  # (retires that slot too): on to the disk tier
                    continue
                ref = (tier.index, slot)
                self.refcounts[ref] = 1
                return ref
        if self._evict(prefer_tier=only) or (only is None and self.policy.reclaim()):
            return self.try_alloc(only)
        return None

    async def alloc(self, only: int | None = None) -> BlockRef:
        """A fresh block; waits while the tiers are full of data not yet uploaded, as long as
        uploads free blocks: ENOSPC after ``write_timeout`` seconds without one freed."""
        started = time.monotonic()
        while (ref := self.try_alloc(only)) is None:
            if not self.policy.releases_pending():
                raise OSError(errno.ENOSPC, "the cache is full of files still open for writing: "
                                            "raise --ram-cache/--cache-size or write fewer files at once")
            left = math.inf
            if self.write_timeout is not None:
                left = max(started, self._freed_at) + self.write_timeout - time.monotonic()
                if left <= 0:
                    raise OSError(errno.ENOSPC, f"the cache is full of data not yet in the store and none "
                                                f"was uploaded for {self.write_timeout:g} s (--write-timeout): "
                                                "is the store down? see 'ckptfs status'")
            self.waiters += 1
            try:
                with trio.move_on_after(left):
                    await self._space.wait()
            finally:
                self.waiters -= 1
        return ref

    def incref(self, ref: BlockRef) -> None:
        self.refcounts[ref] += 1

    def notify_space(self) -> None:
        """Wake writers waiting for a slot: something may be reclaimable now."""
        if self.waiters:
            self._space.set()
            self._space = trio.Event()

    def decref(self, ref: BlockRef) -> None:
        n = self.refcounts[ref] - 1
        if n:
            self.refcounts[ref] = n
            return
        del self.refcounts[ref]
        self.tiers[ref[0]].release(ref[1])
        self._freed_at = time.monotonic()
        self._space.set()
        self._space = trio.Event()

    def fit(self, ref: BlockRef, length: int) -> None:
        """Block ``ref`` holds ``length`` bytes for good (see Tier.fit)."""
        if length < self.block_size:
            self.tiers[ref[0]].fit(ref[1], length)
            self.notify_space()

    def fit_last(self, content: Content) -> None:
        """``content``'s last block is as long as it will be: charge only what it holds."""
        if content.blocks and content.blocks[-1] is not None:
            self.fit(content.blocks[-1], content.block_length(len(content.blocks) - 1))

    # -- clean data -------------------------------------------------------------------
    def mark_clean(self, owner: object, content: Content, on_evict: Callable[[], None],
                   whole: bool = True) -> None:
        """``content`` is in the store: its blocks may go. ``whole=False`` (a file open for
        reading): one block at a time, lowest index first (behind a sequential reader)."""
        self.clean[owner] = (content, on_evict, whole)
        self.clean.move_to_end(owner)
        if self.waiters:
            self._space.set()
            self._space = trio.Event()

    def unmark_clean(self, owner: object) -> None:
        self.clean.pop(owner, None)

    def touch(self, owner: object) -> None:
        """``owner``'s clean data was just used: it goes to the end of the eviction order."""
        if owner in self.clean:
            self.clean.move_to_end(owner)

    def _evict(self, prefer_tier: int | None) -> bool:
        """Drop the least recently used clean content (holding a block on prefer_tier); the
        latest checkpoint's only when nothing else is left."""
        for spare_pinned in (True, False):
            for owner, (content, on_evict, whole) in self.clean.items():
                if spare_pinned and self.policy.pinned(owner):
                    continue
                held = [i for i, r in enumerate(content.blocks) if r is not None and prefer_tier in (None, r[0])]
                if not held:
                    continue
                if whole:
                    del self.clean[owner]
                    on_evict()
                    content.drop_blocks()
                else:  # (the entry stays: the reader fetches more blocks into it)
                    self.decref(content.blocks[held[0]])
                    content.blocks[held[0]] = None
                return True
        return False

    # -- block I/O ----------------------------------------------------------------------
    def write(self, ref: BlockRef, offset: int, data) -> None:
        self.tiers[ref[0]].write(ref[1], offset, data)

    def fill(self, ref: BlockRef, data) -> None:
        """``Tier.fill``: a fresh block's bytes, from a worker thread."""
        self.tiers[ref[0]].fill(ref[1], data)

    def read(self, ref: BlockRef, offset: int, length: int) -> bytes:
        return self.tiers[ref[0]].read(ref[1], offset, length)

    def read_into(self, ref: BlockRef, offset: int, out: memoryview) -> None:
        self.tiers[ref[0]].read_into(ref[1], offset, out)

    def view(self, ref: BlockRef, length: int):
        return self.tiers[ref[0]].view(ref[1], length)

    def view_range(self, ref: BlockRef, offset: int, length: int) -> memoryview:
        """A view of part of a RAM block (no copy)."""
        tier = self.tiers[ref[0]]
        pos = ref[1] * self.block_size + offset
        return memoryview(tier.mm)[pos : pos + length]

    def copy_block(self, src: BlockRef, dst: BlockRef, length: int) -> None:
        if length:
            self.write(dst, 0, self.read(src, 0, length))

    def zero(self, ref: BlockRef, offset: int, length: int) -> None:
        if length > 0:
            self.write(ref, offset, bytes(length))

    def sync(self) -> None:
        for tier in self.tiers:
            tier.sync()

    async def on_disk(self, content: Content) -> Content:
        """The same bytes with every block on the disk tier (RAM blocks copied), for fsync.
        The caller holds ``content`` until this returns."""
        blocks: list[BlockRef | None] = []
        copies: list[tuple[BlockRef, BlockRef, int]] = []
        for i, ref in enumerate(content.blocks):
            if ref is None or ref[0] == DISK:
                if ref is not None:
                    self.incref(ref)
                blocks.append(ref)
                continue
            new = await self.alloc(only=DISK)
            copies.append((ref, new, content.block_length(i)))
            blocks.append(new)
        await trio.to_thread.run_sync(lambda: [self.copy_block(*c) for c in copies])
        copy = Content(self, content.size, blocks)
        self.fit_last(copy)
        copy.key = content.key
        copy.remote, copy.upload = dict(content.remote), content.upload
        return copy

    def _ram_full(self) -> None:
        """The RAM tier's filesystem has no room for a slot: shrink the tier to the slots it has
        pages for, once, with one warning; allocation goes on in the disk tier."""
        ram = self.tiers[RAM]
        before = ram.budget
        lost = ram.retire_unbacked()
        if lost:
            log.warning("the RAM tier's filesystem (%s) cannot hold more (%s): RAM tier shrunk from %s to %s "
                        "for this mount; the rest goes to the disk tier (free space there, or remount with "
                        "a smaller --ram-cache or another --shm-dir)", ram.path.parent, ram.backing_error,
                        _fmt(before), _fmt(ram.budget))

    def expect_writes(self, nbytes: int) -> None:
        """A save of ``nbytes`` happened: keep that many free RAM slots touched for the next one."""
        slots = min(-(-nbytes // self.block_size), self.tiers[RAM].budget // self.block_size)
        if slots > self.populate_ahead:
            self.populate_ahead = slots
        self._populate_wanted.set()

    def _next_untouched(self) -> int | None:
        ram = self.tiers[RAM]
        if ram.mm is None:
            return None
        for slot in reversed(ram.free[-self.populate_ahead:] if self.populate_ahead else []):
            if slot not in ram.touched:  # (the free list is taken from its end)
                return slot
        return None

    async def run_populate(self, threads, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Touch the free RAM slots the next save will take (see the module doc)."""
        task_status.started()
        while True:
            await self._populate_wanted.wait()
            self._populate_wanted = trio.Event()
            while (slot := self._next_untouched()) is not None:
                if not await threads.run(self.tiers[RAM].populate, slot):
                    self._ram_full()

    def charged(self, ref: BlockRef) -> int:
        return self.tiers[ref[0]].charged.get(ref[1], 0)

    def usage(self) -> dict:
        out = {}
        for tier in self.tiers:
            out[TIER_NAMES[tier.index]] = {"used": tier.charged_bytes, "budget": tier.budget}
        out["clean_bytes"] = sum(self.charged(r) for c, *_ in self.clean.values() for r in c.refs())
        out["writers_waiting"] = self.waiters
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def _fmt(nbytes: int) -> str:
    return humanfriendly.format_size(nbytes, binary=True)


def _arena_id(path: Path) -> str:
    """Identifies this incarnation of the RAM arena: a reboot empties tmpfs and makes a new one."""
    try:
        return private.read_file(path, 64).decode(errors="replace").strip()
    except FileNotFoundError:
        new = uuid.uuid4().hex
        private.write_file(path, new.encode())
        return new


class Content:
    """An immutable committed file content: its size and blocks.

    ``blocks[i]`` is None when block i is not cached: a hole (zeros) for a file that
    is only local, or bytes still in the store when ``in_store`` is set. Holders
    (the namespace version, a pending upload, open readers) call hold/release;
    the blocks go back to the cache with the last release.
    """

    def __init__(self, cache: Cache, size: int, blocks: list[BlockRef | None], in_store: bool = False):
        self.cache = cache
        self.size = size
        self.blocks = blocks
        self.in_store = in_store
        self.key: str | None = None  # where the bytes are in the store, once they are
        self.holders = 0
        # Blocks evicted under cache pressure after their part was uploaded: until the upload
        # completes, their bytes exist only in the store's multipart upload ``upload``.
        self.remote: dict[int, object] = {}  # block index -> PartInfo
        self.upload: object | None = None
        self.orphaned = False  # that upload was given up (a newer version replaced this one)
        self.durable_at = 0.0  # when it became durable (time.time()), for the clean cache index
        self.verify = ""  # cached blocks kept from the last mount: their digest, checked at first open
        self.checksums: object | None = None  # integrity.Checksums of its object, once known

    def hold(self) -> Content:
        self.holders += 1
        return self

    def release(self) -> None:
        self.holders -= 1
        if self.holders <= 0:
            self.drop_blocks()

    def drop_blocks(self) -> None:
        for i, ref in enumerate(self.blocks):
            if ref is not None:
                self.cache.decref(ref)
                self.blocks[i] = None

    def block_length(self, index: int) -> int:
        return block_length(self.size, index, self.cache.block_size)

    def missing(self, offset: int, length: int) -> list[int]:
        """Indexes of blocks in the range that must come from the store first."""
        if not self.in_store:
            return []
        bs = self.cache.block_size
        end = min(offset + length, self.size)
        return [i for i in range(offset // bs, (end + bs - 1) // bs) if self.blocks[i] is None]

    def read(self, offset: int, length: int, view: bool = False) -> bytes | memoryview:
        """Bytes from cached blocks (holes read as zeros); callers fetch missing blocks first.
        ``view``: a range within one RAM block comes back as a view of the arena, no copy. Only
        for a caller that is done with it before anything else runs (a FUSE reply): the slot
        may be reused once this content is released."""
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        bs = self.cache.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:  # the common case: one block, one copy (or none)
            ref = self._block_ref(first) if view else None
            if ref is not None and ref[0] == RAM:
                return self.cache.view_range(ref, offset - first * bs, end - offset)
            return self._read_block(first, offset - first * bs, end - offset)
        chunks = []
        for i in range(first, last + 1):
            start = max(offset, i * bs) - i * bs
            stop = min(end, (i + 1) * bs) - i * bs
            chunks.append(self._read_block(i, start, stop - start))
        return b"".join(chunks)

    def read_into(self, offset: int, out: memoryview) -> None:
        """``read`` into a caller's buffer, which the range must fill exactly (within the file)."""
        bs = self.cache.block_size
        done = 0
        while done < len(out):
            index, start = divmod(offset + done, bs)
            chunk = out[done : done + min(bs - start, len(out) - done)]
            ref = self._block_ref(index)
            if ref is None:
                chunk[:] = bytes(len(chunk))
            else:
                self.cache.read_into(ref, start, chunk)
            done += len(chunk)

    def _block_ref(self, index: int) -> BlockRef | None:
        ref = self.blocks[index]
        if ref is None and index in self.remote:
            raise OSError(errno.EIO, "this part of the file was evicted to the store and is not readable yet")
        return ref

    def _read_block(self, index: int, start: int, length: int) -> bytes:
        ref = self._block_ref(index)
        return bytes(length) if ref is None else self.cache.read(ref, start, length)

    def refs(self) -> list[BlockRef]:
        return [r for r in self.blocks if r is not None]


class StagedFile:
    """The private, writable copy of a file behind one open-for-write handle.

    ``valid[i]`` is how many leading bytes of block i hold written data; bytes past
    it are stale slot contents and read as zeros. Sequential writes only move the
    mark, so a fresh slot is never zeroed in full.

    For streaming upload, ``stamps[i]`` changes (never to an earlier value) whenever
    block i changes, and ``changed`` holds the blocks changed since the namespace
    last handed them to the uploader.
    """

    def __init__(self, cache: Cache, base: Content | None = None):
        self.cache = cache
        self.size = 0
        self.blocks: list[BlockRef | None] = []
        self.valid: list[int] = []
        self.stamps: list[int] = []
        self.changed: set[int] = set()
        self._clock = 0
        # Blocks evicted under cache pressure once their part was uploaded (streaming): they
        # can no longer be read or changed until the file is committed and durable.
        self.remote: dict[int, object] = {}  # block index -> PartInfo
        if base is not None:  # share the committed blocks; writes copy them first
            self.size = base.size
            for i, ref in enumerate(base.blocks):
                if ref is not None:
                    cache.incref(ref)
                self.blocks.append(ref)
                self.valid.append(base.block_length(i) if ref is not None else 0)
                self.stamps.append(0)

    def _stamp(self, index: int) -> None:
        self._clock += 1
        self.stamps[index] = self._clock
        self.changed.add(index)

    def evict(self, index: int, part: object) -> None:
        """Drop block ``index``, whose bytes are in the store as ``part`` of the stream's upload."""
        self.cache.decref(self.blocks[index])
        self.blocks[index] = None
        self.remote[index] = part

    def _check_local(self, first: int, last: int) -> None:
        if self.remote and any(first <= i <= last for i in self.remote):
            raise OSError(errno.EIO, "that part of the file was uploaded and evicted from the cache "
                                     "(cache full); it cannot change before the file is closed")

    async def write(self, offset: int, data: bytes) -> int:
        bs = self.cache.block_size
        end = offset + len(data)
        if data:
            self._check_local(offset // bs, (end - 1) // bs)
        view = memoryview(data)
        pos = offset
        while pos < end:
            index, start = divmod(pos, bs)
            take = min(bs - start, end - pos)
            ref = await self._writable_block(index)
            if start > self.valid[index]:  # a gap inside the block: zero it
                self.cache.zero(ref, self.valid[index], start - self.valid[index])
            self.cache.write(ref, start, view[pos - offset : pos - offset + take])
            self.valid[index] = max(self.valid[index], start + take)
            self._stamp(index)
            pos += take
        self.size = max(self.size, end)
        return len(data)

    async def _writable_block(self, index: int) -> BlockRef:
        while True:
            while len(self.blocks) <= index:
                self.blocks.append(None)
                self.valid.append(0)
                self.stamps.append(0)
            ref = self.blocks[index]
            if ref is not None and self.cache.refcounts[ref] == 1:
                return ref
            new = await self.cache.alloc()
            if index >= len(self.blocks) or self.blocks[index] is not ref:  # raced another write/truncate
                self.cache.decref(new)
                continue
            if ref is None:
                self.valid[index] = 0
            else:  # shared with a committed version: copy on write
                self.cache.copy_block(ref, new, self.valid[index])
                self.cache.decref(ref)
            self.blocks[index] = new
            return new

    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        bs = self.cache.block_size
        if end > offset:
            self._check_local(offset // bs, (end - 1) // bs)
        out = bytearray()
        pos = offset
        while pos < end:
            index, start = divmod(pos, bs)
            take = min(bs - start, end - pos)
            ref = self.blocks[index] if index < len(self.blocks) else None
            have = max(0, min(take, self.valid[index] - start)) if ref is not None else 0
            if have:
                out += self.cache.read(ref, start, have)
            out += bytes(take - have)
            pos += take
        return bytes(out)

    async def truncate(self, size: int) -> None:
        bs = self.cache.block_size
        keep = (size + bs - 1) // bs
        if size < self.size and size % bs:
            self._check_local(size // bs, size // bs)
        self._drop_blocks_from(keep)
        last = keep - 1
        if size < self.size and 0 <= last < len(self.blocks):
            limit = size - last * bs
            if self.valid[last] > limit:
                if self.cache.refcounts.get(self.blocks[last], 0) > 1:
                    # Shared with a committed version: lowering the mark would let a later
                    # zero-fill write into bytes that version still shows. Copy first.
                    await self._writable_block(last)
                self.valid[last] = limit
                self._stamp(last)
        self.size = size

    def _drop_blocks_from(self, index: int) -> None:
        for ref in self.blocks[index:]:
            if ref is not None:
                self.cache.decref(ref)
        del self.blocks[index:]
        del self.valid[index:]
        del self.stamps[index:]
        self.changed = {i for i in self.changed if i < index}
        self.remote = {i: p for i, p in self.remote.items() if i < index}

    def snapshot(self) -> Content:
        """A committed Content sharing this file's blocks (gaps zeroed so every block is whole)."""
        blocks: list[BlockRef | None] = []
        for i in range(len(self.blocks)):
            ref = self.blocks[i]
            want = max(0, min(self.cache.block_size, self.size - i * self.cache.block_size))
            if ref is not None:
                if self.valid[i] < want:
                    # Shared blocks are never partially valid (copy on write makes them private).
                    self.cache.zero(ref, self.valid[i], want - self.valid[i])
                    self.valid[i] = want
                    self._stamp(i)
                self.cache.incref(ref)
            blocks.append(ref)
        n_blocks = (self.size + self.cache.block_size - 1) // self.cache.block_size
        blocks += [None] * (n_blocks - len(blocks))
        content = Content(self.cache, self.size, blocks[:n_blocks])
        content.remote = {i: p for i, p in self.remote.items() if i < n_blocks}
        self.cache.fit_last(content)
        return content

    def discard(self) -> None:
        self._drop_blocks_from(0)
        self.size = 0
