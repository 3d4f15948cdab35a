"""POSIX on the node, atomic in the store (issue 17 items 1, 2, 3 and 8), end to end through a
real mount on both stores, by real system calls and real processes: a file's size and bytes are
visible through every descriptor while it is written; several writers share one file and lose
nothing; shared mmap works on read-write descriptors, its pages reaching the commit; mtime is the
last write's, and ftruncate moves it. The store only ever holds committed versions."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from ckptfs.fuse.ops import ENTRY_TIMEOUT
from ckptfs.model.tree import mtime_text
from tests.support.harness import stored

pytestmark = pytest.mark.timeout(300)


def stat_in_another_process(path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os, sys; print(os.stat(sys.argv[1]).st_size)", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout)


def sizes_seen(fd: int, path) -> set[int]:
    """The size as fstat, lseek(SEEK_END), stat by path and another process see it."""
    end = os.lseek(fd, 0, os.SEEK_END)
    return {os.fstat(fd).st_size, end, os.stat(path).st_size, stat_in_another_process(path)}


def test_the_size_is_visible_while_writing(store, mount_factory):
    """Observed at 705484b: fstat, lseek(SEEK_END), stat and a second process saw 0 until close."""
    m = mount_factory().start()
    path = m.path / "growing.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 5000)
        assert sizes_seen(fd, path) == {5000}
        assert path.read_bytes() == b"x" * 5000  # a reader sees the bytes too
        os.ftruncate(fd, 100_000)
        assert sizes_seen(fd, path) == {100_000}
        assert path.read_bytes() == b"x" * 5000 + bytes(95_000)
        m.sync()
        assert "growing.bin" not in store.keys()  # the store: committed versions only
    finally:
        os.close(fd)
    m.sync()
    assert store.read("growing.bin") == b"x" * 5000 + bytes(95_000)


def test_a_close_changes_no_attribute(store, mount_factory):
    """As on a disk, a close leaves size and times as the last write or truncate set them. The
    kernel caches a new file's attributes from the create, so a commit that moved ctime showed
    one ctime right after a touch and another a second later."""
    m = mount_factory().start()
    fields = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_mode", "st_blocks")
    for name, data in (("touched", b""), ("written", b"w" * 70_000)):
        path = m.path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            if data:
                os.write(fd, data)
            at_close = os.fstat(fd)
        finally:
            os.close(fd)
        after_close = os.stat(path)
        time.sleep(ENTRY_TIMEOUT + 0.5)  # (past the kernel's attribute cache: the daemon answers)
        later = os.stat(path)
        for field in fields:
            assert getattr(at_close, field) == getattr(after_close, field) == getattr(later, field), (
                name,
                field,
            )


def test_an_append_from_another_process_is_not_lost(store, mount_factory):
    """Observed at 705484b: fd1 writes 5,000 bytes, another descriptor opened O_APPEND appends
    10 bytes and closes, fd1 closes: the append was gone (each writer had a private copy)."""
    m = mount_factory().start()
    path = m.path / "log.bin"
    fd1 = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd1, b"a" * 5000)
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\nwith open(sys.argv[1], 'ab') as f: f.write(b'0123456789')",
                str(path),
            ],
            check=True,
            timeout=60,
        )
        assert os.fstat(fd1).st_size == 5010
        m.sync()
        assert "log.bin" not in store.keys()  # fd1 still holds it: no commit yet
    finally:
        os.close(fd1)
    assert path.read_bytes() == b"a" * 5000 + b"0123456789"
    m.sync()
    assert store.read("log.bin") == b"a" * 5000 + b"0123456789"


def test_zip_writer_appending_to_its_own_archive(store, mount_factory):
    """zipfile seeks to the end and reads back its own central directory through a read-write
    descriptor ("a" mode: r+b), as tar and HDF5 writers do."""
    m = mount_factory().start()
    path = m.path / "bundle.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("one.txt", "one" * 1000)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("two.bin", os.urandom(3 << 20))
        assert z.namelist() == ["one.txt", "two.bin"]
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and z.read("one.txt") == b"one" * 1000
    m.sync()
    assert store.read("bundle.zip") == path.read_bytes()


@pytest.mark.parametrize("mode", ["w+", "r+"])
def test_numpy_memmap_read_write(store, mount_factory, mode):
    """Observed at 705484b: mmap(MAP_SHARED) of a file open O_RDWR failed with ENODEV."""
    m = mount_factory().start()
    path = m.path / "weights.npy"
    shape = (1 << 20,)  # 4 MiB of float32
    if mode == "r+":
        np.arange(shape[0], dtype=np.float32).tofile(path)
    arr = np.memmap(path, dtype=np.float32, mode=mode, shape=shape)
    arr[::1024] = -1.0
    arr[-1] = 42.0
    arr.flush()  # msync: the pages reach the working copy
    expected = np.arange(shape[0], dtype=np.float32) if mode == "r+" else np.zeros(shape, np.float32)
    expected[::1024] = -1.0
    expected[-1] = 42.0
    assert np.array_equal(np.fromfile(path, dtype=np.float32), expected)  # another descriptor sees them
    del arr  # munmap and close: the commit
    m.sync()
    assert store.read("weights.npy") == expected.tobytes()


def test_mapped_pages_written_after_close_reach_the_store(store, mount_factory):
    """A mapping outlives its descriptor: what is written through it after close() is written
    back at munmap and committed then."""
    m = mount_factory().start()
    path = m.path / "late.bin"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    mapped[4096:4101] = b"hello"
    mapped.close()
    deadline = time.monotonic() + 30
    while path.read_bytes()[4096:4101] != b"hello":  # (the release, and its commit, come after munmap)
        assert time.monotonic() < deadline, "the mapped write never reached the file"
        time.sleep(0.05)
    m.sync()
    assert store.read("late.bin")[4096:4101] == b"hello"


def test_a_shared_read_map_while_another_process_writes(store, mount_factory):
    """Observed at 705484b: a read-only MAP_SHARED map failed while any writer had the file open."""
    m = mount_factory().start()
    path = m.path / "shared.bin"
    path.write_bytes(b"A" * (1 << 20))
    writer = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(writer, b"B" * 4096, 0)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
            assert mapped[:4096] == b"B" * 4096 and mapped[4096:8192] == b"A" * 4096
            mapped.close()
    finally:
        os.close(writer)
    m.sync()
    assert store.read("shared.bin") == b"B" * 4096 + b"A" * ((1 << 20) - 4096)


def test_mtime_is_the_last_writes_and_ftruncate_moves_it(store, mount_factory):
    """Observed at 705484b: the commit at close set mtime to the close time, and ftruncate moved
    only ctime. Both as a local disk now, and the stored mtime is the last write's (a one-PUT
    file here: a streamed multipart file's stored mtime is its completion's, see docs/semantics.md,
    Attributes)."""
    m = mount_factory().start()
    path = m.path / "timed.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"data")
        written = os.fstat(fd).st_mtime_ns
        time.sleep(1.5)  # (the close comes well after the last write)
    finally:
        os.close(fd)
    assert path.stat().st_mtime_ns == written
    os.utime(path, ns=(10**18, 10**18))
    fd = os.open(path, os.O_WRONLY)
    try:
        before = time.time_ns()
        os.ftruncate(fd, 2)
        st = os.fstat(fd)
        assert st.st_mtime_ns >= before - 10**9 and st.st_ctime_ns >= before - 10**9
        truncated = st.st_mtime_ns
    finally:
        os.close(fd)
    m.stop()
    # The store's own metadata (a one-PUT file: it carries the mtime of the version it holds),
    # read behind ckptfs's back: the ftruncate's mtime to the nanosecond, not the close's.
    assert stored(store, "timed.bin").metadata["mtime"] == mtime_text(truncated)
    m.start()
    assert path.stat().st_size == 2
    assert path.stat().st_mtime_ns // 10**9 == truncated // 10**9
