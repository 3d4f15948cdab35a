"""Several ckptfs "nodes" on this one machine, each with its own mount of ONE store: the harness
of the multi-node tests (the ``cluster`` fixture of tests/conftest.py makes one per test).

    node_a, node_b = cluster.node("a"), cluster.node("b")      # started mounts of cluster.store
    node_b.hold_uploads()                                      # b's changes to the store wait ...
    ...
    node_b.release_uploads()                                   # ... or: node_b.lose()

Each node has its own mountpoint (``node.path``), cache dir, RAM tier (``--shm-dir``: a private
directory under /dev/shm) and its own link to the store, so that one node's uploads can be
held while the others' flow:
  - S3: a FaultProxy (tests/support/faultproxy.py) of its own in front of the server, the
    node's ``--endpoint-url``. Holding adds a ``hold()`` rule for every request that changes the
    store (PUT, POST, DELETE, copy: kinds put, upload_part, create/complete_multipart, abort,
    delete, copy) whose path is not under an excepted prefix (multi-object deletes name no key
    in their path: always held); reads, HEADs and listings pass.
  - local store: a hold_syscalls server of its own (tests/support/hold_syscalls.py): the node's
    ``ckptfs mount`` runs under its seccomp filter, so every system call of the daemon that
    would change the store directory (rename, unlink, mkdir, xattrs, creating opens ...) asks
    it first; while holding, those that change what the store shows wait. Every node's store
    URL is the shared directory itself. hold_syscalls.py says exactly what is held, why the
    store's scratch space ``.ckptfs-tmp/`` outside ``uploads/`` is not (the rename that
    publishes is), and why this is not a FUSE passthrough (a call held in a FUSE filesystem
    holds the kernel's directory and rename locks: the node's excepted records would wait).
A node lost (``lose``) has its daemon SIGKILLed, its held requests dropped unforwarded (never
run), its link stopped, its mount lazily unmounted and its cache dir and RAM tier wiped; it
never starts again.

``netns=True`` (S3 only): the node's daemon runs in a network namespace of its own (``ip netns``,
a veth pair 10.231.I.1/30 (host) - 10.231.I.2/30 (node), I allocated per node), started through
``nsenter --net=`` only (the mount namespace stays the host's: the FUSE mount is seen here), and
reaches the store through its FaultProxy listening on the host side of the veth. ``rate``
("200mbit", tc's units) caps that link with a tbf qdisc on both ends of the veth; without
netns, an S3 node's rate throttles its FaultProxy instead (``FaultProxy.rate``). Namespaces
are recorded in /run/ckptfs-tests-netns/NAME (the pytest's PID and the scripts/test session),
so a later run reclaims those of a pytest that died and scripts/test's cleanup removes its own.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from tests.support.harness import REPO, private_shm_dir, proc_state
from tests.support.mounting import CKPTFS, Mount, ckptfs, is_mounted

WRITERS_PREFIX = ".ckptfs-writers/"
HOLD_SYSCALLS = Path(__file__).resolve().parent / "hold_syscalls.py"
# The S3 requests that change the store (tests/support/faultproxy.py's kinds).
CHANGING_KINDS = ("put", "upload_part", "create_multipart", "complete_multipart", "abort", "delete", "copy")
NETNS_RECORDS = Path("/run/ckptfs-tests-netns")
NETNS_SUBNETS = 256  # 10.231.I.0/30, I < 256
STOP_TIMEOUT_S = 60  # a clean umount at cleanup; then SIGKILL
_RATE_UNITS = {  # tc's units -> bytes per second
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "bps": 1,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "tbps": 1e12,
}


def rate_bytes(rate: str) -> float:
    """tc's rate ("200mbit", "50mbps", ...) in bytes per second."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", rate)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"not a rate in tc's units: {rate!r} (e.g. '200mbit', '25mbps')")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def _wait_dead(pid: int, timeout: float = 30) -> None:
    """Until ``pid`` is gone or a zombie (tests/support/mounting.py's kill_daemon says why)."""
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in (None, "Z"):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still runs {timeout:g} s after SIGKILL")
        time.sleep(0.01)


def _lazy_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


# ---- links to the store ------------------------------------------------------------------------


class _ProxyLink:
    """An S3 node's link: a FaultProxy of its own in front of the server."""

    def __init__(self, upstream: str, bucket: str, prefix: str, host: str = "127.0.0.1"):
        from tests.support.faultproxy import FaultProxy  # (here: tests/conftest.py's layer guess)

        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._key_root = f"/{bucket}/{prefix}/" if prefix else f"/{bucket}/"
        self.proxy = FaultProxy(upstream, host=host).start()
        self.endpoint = self.proxy.url
        self.wrap: list[str] = []
        self.pid: int | None = None  # (runs in this process)
        self._rule = None

    def hold(self, except_prefixes: tuple[str, ...]) -> None:
        from tests.support.faultproxy import Rule, hold

        spared = {re.escape(self._key_root + p) for p in except_prefixes}
        spared |= {re.escape(quote(self._key_root + p, safe="/~")) for p in except_prefixes}
        path = f"^(?!(?:{'|'.join(sorted(spared))}))" if spared else None
        self._rule = self.proxy.add_rule(Rule(hold(), kind=CHANGING_KINDS, path=path))

    def release(self) -> None:
        rule, self._rule = self._rule, None
        if rule is not None:
            rule.release()
            self.proxy.remove_rule(rule)

    def held_requests(self) -> list:
        rule = self._rule
        return [] if rule is None else [req for req in list(rule.held) if not req.done.is_set()]

    def held_count(self) -> int:
        return len(self.held_requests())

    def discard(self) -> None:
        """Held requests reset unforwarded; nothing is held any more (the proxy goes on)."""
        rule, self._rule = self._rule, None
        if rule is not None:
            rule.release(forward=False)
            self.proxy.remove_rule(rule)

    def drop(self) -> None:
        """Held requests reset unforwarded, and no request is forwarded any more."""
        rule, self._rule = self._rule, None
        if rule is not None:
            rule.release(forward=False)
        self.proxy.stop()

    def stop(self) -> None:
        self.drop()


class _SyscallLink:
    """A local node's link: tests/support/hold_syscalls.py, a server of its own that the node's
    processes (started under its ``wrap``) ask before every call that would change the store."""

    def __init__(self, directory: Path, log: Path):
        self.url = f"file://{directory}"
        self.endpoint = None
        self.proxy = None
        self._lock = threading.Lock()
        sock = f"@ckptfs-hold-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # (abstract: no path length limit)
        self.wrap = [sys.executable, str(HOLD_SYSCALLS), "wrap", sock, "--"]
        with open(log, "ab") as log_file:
            self._proc = subprocess.Popen(
                [sys.executable, str(HOLD_SYSCALLS), "serve", str(directory), sock],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                bufsize=0,
            )
        self._log = log
        self.pid: int | None = self._proc.pid
        if self._line(60) != "ready":
            self.stop()
            raise AssertionError(f"hold_syscalls did not start: {log.read_text(errors='replace')[-2000:]}")

    def _line(self, timeout: float) -> str | None:
        data = b""
        deadline = time.monotonic() + timeout
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                return None
            byte = self._proc.stdout.read(1)
            if not byte:
                return None
            data += byte
        return data.decode().strip()

    def _command(self, line: str) -> str:
        with self._lock:
            if self._proc.poll() is not None:
                raise AssertionError(f"hold_syscalls exited ({self._proc.returncode}); see {self._log}")
            self._proc.stdin.write(line.encode() + b"\n")
            answer = self._line(30)
        if answer is None or answer.startswith("error"):
            raise AssertionError(f"hold_syscalls answered {answer!r} to {line!r}; see {self._log}")
        return answer

    def hold(self, except_prefixes: tuple[str, ...]) -> None:
        self._command("hold " + json.dumps(list(except_prefixes)))

    def release(self) -> None:
        self._command("release")

    def held_count(self) -> int:
        return int(self._command("count"))

    def held(self) -> list[str]:
        """What is held now, e.g. ["renameat2 /store/.ckptfs-tmp/1f.tmp -> /store/a.bin"]."""
        return json.loads(self._command("list"))

    def discard(self) -> None:
        # (called once the caller is dead: the kernel never runs a dead caller's held call)
        self._command("release")

    def drop(self) -> None:
        self._command("drop")

    def stop(self) -> None:
        """End of its stdin: it fails what it holds (EIO) and exits."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(10)
        self.pid = None


# ---- network namespaces ------------------------------------------------------------------------


class _Netns:
    """A network namespace and a veth pair into it, 10.231.I.1 (host) - 10.231.I.2 (node)."""

    def __init__(self, rate: str | None):
        if shutil.which("ip") is None or shutil.which("nsenter") is None:
            pytest.skip("network namespaces need `ip` (iproute2) and `nsenter` (util-linux)")
        NETNS_RECORDS.mkdir(parents=True, exist_ok=True)
        taken = _run("ip", "-o", "-4", "addr", "show").stdout
        for index in range(NETNS_SUBNETS):
            name = f"ckfs{index}"
            if re.search(rf"\b10\.231\.{index}\.\d+/", taken):
                continue  # (someone's veth is there, ours of a dead pytest or not)
            done = _run("ip", "netns", "add", name, check=False)
            if done.returncode != 0 and self._reclaim(name):
                done = _run("ip", "netns", "add", name, check=False)
            if done.returncode == 0:
                break
            if "File exists" not in done.stderr:
                pytest.skip(f"`ip netns add` is impossible here: {done.stderr.strip()}")
        else:
            raise AssertionError(f"no free network namespace name ckfs0..ckfs{NETNS_SUBNETS - 1}")
        self.name, self.index = name, index
        self.deleted = False
        self.path = f"/run/netns/{name}"
        self.host_if, self.node_if = f"{name}h", f"{name}n"
        self.host_ip, self.node_ip = f"10.231.{index}.1", f"10.231.{index}.2"
        (NETNS_RECORDS / name).write_text(f"{os.getpid()} {os.environ.get('CKPTFS_TEST_SHM_TAG', '')}\n")
        try:
            _run(
                "ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.node_if, "netns", name
            )
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "-n", name, "addr", "add", f"{self.node_ip}/30", "dev", self.node_if)
            _run("ip", "-n", name, "link", "set", self.node_if, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            if rate is not None:
                rate_bytes(rate)  # (a clear error for a bad rate)
                tbf = ("root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")
                _run("tc", "qdisc", "add", "dev", self.host_if, *tbf)  # towards the node
                _run("tc", "-n", name, "qdisc", "add", "dev", self.node_if, *tbf)  # from it
        except BaseException:
            self.delete()
            raise

    @staticmethod
    def _reclaim(name: str) -> bool:
        """Remove the namespace ``name`` (and its veth) if the pytest that made it is dead."""
        try:
            pid = int((NETNS_RECORDS / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if pid == os.getpid() or proc_state(pid) not in (None, "Z"):
            return False
        _run("ip", "link", "del", f"{name}h", check=False)
        _run("ip", "netns", "del", name, check=False)
        (NETNS_RECORDS / name).unlink(missing_ok=True)
        return True

    def qdisc(self) -> str:
        """``tc qdisc show`` of the host end of the veth."""
        return _run("tc", "qdisc", "show", "dev", self.host_if).stdout

    def delete(self) -> None:
        if self.deleted:  # (never twice: by then the name may be another test's)
            return
        self.deleted = True
        _run("ip", "link", "del", self.host_if, check=False)  # (both ends go)
        _run("ip", "netns", "del", self.name, check=False)
        (NETNS_RECORDS / self.name).unlink(missing_ok=True)


class _WrappedMount(Mount):
    """A Mount whose ``ckptfs mount`` (and so its daemon) runs under a prefix: ``nsenter
    --net=...`` (a network namespace: the mount namespace, and so the FUSE mount, stays the
    host's; the control socket is a path, reached from here), or hold_syscalls' ``wrap``."""

    def __init__(self, *args, prefix: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def start(self) -> Mount:
        argv = [*self.prefix, *CKPTFS, "mount", *self.args()]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        self.pid = self.status()["pid"]
        return self


# ---- nodes -------------------------------------------------------------------------------------


class Node:
    """One node: a ckptfs mount of the cluster's store through a link of its own."""

    def __init__(self, name: str, root: Path, link, mount: Mount, shm: Path, netns: _Netns | None):
        self.name = name
        self.root = root
        self.mount = mount
        self.path = mount.path
        self.shm_dir = shm
        self.netns = netns
        self.lost = False
        self._down = False  # (the cleanup is through with it)
        self._holding: tuple[str, ...] | None = None  # the excepted prefixes while holding
        self._link = link

    # what the node's link is: its store URL and endpoint (S3: its proxy's)
    @property
    def store_url(self) -> str:
        return self._link.url

    @property
    def endpoint(self) -> str | None:
        return self._link.endpoint

    @property
    def proxy(self):
        """S3: the node's FaultProxy (add rules of your own to it); local store: None."""
        return self._link.proxy

    def put_through_link(self, key: str, data: bytes, timeout: float = 60) -> None:
        """Store ``data`` as the object ``key`` (relative to the store prefix) through this
        node's link, as its daemon would: S3, a client of its proxy; local store, ckptfs's
        LocalStore in a process under the node's hold_syscalls filter. Held like the daemon's
        own requests (a key not excepted waits while holding: the call fails after ``timeout``)."""
        self._alive()
        if self.proxy is not None:
            import boto3
            from botocore.config import Config

            url = urlsplit(self.store_url)
            prefix = url.path.strip("/")
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint,
                config=Config(
                    s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    retries={"total_max_attempts": 1},
                    connect_timeout=10,
                    read_timeout=timeout,
                ),
            )
            client.put_object(Bucket=url.netloc, Key=f"{prefix}/{key}" if prefix else key, Body=data)
            return
        code = (
            "import sys; from ckptfs.store.local import LocalStore; "
            "LocalStore.at(sys.argv[1]).put(sys.argv[2], sys.stdin.buffer.read())"
        )
        argv = [*self._link.wrap, sys.executable, "-c", code, urlsplit(self.store_url).path, key]
        done = subprocess.run(argv, input=data, capture_output=True, timeout=timeout, cwd=REPO)
        if done.returncode != 0:
            raise AssertionError(f"put {key!r} through {self.name}'s link: {done.stderr.decode()[-2000:]}")

    def held(self) -> list[str]:
        """Local store: what its link holds now (system calls and their paths); S3: the held
        requests (method and path)."""
        if self.lost:
            return []
        if self.proxy is not None:
            return [f"{r.method} {r.path}" for r in self._link.held_requests()]
        return self._link.held()

    @property
    def pid(self) -> int | None:
        """Its daemon's PID (None while stopped, or lost)."""
        return self.mount.pid

    def pids(self) -> list[int]:
        """The PIDs of the node's processes that run now: its daemon, and (local store) its
        hold_syscalls server."""
        pids = [self.mount.pid, self._link.pid]
        return [pid for pid in pids if pid is not None and proc_state(pid) not in (None, "Z")]

    def __repr__(self) -> str:
        return f"<Node {self.name}{' lost' if self.lost else ''} {self.path}>"

    # -- holding uploads ------------------------------------------------------------------
    def hold_uploads(self, except_prefixes=(WRITERS_PREFIX,)) -> None:
        """From now on every request of this node that changes the store is held, unanswered,
        until release_uploads(); except those on keys under ``except_prefixes`` (relative to the
        store prefix). Reads, HEADs and listings pass."""
        self._alive()
        prefixes = tuple(except_prefixes)
        if self._holding is not None:
            if self._holding != prefixes:
                raise ValueError(f"node {self.name} already holds, except {self._holding}: release first")
            return
        self._link.hold(prefixes)
        self._holding = prefixes

    def release_uploads(self) -> None:
        """The held requests go on (to the store), and nothing is held any more."""
        self._alive()
        self._link.release()
        self._holding = None

    def held_count(self) -> int:
        """Requests of this node being held now."""
        return 0 if self.lost else self._link.held_count()

    # -- life ------------------------------------------------------------------------------
    def lose(self) -> None:
        """The node is lost for good: its daemon SIGKILLed, its held requests dropped (never
        forwarded), its link gone, its mountpoint lazily unmounted, its cache dir and RAM tier
        wiped. Works while requests are held: the daemon's threads blocked in held calls die
        with it (a seccomp notification's wait, or a socket's, ends at SIGKILL), and only then
        is what was held dropped: nothing of it ever runs."""
        if self.lost:
            return
        self.lost = True
        pid = self._sigkill()
        self._link.drop()
        self._reap(pid)
        _lazy_unmount(self.path)
        self._link.stop()
        self._wipe()
        if self.netns is not None:
            self.netns.delete()

    def crash(self, restart: bool = True) -> None:
        """kill -9 and mount again with the same cache dir and RAM tier (a daemon crash, not a
        lost node): what its link held is dropped, and nothing is held after. ``restart=False``:
        it stays down until ``start()``."""
        self._alive()
        self._reap(self._sigkill())
        self._link.discard()
        self._holding = None
        _lazy_unmount(self.path)
        if restart:
            self.mount.start()

    def _sigkill(self) -> int | None:
        pid = self.mount.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pid

    def _reap(self, pid: int | None) -> None:
        if pid is not None:
            _wait_dead(pid)
            self.mount.pid = None

    def _wipe(self) -> None:
        ram = self.mount.ram_dir()
        if ram is not None:
            shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(self.mount.cache_dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def start(self) -> Node:
        """Mount again after ``stop`` (a lost node never starts again)."""
        self._alive()
        self.mount.start()
        return self

    def stop(self) -> None:
        """A clean unmount (``ckptfs umount``: waits for the uploads)."""
        self._alive()
        self.mount.stop()

    def sync(self, *paths, timeout: float = 300) -> None:
        self._alive()
        self.mount.sync(*(str(p) for p in paths), timeout=timeout)

    def status(self) -> dict:
        self._alive()
        return self.mount.status()

    def _alive(self) -> None:
        if self.lost or self._down:
            raise AssertionError(f"node {self.name} is {'lost' if self.lost else 'cleaned up'}")

    def _shutdown(self, problems: list[str]) -> None:
        """Cleanup: stopped (cleanly if it can be, within STOP_TIMEOUT_S), unmounted, link gone."""
        if self.lost or self._down:
            return
        self._down = True
        try:
            self._link.release()
        except Exception as e:  # noqa: BLE001 - go on with the hard way
            problems.append(f"{self.name}: release: {e!r}")
        if is_mounted(self.path):
            try:
                ckptfs("umount", str(self.path), timeout=STOP_TIMEOUT_S)
                self.mount.pid = None
            except Exception as e:  # noqa: BLE001 - the test may have left it unable to: kill it
                warnings.warn(f"node {self.name}: ckptfs umount: {e!r} (killed instead)", stacklevel=1)
        pid = self.mount.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self._link.drop()
            except Exception:  # noqa: BLE001 - stopped below anyway
                pass
            try:
                _wait_dead(pid)
            except AssertionError as e:
                problems.append(f"{self.name}: {e}")
            self.mount.pid = None
        _lazy_unmount(self.path)
        self.mount.drop_ram_tier()
        try:
            self._link.stop()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{self.name}: link: {e!r}")
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self.netns is not None:
            self.netns.delete()


class Cluster:
    """Nodes on one store: the ``store`` fixture's view (``store.keys()``, ``.read(key)``, ``.url``)."""

    def __init__(self, store, root: Path):
        self.store = store
        self.root = Path(root)
        self.nodes: dict[str, Node] = {}
        self._shm_dirs: list[Path] = []
        self._links: list = []
        self._netns: list[_Netns] = []
        url = urlsplit(store.url)
        self.kind = "s3" if url.scheme == "s3" else "local"
        if self.kind == "s3":
            self._bucket, self._prefix = url.netloc, url.path.strip("/")
            proxy = getattr(store, "fault_proxy", None)
            self.endpoint = (
                store.endpoint if proxy is None else f"http://{proxy._upstream[0]}:{proxy._upstream[1]}"
            )  # the server itself (a node goes through a proxy of its own)
        else:
            self.endpoint = None
            self.directory = Path(url.path)
            self.directory.mkdir(parents=True, exist_ok=True)

    def node(
        self, name: str, *, extra=(), netns: bool = False, rate: str | None = None, **mount_kwargs
    ) -> Node:
        """A started node ``name`` (``extra``: more ``ckptfs mount`` arguments; ``mount_kwargs``:
        Mount's, e.g. ram_cache, cache_size)."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name in self.nodes:
            raise ValueError(f"node name {name!r}: taken, or not a plain file name")
        if self.kind == "local" and (netns or rate):
            pytest.skip("netns and rate need the S3 store (a local store's link is no network)")
        root = self.root / name
        root.mkdir(parents=True)
        shm = private_shm_dir()
        self._shm_dirs.append(shm)
        ns = None
        if netns:
            ns = _Netns(rate)
            self._netns.append(ns)
        if self.kind == "s3":
            link = _ProxyLink(
                self.endpoint, self._bucket, self._prefix, host=ns.host_ip if ns else "127.0.0.1"
            )
            if rate is not None and ns is None:
                link.proxy.rate = rate_bytes(rate)
        else:
            link = _SyscallLink(self.directory, root / "hold_syscalls.log")
        self._links.append(link)
        args = (link.url, root)
        kwargs = dict(
            endpoint_url=link.endpoint,
            extra=(*getattr(self.store, "mount_extra", ()), "--shm-dir", str(shm), *extra),
            **mount_kwargs,
        )
        prefix = [*(["nsenter", f"--net={ns.path}", "--"] if ns else []), *link.wrap]
        mount = _WrappedMount(*args, prefix=prefix, **kwargs) if prefix else Mount(*args, **kwargs)
        node = self.nodes[name] = Node(name, root, link, mount, shm, ns)
        mount.start()
        return node

    def checkpoints(self) -> dict:
        """``ckptfs checkpoints <store URL> --json`` on the store itself (not a mount), parsed."""
        args = ["checkpoints", self.store.url, "--json"]
        if self.endpoint is not None:
            args += ["--endpoint-url", self.endpoint]
        return json.loads(ckptfs(*args, timeout=120).stdout)

    def cleanup(self) -> None:
        """Every node stopped (or killed) and unmounted; every proxy, hold_syscalls, namespace, veth and
        RAM tier gone, whatever state the test left. Raises (after all of it) if something resisted."""
        problems: list[str] = []
        for node in self.nodes.values():
            try:
                node._shutdown(problems)
            except Exception as e:  # noqa: BLE001 - the others still go
                problems.append(f"{node.name}: {e!r}")
        for link in self._links:  # (a node that failed to start has its link here only)
            try:
                link.stop()
            except Exception as e:  # noqa: BLE001
                problems.append(f"link {link.url}: {e!r}")
        for ns in self._netns:
            ns.delete()
        for shm in self._shm_dirs:
            shutil.rmtree(shm, ignore_errors=True)
        leftovers = [str(n.path) for n in self.nodes.values() if is_mounted(n.path)]
        if leftovers:
            problems.append(f"still mounted: {leftovers}")
        if problems:
            raise AssertionError("cluster cleanup: " + "; ".join(problems))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
