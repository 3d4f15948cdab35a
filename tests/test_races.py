"""Concurrency and namespace races on a real mount: writers of one path, unlink/rename during
uploads. Each test makes its race happen and asserts that it did."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ckptfs.objects import integrity
from tests.support.cluster import WRITERS_PREFIX
from tests.support.harness import wait_until

pytestmark = pytest.mark.timeout(300)

WRITER = """
import os, sys
path, byte, size, index = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_WRONLY)
chunks = list(range(index, size >> 20, 2))  # every other MiB: the two writers interleave
for stage, part in (("opened", chunks[: len(chunks) // 2]), ("halfway", chunks[len(chunks) // 2 :])):
    print(stage, flush=True)
    sys.stdin.readline()  # the test lets both writers go on together
    for chunk in part:
        os.pwrite(fd, byte * (1 << 20), chunk << 20)
os.close(fd)
"""


def test_two_writers_of_one_file_lose_nothing_and_the_store_gets_the_last_close(store, mount_factory):
    """Two processes write one file at once, as ranks into a shared file would: they share its
    working copy (POSIX on the node), so neither loses the other's writes; readers see only
    bytes someone wrote; the last close commits the whole and the store gets exactly that. The
    writers both open the file, then each writes half its share, then the rest: the daemon
    counts both open at once, and each one's second half comes after the other's first."""
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
    writers = []
    try:
        for i, b in enumerate("AB"):
            writers.append(
                subprocess.Popen(
                    [sys.executable, "-c", WRITER, str(path), b, str(size), str(i)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for stage in ("opened", "halfway"):
            assert [w.stdout.readline().strip() for w in writers] == [stage, stage]
            assert m.status()["open_writers"] == 2  # both hold the file open, neither closed it
            for w in writers:
                w.stdin.write("go\n")
                w.stdin.flush()
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
        stop.set()
        t.join()
    assert problems == []
    final = path.read_bytes()
    assert final == (b"A" * (1 << 20) + b"B" * (1 << 20)) * (size >> 21)
    m.sync()
    assert store.read("shared.bin") == final
    m.stop()


# Uploads held at the node's link to the store (tests/support/cluster.py: a fault proxy on S3,
# hold_syscalls on the local store) from before the first write: what is renamed or unlinked
# below is still uploading, its request unanswered, when the rename or unlink returns.
HOLD_EXCEPT = (WRITERS_PREFIX, integrity.SWEEP_STAMP)  # (not the mount's own bookkeeping)


def upload_held(node, before: set[str]) -> set[str]:
    """The node's requests (S3) or system calls (local store) held now and not in ``before``: those
    of the one upload started since."""
    return wait_until(
        lambda: set(node.held()) - before, 60, what="the upload's first request held at the node's link"
    )


def uploads_left(store) -> list:
    """Multipart uploads in progress in the store (a local store's: its uploads directory)."""
    if hasattr(store, "multipart_uploads"):
        return store.multipart_uploads()
    uploads = store.root / ".ckptfs-tmp" / "uploads"  # (the local store's: one directory each)
    return os.listdir(uploads) if uploads.exists() else []


def test_unlink_and_rename_while_uploading(cluster):
    node = cluster.node("a")
    node.hold_uploads(HOLD_EXCEPT)
    gone, moved = os.urandom(40 << 20), os.urandom(40 << 20)
    (node.path / "gone.bin").write_bytes(gone)
    gone_upload = upload_held(node, set())
    (node.path / "moving.bin").write_bytes(moved)
    moving_upload = upload_held(node, gone_upload)
    os.unlink(node.path / "gone.bin")  # its upload is cancelled (or undone)
    os.rename(node.path / "moving.bin", node.path / "moved.bin")  # its upload is retargeted
    assert gone_upload | moving_upload <= set(node.held())  # both still uploading, unanswered
    node.release_uploads()
    node.sync()
    assert cluster.store.keys() == {"moved.bin"}
    assert cluster.store.read("moved.bin") == moved
    assert uploads_left(cluster.store) == []


def test_replace_over_committed_file_and_temp_dir_rename_while_uploads_run(cluster):
    node = cluster.node("a")
    node.hold_uploads(HOLD_EXCEPT)
    uploading: set[str] = set()
    for i in range(3):  # earlier checkpoints still uploading
        (node.path / f"shard-{i}.bin").write_bytes(os.urandom(20 << 20))
        uploading |= upload_held(node, uploading)
    (node.path / "latest").write_text("step-0")
    (node.path / "latest.tmp").write_text("step-1")
    os.replace(node.path / "latest.tmp", node.path / "latest")
    tmp_dir = node.path / "tmp-checkpoint-1"
    tmp_dir.mkdir()
    (tmp_dir / "model.safetensors").write_bytes(b"w" * (9 << 20))
    (tmp_dir / "config.json").write_text("{}")
    os.rename(tmp_dir, node.path / "checkpoint-1")  # as HF Trainer does
    assert uploading <= set(node.held())  # the shards' uploads ran all along, unanswered
    node.release_uploads()
    node.sync()
    keys = cluster.store.keys()
    assert {"latest", "checkpoint-1/model.safetensors", "checkpoint-1/config.json"} <= keys
    assert not any(k.startswith("tmp-checkpoint-1") or k == "latest.tmp" for k in keys)
    assert cluster.store.read("latest") == b"step-1"
    assert cluster.store.read("checkpoint-1/model.safetensors") == b"w" * (9 << 20)
    assert uploads_left(cluster.store) == []
