"""FUSE request handlers (the transport's ``Filesystem`` face, ckptfs/fusewire): thin wrappers
over the namespace, and the one place errors become errno.

Each handler decodes its arguments, calls the namespace and turns the result into the
transport's types. What a handler raises becomes ``FuseError(errors.to_errno(exc))`` (an
FsError's errno; EIO for a bug), logged by level here, so the transport's own safety net never
sees a failure of ours.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import stat
import time

import trio

from ckptfs.errors import FsError, StoreError, to_errno
from ckptfs.fuse.nodeids import NodeIds
from ckptfs.fuse.openers import Openers
from ckptfs.fusewire.face import (
    ENOATTR,
    Ctx,
    Deferred,
    EntryAttributes,
    FileInfo,
    Filesystem,
    FuseError,
    SetattrFields,
    StatvfsData,
)
from ckptfs.model.files import PendingRead, PendingWrite, direct_writes
from ckptfs.model.namespace import Namespace
from ckptfs.model.tree import Attr
from ckptfs.util.stats import STALL_BUCKETS, Histogram

log = logging.getLogger(__name__)

ENTRY_TIMEOUT = 1.0  # seconds the kernel may cache names and attributes
# Reads and writes of at least this many bytes are copied by the FUSE reader thread (GIL
# released, beside the loop); smaller ones on the loop: a trip between the threads and back
# (a wakeup each way, tens of microseconds on these VMs) costs more than their copy.
COPY_IN_READER = 256 << 10
NEGATIVE_TIMEOUT_MAX = 3600.0  # seconds the kernel may remember a name as absent, at most
STATE_XATTR = b"user.ckptfs.state"
VERIFIED_XATTR = b"user.ckptfs.verified"  # yes / no / pending: are reads from the store checked
XXH3_XATTR = b"user.ckptfs.xxh3"  # the whole file's recorded xxh3-64, where the store has one


def _errno_boundary(handler):
    """Every request handler's: what it raises becomes ``FuseError(to_errno(exc))``, logged once
    by level; cancellation (an interrupt) is not caught (not an Exception)."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except FuseError:
            raise
        except Exception as exc:
            number = to_errno(exc)
            _log_failure(handler.__name__, exc, number)
            raise FuseError(number) from None

    return wrapper


def _no_reply_boundary(handler):
    """For forget, which has no reply: there is no one to tell of a failure, so nothing may
    escape; it is logged and dropped."""

    @functools.wraps(handler)
    def wrapper(*args, **kwargs):
        try:
            handler(*args, **kwargs)
        except Exception as exc:
            _log_failure(handler.__name__, exc, to_errno(exc))

    return wrapper


def _log_failure(handler: str, exc: Exception, number: int) -> None:
    """One log record per failed request: expected refusals (ENOENT, ENOATTR) not at all, an
    FsError at info, a store or OS failure at error; anything else is a bug, at error, with its
    traceback when debug logging is on."""
    if isinstance(exc, FsError):
        if exc.errno not in (errno.ENOENT, ENOATTR):
            log.info("%s: %s", handler, exc)
    elif isinstance(exc, (StoreError, OSError)):
        log.error("%s failed: %s (%s)", handler, exc, errno.errorcode.get(number, number))
    else:
        log.error(
            "%s failed unexpectedly: %s: %s",
            handler,
            type(exc).__name__,
            exc,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )


class _CopyOutInReader(Deferred):
    """A read's copy out of the cache, run by the FUSE reader thread that read it (ops.read)."""

    def __init__(self, ops: Operations, pending: PendingRead):
        self.ops, self.pending = ops, pending

    def run(self) -> None:
        self.pending.copy()

    async def finish(self, failed: Exception | None) -> int:
        return await self.ops.read_finished(self.pending, failed)


class _CopyInReader(Deferred):
    """A write's copy, run by the FUSE reader thread that read it (ops.write)."""

    def __init__(self, ops: Operations, fh: int, pending: PendingWrite):
        self.ops, self.fh, self.pending = ops, fh, pending

    def run(self) -> None:
        self.pending.copy()

    async def finish(self, failed: Exception | None) -> int:
        return await self.ops.write_finished(self.fh, self.pending, failed)


def _name(raw: bytes) -> str:
    # surrogateescape keeps undecodable bytes; the namespace refuses them with EINVAL.
    return os.fsdecode(raw)


class Operations(Filesystem):
    """(No writeback cache: measured slower here, docs/machine-facts.md; the transport never asks for it.)"""

    clears_setid = True  # (model/files.drop_setid, at the kernel's word: HANDLE_KILLPRIV_V2)

    def __init__(self, namespace: Namespace, block_size: int, mountpoint: str | None = None):
        self.ns = namespace
        self.block_size = block_size
        # Who opened each writer, so a forked child's close does not commit it (fuse/openers.py).
        # Without the mountpoint every flush commits.
        self.openers = Openers(mountpoint)
        # The kernel's node ids (aliases where passthrough binds one: fuse/nodeids.py).
        self.nodes = NodeIds()
        self.passthrough_on = False  # set by the daemon once the kernel agreed to passthrough
        self.passthrough_off_reason = "not mounted yet"
        self.passthrough_opens = 0  # opens answered with a file the kernel reads itself
        self.read_requests = 0  # READ requests served here (passthrough opens send none)
        self.write_requests = 0  # WRITE requests served here (passthrough writers send none)
        self.getxattr_requests = 0  # GETXATTR requests (the kernel's security.capability probes among them)
        self._dir_listings: dict[int, list] = {}
        self._next_dir_fh = 1 << 40
        # Names are cached by the kernel no longer than the namespace trusts a listing, so a
        # path walk reaches our lookup (which refreshes from the store) at least that often.
        ttl = namespace.list_ttl
        self.entry_timeout = ENTRY_TIMEOUT if ttl is None else min(ENTRY_TIMEOUT, ttl)
        # The save stall as the daemon sees it: open to the committing close of each file written.
        self.written_bytes = 0
        self.save_stall = Histogram(STALL_BUCKETS)
        self._opened_at: dict[int, float] = {}  # writable handles, by fh
        self._wrote: set[int] = set()
        # The largest file the store can hold (one object of at most 10,000 parts): a size or a
        # write beyond it gets EFBIG at once, before any cache, journal or upload work.
        self.max_file_size = namespace.store.limits.max_file_size

    def _entry(self, attr: Attr) -> EntryAttributes:
        entry = EntryAttributes()
        entry.st_ino = attr.ino
        entry.nodeid = self.nodes.for_ino(attr.ino)
        entry.generation = 0
        entry.entry_timeout = self.entry_timeout
        # A file open for writing: no attribute caching, so every descriptor sees its size as
        # it is written, and a cached reader's next read() finds the changed size or mtime and
        # drops its stale pages (auto_inval_data). Otherwise cached like names:
        # every read() asks for attributes when they have expired (auto_inval_data), one
        # daemon round trip per read of a torch.load. A later write through this mount
        # invalidates them in the kernel.
        # And any file while passthrough is on: a writer or a reader may be moved to a new node
        # id (fuse/nodeids.py), and the old one's kernel inode is never told of the new version.
        entry.attr_timeout = (
            0 if attr.writing or (self.passthrough_on and not attr.is_dir) else self.entry_timeout
        )
        entry.st_mode = attr.mode
        entry.st_nlink = attr.nlink
        entry.st_uid = attr.uid
        entry.st_gid = attr.gid
        entry.st_rdev = 0
        entry.st_size = attr.size
        entry.st_blksize = 1 << 20  # tells cp, tar and friends to use large I/O
        entry.st_blocks = (attr.size + 511) // 512
        entry.st_atime_ns = attr.atime_ns
        entry.st_mtime_ns = attr.mtime_ns
        entry.st_ctime_ns = attr.ctime_ns
        return entry

    # -- names ---------------------------------------------------------------------------
    def _checked_name(self, parent_inode: int, raw: bytes) -> str:
        """The name of any call that takes one; ENAMETOOLONG for a name that cannot be in the
        store (over 255 bytes, or a key longer than the store's), whether or not the call would
        create it, as a disk answers. (The namespace refuses a new name one byte earlier.)"""
        if raw not in (b".", b".."):
            self.ns.check_name_length(self.ns.node(parent_inode), raw, spare=0)
        return _name(raw)

    @_errno_boundary
    async def lookup(self, parent_inode: int, raw: bytes, ctx: Ctx) -> EntryAttributes:
        name = self._checked_name(parent_inode, raw)
        try:
            return self._handed_out(self._entry(await self.ns.lookup_async(parent_inode, name)))
        except FsError as exc:
            ttl = self.ns.negative_ttl(parent_inode, name) if exc.errno == errno.ENOENT else 0
            if not ttl:
                raise
        # Absent, and the namespace will say so without asking the store for ``ttl`` seconds:
        # the kernel may remember it as long (a negative entry: inode 0).
        return EntryAttributes(st_ino=0, entry_timeout=min(ttl, NEGATIVE_TIMEOUT_MAX))

    def _handed_out(self, entry: EntryAttributes) -> EntryAttributes:
        self.nodes.handed_out(entry.nodeid)
        return entry

    @_no_reply_boundary
    def forget(self, inode_list):
        for nodeid, count in inode_list:
            self.ns.forget(self.nodes.forgot(nodeid, count), count)

    @_errno_boundary
    async def getattr(self, inode, ctx):
        attr = self.ns.getattr(self.nodes.ino(inode))
        kept = self.nodes.kept_size(inode)
        if kept is not None and not attr.is_dir:  # (its readers keep the version they opened)
            attr = dataclasses.replace(attr, size=kept)
        return self._entry(attr)

    @_errno_boundary
    async def setattr(self, inode, attr: EntryAttributes, fields: SetattrFields, fh, ctx):
        if fields.update_size and attr.st_size > self.max_file_size:
            raise FsError(errno.EFBIG, f"{attr.st_size} bytes: larger than the store's largest object")
        result = await self.ns.setattr(
            self.nodes.ino(inode),
            fh,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            kill_setid=fields.kill_setid,
        )
        return self._entry(result)

    @_errno_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        name = self._checked_name(parent_inode, name)
        return self._handed_out(
            self._entry(self.ns.mkdir(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid))
        )

    @_errno_boundary
    async def rmdir(self, parent_inode, name, ctx):
        self.ns.rmdir(parent_inode, self._checked_name(parent_inode, name))

    @_errno_boundary
    async def unlink(self, parent_inode, name, ctx):
        self.ns.unlink(parent_inode, self._checked_name(parent_inode, name))

    @_errno_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.ns.rename(
            parent_inode_old,
            self._checked_name(parent_inode_old, name_old),
            parent_inode_new,
            self._checked_name(parent_inode_new, name_new),
            flags,
        )
        await self.ns.recorded()

    @_errno_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        name = self._checked_name(parent_inode, name)
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            # mkfifo, device nodes, bind() of an AF_UNIX socket: an object store holds only
            # files and directories.
            raise FsError(errno.EPERM, "FIFOs, devices and sockets cannot be stored")
        # A regular file: made, committed and closed as open(O_CREAT | O_EXCL) + close make it.
        handle, attr = self.ns.create(
            parent_inode, name, mode & ~ctx.umask, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ctx.uid, ctx.gid
        )
        try:
            self.ns.flush(handle.fh)
        finally:
            self.ns.release(handle.fh)
        await self.ns.recorded()
        return self._handed_out(self._entry(self.ns.getattr(attr.ino)))

    @_errno_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        name = self._checked_name(parent_inode, name)
        return self._handed_out(
            self._entry(await self.ns.symlink(parent_inode, name, target, ctx.uid, ctx.gid))
        )

    @_errno_boundary
    async def readlink(self, inode, ctx):
        return await self.ns.readlink(self.nodes.ino(inode))  # (bytes: handed to the kernel as they are)

    @_errno_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self._checked_name(new_parent_inode, new_name)
        raise FsError(errno.EPERM, "hard links cannot be stored (one object per name)")

    # -- directories -------------------------------------------------------------------------
    @_errno_boundary
    async def opendir(self, inode, ctx):
        # Snapshot the listing at open so offsets stay stable while entries change.
        await self.ns.refresh(inode)  # list it again from the store if the last listing is old
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        self._dir_listings[fh] = self.ns.readdir(inode)
        return fh

    @_errno_boundary
    async def readdir(self, fh, start_id):
        entries = self._dir_listings.get(fh, [])
        return [
            (os.fsencode(name), self._entry(attr), index + 1)
            for index, (name, attr) in enumerate(entries[start_id:], start_id)
        ]

    @_no_reply_boundary
    def entry_sent(self, entry: EntryAttributes) -> None:
        self.nodes.handed_out(entry.nodeid)
        self.ns.looked_up(entry.st_ino)  # READDIRPLUS: the kernel now holds the entry, as after a lookup

    @_errno_boundary
    async def releasedir(self, fh):
        self._dir_listings.pop(fh, None)

    @_errno_boundary
    async def fsyncdir(self, fh, datasync):
        await self.ns.fsyncdir()

    # -- files -----------------------------------------------------------------------------------
    @_errno_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        name = self._checked_name(parent_inode, name)
        handle, attr = self.ns.create(
            parent_inode, name, mode & ~ctx.umask, flags, ctx.uid, ctx.gid, keeps_setid=ctx.uid == 0
        )
        self.openers.opened(handle.fh, attr.ino, ctx.pid, flags)
        self._opened_at[handle.fh] = time.monotonic()
        if (
            self.nodes.for_ino(attr.ino) in self.nodes.bound
        ):  # (an existing file readers hold through passthrough)
            self.nodes.retire(self.nodes.for_ino(attr.ino))
        # direct_io for write-only handles: the kernel hands large writes straight to us
        # (1 MiB requests) instead of splitting them through its page cache (files.direct_writes).
        entry = self._handed_out(self._entry(attr))
        backing = self._passthrough_fd(entry.nodeid, attr.ino, flags)
        direct_io = backing is None and direct_writes(flags)
        kind = "passthrough" if backing is not None else "direct" if direct_io else "cached"
        self.passthrough_opens += kind == "passthrough"
        self.nodes.opened_with(handle.fh, entry.nodeid, kind, backing)
        if backing is not None:
            self._wrote.add(handle.fh)  # (the kernel writes it: its save stall is counted at close)
        # The new file's attributes may be cached although it is open for writing: the kernel
        # drops its cached size, times and blocks itself at every write and truncate through
        # it, and nothing else changes them. Saves the GETATTR that the open's permission
        # check would send next: a small file takes six requests instead of seven
        # (docs/benchmarks.md, "What one small file costs").
        entry.attr_timeout = self.entry_timeout
        return FileInfo(fh=handle.fh, direct_io=direct_io, backing_fd=backing), entry

    def _passthrough_fd(self, nodeid: int, ino: int, flags: int) -> int | None:
        """The file an open of ``ino`` may be served from by the kernel itself."""
        if not (self.passthrough_on and self.nodes.may_bind(nodeid)):
            return None
        return self.ns.passthrough_fd(ino, flags)

    @_errno_boundary
    async def open(self, inode, flags, ctx):
        ino = self.nodes.ino(inode)
        read_only = flags & os.O_ACCMODE == os.O_RDONLY
        if self.nodes.open_refused(inode, self._passthrough_fd(inode, ino, flags)) or (
            self.passthrough_on and not self.nodes.may_bind(inode) and self.ns.writes_to_file(ino, flags)
        ):
            # (the kernel looks the name up again: fuse/nodeids.py. A writer the kernel could
            # serve itself but for other opens of this node id also gets a fresh one.)
            self.nodes.retire(inode)
            raise FsError(errno.ESTALE, "this node id is bound to another version's file")
        # (root keeps set-id bits when writing, as with CAP_FSETID: model/files.drops_setid)
        with trio.CancelScope(shield=True):  # (only fetching a reader's file whole is interruptible)
            handle, keep_cache, direct_io = await self.ns.open(
                ino, flags, keeps_setid=ctx.uid == 0, kill_setid=ctx.kill_setid
            )
        backing = self._passthrough_fd(inode, ino, flags)  # (again: a commit may have come meanwhile)
        # (not for O_DIRECT: through the backing file the kernel would ask its alignment of every
        # read, where the daemon takes any buffer, as a reader through FUSE had so far)
        if (
            backing is None
            and read_only
            and not flags & os.O_DIRECT
            and self.passthrough_on
            and self.nodes.may_bind(inode)
        ):
            try:
                await self.ns.land_whole(handle.fh)
            except BaseException:  # interrupted: the opener is gone or took a signal (EINTR)
                self.ns.release(handle.fh, commit=False)
                raise
            backing = self._passthrough_fd(inode, ino, flags)
        if self.nodes.open_refused(inode, backing):
            self.ns.release(handle.fh, commit=False)
            self.nodes.retire(inode)
            raise FsError(errno.ESTALE, "this node id is bound to another version's file")
        self.openers.opened(handle.fh, ino, ctx.pid, flags)
        if not read_only:
            self._opened_at[handle.fh] = time.monotonic()
        if backing is not None:
            direct_io = keep_cache = False  # (the kernel's page cache is the backing file's)
            if not read_only:
                self._wrote.add(handle.fh)  # (the kernel writes it: its save stall is counted at close)
        kind = "passthrough" if backing is not None else "direct" if direct_io else "cached"
        self.passthrough_opens += kind == "passthrough"
        self.nodes.opened_with(handle.fh, inode, kind, backing)
        return FileInfo(fh=handle.fh, direct_io=direct_io, keep_cache=keep_cache, backing_fd=backing)

    def passthrough_refused(self, fh: int, why: str) -> None:
        """The transport answered an open as a plain one: the kernel refused passthrough (for
        the mount: it is off from now on)."""
        self.nodes.passthrough_refused(fh)
        self.passthrough_opens -= 1
        if self.passthrough_on and why:
            self.passthrough_on = False
            self.passthrough_off_reason = why
            self.ns.passthrough_off()

    @_errno_boundary
    async def read(self, fh, off, out: memoryview) -> int | Deferred:
        # Into the reader thread's own reply buffer, by that thread (the GIL released): the
        # bytes cannot change or go away before its reply is written.
        self.read_requests += 1
        if len(out) < COPY_IN_READER:
            return await self.ns.read_into(fh, off, out)
        pending = await self.ns.read_begin(fh, off, out)
        return pending if isinstance(pending, int) else _CopyOutInReader(self, pending)

    @_errno_boundary
    async def read_finished(self, pending: PendingRead, failed: Exception | None) -> int:
        filled = pending.finish()
        if failed is not None:
            raise failed
        return filled

    @_errno_boundary
    async def write(self, fh, off, buf, kill_setid=False):
        if off + len(buf) > self.max_file_size:  # as a disk: short up to the limit, EFBIG at it
            if off >= self.max_file_size:
                raise FsError(errno.EFBIG, "a write past the store's largest object")
            buf = buf[: self.max_file_size - off]
        # The copy into the cache is left to the reader thread (GIL released), so the loop
        # serves other requests meanwhile: two writers' copies run at once. A small one is
        # made here: a second trip to the loop would cost more than the copy.
        self.write_requests += 1
        pending = await self.ns.write_begin(fh, off, buf, kill_setid)
        if len(buf) >= COPY_IN_READER:
            return _CopyInReader(self, fh, pending)
        failed = None
        try:
            pending.copy()
        except OSError as exc:
            failed = exc
        return await self.write_finished(fh, pending, failed)

    @_errno_boundary
    async def write_finished(self, fh: int, pending: PendingWrite, failed: Exception | None) -> int:
        if failed is not None and not isinstance(failed, OSError):
            failed = OSError(errno.EIO, f"{type(failed).__name__}: {failed}")
        written = pending.finish(failed)
        self.written_bytes += written
        self._wrote.add(fh)
        return written

    @_errno_boundary
    async def flush(self, fh, ctx):
        # Every close of a descriptor sends FLUSH, a forked child's too: commit only at the
        # close after which the opening process holds the file no more (fuse/openers.py).
        commit = await self.openers.opener_closed(fh)
        await self.ns.settle_writes(fh)  # (then no await until the commit: no write comes between)
        committed = self.ns.flush(fh, commit=commit)
        if committed:
            await self.ns.recorded()  # (other nodes' markers wait for what this close committed)
        if commit:
            self._saved(fh)

    @_errno_boundary
    async def release(self, fh):
        self.openers.released(fh)
        self.nodes.released(fh)
        await self.ns.settle_writes(fh)
        try:
            # commits a handle still dirty (its opener's close was not seen)
            if self.ns.release(fh):
                await self.ns.recorded()
        finally:
            self._saved(fh)

    def _saved(self, fh: int) -> None:
        opened = self._opened_at.pop(fh, None)
        if fh in self._wrote and opened is not None:
            self.save_stall.observe(time.monotonic() - opened)
        self._wrote.discard(fh)

    @_errno_boundary
    async def fsync(self, fh, datasync):
        await self.ns.fsync(fh)

    @_errno_boundary
    async def statfs(self, ctx):
        usage = self.ns.statfs()
        stats = StatvfsData()
        stats.f_bsize = stats.f_frsize = 4096
        # The store has no fixed size: report a large one, with the cache's use as used space.
        total = max(1 << 50, usage["ram"]["budget"] + usage["disk"]["budget"])
        used = usage["ram"]["used"] + usage["disk"]["used"]
        stats.f_blocks = total // 4096
        stats.f_bfree = stats.f_bavail = (total - used) // 4096
        stats.f_files = 1 << 32
        stats.f_ffree = stats.f_favail = (1 << 32) - usage["files"]
        stats.f_namemax = 255
        return stats

    # -- extended attributes ------------------------------------------------------------------------
    @_errno_boundary
    async def getxattr(self, inode, name, ctx):
        self.getxattr_requests += 1
        if name == STATE_XATTR:
            return self.ns.state(self.nodes.ino(inode)).encode()
        if name in (VERIFIED_XATTR, XXH3_XATTR) and not self.ns.node(self.nodes.ino(inode)).is_dir:
            verified, xxh3 = await self.ns.verification(self.nodes.ino(inode))
            value = verified if name == VERIFIED_XATTR else xxh3
            if value:
                return value.encode()
        raise FuseError(ENOATTR)

    @_errno_boundary
    async def listxattr(self, inode, ctx):
        if self.ns.node(self.nodes.ino(inode)).is_dir:
            return [STATE_XATTR]
        return [STATE_XATTR, VERIFIED_XATTR, XXH3_XATTR]

    @_errno_boundary
    async def setxattr(self, inode, name, value, flags, ctx):
        raise FuseError(errno.ENOTSUP)

    @_errno_boundary
    async def removexattr(self, inode, name, ctx):
        raise FuseError(errno.ENOTSUP)
