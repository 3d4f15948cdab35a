"""Facts about the machine and about processes: what a benchmark report must state and sample."""

from __future__ import annotations

import contextlib
import importlib.metadata
import mmap
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
MADV_POPULATE_WRITE = 23  # (Linux 5.14; not in Python 3.11's mmap module)


# --- processes -------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) and its live children (a ckptfs
    daemon's store workers) so far."""
    return main_cpu_seconds(pid) + sum(main_cpu_seconds(c) for c in _children(pid))


def main_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process alone (a daemon's main interpreter, all threads)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:  # (a child that ended meanwhile)
        return 0.0
    return times.user + times.system


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


# The S3 server's process groups (each of its daemons leads one): set once it is started.
SERVER_GROUPS: list[int] = []


def server_cpu_seconds() -> float:
    """User + system CPU seconds of the S3 server so far: every process of its groups."""
    total = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in SERVER_GROUPS:
                times = proc.cpu_times()
                total += times.user + times.system
        except (psutil.Error, ProcessLookupError):
            pass
    return total


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads (getrusage RUSAGE_SELF: not its
    children). Precise to the microsecond, unlike /proc/PID/stat's clock ticks."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reset_peak_rss(pid: int) -> None:
    """Start a new peak-RSS window (the process's and its children's): the kernel sets VmHWM
    back to the current RSS."""
    for p in (pid, *_children(pid)):
        with contextlib.suppress(FileNotFoundError):
            Path(f"/proc/{p}/clear_refs").write_text("5")


def peak_rss(pid: int) -> int:
    """VmHWM of a process plus its live children's, in bytes: their peak resident sets since
    start or the last reset, summed (a bound on their peak together)."""
    total = 0
    for p in (pid, *_children(pid)):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except FileNotFoundError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:"))
    return total


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the kernel's page cache (needs root). False if not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def prefault_free_memory(nbytes: int) -> None:
    """Touch and free `nbytes` of anonymous memory, so that the next load gets pages the guest
    has just used. On these VMs the first touch of a page the hypervisor took back costs 2-3 s
    per GiB (perf: clear_page_erms), and which pages a load gets depends on what ran before it:
    without this a load measures the VM as much as the filesystem. Done before every timed load
    of every target alike."""
    with mmap.mmap(-1, nbytes) as area:
        try:
            area.madvise(MADV_POPULATE_WRITE)
        except OSError:  # kernels before 5.14: touch one byte per page
            for offset in range(0, nbytes, mmap.PAGESIZE):
                area[offset] = 1


# --- the machine -----------------------------------------------------------------------------


def _first_line(argv: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False).stdout.strip()
        if out:
            return out.splitlines()[0]
    return "not installed"


def _python_package(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _debian_package(name: str) -> str:
    out = _first_line(["dpkg-query", "-W", "-f=${Version}", name])
    return out if out and "no packages" not in out else "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git_revision() -> str:
    rev = _first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return rev + (" + uncommitted changes" if dirty else "")


def describe() -> dict:
    """The machine and the versions of everything measured, for the JSON and the docs."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "kernel": platform.release(),
        "os": _first_line(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "ckptfs": _git_revision(),
            "python": sys.version.split()[0],
            "torch": _python_package("torch"),
            "boto3": _python_package("boto3"),
            "s3torchconnector": _python_package("s3torchconnector"),
            "py-spy": _python_package("py-spy"),
            "s3fs": _first_line(["s3fs", "--version"])
            .replace("Amazon Simple Storage Service File System V", "")
            .split(" ")[0],
            "rclone": _first_line(["rclone", "version"]).replace("rclone v", ""),
            "swift": _debian_package("swift"),
            "fuse3": _debian_package("fuse3"),  # (its fusermount3 mounts FUSE for a user)
        },
    }
