"""The cache's two arenas: one pre-sized file each, carved into slots of ``block_size`` bytes.

The RAM tier lives on tmpfs, mapped once (views for hashing and for FUSE reads), but written
and copied out through the file (pwrite/preadv release the GIL: docs/architecture.md "What runs
where"); the NVMe tier in the cache dir (pread/pwrite, so its pages never count against the daemon's
RSS). A ``Tier`` keeps its free slots and the bytes charged to its budget: a RAM slot costs a
whole block (its pages stay, for reuse), a disk slot only the pages its block holds once that
is known for good (the rest is punched out). The disk arena grows by a slot whenever its budget
has room and no slot is free.
``cache.Cache`` allocates from the tiers and counts references; see its module doc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from pathlib import Path

from ckptfs.store.localfs import punch_hole
from ckptfs.util import private_files

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14 (the mmap module of Python 3.11 lacks the name)

RAM, DISK = 0, 1
PAGE = mmap.PAGESIZE  # the unit a disk slot's block is charged in
# The disk arena is sparse; past this apparent size small files wait for room (ext4: 16 TiB at most).
MAX_DISK_ARENA = 1 << 40
_FALLOC_FL_KEEP_SIZE = 0x01
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
TIER_NAMES = ("ram", "disk")


def in_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: what it costs the disk tier's budget."""
    return -(-nbytes // PAGE) * PAGE


def pwrite_all(fd: int, data, pos: int) -> None:
    """All of ``data`` at ``pos`` (a signal may cut a large write short)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, pos)
        view, pos = view[written:], pos + written


def send_range(fd: int, path: Path, pos: int, length: int, out_fd: int, out_pos: int) -> None:
    """Bytes [pos, pos + length) of ``fd`` into ``out_fd`` at ``out_pos``, in the kernel (sendfile:
    no bytes through Python, the GIL released; callable from a worker thread)."""
    end = pos + length
    os.lseek(out_fd, out_pos, os.SEEK_SET)
    while pos < end:
        sent = os.sendfile(out_fd, fd, pos, end - pos)
        if sent == 0:
            raise OSError(errno.EIO, f"short read from {path}")
        pos += sent


def _address_of(mm: mmap.mmap) -> int:
    """Where the map starts (the ctypes view is dropped at once: a live one would keep the map
    from closing)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


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
        # Budget bytes taken outside the arena: working copies' files (disk), files fetched whole (RAM).
        self.outside = 0
        self.fd = private_files.open_file(path, os.O_RDWR | os.O_CREAT)  # the caller checked its directory
        # Never shrink: slots beyond a smaller new budget may still hold committed data.
        self.file_size = max(os.fstat(self.fd).st_size, self.n_slots * block_size)
        if self.file_size:
            os.ftruncate(self.fd, self.file_size)
        self.mm = mmap.mmap(self.fd, self.file_size) if mapped and self.file_size else None
        self._map_address = _address_of(self.mm) if self.mm is not None else 0
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
            if (
                _libc.fallocate(
                    self.fd,
                    _FALLOC_FL_KEEP_SIZE,
                    ctypes.c_long(slot * self.block_size),
                    ctypes.c_long(self.block_size),
                )
                == 0
            ):
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
        assert self.mm is not None  # (only the RAM tier, which is mapped, is populated)
        if self.mm.closed:
            return False
        # libc's madvise through ctypes, not mmap.madvise: the kernel zeroes the slot's pages
        # meanwhile (0.75 s/GiB here), and ctypes releases the GIL for it, mmap does not.
        address = self._map_address + slot * self.block_size
        if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(self.block_size), MADV_POPULATE_WRITE):
            # kernels before 5.14 (a populate failure is an error, never a signal)
            log.debug("cannot populate %s: %s", self.path, os.strerror(ctypes.get_errno()))
        return True

    def held_bytes(self) -> int:
        """What the arena file already takes on its filesystem (pages kept from the last mount)."""
        return os.fstat(self.fd).st_blocks * 512

    def reset_free(self, used: set[int]) -> None:
        if self.mm is None and used:  # disk slots past the budget's are in use, not retired
            self.n_slots = max(self.n_slots, max(used) + 1)
        # Pop from the end: low slots first, so a small working set stays in touched pages.
        self.free = [s for s in range(self.n_slots - 1, -1, -1) if s not in used]

    def room_to_touch(self, nbytes: int) -> bool:
        """RAM: whether the tmpfs may take ``nbytes`` more pages within the budget. The arena's
        pages stay (touched slots are never punched; a kept RAM tier's come from the last mount),
        files beside it (``outside``: files fetched whole) take theirs."""
        held = max(self.held_bytes(), len(self.touched) * self.block_size)
        return held + self.outside + nbytes <= self.budget

    def take(self) -> int | None:
        """A free slot, charged a whole block (its final length is not known yet); None when
        the budget has no room for one."""
        if self.charged_bytes + self.outside + self.block_size > self.budget:
            return None
        if self.mm is not None and self.outside and self.free and self.free[-1] not in self.touched:
            if not self.room_to_touch(self.block_size):  # (only a slot that has its pages, then)
                touched = [i for i, s in enumerate(self.free) if s in self.touched]
                if not touched:
                    return None
                self.free.append(self.free.pop(touched[-1]))
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

    def slot_bytes(self, slot: int) -> int:
        return self.charged.get(slot, 0)

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

    def prepare(self, slot: int, offset: int, length: int) -> None:
        """The bookkeeping of a write (on the loop), so that ``pwrite`` may run in any thread."""
        if self.mm is None and offset + length > self.charged.get(
            slot, 0
        ):  # a fitted block written again past its end
            self.charge(slot, min(in_pages(offset + length), self.block_size))

    def pwrite(self, slot: int, offset: int, data) -> None:
        """The copy of a prepared write, through the file (the GIL released; any thread)."""
        self._pwrite_all(data, slot * self.block_size + offset)

    def write(self, slot: int, offset: int, data) -> None:
        pos = slot * self.block_size + offset
        if self.mm is not None:
            # Through the file, not the map, even where the map's pages exist: the GIL is
            # released for the copy, so upload threads run beside the FUSE loop (issue 32,
            # docs/architecture.md "What runs where"); and for pages never touched through the
            # map, tmpfs takes a whole page without zeroing it first and without a page fault
            # per page (a fresh mount's first save: 279k faults per GiB through the map, 23k
            # this way; docs/benchmarks.md).
            self._pwrite_all(data, pos)
            return
        end = offset + len(data)
        if end > self.charged.get(slot, 0):  # a fitted block written again past its end (rare)
            self.charge(slot, min(in_pages(end), self.block_size))
        self._pwrite_all(data, pos)

    def fill(self, slot: int, data) -> None:
        """Write a freshly taken slot's block from its start through the file, not the map: the
        GIL is released for the copy (callable from a worker thread: no bookkeeping here, the
        slot was charged a whole block when taken) and tmpfs takes the bytes without a page
        fault per page of the map (a fresh mount's RAM slots have never been mapped)."""
        self._pwrite_all(data, slot * self.block_size)

    def _pwrite_all(self, data, pos: int) -> None:
        pwrite_all(self.fd, data, pos)

    def read(self, slot: int, offset: int, length: int) -> bytes:
        pos = slot * self.block_size + offset
        if self.mm is not None:
            return self.mm[pos : pos + length]
        return os.pread(self.fd, length, pos)

    def read_into(self, slot: int, offset: int, out: memoryview) -> None:
        """Copy into a caller's buffer: no new bytes object (fresh memory is slow here), through
        the file in both tiers, so the GIL is released for the copy (a part's body is read so)."""
        pos = slot * self.block_size + offset
        if os.preadv(self.fd, [out], pos) != len(out):
            raise OSError(errno.EIO, f"short read from {self.path}")

    def send_to(self, slot: int, length: int, out_fd: int, out_pos: int) -> None:
        """Copy a block's first ``length`` bytes into another file at ``out_pos`` (``send_range``)."""
        send_range(self.fd, self.path, slot * self.block_size, length, out_fd, out_pos)

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
        if err := punch_hole(self.fd, pos, length):
            log.debug("cannot punch a hole in %s: %s", self.path, os.strerror(err))

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
                log.warning(
                    "%s: still in use by a thread at close (mapped until the daemon exits)", self.path
                )
        os.close(self.fd)
