"""What every ``ckptfs`` command shares: argument types, finding the mount a path is on, calling
its daemon, and showing sizes and progress. The commands live in their own modules (mount.py,
control.py, catalog.py, verify.py), which import this one; main.py is the parser over them."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import humanfriendly

from ckptfs.config import ckptfs_mounts
from ckptfs.control import client
from ckptfs.errors import UsageError

if TYPE_CHECKING:
    from tqdm import tqdm  # (imported when a bar is first drawn: it is slow to import)

PROGRESS_LINE_S = 10.0  # not on a terminal: a progress line this often
# The STORE_URL|MOUNTPOINT argument and --endpoint-url of the admin commands (ls, checkpoints, gc, verify)
TARGET_HELP = (
    "a store URL (s3://bucket[/prefix], file:///path), read directly, "
    "or a ckptfs mountpoint (or a path on one)"
)
ENDPOINT_HELP = "S3-compatible endpoint for an s3:// STORE_URL (as for mount)"


def parse_size_arg(text: str) -> int:
    try:
        return humanfriendly.parse_size(text, binary=True)
    except humanfriendly.InvalidSize:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 4GiB, 512M, 8MiB, 1048576)"
        ) from None


MAX_SECONDS = 366 * 24 * 3600  # a year: longer waits overflow socket timeouts ('inf' among them)


def parse_seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is more than a year (at most {MAX_SECONDS})")
    return value


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def mount_holding(path: str) -> tuple[str, str]:
    """The ckptfs mount holding ``path`` (the innermost one), and the path as seen from there."""
    mounts = ckptfs_mounts()
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        owners = [m for m in mounts if os.path.commonpath([m, candidate]) == m]
        if owners:
            return max(owners, key=len), candidate
    raise UsageError(f"{path} is not on a ckptfs mount")


def call_mount(
    mountpoint: str,
    cmd: str,
    args: dict | None = None,
    on_progress: Callable[[dict], None] | None = None,
    timeout: float | None = None,
) -> dict:
    """Ask the daemon of ``mountpoint``. NoDaemon: exit 1 for a mount whose daemon is gone, exit
    2 (bad input, as for a PATH outside the mount) for a path that is not a ckptfs mount."""
    try:
        return client.call(mountpoint, cmd, args, on_progress=on_progress, timeout=timeout)
    except client.NoDaemon as e:
        if mountpoint in ckptfs_mounts():
            raise client.NoDaemon(
                f"the ckptfs daemon of {mountpoint} is gone (stale mount): mount it again "
                f"to resume its uploads, or run 'ckptfs umount {mountpoint}'"
            ) from None
        raise not_a_mount(e) from None


def not_a_mount(e: client.NoDaemon) -> client.NoDaemon:
    """``e`` ("no ckptfs mount at PATH") as the bad input it is: exit 2, as UsageError."""
    return client.NoDaemon(str(e), exit_code=UsageError.exit_code)


def canonical_mountpoint(path: str) -> str:
    """The canonical mountpoint, without stat()ing the mount itself (a hung daemon would block us)."""
    path = os.path.abspath(path)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return path if path in ckptfs_mounts() else os.path.realpath(path)


def relative_paths(mountpoint: str, paths: list[str]) -> list[str]:
    """PATHs as the daemon wants them: relative to the mountpoint; [] means everything."""
    out = []
    for path in paths:
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.commonpath([mountpoint, candidate]) == mountpoint:
                break
        else:
            raise UsageError(f"{path} is not inside the ckptfs mount {mountpoint}")
        rel = os.path.relpath(candidate, mountpoint)
        if rel == ".":
            return []
        out.append(rel)
    return out


# --- output ---------------------------------------------------------------------


def format_bytes(n: object) -> str:
    return humanfriendly.format_size(n, binary=True) if isinstance(n, (int, float)) else "?"


class ProgressBar:
    """Progress from the daemon: uploads ({"pending_files", "pending_bytes", "total_bytes"}) or
    warmup ({"done_bytes", "total_bytes", "files", "files_done"}): a tqdm bar in bytes on a
    terminal, nothing otherwise (the caller prints ``summary``)."""

    def __init__(self, desc: str):
        self.desc = desc
        self.start = time.monotonic()
        self.last: dict | None = None
        self.bar: tqdm | None = None
        self.lined = self.start  # when the last progress line was printed (not on a terminal)

    def __call__(self, progress: dict) -> None:
        from tqdm import tqdm

        self.last = progress
        total = int(progress.get("total_bytes") or 0)
        if "done_bytes" in progress:
            done = int(progress["done_bytes"] or 0)
            postfix = f"{progress.get('files_done', '?')} of {progress.get('files', '?')} files"
        else:
            done = max(total - int(progress.get("pending_bytes") or 0), 0)
            files = progress.get("pending_files", "?")
            postfix = f"{files} file{'' if files == 1 else 's'} left"
            if progress.get("store") not in (None, "ok"):
                postfix += f"; store {progress['store']}"
        bar = self.bar
        if bar is None:
            bar = self.bar = tqdm(
                total=total,
                initial=done,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=self.desc,
                file=sys.stderr,
                disable=not sys.stderr.isatty(),
                leave=False,
                dynamic_ncols=True,
            )
        bar.total = total  # grows when more is committed while we wait
        bar.n = done
        bar.set_postfix_str(postfix, refresh=False)
        bar.refresh()
        if bar.disable and time.monotonic() - self.lined >= PROGRESS_LINE_S:  # a log, not a terminal
            self.lined = time.monotonic()
            print(
                f"ckptfs: {self.desc}: {format_bytes(done)} of {format_bytes(total)}, {postfix}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> str | None:
        """What we waited for, or None if nothing was pending."""
        total = (self.last or {}).get("total_bytes")
        if not total:
            return None
        return f"waited {time.monotonic() - self.start:.1f} s for {format_bytes(total)} to upload"
