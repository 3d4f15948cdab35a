"""Shared node, hostile neighbour: what the root daemon creates and who may reach it.

Real mounts as root; the neighbour is the unprivileged ``other_user``. Each test that touches a
tmpfs uses its own --shm-dir (a sticky, world-writable directory like /dev/shm): /dev/shm itself is
shared with every other test running on the node.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.cli import main, mount
from ckptfs.config import control_socket_path
from tests.support.faultproxy import FaultProxy, Rule, status
from tests.support.harness import can_open, wait_until
from tests.support.mounting import Mount, ckptfs, is_mounted

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def shm_dir(tmp_path: Path) -> Path:
    """A private stand-in for /dev/shm: world-writable and sticky, as /dev/shm is."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    return shm


def modes(root: Path) -> dict[str, tuple[int, int, int]]:
    """(type bits, permission bits, owner uid) of ``root`` and everything under it, by relative path."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid)
    return out


def test_planted_shm_dir_and_symlinks_are_never_followed(reachable, tmp_path, other_user):
    """The attack of issue 14: the neighbour pre-creates the RAM tier's old, guessable directory in
    the shm dir, full of symlinks to root's files, plus look-alike RAM tiers of its own and a link
    to a root directory. The daemon writes nothing through them, reads and logs none of them, and
    the arena holding the weights is out of the neighbour's reach."""
    root, make = reachable
    shm = shm_dir(root)
    vault = tmp_path / "vault"  # root's own files, out of the neighbour's reach
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("TOP-SECRET-LINE\n")
    secret.chmod(0o600)
    precious = vault / "precious"
    precious.write_bytes(b"root's data")
    root_ram_like = vault / "old-ram"  # shaped like a RAM tier of a cache dir that is gone
    root_ram_like.mkdir(mode=0o700)
    (root_ram_like / "owner").write_text(str(tmp_path / "no-such-cache"))
    drop = root / "drop"  # where the neighbour wants root to create a file
    drop.mkdir()
    drop.chmod(0o777)

    m = make("--shm-dir", str(shm))
    guessable = shm / ("ckptfs-" + hashlib.sha256(str(m.cache_dir.resolve()).encode()).hexdigest()[:16])
    plant = other_user.python(
        "import os, sys\n"
        "shm, guessable, secret, precious, drop, root_dir = sys.argv[1:]\n"
        "os.mkdir(guessable, 0o777); os.chmod(guessable, 0o777)\n"
        "os.symlink(secret, guessable + '/owner')\n"
        "os.symlink(precious, guessable + '/ram.arena')\n"
        "os.symlink(drop + '/made-by-root', guessable + '/ram.arena.id')\n"
        "mine = shm + '/ckptfs-neighbour'\n"
        "os.mkdir(mine, 0o700)\n"
        "os.symlink(secret, mine + '/owner')\n"
        "os.symlink(root_dir, shm + '/ckptfs-link')\n",
        str(shm),
        str(guessable),
        str(secret),
        str(precious),
        str(drop),
        str(root_ram_like),
    )
    assert plant.returncode == 0, plant.stderr

    m.start()
    weights = os.urandom(3 * MiB)
    (m.path / "model.pt").write_bytes(weights)
    m.sync()
    ram = m.ram_dir()
    assert ram is not None and ram.parent == shm and ram != guessable
    assert can_open(other_user, ram / "ram.arena") == "EACCES"
    listing = other_user.python("import os, sys; print(os.listdir(sys.argv[1]))", str(ram))
    assert listing.returncode != 0 and "PermissionError" in listing.stderr
    m.stop()

    assert precious.read_bytes() == b"root's data"
    assert secret.read_text() == "TOP-SECRET-LINE\n"
    assert os.listdir(drop) == []
    assert (root_ram_like / "owner").exists(), "a link in the shm dir was followed by the sweep"
    assert os.path.islink(guessable / "owner") and os.path.islink(shm / "ckptfs-link")  # not ours: untouched
    assert "TOP-SECRET" not in (m.cache_dir / "ckptfs.log").read_text(errors="replace")


def test_cache_dir_or_shm_dir_another_user_controls_is_refused(store, tmp_path, other_user):
    """A cache dir that is a link, owned by someone else or writable by others, and an shm dir
    others could swap things in: one line, no mount, nothing written there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, other_user.uid, other_user.gid)
    loose_shm = tmp_path / "loose-shm"  # world-writable without the sticky bit
    loose_shm.mkdir()
    loose_shm.chmod(0o777)
    (tmp_path / "link").symlink_to(elsewhere)
    cases = [
        (["--cache-dir", str(tmp_path / "link")], "symbolic link"),
        (["--cache-dir", str(theirs)], "owned by uid"),
        (["--cache-dir", str(tmp_path / "loose")], "writable by other users"),
        (["--shm-dir", str(loose_shm)], "other users could replace"),
    ]
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose").chmod(0o777)
    for i, (extra, message) in enumerate(cases):
        m = Mount(store.url, tmp_path / f"m{i}", endpoint_url=store.endpoint)
        args = m.args()
        if "--cache-dir" in extra:
            args[args.index("--cache-dir") : args.index("--cache-dir") + 2] = []
        try:
            done = ckptfs("mount", *args, *extra, check=False, timeout=120)
            assert done.returncode != 0, f"mounted with {extra}"
            line = done.stderr.strip()
            assert line.startswith("ckptfs: ") and "\n" not in line and message in line, done.stderr
        finally:
            m.cleanup()
    # (the CLI opens its log file there before the daemon starts: that is the logging work's)
    assert not {"journal", "lock", "disk.arena", "ram.dir"} & set(os.listdir(elsewhere))


def test_everything_the_daemon_creates_is_private(store, mount_factory, tmp_path):
    """Cache dir tree (while mounted, and after a clean umount: the clean index), RAM tier tree,
    control socket and its directory: owned by the mounting user (root), directories 0700, files
    0600; the RAM tier's name is not derived from anything
    another user knows. With --cluster: the peer key and certificate too."""
    shm = shm_dir(tmp_path)
    m = mount_factory(extra=("--shm-dir", str(shm), "--cluster")).start()
    (m.path / "f.bin").write_bytes(os.urandom(9 * MiB))
    m.sync()
    ram = m.ram_dir()
    guessable = "ckptfs-" + hashlib.sha256(str(m.cache_dir.resolve()).encode()).hexdigest()[:16]
    assert ram.parent == shm and ram.name.startswith("ckptfs-") and ram.name != guessable
    sock = control_socket_path(m.path)
    found = {"cache": modes(m.cache_dir), "ram": modes(ram), "sockdir": modes(sock.parent)}
    m.stop()
    found["after umount"] = modes(m.cache_dir)  # what a clean umount writes: the clean index

    for tree in ("cache", "after umount"):
        found[tree].pop("ckptfs.log")  # the CLI's log file: covered with the logging work
    assert {"journal", "disk.arena", "lock", "ram.dir", "peer.key", "peer.crt"} <= set(found["cache"])
    assert "clean.index" in found["after umount"]
    assert {"owner", "ram.arena", "ram.arena.id"} <= set(found["ram"])
    for tree in found.values():
        for name, (kind, mode, uid) in tree.items():
            if kind == stat.S_IFDIR:
                assert (mode, uid) == (0o700, 0), (name, oct(mode), uid)
            elif kind == stat.S_IFSOCK:
                assert (mode, uid) == (0o600, 0), (name, oct(mode), uid)
            else:
                assert (kind, mode, uid) == (stat.S_IFREG, 0o600, 0), (name, oct(mode), uid)


def test_other_users_are_kept_out_unless_allow_other(reachable, other_user):
    m = reachable[1]()
    m.start()
    (m.path / "open.bin").write_bytes(b"for everyone")
    (m.path / "open.bin").chmod(0o644)
    assert can_open(other_user, m.path / "open.bin") == "EACCES"
    assert can_open(other_user, m.path) == "EACCES"
    m.stop()


def test_with_allow_other_the_modes_decide_across_remounts(reachable, other_user):
    """With --allow-other the kernel checks each file's mode (default_permissions). The store
    records each file's and directory's mode and owner (issue 17): a remount shows them as they
    were, whatever --umask says (it only sets the modes of objects that carry none)."""
    m = reachable[1]("--allow-other")
    m.start()
    os.close(os.open(m.path / "private.bin", os.O_WRONLY | os.O_CREAT, 0o600))
    (m.path / "private.bin").write_bytes(b"weights")
    (m.path / "private.bin").chmod(0o600)
    (m.path / "shared.bin").write_bytes(b"hello")
    (m.path / "shared.bin").chmod(0o644)
    (m.path / "dir").mkdir(mode=0o700)
    (m.path / "dir" / "inner.bin").write_bytes(b"x")
    (m.path / "dir" / "inner.bin").chmod(0o644)

    def check() -> None:
        assert can_open(other_user, m.path / "shared.bin") == "ok"
        assert can_open(other_user, m.path / "private.bin") == "EACCES"
        assert can_open(other_user, m.path / "dir" / "inner.bin") == "EACCES"  # its directory is 0700
        for name, mode in (
            ("private.bin", 0o600),
            ("shared.bin", 0o644),
            ("dir/inner.bin", 0o644),
            ("dir", 0o700),
        ):
            st = (m.path / name).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (mode, 0), name

    check()
    m.stop()
    m.start()  # the modes the store recorded
    check()
    assert stat.S_IMODE(m.path.stat().st_mode) == 0o755  # the root: as the mountpoint directory was
    m.stop()

    m.extra = ("--allow-other", "--umask", "0022")  # recorded modes win over --umask
    m.start()
    check()
    m.stop()


def test_clean_umount_removes_the_ram_tier_unless_kept(store, mount_factory, tmp_path):
    shm = shm_dir(tmp_path)
    m = mount_factory(extra=("--shm-dir", str(shm))).start()
    data = os.urandom(5 * MiB)
    (m.path / "a.bin").write_bytes(data)
    ram = m.ram_dir()
    assert (ram / "ram.arena").exists()
    m.stop()
    assert os.listdir(shm) == [] and m.ram_dir() is None

    m.extra = ("--shm-dir", str(shm), "--keep-ram-cache")
    m.start()
    assert (m.path / "a.bin").read_bytes() == data
    (m.path / "b.bin").write_bytes(data)
    ram = m.ram_dir()
    m.stop()
    assert os.listdir(shm) == [ram.name] and (ram / "ram.arena").exists()

    m.extra = ("--shm-dir", str(shm))
    m.start()  # finds the kept RAM tier and its cached blocks
    assert m.ram_dir() == ram
    assert (m.path / "b.bin").read_bytes() == data
    assert m.status()["fetched_bytes"] == 0
    m.sync()
    os.kill(m.pid, signal.SIGTERM)  # a clean stop too
    wait_until(
        lambda: not is_mounted(m.path) and not Path(f"/proc/{m.pid}").exists(),
        60,
        what="SIGTERM to stop the daemon",
    )
    m.pid = None
    assert os.listdir(shm) == []


def test_umount_no_wait_keeps_the_ram_tier_pending_uploads_need(s3_server, s3_bucket, tmp_path):
    """Uploads still pending at `umount --no-wait` have their bytes in the RAM arena: it stays, and
    the next mount finishes them from it."""
    shm = shm_dir(tmp_path)
    with FaultProxy(s3_server.endpoint) as proxy:
        m = Mount(
            f"s3://{s3_bucket}/run",
            tmp_path / "m",
            endpoint_url=proxy.url,
            extra=("--shm-dir", str(shm), "--no-passthrough-writes"),  # (the RAM arena holds them)
        )
        try:
            m.start()
            rule = proxy.add_rule(Rule(status(503), method="PUT"))  # uploads fail (retried)
            data = os.urandom(3 * MiB)
            (m.path / "pending.bin").write_bytes(data)
            assert m.status()["pending"]["files"] == 1
            ckptfs("umount", str(m.path), "--no-wait", timeout=120)
            m.pid = None
            ram = m.ram_dir()
            assert ram is not None and (ram / "ram.arena").exists()
            proxy.remove_rule(rule)
            m.start()
            assert m.ram_dir() == ram
            m.sync(timeout=120)
            assert (m.path / "pending.bin").read_bytes() == data
            body = s3_server.client().get_object(Bucket=s3_bucket, Key="run/pending.bin")["Body"].read()
            assert body == data
            m.stop()
            assert os.listdir(shm) == []
        finally:
            proxy.clear()
            m.cleanup()


def test_fstab_options_map_to_the_flags(tmp_path):
    """/etc/fstab: `allow_other`, `umask=0022`, `keep_ram_cache` reach `ckptfs mount` as flags."""
    fake = tmp_path / "bin" / "ckptfs"  # stands in for the installed command: prints what it got
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    helper = Path(__file__).resolve().parent.parent / "mount" / "mount.ckptfs"
    done = subprocess.run(
        [
            sys.executable,
            str(helper),
            "local",
            "/mnt/ckpt",
            "-o",
            "allow_other,umask=0022,keep_ram_cache,_netdev",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(fake.parent)},
    )
    assert done.returncode == 0, done.stderr
    args = done.stdout.split()
    assert args == ["mount", "/mnt/ckpt", "--allow-other", "--umask", "0022", "--keep-ram-cache"]
    config = mount.mount_config(main.build_parser().parse_args(args))
    assert (config.allow_other, config.umask, config.keep_ram_cache) == (True, 0o022, True)
