"""openers.py on its own: whether a writer's FLUSH may commit, asked of real processes' /proc.

No FUSE needed: the check works on whatever filesystem its mountpoint names, so these tests
point it at the filesystem holding tmp_path and hold real descriptors there, in this process
and in child processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
import trio

from ckptfs.fuse.openers import INLINE_FDS, Openers

pytestmark = pytest.mark.unit


def mountpoint_of(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


@pytest.fixture
def target(tmp_path):
    f = tmp_path / "ckpt.bin"
    f.write_bytes(b"x")
    return f


def may_commit(openers: Openers, fh: int) -> bool:
    return trio.run(openers.opener_closed, fh)


def test_the_opener_still_holding_its_descriptor_defers_the_commit(tmp_path, target):
    openers = Openers(mountpoint_of(tmp_path))
    ino = target.stat().st_ino
    fd = os.open(target, os.O_WRONLY)
    try:
        openers.opened(1, ino, os.getpid(), os.O_WRONLY)
        assert not may_commit(openers, 1)  # e.g. a forked child closed its copy: not the last close
    finally:
        os.close(fd)
    assert may_commit(openers, 1)  # the opener's own last close
    assert may_commit(openers, 1)  # and it is forgotten: later flushes commit too


def test_a_dup_counts_until_both_copies_are_closed(tmp_path, target):
    openers = Openers(mountpoint_of(tmp_path))
    fd = os.open(target, os.O_RDWR)
    dup = os.dup(fd)
    openers.opened(7, target.stat().st_ino, os.getpid(), os.O_RDWR)
    os.close(fd)
    try:
        assert not may_commit(openers, 7)
    finally:
        os.close(dup)
    assert may_commit(openers, 7)


def test_two_write_handles_of_one_file_each_commit_at_their_close(tmp_path, target):
    """The count cannot tell the handles apart: with one descriptor per handle, a close commits."""
    openers = Openers(mountpoint_of(tmp_path))
    ino = target.stat().st_ino
    first, second = os.open(target, os.O_WRONLY), os.open(target, os.O_WRONLY)
    openers.opened(1, ino, os.getpid(), os.O_WRONLY)
    openers.opened(2, ino, os.getpid(), os.O_WRONLY)
    try:
        assert not may_commit(openers, 1)  # two descriptors, one other handle: one is a copy of this
        os.close(first)
        assert may_commit(openers, 1)
        openers.released(1)
        assert not may_commit(openers, 2)
    finally:
        os.close(second)
    assert may_commit(openers, 2)


def test_readers_unknown_handles_and_unknown_openers_commit(tmp_path, target):
    openers = Openers(mountpoint_of(tmp_path))
    ino = target.stat().st_ino
    fd = os.open(target, os.O_RDWR)
    try:
        openers.opened(1, ino, os.getpid(), os.O_RDONLY)  # readers never commit anything
        openers.opened(2, ino, 0, os.O_WRONLY)  # an opener outside the daemon's pid namespace
        assert may_commit(openers, 1) and may_commit(openers, 2) and may_commit(openers, 99)
    finally:
        os.close(fd)


def test_a_child_process_holding_the_file_and_then_exiting(tmp_path, target):
    openers = Openers(mountpoint_of(tmp_path))
    with open(target, "ab") as out:
        child = subprocess.Popen(["sleep", "60"], stdout=out)
    try:
        openers.opened(3, target.stat().st_ino, child.pid, os.O_WRONLY)
        assert not may_commit(openers, 3)  # the child opened it and holds its stdout
    finally:
        child.kill()
        child.wait()
    assert may_commit(openers, 3)  # gone: commit


def test_a_large_descriptor_table_is_scanned_too(tmp_path, target):
    openers = Openers(mountpoint_of(tmp_path))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(INLINE_FDS + 10)]
    fd = os.open(target, os.O_WRONLY)
    try:
        openers.opened(1, target.stat().st_ino, os.getpid(), os.O_WRONLY)
        assert not may_commit(openers, 1)
    finally:
        os.close(fd)
        for n in spare:
            os.close(n)
    assert may_commit(openers, 1)


def test_a_descriptor_on_another_filesystem_is_not_ours(tmp_path, target):
    if mountpoint_of(tmp_path) == "/proc":
        pytest.skip("tmp_path on /proc?")
    openers = Openers("/proc")  # the file is not under this "mount": never counted
    fd = os.open(target, os.O_WRONLY)
    try:
        openers.opened(1, target.stat().st_ino, os.getpid(), os.O_WRONLY)
        assert may_commit(openers, 1)
    finally:
        os.close(fd)


def test_a_mountpoint_not_mounted_commits_and_warns_once(tmp_path, target, caplog):
    openers = Openers(str(tmp_path / "not-a-mount"))
    fd = os.open(target, os.O_WRONLY)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptfs.fuse.openers"):
            for fh in (1, 2):
                openers.opened(fh, target.stat().st_ino, os.getpid(), os.O_WRONLY)
                assert may_commit(openers, fh)
    finally:
        os.close(fd)
    assert caplog.text.count("not found in /proc/self/mountinfo") == 1
