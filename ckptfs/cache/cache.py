"""The write-back cache: file contents as sequences of fixed-size blocks in two arenas.

Each tier is one pre-sized arena file carved into slots of ``block_size`` bytes
(``arena.Tier``): the RAM tier lives on tmpfs (mapped once, so writes are a memcpy),
the NVMe tier in the cache dir (pread/pwrite, so its pages never count against the
daemon's RSS). Slots are reused, never given back to the OS: fresh memory costs 2-3 s/GiB
on first touch here (docs/machine-facts.md), reused slots cost nothing. So that a
save never pays for it, the RAM slots the next save will take are touched ahead
of it, in the background (``populate``): as many as the largest save so far. Both
arenas are files, so committed bytes outlive the daemon; the journal maps each
committed file to its slots.

A block is shared by reference count: committing a staged file snapshots its
block list, and a later write into a shared block copies it first (copy on
write; ``contents.Content`` and ``contents.StagedFile``). Budgets are bytes: a RAM
slot costs a whole block (its pages stay, for reuse), a disk slot only the bytes its
block holds once that is known for good (a committed file's last block, a fetched
block): the rest of the slot is a hole, so a directory of 64 KiB files does not take
8 MiB of budget each. The disk arena grows by a slot whenever its budget has room and
no slot is free. A writer that finds no room waits (backpressure) until an upload
finishes or clean data can be evicted.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import humanfriendly
import trio

from ckptfs.blocks import BlockRef, block_length, n_blocks
from ckptfs.cache import backing
from ckptfs.cache.arena import DISK, RAM, TIER_NAMES, Tier, in_pages
from ckptfs.cache.backing import BackingTier
from ckptfs.cache.contents import Content
from ckptfs.util import private_files

log = logging.getLogger(__name__)


class EvictionPolicy(Protocol):
    """What the cache asks of whoever knows what its blocks are for (the model:
    ckptfs/model/policy.py ``CheckpointEvictionPolicy``)."""

    def pinned(self, owner: object) -> bool:
        """Whether ``owner``'s clean data goes last (the latest checkpoint)."""
        ...

    def reclaim(self) -> bool:
        """Free one block of a file still being written whose part is already uploaded; False
        when there is none."""
        ...

    def releases_pending(self) -> bool:
        """Whether some holder of blocks will let go of them by itself (an upload in progress).
        When none will, a writer waiting for space would wait forever: it gets ENOSPC instead."""
        ...


class NoEviction(EvictionPolicy):
    """The policy of a cache on its own: nothing pinned, nothing to reclaim, and a writer
    waiting for space waits (someone may yet free some)."""

    def pinned(self, owner: object) -> bool:
        return False

    def reclaim(self) -> bool:
        return False

    def releases_pending(self) -> bool:
        return True


class Cache:
    """Slot allocation with budgets, reference counts, clean-data eviction."""

    def __init__(
        self,
        cache_dir: Path,
        ram_dir: Path,
        block_size: int,
        ram_budget: int,
        disk_budget: int,
        policy: EvictionPolicy | None = None,
        write_timeout: float | None = None,
    ):
        self.block_size = block_size
        for directory, what in ((cache_dir, "cache dir"), (ram_dir, "RAM tier directory")):
            directory.parent.mkdir(parents=True, exist_ok=True)
            private_files.ensure_dir(directory, what)
        self.tiers = (
            Tier(RAM, ram_dir / "ram.arena", block_size, ram_budget, mapped=True),
            Tier(DISK, cache_dir / "disk.arena", block_size, disk_budget, mapped=False),
        )
        self.ram_arena_id = _arena_id(ram_dir / "ram.arena.id")
        # Working copies in files of their own (cache/backing.py), by tier number; their files'
        # disk use counts against the disk tier's budget (``Tier.outside``).
        self.working_dir = cache_dir / backing.WORKING_DIR
        private_files.ensure_dir(self.working_dir, "working copies directory")
        # Files fetched whole that fit the RAM budget (``new_landing``), never reopened after a
        # restart: what a kept RAM tier left here goes now.
        self.ram_working_dir = ram_dir / backing.WORKING_DIR
        private_files.ensure_dir(self.ram_working_dir, "RAM tier's working directory")
        for path in self.ram_working_dir.iterdir():
            path.unlink(missing_ok=True)
        self.backing: dict[int, BackingTier] = {}
        self.max_backing_files = 1 << 30  # each keeps a descriptor (set at mount: ``backing_room``)
        self._told_backing_cap = False
        # The last close of a dropped file frees its extents: tens to hundreds of ms for a GiB
        # on ext4 (measured: 46-212 ms), so it happens in a thread of its own, not on the loop.
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfs-drop")
        self._new_names = False
        self._next_backing = backing.FIRST_TIER + max(
            (int(p.name) - backing.FIRST_TIER + 1 for p in self.working_dir.iterdir() if p.name.isdigit()),
            default=0,
        )
        self.refcounts: dict[BlockRef, int] = {}
        # Clean (durable, unopened) contents that may be dropped to make room, oldest first.
        self.clean: OrderedDict[object, tuple[Content, Callable[[], None], bool]] = OrderedDict()
        self._space = trio.Event()
        self.waiters = 0
        self.space_waits = 0  # allocations that had to wait for room (status: cache pressure)
        # A writer waits for space at most this long without a block being freed (the store is
        # down: nothing drains), then gets ENOSPC (--write-timeout; None: as long as it takes).
        self.write_timeout = write_timeout
        self._freed_at = 0.0  # time.monotonic() of the last block given back
        # What only the model knows (model/policy.py): which clean data goes last, blocks of
        # files being written that may go, whether a waiting writer can expect space.
        self.policy: EvictionPolicy = policy or NoEviction()
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
                    if ref[0] >= backing.FIRST_TIER:
                        self.backing[ref[0]].slots.add(ref[1])
                        continue
                    tier, slot = self.tiers[ref[0]], ref[1]
                    length = (
                        block_length(size, index, self.block_size) if tier.mm is None else self.block_size
                    )
                    tier.charge(slot, max(tier.charged.get(slot, 0), in_pages(length)))
        for tier in self.tiers:
            tier.reset_free({slot for (t, slot) in self.refcounts if t == tier.index})

    def valid_ref(self, ref: BlockRef) -> bool:
        tier, slot = ref
        if tier >= backing.FIRST_TIER:  # a working copy's file the last run committed
            found = self._backing_file(tier)
            return found is not None and 0 <= slot < max(1, n_blocks(found.size(), self.block_size))
        return tier in (RAM, DISK) and 0 <= slot < self.tiers[tier].file_size // self.block_size

    def tier(self, index: int) -> Tier | BackingTier:
        return self.tiers[index] if index < backing.FIRST_TIER else self.backing[index]

    # -- working copies in files of their own (cache/backing.py) ----------------------------------
    def backing_room(self) -> bool:
        """Whether one more backing file may be kept open (``max_backing_files``: each holds a
        descriptor, daemon/limits.py ``cached_file_budget``). Past it a writer's copy goes in
        the arenas and a cold reader reads through the daemon."""
        if len(self.backing) < self.max_backing_files:
            return True
        if not self._told_backing_cap:
            self._told_backing_cap = True
            log.warning(
                "%d cache files are open, as many as the open-file limit leaves room for: more "
                "files are written and read through the daemon (raise the limit: ulimit -n)",
                len(self.backing),
            )
        return False

    def new_backing(self, home: int = DISK) -> BackingTier:
        """A new, empty backing file: in the cache dir, or (``home`` RAM) on the RAM tier's tmpfs."""
        if not self.backing_room():
            raise OSError(errno.EMFILE, f"{self.max_backing_files} backing files are open already")
        index = self._next_backing
        self._next_backing += 1
        path, fd = backing.new_file(self.working_dir if home == DISK else self.ram_working_dir, index)
        tier = self.backing[index] = BackingTier(index, path, fd, self.block_size, home)
        self._new_names = self._new_names or home == DISK  # (durable once its directory is synced: sync_disk)
        return tier

    def _home(self, tier: int) -> int:
        """The arena whose budget a block of ``tier`` counts against (eviction's preference)."""
        if tier < backing.FIRST_TIER:
            return tier
        found = self.backing.get(tier)
        return found.home if found is not None else DISK

    def _backing_file(self, index: int) -> BackingTier | None:
        """The backing file ``index`` a journal or index record names, opened once."""
        if index not in self.backing:
            path = self.working_dir / str(index)
            try:
                fd = private_files.open_file(path, os.O_RDWR)
            except FileNotFoundError:
                return None
            tier = self.backing[index] = BackingTier(index, path, fd, self.block_size)
            tier.exposed = True  # (a mapping of it from before the restart may still be read)
        return self.backing[index]

    def sweep_backing(self) -> None:
        """After start-up: files no record holds (working copies a crash left uncommitted) go."""
        for tier in list(self.backing.values()):
            if tier.unused():
                self._drop_backing(tier)
            else:
                self.tiers[DISK].outside += tier.measure()
        for path in self.working_dir.iterdir():
            if not (path.name.isdigit() and int(path.name) in self.backing):
                path.unlink(missing_ok=True)

    def hold_backing(self, tier: BackingTier, index: int) -> BlockRef:
        """Block ``index`` of a backing file, one more reference."""
        ref = (tier.index, index)
        self.refcounts[ref] = self.refcounts.get(ref, 0) + 1
        tier.slots.add(index)
        return ref

    def room_for_landing(self, size: int, also: int = 0) -> bool:
        """Whether a file of ``size`` bytes fetched whole fits: in the RAM budget beside the
        arena's pages, or (with ``also`` bytes more landing with it) in the disk budget."""
        return self._ram_room_for_landing(size) or self.room_for_file(also + size)

    def _ram_room_for_landing(self, size: int) -> bool:
        ram = self.tiers[RAM]
        return ram.mm is not None and not ram.shrunk and ram.room_to_touch(size)

    def new_landing(self, size: int) -> BackingTier:
        """A file of ``size`` bytes (all hole) that a version's fetched blocks land in, at their own
        positions (``alloc_for``), until ``landed``: on the RAM tier's tmpfs when the RAM budget
        has room for all of it beside the arena's pages (charged at once, so the landings and
        slots that come meanwhile count it), else in the cache dir."""
        home = RAM if self._ram_room_for_landing(size) else DISK
        tier = self.new_backing(home)
        try:
            os.ftruncate(tier.fd, size)
        except OSError:
            self._drop_backing(tier)
            raise
        if home == RAM:
            tier.charged_bytes = size
            self.tiers[RAM].outside += size
        tier.filling = True
        return tier

    def landed(self, index: int) -> None:
        """The fetches into backing file ``index`` are over: count what it takes; it goes if
        nothing landed."""
        tier = self.backing.get(index)
        if tier is not None:
            tier.filling = False
            self.measure_backing(tier)
            self.drop_backing_if_unused(tier)

    async def alloc_for(self, content: Content, index: int) -> BlockRef:
        """A fresh block for block ``index`` of ``content`` fetched from the store: its place in
        the file the content is landing in, if it is (``new_landing``), else an arena slot."""
        tier = self.backing.get(content.landing) if content.landing is not None else None
        if tier is not None:
            return self.hold_backing(tier, index)
        return await self.alloc()

    def measure_backing(self, tier: BackingTier) -> None:
        """Count what the file takes now against its tier's budget (the disk's, or the RAM's)."""
        self.tiers[tier.home].outside += tier.measure()

    def drop_backing_if_unused(self, tier: BackingTier) -> None:
        if tier.unused() and tier.index in self.backing:
            self._drop_backing(tier)

    def _drop_backing(self, tier: BackingTier) -> None:
        del self.backing[tier.index]
        self.tiers[tier.home].outside -= tier.charged_bytes
        tier.path.unlink(missing_ok=True)
        self._closer.submit(tier.close, False)
        self._freed_at = time.monotonic()
        self.notify_space()

    def backing_of(self, content: Content) -> BackingTier | None:
        """The backing file that is ``content`` whole (every block in place), if there is one."""
        blocks = content.blocks
        if not blocks or content.remote or blocks[0] is None or blocks[0][0] < backing.FIRST_TIER:
            return None
        tier = self.backing.get(blocks[0][0])
        if tier is None or any(ref != (tier.index, i) for i, ref in enumerate(blocks)):
            return None
        return tier if tier.size() == content.size else None

    def disk_nearly_full(self) -> bool:
        """Whether the cache dir's filesystem has less than a block free (a writer the kernel
        serves itself may have failed with ENOSPC: the daemon does not see its writes)."""
        st = os.statvfs(self.working_dir)
        return st.f_bfree * st.f_frsize < self.block_size

    def room_for_file(self, nbytes: int) -> bool:
        """Whether a working copy of about ``nbytes`` fits in the disk budget now (clean data
        evicted to make room), and on the cache dir's filesystem."""
        disk = self.tiers[DISK]
        while disk.charged_bytes + disk.outside + nbytes > disk.budget:
            if not self._evict(prefer_tier=DISK):
                return False
        st = os.statvfs(self.working_dir)
        return st.f_bavail * st.f_frsize >= nbytes

    def disk_files(self) -> list[int]:
        """On the loop: descriptors of our own (the caller passes them to ``sync_disk``, which
        closes them) of what a journal record may name on disk besides the disk arena: the
        committed backing files, and their directory while it has new names (a new file's name
        survives a power cut once its directory is synced)."""
        fds = [os.dup(tier.fd) for tier in self.backing.values() if tier.slots and tier.home == DISK]
        if self._new_names:
            self._new_names = False
            fds.append(os.open(self.working_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        return fds

    def sync_disk(self, fds: list[int]) -> None:
        """From a thread: fsync the disk arena and ``fds`` (``disk_files``), closing them; before
        the journal is synced, so a synced record never names bytes that were not."""
        try:
            self.tiers[DISK].sync()
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    # -- allocation -----------------------------------------------------------------
    def try_alloc(self, only: int | None = None) -> BlockRef | None:
        """A free slot: RAM first (evicting clean RAM data), then disk; ``only`` forces a tier."""
        ram, disk = self.tiers
        if only is None and ram.charged_bytes + ram.outside + self.block_size > ram.budget:
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
        started, waited = time.monotonic(), False
        while (ref := self.try_alloc(only)) is None:
            if not self.policy.releases_pending():
                raise OSError(
                    errno.ENOSPC,
                    "the cache is full of files still open for writing: "
                    "raise --ram-cache/--cache-size or write fewer files at once",
                )
            left = math.inf
            if self.write_timeout is not None:
                left = max(started, self._freed_at) + self.write_timeout - time.monotonic()
                if left <= 0:
                    raise OSError(
                        errno.ENOSPC,
                        f"the cache is full of data not yet in the store and none "
                        f"was uploaded for {self.write_timeout:g} s (--write-timeout): "
                        "is the store down? see 'ckptfs status'",
                    )
            if not waited:
                self.space_waits, waited = self.space_waits + 1, True
            self.waiters += 1
            try:
                with trio.move_on_after(left):
                    await self._space.wait()
            finally:
                self.waiters -= 1
        return ref

    def writable_in_place(self, ref: BlockRef) -> bool:
        """Whether a working copy may write block ``ref`` where it is: it holds the only reference,
        and it is an arena slot (a backing file's block may be read by the kernel: copied first)."""
        return self.refcounts[ref] == 1 and ref[0] < backing.FIRST_TIER

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
        tier = self.tier(ref[0])
        tier.release(ref[1])
        if isinstance(tier, BackingTier):
            if tier.unused():
                self._drop_backing(tier)
            else:
                self.measure_backing(tier)  # (a block punched out)
        self._freed_at = time.monotonic()
        self._space.set()
        self._space = trio.Event()

    def fit(self, ref: BlockRef, length: int) -> None:
        """Block ``ref`` holds ``length`` bytes for good (see Tier.fit)."""
        if length < self.block_size:
            self.tier(ref[0]).fit(ref[1], length)
            self.notify_space()

    def fit_last(self, content: Content) -> None:
        """``content``'s last block is as long as it will be: charge only what it holds."""
        if content.blocks and content.blocks[-1] is not None:
            self.fit(content.blocks[-1], content.block_length(len(content.blocks) - 1))

    # -- clean data -------------------------------------------------------------------
    def mark_clean(
        self, owner: object, content: Content, on_evict: Callable[[], None], whole: bool = True
    ) -> None:
        """``content`` is in the store: its blocks may go. ``whole=False`` (a file open for
        reading): one block at a time, lowest index first (behind a sequential reader)."""
        self.clean[owner] = (content, on_evict, whole)
        self.clean.move_to_end(owner)
        if self.tiers[DISK].outside:  # (a file the kernel wrote may have taken the disk tier past its budget)
            self.room_for_file(0)
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
        latest checkpoint's only when nothing else is left. One pass, the pinning asked only of
        contents that hold such a block: a save of many small files can evict on every
        allocation, with hundreds of clean files to pass over."""
        first_pinned = None
        for owner, (content, on_evict, whole) in self.clean.items():
            if whole and content.in_use:
                continue  # (a read is gathering blocks of it: see Content.reading)
            held = [
                i
                for i, r in enumerate(content.blocks)
                if r is not None and prefer_tier in (None, self._home(r[0])) and i not in content.in_use
            ]
            if not held:
                continue
            if not self.policy.pinned(owner):
                self._drop_clean(owner, content, on_evict, whole, held[0])
                return True
            if first_pinned is None:
                first_pinned = (owner, content, on_evict, whole, held[0])
        if first_pinned is not None:
            self._drop_clean(*first_pinned)
            return True
        return False

    def _drop_clean(
        self, owner: object, content: Content, on_evict: Callable[[], None], whole: bool, first_held: int
    ) -> None:
        if whole:
            del self.clean[owner]
            on_evict()
            content.drop_blocks()
        else:  # (the entry stays: the reader fetches more blocks into it)
            ref = content.blocks[first_held]
            assert ref is not None  # first_held indexes a held block (see _evict)
            self.decref(ref)
            content.blocks[first_held] = None

    # -- block I/O ----------------------------------------------------------------------
    def write(self, ref: BlockRef, offset: int, data) -> None:
        self.tier(ref[0]).write(ref[1], offset, data)

    def prepare_write(self, ref: BlockRef, offset: int, length: int) -> None:
        self.tier(ref[0]).prepare(ref[1], offset, length)

    def pwrite(self, ref: BlockRef, offset: int, data) -> None:
        """A prepared write's copy, from any thread (``Tier.pwrite``)."""
        self.tier(ref[0]).pwrite(ref[1], offset, data)

    def fill(self, ref: BlockRef, data) -> None:
        """``Tier.fill``: a fresh block's bytes, from a worker thread."""
        self.tier(ref[0]).fill(ref[1], data)

    def read(self, ref: BlockRef, offset: int, length: int) -> bytes:
        return self.tier(ref[0]).read(ref[1], offset, length)

    def read_into(self, ref: BlockRef, offset: int, out: memoryview) -> None:
        self.tier(ref[0]).read_into(ref[1], offset, out)

    def locate(self, ref: BlockRef, offset: int) -> tuple[int, int, bool]:
        """Where byte ``offset`` of a block is: its file's descriptor and position, and whether
        the file may end before the block does (a working file: its hole; an arena never does).
        A store worker reads or writes it there (transfer/workers.py)."""
        tier = self.tier(ref[0])
        return tier.fd, ref[1] * self.block_size + offset, ref[0] >= backing.FIRST_TIER

    def send_to(self, ref: BlockRef, length: int, out_fd: int, out_pos: int) -> None:
        """``Tier.send_to``: a block's bytes into another file, from a worker thread."""
        self.tier(ref[0]).send_to(ref[1], length, out_fd, out_pos)

    def view(self, ref: BlockRef, length: int):
        return self.tier(ref[0]).view(ref[1], length)

    def view_range(self, ref: BlockRef, offset: int, length: int) -> memoryview:
        """A view of part of a RAM block (no copy)."""
        tier = self.tier(ref[0])
        assert tier.mm is not None  # only called for RAM blocks: the RAM tier is mapped
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

    async def on_disk(self, content: Content, copy_files: bool = False) -> Content:
        """The same bytes with every block on the disk tier (RAM blocks copied), for fsync.
        ``copy_files``: blocks of backing files too (a working file still written).
        The caller holds ``content`` until this returns."""
        blocks: list[BlockRef | None] = []
        copies: list[tuple[BlockRef, BlockRef, int]] = []
        for i, ref in enumerate(content.blocks):
            if ref is None or ref[0] == DISK or (ref[0] != RAM and not copy_files):
                if ref is not None:
                    self.incref(ref)
                blocks.append(ref)
                continue
            new = await self.alloc(only=DISK)
            copies.append((ref, new, content.block_length(i)))
            blocks.append(new)

        def copy_all() -> None:
            for c in copies:
                self.copy_block(*c)

        await trio.to_thread.run_sync(copy_all)
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
            log.warning(
                "the RAM tier's filesystem (%s) cannot hold more (%s): RAM tier shrunk from %s to %s "
                "for this mount; the rest goes to the disk tier (free space there, or remount with "
                "a smaller --ram-cache or another --shm-dir)",
                ram.path.parent,
                ram.backing_error,
                _fmt(before),
                _fmt(ram.budget),
            )

    def expect_writes(self, nbytes: int) -> None:
        """A save of ``nbytes`` happened: keep that many free RAM slots touched for the next one."""
        slots = min(n_blocks(nbytes, self.block_size), self.tiers[RAM].budget // self.block_size)
        if slots > self.populate_ahead:
            self.populate_ahead = slots
        self._populate_wanted.set()

    def _next_untouched(self) -> int | None:
        ram = self.tiers[RAM]
        if ram.mm is None:
            return None
        for slot in reversed(ram.free[-self.populate_ahead :] if self.populate_ahead else []):
            if slot not in ram.touched:  # (the free list is taken from its end)
                return slot if ram.room_to_touch(self.block_size) else None
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
        return self.tier(ref[0]).slot_bytes(ref[1])

    def usage(self) -> dict:
        out: dict[str, object] = {}
        for tier in self.tiers:
            out[TIER_NAMES[tier.index]] = {"used": tier.charged_bytes + tier.outside, "budget": tier.budget}
        out["working_files"] = {"files": len(self.backing), "bytes": self.tiers[DISK].outside}
        out["clean_bytes"] = sum(self.charged(r) for c, *_ in self.clean.values() for r in c.refs())
        out["writers_waiting"] = self.waiters
        out["space_waits"] = self.space_waits
        return out

    def close(self) -> None:
        self._closer.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
        for file in self.backing.values():
            file.close(remove=file.home == RAM)  # (the journal or the clean index may name the others)
        self.backing.clear()


def _fmt(nbytes: int) -> str:
    return humanfriendly.format_size(nbytes, binary=True)


def _arena_id(path: Path) -> str:
    """Identifies this incarnation of the RAM arena: a reboot empties tmpfs and makes a new one."""
    try:
        return private_files.read_file(path, 64).decode(errors="replace").strip()
    except FileNotFoundError:
        new = uuid.uuid4().hex
        private_files.write_file(path, new.encode())
        return new
