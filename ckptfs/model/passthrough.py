"""Complete cached versions as plain files, for FUSE passthrough reads.

With passthrough the kernel serves an open's reads (and mmap) straight from one regular file,
at the speed of that file's page cache, with no daemon CPU and no second copy in memory
(docs/architecture.md, "Passthrough reads"). The cache keeps a version as 8 MiB blocks spread
over its arenas, so a version complete in the cache is copied, when the machine is idle, into
one file of ``<cache dir>/passthrough/``: after the commit of a checkpoint a restart will load
(where prefill asked for it), and after an open of a complete version that found none. The
next read-only open of that version is answered with the file; until then opens go through the
daemon, as before.

Bound: ``budget`` bytes of such files (``--passthrough-cache``) and ``max_files`` of them (each
keeps a descriptor open: daemon/limits.py ``cached_file_budget``), the least recently opened
dropped first, and never the space the disk tier may still claim (``spare``). A file dropped
while the kernel still reads it lives on, unlinked, until that reader closes. The files are
made fresh at each mount (the directory is emptied at start).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ckptfs.util import private_files
from ckptfs.util.background import BackgroundThreads

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.2  # how often a waiting copy looks again whether the machine is idle


@dataclass
class ReadyFile:
    node: Any
    version: Any  # the node's version it holds
    fd: int
    path: Path
    size: int


def complete(content) -> bool:
    """Every byte of ``content`` is in the cache (a block not cached is a hole, not a part in the store)."""
    if content.remote:
        return False
    return not content.in_store or all(ref is not None for ref in content.blocks)


class PassthroughFiles:
    def __init__(
        self,
        directory: Path,
        budget: int,
        busy: Callable[[], bool],
        spare: Callable[[], int] = lambda: 1 << 62,
        max_files: int = 1 << 30,
    ):
        self.directory = directory
        self.budget = budget
        self.max_files = max_files
        # Bytes the cache dir's filesystem can give these files: its free space less what the
        # disk tier may still claim (the files never take the space writers will need).
        self.spare = spare
        self.busy = busy  # a save or an upload is running: copying would compete with it
        self.files: OrderedDict[int, ReadyFile] = (
            OrderedDict()
        )  # ino -> its file, least recently opened first
        self.queue: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # ino -> (node, version)
        self.used = 0
        self.built_bytes = 0
        self.copying = 0
        self.threads = BackgroundThreads(1, "ckptfs-passthrough")
        self.wakeup = trio.Event()
        # (turned off for the mount when the kernel refuses passthrough)
        self.on = budget > 0 and max_files > 0

    def start(self) -> None:
        """Empty the directory (files of the last mount describe versions this one may not have)."""
        if not self.on:
            return
        private_files.ensure_dir(self.directory, "passthrough dir")
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)

    def off(self) -> None:
        self.on = False
        self.queue.clear()
        self.close()

    def fd_for(self, node, touch: bool = True) -> int | None:
        """The file holding ``node``'s current version, if there is one (``touch``: it was opened)."""
        ready = self.files.get(node.ino)
        if ready is None or ready.version is not node.version:
            return None
        if touch:
            self.files.move_to_end(node.ino)
        return ready.fd

    def want(self, node, version) -> None:
        """Copy ``version`` of ``node`` into a file when idle (if it is complete by then). Not a
        version that is a working file already (cache/backing.py): the kernel reads that one."""
        if not self.on or version is None or version.content.size > self.budget:
            return
        if version.content.cache.backing_of(version.content) is not None:
            return
        ready = self.files.get(node.ino)
        if ready is not None and ready.version is version:
            return
        self.queue.pop(node.ino, None)
        self.queue[node.ino] = (node, version)
        self.wakeup.set()

    def forget(self, ino: int) -> None:
        """``ino`` is gone, or has a newer version: drop its file."""
        self.queue.pop(ino, None)
        ready = self.files.pop(ino, None)
        if ready is not None:
            self._remove(ready)

    def prune(self) -> None:
        """Drop the files of versions no longer current (replaced, renamed over, deleted)."""
        for ino, ready in list(self.files.items()):
            if not self._current(ready.node, ready.version, writer_ok=True):
                del self.files[ino]
                self._remove(ready)

    @property
    def queued_files(self) -> int:
        return len(self.queue) + self.copying

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.wakeup.wait()
            self.wakeup = trio.Event()
            while self.queue:
                while self.busy():
                    await trio.sleep(IDLE_POLL_S)
                if not self.queue:
                    break
                _, (node, version) = self.queue.popitem(last=True)  # the newest first
                self.copying = 1
                try:
                    await self._copy(node, version)
                except OSError as exc:  # the cache disk is full, say: the version goes through the daemon
                    log.info("no passthrough file for %s: %s", node.key(), exc)
                finally:
                    self.copying = 0

    def _current(self, node, version, writer_ok: bool = False) -> bool:
        return (
            node.version is version
            and not (node.unlinked or node.gone)
            and (writer_ok or node.writing is None)
        )

    async def _copy(self, node, version) -> None:
        content = version.content
        self.prune()
        if not self._current(node, version) or not complete(content) or content.cache.backing_of(content):
            return
        old = self.files.pop(node.ino, None)
        if old is not None:
            self._remove(old)
        while (
            self.used + content.size > self.budget
            or self.spare() < content.size
            or len(self.files) >= self.max_files
        ) and self.files:
            _, oldest = self.files.popitem(last=False)
            self._remove(oldest)
        if self.spare() < content.size:
            log.info("no passthrough file for %s: the cache disk has no room to spare for it", node.key())
            return
        path = self.directory / f"{node.ino}-{secrets.token_hex(6)}"
        fd = private_files.open_file(path, os.O_RDWR, new=True)
        ready = ReadyFile(node, version, fd, path, content.size)
        kept = False
        content.hold()
        try:
            os.ftruncate(fd, content.size)  # (blocks never written stay holes)
            cache = content.cache
            with content.reading(0, content.size):  # eviction passes these blocks by meanwhile
                for index, ref in enumerate(content.blocks):
                    while self.busy() and self._current(node, version):
                        await trio.sleep(IDLE_POLL_S)
                    if not self._current(node, version):
                        return
                    if ref is None:
                        continue
                    cache.incref(ref)  # the slot must not be reused while the kernel copies from it
                    try:
                        length = content.block_length(index)
                        await self.threads.run(cache.send_to, ref, length, fd, index * cache.block_size)
                    finally:
                        cache.decref(ref)
            if self._current(node, version):
                self.files[node.ino] = ready
                self.used += ready.size
                self.built_bytes += ready.size
                kept = True
        finally:
            content.release()
            if not kept:
                os.close(fd)
                path.unlink(missing_ok=True)

    def _remove(self, ready: ReadyFile) -> None:
        self.used -= ready.size
        os.close(ready.fd)
        ready.path.unlink(missing_ok=True)

    def close(self) -> None:
        while self.files:
            _, ready = self.files.popitem()
            self._remove(ready)

    def status(self) -> dict:
        self.prune()
        return {
            "files": len(self.files),
            "bytes": self.used,
            "budget": self.budget,
            "max_files": self.max_files,
            "copied_bytes": self.built_bytes,
            "queued_files": self.queued_files,
        }
