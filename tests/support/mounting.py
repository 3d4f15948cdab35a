"""Real ckptfs mounts for end-to-end tests, driven through the real CLI in subprocesses, and
s3fs-fuse mounted on the same bucket (``S3fsMount``: the peer tool whose object metadata ckptfs shares)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptfs.control import client
from ckptfs.daemon.run import recorded_ram_dir
from tests.support.harness import proc_state

CKPTFS = [sys.executable, "-m", "ckptfs"]


def ckptfs(
    *args: str, check: bool = True, timeout: float = 300, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``prefix``: a command that runs it (``prlimit --nofile=...``: the daemon inherits its limits)."""
    done = subprocess.run([*prefix, *CKPTFS, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def is_mounted(path: Path) -> bool:
    target = str(path).replace(" ", "\\040")
    with open("/proc/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


class Mount:
    """One ckptfs mount: a mountpoint, a cache dir and a store; start/stop/kill it any number of times."""

    def __init__(
        self,
        store_url: str,
        root: Path,
        endpoint_url: str | None = None,
        ram_cache: str = "256MiB",
        cache_size: str = "2GiB",
        extra: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ):
        self.store_url = store_url
        self.prefix = prefix  # what `ckptfs mount` runs under (see ``ckptfs``)
        self.path = root / "mnt"
        self.cache_dir = root / "cache"
        self.endpoint_url = endpoint_url
        self.ram_cache = ram_cache
        self.cache_size = cache_size
        self.extra = extra
        self.pid: int | None = None
        self.path.mkdir(parents=True, exist_ok=True)

    def args(self) -> list[str]:
        args = [
            self.store_url,
            str(self.path),
            "--cache-dir",
            str(self.cache_dir),
            "--ram-cache",
            self.ram_cache,
            "--cache-size",
            self.cache_size,
            *self.extra,
        ]
        if self.endpoint_url:
            args += ["--endpoint-url", self.endpoint_url]
        return args

    def start(self) -> Mount:
        ckptfs("mount", *self.args(), timeout=120, prefix=self.prefix)
        self.pid = self.status()["pid"]
        return self

    def status(self) -> dict:
        """What `ckptfs status --json` prints (the daemon's status command), asked over the control
        socket from this process: an interpreter start per call cost 1-1.5 s on the loaded 2-core
        VM, and tests poll it. The CLI's own path keeps tests of its own (test_status_metrics,
        test_packaging, test_security_logs)."""
        return json.loads(json.dumps(client.call(self.path, "status", timeout=30)))

    def fetched_bytes(self) -> int:
        """Bytes this daemon fetched from the store so far (its status)."""
        return self.status()["fetched_bytes"]

    def sync(self, *paths: str, timeout: float = 300) -> None:
        ckptfs("sync", str(self.path), *paths, timeout=timeout)

    def stop(self) -> None:
        ckptfs("umount", str(self.path), timeout=300)
        self.pid = None

    def kill(self) -> None:
        """SIGKILL the daemon, as an OOM kill would; its dead mount stays until the next mount."""
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.pid = None

    def cleanup(self) -> None:
        """Whatever state the test left: stop our daemon and leave nothing mounted."""
        if self.pid is not None and is_mounted(self.path):
            try:
                self.stop()
            except Exception:  # noqa: BLE001 - fall through to the hard way
                pass
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if is_mounted(self.path):
            subprocess.run(["umount", "-l", str(self.path)], check=False)
        self.drop_ram_tier()

    def ram_dir(self) -> Path | None:
        """The RAM tier directory (tmpfs) this mount's cache dir recorded, if any."""
        return recorded_ram_dir(self.cache_dir) if self.cache_dir.is_dir() else None

    def drop_ram_tier(self) -> None:
        """Remove the RAM tier's tmpfs arena, as a reboot does (it would outlive the test otherwise)."""
        ram = self.ram_dir()
        if ram is not None:
            shutil.rmtree(ram, ignore_errors=True)


def kill_daemon(m: Mount) -> None:
    """SIGKILL the daemon and wait until it is dead and its mount answers ENOTCONN.

    Dead = gone or a zombie (the daemon is reparented to init, which may take a while to reap
    it; Mount.kill waits for the reaping). The wait for ENOTCONN makes the death visible to what
    the caller does next: for up to the kernel's attribute timeout (1 s) after it, stat() of the
    mountpoint still succeeds from the attribute cache. `ckptfs mount` no longer needs the wait
    (it asks the daemon, not stat(): test_crash_torture.py's
    test_mount_right_after_sigkill_clears_the_stale_mount)."""
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_state(pid) not in (None, "Z"):
        assert time.monotonic() < deadline, f"daemon {pid} did not die"
        time.sleep(0.005)
    m.pid = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.stat(m.path)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                return
            if exc.errno != errno.ECONNABORTED:  # ECONNABORTED: the connection is being torn down
                raise
        time.sleep(0.02)
    raise AssertionError(f"{m.path} still answers stat 10 s after its daemon died")


def fresh_cache(m: Mount) -> Mount:
    """``m`` stopped and started again with an empty cache dir: everything comes from the store."""
    m.stop()
    m.drop_ram_tier()
    shutil.rmtree(m.cache_dir)
    return m.start()


class S3fsMount:
    """s3fs-fuse in the foreground on ``bucket:/prefix`` of the test S3 server, as the bench runs it
    (Debian's s3fs; tests skip without the binary). ``options``: more ``-o`` options. ``stop``
    unmounts it and waits for the process: s3fs has uploaded everything by then."""

    def __init__(self, server, bucket: str, prefix: str, root: Path, options: tuple[str, ...] = ()):
        self.path = root / "s3fs-mnt"
        self.path.mkdir(parents=True)
        passwd = root / "s3fs.passwd"
        passwd.write_text(f"{bucket}:{server.access_key}:{server.secret_key}\n")
        passwd.chmod(0o600)
        options = [
            f"url={server.endpoint}",
            "use_path_request_style",
            f"endpoint={server.region}",
            f"passwd_file={passwd}",
            "stat_cache_expire=1",
            *options,
        ]
        self.log = root / "s3fs.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["s3fs", f"{bucket}:/{prefix}", str(self.path), "-f", "-o", ",".join(options)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"s3fs did not mount: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", str(self.path)], check=False)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
