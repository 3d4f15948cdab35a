"""A do-nothing filesystem on ckptfs's own FUSE transport (ckptfs/fusewire): the ceiling for any
Python FUSE write path on this machine.

    python -m bench.nullfs MOUNTPOINT      # foreground; ends at SIGTERM/SIGINT or umount

Files can be created and written; written bytes are discarded (only the size is kept), with the
same transport, mount and handle options ckptfs uses (direct_io on writing handles,
default_permissions, allow_other, as many reader threads as ckptfs's default), so the difference
in write throughput between the two is ckptfs's own work.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

import trio

from ckptfs.config import MountConfig
from ckptfs.fusewire.abi import ROOT_ID
from ckptfs.fusewire.face import EntryAttributes, FileInfo, Filesystem, FuseError
from ckptfs.fusewire.session import Session

ROOT = ROOT_ID


class NullFs(Filesystem):
    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.sizes: dict[int, int] = {}
        self.next_inode = ROOT + 1

    def _attr(self, inode: int) -> EntryAttributes:
        now = time.time_ns()
        return EntryAttributes(
            st_ino=inode,
            entry_timeout=0,
            attr_timeout=0,
            st_mode=(stat.S_IFDIR | 0o755) if inode == ROOT else (stat.S_IFREG | 0o644),
            st_nlink=2 if inode == ROOT else 1,
            st_size=self.sizes.get(inode, 0),
            st_blksize=1 << 20,
            st_atime_ns=now,
            st_mtime_ns=now,
            st_ctime_ns=now,
        )

    async def getattr(self, inode, ctx):
        if inode != ROOT and inode not in self.sizes:
            raise FuseError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx):
        if parent_inode != ROOT or name not in self.names:
            raise FuseError(errno.ENOENT)
        return self._attr(self.names[name])

    async def create(self, parent_inode, name, mode, flags, ctx):
        if parent_inode != ROOT:
            raise FuseError(errno.ENOENT)
        inode = self.names.get(name)
        if inode is None:
            inode = self.names[name] = self.next_inode
            self.next_inode += 1
        self.sizes[inode] = 0
        return FileInfo(fh=inode, direct_io=True), self._attr(inode)

    async def open(self, inode, flags, ctx):
        if flags & os.O_TRUNC:
            self.sizes[inode] = 0
        return FileInfo(fh=inode, direct_io=True)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size:
            self.sizes[inode] = attr.st_size
        return self._attr(inode)

    async def write(self, fh, off, data: memoryview, kill_setid: bool = False) -> int:
        self.sizes[fh] = max(self.sizes[fh], off + len(data))
        return len(data)

    async def read(self, fh, off, out: memoryview) -> int:
        n = max(0, min(len(out), self.sizes[fh] - off))
        out[:n] = bytes(n)
        return n

    async def unlink(self, parent_inode, name, ctx):
        self.sizes.pop(self.names.pop(name, 0), None)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id):
        return [
            (name, self._attr(inode), index + 1)
            for index, (name, inode) in enumerate(list(self.names.items())[start_id:], start_id)
        ]

    async def flush(self, fh, ctx):
        pass

    async def release(self, fh):
        pass


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m bench.nullfs MOUNTPOINT", file=sys.stderr)
        return 2
    session = Session(
        NullFs(),
        sys.argv[1],
        fsname="nullfs",
        subtype="nullfs",
        options=["default_permissions", "allow_other"],
        max_threads=MountConfig.fuse_threads,
    )
    session.mount()

    async def run() -> None:
        async with trio.open_nursery() as nursery:

            async def stop_at_a_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        session.terminate()  # (unmounts: serve returns once the readers are gone)
                        break

            nursery.start_soon(stop_at_a_signal)
            await session.serve()
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
