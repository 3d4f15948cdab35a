"""The local store's tree: a directory holding one file per key, walked without following links.

``LocalTree`` holds what every local-store operation shares: a key's path below the root, the
directories on the way opened one at a time (O_NOFOLLOW, relative to the one before), errors
turned into StoreErrors, a new object published whole (a temp file in ``ROOT/.ckptfs-tmp/``,
fsynced, renamed into place) and its user metadata in xattrs. ckptfs/store/local.py says why.
``LocalStore`` and its ``LocalMultipart`` are each given one (the same) at construction.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from ckptfs.errors import NotFound, StoreError
from ckptfs.store import localfs as fs
from ckptfs.store.base import S3_LIMITS

log = logging.getLogger("ckptfs.store.local")

TMP_DIR = ".ckptfs-tmp"
UPLOADS = (TMP_DIR, "uploads")
XATTR_PREFIX = "user.ckptfs."
_NO_XATTR = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
# Errors where trying again later may succeed (space freed, NFS server back).
TRANSIENT = {
    errno.EIO,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EAGAIN,
    errno.EINTR,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.EBUSY,
}
# Parts of any size (a directory takes what it is given); keys and part counts as on S3, so that
# what a mount writes here fits S3 too (and the upload index is sized for max_parts records).
LOCAL_LIMITS = replace(S3_LIMITS, min_part_size=0)
# Opening a name that is no object: a symbolic link (ELOOP), a socket (ENXIO).
NOT_AN_OBJECT = {errno.ELOOP, errno.ENXIO, errno.ENODEV}


def etag(st: os.stat_result) -> str:
    """Which file holds the object: every write publishes a new file (a new inode), and a
    filesystem's clock may not tell two writes in one tick apart."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}"


def why(e: OSError) -> str:
    """What went wrong with a name in the store, in words."""
    if e.errno == errno.ELOOP:
        name = e.filename or "a name on the way"
        return f"{name} is a symbolic link (links in the store are never followed)"
    return e.strerror or str(e)


class LocalTree:
    """The directory of a local store and the file operations on it that every verb shares."""

    def __init__(self, root: Path | str):
        self.root = Path(os.path.abspath(root))
        self._xattrs = True  # cleared the first time the filesystem refuses them
        self._ready = False

    def parts(self, key: str) -> list[str]:
        """The path components of ``key`` below the root; ValueError for keys that would escape it."""
        if not key or key.startswith("/") or "\0" in key:
            raise ValueError(f"invalid store key {key!r}")
        parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid store key {key!r}: empty, '.' or '..' component")
        if parts[0] == TMP_DIR:
            raise ValueError(f"invalid store key {key!r}: {TMP_DIR} is reserved")
        return parts

    def open_dir(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of the directory ROOT/parts..., each component opened relative to the
        one before and never through a link (see the module doc). With ``create``: mkdir -p."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in parts:
                child = fs.subdir(fd, name, create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def directory(self, parts: Sequence[str], create: bool = False) -> Iterator[int]:
        fd = self.open_dir(parts, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def open_object(self, key: str, op: str) -> tuple[int, os.stat_result]:
        """The regular file holding ``key``, opened read-only, and its stat; NotFound where there
        is none (a directory, a link, anything else)."""
        parts = self.parts(key)
        try:
            with self.directory(parts[:-1]) as d:
                # O_NONBLOCK: opening a fifo someone put there must not hang; no effect on a file.
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | fs.NOFOLLOW, dir_fd=d)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"local store {self.root}: no object {key!r}") from None
        except OSError as e:
            if e.errno in NOT_AN_OBJECT:
                raise NotFound(f"local store {self.root}: no object {key!r} ({why(e)})") from None
            raise self.err(op, key, e) from None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise self.err(op, key, e) from None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotFound(f"local store {self.root}: no object {key!r} (not a file)")
        return fd, st

    def err(self, op: str, key: str, e: OSError) -> StoreError:
        """``e`` as the StoreError of ``op`` on ``key`` (transient where trying later may work)."""
        code = e.errno or errno.EIO
        return StoreError(
            f"local store {self.root}: {op} {key!r}: {why(e)}", transient=code in TRANSIENT, errno_=code
        )

    def prepare(self) -> None:
        """Make the root and the uploads' directory (once)."""
        if not self._ready:
            self.root.mkdir(parents=True, exist_ok=True)
            os.close(self.open_dir(UPLOADS, create=True))
            self._ready = True

    def publish(self, fd: int, src_dir: int, src_name: str, dest: Sequence[str]) -> None:
        """fsync the file ``fd`` (named ``src_name`` in ``src_dir``), rename it over the key
        ``dest`` (its components) and make the rename durable. The rename replaces a link at
        ``dest`` itself, never what it points to."""
        os.fsync(fd)
        with self.directory(dest[:-1], create=True) as d:
            os.rename(src_name, dest[-1], src_dir_fd=src_dir, dst_dir_fd=d)
            os.fsync(d)

    def publish_new(
        self, dest: Sequence[str], metadata: dict[str, str] | None, fill: Callable[[int], object]
    ) -> None:
        """A new object at ``dest``: a temp file that ``fill(fd)`` writes, then ``publish``."""
        self.prepare()
        with self.directory((TMP_DIR,), create=True) as tmp_dir:
            name = f"{uuid.uuid4().hex}.tmp"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | fs.NOFOLLOW, 0o644, dir_fd=tmp_dir)
            try:
                fill(fd)
                self.write_metadata(fd, metadata)
                self.publish(fd, tmp_dir, name, dest)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=tmp_dir)

    def write_metadata(self, fd: int, metadata: dict[str, str] | None) -> None:
        """Set user metadata on the file or directory ``fd`` (xattrs, where the filesystem has them)."""
        for name, value in (metadata or {}).items():
            if not self._xattrs:
                return
            try:
                os.setxattr(fd, XATTR_PREFIX + name, value.encode())
            except OSError as e:
                if e.errno not in _NO_XATTR:
                    raise
                self._xattrs = False
                log.debug(
                    "local store %s: no xattr support (%s): metadata is not kept", self.root, e.strerror
                )

    def read_metadata(self, fd: int) -> dict[str, str]:
        """The user metadata of the file or directory ``fd``."""
        if not self._xattrs:
            return {}
        try:
            names = [n for n in os.listxattr(fd) if n.startswith(XATTR_PREFIX)]
            return {n[len(XATTR_PREFIX) :]: os.getxattr(fd, n).decode() for n in names}
        except OSError as e:
            if e.errno in _NO_XATTR:
                return {}
            raise
