"""GIL-held time of a Python process, sampled with py-spy (issue 32: how far one mount could scale).

`py-spy record --gil --nonblocking` samples the process `RATE` times a second without stopping
it and keeps only the samples in which one of its threads holds the GIL, so the samples written
/ `RATE` are the seconds during which some thread held it. The raw format is one line per stack:
`frame;frame;... count`. A holder that the kernel has preempted still counts (the GIL is held
meanwhile), so on a machine short of cores the figure is an upper bound of what more cores would
see. `calibrate` checks the method on two known processes: a busy loop (held all the time) and a
sleeper (never).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

RATE = 250  # samples per second
START_TIMEOUT = 20.0  # py-spy reads the target's symbols before it samples


class GilError(Exception):
    """py-spy is missing or failed: the figure is left out, with this one-line reason."""


def py_spy() -> str:
    """The py-spy binary: next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise GilError("py-spy not found (scripts/setup --with-bench installs it)")
    return found


def held_seconds(raw: str) -> float:
    """GIL-held seconds from py-spy's raw output: the sum of the trailing counts / RATE."""
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples += int(count)
    return samples / RATE


class GilSampler:
    """`with GilSampler(pid, out) as gil:` samples `pid` from the moment py-spy reports that it
    samples until the block ends; then `gil.seconds` holds the GIL-held seconds."""

    def __init__(self, pid: int, out: Path):
        self.pid, self.raw, self.log = pid, out.with_suffix(".raw"), out.with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self.seconds: float | None = None

    def __enter__(self) -> GilSampler:
        argv = [py_spy(), "record", "--gil", "--nonblocking", "--rate", str(RATE), "--format", "raw"]
        argv += ["--output", str(self.raw), "--pid", str(self.pid)]
        try:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
        except OSError as e:
            raise GilError(f"py-spy did not run: {e}") from None
        deadline = time.monotonic() + START_TIMEOUT
        while b"Sampling process" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._end()
                raise GilError(f"py-spy did not start sampling pid {self.pid}: {self._reason()}")
            time.sleep(0.02)
        return self

    def __exit__(self, kind, value, tb) -> None:
        rc = self._end()
        if kind is not None:
            return
        if rc != 0 or not self.raw.exists():
            raise GilError(f"py-spy exited with status {rc}: {self._reason()}")
        self.seconds = held_seconds(self.raw.read_text())

    def _end(self) -> int | None:
        """SIGINT (py-spy then writes its output), by PID; a kill if it does not exit."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    def _reason(self) -> str:
        """py-spy's error line (its backtrace follows it), else its last line."""
        with contextlib.suppress(OSError):
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines()]
            errors = [line for line in lines if line.startswith("Error:")]
            return next(iter(errors), next((line for line in reversed(lines) if line), "no output"))
        return "no output"


CALIBRATION_SECONDS = 2.0
CALIBRATION = {
    "busy loop": "while True: pass",  # holds the GIL all the time: ~2 s
    "sleeper": "import time; time.sleep(60)",  # never: ~0 s
}


def calibration_off(found: dict[str, float]) -> str | None:
    """Why the calibration says the method is off (None: it is sane)."""
    busy, sleeper, full = found["busy loop"], found["sleeper"], CALIBRATION_SECONDS
    if abs(busy - full) <= 0.2 * full and sleeper <= 0.05 * full:
        return None
    return f"py-spy's calibration is off: busy loop {busy:.2f} s, sleeper {sleeper:.2f} s of {full:.0f} s"


def calibrate(work: Path) -> dict[str, float]:
    """GIL-held seconds py-spy reports for CALIBRATION_SECONDS of each known process."""
    found = {}
    for name, code in CALIBRATION.items():
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
        try:
            time.sleep(0.3)  # (the interpreter started)
            with GilSampler(proc.pid, work / f"gil-calibration-{name.replace(' ', '-')}") as gil:
                time.sleep(CALIBRATION_SECONDS)
            found[name] = gil.seconds
        finally:
            proc.kill()
            proc.wait()
    return found


def main_thread_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s main thread (the ckptfs daemon's trio thread, which
    answers every FUSE request), from /proc/PID/task/PID/stat."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
