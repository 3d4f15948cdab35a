"""mount/: the mount(8) helper and the systemd unit, run the way mount(8) and systemd run them,
on the real S3 server (behind the fault proxy, so uploads can be held back).

- The helper is called as mount(8) calls it (``mount.ckptfs SOURCE MOUNTPOINT -o OPTIONS``),
  then through mount(8) itself: ``mount -t ckptfs``, and an fstab line in a scratch fstab
  (``mount -T FSTAB MOUNTPOINT``, ``mount -a -T FSTAB``). mount(8) only looks for helpers in
  /sbin, so those tests link /sbin/mount.ckptfs to the helper for their duration (only where no
  such file exists; skipped otherwise) and remove it after. mount(8) runs helpers without PATH:
  the test names the ckptfs command with CKPTFS_COMMAND (a wrapper running this checkout).
- systemd does not run in the test container (no /run/systemd/system), so the unit is run as
  systemd would: the unit file parsed, %i/%f substituted for an instance, its EnvironmentFile
  read (from a scratch directory instead of /etc/ckptfs), ExecStartPre run, ExecStart started as
  the main process (Type=simple), ExecStop run to stop it. Checked: it starts, stop drains what
  is pending, and after a crash (SIGKILL, which Restart=on-failure restarts) the next start with
  the same cache dir makes what was pending durable.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ckptfs.cli import main as cli_main
from ckptfs.cli.control import UMOUNT_TIMEOUT_S, UNMOUNT_WAIT_S
from tests.support.faultproxy import Rule, blackhole, delay
from tests.support.mounting import ckptfs, is_mounted

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "mount" / "mount.ckptfs"
UNIT = REPO / "mount" / "ckptfs@.service"
SBIN_HELPER = Path("/sbin/mount.ckptfs")
PREFIX = "run"
MiB = 1 << 20


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    """A directory holding a ``ckptfs`` command that runs this checkout (the virtualenv's own
    console script may run another copy of ckptfs)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    wrapper = directory / "ckptfs"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m ckptfs "$@"\n'
    )
    wrapper.chmod(0o755)
    return directory


@pytest.fixture
def place(s3_bucket, proxy, tmp_path):
    """Where to mount, the fstab-style options for it, and cleanup of whatever got mounted."""
    shm = Path("/dev/shm") / f"ckptfs-packaging-tests-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    class Place:
        source = f"s3://{s3_bucket}/{PREFIX}"
        mountpoint = mnt
        cache_dir = tmp_path / "cache"
        options = (
            f"_netdev,nofail,cache_dir={tmp_path / 'cache'},ram_cache=64MiB,cache_size=512MiB,"
            f"endpoint_url={proxy.url},shm_dir={shm}"
        )

    yield Place
    proxy.clear()
    if is_mounted(mnt):
        if ckptfs("umount", str(mnt), check=False, timeout=120).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    shutil.rmtree(shm, ignore_errors=True)


def helper_env(bin_dir: Path) -> dict[str, str]:
    return {**os.environ, "CKPTFS_COMMAND": str(bin_dir / "ckptfs")}


def check_mounted(place, bucket_read) -> None:
    """Mounted as ckptfs with the options given: a file written there reaches the store."""
    assert is_mounted(place.mountpoint)
    with open("/proc/mounts") as mounts:
        fstype = [line.split()[2] for line in mounts if line.split()[1] == str(place.mountpoint)]
    assert fstype == ["fuse.ckptfs"], fstype
    st = ckptfs("status", str(place.mountpoint), "--json").stdout
    assert f'"cache_dir": "{place.cache_dir}"' in st and '"budget": 67108864' in st, st
    data = os.urandom(MiB + 7)
    name = f"f-{uuid.uuid4().hex[:6]}.bin"
    (place.mountpoint / name).write_bytes(data)
    ckptfs("sync", str(place.mountpoint), timeout=120)
    assert bucket_read(name) == data


def test_the_helper_called_as_mount8_calls_it(place, bin_dir, bucket_read):
    done = subprocess.run(
        [str(HELPER), place.source, str(place.mountpoint), "-o", "rw," + place.options],
        env=helper_env(bin_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    check_mounted(place, bucket_read)
    ckptfs("umount", str(place.mountpoint), timeout=120)
    assert not is_mounted(place.mountpoint)

    # Bad options: ckptfs's own one-line errors, passed through.
    done = subprocess.run(
        [str(HELPER), place.source, str(place.mountpoint), "-o", "ram_cache=lots"],
        env=helper_env(bin_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "'lots' is not a size" in done.stderr and "Traceback" not in done.stderr
    # No ckptfs command to be found (mount(8) gives helpers no PATH): one line, not a traceback.
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "CKPTFS_COMMAND")}
    done = subprocess.run(
        [sys.executable, str(HELPER), place.source, str(place.mountpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if shutil.which("ckptfs", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") is None:
        assert done.returncode == 1 and done.stderr.startswith("mount.ckptfs: no ckptfs command in"), (
            done.stderr
        )
        assert len(done.stderr.splitlines()) == 1
    done = subprocess.run(
        [sys.executable, str(HELPER), place.source, str(place.mountpoint)],
        env={**env, "CKPTFS_COMMAND": "/nonexistent/ckptfs"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        done.returncode == 1
        and done.stderr == "mount.ckptfs: cannot run /nonexistent/ckptfs: No such file or directory\n"
    )


@pytest.fixture
def sbin_helper():
    """/sbin/mount.ckptfs linked to this checkout's helper for the test, removed after."""
    if os.geteuid() != 0:
        pytest.skip("installing /sbin/mount.ckptfs needs root")
    if os.path.lexists(SBIN_HELPER):
        pytest.skip(f"{SBIN_HELPER} exists already: not replacing it (the helper is tested directly)")
    SBIN_HELPER.symlink_to(HELPER)
    try:
        yield SBIN_HELPER
    finally:
        if SBIN_HELPER.is_symlink() and os.readlink(SBIN_HELPER) == str(HELPER):
            SBIN_HELPER.unlink()


def test_mount_t_ckptfs_and_an_fstab_line(place, sbin_helper, bin_dir, bucket_read, tmp_path):
    env = helper_env(bin_dir)
    done = subprocess.run(
        ["mount", "-t", "ckptfs", place.source, str(place.mountpoint), "-o", place.options],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    check_mounted(place, bucket_read)
    ckptfs("umount", str(place.mountpoint), timeout=120)

    # The fstab line, with this test's bucket, paths and sizes.
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# scratch fstab\n{place.source} {place.mountpoint} ckptfs {place.options} 0 0\n")
    done = subprocess.run(
        ["mount", "-T", str(fstab), str(place.mountpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    check_mounted(place, bucket_read)
    ckptfs("umount", str(place.mountpoint), timeout=120)

    done = subprocess.run(
        ["mount", "-a", "-T", str(fstab)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    check_mounted(place, bucket_read)
    # Mounted already: mount -a leaves it alone (the mount table's source is the store URL).
    done = subprocess.run(
        ["mount", "-a", "-T", str(fstab)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    ckptfs("umount", str(place.mountpoint), timeout=120)
    assert not is_mounted(place.mountpoint)


# --- the systemd unit, run as systemd would ---------------------------------------------------


def systemd_escape_path(path: Path) -> str:
    """systemd-escape --path."""
    out = []
    for i, ch in enumerate(str(path).strip("/")):
        if ch == "/":
            out.append("-")
        elif ch.isascii() and (ch.isalnum() or ch in ":_" or (ch == "." and i > 0)):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out)


def systemd_unescape_path(instance: str) -> str:
    return "/" + re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m[1], 16)), instance.replace("-", "/"))


class Unit:
    """One instance of a template unit, its commands expanded as systemd expands them."""

    def __init__(self, path: Path, mountpoint: Path, env_dir: Path, bin_dir: Path):
        self.bin_dir = bin_dir
        self.mains: list[subprocess.Popen] = []  # every ExecStart process, for stop_mains
        parser = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",))
        parser.optionxform = str
        parser.read(path)
        self.service = dict(parser["Service"])
        self.instance = systemd_escape_path(mountpoint)
        assert systemd_unescape_path(self.instance) == str(mountpoint)
        env_file = self.specifiers(self.service["EnvironmentFile"]).lstrip("-")
        assert env_file.startswith("/etc/ckptfs/"), env_file
        self.env_file = env_dir / Path(env_file).name  # (a scratch directory, not /etc/ckptfs)

    def specifiers(self, text: str) -> str:
        return re.sub(
            r"%[%if]",
            lambda m: {"%%": "%", "%i": self.instance, "%f": systemd_unescape_path(self.instance)}[m[0]],
            text,
        )

    def environment(self) -> dict[str, str]:
        env = {}
        for line in self.env_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", ";")):
                name, _, value = line.partition("=")
                env[name.strip()] = value.strip().strip('"')
        return env

    def command(self, key: str) -> tuple[list[str], bool]:
        """The argv of Exec<key>, and whether its failure is ignored (a leading '-')."""
        line = self.service[key]
        ignore = line.startswith("-")
        env = self.environment()
        argv = []
        for word in shlex.split(self.specifiers(line.lstrip("-"))):
            whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
            if whole:  # $VAR: split into words at whitespace
                argv += env.get(whole[1], "").split()
            else:  # ${VAR}: one word
                argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
        return argv, ignore

    def process_env(self) -> dict[str, str]:
        # systemd's PATH holds /usr/local/bin, /usr/bin...: there, the wrapper running this checkout.
        return {**os.environ, **self.environment(), "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '')}"}

    def run(self, key: str) -> subprocess.CompletedProcess:
        argv, ignore = self.command(key)
        done = subprocess.run(argv, env=self.process_env(), capture_output=True, text=True, timeout=600)
        assert ignore or done.returncode == 0, f"{key} {argv} failed: {done.stderr}"
        return done

    def stop_mains(self) -> None:
        """SIGTERM (then SIGKILL) every ExecStart process still running: a failed test leaves none."""
        for main in self.mains:
            if main.poll() is None:
                os.killpg(main.pid, signal.SIGTERM)
                try:
                    main.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(main.pid, signal.SIGKILL)
                    main.wait(timeout=30)

    def start(self, mountpoint: Path) -> subprocess.Popen:
        """ExecStartPre, then ExecStart as the main process (Type=simple); returns once mounted."""
        self.run("ExecStartPre")
        argv, _ = self.command("ExecStart")
        self.journal = self.env_file.with_suffix(".journal")  # what systemd's journal would get
        with open(self.journal, "ab") as journal:
            main = subprocess.Popen(
                argv, env=self.process_env(), stdout=journal, stderr=journal, start_new_session=True
            )
        self.mains.append(main)
        deadline = time.monotonic() + 120
        while not (is_mounted(mountpoint) and ckptfs("status", str(mountpoint), check=False).returncode == 0):
            assert main.poll() is None, (
                f"ExecStart exited {main.returncode}: {self.journal.read_text()[-2000:]}"
            )
            assert time.monotonic() < deadline, "the unit did not mount in 120 s"
            time.sleep(0.2)
        return main


def systemd_seconds(span: str) -> float:
    """A systemd time span ("30min", "1h 30s", "90") in seconds (systemd.time(7))."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and all(unit in units for _, unit in parts), span
    return sum(float(n) * units[unit] for n, unit in parts)


def test_the_unit_drains_for_most_of_timeout_stop_sec(tmp_path):
    """ExecStop's drain gives up (umount --timeout, as the CLI parses it) late enough to use most
    of TimeoutStopSec (the default --timeout, 300 s, would end it long before) and early enough
    that umount's wait for the unmount still ends before systemd kills the unit."""
    unit = Unit(UNIT, Path("/mnt/ckpt"), tmp_path, tmp_path)
    unit.env_file.write_text("CKPTFS_STORE=s3://bucket/run42\nCKPTFS_OPTS=\n")
    argv, ignore = unit.command("ExecStop")
    assert not ignore
    assert argv[:3] == ["/usr/bin/env", "ckptfs", "umount"], argv
    args = cli_main.build_parser().parse_args(argv[2:])
    stop_sec = systemd_seconds(unit.service["TimeoutStopSec"])
    assert "--timeout" in argv and args.timeout != UMOUNT_TIMEOUT_S, argv
    assert stop_sec - 5 * 60 <= args.timeout <= stop_sec - UNMOUNT_WAIT_S, (args.timeout, stop_sec)


def test_the_systemd_unit_starts_drains_on_stop_and_resumes_after_a_crash(
    place, proxy, bin_dir, bucket_read, tmp_path, request
):
    unit = Unit(UNIT, place.mountpoint, tmp_path, bin_dir)
    request.addfinalizer(unit.stop_mains)  # (what systemd does to a unit's processes when stop fails)
    assert unit.service["Type"] == "simple" and unit.service["Restart"] == "on-failure"
    opts = (
        f"--endpoint-url {proxy.url} --cache-dir {place.cache_dir} --ram-cache 64MiB --cache-size 512MiB "
        f"--shm-dir {place.options.rsplit('shm_dir=', 1)[1]}"
    )
    unit.env_file.write_text(
        f"# /etc/ckptfs/{unit.instance}.env\nCKPTFS_STORE={place.source}\nCKPTFS_OPTS={opts}\n"
    )

    # Starts; stop drains: uploads held back by a slow store are in it when ExecStop returns.
    main = unit.start(place.mountpoint)
    slow = proxy.add_rule(Rule(delay(1.0), kind=("upload_part", "put")))
    files = {f"step-1/shard-{i}.pt": os.urandom(9 * MiB + i) for i in range(3)}
    (place.mountpoint / "step-1").mkdir()
    for name, data in files.items():
        (place.mountpoint / name).write_bytes(data)
    pending = json.loads(ckptfs("status", str(place.mountpoint), "--json").stdout)["pending"]["files"]
    assert pending >= 1
    stopped = unit.run("ExecStop")
    assert stopped.returncode == 0, stopped.stderr
    assert main.wait(timeout=60) == 0  # the main process ends by itself (no SIGTERM needed)
    assert not is_mounted(place.mountpoint) and slow.hits >= 1
    for name, data in files.items():
        assert bucket_read(name) == data
    proxy.clear()

    # A crash with uploads pending (the store is down); Restart=on-failure starts it again with
    # the same cache dir: what was committed becomes durable.
    main = unit.start(place.mountpoint)
    proxy.add_rule(Rule(blackhole()))
    data = os.urandom(12 * MiB)
    (place.mountpoint / "step-2").mkdir()
    (place.mountpoint / "step-2" / "model.pt").write_bytes(data)
    os.killpg(main.pid, signal.SIGKILL)
    assert main.wait(timeout=30) == -signal.SIGKILL  # a failure: on-failure restarts it
    proxy.clear()
    main = unit.start(place.mountpoint)  # (ExecStartPre on the dead mount's path too)
    try:
        ckptfs("sync", str(place.mountpoint), "--timeout", "120", timeout=180)
        assert bucket_read("step-2/model.pt") == data
        assert (place.mountpoint / "step-2" / "model.pt").read_bytes() == data
    finally:
        unit.run("ExecStop")
        main.wait(timeout=60)
        assert not is_mounted(place.mountpoint)
