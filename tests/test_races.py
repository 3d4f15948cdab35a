"""Concurrency and namespace races on a real mount: writers of one path, unlink/rename during uploads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.timeout(300)

WRITER = """
import os, sys
path, byte, size, index = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_WRONLY)
for chunk in range(index, size >> 20, 2):  # every other MiB: the two writers interleave
    os.pwrite(fd, byte * (1 << 20), chunk << 20)
os.close(fd)
"""


def test_two_writers_of_one_file_lose_nothing_and_the_store_gets_the_last_close(store, mount_factory):
    """Two processes write one file at once, as ranks into a shared file would: they share its
    working copy (POSIX on the node), so neither loses the other's writes; readers see only
    bytes someone wrote; the last close commits the whole and the store gets exactly that."""
    m = mount_factory().start()
    path = m.path / "shared.bin"
    size = 24 << 20
    path.write_bytes(b"0" * size)
    problems, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            data = path.read_bytes()
            if not set(data) <= set(b"0AB") or len(data) != size:
                problems.append(f"a reader saw bytes {sorted(set(data))[:4]}, length {len(data)}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, str(path), b, str(size), str(i)])
            for i, b in enumerate("AB")
        ]
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    finally:
        stop.set()
        t.join()
    assert problems == []
    final = path.read_bytes()
    assert final == (b"A" * (1 << 20) + b"B" * (1 << 20)) * (size >> 21)
    m.sync()
    assert store.read("shared.bin") == final
    m.stop()


def test_unlink_and_rename_while_uploading(store, mount_factory):
    m = mount_factory().start()
    gone, moved = os.urandom(40 << 20), os.urandom(40 << 20)
    (m.path / "gone.bin").write_bytes(gone)
    (m.path / "moving.bin").write_bytes(moved)
    os.unlink(m.path / "gone.bin")  # its upload is cancelled (or undone)
    os.rename(m.path / "moving.bin", m.path / "moved.bin")  # its upload is retargeted
    m.sync()
    assert store.keys() == {"moved.bin"}
    assert store.read("moved.bin") == moved
    if hasattr(store, "multipart_uploads"):
        assert store.multipart_uploads() == []
    m.stop()


def test_replace_over_committed_file_and_temp_dir_rename_while_uploads_run(store, mount_factory):
    m = mount_factory().start()
    for i in range(3):  # earlier checkpoints still uploading
        (m.path / f"shard-{i}.bin").write_bytes(os.urandom(20 << 20))
    (m.path / "latest").write_text("step-0")
    (m.path / "latest.tmp").write_text("step-1")
    os.replace(m.path / "latest.tmp", m.path / "latest")
    tmp_dir = m.path / "tmp-checkpoint-1"
    tmp_dir.mkdir()
    (tmp_dir / "model.safetensors").write_bytes(b"w" * (9 << 20))
    (tmp_dir / "config.json").write_text("{}")
    os.rename(tmp_dir, m.path / "checkpoint-1")  # as HF Trainer does
    m.sync()
    keys = store.keys()
    assert {"latest", "checkpoint-1/model.safetensors", "checkpoint-1/config.json"} <= keys
    assert not any(k.startswith("tmp-checkpoint-1") or k == "latest.tmp" for k in keys)
    assert store.read("latest") == b"step-1"
    assert store.read("checkpoint-1/model.safetensors") == b"w" * (9 << 20)
    m.stop()
