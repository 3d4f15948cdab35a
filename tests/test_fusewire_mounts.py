"""The FUSE transport (ckptfs/fusewire) end to end: real ckptfs mounts through real FUSE.

- A user other than root mounts through fusermount3 (the /dev/fuse fd passed back over a socket),
  uses the mount, asks its status and unmounts it; passthrough is off for it, and the log says so.
- A reader stuck in a read the store is slow to answer: a fatal signal ends it at once while the
  mount serves everything else, and the file reads back whole once the store answers. (A signal
  with a handler cannot cut such a read short: see test_a_signal_handler_cuts_a_stalled_read_short.)
- Many processes writing and reading at once, with the reader threads growing on cloned fds, and
  with one reader thread (--fuse-threads 1: no clone).
- Unmounting: a process that still holds a file gets an error, not a hang; a plain umount(8) from
  outside ends the daemon, and nothing committed is lost.

Local store (file://) except for the stalled reads, which need the S3 fault proxy to hold a GET.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import LocalStoreView
from tests.support.faultproxy import Rule, hold
from tests.support.harness import proc_state, wait_until, write_files
from tests.support.mounting import Mount, fresh_cache, is_mounted

# Layers by test: e2e, and e2e + store for the two that need the S3 fault proxy.
pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    """The local store for mount_factory's mounts (the S3 test makes its own mount)."""
    return LocalStoreView(tmp_path / "store")


def gone(pid: int) -> bool:
    return proc_state(pid) in (None, "Z")  # an exited process nobody reaped yet counts as gone


def fuse_fds(pid: int) -> int:
    """How many /dev/fuse descriptors the daemon holds: the first, and one per cloned reader."""
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == "/dev/fuse"
        except OSError:
            pass
    return count


def python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a child interpreter: a call that hung inside the mount hangs it, not the test."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout
    )


class Child:
    """A child process that reports line by line (read in a thread, so waits have timeouts)."""

    def __init__(self, code: str, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float) -> str | None:
        """The first line from now on starting with ``prefix``; None if none came in time."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def say(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # (stuck in an uninterruptible wait: reaped by init once the wait ends)


# =============================================================================================
# a. A mount by a user other than root, through fusermount3
# =============================================================================================


class UserNamespace:
    """Commands run as ``user`` in a mount namespace of their own, in which /dev/fuse is a node
    of the same device with mode 0666.

    fusermount3 (3.14) opens /dev/fuse with the calling user's filesystem uid, so a user may
    mount FUSE only where /dev/fuse is 0666, as udev makes it. Some machines (containers) have it
    0600: there nobody but root can mount any FUSE filesystem. The namespace gives the user the
    usual 0666 node without changing the machine's; what runs in it (fusermount3, the mount(2),
    the daemon, the kernel's FUSE) is as on any machine. Its mounts stay in it (slave
    propagation), so the mount table to look at is its own (/proc/<pid>/mounts)."""

    def __init__(self, user, root: Path):
        self.user = user
        node = root / "fuse"
        dev = os.stat("/dev/fuse").st_rdev
        os.mknod(node, stat.S_IFCHR | 0o666, dev)
        node.chmod(0o666)  # (mknod applies the umask)
        script = 'mount --bind "$0" /dev/fuse && echo ready && exec sleep 3600'
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script, str(node)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None and self.holder.stderr is not None
        if self.holder.stdout.readline().strip() != "ready":
            self.close()
            raise AssertionError(f"no mount namespace with a 0666 /dev/fuse: {self.holder.stderr.read()}")

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
        env.update(conftest._other_pythonpath())
        return subprocess.run(
            ["nsenter", f"--target={self.holder.pid}", "--mount", "--"]
            + ["setpriv", f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--clear-groups", "--"]
            + list(argv),
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ckptfs(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(conftest._other_python(), "-m", "ckptfs", *args, timeout=timeout)

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        return self.run(conftest._other_python(), "-c", textwrap.dedent(code), *args)

    def mounts(self) -> list[list[str]]:
        """The namespace's mount table, one split line per mount."""
        return [line.split() for line in Path(f"/proc/{self.holder.pid}/mounts").read_text().splitlines()]

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(timeout=30)
        for pipe in (self.holder.stdout, self.holder.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.e2e
def test_a_user_mounts_through_fusermount3(other_user):
    root = Path(tempfile.mkdtemp(prefix="ckptfs-fusewire-", dir="/tmp"))  # (pytest's tree is 0700)
    root.chmod(0o711)
    space = None
    pid = None
    try:
        store, cache, mnt, shm = (root / name for name in ("store", "cache", "mnt", "shm"))
        for directory in (store, cache, mnt):
            directory.mkdir()
            os.chown(directory, other_user.uid, other_user.gid)
        shm.mkdir()
        shm.chmod(0o1777)  # a stand-in for /dev/shm: sticky and world-writable
        space = UserNamespace(other_user, root)

        done = space.ckptfs(
            "mount",
            f"file://{store}",
            str(mnt),
            "--cache-dir",
            str(cache),
            "--ram-cache",
            "64MiB",
            "--cache-size",
            "256MiB",
            "--shm-dir",
            str(shm),
        )
        assert done.returncode == 0, f"mount as {other_user.name}: {done.stderr.strip()}"
        done = space.ckptfs("status", str(mnt), "--json")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        pid = status["pid"]
        assert status["store"] == f"file://{store}" and status["mountpoint"] == str(mnt)
        uids = Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[:4]
        assert uids == [str(other_user.uid)] * 4  # the daemon runs as the user, no root anywhere
        assert fuse_fds(pid) >= 1  # the fd fusermount3 passed back

        (line,) = [m for m in space.mounts() if m[1] == str(mnt)]
        source, _, fstype, options = line[:4]
        assert (source, fstype) == (f"file://{store}", "fuse.ckptfs")
        options = options.split(",")
        assert f"user_id={other_user.uid}" in options and f"group_id={other_user.gid}" in options
        assert "default_permissions" in options and "nosuid" in options and "nodev" in options

        done = space.python(
            """
            import hashlib, os, random, sys
            path = sys.argv[1]
            data = random.Random(7).randbytes(3 * 1024 * 1024 + 5)
            with open(path, "wb") as f:
                f.write(data)
            with open(path, "rb") as f:
                back = f.read()
            st = os.stat(path)
            print(back == data, st.st_uid, st.st_size, hashlib.sha256(back).hexdigest())
            """,
            str(mnt / "weights.bin"),
        )
        expected = random.Random(7).randbytes(3 * MiB + 5)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [
            "True",
            str(other_user.uid),
            str(len(expected)),
            hashlib.sha256(expected).hexdigest(),
        ]
        assert fuse_fds(pid) > 1  # more reader threads, on fds the user's daemon cloned itself

        log = (cache / "ckptfs.log").read_text()
        reasons = re.findall(r"passthrough off: (.*?); every read", log)
        assert reasons in (
            ["FUSE passthrough needs root (CAP_SYS_ADMIN)"],  # a kernel that offers it (Linux >= 6.9)
            ["the kernel offers no FUSE passthrough (Linux 6.9 or later)"],
        ), reasons

        done = space.ckptfs("umount", str(mnt))
        assert done.returncode == 0, f"umount as {other_user.name}: {done.stderr.strip()}"
        assert wait_until(lambda: gone(pid), 30, step=0.05), f"daemon {pid} still running after umount"
        pid = None
        assert not [m for m in space.mounts() if m[1] == str(mnt)]
        assert (store / "weights.bin").read_bytes() == expected  # committed and uploaded before it left
        assert "Traceback" not in (cache / "ckptfs.log").read_text()
    finally:
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: gone(pid), 10)
        if space is not None:
            space.close()  # the namespace, its /dev/fuse and any mount left in it go with it
        shutil.rmtree(root, ignore_errors=True)


# =============================================================================================
# b. A read the store is slow to answer, and signals
# =============================================================================================

READER = """
import os, sys, signal, time

class Interrupted(Exception):
    pass

def on_signal(signum, frame):
    raise Interrupted

signal.signal(signal.SIGUSR1, on_signal)
fd = os.open(sys.argv[1], os.O_RDONLY)
print("opened", flush=True)
sys.stdin.readline()
print("reading", flush=True)
try:
    data = os.pread(fd, 1 << 20, 0)
    print("read", len(data), flush=True)
except Interrupted:
    print("interrupted", flush=True)
except OSError as exc:
    print("error", exc.errno, flush=True)
"""


@pytest.fixture
def stalled(proxied_store, proxy, tmp_path):
    """(mount, proxy, files): files in the store and none in the mount's cache, so every read of
    them is a GET through the fault proxy."""
    m = Mount(
        proxied_store.url,
        tmp_path / "m",
        endpoint_url=proxied_store.endpoint,
        # (reads through the daemon: a cold open would fetch the file whole, tests/test_fetch_whole.py)
        extra=(*proxied_store.mount_extra, "--fetch-whole", "0"),
    )
    try:
        files = {"slow.bin": os.urandom(4 * MiB), "other.bin": os.urandom(MiB + 17)}
        m.start()
        write_files(m.path, files)
        fresh_cache(m)  # (stops, which drains: the files are in the store)
        yield m, proxy, files
    finally:
        proxy.clear()  # (the stop waits for the store)
        m.cleanup()


@contextlib.contextmanager
def stalled_read(m: Mount, proxy):
    """(reader, rule): a child in a read of slow.bin whose GET the proxy holds (rule.held[0]).
    Released, and the child gone, on the way out."""
    reader = Child(READER, str(m.path / "slow.bin"))
    rule = None
    try:
        assert reader.expect("opened", 60), reader.seen
        rule = proxy.add_rule(Rule(hold(), kind="get", path=r"/slow\.bin$"))
        reader.say()
        assert reader.expect("reading", 30), reader.seen
        rule.wait_held(60)  # the read waits on the store now
        yield reader, rule
    finally:
        if rule is not None:
            rule.release()
        reader.close()


@pytest.mark.e2e
@pytest.mark.store
def test_a_reader_killed_in_a_stalled_read_goes_at_once_and_the_mount_serves_on(stalled):
    m, proxy, files = stalled
    with stalled_read(m, proxy) as (reader, rule):
        get = rule.held[0]
        # Meanwhile the mount serves everything else: names, attributes, another file's GETs, writes.
        done = python(
            """
            import hashlib, os, sys
            root = sys.argv[1]
            assert sorted(os.listdir(root)) == ["other.bin", "slow.bin"]
            assert os.stat(os.path.join(root, "slow.bin")).st_size == 4 * 1024 * 1024
            with open(os.path.join(root, "other.bin"), "rb") as f:
                print(hashlib.sha256(f.read()).hexdigest())
            with open(os.path.join(root, "new.bin"), "wb") as f:
                f.write(b"n" * 300_000)
            with open(os.path.join(root, "new.bin"), "rb") as f:
                assert f.read() == b"n" * 300_000
            """,
            str(m.path),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [hashlib.sha256(files["other.bin"]).hexdigest()]
        assert not get.done.is_set(), "the store answered the held GET: the test proves nothing"

        os.kill(reader.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: gone(reader.proc.pid), 15, step=0.02), (
            "the killed reader stayed in its read"
        )
        assert not get.done.is_set()  # it went before the store answered
        assert os.stat(m.path / "other.bin").st_size == len(files["other.bin"])

        rule.release()
        assert get.done.wait(60)
        assert (m.path / "slow.bin").read_bytes() == files["slow.bin"]
        assert (m.path / "new.bin").read_bytes() == b"n" * 300_000
        assert "Traceback" not in (m.cache_dir / "ckptfs.log").read_text()


@pytest.mark.e2e
@pytest.mark.store
def test_a_signal_handler_cuts_a_stalled_read_short(stalled):
    """What the transport's READ interrupts are for (Session._handle, InFlight): a signal whose
    handler raises ends a read the store is slow to answer, with the handler's exception."""
    m, proxy, files = stalled
    with stalled_read(m, proxy) as (reader, rule):
        get = rule.held[0]
        os.kill(reader.proc.pid, signal.SIGUSR1)
        ended = reader.expect("", 5)  # the read's end, whatever it is
        still_held = not get.done.is_set()
        rule.release()
        assert get.done.wait(60)
        assert (m.path / "slow.bin").read_bytes() == files["slow.bin"]  # whatever happened: intact
        assert ended == "interrupted" and still_held, f"after SIGUSR1: {ended!r}"


# =============================================================================================
# c. Many requests at once, on many reader threads or on one
# =============================================================================================

WORKER = """
import os, random, sys
root, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(n)
direct = rng.randbytes(2 * 1024 * 1024 + n)  # a write-only handle: direct I/O
paged = rng.randbytes(1024 * 1024 + 3 * n)  # a read-write handle: through the page cache
a, b = os.path.join(root, f"direct-{n}.bin"), os.path.join(root, f"paged-{n}.bin")
sys.stdin.readline()  # all start together
with open(a, "wb") as f:
    for at in range(0, len(direct), 256 * 1024):
        f.write(direct[at : at + 256 * 1024])
fd = os.open(b, os.O_RDWR | os.O_CREAT, 0o644)
pieces = list(range(0, len(paged), 64 * 1024))
rng.shuffle(pieces)
for at in pieces:
    os.pwrite(fd, paged[at : at + 64 * 1024], at)
os.fsync(fd)
assert os.pread(fd, len(paged) + 10, 0) == paged
os.close(fd)
for _ in range(3):
    with open(a, "rb") as f:
        assert f.read() == direct, "direct"
    with open(b, "rb") as f:
        assert f.read() == paged, "paged"
    assert os.stat(a).st_size == len(direct) and os.stat(b).st_size == len(paged)
    assert {f"direct-{n}.bin", f"paged-{n}.bin"} <= set(os.listdir(root))
print("ok", n, flush=True)
"""

WORKERS = 8


def expected_files(n: int) -> dict[str, bytes]:
    rng = random.Random(n)
    direct = rng.randbytes(2 * MiB + n)
    paged = rng.randbytes(MiB + 3 * n)
    return {f"direct-{n}.bin": direct, f"paged-{n}.bin": paged}


@pytest.mark.e2e
@pytest.mark.parametrize("threads", [None, 1], ids=["default-threads", "one-thread"])
def test_concurrent_writers_and_readers_all_get_their_bytes(store, mount_factory, threads):
    m = mount_factory(extra=("--fuse-threads", str(threads)) if threads else ()).start()
    workers = [Child(WORKER, str(m.path), str(n)) for n in range(WORKERS)]
    try:
        for w in workers:
            w.say()
        for n, w in enumerate(workers):
            line = w.expect("ok", 120)
            assert line == f"ok {n}", f"worker {n}: {w.seen}"
            assert w.proc.wait(30) == 0
    finally:
        for w in workers:
            w.close()
    fds = fuse_fds(m.pid)
    if threads == 1:
        assert fds == 1, f"--fuse-threads 1: {fds} /dev/fuse fds (a reader was cloned)"
    else:
        assert 1 < fds <= 16, f"{fds} /dev/fuse fds for up to 16 reader threads"
    m.sync()
    for n in range(WORKERS):
        for name, data in expected_files(n).items():
            assert (m.path / name).read_bytes() == data
            assert store.read(name) == data, f"{name} differs in the store"


# =============================================================================================
# d. Unmounting
# =============================================================================================

HOLDER = """
import errno, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("opened", flush=True)
sys.stdin.readline()
try:
    data = os.pread(fd, 4096, 2 * 1024 * 1024)  # (nothing read before: not in the page cache)
    print("read", len(data), flush=True)
except OSError as exc:
    print("error", errno.errorcode.get(exc.errno, exc.errno), flush=True)
"""


@pytest.mark.e2e
def test_after_umount_a_process_holding_a_file_gets_an_error_not_a_hang(store, mount_factory):
    # (a file read through the daemon: one fetched whole at its open is read by the kernel,
    # which goes on reading it after the daemon left)
    m = mount_factory(extra=("--fetch-whole", "0")).start()
    data = os.urandom(4 * MiB)
    (m.path / "held.bin").write_bytes(data)
    m.stop()
    m.drop_ram_tier()
    shutil.rmtree(m.cache_dir)  # (nothing of it cached: a read must ask the daemon)
    m.start()
    pid = m.pid
    holder = Child(HOLDER, str(m.path / "held.bin"))
    try:
        assert holder.expect("opened", 60), holder.seen
        m.stop()  # detaches the busy mount and ends the daemon
        assert gone(pid) and not is_mounted(m.path)
        holder.say()
        line = holder.expect("", 30)
        assert line is not None, "the holder's read hung after the daemon left"
        print(f"\na read of a file held open across the umount: {line}")
        assert line.split()[:2] in (["error", "ENOTCONN"], ["error", "ECONNABORTED"], ["error", "EIO"]), line
        assert holder.proc.wait(30) == 0
    finally:
        holder.close()
    # the file is whole for the next mount
    m.start()
    assert (m.path / "held.bin").read_bytes() == data


@pytest.mark.e2e
def test_a_plain_umount_from_outside_ends_the_daemon_and_loses_nothing(store, mount_factory):
    m = mount_factory().start()
    pid = m.pid
    files = {"a.bin": os.urandom(3 * MiB), "dir/b.txt": b"committed\n"}
    write_files(m.path, files)  # (committed at close; maybe not yet in the store)
    done = subprocess.run(["umount", str(m.path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert wait_until(lambda: gone(pid), 30, step=0.05), f"daemon {pid} still running after umount(8)"
    m.pid = None
    assert not is_mounted(m.path)
    log = (m.cache_dir / "ckptfs.log").read_text()
    assert "Traceback" not in log and "unmounted" in log  # a clean stop, not a crash
    # The kernel unmounted it: the daemon must not unmount the path again on its way out (it
    # may hold another mount by then; libfuse checks the connection for POLLERR first).
    assert "cannot unmount" not in log, log
    m.start()  # uploads left pending resume
    m.sync()
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data
        assert store.read(name) == data
