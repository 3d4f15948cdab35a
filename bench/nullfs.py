"""A do-nothing pyfuse3 filesystem: the ceiling for any Python FUSE write path on this machine.

    python -m bench.nullfs MOUNTPOINT      # foreground; ends at SIGTERM/SIGINT or umount

Files can be created and written; written bytes are discarded (only the size is kept), with the
same mount and handle options ckptfs uses (direct_io on writing handles, allow_other), so the
difference in write throughput between the two is ckptfs's own work.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE


class NullFs(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.sizes: dict[int, int] = {}
        self.next_inode = ROOT + 1

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.st_mode = (stat.S_IFDIR | 0o755) if inode == ROOT else (stat.S_IFREG | 0o644)
        entry.st_nlink = 2 if inode == ROOT else 1
        entry.st_size = self.sizes.get(inode, 0)
        entry.st_blksize = 1 << 20
        now = time.time_ns()
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = now
        entry.entry_timeout = entry.attr_timeout = 0
        return entry

    async def getattr(self, inode, ctx=None):
        if inode != ROOT and inode not in self.sizes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != ROOT or name not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self.names[name])

    async def create(self, parent_inode, name, mode, flags, ctx):
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = self.names.get(name)
        if inode is None:
            inode = self.names[name] = self.next_inode
            self.next_inode += 1
        self.sizes[inode] = 0
        return pyfuse3.FileInfo(fh=inode, direct_io=True), self._attr(inode)

    async def open(self, inode, flags, ctx):
        if flags & os.O_TRUNC:
            self.sizes[inode] = 0
        return pyfuse3.FileInfo(fh=inode, direct_io=True)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size:
            self.sizes[inode] = attr.st_size
        return self._attr(inode)

    async def write(self, fh, off, buf):
        self.sizes[fh] = max(self.sizes[fh], off + len(buf))
        return len(buf)

    async def read(self, fh, off, size):
        return b"\0" * max(0, min(size, self.sizes[fh] - off))

    async def unlink(self, parent_inode, name, ctx):
        self.sizes.pop(self.names.pop(name, 0), None)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for index, (name, inode) in enumerate(list(self.names.items())[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), index + 1):
                break

    async def flush(self, fh):
        pass

    async def release(self, fh):
        pass


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m bench.nullfs MOUNTPOINT", file=sys.stderr)
        return 2
    options = set(pyfuse3.default_options) | {"fsname=nullfs", "allow_other"}
    pyfuse3.init(NullFs(), sys.argv[1], options)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
