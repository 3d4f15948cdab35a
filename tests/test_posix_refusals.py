"""Clean refusals and limits, end to end through a real mount on both stores, by real system calls:
FIFOs, devices, sockets and hard links get EPERM (mknod of a regular file makes it); names over
255 bytes and paths over the store's key limit ENAMETOOLONG on every call; sizes beyond the store's
largest object EFBIG at once; link counts as a local disk shows them."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from ckptfs.store.base import S3_LIMITS, GiB, TiB
from ckptfs.store.local_tree import LOCAL_LIMITS
from tests.support.mounting import Mount

pytestmark = pytest.mark.timeout(300)

LARGEST_FILE = S3_LIMITS.max_file_size  # 5 TiB: S3's object limit (10,000 parts of 5 GiB would be more)


@pytest.mark.unit
def test_the_largest_file_is_the_smaller_of_the_object_limit_and_the_parts():
    assert S3_LIMITS.max_file_size == LOCAL_LIMITS.max_file_size == 5 * TiB
    assert replace(S3_LIMITS, max_object_size=100 * TiB).max_file_size == 10_000 * 5 * GiB


def errno_of(call, *args) -> int:
    """The errno ``call(*args)`` fails with (the test fails if it succeeds)."""
    with pytest.raises(OSError) as caught:
        call(*args)
    return caught.value.errno


def bind_errno(path) -> str:
    """What another process sees binding an AF_UNIX socket at ``path``: "ok" or the errno's name."""
    script = (
        "import errno, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.bind(sys.argv[1])\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n"
        "else:\n    print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_fifos_devices_sockets_and_hard_links_get_eperm_mknod_of_a_file_makes_it(store, mount_factory):
    m = mount_factory().start()
    (m.path / "real.bin").write_bytes(b"real")
    assert errno_of(os.mkfifo, m.path / "fifo") == errno.EPERM
    assert errno_of(os.mknod, m.path / "fifo2", stat.S_IFIFO | 0o600) == errno.EPERM
    assert errno_of(os.mknod, m.path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3)) == errno.EPERM
    assert errno_of(os.mknod, m.path / "loop", stat.S_IFBLK | 0o600, os.makedev(7, 0)) == errno.EPERM
    assert bind_errno(m.path / "sock") == "EPERM"
    assert errno_of(os.link, m.path / "real.bin", m.path / "hard.bin") == errno.EPERM
    for refused in ("fifo", "fifo2", "null", "loop", "sock", "hard.bin"):
        assert not os.path.lexists(m.path / refused)

    # mknod of a regular file (S_IFREG, or no type at all) creates it, empty, as create + close would.
    os.mknod(m.path / "made.bin", stat.S_IFREG | 0o640)
    os.mknod(m.path / "typeless.bin", 0o600)
    for name, mode in (("made.bin", 0o640), ("typeless.bin", 0o600)):
        st = os.stat(m.path / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode & ~_umask()
        assert st.st_size == 0 and st.st_nlink == 1
        assert os.getxattr(m.path / name, "user.ckptfs.state") in (b"pending", b"durable")
    assert errno_of(os.mknod, m.path / "made.bin", stat.S_IFREG | 0o644) == errno.EEXIST
    (m.path / "made.bin").write_bytes(b"written later")
    m.sync()
    assert store.keys() == {"real.bin", "made.bin", "typeless.bin"}
    assert store.read("typeless.bin") == b""
    assert store.read("made.bin") == b"written later"
    m.stop()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_names_over_255_bytes_and_paths_over_the_key_limit_get_enametoolong(store, mount_factory):
    m = mount_factory().start()
    (m.path / "file").write_bytes(b"f")
    (m.path / "dir").mkdir()
    too_long = m.path / ("é" * 128)  # 256 bytes (128 characters)
    assert errno_of(os.stat, too_long) == errno.ENAMETOOLONG  # lookup
    assert errno_of(os.open, too_long, os.O_CREAT | os.O_WRONLY, 0o644) == errno.ENAMETOOLONG
    assert errno_of(os.mkdir, too_long) == errno.ENAMETOOLONG
    assert errno_of(os.mknod, too_long, stat.S_IFREG | 0o644) == errno.ENAMETOOLONG
    assert errno_of(os.unlink, too_long) == errno.ENAMETOOLONG
    assert errno_of(os.rmdir, too_long) == errno.ENAMETOOLONG
    assert errno_of(os.rename, m.path / "file", too_long) == errno.ENAMETOOLONG
    assert errno_of(os.rename, too_long, m.path / "file") == errno.ENAMETOOLONG
    assert errno_of(os.rename, m.path / "dir", m.path / "dir" / ("x" * 256)) == errno.ENAMETOOLONG
    longest = "é" * 127 + "a"  # 255 bytes: fits
    (m.path / longest).write_bytes(b"255")

    # Paths: four directories of 250-byte names make a 1004-byte key prefix ("d/d/d/d/"); the store
    # takes keys of 1024 bytes, less its prefix on S3 ("run1/"). The longest file name that fits
    # leaves a byte for a directory's trailing "/", as the namespace checks every new name.
    deep = m.path
    for level in range(4):
        deep = deep / (str(level) * 250)
        deep.mkdir()
    dir_key = 4 * 251
    room = 1024 - (len(store.prefix) + 1 if hasattr(store, "prefix") else 0)
    fits = "f" * (room - dir_key - 1)
    over = fits + "g"  # a key of exactly the limit: may exist (another tool), cannot be made here
    for call, args in (
        (os.open, (deep / over, os.O_CREAT | os.O_WRONLY, 0o644)),
        (os.mkdir, (deep / over,)),
        (os.mknod, (deep / over, stat.S_IFREG | 0o644)),
        (os.rename, (m.path / "file", deep / over)),
    ):
        assert errno_of(call, *args) == errno.ENAMETOOLONG, call.__name__
    assert errno_of(os.stat, deep / over) == errno.ENOENT
    beyond = deep / (over + "h")  # a key past the limit cannot exist: every call says so
    for call, args in (
        (os.stat, (beyond,)),
        (os.unlink, (beyond,)),
        (os.rmdir, (beyond,)),
        (os.rename, (beyond, m.path / "x")),
    ):
        assert errno_of(call, *args) == errno.ENAMETOOLONG, call.__name__
    (deep / fits).write_bytes(b"deep")
    m.sync()
    fits_key = "/".join(str(level) * 250 for level in range(4)) + "/" + fits
    assert store.read(fits_key) == b"deep"  # the store took the longest key the mount allowed
    assert store.read(longest) == b"255"
    assert store.keys() == {"file", longest, fits_key}
    m.stop()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_sizes_beyond_the_largest_object_get_efbig_at_once(store, mount_factory):
    m = mount_factory().start()
    path = m.path / "f.bin"
    path.write_bytes(b"x" * 100)
    m.sync()
    journal = m.cache_dir / "journal"
    journal_before, rss_before = journal.stat().st_size, _rss_kib(m.pid)

    started = time.monotonic()
    done = subprocess.run(
        ["truncate", "-s", "999999999999999", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "File too large" in done.stderr
    assert errno_of(os.truncate, path, LARGEST_FILE + 1) == errno.EFBIG
    fd = os.open(path, os.O_RDWR)
    try:
        assert errno_of(os.ftruncate, fd, 999_999_999_999_999) == errno.EFBIG
        assert errno_of(os.pwrite, fd, b"y", LARGEST_FILE) == errno.EFBIG
        assert errno_of(os.pwrite, fd, b"y", 999_999_999_999_999) == errno.EFBIG
        assert os.fstat(fd).st_size == 100
    finally:
        os.close(fd)
    assert time.monotonic() - started < 30  # refused before any work (the bug took minutes and GBs)

    assert os.stat(path).st_size == 100 and path.read_bytes() == b"x" * 100
    assert journal.stat().st_size - journal_before < 64 << 10
    assert _rss_kib(m.pid) - rss_before < 64 << 10  # KiB: 64 MiB
    (m.path / "after.bin").write_bytes(b"still works")
    m.sync()
    assert store.read("f.bin") == b"x" * 100
    assert store.read("after.bin") == b"still works"
    m.stop()


def test_link_counts_directories_two_plus_subdirectories_unlinked_open_file_zero(store, mount_factory):
    m: Mount = mount_factory().start()
    root_links = os.stat(m.path).st_nlink
    d = m.path / "d"
    d.mkdir()
    assert os.stat(d).st_nlink == 2
    assert os.stat(m.path).st_nlink == root_links + 1
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "b" / "c").mkdir()
    data = os.urandom(3 * 65536 + 7)
    (d / "f.bin").write_bytes(data)
    assert os.stat(d).st_nlink == 4  # ".", its entry, and the ".." of a and b (files do not count)
    assert os.stat(d / "b").st_nlink == 3
    assert os.stat(d / "f.bin").st_nlink == 1
    (d / "a").rmdir()
    assert os.stat(d).st_nlink == 3
    os.rename(d / "b", m.path / "moved")  # a directory moved out takes its ".." along
    assert os.stat(d).st_nlink == 2
    assert os.stat(m.path).st_nlink == root_links + 2
    os.rename(m.path / "moved", d / "b")
    assert os.stat(d).st_nlink == 3
    assert os.stat(m.path).st_nlink == root_links + 1

    reader = os.open(d / "f.bin", os.O_RDONLY)
    writer = os.open(d / "w.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(writer, b"w")
        assert os.fstat(writer).st_nlink == 1
        os.unlink(d / "f.bin")
        os.unlink(d / "w.bin")
        assert os.fstat(reader).st_nlink == 0
        assert os.fstat(writer).st_nlink == 0
        # As on a local disk, the unlinked file stays whole for the descriptor still open.
        assert os.fstat(reader).st_size == len(data)
        assert os.pread(reader, len(data) + 10, 0) == data
    finally:
        os.close(reader)
        os.close(writer)
    m.sync()

    m.stop()
    m.start()  # the counts of directories listed from the store
    assert os.stat(d).st_nlink == 3
    assert os.stat(d / "b").st_nlink == 3
    assert os.stat(d / "b" / "c").st_nlink == 2
    m.stop()
