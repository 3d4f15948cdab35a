"""fsync across a power cut: the cache dir on a disk that loses every write not flushed.

kill -9 plus an emptied RAM tier (tests/test_e2e.py::test_fsync_before_close_survives_crash_and_reboot)
keeps the page cache of the cache dir, so a missing fsync of the disk arena, of the journal or of
the cache dir's entries goes unseen there. Here the cache dir sits on a disk whose unflushed
writes are lost at a cut that comes right after the fsync under test returns, as xfstests'
dm-flakey tests do it; then the daemon is killed (kill -9), its mount and the disk are unmounted,
the RAM tier (tmpfs) is emptied, the disk is powered on and mounted again, and ckptfs remounts
with the same cache dir. Every fsync'd byte must be there.

The disk: dm-flakey (``drop_writes``) over a loop device where the kernel has device-mapper,
else tests/support/powercut_fs.py (a FUSE filesystem that keeps only what was fsynced).
``CKPTFS_POWER_CUT=flakey`` or ``=fuse`` picks one; a test skips, saying why, only where the one
asked for (or, unset, both) cannot run. Each test's id names the disk it ran on (``[dm-flakey]``,
``[powercut-fs]``), and the first test checks that disk itself: what was not flushed is gone
after a cut, so these tests cannot pass on a disk that keeps everything. Uploads are held (the
store behind a proxy that never answers a write) from before the first write to after the cut: a
version must be in the store only through the cache dir, or an upload that finished in time
would hide a missing sync.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.faultproxy import Rule, blackhole
from tests.support.harness import private_shm_dir
from tests.support.mounting import Mount, is_mounted

pytestmark = [pytest.mark.e2e, pytest.mark.store]

UPLOADS = ("put", "upload_part", "create_multipart", "complete_multipart", "copy", "delete")
MiB = 1 << 20
LONG = os.environ.get("CKPTFS_LONG") == "1"
ONLY_LONG = pytest.mark.skipif(not LONG, reason="a long variant (CKPTFS_LONG=1)")


# -- the disk --------------------------------------------------------------------------------
def _flakey_missing() -> str:
    try:
        misc = Path("/proc/misc").read_text()
    except OSError:
        misc = ""
    if "device-mapper" not in misc:
        return "the kernel has no device-mapper (/proc/misc)"
    for tool in ("dmsetup", "losetup", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if os.geteuid() != 0:
        return "not root"
    return ""


def _fuse_missing() -> str:
    if os.geteuid() != 0:
        return "not root (the power-cut filesystem's files must be the daemon's)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return ""


def _run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


class FlakeyDisk:
    """ext4 on dm-flakey over a loop device: the cut loads ``drop_writes`` without flushing
    (suspend --nolockfs), so the page cache's dirty pages written at the unmount are dropped."""

    def __init__(self, root: Path):
        self.image, self.path = root / "disk.img", root / "disk"
        self.name = f"ckptfs-flakey-{uuid.uuid4().hex[:8]}"
        self.loop = ""
        self.path.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(1 << 30)
        self.loop = _run("losetup", "-f", "--show", str(self.image))
        self.sectors = int(_run("blockdev", "--getsz", self.loop))
        _run("dmsetup", "create", self.name, "--table", self._table(drop=False))
        self.dev = f"/dev/mapper/{self.name}"
        _run("mkfs.ext4", "-q", self.dev)
        _run("mount", self.dev, str(self.path))

    def _table(self, drop: bool) -> str:
        if drop:
            return f"0 {self.sectors} flakey {self.loop} 0 0 180 1 drop_writes"
        return f"0 {self.sectors} linear {self.loop} 0"

    def _load(self, drop: bool) -> None:
        _run("dmsetup", "suspend", "--nolockfs", self.name)
        _run("dmsetup", "load", self.name, "--table", self._table(drop))
        _run("dmsetup", "resume", self.name)

    def cut(self) -> None:
        self._load(drop=True)

    def power_on(self) -> None:
        subprocess.run(["umount", str(self.path)], check=True)
        self._load(drop=False)
        _run("mount", self.dev, str(self.path))

    def close(self) -> None:
        if is_mounted(self.path):
            subprocess.run(["umount", "-l", str(self.path)], check=False)
        if self.loop:
            subprocess.run(["dmsetup", "remove", "--retry", self.name], check=False, capture_output=True)
            subprocess.run(["losetup", "-d", self.loop], check=False)


class FuseDisk:
    """tests/support/powercut_fs.py: the cut is SIGKILL of its process (the dead mount refuses
    I/O), power on a lazy unmount and a new start on the same work dir."""

    def __init__(self, root: Path):
        self.work, self.path = root / "powercut-work", root / "disk"
        self.path.mkdir()
        self.proc: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.powercut_fs", str(self.work), str(self.path)],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == b"ready\n", f"the power-cut filesystem did not mount (exit {self.proc.poll()})"

    def cut(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def power_on(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)
        self._start()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        if is_mounted(self.path):
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def _disk_kind() -> str:
    """The disk the tests use: the one ``CKPTFS_POWER_CUT`` asks for, else dm-flakey where it can
    run, else the FUSE power-cut filesystem. It names the tests (``[dm-flakey]``, ``[powercut-fs]``)."""
    asked = os.environ.get("CKPTFS_POWER_CUT", "")
    return asked or ("flakey" if not _flakey_missing() else "fuse")


DISK = _disk_kind()


@pytest.fixture(params=[DISK], ids=[{"flakey": "dm-flakey", "fuse": "powercut-fs"}.get(DISK, DISK)])
def disk(request, tmp_path):
    kind, flakey, fuse = request.param, _flakey_missing(), _fuse_missing()
    if kind == "flakey":
        if flakey:
            pytest.skip(f"CKPTFS_POWER_CUT=flakey but dm-flakey cannot run: {flakey}")
        made: FlakeyDisk | FuseDisk = FlakeyDisk(tmp_path)
    elif kind != "fuse":
        pytest.fail(f"CKPTFS_POWER_CUT={kind}: flakey or fuse")
    elif fuse:
        pytest.skip(
            f"no power-cut disk: dm-flakey: {flakey or 'not asked for'}; the FUSE power-cut filesystem: {fuse}"
        )
    else:
        made = FuseDisk(tmp_path)
    try:
        yield made
    finally:
        made.close()


class Node:
    """One node: a ckptfs mount whose cache dir is on ``disk``, its RAM tier in a tmpfs of its own,
    uploads held until ``release_uploads``."""

    def __init__(self, disk, s3_bucket, proxy, tmp_path: Path, ram_cache: str):
        self.disk, self.proxy = disk, proxy
        self.shm = private_shm_dir()
        self.m = Mount(
            f"s3://{s3_bucket}/run",
            tmp_path / "node",
            endpoint_url=proxy.url,
            ram_cache=ram_cache,
            cache_size="256MiB",
            extra=("--shm-dir", str(self.shm)),
        )
        self.m.cache_dir = disk.path / "cache"
        self.rule: Rule | None = None

    def hold_uploads(self) -> None:
        self.rule = self.proxy.add_rule(Rule(blackhole(), kind=UPLOADS))

    def release_uploads(self) -> None:
        if self.rule is not None:
            self.proxy.remove_rule(self.rule)
            self.rule = None

    def power_cut(self, *fds: int) -> None:
        """The power goes right after the last fsync returned: the disk loses what was not
        flushed, the daemon dies, tmpfs is emptied; then the node boots and ckptfs mounts again."""
        self.disk.cut()
        self.m.kill()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass  # the daemon is gone
        subprocess.run(["umount", "-l", str(self.m.path)], check=False)
        for entry in self.shm.iterdir():
            shutil.rmtree(entry)
        self.disk.power_on()
        self.release_uploads()
        self.m.start()

    def close(self) -> None:
        self.release_uploads()
        if self.m.pid is not None:
            try:
                os.stat(self.m.cache_dir)  # the disk answers: a clean stop can work
            except OSError:
                self.m.kill()
        self.m.cleanup()
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def node_factory(disk, s3_bucket, proxy, tmp_path):
    nodes: list[Node] = []

    def make(ram_cache: str = "64MiB") -> Node:
        n = Node(disk, s3_bucket, proxy, tmp_path, ram_cache)
        nodes.append(n)
        n.m.start()
        return n

    yield make
    for n in nodes:
        n.close()


def store_read(s3_server, s3_bucket, key: str) -> bytes:
    return s3_server.client().get_object(Bucket=s3_bucket, Key=f"run/{key}")["Body"].read()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TIERS = [pytest.param("64MiB", id="ram-tier"), pytest.param("0", id="disk-only")]


# -- the tests --------------------------------------------------------------------------------
def test_the_disk_loses_what_was_not_flushed(disk):
    """The power-cut disk itself: after a cut, bytes written after a file's last fsync are gone,
    so is a file nothing flushed, and a rename no directory fsync followed is undone; what was
    flushed stays. (Else every test below would pass on a disk that keeps everything.)"""
    top = disk.path / "self-check"
    top.mkdir()
    fsync_path(disk.path)
    synced, later = os.urandom(300_000), os.urandom(200_000)
    for name in ("kept.bin", "moved.bin"):
        with open(top / name, "wb") as f:
            f.write(synced)
            f.flush()
            os.fsync(f.fileno())
    fsync_path(top)
    with open(top / "kept.bin", "ab") as f:
        f.write(later)
    (top / "unsynced.bin").write_bytes(later)
    os.rename(top / "moved.bin", top / "renamed.bin")
    assert sorted(os.listdir(top)) == ["kept.bin", "renamed.bin", "unsynced.bin"]
    disk.cut()
    disk.power_on()
    assert sorted(os.listdir(top)) == ["kept.bin", "moved.bin"], (
        f"{type(disk).__name__} kept what was not flushed"
    )
    assert (top / "kept.bin").read_bytes() == synced, (
        f"{type(disk).__name__} kept bytes that were not fsynced"
    )
    assert (top / "moved.bin").read_bytes() == synced


@pytest.mark.parametrize(
    "ram_cache", [pytest.param("64MiB", id="ram-tier"), pytest.param("0", id="disk-only", marks=ONLY_LONG)]
)
def test_a_writers_fsync_before_close_survives_a_power_cut(node_factory, s3_server, s3_bucket, ram_cache):
    """An open writer's fsync: exactly the bytes written before it, not the later ones."""
    n = node_factory(ram_cache)
    n.hold_uploads()
    fsynced, later = os.urandom(9 * MiB + 12345), os.urandom(2 * MiB)
    fd = os.open(n.m.path / "open.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, fsynced)
    os.fsync(fd)
    os.write(fd, later)
    n.power_cut(fd)
    assert (n.m.path / "open.bin").read_bytes() == fsynced
    n.m.sync()
    assert store_read(s3_server, s3_bucket, "open.bin") == fsynced


@pytest.mark.parametrize("ram_cache", TIERS)
def test_a_readers_fsync_of_a_pending_version_survives_a_power_cut(
    node_factory, s3_server, s3_bucket, ram_cache
):
    """A committed version whose upload is held, fsynced through a read-only descriptor: with a
    RAM tier its blocks are copied to the disk tier; without one they are there already (the
    case of 3f145af: only the journal was synced, not the disk arena)."""
    n = node_factory(ram_cache)
    n.hold_uploads()
    data = os.urandom(9 * MiB + 777)
    (n.m.path / "pending.bin").write_bytes(data)
    fd = os.open(n.m.path / "pending.bin", os.O_RDONLY)
    os.fsync(fd)
    n.power_cut(fd)
    assert (n.m.path / "pending.bin").read_bytes() == data
    n.m.sync()
    assert store_read(s3_server, s3_bucket, "pending.bin") == data


def test_a_directory_fsync_survives_a_power_cut(node_factory, s3_server, s3_bucket):
    """Name changes made after a file's fsync, then fsync of their directory: a new directory,
    a rename of the fsynced file, the unlink of a file and the rmdir of a directory already in
    the store. Versions only in the RAM tier are still dropped: a new file closed but never
    fsynced is gone, a file rewritten that way is back to its version in the store."""
    n = node_factory()
    (n.m.path / "old.bin").write_bytes(b"in the store")
    (n.m.path / "rewritten.bin").write_bytes(b"version 1, in the store")
    (n.m.path / "emptied").mkdir()
    n.m.sync()
    n.hold_uploads()
    data = os.urandom(3 * MiB + 5)
    with open(n.m.path / "a.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.mkdir(n.m.path / "sub")
    os.rename(n.m.path / "a.bin", n.m.path / "b.bin")
    os.unlink(n.m.path / "old.bin")
    os.rmdir(n.m.path / "emptied")
    # Committed, in the RAM tier only: read-write opens go through the daemon's arenas (a
    # write-only one would be a file of the disk tier, which the directory's fsync syncs too).
    with open(n.m.path / "ram-only.bin", "w+b") as f:
        f.write(os.urandom(MiB))
    with open(n.m.path / "rewritten.bin", "w+b") as f:
        f.write(b"version 2, in the RAM tier only")
    fsync_path(n.m.path)
    n.power_cut()
    assert sorted(os.listdir(n.m.path)) == ["b.bin", "rewritten.bin", "sub"]
    assert (n.m.path / "b.bin").read_bytes() == data
    assert (n.m.path / "rewritten.bin").read_bytes() == b"version 1, in the store"
    n.m.sync()
    assert store_read(s3_server, s3_bucket, "b.bin") == data


@pytest.mark.parametrize(
    "dir_fsync",
    [pytest.param(True, id="dir-fsynced"), pytest.param(False, id="no-dir-fsync")],
)
def test_a_rename_after_an_fsync_survives_a_power_cut(node_factory, s3_server, s3_bucket, dir_fsync):
    """torch.distributed.checkpoint's ``.metadata``: written to a temp name, fsynced, closed,
    renamed. With the directory fsynced after the rename the new name holds the bytes; without,
    the bytes are under one of the two names (never lost, never both)."""
    n = node_factory()
    n.hold_uploads()
    (n.m.path / "step").mkdir()
    data = os.urandom(2 * MiB + 99)
    with open(n.m.path / "step" / ".metadata.tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(n.m.path / "step" / ".metadata.tmp", n.m.path / "step" / ".metadata")
    if dir_fsync:
        fsync_path(n.m.path / "step")
    n.power_cut()
    names = sorted(os.listdir(n.m.path / "step"))
    if dir_fsync:
        assert names == [".metadata"]
    else:
        assert names in ([".metadata"], [".metadata.tmp"])
    assert (n.m.path / "step" / names[0]).read_bytes() == data
    n.m.sync()
    assert store_read(s3_server, s3_bucket, f"step/{names[0]}") == data
