"""The Python API for training scripts: wait for durability without a subprocess.

    import ckptfs

    torch.save(state, f"/mnt/ckpt/step-{step}/model.pt")
    ckptfs.sync("/mnt/ckpt/step-{step}", timeout=600)   # in the store now (or TimedOut)
    ckptfs.state("/mnt/ckpt/step-{step}/model.pt")        # "durable"

Every call talks to the daemon of the mount that holds the path (its control socket) or reads
the file's ``user.ckptfs.state`` attribute; nothing here imports the daemon's libraries.
Errors: ``NotACkptfsMount`` (the path is on no ckptfs mount), ``TimedOut`` (a ``TimeoutError``:
the timeout passed, nothing is lost, what was pending stays pending), ``FileNotFoundError``,
``CkptfsError`` for the rest (the daemon is gone, permission denied).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from ckptfs.config import ckptfs_mounts
from ckptfs.errors import CkptfsError, TimedOut

STATE_XATTR = "user.ckptfs.state"
WRITING, PENDING, REPLICATED, DURABLE = "writing", "pending", "replicated", "durable"
POLL_S = 0.2  # wait_durable: how often it looks at a file still open for writing
CLIENT_SLACK_S = 30.0  # the daemon enforces a timeout; ours only guards against a hung daemon

__all__ = ["NotACkptfsMount", "SyncResult", "TimedOut", "mount_of", "state", "sync", "wait_durable"]


class NotACkptfsMount(CkptfsError, ValueError):
    """The path is not on a ckptfs mount."""


@dataclass(frozen=True)
class SyncResult:
    files: int  # files that were pending when the sync began, now durable
    bytes: int  # their size
    seconds: float  # how long the sync waited


def mount_of(path: str | os.PathLike) -> str:
    """The ckptfs mountpoint holding ``path`` (the innermost one). Reads the mount table only."""
    mounts = ckptfs_mounts()
    path = os.fspath(path)
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        owners = [m for m in mounts if os.path.commonpath([m, candidate]) == m]
        if owners:
            return max(owners, key=len)
    raise NotACkptfsMount(f"{path} is not on a ckptfs mount")


def _relative(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(mountpoint, [path relative to it]) as the daemon wants it; [] for the whole mount."""
    mountpoint = mount_of(path)
    path = os.fspath(path)
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        if os.path.commonpath([mountpoint, candidate]) == mountpoint:
            rel = os.path.relpath(candidate, mountpoint)
            if rel == ".":
                return mountpoint, []
            if not os.path.lexists(candidate):
                raise FileNotFoundError(errno.ENOENT, "no such file or directory on the mount", path)
            return mountpoint, [rel]
    raise NotACkptfsMount(f"{path} is not on a ckptfs mount")  # (mount_of found one: not reached)


def sync(path: str | os.PathLike, timeout: float | None = None) -> SyncResult:
    """Block until everything committed (closed) so far at or under ``path`` is durable in the
    store; ``path`` the mountpoint means the whole mount. Raises ``TimedOut`` after ``timeout``
    seconds (the uploads go on; nothing is lost)."""
    from ckptfs.control import client  # (trio: only when used)

    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
    mountpoint, paths = _relative(path)
    result = client.call(
        mountpoint,
        "sync",
        {"paths": paths, "timeout": timeout},
        timeout=None if timeout is None else timeout + CLIENT_SLACK_S,
    )
    return SyncResult(
        int(result.get("files") or 0), int(result.get("bytes") or 0), float(result.get("seconds") or 0.0)
    )


def state(path: str | os.PathLike) -> str:
    """``"durable"`` (in the store), ``"replicated"`` (committed, not yet in the store, held by
    the ``--replicas`` peers), ``"pending"`` (committed, on this node only) or ``"writing"``
    (created, never closed yet). A directory is ``"durable"`` once every file
    committed in it is."""
    mount_of(path)
    try:
        return os.getxattr(path, STATE_XATTR).decode()
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            raise NotACkptfsMount(f"{os.fspath(path)} has no ckptfs state (not on a ckptfs mount?)") from None
        raise


def wait_durable(path: str | os.PathLike, timeout: float | None = None) -> None:
    """Block until ``path`` is durable: unlike ``sync``, a file still being written (an async
    save) is waited for until it is closed and then uploaded. Raises ``TimedOut``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        now = state(path)
        if now == DURABLE:
            return
        if now in (PENDING, REPLICATED):
            sync(path, timeout=left)  # (raises TimedOut at the deadline)
            continue
        if left == 0.0:
            raise TimedOut(f"timed out after {timeout:g} s: {os.fspath(path)} is still open for writing")
        time.sleep(POLL_S if left is None else min(POLL_S, left))
