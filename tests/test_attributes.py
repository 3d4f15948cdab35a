"""Attributes that survive (issue 17, item 4): mode, uid, gid and mtime stored with each object
(the x-amz-meta-mode/-uid/-gid/-mtime metadata of s3fs-fuse and rclone) and restored by any mount.

Real mounts on both stores, as root; the neighbour is the unprivileged ``other_user``. The
round trip through s3fs-fuse runs on the S3 server only, with Debian's s3fs (scripts/setup
installs it; the test is skipped without it).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ckptfs.model.tree import Node, apply_attr_metadata
from ckptfs.store import open_store
from tests.conftest import S3StoreView
from tests.support.harness import can_open, stored
from tests.support.mounting import Mount, S3fsMount, fresh_cache, kill_daemon

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
MTIME = 1_600_000_000  # (whole seconds: the metadata keeps seconds, as s3fs writes it)


def attrs(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_mode, st.st_uid, st.st_gid, int(st.st_mtime)


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
    assert (meta["mode"], meta["uid"], meta["gid"], meta["mtime"]) == (
        str(stat.S_IFREG | 0o600),
        "0",
        "0",
        str(MTIME),
    )
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
    assert (
        after["big.pt"].metadata["mode"],
        after["big.pt"].metadata["uid"],
        after["big.pt"].metadata["gid"],
    ) == (str(stat.S_IFREG | 0o604), "1234", "5678")
    # What ckptfs keeps with the object (its checksums' upload id, its hash) is kept.
    kept = {k: v for k, v in before["big.pt"].metadata.items() if k not in ("mode", "uid", "gid", "mtime")}
    assert kept and {k: after["big.pt"].metadata.get(k) for k in kept} == kept
    m.stop()

    m.start()
    assert stat.S_IMODE(big.stat().st_mode) == 0o604 and (big.stat().st_uid, big.stat().st_gid) == (
        1234,
        5678,
    )
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


def test_attribute_changes_before_the_commit_and_while_the_put_is_pending(
    s3_server, s3_bucket, proxy, tmp_path
):
    """A file not yet committed (chmod/chown/utime on its open descriptor) gets its attributes
    with its first upload: one PUT, no metadata op after it. A file committed and still pending
    (its PUT held at the fault proxy, carrying the old attributes) gets them in an op after its
    put: a CopyObject onto itself follows the PUT."""
    from tests.support.faultproxy import Rule, hold

    view = S3StoreView(s3_server, s3_bucket, prefix="run")  # read behind the proxy's back
    m = Mount(view.url, tmp_path / "m", endpoint_url=proxy.url)
    gate = None
    try:
        m.start()
        # Not yet committed: the changes come while the writer holds the file open.
        early = m.path / "early.pt"
        with open(early, "wb") as f:
            f.write(b"e" * 4096)
            f.flush()  # the write reaches the mount before the changes (no writeback cache)
            os.fchmod(f.fileno(), 0o640)
            os.fchown(f.fileno(), 4321, 4321)
            os.utime(f.fileno(), (MTIME, MTIME))
        m.sync()
        meta = stored(view, "early.pt").metadata
        assert (meta["mode"], meta["uid"], meta["gid"], meta["mtime"]) == (
            str(stat.S_IFREG | 0o640),
            "4321",
            "4321",
            str(MTIME),
        )
        sent = [r.kind for r in proxy.requests if r.path.endswith("/run/early.pt")]
        assert sent.count("put") == 1 and "copy" not in sent, sent
        # Committed and still pending: the PUT is held at the proxy while the attributes change.
        gate = proxy.add_rule(Rule(hold(), kind="put", path=r"/run/late\.pt$", count=1))
        late = m.path / "late.pt"
        late.write_bytes(b"l" * 4096)
        committed_mode = late.stat().st_mode
        put = gate.wait_held(60)
        assert put.headers.get("x-amz-meta-mode") == str(committed_mode)  # the put carries the commit's
        late.chmod(0o604 if stat.S_IMODE(committed_mode) != 0o604 else 0o640)
        new_mode = late.stat().st_mode
        os.chown(late, 1234, 1234)
        os.utime(late, (MTIME, MTIME))
        assert os.getxattr(late, "user.ckptfs.state") == b"pending" and not put.done.is_set()
        gate.release()
        m.sync()
        meta = stored(view, "late.pt").metadata
        assert (meta["mode"], meta["uid"], meta["gid"], meta["mtime"]) == (
            str(new_mode),
            "1234",
            "1234",
            str(MTIME),
        )
        sent = [
            r.kind for r in proxy.requests if r.path.endswith("/run/late.pt") and r.kind in ("put", "copy")
        ]
        assert sent[0] == "put" and "copy" in sent[1:], f"no metadata op after the put: {sent}"
        assert view.read("late.pt") == b"l" * 4096
        m.stop()
    finally:
        if gate is not None:
            gate.release()
        m.cleanup()


def test_objects_without_attributes_keep_the_defaults(store, mount_factory):
    """An object another tool wrote (no such metadata): the mounting user's, 0666 (files) or 0777
    (directories) less --umask: 0600/0700 by default, 0644/0755 with --umask 0022. Set-id bits
    in a stored mode are never shown (the other bits are)."""
    backend = open_store(store.url, store.endpoint)
    try:
        backend.put("foreign.bin", b"from elsewhere")
        backend.put("odd.bin", b"x", {"mode": "not a number", "uid": "-5"})
        backend.put("dir/inner.bin", b"in a directory that has no marker object")
        backend.put("setid.bin", b"x", {"mode": str(stat.S_IFREG | 0o6755)})
    finally:
        backend.close()
    for umask, file_mode, dir_mode in ((None, 0o600, 0o700), ("0022", 0o644, 0o755)):
        m = mount_factory(extra=("--umask", umask) if umask else ()).start()
        for name in ("foreign.bin", "odd.bin", "dir/inner.bin"):
            st = (m.path / name).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (file_mode, os.getuid()), (umask, name)
        st = (m.path / "dir").stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (dir_mode, os.getuid()), umask
        assert stat.S_IMODE((m.path / "setid.bin").stat().st_mode) == 0o755, umask  # (stored: 06755)
        m.stop()


WRITE_AS = (
    "import os, sys\nfd = os.open(sys.argv[1], getattr(os, sys.argv[2]))\nos.write(fd, b'x')\nos.close(fd)"
)


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_write_without_privilege_clears_the_set_id_bits(store, reachable, other_user):
    """As on a local disk (pjdfstest chmod/12, tests 3-4; Linux's file_remove_privs): a write by a
    process without CAP_FSETID (the other user) clears set-user-ID, and set-group-ID where group
    execute is set; root's write keeps them. Write-only handles are direct I/O (the kernel leaves
    it to the filesystem), read-write ones go through the page cache (the kernel asks for it with
    a SETATTR). The store keeps the mode the file was left with."""
    m = reachable[1]("--allow-other").start()
    cases = {  # name: mode, who writes, how it opens, the mode after
        "suid-wronly": (0o4777, "other", "O_WRONLY", 0o777),
        "sgid-wronly": (0o2777, "other", "O_WRONLY", 0o777),
        "both-wronly": (0o6777, "other", "O_WRONLY", 0o777),
        "suid-rdwr": (0o4777, "other", "O_RDWR", 0o777),
        "sgid-rdwr": (0o2777, "other", "O_RDWR", 0o777),
        "sgid-no-group-x": (0o2707, "root", "O_WRONLY", 0o2707),  # (not a set-id program: kept)
        "suid-root-wronly": (0o4777, "root", "O_WRONLY", 0o4777),
        "both-root-rdwr": (0o6777, "root", "O_RDWR", 0o6777),
    }
    for name, (mode, _, _, _) in cases.items():
        (m.path / name).write_bytes(b"program")
        (m.path / name).chmod(mode)
        assert stat.S_IMODE((m.path / name).stat().st_mode) == mode, name
    for name, (_, who, how, _) in cases.items():
        path = str(m.path / name)
        if who == "other":
            done = other_user.python(WRITE_AS, path, how)
            assert done.returncode == 0, (name, done.stderr)
        else:
            fd = os.open(path, getattr(os, how))
            os.write(fd, b"x")
            os.close(fd)
    for name, (_, _, _, after) in cases.items():
        assert stat.S_IMODE((m.path / name).stat().st_mode) == after, name
        assert (m.path / name).read_bytes() == b"xrogram", name
    m.sync()
    for name, (_, _, _, after) in cases.items():  # what the store keeps
        assert stored(store, name).metadata["mode"] == str(stat.S_IFREG | after), name
    m.stop()
    m.start()  # set-id bits are never taken from the store (the ones root kept included)
    for name, (_, _, _, after) in cases.items():
        assert stat.S_IMODE((m.path / name).stat().st_mode) == after & 0o1777, f"{name}, after a remount"
    m.stop()


# What the other user does in a directory (as a local disk, then through the mount): each case
# a file root made with set-id bits (06777: group execute, so set-group-ID goes too), then one
# way of changing it that clears them on Linux (fs/attr.c, setattr_should_drop_suidgid).
SET_ID_CASES = r"""
import json, os, stat, sys
d = sys.argv[1]
mode = lambda name: stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode)
seen = {}
fd = os.open(os.path.join(d, "trunc-open"), os.O_WRONLY | os.O_TRUNC)  # (a passthrough write after)
os.write(fd, b"x")
os.close(fd)
fd = os.open(os.path.join(d, "ftruncate"), os.O_WRONLY)
os.ftruncate(fd, 2)
os.close(fd)
fd = os.open(os.path.join(d, "rdwr-write"), os.O_RDWR)  # (through the page cache)
os.write(fd, b"x")
os.close(fd)
# Set-id bits given while the kernel itself writes the file (a passthrough write: the daemon
# sees no WRITE), then a write.
path = os.path.join(d, "chmod-while-writing")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777)
os.write(fd, b"x" * 4096)
os.chmod(path, 0o6777)
seen["chmod-while-writing: given"] = stat.S_IMODE(os.fstat(fd).st_mode)
os.write(fd, b"y")
seen["chmod-while-writing: written"] = stat.S_IMODE(os.fstat(fd).st_mode)
os.close(fd)
for name in ("trunc-open", "ftruncate", "rdwr-write", "chmod-while-writing"):
    seen[name] = mode(name)
print(json.dumps(seen))
"""


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_set_id_bits_go_as_on_a_local_disk_with_no_getxattr_per_write(store, reachable, other_user):
    """The filesystem clears set-id bits itself (FUSE_HANDLE_KILLPRIV_V2): for an O_TRUNC open,
    a truncate, a write through the page cache and a chown, as the kernel flags them, and for a
    write the kernel makes itself through passthrough (a SETATTR with nothing to set). The same
    cases on a local disk give the same modes. In exchange the kernel stops asking for
    security.capability before every write: a GETXATTR per write() before, a few per file now."""
    root, make = reachable
    m = make("--allow-other").start()
    local = root / "disk"
    outcomes = {}
    for where in (local, m.path / "d"):
        where.mkdir()
        where.chmod(0o777)
        for name in ("trunc-open", "ftruncate", "rdwr-write", "chown"):
            (where / name).write_bytes(b"program")
            (where / name).chmod(0o6777)
        os.chown(where / "chown", other_user.uid, other_user.gid)  # (root's chown clears them too)
        done = other_user.python(SET_ID_CASES, str(where))
        assert done.returncode == 0, (where, done.stderr)
        outcomes[where] = {**json.loads(done.stdout), "chown": stat.S_IMODE((where / "chown").stat().st_mode)}
    assert outcomes[m.path / "d"] == outcomes[local], "as on a local disk"
    assert set(outcomes[local].values()) == {0o777, 0o6777}
    assert outcomes[local]["chmod-while-writing: given"] == 0o6777
    m.sync()
    for name in ("trunc-open", "ftruncate", "rdwr-write", "chown", "chmod-while-writing"):
        assert stored(store, f"d/{name}").metadata["mode"] == str(stat.S_IFREG | 0o777), name

    before = m.status()["passthrough"]
    with open(m.path / "many-writes.bin", "wb") as f:  # (write-only, created: a passthrough writer)
        for _ in range(64):
            f.write(b"w" * 65536)
            f.flush()
    after = m.status()["passthrough"]
    assert after["working_files"] == before["working_files"] + 1
    assert after["getxattr_requests"] - before["getxattr_requests"] <= 4, "not one per write()"
    m.stop()


# --- s3fs-fuse on the same bucket ------------------------------------------------------------------


@pytest.mark.unit
def test_a_stored_mtime_is_read_to_the_nanosecond():
    """s3fs 1.90 stores an mtime that utime gave with nanoseconds as "<seconds>.<nanoseconds>";
    read exactly (a float would lose the last digits). Anything unreadable keeps the default."""

    def shown(mtime: str) -> int:
        node = Node(2, "x", None, False, stat.S_IFREG | 0o600, 0, 0)
        node.mtime_ns = 7
        apply_attr_metadata(node, {"mtime": mtime})
        return node.mtime_ns

    assert shown(str(MTIME)) == MTIME * 10**9  # (what ckptfs and s3fs write for whole seconds)
    assert shown(f"{MTIME}.123456789") == MTIME * 10**9 + 123456789
    assert shown(f"{MTIME}.5") == MTIME * 10**9 + 500_000_000
    for unreadable in ("", "soon", "nan", "inf", "1e999999999", "9e9"):  # (the last two: past an int64 of ns)
        assert shown(unreadable) == 7, unreadable


def exact_attrs(path: Path) -> tuple[int, int, int, int]:
    """mode (type bits included), uid, gid and the mtime in nanoseconds."""
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


def set_attrs(path: Path, mode: int, uid: int, gid: int, mtime: int) -> None:
    """chmod, chown, then utime (last: neither chmod nor chown may move the mtime afterwards)."""
    os.chmod(path, mode)
    os.chown(path, uid, gid)
    os.utime(path, (mtime, mtime))


@pytest.mark.skipif(
    shutil.which("s3fs") is None, reason="s3fs-fuse is not installed (scripts/setup installs it)"
)
def test_attributes_round_trip_through_s3fs_on_the_same_bucket(s3_server, s3_bucket, tmp_path):
    """ckptfs -> store -> s3fs and s3fs -> store -> a fresh ckptfs mount: mode bits, uid, gid and
    mtime of a file and of a directory, each set to values no default could give."""
    view = S3StoreView(s3_server, s3_bucket)

    def raw(key: str) -> dict[str, str]:  # the metadata as the server holds it, for the messages
        return view.client.head_object(Bucket=s3_bucket, Key=f"{view.prefix}/{key}")["Metadata"]

    # path -> (mode with type bits, uid, gid, mtime) set through one tool, checked through the other
    by_ckptfs = {
        "c_dir": (stat.S_IFDIR | 0o750, 1234, 2345, (MTIME + 100) * 10**9),
        "c_dir/model.pt": (stat.S_IFREG | 0o640, 1234, 2345, MTIME * 10**9),
        "c_top.pt": (stat.S_IFREG | 0o604, 3456, 4567, (MTIME + 200) * 10**9),
    }
    by_s3fs = {
        "s_dir": (stat.S_IFDIR | 0o710, 2345, 1234, (MTIME + 300) * 10**9),
        "s_dir/model.pt": (stat.S_IFREG | 0o620, 2345, 1234, (MTIME + 400) * 10**9),
        "s_top.pt": (stat.S_IFREG | 0o444, 4567, 3456, (MTIME + 500) * 10**9),
    }
    data = {name: f"bytes of {name}".encode() for name in (*by_ckptfs, *by_s3fs) if name.endswith(".pt")}

    def make(root: Path, attrs: dict) -> None:
        for name in attrs:  # every entry first, then the attributes: a new entry moves its directory's mtime
            if name in data:
                (root / name).write_bytes(data[name])
            else:
                (root / name).mkdir()
        for name, (mode, uid, gid, mtime_ns) in attrs.items():
            set_attrs(root / name, stat.S_IMODE(mode), uid, gid, mtime_ns // 10**9)

    def check(root: Path, attrs: dict, who: str) -> None:
        for name, want in attrs.items():
            key = name + ("/" if stat.S_ISDIR(want[0]) else "")
            got = exact_attrs(root / name)
            assert got == want, (who, name, oct(got[0]), oct(want[0]), raw(key))
            if name in data:
                assert (root / name).read_bytes() == data[name], (who, name)

    m = Mount(view.url, tmp_path / "ckptfs", endpoint_url=view.endpoint).start()
    s3fs = None
    try:
        make(m.path, by_ckptfs)
        check(m.path, by_ckptfs, "ckptfs")
        m.sync()
        s3fs = S3fsMount(s3_server, s3_bucket, view.prefix, tmp_path)
        check(s3fs.path, by_ckptfs, "s3fs")

        make(s3fs.path, by_s3fs)
        check(s3fs.path, by_s3fs, "s3fs")
        # Sub-second mtimes: both keep the nanoseconds ("<s>.<ns>").
        (s3fs.path / "s_ns.pt").write_bytes(b"s")
        os.utime(s3fs.path / "s_ns.pt", ns=(MTIME * 10**9 + 123456789,) * 2)
        (m.path / "c_ns.pt").write_bytes(b"c")
        os.utime(m.path / "c_ns.pt", ns=(MTIME * 10**9 + 987654321,) * 2)
        m.sync()
        assert os.stat(s3fs.path / "c_ns.pt").st_mtime_ns == MTIME * 10**9 + 987654321
        s3fs.stop()  # s3fs has uploaded all of it when its process is gone
        s3fs = None
        assert (
            raw("s_ns.pt")["mtime"] == f"{MTIME}.123456789"
            and raw("c_ns.pt")["mtime"] == f"{MTIME}.987654321"
        )
        fresh = fresh_cache(m)  # an empty cache dir: all from the store
        check(fresh.path, by_s3fs, "ckptfs")
        check(fresh.path, by_ckptfs, "ckptfs")
        assert os.stat(fresh.path / "s_ns.pt").st_mtime_ns == MTIME * 10**9 + 123456789
    finally:
        if s3fs is not None:
            s3fs.stop()
        m.cleanup()
