"""End to end: the latest checkpoint, once durable, is pushed into the kernel's page cache.

That is the path where passthrough reads are off (``--passthrough-cache 0`` here; a kernel before
6.9 or a mount as a user); with them, the checkpoint becomes a file the kernel reads itself
instead (tests/test_passthrough.py).

What the kernel holds is read with mincore(2) on a mapping of the file through the mount, so
these tests see the page cache itself, not the daemon's idea of it. The other half of the
contract: a page of an older version is never served after a newer one is committed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
from pathlib import Path

import pytest

from tests.support.harness import wait_until
from tests.support.mounting import Mount

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
NO_PASSTHROUGH = ("--passthrough-cache", "0", "--no-passthrough-writes")
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(path: Path) -> float:
    """The share of the file's pages in the kernel's page cache (opening keeps them: keep_cache)."""
    size = path.stat().st_size
    # A private writable mapping only to take its address (ctypes wants a writable buffer);
    # nothing is written, so every page is the file's page-cache page or absent.
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm,
    ):
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        start = ctypes.c_char.from_buffer(mm)
        try:
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del start
        return sum(v & 1 for v in vec) / pages


def wait_pushed(mount: Mount, size: int, timeout: float = 60) -> None:
    wait_until(
        lambda: mount.status()["page_cache_pushed_bytes"] >= size,
        timeout,
        what=f"{size} bytes pushed into the page cache",
    )


def test_a_durable_checkpoint_is_in_the_page_cache_before_its_first_read(mount_factory):
    m = mount_factory(extra=NO_PASSTHROUGH).start()
    data = random.Random(1).randbytes(3 * 8 * MiB + 12345)
    path = m.path / "step-1" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    m.sync()
    wait_pushed(m, len(data))
    wait_until(
        lambda: not m.status()["page_cache_queued_files"], 10, what="the push of the last block to end"
    )
    assert m.status()["page_cache_pushed_bytes"] == len(data)
    # Before any read through the mount. In about 1 run in 7 a few % of the pushed pages, scattered
    # over the whole file, are not resident (seen on kernel 6.18 with every push acknowledged;
    # cause not found): those pages are read through FUSE. Without the push it is 0 %.
    assert resident_fraction(path) >= 0.9
    assert path.read_bytes() == data
    m.stop()


def test_small_files_are_not_pushed(mount_factory):
    m = mount_factory(extra=NO_PASSTHROUGH).start()
    (m.path / "step-1").mkdir()
    (m.path / "step-1" / "config.json").write_bytes(b"{}" * 1000)
    m.sync()
    time.sleep(0.5)
    assert m.status()["page_cache_pushed_bytes"] == 0
    m.stop()


def test_a_newer_version_is_never_served_from_older_pages(mount_factory):
    """Overwrite a pushed file again and again (same size, other bytes), reading between: each
    read returns the version committed last, whatever the push of an older one was doing."""
    m = mount_factory(extra=NO_PASSTHROUGH).start()
    path = m.path / "ckpt" / "model.pt"
    path.parent.mkdir()
    size = 2 * 8 * MiB
    for round_ in range(6):
        data = random.Random(round_).randbytes(size)
        tmp = path.with_name("model.pt.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        if round_ % 2:
            m.sync()  # durable: a push starts; the next round races it
        assert path.read_bytes() == data, f"round {round_}: stale bytes"
    m.sync()
    wait_pushed(m, size)
    assert path.read_bytes() == data
    m.stop()


def test_a_push_put_off_by_an_open_reader_goes_ahead_when_it_closes(mount_factory):
    """The push of a durable checkpoint finds the file open (a reader): it waits for the close
    instead of being dropped (it was dropped: the next restart then read through FUSE)."""
    m = mount_factory(extra=NO_PASSTHROUGH).start()
    path = m.path / "ckpt" / "model.pt"
    path.parent.mkdir()
    size = 2 * 8 * MiB
    path.write_bytes(os.urandom(size))
    with open(path, "rb"):
        m.sync()
        wait_until(
            lambda: not m.status()["page_cache_queued_files"],
            60,
            what="the push to come and find the file open",
        )
        assert m.status()["page_cache_pushed_bytes"] == 0
    wait_pushed(m, size)
    m.stop()
