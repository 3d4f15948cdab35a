"""Small helpers every kind of test uses: test data, waiting on a condition, running trio code,
free ports and the ckptfs command's one-line errors. (Mounts: tests/support/mounting.py; the namespace
driven in-process: tests/support/inprocess.py; fixtures: tests/conftest.py.)"""

from __future__ import annotations

import functools
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[2]

# Hang guard of run_trio/trio_test: turns a deadlock into a failure; nothing waits on it otherwise.
TRIO_GUARD_S = 120.0


def blob(n: int, seed: int = 0) -> bytes:
    """``n`` incompressible bytes, the same for the same seed and distinct across seeds (a swapped,
    stale or shifted block shows up)."""
    return random.Random(seed).randbytes(n)


def floats(n_bytes: int, dtype="float32", seed: int = 0) -> bytes:
    """Weight-like data: small normally distributed values of ``dtype`` (their exponent bytes
    repeat, so they compress a little, as real weights do)."""
    import numpy

    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal(n_bytes // numpy.dtype(dtype).itemsize) * 0.02).astype(dtype).tobytes()


def wait_until(predicate, timeout: float, step: float = 0.1, what: str | None = None):
    """Poll ``predicate`` until it returns something true, at most ``timeout`` seconds; returns
    that value. Without ``what``, returns the last (false) value at the deadline for the caller
    to assert on; with it, fails with "timed out after Ns waiting for <what>"."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(step)
    if not value and what is not None:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
    return value


async def wait_until_async(predicate, timeout: float, what: str, step: float = 0.01):
    """``wait_until`` inside trio: poll ``predicate`` (a plain function) without blocking the loop;
    fails with "timed out after Ns waiting for <what>"."""
    with trio.move_on_after(timeout):
        while not (value := predicate()):
            await trio.sleep(step)
        return value
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def run_trio(fn, *args, guard_s: float = TRIO_GUARD_S):
    """``trio.run(fn, *args)`` under a hang guard; returns what ``fn`` returns."""

    async def guarded():
        with trio.fail_after(guard_s):
            return await fn(*args)

    return trio.run(guarded)


def trio_test(test):
    """Decorator: an ``async def`` test (its fixtures as usual) run by ``run_trio``."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return run_trio(functools.partial(test, *args, **kwargs))

    return run


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (a server started next may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_shm_dir() -> Path:
    """A fresh 0700 directory in /dev/shm for a mount's RAM tier (``--shm-dir``). Its name carries
    the scripts/test session (CKPTFS_TEST_SHM_TAG), so that session's cleanup removes what a
    killed pytest left behind without touching another session's."""
    tag = os.environ.get("CKPTFS_TEST_SHM_TAG", "")
    shm = Path("/dev/shm") / f"ckptfs-tests-{tag + '-' if tag else ''}{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    return shm


def write_files(root: Path, files: dict[str, bytes]) -> None:
    """Write each ``name: bytes`` under ``root``, making parent directories."""
    for name, data in files.items():
        path = Path(root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (``Z`` for a zombie), None when it is gone. A
    leader that has exited while its other threads still tear down (and hold its files, such as
    the control socket) shows as the state of a live thread, not as ``Z``."""
    try:
        leader = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if leader == "Z":
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return leader
        for tid in tasks:
            try:
                state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                return state
    return leader


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The ckptfs command in a subprocess from the repository root; never raises on its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "ckptfs", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(done: subprocess.CompletedProcess, code: int | None, *needles: str) -> None:
    """Exit ``code`` (None: any non-zero) and exactly one stderr line, "ckptfs: ...", holding every
    needle; no traceback."""
    if code is None:
        assert done.returncode != 0, done.stderr
    else:
        assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def can_open(other_user, path: Path) -> str:
    """ "ok" if the other user can open ``path`` for reading, else the errno's name."""
    done = other_user.python(
        "import errno, os, sys\n"
        "try:\n    os.close(os.open(sys.argv[1], os.O_RDONLY)); print('ok')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def stored(store, key: str):
    """The object as the store shows it (HEAD: its size, ETag and metadata), read behind
    ckptfs's back; ``store`` is a store view (the ``store`` fixture's)."""
    from ckptfs.store import open_store

    backend = open_store(store.url, store.endpoint)
    try:
        return backend.head(key)
    finally:
        backend.close()
