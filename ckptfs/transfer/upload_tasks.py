"""The uploader's records: a pending op's progress (``Task``), a multipart upload (``Upload``),
the parts of a file still open for writing (``Stream``), and the reused request bodies of parts
(``PartBuffers``). Plain state; ``uploader.Uploader`` and its ``PartSender`` and ``Encoder`` act
on it. Which parts a file has is ``ckptfs/parts.py``'s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ckptfs.blocks import BlockRef
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import PUT, Op
from ckptfs.parts import PartLayout
from ckptfs.store.base import PartInfo


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

    def __init__(self, key: str, layout: PartLayout):
        self.key = key  # the upload goes under the key the file had when streaming began
        # Its parts: the grown layout (ckptfs/parts.py), whose first parts are the uniform one's.
        self.layout = layout
        # Blocks handed over (and held) for parts not complete yet: part index -> {block: (ref, stamp)}
        self.filling: dict[int, dict[int, tuple[BlockRef, int]]] = {}
        self.meta: dict[str, str] = {}  # the file's attributes for the upload's metadata (no mtime yet)
        self.upload: Upload | None = None
        # block index -> (its change stamp, the part holding it): a part of k blocks has k entries
        self.sent: dict[int, tuple[int, PartInfo]] = {}
        self.sending: set[int] = set()  # part indexes on their way
        self.idle = trio.Event()
        self.idle.set()
        self.creating = trio.Lock()
        self.scopes: set[trio.CancelScope] = set()  # one per part on its way
        self.closed = False  # adopted by a commit or abandoned: no new parts
        self.abandoned = False
        # A file the kernel writes itself (passthrough): no change stamps. Each part sent keeps
        # the xxh3 of the bytes it carried, and the commit keeps only the parts whose bytes are
        # still those (read and hashed again: ``PartSender._adopt_stream``).
        self.verify = False
        self.digests: dict[int, str] = {}  # part index -> part_hash of what was sent

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
        self.layout = PartLayout.uniform_of(1)  # set by Uploader.submit
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
        return self.op.kind == PUT and self.op.size > self.layout.size(0)

    def n_parts(self) -> int:
        return self.layout.count(self.op.size)

    def part_bounds(self, index: int) -> tuple[int, int]:
        """Part ``index`` as (start, length)."""
        return self.layout.bounds(index, self.op.size)


INLINE_BYTES = 256 << 10  # hashed or copied on the trio thread up to this size


async def in_thread_if_large(limiter: trio.CapacityLimiter, nbytes: int, fn: Callable, *args):
    """``fn(*args)``, a hash or copy of ``nbytes`` of cached data: in a worker thread, or on the
    trio thread when small (a thread's round trip, two wake-ups, costs more on this VM than
    hashing or copying INLINE_BYTES: a save of many small files waits on the trio thread)."""
    if nbytes <= INLINE_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
