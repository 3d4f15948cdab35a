"""A filesystem that loses what was not flushed when its power is cut: a passthrough on ckptfs's
own FUSE transport (ckptfs/fusewire) for tests of fsync (root with /dev/fuse), where the kernel
has no dm-flakey.

    python -m tests.support.powercut_fs WORK MOUNTPOINT     # prints "ready" once mounted

``WORK/live`` is the tree the mount shows: every call is passed through to it at once, so reads
see every write, as a page cache would. ``WORK/durable`` is what a disk would hold: a file's
bytes (and size) as they were at its last ``fsync``/``fdatasync`` (``data/<id>``, one per file,
ids never reused), and the namespace (every name, its file's id, its mode and owner) as it was
at the last ``fsync`` of a directory (``names.json``). Until a file is fsynced it has no durable
bytes (empty after the cut); until a directory fsync records a name, the name does not exist.

The cut is SIGKILL of this process: whatever it knew only in memory is gone, and the kernel
answers every call on the dead mount ENOTCONN (I/O refused until power on). Power on is a
(lazy) unmount of the dead mount and a new start on the same WORK: ``live`` is rebuilt from
``durable`` before anything is mounted. The kernel's caches go with the old mount.

Coarser than POSIX in one way, as ext4 and xfs are: a directory's fsync commits the whole
namespace (their journal commits every earlier name change with it), so a missing directory
fsync is caught, the fsync of the wrong directory is not. ``fallocate`` is not offered (the
transport has no handler for it: callers get EOPNOTSUPP, as on a filesystem that cannot punch
holes). Single-threaded: one reader thread, and every call runs to its end on the trio loop
before the next one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import trio

from ckptfs.fusewire.abi import ROOT_ID
from ckptfs.fusewire.face import EntryAttributes, FileInfo, Filesystem, FuseError, StatvfsData
from ckptfs.fusewire.session import Session

ROOT = ROOT_ID


def copy_sparse(src_fd: int, dst: Path) -> None:
    """``dst`` made, atomically, a copy of the file ``src_fd``: its data extents and its size."""
    size = os.fstat(src_fd).st_size
    tmp = dst.with_name(dst.name + ".tmp")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pos = 0
        while pos < size:
            try:
                start = os.lseek(src_fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(src_fd, start, os.SEEK_HOLE)
            while start < end:
                chunk = os.pread(src_fd, min(end - start, 1 << 20), start)
                if not chunk:
                    break
                os.pwrite(out, chunk, start)
                start += len(chunk)
            pos = end
        os.ftruncate(out, size)
    finally:
        os.close(out)
    os.replace(tmp, dst)


class PowerCutFs(Filesystem):
    def __init__(self, work: Path):
        super().__init__()
        self.live = work / "live"
        self.durable = work / "durable"
        self.data = self.durable / "data"
        self.names_file = self.durable / "names.json"
        self.path_of: dict[int, str] = {ROOT: ""}  # id -> path relative to live ("": the root)
        self.id_of: dict[str, int] = {"": ROOT}
        self.next_id = ROOT + 1
        self.fds: dict[int, int] = {}  # fh (a descriptor of the live file) -> id
        self.power_on()

    # -- the durable state ---------------------------------------------------------------
    def power_on(self) -> None:
        """``live`` rebuilt from the durable state (a first start: what is in ``live`` is it)."""
        self.live.mkdir(parents=True, exist_ok=True)
        if self.names_file.exists():
            names = json.loads(self.names_file.read_text())
            shutil.rmtree(self.live)
            self.live.mkdir()
            for path, entry in sorted(names.items()):  # a parent sorts before its children
                target = self.live / path if path else self.live
                if entry["dir"]:
                    target.mkdir(exist_ok=True)
                else:
                    data = self.data / str(entry["id"])
                    if data.exists():
                        fd = os.open(data, os.O_RDONLY)
                        try:
                            copy_sparse(fd, target)
                        finally:
                            os.close(fd)
                    else:
                        target.touch()  # a name made durable, its bytes never synced
                os.chown(target, entry["uid"], entry["gid"])
                os.chmod(target, entry["mode"])
        shutil.rmtree(self.data, ignore_errors=True)
        self.data.mkdir(parents=True)
        for dirpath, dirnames, filenames in os.walk(self.live):
            for name in dirnames + filenames:
                path = os.path.relpath(os.path.join(dirpath, name), self.live)
                ino = self._new_id(path)
                if name in filenames:
                    fd = os.open(self.live / path, os.O_RDONLY | os.O_NOFOLLOW)
                    try:
                        copy_sparse(fd, self.data / str(ino))
                    finally:
                        os.close(fd)
        self.sync_names()

    def sync_names(self) -> None:
        names = {}
        for path, ino in self.id_of.items():
            st = os.lstat(self.live / path)
            names[path] = {
                "id": ino,
                "dir": stat.S_ISDIR(st.st_mode),
                "mode": stat.S_IMODE(st.st_mode),
                "uid": st.st_uid,
                "gid": st.st_gid,
            }
        tmp = self.names_file.with_name("names.json.tmp")
        tmp.write_text(json.dumps(names))
        os.replace(tmp, self.names_file)

    # -- names and ids -------------------------------------------------------------------
    def _new_id(self, path: str) -> int:
        ino, self.next_id = self.next_id, self.next_id + 1
        self.path_of[ino], self.id_of[path] = path, ino
        return ino

    def _child(self, parent: int, name: bytes) -> str:
        base = self.path_of[parent]
        name_s = os.fsdecode(name)
        return f"{base}/{name_s}" if base else name_s

    def _forget_path(self, path: str) -> None:
        """``path`` and everything below it no longer exist (their ids are retired)."""
        for p in [p for p in self.id_of if p == path or p.startswith(path + "/")]:
            del self.path_of[self.id_of.pop(p)]

    def _attr(self, ino: int) -> EntryAttributes:
        st = os.lstat(self.live / self.path_of[ino])
        return EntryAttributes(
            st_ino=ino,
            entry_timeout=0,
            attr_timeout=0,
            st_mode=st.st_mode,
            st_nlink=st.st_nlink,
            st_uid=st.st_uid,
            st_gid=st.st_gid,
            st_rdev=st.st_rdev,
            st_size=st.st_size,
            st_blksize=4096,
            st_blocks=st.st_blocks,
            st_atime_ns=st.st_atime_ns,
            st_mtime_ns=st.st_mtime_ns,
            st_ctime_ns=st.st_ctime_ns,
        )

    def _entry(self, path: str) -> EntryAttributes:
        ino = self.id_of.get(path)
        if ino is None:
            ino = self._new_id(path)
        return self._attr(ino)

    # -- operations ----------------------------------------------------------------------
    async def lookup(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        try:
            os.lstat(self.live / path)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        return self._entry(path)

    async def getattr(self, inode, ctx):
        return self._attr(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self.live / self.path_of[inode]
        try:
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(
                    path, attr.st_uid if fields.update_uid else -1, attr.st_gid if fields.update_gid else -1
                )
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                os.utime(
                    path,
                    ns=(
                        attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                        attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns,
                    ),
                )
        except OSError as exc:
            raise FuseError(exc.errno) from None
        return self._attr(inode)

    async def statfs(self, ctx):
        st = os.statvfs(self.live)
        return StatvfsData(
            f_bsize=st.f_bsize,
            f_frsize=st.f_frsize,
            f_blocks=st.f_blocks,
            f_bfree=st.f_bfree,
            f_bavail=st.f_bavail,
            f_files=st.f_files,
            f_ffree=st.f_ffree,
            f_favail=st.f_favail,
            f_namemax=st.f_namemax,
        )

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id):
        # (every entry from start_id on: the transport sends as many as fit the reply)
        names = [os.fsencode(name) for name in sorted(os.listdir(self.live / self.path_of[fh]))]
        return [
            (name, self._entry(self._child(fh, name)), index + 1)
            for index, name in enumerate(names[start_id:], start_id)
        ]

    async def releasedir(self, fh):
        pass

    async def fsyncdir(self, fh, datasync):
        self.sync_names()

    async def mkdir(self, parent_inode, name, mode, ctx):
        path = self._child(parent_inode, name)
        try:
            os.mkdir(self.live / path, mode & ~ctx.umask)
            os.chown(self.live / path, ctx.uid, ctx.gid)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        return self._entry(path)

    async def rmdir(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        try:
            os.rmdir(self.live / path)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        self._forget_path(path)

    async def unlink(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        try:
            os.unlink(self.live / path)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        self._forget_path(path)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags:
            raise FuseError(errno.EINVAL)
        old, new = self._child(parent_inode_old, name_old), self._child(parent_inode_new, name_new)
        try:
            os.rename(self.live / old, self.live / new)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        self._forget_path(new)  # what the rename replaced
        for p in [p for p in self.id_of if p == old or p.startswith(old + "/")]:
            ino = self.id_of.pop(p)
            moved = new + p[len(old) :]
            self.id_of[moved], self.path_of[ino] = ino, moved

    async def open(self, inode, flags, ctx):
        try:
            fd = os.open(self.live / self.path_of[inode], flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY))
        except OSError as exc:
            raise FuseError(exc.errno) from None
        self.fds[fd] = inode
        return FileInfo(fh=fd, direct_io=True)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path = self._child(parent_inode, name)
        try:
            fd = os.open(self.live / path, flags | os.O_CREAT, mode & ~ctx.umask)
            os.fchown(fd, ctx.uid, ctx.gid)
        except OSError as exc:
            raise FuseError(exc.errno) from None
        attr = self._entry(path)
        self.fds[fd] = attr.st_ino
        return FileInfo(fh=fd, direct_io=True), attr

    async def read(self, fh, off, out: memoryview) -> int:
        return os.preadv(fh, [out], off)

    async def write(self, fh, off, buf: memoryview, kill_setid: bool = False) -> int:
        return os.pwrite(fh, buf, off)  # (an O_APPEND descriptor appends, as the kernel asked)

    async def flush(self, fh, ctx):
        pass

    async def release(self, fh):
        del self.fds[fh]
        os.close(fh)

    async def fsync(self, fh, datasync):
        ino = self.fds[fh]
        if ino in self.path_of:  # (the bytes of a file with no name can never be found again)
            fd = os.open(f"/proc/self/fd/{fh}", os.O_RDONLY)  # (fh may be write-only)
            try:
                copy_sparse(fd, self.data / str(ino))
            finally:
                os.close(fd)

    def forget(self, items):
        pass  # ids live as long as their names


def main() -> None:
    work, mountpoint = Path(sys.argv[1]), sys.argv[2]
    fs = PowerCutFs(work)
    # Without default_permissions (the kernel checks no modes; its one user, the daemon, is root)
    # and without passthrough: every read and write reaches this process, and the daemon's own
    # passthrough backing files may live here (a FUSE filesystem stacked on one that uses none).
    session = Session(
        fs, mountpoint, fsname="ckptfs-powercut", subtype="powercut", max_threads=1, passthrough=False
    )
    session.mount()
    print("ready", flush=True)
    try:
        trio.run(session.serve)
    finally:
        session.close()


if __name__ == "__main__":
    main()
