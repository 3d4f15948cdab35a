"""Checks on the directories `ckptfs mount` is given, before anything is created or mounted.

A cache dir, RAM dir or local store inside the mountpoint would be served by the mount itself:
the daemon would wait on its own FUSE requests and `umount` would hang. A mountpoint inside the
cache dir or the local store would hide or publish the daemon's own files. Each mistake is one
UsageError that names the path and says what to do. The `mount` command runs these checks before
it starts the daemon, and the daemon runs them again (a foreground mount, or anyone calling
``daemon.run``). Nothing here looks inside a mount that is up: whether a ckptfs mount already at
the mountpoint is served is asked of its daemon over the admin channel (``mount_at``), for the
CLI's check (``check_mountpoint``) and the daemon's (``prepare_mountpoint``, which clears a dead
daemon's mount with ``lazy_unmount``, as `ckptfs umount` does for a mount whose daemon is gone).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from ckptfs.config import MountConfig, ckptfs_mounts
from ckptfs.control import client
from ckptfs.errors import CkptfsError, MountError, UsageError, one_line

log = logging.getLogger(__name__)

# What ``mount_at`` finds at a mountpoint.
NO_MOUNT = "no ckptfs mount"
LIVE = "served by a daemon that answers"
SILENT = "served by a daemon that does not answer"
DEAD = "left by a dead daemon"


def mount_at(mountpoint: str) -> str:
    """Whether a ckptfs mount is at ``mountpoint`` and its daemon answers: NO_MOUNT, LIVE, SILENT or
    DEAD. The daemon is asked, not stat(): the kernel answers stat from its attribute cache for a
    while after the daemon died. Asked up to 3 times: a daemon being killed can still hold its
    socket (its last threads are exiting) and leave a connection unanswered for a moment."""
    if mountpoint not in ckptfs_mounts():
        return NO_MOUNT
    for attempt in range(3):
        try:
            client.call(mountpoint, "status", timeout=5)
            return LIVE
        except client.NoDaemon:
            return DEAD
        except CkptfsError:
            if attempt == 2:
                return SILENT
            time.sleep(1)
    raise AssertionError("unreachable")


def check_mountpoint(mountpoint: str) -> None:
    """`ckptfs mount`'s check of the mountpoint before the daemon starts: an existing, empty
    directory, not a ckptfs mount in use (a dead daemon's mount passes: the new daemon clears it
    and resumes its uploads). One UsageError saying what is wrong."""
    found = mount_at(mountpoint)
    if found == DEAD:
        return
    if found != NO_MOUNT:
        raise UsageError(f"{mountpoint} is already a ckptfs mount (see 'ckptfs status {mountpoint}')")
    try:
        os.stat(mountpoint)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:  # EACCES on a parent, ELOOP, ENAMETOOLONG: not "does not exist"
        raise UsageError(f"cannot reach mountpoint {mountpoint}: {e.strerror}") from None
    if not os.path.isdir(mountpoint):
        raise UsageError(f"mountpoint {mountpoint} is not a directory")
    try:
        with os.scandir(mountpoint) as entries:
            empty = next(entries, None) is None
    except OSError as e:
        raise UsageError(f"cannot read mountpoint {mountpoint}: {e.strerror}") from None
    if not empty:
        raise UsageError(f"mountpoint {mountpoint} is not empty")


def prepare_mountpoint(mountpoint: str) -> None:
    """The daemon's own check right before it mounts (the CLI's is ``check_mountpoint``): a mount
    left by a dead daemon is cleared (its uploads resume from the cache dir), one whose daemon is
    alive or silent refused with a MountError, and the mountpoint must be a directory."""
    found = mount_at(mountpoint)
    if found == DEAD:  # a daemon died and left its mount behind: clear it to mount again
        log.warning("%s: clearing a stale mount left by a dead daemon", mountpoint)
        try:
            lazy_unmount(mountpoint)
        except CkptfsError as e:
            log.warning("%s", e)  # mounting over it fails next, with the kernel's reason
    elif found == SILENT:
        raise MountError(f"{mountpoint} is already a mount point (its daemon does not answer)")
    elif found == LIVE:
        raise MountError(f"{mountpoint} is already a mount point")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")


def lazy_unmount(mountpoint: str) -> None:
    """Detach the mount at ``mountpoint`` now, busy or not (files still open keep it until they
    close): fusermount3 -u -z, or umount -l for root where that fails. CkptfsError if neither can."""
    commands = [["fusermount3", "-u", "-z", mountpoint]]
    if os.geteuid() == 0:
        commands.append(["umount", "-l", mountpoint])
    why = "fusermount3 not found"
    for command in commands:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
            continue
        if done.returncode == 0:
            return
        why = one_line(done.stderr) or f"{command[0]} exited with status {done.returncode}"
    raise CkptfsError(f"could not unmount {mountpoint}: {why}")


def check_mount_paths(config: MountConfig) -> None:
    mountpoint = os.path.realpath(config.mountpoint)
    cache_dir = _check_apart("the cache dir", config.cache_dir, mountpoint)
    _check_writable_dir(
        "the cache dir", config.cache_dir, "give --cache-dir a writable directory (it is created if missing)"
    )

    shm_dir = config.shm_dir
    if shm_dir != MountConfig.shm_dir or os.path.lexists(
        shm_dir
    ):  # a missing default: the RAM tier goes to the cache dir
        _check_apart("--shm-dir", shm_dir, mountpoint)
        if not os.path.isdir(shm_dir):
            what = "does not exist" if not os.path.lexists(shm_dir) else "is not a directory"
            raise UsageError(f"--shm-dir {shm_dir} {what}: give a tmpfs directory such as /dev/shm")
        if not os.access(shm_dir, os.W_OK | os.X_OK):
            raise UsageError(
                f"--shm-dir {shm_dir} is not writable ({_why_not_writable(shm_dir)}): "
                "give a tmpfs directory you can write to"
            )

    store_root = _local_store_dir(config.store_url)
    if store_root is not None:
        store_dir = _check_apart("the local store", store_root, mountpoint)
        if _inside(mountpoint, store_dir):
            raise UsageError(
                f"mountpoint {mountpoint} is inside the local store {store_dir}: "
                "mount somewhere outside the store directory"
            )
        if _inside(cache_dir, store_dir) or _inside(store_dir, cache_dir):
            raise UsageError(
                f"the cache dir {cache_dir} and the local store {store_dir} overlap: "
                "keep them in separate directories"
            )
    if _inside(mountpoint, cache_dir):
        raise UsageError(
            f"mountpoint {mountpoint} is inside the cache dir {cache_dir}: "
            "mount somewhere outside the cache dir"
        )


def _check_apart(what: str, path: str | os.PathLike, mountpoint: str) -> str:
    """``path`` resolved; UsageError if it is the mountpoint or inside it. The path as written is
    compared first, so that resolving it never stat()s inside the mountpoint."""
    written = os.path.abspath(path)
    resolved = written if _inside(written, mountpoint) else os.path.realpath(written)
    if _inside(resolved, mountpoint):
        raise UsageError(
            f"{what} {written} is {'the mountpoint' if resolved == mountpoint else 'inside the mountpoint'} "
            f"{mountpoint}: the mount would wait on itself; put it outside the mount"
        )
    return resolved


def _check_writable_dir(what: str, path: str, advice: str) -> None:
    """UsageError unless ``path`` is a directory we may write in, or can be created as one."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.lexists(existing):  # (lexists is False, too, where a parent forbids search)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = (
            "is not a directory" if existing == path else f"cannot be created: {existing} is not a directory"
        )
        raise UsageError(f"{what} {path} {where}; {advice}")
    if not os.access(existing, os.W_OK | os.X_OK):
        verb = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise UsageError(f"{what} {path} {verb} ({_why_not_writable(existing)}); {advice}")


def _why_not_writable(path: str) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only filesystem" if read_only else "permission denied"


def _local_store_dir(store_url: str) -> Path | None:
    if not store_url.lower().startswith("file://"):
        return None
    from ckptfs.errors import StoreError
    from ckptfs.store import open_store  # a file:// URL: no boto3 import

    try:
        return open_store(store_url).root  # type: ignore[attr-defined]
    except StoreError:
        return None  # a bad URL: reported where the store is opened


def _inside(path: str, directory: str) -> bool:
    """``path`` is ``directory`` or below it (both absolute, normalised)."""
    return os.path.commonpath([path, directory]) == directory
