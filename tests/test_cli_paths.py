"""Bad paths and other users' mounts: one line on stderr, a non-zero exit, nothing mounted.

A cache dir, RAM dir or local store inside the mountpoint would make the daemon wait on its own
mount (`umount` hung); a non-root user who asks about root's mount must read "permission denied",
not "the daemon is gone", and must not try to unmount it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.config import MountConfig, ckptfs_mounts, mount_owner
from tests.support.harness import assert_one_line_error, run_cli
from tests.support.mounting import Mount


def assert_nothing_mounted(mountpoint: Path) -> None:
    if str(mountpoint) in ckptfs_mounts():
        _force_unmount(mountpoint)
        pytest.fail(f"{mountpoint} was mounted (unmounted it)")
    assert list(mountpoint.iterdir()) == [], "the failed mount left files in the mountpoint"


def _force_unmount(mountpoint: Path) -> None:
    """Stop the daemon this test started on ``mountpoint`` and detach the mount. Not `ckptfs umount`:
    with its cache dir inside the mount, that is the deadlock these tests are about."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and b"ckptfs" in argv and os.fsencode(mountpoint) in argv:
            os.kill(int(entry.name), signal.SIGKILL)
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "mnt").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "mnt").mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "mnt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "mnt")
    return {"T": tmp_path}


# (store, mountpoint, extra arguments, what the one line says); {T} is the test's directory.
BAD_PATHS = [
    ("file://{T}/store", "{T}/mnt", ["--cache-dir", "{T}/file"], "cache dir {T}/file is not a directory"),
    ("file://{T}/store", "{T}/mnt", ["--cache-dir", "{T}/file/sub"], "{T}/file is not a directory"),
    ("file://{T}/store", "{T}/mnt", ["--cache-dir", "{T}/mnt/cache"], "is inside the mountpoint {T}/mnt"),
    ("file://{T}/store", "{T}/mnt", ["--cache-dir", "{T}/mnt"], "cache dir {T}/mnt is the mountpoint"),
    ("file://{T}/store", "{T}/mnt", ["--cache-dir", "{T}/link/cache"], "is inside the mountpoint {T}/mnt"),
    (
        "file://{T}/store",
        "{T}/cache/mnt",
        ["--cache-dir", "{T}/cache"],
        "mountpoint {T}/cache/mnt is inside the cache dir",
    ),
    (
        "file://{T}/store",
        "{T}/mnt",
        ["--cache-dir", "{T}/c", "--shm-dir", "{T}/file"],
        "--shm-dir {T}/file is not a directory",
    ),
    (
        "file://{T}/store",
        "{T}/mnt",
        ["--cache-dir", "{T}/c", "--shm-dir", "{T}/none"],
        "--shm-dir {T}/none does not exist",
    ),
    (
        "file://{T}/store",
        "{T}/mnt",
        ["--cache-dir", "{T}/c", "--shm-dir", "{T}/mnt"],
        "--shm-dir {T}/mnt is the mountpoint",
    ),
    ("file://{T}/mnt", "{T}/mnt", ["--cache-dir", "{T}/c"], "local store {T}/mnt is the mountpoint"),
    (
        "file://{T}/mnt/store",
        "{T}/mnt",
        ["--cache-dir", "{T}/c"],
        "local store {T}/mnt/store is inside the mountpoint",
    ),
    (
        "file://{T}/store",
        "{T}/store/mnt",
        ["--cache-dir", "{T}/c"],
        "mountpoint {T}/store/mnt is inside the local store",
    ),
    (
        "file://{T}/c/store",
        "{T}/mnt",
        ["--cache-dir", "{T}/c"],
        "cache dir {T}/c and the local store {T}/c/store overlap",
    ),
]


@pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])
@pytest.mark.parametrize("store, mountpoint, extra, needle", BAD_PATHS)
def test_bad_paths(store, mountpoint, extra, needle, foreground, layout):
    fill = lambda s: s.replace("{T}", str(layout["T"]))  # noqa: E731
    argv = ["mount", fill(store), fill(mountpoint), *map(fill, extra)] + (
        ["--foreground"] if foreground else []
    )
    try:
        done = run_cli(*argv)
    finally:
        assert_nothing_mounted(Path(fill(mountpoint)))
    assert_one_line_error(done, 2, fill(needle))


def test_the_daemon_checks_too(layout):
    """Anything calling daemon.run (the detached daemon, a foreground mount) refuses the same paths
    before it mounts."""
    t = layout["T"]
    config = MountConfig(
        mountpoint=str(t / "mnt"), store_url=f"file://{t}/store", cache_dir=str(t / "mnt" / "cache")
    )
    code = (
        "import sys; from ckptfs.daemon import run; from ckptfs.config import MountConfig; "
        "run.run(MountConfig.from_json(sys.argv[1]))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, config.to_json()], capture_output=True, text=True, timeout=60
        )
    finally:
        assert_nothing_mounted(t / "mnt")
    assert (
        done.returncode != 0
        and "UsageError: the cache dir" in done.stderr
        and "is inside the mountpoint" in done.stderr
    )


@pytest.fixture
def read_only_dir(tmp_path: Path):
    ro = tmp_path / "ro"
    ro.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "ckptfs-test-ro", str(ro)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.strip()}")
    yield ro
    subprocess.run(["umount", str(ro)], check=False)


@pytest.mark.parametrize("cache", ["ro", "ro/cache"])
def test_cache_dir_on_a_read_only_filesystem(cache, read_only_dir, tmp_path):
    (tmp_path / "mnt").mkdir()
    done = run_cli(
        "mount", f"file://{tmp_path}/store", str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / cache)
    )
    assert_one_line_error(done, 2, str(tmp_path / cache), "read-only filesystem")
    assert_nothing_mounted(tmp_path / "mnt")


def test_cache_dir_not_creatable_by_a_user(other_user, tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "private").mkdir(mode=0o700)  # root's
    other_user.reach(tmp_path / "mnt")
    done = other_user.ckptfs(
        "mount",
        f"file://{tmp_path}/store",
        str(tmp_path / "mnt"),
        "--cache-dir",
        str(tmp_path / "private" / "cache"),
    )
    assert_one_line_error(
        done, 2, f"{tmp_path}/private/cache cannot be created in {tmp_path}/private (permission denied)"
    )
    assert_nothing_mounted(tmp_path / "mnt")


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["sync", "{T}", "--timeout", "1e308"], 2, "'1e308' seconds is more than a year"),
        (["warmup", "{T}", "--timeout", "inf"], 2, "'inf' seconds is more than a year"),
        (["mount", "{T}/mnt", "--list-ttl", "1e400"], 2, "more than a year"),
        (["mount", "file:///tmp/a%00b", "{T}/mnt"], 2, "bad store URL"),
        (["mount", ""], 2, "MOUNTPOINT is empty"),
        (["mount", "{T}/mnt", "--cache-dir", ""], 2, "--cache-dir is empty"),
        (["mount", "{T}/mnt", "--shm-dir", " "], 2, "--shm-dir is empty"),
        (
            ["mount", "file://{T}/store", "{T}/mnt", "--cache-dir", "/proc/ckptfs-test"],
            2,
            "filesystem of /proc",
        ),
        (
            ["mount", "file://{T}/store", "{T}/mnt", "--cache-dir", "{T}/" + "a" * 300],
            1,
            "File name too long",
        ),
    ],
)
def test_odd_input(args, code, needle, tmp_path):
    (tmp_path / "mnt").mkdir()
    fill = lambda s: s.replace("{T}", str(tmp_path))  # noqa: E731
    assert_one_line_error(run_cli(*map(fill, args)), code, fill(needle))
    assert_nothing_mounted(tmp_path / "mnt")


# --- another user's mount ------------------------------------------------------------------------


@pytest.fixture
def roots_mount(tmp_path):
    m = Mount(f"file://{tmp_path}/store", tmp_path / "m", ram_cache="64MiB", cache_size="256MiB")
    try:
        m.start()
        (m.path / "weights.pt").write_bytes(b"w" * 4096)
        yield m
    finally:
        m.cleanup()


def test_another_users_mount_is_permission_denied(other_user, roots_mount):
    mnt = roots_mount.path
    other_user.reach(mnt)
    assert mount_owner(str(mnt)) == 0 and mount_owner(str(mnt.parent)) is None
    for args in (
        ["status", str(mnt)],
        ["sync", str(mnt)],
        ["warmup", str(mnt / "weights.pt")],
        ["umount", str(mnt)],
        ["umount", str(mnt), "--no-wait"],
        ["mount", str(mnt)],
    ):
        done = other_user.ckptfs(*args)
        needle = (
            "is already a ckptfs mount" if args[0] == "mount" else "permission denied: the ckptfs mount at"
        )
        assert_one_line_error(done, 2 if args[0] == "mount" else 1, needle)
        assert "gone" not in done.stderr and "fusermount" not in done.stderr
    # Still up and served by the same daemon.
    assert str(mnt) in ckptfs_mounts()
    assert roots_mount.status()["pid"] == roots_mount.pid
    assert (mnt / "weights.pt").read_bytes() == b"w" * 4096
    roots_mount.sync()


def test_paths_with_spaces_and_newlines(tmp_path):
    m = Mount(f"file://{tmp_path}/st ore", tmp_path / "a b\nc", ram_cache="64MiB", cache_size="256MiB")
    try:
        m.start()
        (m.path / "x").write_bytes(b"x")
        m.sync()
        assert mount_owner(str(m.path)) == os.geteuid()
        assert m.status()["mountpoint"] == str(m.path)
        m.stop()
        assert str(m.path) not in ckptfs_mounts()
        assert (tmp_path / "st ore" / "x").read_bytes() == b"x"
    finally:
        m.cleanup()
        if str(m.path) in ckptfs_mounts():  # (Mount.cleanup does not find a name with a newline)
            subprocess.run(["umount", "-l", str(m.path)], check=False)


@pytest.mark.parametrize(
    "mountpoint, needle",
    [
        ("d", "cannot read mountpoint {mnt}: Permission denied"),  # d (0711): it can reach d, not list it
        ("d/mnt", "cannot reach mountpoint {mnt}: Permission denied"),  # not "does not exist"
    ],
)
def test_a_mountpoint_the_user_cannot_read(mountpoint, needle, other_user, tmp_path):
    other_user.reach(tmp_path)
    (tmp_path / "d" / "mnt").mkdir(parents=True)
    (tmp_path / "d").chmod(0o711 if mountpoint == "d" else 0o700)
    mnt = tmp_path / mountpoint
    done = other_user.ckptfs(
        "mount", f"file://{tmp_path}/store", str(mnt), "--cache-dir", "/tmp/ckptfs-test-never-made"
    )
    assert_one_line_error(done, 2, needle.format(mnt=mnt))
    assert str(mnt) not in ckptfs_mounts()
    assert not Path("/tmp/ckptfs-test-never-made").exists()


def test_root_does_not_unmount_another_users_mount_it_cannot_reach(roots_mount, monkeypatch, capsys):
    """Root finds a user's daemon by that user's socket; where it finds none it says so rather than
    taking the mount for a stale one and unmounting it (the user may have set XDG_RUNTIME_DIR).
    (No user here may mount FUSE: root's mount stands in, with its owner read as another uid.)"""
    from ckptfs.cli import main as cli_main
    from ckptfs.control import client

    monkeypatch.setattr(client, "mount_owner", lambda mountpoint: 2**31 - 7)  # a uid with no runtime dir
    for args in (["status"], ["umount"]):
        assert cli_main.main([*args, str(roots_mount.path)]) == 1
        err = capsys.readouterr().err
        assert (
            err.startswith("ckptfs: cannot find the control socket of the ckptfs mount at")
            and err.count("\n") == 1
        ), err
    monkeypatch.undo()
    assert str(roots_mount.path) in ckptfs_mounts()
    assert roots_mount.status()["pid"] == roots_mount.pid
