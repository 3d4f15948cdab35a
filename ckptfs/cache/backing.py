"""Working copies that are files of their own, so the kernel writes them itself (FUSE
passthrough): ``BackingTier``, one such file seen as a tier of the cache (block i is bytes
[i x block, (i + 1) x block) of the file: its slot i), and ``WorkingFile``, the working copy
behind a file open for writing that lives in one (docs/architecture.md, "Passthrough writes").

The files live in ``<cache dir>/working/``, on the disk tier's filesystem: the kernel's page
cache is their RAM tier (dirty-page throttling is the writers' backpressure), and what they take
on disk counts against ``--cache-size``. A committed version keeps its file as its blocks, never
written again: the next ``O_TRUNC`` writer gets a new file, any other writer copies the blocks it
changes into the arenas (copy on write, as for any shared block). A file goes when no version,
upload or reader holds a block of it; one the kernel still reads from lives on, unlinked, until
that reader closes.

A version read cold from the store may be fetched whole into such a file too (``Cache.new_landing``,
model/files.py ``land_whole``): its blocks land at their own positions, and once all are there the
kernel reads the file itself, as it does a committed working copy. Such a file lives on the RAM
tier's tmpfs when the RAM budget has room for it beside the arena's pages, and counts against
that budget: fetched bytes written there cost the store worker about half the CPU they cost into
an ext4 file (docs/architecture.md, "Cold opens fetched whole"). It is never reopened after a
restart.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ckptfs.blocks import BlockRef, n_blocks
from ckptfs.cache.arena import DISK, pwrite_all, send_range
from ckptfs.cache.contents import BlockCopy, Content
from ckptfs.store.localfs import punch_hole
from ckptfs.util import private_files

log = logging.getLogger(__name__)

WORKING_DIR = "working"
FIRST_TIER = 2  # a backing file's tier number: past the two arenas (RAM 0, disk 1); its file name


class BackingTier:
    """One working copy's file, with the block I/O of ``arena.Tier`` at fixed positions."""

    mm = None  # (never mapped: read and written through the file)

    def __init__(self, index: int, path: Path, fd: int, block_size: int, home: int = DISK):
        self.index = index
        self.path = path
        self.fd = fd
        self.block_size = block_size
        # The arena whose budget its bytes count against, on whose filesystem it lives: the disk
        # tier's, or the RAM tier's tmpfs for a file fetched whole that fits (``Cache.new_landing``).
        self.home = home
        self.slots: set[int] = set()  # blocks the cache counts references to
        self.writer = False  # a working copy still writes it
        self.filling = False  # a version is being fetched whole into it (``Cache.new_landing``)
        # Handed to the kernel for an open that can read it (and map it: a mapping outlives the
        # open): no hole is ever punched in it then; before, a block no one holds is punched out.
        self.exposed = False
        self.charged_bytes = 0  # what it takes on disk, as last measured (``measure``)

    def unused(self) -> bool:
        return not self.slots and not self.writer and not self.filling

    def measure(self) -> int:
        """The bytes it takes on disk now, less what was charged before (the caller's change)."""
        held = os.fstat(self.fd).st_blocks * 512
        change, self.charged_bytes = held - self.charged_bytes, held
        return change

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def slot_bytes(self, slot: int) -> int:
        return self.block_size if slot in self.slots else 0

    # -- block I/O, as arena.Tier's (positions fixed: slot i is block i) ------------------------
    def prepare(self, slot: int, offset: int, length: int) -> None:
        pass  # (nothing to charge: ``measure`` counts what the file takes)

    def pwrite(self, slot: int, offset: int, data) -> None:
        pwrite_all(self.fd, data, slot * self.block_size + offset)

    write = pwrite  # (cache.Cache.write: the same, here)

    def fill(self, slot: int, data) -> None:
        self.pwrite(slot, 0, data)

    def read(self, slot: int, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, slot * self.block_size + offset)
        return data if len(data) == length else data + bytes(length - len(data))  # (past EOF: a hole)

    def read_into(self, slot: int, offset: int, out: memoryview) -> None:
        got = os.preadv(self.fd, [out], slot * self.block_size + offset)
        if got < len(out):  # past the file's end: zeros, as a hole (a truncate raced a read)
            out[got:] = bytes(len(out) - got)

    def send_to(self, slot: int, length: int, out_fd: int, out_pos: int) -> None:
        send_range(self.fd, self.path, slot * self.block_size, length, out_fd, out_pos)

    def view(self, slot: int, length: int) -> bytes:
        return self.read(slot, 0, length)

    def fit(self, slot: int, length: int) -> None:
        pass

    def release(self, slot: int) -> None:
        """No one holds block ``slot`` any more: its space goes back to the filesystem, unless the
        file is still written or the kernel may read it (a hole would read as zeros there)."""
        self.slots.discard(slot)
        if not (self.writer or self.filling or self.exposed):
            if err := punch_hole(self.fd, slot * self.block_size, self.block_size):
                log.debug("cannot punch a hole in %s: %s", self.path, os.strerror(err))

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self, remove: bool) -> None:
        os.close(self.fd)
        if remove:
            self.path.unlink(missing_ok=True)


class WorkingFile:
    """The working copy of a file open for writing, in a backing file of its own: written by the
    kernel itself for passthrough opens (the daemon sees none of those writes) and by the daemon
    for the others (``reserve``), read likewise. Its size and last write time are the file's.
    Same face as ``contents.StagedFile`` where ``model/files.py`` uses it."""

    def __init__(self, cache, tier: BackingTier):
        self.cache = cache
        self.tier = tier
        tier.writer = True
        self.fd = tier.fd
        # What a StagedFile keeps for block streaming and eviction: nothing here (the file is
        # streamed by tailing it, model/tailing.py, and never evicted while written).
        self.blocks: list[BlockRef | None] = []
        self.stamps: list[int] = []
        self.changed: set[int] = set()
        self.valid: list[int] = []
        self.remote: dict[int, object] = {}

    @property
    def size(self) -> int:
        return self.tier.size()

    def evict(self, index: int, part: object) -> None:
        raise AssertionError("a working file holds no blocks to evict")  # (``blocks`` is empty)

    def written_ns(self) -> int:
        """When the file was last written (its mtime): the kernel writes it without telling us."""
        return os.fstat(self.fd).st_mtime_ns

    async def reserve(self, offset: int, data) -> list[BlockCopy]:
        """A daemon write (an open the kernel does not pass through): one copy, at its offset."""
        return [BlockCopy(0, (self.tier.index, 0), offset, memoryview(data))]

    def finish(self, copies: list[BlockCopy]) -> None:
        copies.clear()

    def abandon(self, copies: list[BlockCopy]) -> None:
        copies.clear()

    async def write(self, offset: int, data) -> int:
        self.tier.pwrite(0, offset, data)
        return len(data)

    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        return self.tier.read(0, offset, end - offset) if end > offset else b""

    async def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def snapshot(self) -> Content:
        """The committed version: this file's blocks, each held; a block that is all hole in the
        file is None, a hole of the version (never read nor sent: a sparse file stays cheap)."""
        size = self.size
        blocks: list[BlockRef | None] = [
            self.cache.hold_backing(self.tier, i) if data else None for i, data in enumerate(self._data(size))
        ]
        self.cache.measure_backing(self.tier)
        return Content(self.cache, size, blocks)

    def _data(self, size: int) -> list[bool]:
        """Which blocks of the file hold data (SEEK_DATA/SEEK_HOLE; all, where unsupported)."""
        bs = self.cache.block_size
        present = [False] * n_blocks(size, bs)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(self.fd, pos, os.SEEK_DATA)
                end = min(os.lseek(self.fd, start, os.SEEK_HOLE), size)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data past pos
                    break
                return [True] * len(present)  # (a filesystem that cannot tell)
            if start >= size:
                break
            for i in range(start // bs, (end - 1) // bs + 1):
                present[i] = True
            pos = end
        return present

    def block_ref(self, index: int) -> BlockRef:
        """Block ``index``, held (the caller lets go of it): for streaming it as a part."""
        return self.cache.hold_backing(self.tier, index)

    def sync(self) -> None:
        os.fsync(self.fd)

    def discard(self) -> None:
        self.tier.writer = False
        self.cache.drop_backing_if_unused(self.tier)


def new_file(directory: Path, index: int) -> tuple[Path, int]:
    path = directory / str(index)
    return path, private_files.open_file(path, os.O_RDWR, new=True)
