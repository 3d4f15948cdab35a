"""Sparse files through a real mount (issue 17, item 5): a hole costs no cache, journal or
daemon work in proportion to its size. The store has no sparse objects, so a hole is stored as
zeros, but the store makes them itself (a server-side copy of a zeros object on S3, a punched
hole in the local store's file): the daemon neither reads, hashes nor sends a byte of hole.
Deleting a file cancels the work on its old content at once, and a second mount reads the holes
back as zeros, checked against the part checksums.

Sizes: 16 GiB on the local store (its holes take no disk), 128 MiB on S3 (Swift writes the copied
zeros to its disks, and copies them at its own pace)."""

from __future__ import annotations

import errno
import os

import pytest

from tests.support.harness import stored

GiB, MiB = 1 << 30, 1 << 20
pytestmark = pytest.mark.timeout(600)


def _size(store) -> int:
    return 16 * GiB if store.url.startswith("file:") else 128 * MiB


def test_a_sparse_file_is_stored_whole_without_the_daemon_touching_its_holes(store, mount_factory):
    size = _size(store)
    m = mount_factory("w").start()
    path = m.path / "sparse.bin"
    with open(path, "wb") as f:
        f.write(b"head")
        f.seek(size // 2)
        f.write(b"middle")
        f.truncate(size)
    assert os.stat(path).st_size == size
    m.sync()

    status = m.status()
    # Three parts hold bytes; every other part is a hole the store made (not one byte of it sent).
    assert status["uploaded_bytes"] >= size
    assert status["stored_bytes"] <= 3 * 8 * MiB
    assert stored(store, "sparse.bin").size == size
    if store.url.startswith("file:"):  # its object file's disk: the parts sent, no byte of hole
        assert (store.root / "sparse.bin").stat().st_blocks * 512 <= 3 * 8 * MiB + MiB  # (+ extents)

    other = mount_factory("r").start()  # an empty cache: every byte read comes from the store, checked
    with open(other.path / "sparse.bin", "rb") as f:
        assert f.read(4) == b"head"
        f.seek(size // 2 - 3)
        assert f.read(12) == bytes(3) + b"middle" + bytes(3)
        f.seek(size // 4)
        assert f.read(1 << 20) == bytes(1 << 20)
        f.seek(size - 5)
        assert f.read() == bytes(5)
    xattr = os.getxattr(other.path / "sparse.bin", "user.ckptfs.verified")
    assert xattr == b"yes"
    with pytest.raises(OSError) as info:  # no whole-file xxh3 for a file with holes
        os.getxattr(other.path / "sparse.bin", "user.ckptfs.xxh3")
    assert info.value.errno == errno.ENODATA


def test_deleting_a_sparse_file_being_uploaded_stops_its_upload_and_umount_finishes(store, mount_factory):
    size = _size(store)
    m = mount_factory().start()
    for name in ("a.bin", "b.bin"):
        with open(m.path / name, "wb") as f:
            f.write(b"x")
            f.truncate(size)
    os.unlink(m.path / "a.bin")
    os.truncate(m.path / "b.bin", 10)  # the old content's upload goes too: a new version replaces it
    m.sync(timeout=120)
    assert m.status()["pending"] == {"files": 0, "bytes": 0}
    m.stop()
    assert stored(store, "a.bin") is None
    assert store.read("b.bin") == b"x" + bytes(9)


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_compressed_sparse_file_reads_back_on_a_mount_without_compress(store, mount_factory):
    """--compress: each hole part is one zstd frame of zeros, encoded once per length and sent
    (padded to S3's smallest part, as every compressed part but the last)."""
    size = 1 * GiB + 5
    m = mount_factory("w", extra=("--compress", "zstd")).start()
    with open(m.path / "sparse.bin", "wb") as f:
        f.seek(100 * MiB)
        f.write(b"data")
        f.truncate(size)
    m.sync()
    assert (
        m.status()["stored_bytes"] <= (size // (8 * MiB) + 1) * 5 * MiB
    )  # (the padding; no byte compressed)
    other = mount_factory("r").start()
    with open(other.path / "sparse.bin", "rb") as f:
        f.seek(100 * MiB - 2)
        assert f.read(8) == bytes(2) + b"data" + bytes(2)
        f.seek(size - 3)
        assert f.read() == bytes(3)
    assert os.getxattr(other.path / "sparse.bin", "user.ckptfs.verified") == b"yes"
