"""Exceptions shared by every part of ckptfs."""

from __future__ import annotations

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
    """A filesystem-domain error; ``fuse_ops`` turns it into ``FUSEError(errno)``."""

    def __init__(self, errno: int, message: str = ""):
        super().__init__(message or os.strerror(errno))
        self.errno = errno
