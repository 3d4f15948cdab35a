"""End to end: passthrough reads. A complete cached version becomes a plain file the kernel reads
itself (model/passthrough.py), so its reads and mmaps reach no READ request of the daemon; the
kernel's rules (one backing file per node while a passthrough open lasts, no other open of it
meanwhile) never show as an error: a writer or a reader of a newer version gets a new node id
(fuse/nodeids.py), and readers already in keep the version they opened.

The daemon's READ count and its passthrough figures come from ``ckptfs status --json``.
"""

from __future__ import annotations

import mmap
import os
import random

import pytest

from tests.support.harness import wait_until
from tests.support.mounting import Mount, ckptfs

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
# The read copies of versions the daemon wrote (passthrough writes make a file of each new one,
# which the kernel reads without a copy: tests/test_passthrough_writes.py).
NO_WRITES = ("--no-passthrough-writes",)


def passthrough(m: Mount) -> dict:
    return m.status()["passthrough"]


def wait_copied(m: Mount, files: int = 1) -> None:
    wait_until(
        lambda: passthrough(m)["files"] >= files and not passthrough(m)["queued_files"],
        60,
        what=f"{files} passthrough files",
    )


def test_a_durable_checkpoint_is_read_by_the_kernel_from_its_file(mount_factory):
    m = mount_factory(extra=NO_WRITES).start()
    assert passthrough(m)["on"], passthrough(m)
    data = random.Random(1).randbytes(3 * 8 * MiB + 12345)
    path = m.path / "step-1" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    m.sync()
    wait_copied(m)
    before = passthrough(m)
    assert path.read_bytes() == data
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[:] == data  # (mmap maps the backing file)
    after = passthrough(m)
    assert after["daemon_reads"] == before["daemon_reads"], "reads reached the daemon"
    assert after["opens"] >= before["opens"] + 2
    assert after["bytes"] == len(data)
    m.stop()


def test_a_reader_keeps_its_version_while_a_writer_commits_a_new_one(mount_factory):
    """The checkpoint pattern over a file a reader holds through passthrough: the writer's open
    and the new readers' opens succeed; the old reader (and its mapping) keeps the old bytes."""
    m = mount_factory().start()
    path = m.path / "latest.pt"
    old = random.Random(2).randbytes(2 * 8 * MiB)
    path.write_bytes(old)  # (a working file the kernel wrote: the version is that file)
    m.sync()
    opens = passthrough(m)["opens"]
    with open(path, "rb") as reader, mmap.mmap(reader.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert passthrough(m)["opens"] == opens + 1
        new = random.Random(3).randbytes(3 * MiB + 7)
        with open(path, "wb") as writer:  # O_TRUNC on the file the reader holds
            writer.write(new)
        assert path.read_bytes() == new
        with open(path, "r+b") as rw:  # a read-write open too
            rw.seek(10)
            rw.write(b"xyz")
        new = new[:10] + b"xyz" + new[13:]
        assert path.read_bytes() == new
        reader.seek(0)
        assert reader.read() == old
        assert mm[: len(old)] == old
    m.sync()
    assert path.read_bytes() == new
    m.stop()


def test_a_newer_version_is_never_served_from_an_older_file(mount_factory):
    """Replace a file again and again (same size, other bytes), reading between and while the
    copy of an older version is being made."""
    m = mount_factory(extra=NO_WRITES).start()
    path = m.path / "ckpt" / "model.pt"
    path.parent.mkdir()
    size = 2 * 8 * MiB
    for round_ in range(6):
        data = random.Random(round_).randbytes(size)
        tmp = path.with_name("model.pt.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        if round_ % 2:
            m.sync()  # durable: a copy starts; the next round races it
        assert path.read_bytes() == data, f"round {round_}: stale bytes"
    m.sync()
    wait_copied(m)
    assert path.read_bytes() == data
    assert passthrough(m)["files"] == 1, "the files of replaced versions are dropped"
    m.stop()


def test_with_passthrough_off_the_daemon_serves_the_reads(mount_factory):
    m = mount_factory(extra=("--passthrough-cache", "0", *NO_WRITES)).start()
    figures = passthrough(m)
    assert not figures["on"] and figures["off_because"] == "--passthrough-cache 0, --no-passthrough-writes"
    data = os.urandom(4 * MiB + 1)  # (under a block: no page-cache prefill either)
    (m.path / "a").write_bytes(data)
    m.sync()
    reads = passthrough(m)["daemon_reads"]
    assert (m.path / "a").read_bytes() == data
    assert passthrough(m)["daemon_reads"] > reads
    assert passthrough(m)["opens"] == 0
    assert "passthrough reads:" in (shown := ckptfs("status", str(m.path)).stdout)
    assert "off (--passthrough-cache 0, --no-passthrough-writes)" in shown
    m.stop()


def test_the_files_stay_within_their_budget(mount_factory):
    m = mount_factory(extra=("--passthrough-cache", "24MiB", *NO_WRITES)).start()
    for i in range(3):
        (m.path / f"f{i}").write_bytes(os.urandom(10 * MiB))
        m.sync()
        (m.path / f"f{i}").read_bytes()  # (an open of a complete version asks for its file)
        wait_until(lambda: not passthrough(m)["queued_files"], 60, what="the copies")
    figures = passthrough(m)
    assert figures["bytes"] <= 24 * MiB and figures["files"] == 2, figures
    assert len(os.listdir(m.cache_dir / "passthrough")) == 2
    (m.path / "f0").unlink()
    m.stop()


def test_a_warmed_checkpoint_is_read_by_the_kernel_after_a_remount(mount_factory):
    """`ckptfs warmup` after a remount (the files are made fresh at each mount) gives the
    warmed files their passthrough files (a copy of blocks kept in the arenas, or the file they
    were fetched whole into: --fetch-whole): the restart's load reaches no READ of the daemon."""
    m = mount_factory(extra=NO_WRITES).start()
    data = random.Random(4).randbytes(8 * MiB + 99)
    path = m.path / "step-2" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    m.sync()
    m.stop()
    m.start()
    assert passthrough(m)["files"] == 0
    ckptfs("warmup", str(m.path / "step-2"))
    if not passthrough(m)["whole_fetches"]:
        wait_copied(m)
    reads = passthrough(m)["daemon_reads"]
    assert path.read_bytes() == data
    assert passthrough(m)["daemon_reads"] == reads
    m.stop()
