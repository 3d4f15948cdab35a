"""File primitives of the local store: every file and directory below the store's root is
opened relative to its parent's descriptor (openat) and never through a symbolic link (see
ckptfs/store/local.py for why); writes are whole, copies are the kernel's where it can.

The store's modules call these as ``localfs.NAME`` (one place for a test to count copies or
writes).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

COPY_CHUNK = 64 << 20
SMALL_FILE = 1 << 20  # the most read_small reads (an upload's ``key`` or ``metadata.json``)

# Every open below the root: never through a symbolic link, never inherited by helpers.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
DIR = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW


def subdir(parent: int, name: str, create: bool = False) -> int:
    """A descriptor of the directory ``name`` in ``parent``, never through a symbolic link
    (one there: ELOOP; a file: ENOTDIR). With ``create``, made if missing (and ``parent``
    fsynced, so it survives a crash)."""
    try:
        return os.open(name, DIR, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except NotADirectoryError:
        # O_DIRECTORY|O_NOFOLLOW says ENOTDIR for a link too: tell the two apart for the message.
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
        raise
    try:
        os.mkdir(name, dir_fd=parent)
        os.fsync(parent)
    except FileExistsError:
        pass  # made meanwhile: opened below with the same checks
    return subdir(parent, name)


@contextlib.contextmanager
def closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def read_small(dir_fd: int, name: str) -> bytes:
    """The content of a small file (at most SMALL_FILE bytes) in ``dir_fd``, not through a link."""
    fd = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=dir_fd)
    try:
        chunks, size = [], 0
        while size < SMALL_FILE and (chunk := os.read(fd, SMALL_FILE - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (a write may be short); returns its length."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, length: int) -> int:
    """Free ``length`` bytes at ``offset`` of a file (they read as zeros; its size stays).
    Returns 0, or the errno of a filesystem that cannot."""
    if (
        _libc.fallocate(
            fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(length)
        )
        == 0
    ):
        return 0
    return ctypes.get_errno()


def zero_range(fd: int, offset: int, length: int) -> None:
    """Make ``length`` bytes at ``offset`` read as zeros without writing them: a hole punched in
    the file (what was there is freed), which reaches at least to the range's end (a hole past
    the end is only that once the file is that long). Where the filesystem cannot punch, zeros
    are written."""
    if length <= 0:
        return
    pwrite_all(fd, b"\0", offset + length - 1)  # (never shrinks the file, whoever writes beyond)
    err = punch_hole(fd, offset, length)
    if not err:
        return
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(err, os.strerror(err))
    zeros = bytes(min(length, COPY_CHUNK))
    for start in range(0, length, len(zeros)):
        pwrite_all(fd, memoryview(zeros)[: min(len(zeros), length - start)], offset + start)


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int | None = None) -> int:
    """Copy ``length`` bytes (None: up to the end of ``src``) from ``src`` at ``src_offset`` to
    ``dst`` at ``dst_offset``; returns the bytes copied (fewer where ``src`` ends first).
    copy_file_range lets the kernel (or an NFS/Lustre server) copy without user space."""
    copied = 0

    def chunk() -> int:
        return COPY_CHUNK if length is None else min(COPY_CHUNK, length - copied)

    try:
        while (n := chunk()) and (
            n := os.copy_file_range(src, dst, n, src_offset + copied, dst_offset + copied)
        ):
            copied += n
        return copied
    except OSError as e:
        # Not supported on this filesystem pair: fall back to read/write below.
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    while (n := chunk()) and (data := os.pread(src, n, src_offset + copied)):
        copied += pwrite_all(dst, data, dst_offset + copied)
    return copied


@contextlib.contextmanager
def flocked(dir_fd: int, name: str, how: int, create: bool = False) -> Iterator[int]:
    """``name`` in ``dir_fd`` opened (not through a link) and flocked ``how`` (closing it
    releases the lock)."""
    fd = os.open(name, os.O_RDWR | NOFOLLOW | (os.O_CREAT if create else 0), 0o644, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)
