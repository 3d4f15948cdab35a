"""Exceptions shared by every part of ckptfs."""

from __future__ import annotations

import errno
import os


class CkptfsError(Exception):
    """A user-facing error: the CLI prints ``ckptfs: <message>`` (one line, no
    traceback) and exits with ``exit_code``."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(CkptfsError):
    """Bad command-line input (exit status 2, as argparse uses)."""

    exit_code = 2


class MountError(CkptfsError):
    """The filesystem could not be mounted."""


class ControlError(CkptfsError):
    """The admin channel to a running daemon failed, or the daemon refused a request."""


class TimedOut(ControlError, TimeoutError):
    """A daemon command gave up after the timeout it was given (sync, warmup, umount): nothing
    is lost, what was pending stays pending."""


class FsError(Exception):
    """A filesystem-domain error; ``fuse/ops.py`` turns it into ``FUSEError(errno)``."""

    def __init__(self, errno: int, message: str = ""):
        super().__init__(message or os.strerror(errno))
        self.errno = errno


class StoreUnreachable(FsError):
    """A read gave up: the store failed or did not answer for ``--read-timeout`` (an outage)."""


class StoreError(Exception):
    """A store call failed. ``transient`` says whether retrying may help. (Defined here, below
    the stores, so that ``to_errno`` can map it; ``ckptfs.store.base`` exports it.)"""

    def __init__(self, message: str, *, transient: bool = False, errno_: int = errno.EIO, code: str = ""):
        super().__init__(message)
        self.transient = transient
        self.errno = errno_
        self.code = code  # the server's error code, where it gave one ("InvalidPart", ...)


class NotFound(StoreError):
    def __init__(self, message: str):
        super().__init__(message, transient=False, errno_=errno.ENOENT)


class PartsLeftOut(StoreError):
    """The server refused a multipart completion that leaves some uploaded parts out (Ceph RGW
    16 does; S3 and Swift allow it): the upload must be made again with exactly its parts."""


# A store's errno a caller may see, where a local disk would return the same for the same cause:
# the store (or its quota) is full, the file or name is larger than the store holds, the store is
# read-only. Any other store failure is EIO, as a disk's media error is: ENOENT (an object behind
# a name the mount holds has gone: ENOENT would tell the kernel the name itself is absent), EAGAIN
# (a blocking read() must not say "try again"), EACCES (the store's credentials, not the caller's
# permissions), EINVAL, ETIMEDOUT...
STORE_ERRNOS_KEPT = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENAMETOOLONG, errno.EROFS})


def to_errno(exc: BaseException) -> int:
    """The errno a request that failed with ``exc`` answers the kernel with: an FsError's or an
    OSError's own (EIO where it has none), a StoreError's where STORE_ERRNOS_KEPT has it, EIO for
    anything else. Cancellation, KeyboardInterrupt and SystemExit are not failures to answer:
    they are raised again, never swallowed into an errno."""
    if not isinstance(exc, Exception):
        raise exc
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, StoreError):
        return exc.errno if exc.errno in STORE_ERRNOS_KEPT else errno.EIO
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    return errno.EIO


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` on one line (every run of whitespace, newlines included, one space), cut to
    ``limit`` characters with "..." where given: for error messages, logs and the admin reply."""
    line = " ".join(str(text).split())
    return line if limit is None or len(line) <= limit else line[:limit] + "..."
