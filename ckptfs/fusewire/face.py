"""The one face the transport shows a filesystem: the types its handlers take and return, and the
``Filesystem`` base class whose methods the transport calls (absent ones answer ENOSYS).

The reply is the return value: a handler returns its result or raises ``FuseError(errno)``, so
it can neither answer twice nor forget to answer. Handlers run on the trio loop; ``forget`` is
plain and never answered.
"""

from __future__ import annotations

import abc
import errno
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ENOATTR = errno.ENODATA  # Linux's name for "no such attribute"


class FuseError(Exception):
    """A request refused with ``errno``."""

    def __init__(self, number: int):
        super().__init__(number)
        self.errno = number

    def __str__(self) -> str:
        return errno.errorcode.get(self.errno, str(self.errno))


@dataclass(slots=True)
class Ctx:
    """Who asks: the caller's ids and its thread id (``pid``: the kernel sends the task's id),
    the umask of a call that creates, and the request's unique id."""

    uid: int
    gid: int
    pid: int
    umask: int = 0
    unique: int = 0
    kill_setid: bool = False  # an open that must clear the file's set-id bits (O_TRUNC, no CAP_FSETID)


@dataclass(slots=True)
class EntryAttributes:
    """A node's attributes, and how long the kernel may keep them (and its name). ``nodeid`` is
    the kernel's handle for the node; 0 means the same as ``st_ino``; an ``st_ino`` of 0 in a
    lookup reply is a negative entry (the name is absent for ``entry_timeout`` seconds)."""

    st_ino: int = 0
    generation: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0
    st_mode: int = 0
    st_nlink: int = 1
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_size: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_atime_ns: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0
    nodeid: int = 0


@dataclass(slots=True)
class SetattrFields:
    """Which attributes a setattr changes (the values are in the ``EntryAttributes`` beside it)."""

    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False
    update_atime: bool = False
    update_mtime: bool = False
    kill_setid: bool = False  # clear set-id bits too (a truncate or chown: HANDLE_KILLPRIV_V2)


@dataclass(slots=True)
class FileInfo:
    """An open's answer. ``backing_fd``: a regular file whose bytes the kernel serves for this
    open itself (FUSE passthrough); no READ or WRITE of the open reaches the daemon. The
    transport registers it (one backing file per node while any such open lasts) and may refuse
    it, when the kernel or the daemon's privileges do not allow passthrough: the open is then
    answered as a plain one, served through READ requests (``passthrough`` tells which)."""

    fh: int
    direct_io: bool = False
    keep_cache: bool = False
    backing_fd: int | None = None


@dataclass(slots=True)
class StatvfsData:
    f_bsize: int = 4096
    f_frsize: int = 4096
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_favail: int = 0
    f_namemax: int = 255


class Deferred(abc.ABC):
    """What a handler may return to leave its copies to the reader thread that read the
    request (``run``: no shared state, the GIL released), before it ``finish``es on the loop with
    the answer (``run``'s exception, if any, passed in). A WRITE's payload is valid until then."""

    @abc.abstractmethod
    def run(self) -> None: ...

    @abc.abstractmethod
    async def finish(self, failed: Exception | None) -> int: ...


DirEntry = tuple[bytes, EntryAttributes, int]  # name, attributes, the offset of the entry after it


class Filesystem(abc.ABC):  # noqa: B024 (an interface whose every method has a default)
    """What a FUSE filesystem serves. Each method answers one request; the defaults refuse with
    ENOSYS (the kernel then stops asking, where it can). ``readdir`` yields entries from
    ``offset`` on; the transport takes as many as fit the reply, and ``entry_sent`` is told of
    each one a READDIRPLUS reply hands the kernel (the kernel counts it as a lookup).
    ``clears_setid``: the filesystem clears set-id bits itself where the kernel says so
    (``kill_setid`` of write, setattr and open: FUSE_HANDLE_KILLPRIV_V2); the kernel then stops
    asking for security.capability before every write."""

    clears_setid = False

    def forget(self, items: Sequence[tuple[int, int]]) -> None:
        """(nodeid, count) pairs the kernel forgot. No reply; must not raise."""

    async def lookup(self, parent: int, name: bytes, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def getattr(self, nodeid: int, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def setattr(
        self, nodeid: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None, ctx: Ctx
    ) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def readlink(self, nodeid: int, ctx: Ctx) -> bytes:
        raise FuseError(errno.ENOSYS)

    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def unlink(self, parent: int, name: bytes, ctx: Ctx) -> None:
        raise FuseError(errno.ENOSYS)

    async def rmdir(self, parent: int, name: bytes, ctx: Ctx) -> None:
        raise FuseError(errno.ENOSYS)

    async def rename(
        self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int, ctx: Ctx
    ) -> None:
        raise FuseError(errno.ENOSYS)

    async def link(self, nodeid: int, new_parent: int, new_name: bytes, ctx: Ctx) -> EntryAttributes:
        raise FuseError(errno.ENOSYS)

    async def open(self, nodeid: int, flags: int, ctx: Ctx) -> FileInfo:
        raise FuseError(errno.ENOSYS)

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: Ctx
    ) -> tuple[FileInfo, EntryAttributes]:
        raise FuseError(errno.ENOSYS)

    async def read(self, fh: int, offset: int, out: memoryview) -> int | Deferred:
        """Fill ``out`` (the request's size) from ``offset``; the bytes filled (short at EOF)."""
        raise FuseError(errno.ENOSYS)

    async def write(self, fh: int, offset: int, data: memoryview, kill_setid: bool = False) -> int | Deferred:
        """``data`` lives only until this returns (or its Deferred finishes): bytes written.
        ``kill_setid``: the writer lacks CAP_FSETID, the file's set-id bits go (as Linux's
        file_remove_privs; the kernel leaves it to the filesystem: HANDLE_KILLPRIV_V2)."""
        raise FuseError(errno.ENOSYS)

    async def flush(self, fh: int, ctx: Ctx) -> None:
        raise FuseError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        pass

    async def fsync(self, fh: int, datasync: bool) -> None:
        raise FuseError(errno.ENOSYS)

    async def opendir(self, nodeid: int, ctx: Ctx) -> int:
        return 0

    async def readdir(self, fh: int, offset: int) -> Iterable[DirEntry]:
        raise FuseError(errno.ENOSYS)

    def entry_sent(self, entry: EntryAttributes) -> None:
        """A READDIRPLUS reply holds ``entry`` (the kernel counts a lookup of it)."""

    async def releasedir(self, fh: int) -> None:
        pass

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        raise FuseError(errno.ENOSYS)

    async def statfs(self, ctx: Ctx) -> StatvfsData:
        return StatvfsData()

    async def getxattr(self, nodeid: int, name: bytes, ctx: Ctx) -> bytes:
        raise FuseError(errno.ENOSYS)

    async def listxattr(self, nodeid: int, ctx: Ctx) -> Sequence[bytes]:
        raise FuseError(errno.ENOSYS)

    async def setxattr(self, nodeid: int, name: bytes, value: bytes, flags: int, ctx: Ctx) -> None:
        raise FuseError(errno.ENOSYS)

    async def removexattr(self, nodeid: int, name: bytes, ctx: Ctx) -> None:
        raise FuseError(errno.ENOSYS)
