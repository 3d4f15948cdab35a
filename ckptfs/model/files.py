"""File operations: open handles, reads, writes into the file's one working copy (shared by all
its writers: POSIX on the node), the commit when its last writer closes, fsync (local
durability through shadows), truncate and attributes."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import TypeVar, cast

import trio

from ckptfs.cache.arena import RAM
from ckptfs.cache.backing import WorkingFile
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import BlockCopy, Content, StagedFile
from ckptfs.errors import FsError, StoreUnreachable
from ckptfs.model.commits import Commits
from ckptfs.model.tree import Attr, Handle, Node, Writing, attr_metadata
from ckptfs.transfer.fetcher import Fetcher

log = logging.getLogger(__name__)
T = TypeVar("T")


def direct_writes(flags: int) -> bool:
    """Whether a writer's I/O bypasses the kernel page cache. Write-only handles (torch.save,
    every checkpoint writer): direct, the kernel hands us 1 MiB writes (0.94x of a discarding
    filesystem's torch.save against 0.56x through the page cache, docs/machine-facts.md).
    Read-write handles: through the page cache, so MAP_SHARED works (numpy.memmap r+/w+,
    HDF5); their mapped pages reach us at msync, munmap or close."""
    return flags & os.O_ACCMODE == os.O_WRONLY


def appends_here(flags: int) -> bool:
    """Whether the daemon puts a handle's writes at the end of the file itself. Only for direct
    O_APPEND handles, where every WRITE is a write() or pwrite(). Through the page cache the
    kernel places write() at the end (its size is the working copy's: all writers on the node
    go through it), and a WRITE may be a mapped page written back at its own offset."""
    return bool(flags & os.O_APPEND) and direct_writes(flags)


def drop_setid(mode: int) -> int:
    """``mode`` after a write by a process without CAP_FSETID, as a local disk leaves it (Linux's
    file_remove_privs): set-user-ID always goes, set-group-ID where group execute is set (without
    it, the bit marks mandatory locking, not a set-group-ID program). Regular files only."""
    if not stat.S_ISREG(mode):
        return mode
    kill = stat.S_ISUID | (stat.S_ISGID if mode & stat.S_IXGRP else 0)
    return mode & ~kill


def passes_through(flags: int) -> bool:
    """Whether a writer's open may be handed to the kernel with its working copy's file
    (passthrough writes): write-only, so it cannot map the file shared and change a version after
    its commit; a new content (created or truncated), so nothing is copied at open."""
    return flags & os.O_ACCMODE == os.O_WRONLY and bool(flags & (os.O_TRUNC | os.O_CREAT))


def drops_setid(flags: int, keeps_setid: bool) -> bool:
    """Whether a handle's writes must clear set-id bits here. Through the page cache the kernel
    does it itself (file_remove_privs: a SETATTR of the mode before the write); a direct write
    only flags the WRITE (FUSE_WRITE_KILL_SUIDGID), which the transport does not pass on, so the
    daemon clears them for an opener without the privilege (``keeps_setid``: CAP_FSETID, which
    the FUSE request does not carry: taken as uid 0)."""
    return direct_writes(flags) and not keeps_setid


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions in ``exc``, out of any (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


class Files:
    def __init__(self, commits: Commits, fetcher: Fetcher):
        self.commits = commits
        self.tree = commits.tree
        self.cache: Cache = commits.cache
        self.retention = commits.retention
        self.uploader = commits.uploader
        self.prefill = commits.prefill
        self.fetcher = fetcher
        # New contents of write-only opens go into files of their own that the kernel writes
        # itself (cache/backing.py), when the mount has passthrough (set by the namespace).
        self.passthrough_writes = False
        self.working_files = 0  # working copies made as files (status)
        self.kernel_written = 0  # bytes of the versions committed from them (the writes are not seen)
        self.largest_file = 0  # the largest file such a working copy committed (room kept at open)
        self.tailed: dict[Writing, Node] = {}  # working files being written (model/tailing.py)
        # A read-only open of a version not cached, up to this size, fetches it whole into a
        # file of its own that the kernel then reads itself (``land_whole``); 0: never.
        self.fetch_whole = 0
        self.whole_fetches = 0  # versions fetched whole that way (status)
        self.whole_fetched_bytes = 0

    def _new_working_copy(self, node: Node, flags: int, setid_ok: bool) -> StagedFile | WorkingFile:
        """A new, empty working copy: a file of its own where the kernel can write it and the
        disk budget has room for one like the last (else blocks in the arenas, whose writes wait
        for room: backpressure, then ENOSPC, as documented)."""
        expected = max(self.cache.block_size, self.largest_file, node.size())
        if (
            self.passthrough_writes
            and passes_through(flags)
            and setid_ok
            and self.cache.backing_room()
            and self.cache.room_for_file(expected)
        ):
            try:
                tier = self.cache.new_backing()
            except OSError as exc:  # (the cache dir's filesystem, or descriptors: in the arenas then)
                log.info("%s: its working copy goes in the cache's arenas (%s)", node.key(), exc)
            else:
                self.working_files += 1
                return WorkingFile(self.cache, tier)
        return StagedFile(self.cache)

    def writes_to_file(self, node: Node, flags: int) -> bool:
        """Whether a write-only open with ``flags`` would write ``node``'s working copy as a file
        the kernel may write itself (the file open already, or a new content)."""
        if not self.passthrough_writes or flags & os.O_ACCMODE != os.O_WRONLY:
            return False
        writing = node.writing
        if writing is not None and not (writing.frozen or writing.error):
            return isinstance(writing.staged, WorkingFile)
        return (
            passes_through(flags)
            and bool(flags & os.O_TRUNC or node.version is None)
            and self.cache.backing_room()
        )

    def _writing(self, node: Node, staged: StagedFile | WorkingFile) -> Writing:
        writing = Writing(staged)
        if isinstance(staged, WorkingFile):
            writing.seen_ns = staged.written_ns()
            self.tailed[writing] = node
        return writing

    def create(
        self, parent_ino: int, name: str, mode: int, flags: int, uid: int, gid: int, keeps_setid: bool = True
    ) -> tuple[Handle, Attr]:
        parent = self.tree.dir(parent_ino)
        if name in parent.children:
            raise FsError(
                errno.EEXIST
            )  # (O_EXCL or not: the kernel only sends create for names it found absent)
        self.tree.check_new_name(parent, name)
        node = self.tree.add(
            parent, name, is_dir=False, mode=stat.S_IFREG | (mode & 0o7777), uid=uid, gid=gid
        )
        node.nlookup += 1
        setid_ok = not drops_setid(flags, keeps_setid) or drop_setid(node.mode) == node.mode
        node.writing = self._writing(node, self._new_working_copy(node, flags, setid_ok))
        node.writing.dirty = True  # a created file exists once closed, even empty
        self.commits.writing(node.key())
        handle = self._open_handle(node, node.writing, None, appends_here(flags))
        handle.drops_setid = drops_setid(flags, keeps_setid)
        self.tree.touch(parent)
        return handle, self.tree.attr(node)

    async def open(
        self, ino: int, flags: int, keeps_setid: bool = True, kill_setid: bool = False
    ) -> tuple[Handle, bool, bool]:
        """A handle; whether the kernel may keep its cached pages of this file; whether the
        handle's I/O bypasses the kernel page cache (direct I/O: write-only handles).
        ``keeps_setid``: the opener's writes leave set-id bits alone (``drops_setid``);
        ``kill_setid``: an O_TRUNC open without CAP_FSETID, which clears them now."""
        node = self.tree.node(ino)
        if node.gone:  # deleted by another mount; the kernel's entry for it has not expired yet
            raise FsError(errno.ENOENT)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if kill_setid:
            self._drop_setid(node)
        if node.version is not None and node.version.content.verify:
            await self.retention.verify_kept(node.version.content)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            await self.prefill.settle(node)  # no page of an older version may land after our answer
            content = node.version.content if node.version is not None else Content(self.cache, 0, [])
            # Through the page cache (mmap works). While the file is open for writing its pages
            # hold the working copy, and its attributes are not cached: the kernel drops the
            # pages when a read finds the size or mtime changed (auto_inval_data).
            being_written = node.writing is not None
            keep_cache = (
                not being_written and node.version is not None and node.kernel_version is node.version
            )
            node.kernel_version = None if being_written else node.version
            return self._open_handle(node, None, content.hold(), False), keep_cache, False
        writing = node.writing
        # A frozen copy's parts belong to its upload, a poisoned one (a failed write) will never
        # commit: a new writer starts anew from the committed version.
        if writing is None or writing.frozen or writing.error:
            setid_ok = not drops_setid(flags, keeps_setid) or drop_setid(node.mode) == node.mode
            staged = await self._working_copy(node, flags, setid_ok)
            if node.writing is not None and not (node.writing.frozen or node.writing.error):  # made meanwhile
                staged.discard()
            else:
                node.writing = self._writing(node, staged)
            writing = node.writing
        if flags & os.O_TRUNC:
            if writing.staged.size:
                await self._truncate_working_copy(writing, 0)
            writing.dirty = True
            node.mtime_ns = node.ctime_ns = time.time_ns()
        node.kernel_version = None  # (its pages will hold the working copy)
        self.commits.writing(node.key())
        handle = self._open_handle(node, writing, None, appends_here(flags))
        handle.drops_setid = drops_setid(flags, keeps_setid)
        return handle, False, direct_writes(flags)

    async def _working_copy(self, node: Node, flags: int, setid_ok: bool) -> StagedFile | WorkingFile:
        if flags & os.O_TRUNC or node.version is None:
            return self._new_working_copy(node, flags, setid_ok)
        base = node.version.content
        base.hold()  # keep it while we fetch what is not cached
        try:
            await self._fetch_range(node, base, 0, base.size)
            return StagedFile(self.cache, base)
        finally:
            base.release()

    def _open_handle(
        self, node: Node, writing: Writing | None, content: Content | None, append: bool
    ) -> Handle:
        handle = self.tree.new_handle(node, writing, content, append)
        self.retention.keep(node)
        self.retention.maybe_clean(node)  # a reader: evictable block by block
        return handle

    async def read(self, fh: int, offset: int, size: int, view: bool = False) -> bytes | memoryview:
        handle = self.tree.handle(fh)
        writing = handle.writing or handle.node.writing  # every descriptor reads the working copy
        if writing is not None:
            return self._read_working_copy(writing, offset, size)
        # (A view only of what the handle still holds: the blocks of a version let go meanwhile
        # may be freed with our hold.)
        return await self._read_cached(
            handle,
            offset,
            size,
            lambda content: content.read(offset, size, view and content is handle.content),
        )

    async def read_into(self, fh: int, offset: int, out: memoryview) -> int:
        """``read`` into a caller's buffer (a FUSE reader's reply buffer, which no one else can
        change): the bytes filled; the copy out of the cache runs with the GIL released."""
        handle = self.tree.handle(fh)
        writing = handle.writing or handle.node.writing
        if writing is not None:
            data = self._read_working_copy(writing, offset, len(out))
            out[: len(data)] = data
            return len(data)

        def fill(content: Content) -> int:
            n = max(0, min(len(out), content.size - offset))
            content.read_into(offset, out[:n])
            return n

        return await self._read_cached(handle, offset, len(out), fill)

    async def read_begin(self, fh: int, offset: int, out: memoryview) -> int | PendingRead:
        """``read_into`` in two halves: the blocks fetched and held on the loop, the copy
        (``PendingRead.copy``, GIL released) in any thread, ``finish`` on the loop. A working
        copy's bytes are copied at once (the bytes filled come back)."""
        handle = self.tree.handle(fh)
        if handle.writing or handle.node.writing:
            return await self.read_into(fh, offset, out)

        def hold(content: Content) -> PendingRead:
            n = max(0, min(len(out), content.size - offset))
            guard = content.reading(offset, n)  # (eviction passes the blocks by until finish)
            guard.__enter__()
            return PendingRead(content.hold(), guard, offset, out[:n])

        return await self._read_cached(handle, offset, len(out), hold)

    @staticmethod
    def _read_working_copy(writing: Writing, offset: int, size: int) -> bytes:
        try:
            return writing.staged.read(offset, size)
        except OSError as exc:
            # (the working copy's reads fail with an errno: EIO, or the disk tier's own)
            raise FsError(cast(int, exc.errno), str(exc)) from None

    async def _read_cached(self, handle, offset: int, size: int, take: Callable[[Content], T]) -> T:
        """``take`` of the handle's version once every block of the range is cached."""
        reading = handle.content
        assert reading is not None  # no working copy: a reader, opened with the version it reads
        content = reading.hold()  # (a commit here may move the handle to a newer version meanwhile)
        try:
            await self._wait_for_evicted(content)
            if content.in_store:
                if offset == handle.read_end:  # sequential: keep the next blocks coming
                    self.fetcher.prefetch(content, (offset + size) // self.cache.block_size)
                handle.read_end = offset + size
                self.cache.touch(handle.node)  # the file being read goes last among clean data
                # Loop: a block fetched for this read may be evicted while the next one arrives
                # (only by another read's need: eviction passes over this read's blocks).
                with content.reading(offset, size):
                    while missing := content.missing(offset, size):
                        await self.fetcher.fill(content, missing)
            return take(content)  # (no await since the check: every block is there)
        finally:
            content.release()

    async def _wait_for_evicted(self, content: Content) -> None:
        """Parts evicted under cache pressure come back once the file is in the store."""
        while content.remote and not content.in_store:
            if content.orphaned:
                raise FsError(errno.EIO, "this version was replaced before it reached the store")
            await self.uploader.progress.wait()

    async def land_whole(self, fh: int) -> None:
        """Before answering a read-only open: fetch the version it reads, if none of it is cached
        and it is at most ``fetch_whole`` bytes that the disk budget has room for, into a file of
        its own (``Cache.new_landing``), where the kernel then serves the open's reads itself
        (FUSE passthrough: no READ request reaches the daemon). An open of a version already
        landing waits for that fetch. Cancellable (the opener was interrupted): what landed
        stays cached. An outage (``StoreUnreachable``) fails the open: its reads would wait out
        ``--read-timeout`` again. Any other failure (a part that never matches its checksum, a
        cache disk too full for the file) leaves the open to read through the daemon, where only
        the reads of what is wrong fail, as on a disk with a bad sector."""
        handle = self.tree.handle(fh)
        content = handle.content
        if content is None or handle.node.writing is not None:
            return
        if content.landing_done is not None:
            await content.landing_done.wait()
            return
        if not self.start_landing(content):
            return
        try:
            # The first block alone, first: its GET tells the object's checksums (no request
            # more), so the store workers, which fetch only what they can check, take the rest.
            await self._fetch_range(handle.node, content, 0, self.cache.block_size)
            await self._fetch_range(handle.node, content, 0, content.size)
        except Exception as exc:  # (the blocks are fetched at once: a group of failures)
            failures = _leaves(exc)
            if not all(isinstance(f, FsError | OSError) for f in failures) or any(
                isinstance(f, StoreUnreachable) for f in failures
            ):
                raise
            log.info("%s: not fetched whole at open (%s): read through the daemon", content.key, failures[0])
        finally:
            self.end_landing(content)

    def start_landing(self, content: Content, also: int = 0) -> bool:
        """Whether ``content`` is fetched into a file of its own from now (``land_whole``): none of
        it cached, at least a block and at most ``fetch_whole`` bytes, and room in the disk
        budget for it and ``also`` bytes more (other files landing with it: ``ckptfs warmup``)."""
        if not (
            content.in_store
            and not content.remote
            and content.landing is None
            # (a smaller file is a few READs: not worth a file, and its descriptor, of its own)
            and self.cache.block_size <= content.size <= self.fetch_whole
            and self.cache.backing_room()
            and all(ref is None for ref in content.blocks)
            and self.cache.room_for_landing(content.size, also)
        ):
            return False
        try:
            content.landing = self.cache.new_landing(content.size).index
        except OSError as exc:  # (the cache dir's filesystem: read through the daemon instead)
            log.info("%s: not fetched whole at open (%s): read through the daemon", content.key, exc)
            return False
        content.landing_done = trio.Event()
        return True

    def end_landing(self, content: Content) -> None:
        tier, done = content.landing, content.landing_done
        assert tier is not None and done is not None  # (after start_landing)
        content.landing = content.landing_done = None
        self.cache.landed(tier)
        done.set()
        whole = self.cache.backing_of(content)
        if whole is not None and whole.index == tier:
            self.whole_fetches += 1
            self.whole_fetched_bytes += content.size

    async def _fetch_range(self, node: Node, content: Content, offset: int, size: int) -> None:
        """Cache a range of ``content`` to build a writer's copy from: none of it may be evicted
        before the copy shares it (a file larger than the cache gets ENOSPC)."""
        self.retention.keep(node)
        try:
            # (Not cached is not a hole here: a block evicted to the version's upload, not yet
            # complete, must come from the store once it is, never read as zeros: issue 28.)
            await self._wait_for_evicted(content)
            while missing := content.missing(offset, size):
                await self.fetcher.fill(content, missing)
        finally:
            self.retention.maybe_clean(node)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        pending = await self.write_begin(fh, offset, data)
        try:
            pending.copy()
        except OSError as exc:
            return pending.finish(exc)
        return pending.finish()

    async def write_begin(self, fh: int, offset: int, data, kill_setid: bool = False) -> PendingWrite:
        """A write's first half, on the loop: its blocks taken (waiting for cache space) and held;
        the copy is ``PendingWrite.copy``, from any thread (a FUSE reader's: the GIL released),
        then ``finish`` on the loop. The file's other writes, commits, fsyncs and truncates wait
        for the write meanwhile (``Writing.lock``)."""
        handle = self.tree.handle(fh)
        writing = handle.writing
        if writing is None:
            raise FsError(errno.EBADF)
        await writing.lock.acquire()
        try:
            if writing.error:
                raise FsError(writing.error)
            if writing.frozen:
                raise FsError(errno.EIO, "this file was committed since it was opened: reopen it to write")
            if handle.append:
                offset = writing.staged.size
            node = handle.node
            if (handle.drops_setid or kill_setid) and drop_setid(node.mode) != node.mode:
                node.mode = drop_setid(
                    node.mode
                )  # (before the write, as the kernel does; the commit stores it)
            self._note_position(writing, offset, len(data))
            if writing.sequential:
                self._send_full_blocks(node, writing, offset)
            try:
                copies = await writing.staged.reserve(offset, data)
            except OSError as exc:
                raise self.failed_write(handle, exc) from None
        except BaseException:
            writing.lock.release()
            raise
        return PendingWrite(self, handle, writing, copies, len(data))

    def failed_write(self, handle: Handle, exc: OSError) -> FsError:
        """The cache disk is full or failing: the file is never committed torn."""
        assert handle.writing is not None
        handle.writing.error = exc.errno or errno.EIO
        log.error("write to %s failed: %s; the file will not be committed", handle.node.key(), exc)
        return FsError(handle.writing.error)

    async def settle_writes(self, fh: int) -> None:
        """Wait for the write of the handle's file whose copy is under way, if any (before a
        commit: it must not take a block half copied)."""
        handle = self.tree.handles.get(fh)
        writing = None if handle is None else handle.writing or handle.node.writing
        if writing is not None and writing.lock.value == 0:
            async with writing.lock:
                pass

    def _note_position(self, writing: Writing, offset: int, length: int) -> None:
        """A write of ``length`` bytes at ``offset``: the copy stops being sequential when it
        goes back behind the block holding its furthest byte so far (it may change the blocks
        it moved past: they are no longer streamed, nor evicted under pressure)."""
        bs = self.cache.block_size
        if writing.high_water and offset // bs < (writing.high_water - 1) // bs:
            writing.sequential = False
        writing.high_water = max(writing.high_water, offset + length)

    def _send_full_blocks(self, node: Node, writing: Writing, offset: int) -> None:
        """Streaming upload: blocks a writer filled and has moved past (it now writes at
        ``offset``) are sent at once; the commit re-sends any that change again."""
        staged = writing.staged
        bs = self.cache.block_size
        sealed = [
            i
            for i in staged.changed
            if i < offset // bs and staged.valid[i] == bs and staged.blocks[i] is not None
        ]
        if not sealed or node.unlinked:
            return
        if writing.stream is None:
            writing.stream = self.uploader.open_stream(node.key())
            writing.stream.meta = attr_metadata(node, mtime=False)  # (its mtime: the completion's)
        for index in sealed:
            staged.changed.discard(index)
            ref = staged.blocks[index]
            assert ref is not None  # sealed blocks are cached (filtered above)
            self.uploader.stream_part(writing.stream, index, ref, staged.stamps[index])
            if self.commits.replicator is not None:  # (--replicas: the peers' copy streams too)
                self.commits.replicator.seal(writing.serial, index, ref, bs, staged.stamps[index])

    def flush(self, fh: int, commit: bool = True) -> bool:
        """A close. The file is committed when every writer's opener has closed it (a clean
        file: a no-op); until then the other writers keep changing the one working copy.
        ``commit=False``: a close that is not the opener's last (a forked child's copy): only
        report a failed write. True if it committed a version."""
        handle = self.tree.handle(fh)
        writing = handle.writing
        if writing is None:
            return False
        self._check_kernel_writes(handle.node, writing)
        if writing.error:
            raise FsError(writing.error, "an earlier write failed: the file was not committed")
        if not commit:
            return False
        writing.closed.add(handle)
        return writing.handles <= writing.closed and self._commit(handle.node, writing)

    def _check_kernel_writes(self, node: Node, writing: Writing) -> None:
        """A working file the kernel writes: had the cache disk filled meanwhile, a write may have
        failed with ENOSPC without the daemon seeing it. Never commit it then (torn)."""
        if isinstance(writing.staged, WorkingFile) and not writing.error:
            if writing.disk_full or self.cache.disk_nearly_full():
                writing.error = errno.ENOSPC
                log.error(
                    "the cache disk filled while %s was written: it will not be committed",
                    writing.staged.tier.path.name,
                )

    def _commit(self, node: Node, writing: Writing) -> bool:
        node.note_writes()  # (the kernel's own writes to a working file)
        self._check_kernel_writes(node, writing)
        if not writing.dirty or writing.error:
            return False  # (never commit a torn file)
        writing.dirty = False
        if node.unlinked:
            return False  # written after unlink: nobody can see it
        content = writing.staged.snapshot()
        if content.remote:
            assert writing.stream is not None  # evicted blocks are parts of its streamed upload
            content.upload = writing.stream.upload
        if isinstance(writing.staged, WorkingFile):
            self.largest_file = max(self.largest_file, content.size)
            self.kernel_written += content.size
            # The file is the version now: never written again through this working copy. Later
            # writes of its handles (a writer's mapped pages written back, a joining opener) go
            # through the daemon into blocks copied on write; the next writer gets a new file.
            # The sealed file stays open as written until the last handle goes (release): a
            # forked child's descriptor may still write it through the kernel.
            sealed, writing.staged = writing.staged, StagedFile(self.cache, content)
            writing.sealed, writing.sealed_ns, writing.sealed_content = sealed, sealed.written_ns(), content
            self.tailed.pop(writing, None)
            writing.frozen = True  # (the next open starts a new working copy: a new file)
        self.commits.commit(node, content, writing)
        if writing.staged.remote:
            writing.frozen = True
        self._readers_follow(node)
        return True

    def _readers_follow(self, node: Node) -> None:
        """Descriptors open for reading read the version just committed here, as on a local
        disk (a version another mount put keeps its open readers on the one they opened). The
        one they had is let go at once (a read in progress holds it itself): a reader kept
        open across many saves pins no old versions in the cache."""
        version = node.version
        assert version is not None  # called right after a commit gave the node this version
        for handle in self.tree.handles.values():
            if handle.node is node and handle.writing is None and handle.content is not version.content:
                old, handle.content = handle.content, version.content.hold()
                assert old is not None  # no working copy: a reader, opened with a version
                old.release()

    def _recommit_sealed(self, node: Node, writing: Writing) -> bool:
        """A handle of a committed working file still wrote it through the kernel (a forked child
        holding the file after its opener's close): the file as it is now is the version."""
        sealed = writing.sealed
        version = node.version
        if (
            sealed is None
            or node.unlinked
            or version is None
            or version.content is not writing.sealed_content
        ):
            return False  # (none, or a newer version replaced it meanwhile)
        if sealed.written_ns() <= writing.sealed_ns:
            return False
        writing.sealed_ns = sealed.written_ns()
        node.mtime_ns = node.ctime_ns = writing.sealed_ns
        writing.sealed_content = sealed.snapshot()
        self.commits.commit(node, writing.sealed_content)
        self._readers_follow(node)
        return True

    def release(self, fh: int, commit: bool = True) -> bool:
        """The last close of a handle; True if it committed a version. ``commit=False``: an
        open taken back (the kernel never saw it), nothing committed."""
        handles = self.tree.handles
        handle = handles.pop(fh, None)
        if handle is None:
            return False
        node = handle.node
        writing = handle.writing
        committed = False
        try:
            if writing is not None:
                node.writers -= 1
                writing.handles.discard(handle)
                writing.closed.discard(handle)
                # Every writer left has been closed by its opener (or none is left): commit
                # what no close did (an opener's close not seen, a writer closed before another).
                if commit and writing.handles <= writing.closed:
                    committed = self._commit(node, writing) or self._recommit_sealed(node, writing)
        finally:
            if writing is not None and not writing.handles:
                self.tailed.pop(writing, None)
                if writing.stream is not None:  # no commit took its parts
                    self.uploader.abandon(writing.stream)
                if self.commits.replicator is not None:
                    self.commits.replicator.forget(writing.serial)
                writing.staged.discard()
                if writing.sealed is not None:
                    writing.sealed.discard()
                if node.writing is writing:
                    node.writing = None
            if handle.content is not None:
                handle.content.release()
            node.handles -= 1
        if not node.handles:
            self.prefill.closed(node)
        self.retention.maybe_clean(node)
        self.tree.maybe_drop(node)
        return committed

    async def fsync(self, fh: int) -> None:
        """Local durability: what this handle wrote so far (a writer), or the committed version
        (a reader or a clean writer), survives a node reboot. RAM blocks are copied to the disk
        tier, the disk arena is synced, then a put op naming those blocks is journaled and synced.
        The op is not uploaded (the commit or the version it shadows is); it only matters to a
        restart that lost the RAM tier."""
        await self.settle_writes(fh)
        handle = self.tree.handle(fh)
        node = handle.node
        writing = handle.writing or node.writing  # (a reader's fsync flushes the file's data too)
        if writing is not None:
            node.note_writes()
        if writing is not None and writing.dirty:
            content, covers = writing.staged.snapshot(), None
            if content.remote:
                assert writing.stream is not None  # evicted blocks are parts of its streamed upload
                content.upload = writing.stream.upload
        elif node.version is not None and node.version.seq is not None:
            content, covers = node.version.content, node.version.seq
            if not any(ref is not None and ref[0] == RAM for ref in content.blocks):
                # Already on disk (the disk arena, a backing file): its commit's journal record
                # names those blocks; they were written, not necessarily synced.
                content = None
        else:
            return  # durable in the store already, or nothing committed
        if content is None:
            await trio.to_thread.run_sync(self.cache.sync_disk, self.cache.disk_files())
        else:
            content.hold()
            try:
                # (a working file goes on changing after the fsync: its shadow gets a copy)
                disk = await self.cache.on_disk(content, copy_files=covers is None)
            finally:
                content.release()
            disk.hold()
            try:
                await trio.to_thread.run_sync(self.cache.sync_disk, self.cache.disk_files())
                if not node.unlinked and fh in self.tree.handles:
                    self.commits.add_shadow(node, disk, writing if covers is None else None, covers)
            finally:
                disk.release()
        await trio.to_thread.run_sync(self.commits.journal.sync)

    async def fsyncdir(self) -> None:
        """fsync of a directory: every name change made so far (create, mkdir, rename, unlink,
        rmdir; here or anywhere on the mount) survives a node reboot, as do the versions the
        journal names on the disk tier. The disk arena (and backing files) first, then the journal: a
        synced record never names blocks that were not (versions in the RAM tier are still
        dropped at a reboot: only a file's fsync copies them to disk)."""
        await trio.to_thread.run_sync(self.cache.sync_disk, self.cache.disk_files())
        await trio.to_thread.run_sync(self.commits.journal.sync)

    async def setattr(
        self,
        ino: int,
        fh: int | None,
        size=None,
        mode=None,
        uid=None,
        gid=None,
        atime_ns=None,
        mtime_ns=None,
        kill_setid: bool = False,
    ) -> Attr:
        node = self.tree.node(ino)
        node.note_writes()  # (the kernel's writes so far: an explicit mtime below comes after them)
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            await self._truncate(node, fh, size)
            if mtime_ns is None:
                node.mtime_ns = time.time_ns()  # (a truncate is a change of the data, as a write)
        if mode is not None:
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        # A chown, or a truncate without CAP_FSETID, clears set-id bits (after the new mode).
        killed = kill_setid and drop_setid(node.mode) != node.mode
        if killed:
            node.mode = drop_setid(node.mode)
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
            if node.writing is not None:  # (the file's own mtime is not a later write)
                node.writing.seen_ns = node.writing.staged.written_ns()
        node.ctime_ns = time.time_ns()
        if (
            killed
            or mode is not None
            or uid is not None
            or gid is not None
            or (mtime_ns is not None and size is None)
        ):
            self.commits.set_attrs(node)
        return self.tree.attr(node)

    def _drop_setid(self, node: Node) -> None:
        """Set-id bits cleared at the kernel's word (HANDLE_KILLPRIV_V2), stored as a chmod is."""
        if drop_setid(node.mode) != node.mode:
            node.mode = drop_setid(node.mode)
            node.ctime_ns = time.time_ns()
            self.commits.set_attrs(node)

    async def _truncate(self, node: Node, fh: int | None, size: int) -> None:
        handle = self.tree.handles.get(fh) if fh is not None else None
        writing = (handle.writing if handle is not None else None) or node.writing
        if writing is not None:  # open for writing: the working copy (its last close commits)
            await self._truncate_working_copy(writing, size)
            writing.dirty = True
            return
        # No writer: truncate(path) is open + truncate + close.
        base = node.version.content.hold() if node.version is not None else None
        try:
            if base is not None and base.size == size:
                return
            if base is not None and size:
                await self._fetch_range(node, base, 0, min(size, base.size))
            staged = StagedFile(self.cache, base)
        finally:
            if base is not None:
                base.release()
        await staged.truncate(size)
        if not node.unlinked:
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.commits.commit(node, staged.snapshot())
            self._readers_follow(node)
        staged.discard()

    async def _truncate_working_copy(self, writing: Writing, size: int) -> None:
        async with writing.lock:  # (no write half done: its bytes would land in a dropped block)
            await self._truncate_locked(writing, size)

    async def _truncate_locked(self, writing: Writing, size: int) -> None:
        staged, bs = writing.staged, self.cache.block_size
        if (
            self.uploader.codec is not None
            and size < staged.size
            and size % bs == 0
            and size // bs - 1 in staged.remote
        ):
            # A compressed upload's last part is sent again at commit, followed by the seek
            # table: an evicted block cannot be read back to be that part.
            raise FsError(
                errno.EIO,
                "the file's new last block was uploaded and evicted from the cache "
                "(cache full): a compressed file cannot end there before it is closed",
            )
        if staged.remote and size < staged.size and self.uploader.store.refuses_parts_left_out:
            # Parts past the new end would be left out of the object, which this server refuses
            # (the file then goes again in a new upload), and evicted blocks cannot go again.
            raise FsError(
                errno.EIO,
                "blocks of this file were uploaded and evicted from the cache (cache full), and the "
                "store refuses objects that leave uploaded parts out: it cannot shrink before it is closed",
            )
        stream = writing.stream
        if stream is not None and staged.remote and 0 < size < staged.size:
            # The new last part is sent again at commit, cut short: a block of it evicted to
            # the store cannot be read back for that (a part of the grown layout holds many).
            part = stream.layout.index(size - 1)
            start, end = stream.layout.start(part), stream.layout.start(part) + stream.layout.size(part)
            if end != size and any(start // bs <= i < end // bs for i in staged.remote):
                raise FsError(
                    errno.EIO,
                    "the file's new last part was uploaded and partly evicted from the cache "
                    "(cache full): the file cannot end there before it is closed",
                )
        await staged.truncate(size)
        writing.tailed = min(writing.tailed, size // bs)
        if size == 0:  # empty again (O_TRUNC): a sequential writer may start over
            writing.sequential, writing.high_water = True, 0
        elif size < writing.high_water:  # cut back behind its writes: it may go back there
            writing.sequential = False


class PendingRead:
    """A read between its halves (``Files.read_begin``): the content held, its blocks kept."""

    def __init__(self, content: Content, guard, offset: int, out: memoryview):
        self.content, self.guard, self.offset, self.out = content, guard, offset, out

    def copy(self) -> None:
        """The bytes into the caller's buffer (``preadv``: the GIL released). Any thread."""
        self.content.read_into(self.offset, self.out)

    def finish(self) -> int:
        """On the loop, after ``copy`` (or instead of it): the bytes filled."""
        self.guard.__exit__(None, None, None)
        self.content.release()
        return len(self.out)


class PendingWrite:
    """A write between its halves (``Files.write_begin``): the copies to make, from any thread,
    and the marks to set once they are made, on the loop."""

    def __init__(self, files: Files, handle: Handle, writing: Writing, copies: list[BlockCopy], length: int):
        self.files = files
        self.handle = handle
        self.writing = writing
        self.copies = copies
        self.length = length

    def copy(self) -> None:
        """The bytes into the cache (``pwrite``: the GIL released). Any thread; no state touched."""
        cache = self.files.cache
        for block in self.copies:
            cache.pwrite(block.ref, block.start, block.data)

    def finish(self, failed: OSError | None = None) -> int:
        """On the loop, after ``copy``: the bytes count as written (or the write failed)."""
        writing, staged = self.writing, self.writing.staged
        try:
            if failed is not None:
                staged.abandon(self.copies)
                raise self.files.failed_write(self.handle, failed)
            staged.finish(self.copies)
            writing.dirty = True
            self.handle.node.mtime_ns = self.handle.node.ctime_ns = time.time_ns()
            return self.length
        finally:
            writing.lock.release()
