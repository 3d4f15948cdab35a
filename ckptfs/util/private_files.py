"""Files and directories the daemon creates, created so that no other local user can redirect or read them.

The daemon runs as root on shared nodes. Each of its files lives in a directory it owns and
checks (not a symbolic link, owned by the daemon's user, mode 0700); each file is opened
with O_NOFOLLOW (a planted symlink fails, it is never followed), with O_EXCL where it is
new, and mode 0600. Anything that fails a check is refused with one line (``MountError``),
never repaired by following it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ckptfs.errors import MountError

DIR_MODE, FILE_MODE = 0o700, 0o600


def ours(st: os.stat_result) -> bool:
    """Owned by the daemon's user (the mounting user; root when root mounts)."""
    return st.st_uid == os.geteuid()


def ensure_dir(path: Path, what: str) -> None:
    """``path`` is a directory of ours, mode 0700; made (0700) if missing.

    An existing directory of ours that others may only read is tightened to 0700; one that
    others may write (they could have planted files in it), a symbolic link, or one owned by
    someone else is refused.
    """
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise MountError(f"cannot create the {what} {path}: {exc.strerror}") from None
    try:  # checked through an fd of the directory itself: nothing can swap it in between
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "it is a symbolic link" if os.path.islink(path) else "not a directory"
            raise MountError(f"refusing the {what} {path}: {kind}") from None
        raise MountError(f"cannot open the {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not ours(st):
            raise MountError(f"refusing the {what} {path}: owned by uid {st.st_uid}, not {os.geteuid()}")
        if st.st_mode & 0o022:
            raise MountError(
                f"refusing the {what} {path}: writable by other users "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); use a directory only its owner can write"
            )
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def is_private_dir(path: Path) -> bool:
    """Whether ``path`` itself (not followed) is a directory of ours with mode 0700."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and ours(st) and stat.S_IMODE(st.st_mode) == DIR_MODE


def check_shared_parent(path: Path, what: str) -> None:
    """A directory we create private directories in (the shm dir): owned by root or us, and if
    others may write it, sticky (as /dev/shm and /tmp are), so no one can move ours away."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise MountError(f"cannot use the {what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"cannot use the {what} {path}: not a directory")
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise MountError(
            f"refusing the {what} {path}: other users could replace what ckptfs makes there "
            "(it must be owned by root or you, and sticky if others may write it, like /dev/shm)"
        )


def open_file(path: Path, flags: int, *, new: bool = False) -> int:
    """An fd on ``path``, a regular file of ours, never through a symbolic link. ``new``: it must
    not exist yet (O_EXCL). A file that does exist is made 0600 if it is not."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if new else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MountError(f"refusing {path}: it is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not ours(st):
            raise MountError(f"refusing {path}: not a regular file owned by uid {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a file of ours (at most ``limit``). FileNotFoundError if there is none."""
    fd = open_file(path, os.O_RDONLY)
    try:
        if limit is not None:
            return os.read(fd, limit)
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def new_temp(path: Path) -> int:
    """A fresh file to write and then rename onto ``path`` (a leftover of a crash is replaced)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # unlink does not follow a link: a planted one just goes
    return open_file(tmp, os.O_WRONLY, new=True)


def replace_from_temp(path: Path) -> None:
    """Rename the file ``new_temp(path)`` wrote onto ``path`` and make the rename durable."""
    os.replace(path.with_name(path.name + ".tmp"), path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably, via a new 0600 file."""
    with os.fdopen(new_temp(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    replace_from_temp(path)
