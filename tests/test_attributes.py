"""Attributes that survive (issue 17, item 4): mode, uid, gid and mtime stored with each object
(the x-amz-meta-mode/-uid/-gid/-mtime metadata of s3fs-fuse and rclone) and restored by any mount.

Real mounts on both stores, as root; the neighbour is the unprivileged ``other_user``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ckptfs.store import open_store
from tests.harness import can_open
from tests.mounting import kill_daemon

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
MTIME = 1_600_000_000  # (whole seconds: the metadata keeps seconds, as s3fs writes it)


def attrs(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_mode, st.st_uid, st.st_gid, int(st.st_mtime)


def stored(store, key: str):
    """The object as the store shows it (its metadata and ETag), read behind ckptfs's back."""
    backend = open_store(store.url, store.endpoint)
    try:
        return backend.head(key)
    finally:
        backend.close()


def test_mode_owner_and_mtime_survive_a_remount_and_show_on_a_second_mount(store, reachable, other_user):
    m = reachable[1]("--allow-other").start()
    mine, theirs, secret = m.path / "mine.pt", m.path / "theirs.pt", m.path / "private" / "inner.pt"
    mine.write_bytes(b"proprietary weights")
    mine.chmod(0o600)
    os.utime(mine, (MTIME, MTIME))
    theirs.write_bytes(b"their weights")
    theirs.chmod(0o640)
    os.chown(theirs, other_user.uid, other_user.gid)
    (m.path / "private").mkdir(mode=0o700)
    secret.write_bytes(b"x")
    secret.chmod(0o644)
    expected = {
        mine: (stat.S_IFREG | 0o600, 0, 0, MTIME),
        theirs: (stat.S_IFREG | 0o640, other_user.uid, other_user.gid, int(theirs.stat().st_mtime)),
        secret: (stat.S_IFREG | 0o644, 0, 0, int(secret.stat().st_mtime)),
    }
    for path, want in expected.items():
        assert attrs(path) == want, path
    m.sync()
    meta = stored(store, "mine.pt").metadata  # the conventions of s3fs-fuse and rclone
    assert (meta["mode"], meta["uid"], meta["gid"], meta["mtime"]) == (str(stat.S_IFREG | 0o600), "0", "0", str(MTIME))
    m.stop()

    # Default --umask 0077 would show everything 0600 root: what is shown now is what was stored.
    second = reachable[1]("--allow-other")
    for mount in (m.start(), second.start()):
        base = mount.path
        for path, want in expected.items():
            assert attrs(base / path.relative_to(m.path)) == want, (mount.path, path)
        assert stat.S_IMODE((base / "private").stat().st_mode) == 0o700
        assert can_open(other_user, base / "mine.pt") == "EACCES"
        assert can_open(other_user, base / "theirs.pt") == "ok"  # its owner now
        assert can_open(other_user, base / "private" / "inner.pt") == "EACCES"  # its directory is 0700
    second.stop()
    m.stop()


def test_chmod_of_a_durable_file_changes_only_its_metadata(store, mount_factory):
    m = mount_factory().start()
    small, big = m.path / "small.pt", m.path / "big.pt"
    small.write_bytes(b"s" * 1000)
    data = os.urandom(20 * MiB)  # three multipart parts
    big.write_bytes(data)
    m.sync()
    before = {key: stored(store, key) for key in ("small.pt", "big.pt")}
    sent = m.status()["uploaded_bytes"]

    small.chmod(0o640)
    big.chmod(0o604)
    os.chown(big, 1234, 5678)
    m.sync()
    assert m.status()["uploaded_bytes"] == sent  # no byte of data went up again
    after = {key: stored(store, key) for key in ("small.pt", "big.pt")}
    assert after["small.pt"].metadata["mode"] == str(stat.S_IFREG | 0o640)
    assert after["small.pt"].etag == before["small.pt"].etag  # the same bytes (S3: a copy in place)
    assert (after["big.pt"].metadata["mode"], after["big.pt"].metadata["uid"],
            after["big.pt"].metadata["gid"]) == (str(stat.S_IFREG | 0o604), "1234", "5678")
    # What ckptfs keeps with the object (its checksums' upload id, its hash) is kept.
    kept = {k: v for k, v in before["big.pt"].metadata.items() if k not in ("mode", "uid", "gid", "mtime")}
    assert kept and {k: after["big.pt"].metadata.get(k) for k in kept} == kept
    m.stop()

    m.start()
    assert stat.S_IMODE(big.stat().st_mode) == 0o604 and (big.stat().st_uid, big.stat().st_gid) == (1234, 5678)
    assert big.read_bytes() == data  # still reads (and checks) as it was written
    m.stop()


def test_chmod_survives_a_crash(store, mount_factory):
    m = mount_factory().start()
    path = m.path / "ckpt.pt"
    path.write_bytes(b"w" * 4096)
    m.sync()
    path.chmod(0o600)
    os.chown(path, 4321, 4321)
    os.utime(path, (MTIME, MTIME))
    kill_daemon(m)  # right away: the change is in the journal, maybe not in the store yet
    m.start()
    assert attrs(path) == (stat.S_IFREG | 0o600, 4321, 4321, MTIME)
    m.sync()
    meta = stored(store, "ckpt.pt").metadata
    assert (meta["mode"], meta["uid"], meta["mtime"]) == (str(stat.S_IFREG | 0o600), "4321", str(MTIME))
    m.stop()


def test_objects_without_attributes_keep_the_defaults(store, mount_factory):
    """An object another tool wrote (no such metadata): the mounting user's, 0666 less --umask."""
    backend = open_store(store.url, store.endpoint)
    try:
        backend.put("foreign.bin", b"from elsewhere")
        backend.put("odd.bin", b"x", {"mode": "not a number", "uid": "-5"})
    finally:
        backend.close()
    m = mount_factory().start()
    for name in ("foreign.bin", "odd.bin"):
        st = (m.path / name).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.getuid()), name
    m.stop()
