"""FUSE mounts the bench makes, and how it takes each one down again, whatever happened.

`ForegroundMount` runs a FUSE daemon as a child that stays in the foreground (s3fs -f, rclone
mount, bench.nullfs), in its own session so a Ctrl-C reaches only the bench, which then unmounts
in order. `CkptfsMount` uses the ckptfs CLI (the daemon detaches; its PID comes from `ckptfs
status --json`). Both stop only the process they started, by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MOUNT_TIMEOUT = 60.0


def _mount_table() -> list[tuple[Path, str]]:
    """(mountpoint, type) of every mount, from /proc/mounts (which escapes spaces as octal)."""
    with open("/proc/mounts") as f:
        rows = [line.split() for line in f]
    return [(Path(r[1].encode().decode("unicode_escape")), r[2]) for r in rows if len(r) > 2]


def _mounted(path: Path) -> bool:
    """From the mount table, not stat: a hung FUSE daemon would hang a stat, and a dead one
    makes os.path.ismount say False while its mount is still there."""
    return Path(path).absolute() in {mp for mp, _ in _mount_table()}


def _fusermount(path: Path, lazy: bool = False) -> bool:
    argv = ["fusermount3", "-u", *(["-z"] if lazy else []), str(path)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-lines:])
    return "    (no log)"


def unmount(path: Path, attempts: int = 20) -> None:
    """Unmount `path`, retrying while it is busy, lazily as a last resort."""
    for _ in range(attempts):
        if not _mounted(path) or _fusermount(path):
            return
        time.sleep(0.25)
    _fusermount(path, lazy=True)


def fuse_mounts_under(root: Path) -> list[Path]:
    """FUSE mountpoints below `root`, deepest first (/proc/mounts escapes spaces as octal)."""
    found = [mp for mp, kind in _mount_table() if kind.split(".")[0] == "fuse" and mp.is_relative_to(root)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


class ForegroundMount:
    """A FUSE daemon in the foreground, as our child: we know its PID and own its log."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        mountpoint: Path,
        log: Path,
        env: dict | None = None,
        stop_signal: int | None = None,
    ):
        """`stop_signal`: how the daemon wants to be stopped (it unmounts itself); None: fusermount3 -u."""
        self.name, self.argv, self.mountpoint, self.log, self.env = name, argv, mountpoint, log, env
        self.stop_signal = stop_signal
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> ForegroundMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not _mounted(self.mountpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before mounting:\n"
                    + _tail(self.log)
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not mount {self.mountpoint} in {MOUNT_TIMEOUT:.0f} s:\n"
                    + _tail(self.log)
                )
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.stop_signal is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        unmount(self.mountpoint)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class CkptfsMount:
    """`ckptfs mount STORE MNT` with its own cache dir; `stop` drains and unmounts it. `extra`: more
    mount arguments; `prefix`: what `ckptfs mount` (and so its daemon) runs under, e.g. nsenter."""

    def __init__(
        self,
        store_url: str,
        mountpoint: Path,
        cache_dir: Path,
        ram_cache: int,
        cache_size: int,
        endpoint: str | None = None,
        extra: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ):
        self.store_url, self.mountpoint, self.cache_dir = store_url, mountpoint, cache_dir
        self.ram_cache, self.cache_size, self.endpoint = ram_cache, cache_size, endpoint
        self.extra, self.prefix = tuple(extra), tuple(prefix)
        self.pid: int | None = None

    def _ckptfs(self, *args: str, timeout: float = 120, prefix: tuple[str, ...] = ()) -> str:
        r = subprocess.run(
            [*prefix, sys.executable, "-m", "ckptfs", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if r.returncode:
            raise RuntimeError(f"ckptfs {args[0]} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def start(self) -> CkptfsMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        args = [
            self.store_url,
            str(self.mountpoint),
            "--cache-dir",
            str(self.cache_dir),
            "--ram-cache",
            str(self.ram_cache),
            "--cache-size",
            str(self.cache_size),
        ]
        if self.endpoint:
            args += ["--endpoint-url", self.endpoint]
        try:
            self._ckptfs("mount", *args, *self.extra, prefix=self.prefix)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{_tail(self.cache_dir / 'ckptfs.log')}") from None
        self.pid = self.status()["pid"]
        return self

    def status(self) -> dict:
        return json.loads(self._ckptfs("status", str(self.mountpoint), "--json"))

    def stop(self) -> None:
        if self.pid is None:
            return
        from ckptfs.daemon.run import recorded_ram_dir

        try:
            self._ckptfs("umount", str(self.mountpoint), timeout=300)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"  ({e}; stopping daemon {self.pid} and unmounting lazily)", file=sys.stderr, flush=True)
            self._kill_daemon()  # (first: a hung daemon would hang the unmount)
            unmount(self.mountpoint, attempts=1)
        self.pid = None
        if (ram := recorded_ram_dir(self.cache_dir)) is not None:  # left by --no-wait or a kill
            shutil.rmtree(ram, ignore_errors=True)

    def _kill_daemon(self) -> None:
        """SIGKILL our daemon, checking by its command line that the PID is still ours."""
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes()
            if str(self.mountpoint).encode() in cmdline:
                os.kill(self.pid, signal.SIGKILL)
