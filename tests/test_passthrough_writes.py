"""End to end: passthrough writes. A file created or truncated by a write-only open gets a working
copy that is a file of its own (cache/backing.py), which the kernel writes itself: no WRITE
request reaches the daemon, yet every descriptor sees the size as it grows, the last close
commits it, its parts stream to the store while it is written (tail and verify:
model/tailing.py) and a part written again after it was sent is sent again. The committed
version keeps that file: readers (now, and after a clean remount) read it through the kernel.

The daemon's WRITE and READ counts and its passthrough figures come from ``ckptfs status --json``.
"""

from __future__ import annotations

import errno
import os
import random

import pytest

from tests.support.harness import wait_until
from tests.support.mounting import Mount, ckptfs, kill_daemon

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
BLOCK = 8 * MiB


def passthrough(m: Mount) -> dict:
    return m.status()["passthrough"]


def working_files(m: Mount) -> list[str]:
    return sorted(os.listdir(m.cache_dir / "working"))


def test_a_checkpoint_is_written_by_the_kernel_and_reaches_the_store(mount_factory, store):
    m = mount_factory().start()
    figures = passthrough(m)
    assert figures["on"] and figures["writes"], figures
    writes, written = figures["daemon_writes"], m.status()["written_bytes"]
    data = random.Random(1).randbytes(4 * BLOCK + 12345)
    path = m.path / "step-1" / "model.pt"
    path.parent.mkdir()
    sizes = []
    with open(path, "wb") as f:
        for pos in range(0, len(data), MiB):
            f.write(data[pos : pos + MiB])
            f.flush()
            sizes.append(os.stat(path).st_size)  # (another descriptor's view: the working file's size)
        assert os.fstat(f.fileno()).st_size == len(data)
    assert sizes == sorted(sizes) and sizes[-1] == len(data), "stat follows the writes"
    after = m.status()
    assert after["passthrough"]["daemon_writes"] == writes, "WRITE requests reached the daemon"
    assert after["written_bytes"] == written + len(data)  # (counted at the commit)
    assert after["passthrough"]["working_files"] == figures["working_files"] + 1
    assert os.stat(path).st_size == len(data)
    m.sync()
    assert store.read("step-1/model.pt") == data
    reads = passthrough(m)["daemon_reads"]
    assert path.read_bytes() == data
    assert passthrough(m)["daemon_reads"] == reads, "the committed version is read by the kernel"
    assert passthrough(m)["files"] == 0, "no read copy of a version that is its working file"
    ckptfs("verify", str(m.path / "step-1"))
    m.stop()


def test_a_part_written_again_after_it_was_streamed_is_sent_again(mount_factory, store):
    m = mount_factory().start()
    data = bytearray(random.Random(2).randbytes(5 * BLOCK))
    path = m.path / "rewritten.bin"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        wait_until(lambda: passthrough(m)["streamed_bytes"] >= 2 * BLOCK, 60, what="parts streamed")
        f.seek(BLOCK // 2)  # into a part already sent
        patch = b"changed after it was sent" * 1000
        f.write(patch)
        data[BLOCK // 2 : BLOCK // 2 + len(patch)] = patch
    m.sync()
    assert store.read("rewritten.bin") == bytes(data)
    figures = passthrough(m)
    assert figures["changed_parts"] >= 1, figures
    assert figures["verified_bytes"] >= 2 * BLOCK, figures
    m.stop()


def test_a_streamed_file_truncated_below_its_sent_parts_is_stored_as_left(mount_factory, store):
    """Parts streamed while the file was longer are left out of its object: where the server
    refuses a completion that leaves parts out (Ceph RGW 16: InvalidPart), the file goes again in
    a new upload (store/s3_multipart.py, PartsLeftOut). Either way the store holds what the file
    was left with."""
    m = mount_factory().start()
    data = random.Random(5).randbytes(5 * BLOCK)
    path = m.path / "shrunk.bin"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        wait_until(lambda: passthrough(m)["streamed_bytes"] >= 3 * BLOCK, 60, what="parts streamed")
        f.truncate(BLOCK + BLOCK // 2)
    m.sync()
    assert store.read("shrunk.bin") == data[: BLOCK + BLOCK // 2]
    assert not getattr(store, "multipart_uploads", list)(), "no upload left behind"
    m.stop()


def test_truncates_appends_and_a_second_writer_share_the_working_file(mount_factory, store):
    m = mount_factory().start()
    path = m.path / "shared.bin"
    with open(path, "wb") as a:
        a.write(b"a" * (3 * MiB))
        a.flush()
        with open(path, "ab") as b:  # a second write-only open: the same file, O_APPEND
            b.write(b"b" * MiB)
        a.truncate(2 * MiB)  # ftruncate through the kernel: a SETATTR
        a.seek(0, os.SEEK_END)
        a.write(b"c" * 10)
        a.flush()
        assert os.stat(path).st_size == 2 * MiB + 10
    want = b"a" * (2 * MiB) + b"c" * 10
    assert path.read_bytes() == want
    m.sync()
    assert store.read("shared.bin") == want
    m.stop()


def test_a_daemon_killed_under_a_passthrough_writer_commits_nothing_torn(mount_factory, store):
    """The kernel goes on writing the working file after the daemon dies; the close fails. The
    next mount drops that uncommitted file and keeps what was committed before."""
    m = mount_factory().start()
    kept = os.urandom(BLOCK + 5)
    (m.path / "kept.bin").write_bytes(kept)
    f = open(m.path / "open.bin", "wb")  # noqa: SIM115 - closed after the daemon's death
    try:
        f.write(os.urandom(2 * BLOCK))
        f.flush()
        kill_daemon(m)
        try:
            f.write(os.urandom(MiB))
            f.flush()
        except OSError:
            pass  # (the kernel may or may not still take writes: either is fine)
    finally:
        with pytest.raises(OSError) as closed:
            f.close()
    assert closed.value.errno == errno.ENOTCONN
    m.start()
    assert (m.path / "kept.bin").read_bytes() == kept
    assert not (m.path / "open.bin").exists()
    m.sync()
    assert store.read("kept.bin") == kept
    assert "open.bin" not in store.keys()
    assert len(working_files(m)) <= 1, "the uncommitted working file was dropped at start"
    m.stop()


def test_a_committed_working_file_outlives_a_clean_remount(mount_factory):
    m = mount_factory().start()
    data = random.Random(3).randbytes(2 * BLOCK + 77)
    path = m.path / "step-2" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    m.sync()
    m.stop()
    m.start()
    fetched, reads = m.fetched_bytes(), passthrough(m)["daemon_reads"]
    assert path.read_bytes() == data
    assert m.fetched_bytes() == fetched and passthrough(m)["daemon_reads"] == reads
    assert len(working_files(m)) == 1
    path.unlink()
    m.sync()
    wait_until(lambda: not working_files(m), 30, what="the file of a deleted version to go")
    m.stop()


def test_without_passthrough_writes_the_daemon_takes_the_writes(mount_factory, store):
    m = mount_factory(extra=("--no-passthrough-writes",)).start()
    assert not passthrough(m)["writes"]
    writes = passthrough(m)["daemon_writes"]
    data = os.urandom(3 * MiB)
    (m.path / "a").write_bytes(data)
    assert passthrough(m)["daemon_writes"] >= writes + 3
    assert "writes off" in ckptfs("status", str(m.path)).stdout
    m.sync()
    assert store.read("a") == data
    m.stop()
