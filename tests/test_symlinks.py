"""Symbolic links (issue 17, item 6): symlink, readlink, lstat, rename and unlink of links, stored
as s3fs-fuse stores them (a small object: the target as its body, x-amz-meta-mode S_IFLNK | 0777)
and shown as links by another mount, by a remount with a fresh cache dir, and by s3fs itself.

Real mounts on both stores (the ``store`` fixture), driven by real system calls; the s3fs round
trip runs on the S3 server only, with Debian's s3fs (scripts/setup installs it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ckptfs.model.tree import Node, apply_attr_metadata
from tests.conftest import S3StoreView
from tests.support.harness import blob, stored
from tests.support.mounting import Mount, S3fsMount, ckptfs, fresh_cache, kill_daemon

pytestmark = pytest.mark.timeout(300)

LINK_MODE = stat.S_IFLNK | 0o777


def errno_of(call, *args) -> int:
    with pytest.raises(OSError) as caught:
        call(*args)
    return caught.value.errno


def assert_link(path: Path, target: str) -> None:
    st = os.lstat(path)
    assert stat.S_ISLNK(st.st_mode) and st.st_mode == LINK_MODE, (path, oct(st.st_mode))
    assert st.st_size == len(target.encode())
    assert os.readlink(path) == target


@pytest.mark.unit
def test_only_a_stored_link_mode_makes_a_link():
    def shown(is_dir: bool, mode: int, metadata: dict[str, str]) -> int:
        node = Node(2, "x", None, is_dir, mode, 0, 0)
        apply_attr_metadata(node, metadata)
        return node.mode

    reg, dir_ = stat.S_IFREG | 0o600, stat.S_IFDIR | 0o700
    assert shown(False, reg, {"mode": str(LINK_MODE)}) == LINK_MODE  # s3fs's link (or ours)
    assert shown(False, reg, {"mode": str(stat.S_IFLNK | 0o644)}) == LINK_MODE  # (a link's bits are 0777)
    assert shown(False, reg, {"mode": str(stat.S_IFREG | 0o640)}) == stat.S_IFREG | 0o640
    assert shown(False, reg, {}) == reg and shown(False, reg, {"mode": "-1"}) == reg  # another tool's object
    assert shown(True, dir_, {"mode": str(LINK_MODE)}) == dir_  # a directory never becomes a link
    # A link whose object was replaced by a file: a file again, with its stored mode or 0600.
    assert shown(False, LINK_MODE, {"mode": str(stat.S_IFREG | 0o644)}) == stat.S_IFREG | 0o644
    assert shown(False, LINK_MODE, {}) == stat.S_IFREG | 0o600


def test_links_relative_absolute_dangling_and_to_a_directory(store, mount_factory):
    other = mount_factory(extra=("--list-ttl", "1")).start()  # another node, mounted before the links exist
    m = mount_factory().start()
    data = blob(3 << 20, 1)
    (m.path / "ckpt" / "step1").mkdir(parents=True)
    (m.path / "ckpt" / "step1" / "model.pt").write_bytes(data)
    long_target = "d/" * 2047 + "x"  # 4095 bytes: the longest target a local disk takes
    links = {
        "relative": "ckpt/step1/model.pt",
        "absolute": str(m.path / "ckpt" / "step1" / "model.pt"),
        "dangling": "nowhere.pt",
        "latest": "ckpt/step1",  # a link to a directory
        "ckpt/last": "step1/model.pt",  # relative to its own directory
        "long": long_target,
    }
    for name, target in links.items():
        os.symlink(target, m.path / name)

    def check(root: Path) -> None:
        for name, target in links.items():
            assert_link(root / name, target)
        for name in ("relative", "absolute", "ckpt/last"):
            assert (root / name).read_bytes() == data, name
        assert os.path.lexists(root / "dangling") and not os.path.exists(root / "dangling")
        assert errno_of(open, root / "dangling") == errno.ENOENT
        assert os.path.isdir(root / "latest") and os.listdir(root / "latest") == ["model.pt"]
        kinds = {e.name: e.is_symlink() for e in os.scandir(root)}  # readdir's entry types
        assert kinds == {
            "ckpt": False,
            "relative": True,
            "absolute": True,
            "dangling": True,
            "latest": True,
            "long": True,
        }

    check(m.path)
    assert os.lstat(m.path / "relative").st_uid == os.getuid()
    m.sync()
    info = stored(store, "relative")  # the s3fs convention: target as body, S_IFLNK in the mode
    assert store.read("relative") == b"ckpt/step1/model.pt" and store.read("long") == long_target.encode()
    assert (info.metadata["mode"], info.metadata["uid"], info.metadata["gid"]) == (
        str(LINK_MODE),
        str(os.getuid()),
        str(os.getgid()),
    )

    # Another mount asks the store about each name (a HEAD: the metadata says link); a remount
    # with an empty cache dir lists them and reads each one's metadata. (The absolute link names
    # this mount's path, the same after the remount.)
    for name, target in links.items():
        assert_link(other.path / name, target)
    assert (other.path / "relative").read_bytes() == data
    check(fresh_cache(m).path)
    m.stop()


def test_link_refusals_eexist_and_enametoolong(store, mount_factory):
    m = mount_factory().start()
    (m.path / "file.pt").write_bytes(b"weights")
    os.symlink("file.pt", m.path / "link")
    assert errno_of(os.symlink, "elsewhere", m.path / "file.pt") == errno.EEXIST
    assert errno_of(os.symlink, "elsewhere", m.path / "link") == errno.EEXIST
    assert errno_of(os.symlink, "x" * 4096, m.path / "too_long") == errno.ENAMETOOLONG  # the target
    assert errno_of(os.symlink, "file.pt", m.path / ("n" * 256)) == errno.ENAMETOOLONG  # the name
    assert errno_of(os.readlink, m.path / "file.pt") == errno.EINVAL  # not a link
    assert sorted(os.listdir(m.path)) == ["file.pt", "link"]
    assert os.readlink(m.path / "link") == "file.pt" and (m.path / "file.pt").read_bytes() == b"weights"
    m.sync()
    assert store.keys() == {"file.pt", "link"}
    m.stop()


def test_rename_unlink_and_lchown_of_links_persist(store, mount_factory):
    m = mount_factory().start()
    root = m.path
    (root / "target.pt").write_bytes(b"the weights")
    (root / "sub").mkdir()
    for name in ("moved", "gone", "over_file"):
        os.symlink("target.pt", root / name)
    (root / "plain.pt").write_bytes(b"a file")
    (root / "was_link").symlink_to("target.pt")
    m.sync()  # durable first: the renames below are store-side moves of link objects

    os.rename(
        root / "moved", root / "sub" / "renamed"
    )  # into another directory: its target is unchanged text
    os.unlink(root / "gone")
    os.rename(root / "over_file", root / "plain.pt")  # a link replaces a file
    (root / "file.pt").write_bytes(b"a file again")
    os.rename(root / "file.pt", root / "was_link")  # a file replaces a link
    os.chown(root / "sub" / "renamed", 1234, 5678, follow_symlinks=False)  # chown -h
    os.utime(root / "sub" / "renamed", ns=(1_600_000_000 * 10**9,) * 2, follow_symlinks=False)

    def check(base: Path) -> None:
        assert sorted(os.listdir(base)) == ["plain.pt", "sub", "target.pt", "was_link"]
        assert_link(base / "sub" / "renamed", "target.pt")
        renamed = os.lstat(base / "sub" / "renamed")
        assert (renamed.st_uid, renamed.st_gid, int(renamed.st_mtime)) == (1234, 5678, 1_600_000_000)
        assert os.stat(base / "target.pt").st_uid == os.getuid()  # the target was not chowned
        assert not (base / "sub" / "renamed").exists()  # (target.pt is not in sub/)
        assert_link(base / "plain.pt", "target.pt")
        assert (base / "plain.pt").read_bytes() == b"the weights"
        assert stat.S_ISREG(os.lstat(base / "was_link").st_mode)  # a file, not a link, now
        assert (base / "was_link").read_bytes() == b"a file again"

    check(root)
    m.sync()
    assert store.keys() == {"target.pt", "plain.pt", "was_link", "sub/renamed"}
    assert stat.S_ISREG(int(stored(store, "was_link").metadata["mode"]))
    assert int(stored(store, "plain.pt").metadata["mode"]) == LINK_MODE
    check(fresh_cache(m).path)
    m.stop()


def test_a_link_survives_a_crash_right_after_it_is_made(store, mount_factory):
    m = mount_factory().start()
    os.symlink("global_step100", m.path / "latest")
    kill_daemon(m)  # at once: the link is in the journal, maybe not in the store yet
    m.start()
    assert_link(m.path / "latest", "global_step100")
    m.sync()
    assert store.read("latest") == b"global_step100"
    assert int(stored(store, "latest").metadata["mode"]) == LINK_MODE
    m.stop()


def test_ls_and_checkpoints_show_a_link_as_the_small_file_it_is_stored_as(store, mount_factory):
    """`ckptfs ls` lists a link as a file of its target's length (what a store listing shows);
    a pointer that is a link (DeepSpeed's ``latest``) names its target step on the mount and the URL."""
    m = mount_factory().start()
    for step in (100, 200):
        (m.path / "ds" / f"global_step{step}").mkdir(parents=True)
        (m.path / "ds" / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"w" * step)
    os.symlink("global_step100", m.path / "ds" / "latest")  # not the newest: the pointer decides
    m.sync()
    url = [store.url, *(["--endpoint-url", store.endpoint] if store.endpoint else [])]
    for where in ([str(m.path)], url):
        listed = {f["path"]: f["bytes"] for f in json.loads(ckptfs("ls", *where, "--json").stdout)["files"]}
        assert listed["ds/latest"] == len("global_step100")
        found = json.loads(ckptfs("checkpoints", *where, "--json").stdout)
        (series,) = found["series"]
        assert series["pointers"][0]["names"] == "ds/global_step100", where
    m.stop()


# --- s3fs-fuse on the same bucket ------------------------------------------------------------------


@pytest.fixture
def s3_store(s3_server, s3_bucket):
    return S3StoreView(s3_server, s3_bucket)


@pytest.mark.skipif(
    shutil.which("s3fs") is None, reason="s3fs-fuse is not installed (scripts/setup installs it)"
)
def test_s3fs_and_ckptfs_read_each_others_links(s3_server, s3_bucket, s3_store, tmp_path):
    m = Mount(s3_store.url, tmp_path / "ckptfs", endpoint_url=s3_store.endpoint).start()
    s3fs = None
    try:
        (m.path / "model.pt").write_bytes(b"weights")
        os.symlink("model.pt", m.path / "by_ckptfs")
        m.sync()
        s3fs = S3fsMount(s3_server, s3_bucket, s3_store.prefix, tmp_path)
        assert_link(s3fs.path / "by_ckptfs", "model.pt")
        assert (s3fs.path / "by_ckptfs").read_bytes() == b"weights"
        os.symlink("model.pt", s3fs.path / "by_s3fs")  # s3fs uploads a link at once
        s3fs.stop()
        s3fs = None
        fresh = fresh_cache(m)
        assert_link(fresh.path / "by_s3fs", "model.pt")
        assert (fresh.path / "by_s3fs").read_bytes() == b"weights"
        assert int(stored(s3_store, "by_s3fs").metadata["mode"]) == LINK_MODE
    finally:
        if s3fs is not None:
            s3fs.stop()
        m.cleanup()
