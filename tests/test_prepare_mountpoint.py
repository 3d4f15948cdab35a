"""mount_paths.prepare_mountpoint, the daemon's check right before it mounts: a live mount refused, a
dead daemon's mount cleared (lazy_unmount), a mountpoint that is no directory refused; and
`ckptfs umount` of a dead daemon's mount, which unmounts it with the same lazy_unmount."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckptfs.cli import main as cli_main
from ckptfs.config import ckptfs_mounts
from ckptfs.daemon import mount_paths
from ckptfs.errors import MountError
from tests.support.harness import proc_state
from tests.support.mounting import Mount


def _dead(pid: int) -> bool:
    return proc_state(pid) in (None, "Z")


def _kill(m: Mount) -> None:
    os.stat(m.path)  # the kernel caches the root's attributes: a stat would still answer
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    m.pid = None


def test_a_live_mount_is_refused_and_a_dead_daemons_mount_cleared(tmp_path):
    m = Mount(f"file://{tmp_path / 'store'}", tmp_path / "m")
    try:
        m.start()
        with pytest.raises(MountError, match="is already a mount point"):
            mount_paths.prepare_mountpoint(str(m.path))
        _kill(m)
        mount_paths.prepare_mountpoint(str(m.path))
        assert str(m.path) not in ckptfs_mounts()
    finally:
        m.cleanup()


def test_umount_of_a_dead_daemons_mount_unmounts_it_lazily(tmp_path, capsys):
    m = Mount(f"file://{tmp_path / 'store'}", tmp_path / "m")
    try:
        m.start()
        _kill(m)
        assert cli_main.main(["umount", str(m.path)]) == 0
        assert str(m.path) not in ckptfs_mounts()
        err = capsys.readouterr().err
        assert (
            err.startswith(f"ckptfs: the daemon of {m.path} was gone; unmounted it lazily")
            and err.count("\n") == 1
        )
    finally:
        m.cleanup()


def test_a_mountpoint_that_is_no_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MountError, match="not a directory"):
        mount_paths.prepare_mountpoint(str(tmp_path / "file"))
    mount_paths.prepare_mountpoint(str(tmp_path))  # an empty directory with no mount: fine
