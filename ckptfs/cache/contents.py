"""A file's content in the cache: ``Content``, a committed file's blocks (shared by reference
count, read by many), and ``StagedFile``, the private writable copy behind one open-for-write
handle (copy on write of the blocks it shares with a committed ``Content``; change stamps for
streamed uploads). Both hold the ``cache.Cache`` whose blocks they are (an argument, not an
import: the cache makes Contents, so it is the one above).
"""

from __future__ import annotations

import contextlib
import errno
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.blocks import BlockRef, block_length, blocks_touched, n_blocks
from ckptfs.cache.arena import RAM

if TYPE_CHECKING:
    import trio


@dataclass
class BlockCopy:
    """Bytes of a write bound for one block of a working copy (``StagedFile.reserve``)."""

    index: int
    ref: BlockRef
    start: int
    data: memoryview


class Content:
    """An immutable committed file content: its size and blocks.

    ``blocks[i]`` is None when block i is not cached: a hole (zeros) for a file that
    is only local, or bytes still in the store when ``in_store`` is set. Holders
    (the namespace version, a pending upload, open readers) call hold/release;
    the blocks go back to the cache with the last release.
    """

    def __init__(self, cache, size: int, blocks: list[BlockRef | None], in_store: bool = False):
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
        self.in_use: Counter[int] = Counter()  # blocks reads are gathering (eviction passes them by)
        # The backing file (cache/backing.py: its tier number) its fetched blocks land in while
        # it is fetched whole for a passthrough open (model/files.py ``land_whole``), and that
        # fetch's end.
        self.landing: int | None = None
        self.landing_done: trio.Event | None = None

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
        return [i for i in blocks_touched(offset, end, bs) if self.blocks[i] is None]

    @contextlib.contextmanager
    def reading(self, offset: int, length: int):
        """While a read gathers its blocks, eviction passes them by: a read of more blocks than
        the RAM tier holds would otherwise evict its own first block to fetch its last, and
        fetch that one again, forever (the disk tier takes what RAM cannot)."""
        touched = blocks_touched(offset, min(offset + length, self.size), self.cache.block_size)
        self.in_use.update(touched)
        try:
            yield
        finally:
            self.in_use.subtract(touched)
            self.in_use += Counter()  # (drops the zeros)
            self.cache.notify_space()  # (an allocation may have found only these blocks to evict)

    def holes(self, offset: int, length: int) -> bool:
        """Whether bytes [offset, offset + length) of a file not yet in the store are all hole
        (zeros no one wrote): the uploader sends such a part without reading or hashing it."""
        if self.in_store or length <= 0:
            return False
        touched = blocks_touched(offset, min(offset + length, self.size), self.cache.block_size)
        return all(self.blocks[i] is None and i not in self.remote for i in touched)

    def sparse(self) -> bool:
        """Whether a file not yet in the store has a hole of a block or more."""
        return not self.in_store and any(
            ref is None and i not in self.remote for i, ref in enumerate(self.blocks)
        )

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

    def pieces(self, offset: int, length: int) -> list[tuple[int | None, int, int, bool]]:
        """Where bytes [offset, offset + length) lie, as ``read_into`` would read them: (the
        descriptor of a cache file or None for a hole's zeros, position, length, whether the
        file may end before it: zeros then) per block."""
        bs = self.cache.block_size
        out: list[tuple[int | None, int, int, bool]] = []
        done = 0
        while done < length:
            index, start = divmod(offset + done, bs)
            n = min(bs - start, length - done)
            ref = self._block_ref(index)
            if ref is None:
                out.append((None, 0, n, True))
            else:
                fd, pos, short = self.cache.locate(ref, start)
                out.append((fd, pos, n, short))
            done += n
        return out

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

    def __init__(self, cache, base: Content | None = None):
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

    def written_ns(self) -> int:
        """(A working file's kernel writes show as its mtime: cache/backing.py. Every write
        here goes through the daemon, which sets the node's mtime itself.)"""
        return 0

    def evict(self, index: int, part: object) -> None:
        """Drop block ``index``, whose bytes are in the store as ``part`` of the stream's upload."""
        self.cache.decref(self.blocks[index])
        self.blocks[index] = None
        self.remote[index] = part

    def _check_local(self, first: int, last: int) -> None:
        if self.remote and any(first <= i <= last for i in self.remote):
            raise OSError(
                errno.EIO,
                "that part of the file was uploaded and evicted from the cache "
                "(cache full); it cannot change before the file is closed",
            )

    async def write(self, offset: int, data: bytes) -> int:
        copies = await self.reserve(offset, data)
        try:
            for copy in copies:
                self.cache.pwrite(copy.ref, copy.start, copy.data)
        except BaseException:
            self.abandon(copies)
            raise
        self.finish(copies)
        return len(data)

    async def reserve(self, offset: int, data) -> list[BlockCopy]:
        """The first half of a write: the blocks its bytes go into, made writable (copied on
        write, gaps zeroed) and held, the copies left to the caller (``cache.pwrite``, from any
        thread), nothing marked written yet. One write at a time between ``reserve`` and
        ``finish`` (or ``abandon``): the caller serialises them (``Writing.lock``)."""
        bs = self.cache.block_size
        end = offset + len(data)
        if data:
            self._check_local(offset // bs, (end - 1) // bs)
        view = memoryview(data)
        copies: list[BlockCopy] = []
        pos = offset
        try:
            while pos < end:
                index, start = divmod(pos, bs)
                take = min(bs - start, end - pos)
                ref = await self._writable_block(index)
                if start > self.valid[index]:  # a gap inside the block: zero it
                    self.cache.zero(ref, self.valid[index], start - self.valid[index])
                self.cache.prepare_write(ref, start, take)
                self.cache.incref(ref)  # (kept while the copy runs, whatever happens to the file)
                copies.append(BlockCopy(index, ref, start, view[pos - offset : pos - offset + take]))
                pos += take
        except BaseException:
            self.abandon(copies)
            raise
        return copies

    def finish(self, copies: list[BlockCopy]) -> None:
        """The second half: the copies landed; mark them written."""
        for copy in copies:
            if copy.index < len(self.blocks) and self.blocks[copy.index] is copy.ref:
                end = copy.start + len(copy.data)
                self.valid[copy.index] = max(self.valid[copy.index], end)
                self._stamp(copy.index)
                self.size = max(self.size, copy.index * self.cache.block_size + end)
        self.abandon(copies)

    def abandon(self, copies: list[BlockCopy]) -> None:
        """Let go of the blocks ``reserve`` held (after ``finish``, or instead of it)."""
        for copy in copies:
            self.cache.decref(copy.ref)
        copies.clear()

    async def _writable_block(self, index: int) -> BlockRef:
        while True:
            while len(self.blocks) <= index:
                self.blocks.append(None)
                self.valid.append(0)
                self.stamps.append(0)
            ref = self.blocks[index]
            if ref is not None and self.cache.writable_in_place(ref):
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
        keep = n_blocks(size, bs)
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
            want = block_length(self.size, i, self.cache.block_size)
            if ref is not None:
                if self.valid[i] < want:
                    # Shared blocks are never partially valid (copy on write makes them private).
                    self.cache.zero(ref, self.valid[i], want - self.valid[i])
                    self.valid[i] = want
                    self._stamp(i)
                self.cache.incref(ref)
            blocks.append(ref)
        count = n_blocks(self.size, self.cache.block_size)
        blocks += [None] * (count - len(blocks))
        content = Content(self.cache, self.size, blocks[:count])
        content.remote = {i: p for i, p in self.remote.items() if i < count}
        self.cache.fit_last(content)
        return content

    def discard(self) -> None:
        self._drop_blocks_from(0)
        self.size = 0
