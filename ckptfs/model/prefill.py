"""Page-cache prefill: the latest checkpoint, once durable, is pushed into the kernel's page cache.

Writes bypass the kernel's page cache (direct I/O is what makes saves fast), so without this
the first ``torch.load`` after a save would pull every page through FUSE READ requests; on
these VMs filling fresh page-cache pages that way costs ~3 s/GiB (docs/machine-facts.md). So
when the machine is idle (no file open for writing, no upload pending) the daemon hands the
cached bytes to the kernel with FUSE notify_store, and the next open keeps them (keep_cache).

Consistency with Node.kernel_version (which decides keep_cache at open):
- a push starts only while no handle has the file open, so no reader of an older version can
  put its pages back; it first drops whatever the kernel holds for the file (invalidate), then
  names the version as the kernel's;
- each chunk is pushed from a thread; an open waits for the chunk in flight (``settle``), so an
  open that invalidates the page cache for a newer version comes after the last old page;
- the push stops at the first change (new version, a writer, the kernel forgot the inode).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import trio

from ckptfs.model.passthrough import PassthroughFiles
from ckptfs.util.background import BackgroundThreads

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.2  # how often a waiting push looks again whether the machine is idle


class KernelCache(Protocol):
    """What the daemon can tell the kernel about its caches (the FUSE session's notifications:
    daemon/run.py ``FuseKernelCache``, as only the daemon knows the session). Called from
    threads (the page calls) and the trio loop (``forget_name``), only while the mount serves."""

    def store_pages(self, ino: int, offset: int, data) -> None:
        """Put ``data`` into the page cache of inode ``ino`` at ``offset`` (notify_store)."""
        ...

    def invalidate_inode(self, ino: int) -> None:
        """Drop the pages and attributes the kernel caches for ``ino``."""
        ...

    def stat(self, key: str) -> object:
        """A stat of the file at store key ``key`` through the mount: the kernel sees its
        current attributes."""
        ...

    def forget_name(self, parent_ino: int, name: str) -> None:
        """Drop the kernel's entry for ``name`` in ``parent_ino`` (asynchronously)."""
        ...


class Prefill:
    """``kernel``: None (no FUSE channel, e.g. the namespace driven in process): prefill is off."""

    def __init__(
        self,
        busy: Callable[[], bool],
        kernel: KernelCache | None = None,
        files: PassthroughFiles | None = None,
    ):
        self.busy = busy  # a save or an upload is running: pushing would compete with it
        self.kernel = kernel
        # With passthrough reads the kernel reads a version from a file of its own, not from the
        # FUSE page cache: prefill makes that file instead of pushing pages (model/passthrough.py).
        self.files = files
        self.stopped = False  # (stop: no new pushes)
        self.threads = BackgroundThreads(1, "ckptfs-prefill")  # low priority: never before the job
        self.queue: OrderedDict[int, tuple[object, object]] = OrderedDict()  # ino -> (node, version)
        self.wakeup = trio.Event()
        self.in_flight: dict[int, trio.Event] = {}  # ino -> set when its chunk is in
        self.pushed_bytes = 0
        self.pushing = 0  # files being pushed now (0 or 1)
        # Pushes put off because the file was open (ino -> (node, version)): they go ahead when
        # its last handle closes, so a reader racing the push does not cancel it for good.
        self.deferred: dict[int, tuple[object, object]] = {}
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()

    def want(self, node, version) -> None:
        """Push ``version`` of ``node`` when idle (the newest request for a node wins)."""
        if self.files is not None and self.files.on:
            self.files.want(node, version)
            return
        if self.kernel is None or self.stopped:
            return
        self.queue.pop(node.ino, None)
        self.queue[node.ino] = (node, version)
        self.wakeup.set()

    async def settle(self, node) -> None:
        """Wait for the chunk of ``node`` being pushed, if any (called at open)."""
        event = self.in_flight.get(node.ino)
        if event is not None:
            await event.wait()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.CancelScope() as self._scope:
                task_status.started()
                while True:
                    await self.wakeup.wait()
                    self.wakeup = trio.Event()
                    while self.queue:
                        while self.busy():
                            await trio.sleep(IDLE_POLL_S)
                        if not self.queue:
                            break
                        ino, (node, version) = self.queue.popitem(last=True)  # the newest first
                        self.pushing = 1
                        try:
                            await self._push(node, version)
                        finally:
                            self.pushing = 0
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop pushing and wait for the call in flight. Called while the mount still answers
        FUSE requests: a stat or an invalidate through the mount waits for the daemon's own
        answer, and once the FUSE loop has stopped nobody would give it."""
        self.stopped = True  # no new pushes (want() is a no-op from now on)
        self.queue.clear()
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()

    def replaced(self, node) -> None:
        """``node`` has a new version: the file of the old one goes."""
        if self.files is not None:
            self.files.forget(node.ino)

    def closed(self, node) -> None:
        """``node``'s last handle closed: a push put off while it was open goes ahead."""
        deferred = self.deferred.pop(node.ino, None)
        if deferred is not None and self._current(*deferred):
            self.want(*deferred)

    @property
    def queued_files(self) -> int:
        """Files waiting for a push or being pushed (0: the page cache holds what it will)."""
        return len(self.queue) + self.pushing

    def _current(self, node, version) -> bool:
        return node.version is version and not node.unlinked and node.nlookup > 0

    async def _push(self, node, version) -> None:
        kernel = self.kernel
        if kernel is None or not self._current(node, version):
            return  # (no kernel: nothing was queued)
        if node.handles:
            self.deferred[node.ino] = (node, version)
            return
        content, cache = version.content, version.content.cache
        if not await self._in_thread(node, self._forget_pages, kernel, node.ino, node.key()):
            return
        if not self._current(node, version):
            return
        if node.handles:
            self.deferred[node.ino] = (node, version)
            return
        node.kernel_version = version
        for index in range(len(content.blocks)):  # one block at a time
            while self.busy() and self._current(node, version):
                await trio.sleep(IDLE_POLL_S)
            if not self._current(node, version) or node.kernel_version is not version:
                return
            ref = content.blocks[index]
            if ref is None:
                continue  # not cached (evicted): the kernel reads it through FUSE
            cache.incref(ref)  # the slot must not be reused while the kernel copies from it
            try:
                length = content.block_length(index)
                pushed = await self._in_thread(
                    node, self._store_block, kernel, node.ino, index * cache.block_size, cache, ref, length
                )
            finally:
                cache.decref(ref)
            if not pushed:
                return
            self.pushed_bytes += length

    def _forget_pages(self, kernel: KernelCache, ino: int, key: str) -> None:
        kernel.invalidate_inode(ino)
        # The kernel drops its cached pages whenever it sees a new mtime (auto_inval_data):
        # show it the current attributes now, not after the pages are in.
        kernel.stat(key)

    def _store_block(self, kernel: KernelCache, ino: int, offset: int, cache, ref, length: int) -> None:
        view = cache.view(ref, length)  # the RAM tier's own pages: no copy on our side
        try:
            kernel.store_pages(ino, offset, view)
        finally:
            if isinstance(view, memoryview):
                view.release()

    async def _in_thread(self, node, fn, *args) -> bool:
        done = self.in_flight[node.ino] = trio.Event()
        try:
            await self.threads.run(fn, *args)
            return True
        except OSError as exc:  # ENOENT: the kernel forgot the inode; ENOSYS: no support
            log.info("page-cache prefill of %s stopped: %s", node.key(), exc)
            return False
        finally:
            del self.in_flight[node.ino]
            done.set()
