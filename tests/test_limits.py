"""Hardened for shared nodes (issue 14): the RAM tier never SIGBUSes, memory and threads are
bounded by flags checked against the machine at mount. Real mounts; a 64 MiB tmpfs stands in
for a container's /dev/shm."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from ckptfs.cache.arena import DISK, RAM
from ckptfs.cache.cache import Cache
from ckptfs.config import MiB, MountConfig
from ckptfs.daemon import limits
from tests.conftest import LocalStoreView
from tests.support.harness import assert_one_line_error, run_cli, wait_until
from tests.support.mounting import CKPTFS, Mount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


def tmpfs(path: Path, size: str):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_shm(tmp_path: Path):
    """A 64 MiB tmpfs: docker's and Kubernetes' default /dev/shm."""
    yield from tmpfs(tmp_path / "shm", "64m")


@pytest.fixture
def own_shm(tmp_path: Path):
    """A tmpfs of our own for the RAM tier, so the test neither sees nor touches the node's /dev/shm."""
    yield from tmpfs(tmp_path / "shm", "1g")


@pytest.fixture
def store(tmp_path):
    """The local store only: these tests are about the machine, not the store."""
    return LocalStoreView(tmp_path / "store")


def fill(path: Path, leave: int) -> None:
    """Take all but ``leave`` bytes of the filesystem of ``path``'s directory (another user's file)."""
    st = os.statvfs(path.parent)
    with open(path, "wb") as f:
        f.write(b"\x5a" * max(st.f_bavail * st.f_frsize - leave, 0))


def status_of(m: Mount) -> dict:
    return m.status()


def vm(pid: int, field: str) -> int:
    """A /proc/PID/status field (VmRSS, VmHWM, RssAnon) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


# -- the RAM tier on a small /dev/shm --------------------------------------------------------


def test_ram_cache_larger_than_shm_is_refused(tmp_path, small_shm, mount_factory):
    m = mount_factory("m", ram_cache="1GiB", extra=("--shm-dir", str(small_shm)))
    done = run_cli("mount", *m.args())
    assert_one_line_error(done, 2, "--ram-cache 1 GiB", "64 MiB", "--shm-dir", "--shm-size")
    assert not os.listdir(small_shm)  # refused before anything was created there


def test_ram_cache_larger_than_free_shm_is_refused(tmp_path, small_shm, mount_factory):
    fill(small_shm / "other-users-file", leave=16 * MiB)
    m = mount_factory("m", ram_cache="32MiB", extra=("--shm-dir", str(small_shm)))
    done = run_cli("mount", *m.args())  # (fits the tmpfs's size, not what is free in it)
    assert_one_line_error(done, 1, "--ram-cache 32 MiB", "free of 64 MiB", "--shm-dir")


def test_full_shm_falls_back_to_disk(tmp_path, small_shm, mount_factory):
    """/dev/shm fills up under a mounted daemon: writes go on in the disk tier, no SIGBUS."""
    # (through the daemon's arenas: passthrough writes would take the disk tier's files)
    m = mount_factory(
        "m", ram_cache="32MiB", extra=("--shm-dir", str(small_shm), "--no-passthrough-writes")
    ).start()
    fill(small_shm / "other-users-file", leave=12 * MiB)  # room for one 8 MiB slot of the four
    data = os.urandom(3 * 32 * MiB)
    for name in ("a", "b"):  # the second save also meets the populate thread's ahead-of-time touch
        with open(m.path / name, "wb") as f:
            for i in range(0, len(data), MiB):
                f.write(data[i : i + MiB])
    status = status_of(m)  # the daemon is alive and answers
    assert status["pid"] == m.pid
    assert status["ram"]["budget"] == 8 * MiB  # shrunk to the slot it had pages for
    for name in ("a", "b"):
        assert (m.path / name).read_bytes() == data
    m.sync()
    log = (m.cache_dir / "ckptfs.log").read_text()
    assert log.count("RAM tier shrunk from 32 MiB to 8 MiB") == 1, log
    m.stop()
    assert (tmp_path / "store" / "a").read_bytes() == data


def test_a_full_tmpfs_is_an_errno_not_a_signal(tmp_path, small_shm, caplog):
    """The cache itself: a RAM slot tmpfs cannot back is refused before anything touches it
    (allocation, and the populate thread), and the tier shrinks to the slots it has."""
    block = 8 * MiB
    c = Cache(tmp_path / "cache", small_shm / "ram", block, 4 * block, 8 * block)
    try:
        ram = c.tiers[RAM]
        first = c.try_alloc()
        c.write(first, 0, b"\1" * block)
        fill(small_shm / "other-users-file", leave=block + block // 2)  # room for one more slot
        ahead, unbacked = ram.free[-1], ram.free[-2]  # (the free list is taken from its end)
        assert ram.populate(ahead) is True
        assert ram.populate(unbacked) is False  # an answer, not a SIGBUS
        assert unbacked not in ram.touched
        second = c.try_alloc()
        assert second == (RAM, ahead)
        c.write(second, 0, b"\2" * block)
        third = c.try_alloc()  # the next RAM slot has no pages: the disk tier takes it
        assert third[0] == DISK
        assert ram.budget == 2 * block and ram.free == []
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"the RAM tier's filesystem ({ram.path.parent}) cannot hold more (No space left on device): RAM tier "
            "shrunk from 32 MiB to 16 MiB for this mount; the rest goes to the disk tier (free space there, "
            "or remount with a smaller --ram-cache or another --shm-dir)"
        ]
        for ref in (first, second, third):
            c.decref(ref)
        assert sorted(ram.free) == sorted([first[1], ahead])  # the backed slots stay in use
        assert c.try_alloc()[0] == RAM and c.try_alloc()[0] == RAM and c.try_alloc()[0] == DISK
    finally:
        c.close()


def test_no_ram_tier(tmp_path, own_shm, mount_factory):
    """--ram-cache 0: no RAM tier, everything in the disk tier."""
    m = mount_factory("m", ram_cache="0", extra=("--shm-dir", str(own_shm))).start()
    data = os.urandom(20 * MiB + 5)
    (m.path / "f").write_bytes(data)
    status = status_of(m)
    assert status["ram"]["budget"] == 0 and status["disk"]["used"] > 0
    assert (m.path / "f").read_bytes() == data
    m.stop()


# -- flags checked against the machine -------------------------------------------------------


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--cache-size", "0"], ["--cache-size 0 bytes", "cannot hold one part"]),
        (["--ram-cache", "1MiB"], ["--ram-cache 1 MiB", "cannot hold one part", "0 for no RAM tier"]),
        (["--ram-cache", "1PiB"], ["--ram-cache 1 PiB", "more than this machine's RAM"]),
        (["--cache-size", "1EiB"], ["--cache-size 1 EiB", "more than the whole filesystem"]),
        (["--upload-concurrency", "100000"], ["--upload-concurrency 100000 is too many", "at most 64"]),
        (["--part-size", "6GiB"], ["--part-size 6 GiB is out of range"]),
        (["--part-size", "1KiB"], ["--part-size 1 KiB is out of range"]),
        (
            ["--part-size", "5GiB", "--upload-concurrency", "64", "--ram-cache", "5GiB"],
            [
                "--upload-concurrency 64 x --part-size 5 GiB = 320 GiB",
                "lower --part-size or --upload-concurrency",
            ],
        ),
        (["--shm-dir", "/nonexistent/shm"], ["--shm-dir /nonexistent/shm does not exist"]),
    ],
)
def test_flag_limits(flags, needles, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    started = time.monotonic()
    done = run_cli(
        "mount", f"file://{tmp_path / 'store'}", str(mnt), "--cache-dir", str(tmp_path / "cache"), *flags
    )
    assert_one_line_error(done, 2, *needles)
    assert time.monotonic() - started < 60  # refused by the command itself, not a daemon start-up timeout
    assert not (tmp_path / "cache").exists()  # no daemon was started


def test_limits_scale_with_the_machine(monkeypatch, tmp_path):
    """The same flags pass or fail with the machine's RAM (a container's cgroup limit, say)."""
    config = MountConfig(
        mountpoint=str(tmp_path),
        store_url="file:///x",
        cache_dir=str(tmp_path / "c"),
        ram_cache=2 << 30,
        part_size=64 * MiB,
        upload_concurrency=16,
    )
    monkeypatch.setattr(limits, "machine_memory", lambda: 64 << 30)
    limits.check(config)
    monkeypatch.setattr(limits, "machine_memory", lambda: 3 << 30)  # 1 GiB of bodies > 3 GiB / 4
    with pytest.raises(limits.UsageError, match="more than a quarter of this machine's 3 GiB"):
        limits.check(config)
    monkeypatch.setattr(limits, "machine_memory", lambda: 1 << 30)
    config.upload_concurrency = 1
    with pytest.raises(limits.UsageError, match="more than this machine's RAM"):
        limits.check(config)


# -- the daemon's memory ---------------------------------------------------------------------


# -- descriptors: each cache file the kernel reads or writes itself keeps one open -----------


def open_files(pid: int) -> tuple[int, int]:
    """The process's open descriptors now, and its soft RLIMIT_NOFILE."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = int(line.split()[3])
    return len(os.listdir(f"/proc/{pid}/fd")), soft


def test_open_file_limit_bounds_the_cache_files_kept_open(tmp_path, mount_factory):
    """Under a low hard limit (a shell's or a service's), many small files written: each would
    keep its working copy's file open. Past the budget the limit leaves, files go through the
    daemon's arenas instead: no EMFILE for the writer, for the control socket (sync, status,
    umount) or for the store, and every file reads back."""
    m = mount_factory("m", prefix=("prlimit", "--nofile=480:480", "--")).start()
    assert m.pid is not None
    passthrough = m.status()["passthrough"]
    cap = passthrough["max_backing_files"]
    assert 0 < cap < 480 and passthrough["max_files"] < 480 - cap
    files = {f"f{i}": os.urandom(4096 + i) for i in range(cap + 150)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    used, soft = open_files(m.pid)
    assert soft == 480 and used < soft
    passthrough = m.status()["passthrough"]
    assert passthrough["backing_files"] <= cap and passthrough["working_files"] == cap
    m.sync()
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data, name
    m.stop()


def test_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path, mount_factory):
    m = mount_factory("m", prefix=("prlimit", "--nofile=512:4096", "--")).start()
    assert m.pid is not None
    assert open_files(m.pid)[1] == 4096
    assert m.status()["passthrough"]["max_backing_files"] > 512
    m.stop()


def test_a_low_open_file_limit_is_a_warning_at_mount(tmp_path, store):
    """A limit that leaves no room for cache files kept open still mounts (files then go through
    the daemon), with one line saying so."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        [
            "prlimit",
            "--nofile=300:300",
            "--",
            *CKPTFS,
            "mount",
            store.url,
            str(mnt),
            "--cache-dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert done.returncode == 0, done.stderr
        warning = [line for line in done.stderr.splitlines() if "open-file limit" in line]
        assert len(warning) == 1 and "ulimit -n" in warning[0], done.stderr
        (mnt / "f").write_bytes(b"x" * 5000)
        assert (mnt / "f").read_bytes() == b"x" * 5000
    finally:
        subprocess.run([*CKPTFS, "umount", str(mnt)], capture_output=True, timeout=120)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_rss_stays_under_the_formula(tmp_path, own_shm, mount_factory):
    """Writing four times the RAM budget (and reading it back) keeps the daemon's peak RSS under
    --ram-cache + (3 x concurrency + 4) x part size + the fixed overhead (docs/architecture.md)."""
    ram, part, concurrency = 32 * MiB, 4 * MiB, 4
    m = mount_factory(
        "m",
        ram_cache=str(ram),
        cache_size="1GiB",
        extra=("--part-size", str(part), "--upload-concurrency", str(concurrency), "--shm-dir", str(own_shm)),
    ).start()
    data = os.urandom(4 * ram)
    for name in ("a", "b"):
        (m.path / name).write_bytes(data)
    m.sync()
    for name in ("a", "b"):
        assert (m.path / name).read_bytes() == data
    config = MountConfig(
        mountpoint="",
        store_url=m.store_url,
        cache_dir="",
        ram_cache=ram,
        part_size=part,
        upload_concurrency=concurrency,
    )
    # (on S3, the store workers' too: the bound covers them; each one's peak, summed)
    workers = (m.status()["store_workers"] or {"pids": []})["pids"]
    assert len(workers) == config.store_worker_count()
    peak = vm(m.pid, "VmHWM") + sum(vm(pid, "VmHWM") for pid in workers)
    assert peak <= limits.memory_bound(config), (peak, limits.memory_bound(config))


def test_idle_rss_is_not_concurrency_times_part_size(tmp_path, own_shm, mount_factory):
    """Part buffers are made when first needed: 8 x 256 MiB would be 2 GiB of zeros up front."""
    part, concurrency = 256 * MiB, 8
    m = mount_factory(
        "m",
        ram_cache=str(part),
        extra=("--part-size", str(part), "--upload-concurrency", str(concurrency), "--shm-dir", str(own_shm)),
    ).start()
    (m.path / "small").write_bytes(b"x" * 4096)  # a small file: no part buffer
    m.sync()
    # (RssShmem is the RAM tier: the populate thread gives the next save's slot its pages.)
    assert vm(m.pid, "RssAnon") < limits.FIXED_OVERHEAD < concurrency * part


def test_rss_with_cluster_stays_under_the_formula(cluster):
    """With --cluster --replicas 1, two nodes: b restores a 128 MiB file a wrote (a's parts, and
    those a still holds, from a over the peer channel, most sent from a's disk tier) while
    each node writes 32 MiB files replicated to the other; each daemon's peak RSS stays under
    memory_bound with every --cluster term (docs/architecture.md)."""
    ram, part, concurrency, connections = 32 * MiB, 4 * MiB, 4, 4
    flags = (
        "--cluster",
        "--replicas",
        "1",
        "--part-size",
        str(part),
        "--upload-concurrency",
        str(concurrency),
        "--peer-connections",
        str(connections),
    )
    a, b = (cluster.node(name, extra=flags, ram_cache=str(ram), cache_size="1GiB") for name in "ab")
    for node in (a, b):
        wait_until(lambda node=node: node.status()["peers"].get("holders"), 30, what=f"{node.name}'s holder")
    data = os.urandom(4 * ram)
    (a.path / "restore.bin").write_bytes(data)
    a.sync()
    reader = subprocess.Popen(["sha256sum", str(b.path / "restore.bin")], stdout=subprocess.PIPE, text=True)
    for round_ in range(4):  # (closes waiting for their replica while the restore goes on)
        for node in (a, b):
            (node.path / f"w{round_}.bin").write_bytes(os.urandom(8 * MiB))
    out, _ = reader.communicate(timeout=300)
    assert out.split()[0] == hashlib.sha256(data).hexdigest()
    # what the terms are for happened: b took the restore from a, each held the other's replicas
    peers = {node.name: node.status()["peers"] for node in (a, b)}
    assert peers["b"]["taken_bytes"] >= len(data) // 4 and peers["a"]["served_bytes"] > 0, peers
    for name in "ab":
        assert peers[name]["replicated_bytes"] > 0 and peers[name]["replica_received_bytes"] > 0, peers
    config = MountConfig(
        mountpoint="",
        store_url="",
        cache_dir="",
        ram_cache=ram,
        part_size=part,
        upload_concurrency=concurrency,
        cluster=True,
        replicas=1,
        peer_connections=connections,
    )
    bound = limits.memory_bound(config)
    for node in (a, b):
        peak = vm(node.pid, "VmHWM")
        print(f"{node.name}: peak RSS {peak / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB")
        assert peak <= bound, (node.name, peak, bound)
