"""A single-node OpenStack Swift with the s3api middleware ("SAIO"), for tests and benchmarks.

Self-contained (stdlib + boto3). Everything lives under one root directory and listens on
127.0.0.1 only:

    ROOT/etc   swift.conf, the four server configs, the rings, a small launcher
    ROOT/srv   the devices directory; ROOT/srv/sdb1 is the one device (needs user xattrs)
    ROOT/log   one log file per server (memcached, account, container, object, proxy)
    ROOT/run   memcached's pid file

Use from Python::

    with SwiftServer(root) as s3:
        s3.make_bucket("b")
        s3.client().put_object(Bucket="b", Key="k", Body=b"x")

or from a shell (the servers keep running after the command returns)::

    python -m tests.support.swift start ROOT     # writes ROOT/env and ROOT/pids, returns once healthy
    . ROOT/env
    python -m tests.support.swift stop ROOT      # stops the PIDs listed in ROOT/pids

Swift reads swift.conf (hash prefix/suffix, storage policies, constraints such as
max_file_size) from the hard-coded path /etc/swift/swift.conf, whatever swift_dir says. So the
servers are not started through the swift-*-server scripts but through ROOT/etc/launch.py,
which points Swift at ROOT/etc/swift.conf before anything reads it, then does exactly what
those scripts do. Swift's own in-process functional tests do the same.

Every server runs in its own session (process group): on SIGTERM a Swift server kills its own
process group (its workers), which must never be the caller's group.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ACCESS_KEY = "test:tester"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Biggest single object (PUT or multipart part) Swift accepts; default is 5 GiB + 2.
MAX_FILE_SIZE = 5 * 1024**4  # 5 TiB
START_TIMEOUT = 60.0
STOP_GRACE = 10.0

SERVER_KINDS = ("account", "container", "object", "proxy")
WORKERS = {"account": 1, "container": 1, "object": 2, "proxy": 2}
DEBIAN_PACKAGES = "swift swift-proxy swift-object swift-container swift-account memcached"


class SwiftError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# S3 endpoint description (also used for a server someone else started)
# --------------------------------------------------------------------------------------------


class S3Endpoint:
    """Where an S3 server is and how to talk to it."""

    def __init__(
        self,
        endpoint: str,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        region: str = REGION,
    ):
        self.endpoint = endpoint
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r})"

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 (and ckptfs) at this server."""
        return {
            "CKPTFS_TEST_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, secret_key: str | None = None, **config):
        """A boto3 S3 client for this server: path-style, SigV4, checksums only when required.

        `config` entries override/extend the botocore Config (e.g. max_pool_connections=16).
        `secret_key` overrides the secret (to test authentication failures).
        """
        import boto3
        from botocore.config import Config

        cfg = dict(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
        )
        cfg.update(config)
        session = boto3.session.Session()
        return session.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key if secret_key is None else secret_key,
            region_name=self.region,
            config=Config(**cfg),
        )

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"    (cannot read {path}: {e})"
    out = data.splitlines()[-lines:]
    return "\n".join("    " + line for line in out) if out else "    (empty)"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, pgrp) of a process, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    rest = data[data.rindex(")") + 2 :].split()
    return rest[0], int(rest[2])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _proc_stat(int(name))
        if st and st[1] == pgid and st[0] != "Z":
            members.append(int(name))
    return members


def _alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z"


def terminate(pids: list[int], marker: str, grace: float = STOP_GRACE) -> list[int]:
    """Stop the given server PIDs (and the process groups they lead), TERM then KILL.

    A PID is only signalled if its command line contains `marker` (the server root), so a
    recycled PID is never touched. Returns the PIDs that were signalled.
    """
    targets = []  # (pid, is_group_leader)
    for pid in pids:
        st = _proc_stat(pid)
        if st is None or marker not in _cmdline(pid):
            # Leader gone: its workers (same group, our marker) may still be around.
            members = [m for m in _group_members(pid) if marker in _cmdline(m)]
            if members:
                targets.append((pid, True))
            continue
        targets.append((pid, st[1] == pid))

    def send(sig):
        for pid, leader in targets:
            try:
                if leader:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def remaining():
        left = []
        for pid, leader in targets:
            if _group_members(pid) if leader else [pid] if _alive(pid) else []:
                left.append(pid)
        return left

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while remaining() and time.monotonic() < deadline:
        time.sleep(0.1)
    if remaining():
        send(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while remaining() and time.monotonic() < deadline:
            time.sleep(0.05)
    return [pid for pid, _ in targets]


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------

LAUNCHER = """\
# Generated by tests/support/swift.py: run one Swift WSGI server with ROOT/etc/swift.conf.
# Usage: launch.py KIND CONF [-v]   (KIND: account, container, object, proxy)
import os
import sys

from swift.common import utils

utils.SWIFT_CONF_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swift.conf")
utils.HASH_PATH_PREFIX = utils.HASH_PATH_SUFFIX = b""
utils.validate_configuration()

from swift.common import constraints, storage_policy  # noqa: E402

constraints.reload_constraints()
storage_policy.reload_storage_policies()

from swift.common.wsgi import run_wsgi  # noqa: E402

kind = sys.argv.pop(1)
kwargs = {}
if kind == "object":
    from swift.obj import server

    kwargs["global_conf_callback"] = server.global_conf_callback
conf_file, options = utils.parse_options()
sys.exit(run_wsgi(conf_file, kind + "-server", **kwargs, **options))
"""


def _default_section(root: Path, port: int, workers: int, user: str) -> str:
    return f"""\
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = {workers}
user = {user}
swift_dir = {root / "etc"}
devices = {root / "srv"}
mount_check = false
log_level = INFO
# give up quickly on a taken port (default 30 s): start() then retries with other free ports
bind_timeout = 5
"""


def _configs(root: Path, ports: dict[str, int], user: str) -> dict[str, str]:
    confs = {
        "swift.conf": f"""\
[swift-hash]
swift_hash_path_prefix = ckptfs-test-prefix
swift_hash_path_suffix = ckptfs-test-suffix

[storage-policy:0]
name = Policy-0
default = yes

[swift-constraints]
max_file_size = {MAX_FILE_SIZE}
""",
        "launch.py": LAUNCHER,
    }
    for kind in ("account", "container", "object"):
        extra = "mb_per_sync = 64\n" if kind == "object" else ""
        confs[f"{kind}-server.conf"] = (
            _default_section(root, ports[kind], WORKERS[kind], user)
            + f"""
[pipeline:main]
pipeline = healthcheck {kind}-server

[app:{kind}-server]
use = egg:swift#{kind}
{extra}
[filter:healthcheck]
use = egg:swift#healthcheck
"""
        )
    filters = {
        "catch_errors": "catch_errors",
        "gatekeeper": "gatekeeper",
        "healthcheck": "healthcheck",
        "proxy-logging": "proxy_logging",
        "listing_formats": "listing_formats",
        "bulk": "bulk",
        "tempurl": "tempurl",
        "ratelimit": "ratelimit",
        "copy": "copy",
        "container-quotas": "container_quotas",
        "account-quotas": "account_quotas",
        "dlo": "dlo",
        "versioned_writes": "versioned_writes",
        "symlink": "symlink",
    }
    simple = "".join(f"\n[filter:{name}]\nuse = egg:swift#{egg}\n" for name, egg in filters.items())
    confs["proxy-server.conf"] = (
        _default_section(root, ports["proxy"], WORKERS["proxy"], user)
        + f"""
[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats bulk tempurl ratelimit s3api tempauth copy container-quotas account-quotas slo dlo versioned_writes symlink proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
# one replica on a shared 2-core machine: be patient with a busy object server (fsync)
node_timeout = 60
recoverable_node_timeout = 60
conn_timeout = 5

[filter:s3api]
use = egg:swift#s3api
location = {REGION}
allow_multipart_uploads = true
max_upload_part_num = 10000
s3_acl = false

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = {SECRET_KEY} .admin

[filter:slo]
use = egg:swift#slo
max_manifest_segments = 10000

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:{ports["memcached"]}
"""  # noqa: E501 (a Swift pipeline is one line)
        + simple
    )
    return confs


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------


class SwiftServer(S3Endpoint):
    """A Swift + s3api node under `root`, listening on 127.0.0.1:`port` (0 = any free port)."""

    def __init__(self, root: Path | str, port: int = 0):
        self.root = Path(root).resolve()
        self.requested_port = int(port)
        self.port = int(port)
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.startup_seconds: float | None = None
        self.etc = self.root / "etc"
        self.logdir = self.root / "log"
        self.device = self.root / "srv" / "sdb1"

    # -- public -------------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT, stop_at_exit: bool = True) -> SwiftServer:
        """Start everything; return once all four servers answer /healthcheck with 200.

        With stop_at_exit (the default), the servers are also stopped when this Python process
        exits normally, should the caller forget to. The CLI passes False: its servers outlive it.
        """
        if self.procs:
            raise SwiftError(f"{self!r} is already started")
        t0 = time.monotonic()
        self._check_tools()
        for d in (self.etc, self.logdir, self.device, self.root / "run"):
            d.mkdir(parents=True, exist_ok=True)
        self._check_xattrs()
        attempts = 3 if self.requested_port == 0 else 1
        for attempt in range(attempts):
            self._pick_ports()
            self._write_configs()
            self._build_rings()
            try:
                self._spawn_all()
                self._wait_healthy(time.monotonic() + timeout)
            except SwiftError as e:
                self.stop()
                port_clash = "Could not bind to" in str(e) or "Address already in use" in str(e)
                if not port_clash or attempt == attempts - 1:
                    raise
            except BaseException:
                self.stop()
                raise
            else:
                break
        self.startup_seconds = time.monotonic() - t0
        if stop_at_exit:
            atexit.register(self.stop)
        return self

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every server this object started (by recorded PID / process group)."""
        if not self.procs:
            return
        order = ["proxy", "object", "container", "account", "memcached"]
        procs = [self.procs[k] for k in order if k in self.procs]
        terminate([p.pid for p in procs], _marker(self.root), grace)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = {}
        (self.root / "pids").unlink(missing_ok=True)
        atexit.unregister(self.stop)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def write_env(self) -> None:
        """Write ROOT/env: shell `export` lines pointing boto3 at this server."""
        env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env().items())
        _atomic_write(self.root / "env", env)

    def _write_pids(self) -> None:
        # ROOT/pids ("PID NAME" lines) exists from the moment the processes do, so that
        # `python -m tests.support.swift stop ROOT` can clean up even after an interrupted start.
        _atomic_write(self.root / "pids", "".join(f"{pid} {n}\n" for n, pid in self.pids().items()))

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for name in ("memcached",) + SERVER_KINDS:
            path = self.logdir / f"{name}.log"
            if path.exists():
                parts.append(f"--- {path} (last {lines} lines)\n{_tail(path, lines)}")
        return "\n".join(parts)

    def __enter__(self) -> SwiftServer:
        if not self.procs:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- steps --------------------------------------------------------------------------------

    def _check_tools(self) -> None:
        missing = [t for t in ("memcached", "swift-ring-builder", "swift-proxy-server") if not _which(t)]
        if missing:
            raise SwiftError(
                f"missing {', '.join(missing)}: install the Debian packages "
                f"(apt-get install -y {DEBIAN_PACKAGES})"
            )

    def _check_xattrs(self) -> None:
        probe = self.device / ".xattr-probe"
        try:
            probe.write_bytes(b"")
            os.setxattr(probe, "user.swift.probe", b"1")
            ok = os.getxattr(probe, "user.swift.probe") == b"1"
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                raise
            ok = False
        finally:
            probe.unlink(missing_ok=True)
        if not ok:
            raise SwiftError(
                f"the filesystem holding {self.device} does not support user extended attributes, "
                "which Swift's object server needs; put the Swift root on ext4/xfs "
                "(or a filesystem mounted with user_xattr), e.g. via TMPDIR"
            )

    def _pick_ports(self) -> None:
        names = ["memcached", "account", "container", "object"]
        if self.requested_port == 0:
            names.append("proxy")
        ports = free_ports(len(names) + (1 if self.requested_port else 0))
        ports = [p for p in ports if p != self.requested_port][: len(names)]
        self.ports = dict(zip(names, ports))
        if self.requested_port:
            self.ports["proxy"] = self.requested_port
        self.port = self.ports["proxy"]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _write_configs(self) -> None:
        user = pwd.getpwuid(os.getuid()).pw_name
        for name, text in _configs(self.root, self.ports, user).items():
            (self.etc / name).write_text(text)

    def _build_rings(self) -> None:
        builder = _which("swift-ring-builder")

        def build(kind: str) -> None:
            path = str(self.etc / f"{kind}.builder")
            for f in (self.etc / f"{kind}.builder", self.etc / f"{kind}.ring.gz"):
                f.unlink(missing_ok=True)
            steps = [
                ["create", "8", "1", "1"],
                ["add", f"r1z1-127.0.0.1:{self.ports[kind]}/sdb1", "100"],
                ["rebalance"],
            ]
            for args in steps:
                r = subprocess.run(
                    [builder, path, *args],
                    cwd=self.etc,
                    env=_server_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                # rebalance exits 1 for "warning" (e.g. balance not perfect); the ring is written
                if r.returncode not in (0, 1) or (r.returncode == 1 and args[0] != "rebalance"):
                    raise SwiftError(
                        f"swift-ring-builder {path} {' '.join(args)} failed ({r.returncode}):\n{r.stdout}"
                    )
            if not (self.etc / f"{kind}.ring.gz").exists():
                raise SwiftError(f"swift-ring-builder did not write {kind}.ring.gz")

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(build, ("account", "container", "object")))

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.logdir / f"{name}.log", "ab")
        try:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(argv)}\n".encode())
            log.flush()
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=self.root,
                env=_server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: Swift's SIGTERM handler kills its group
                close_fds=True,
            )
        finally:
            log.close()

    def _spawn_all(self) -> None:
        mc = [
            _which("memcached"),
            "-l",
            "127.0.0.1",
            "-p",
            str(self.ports["memcached"]),
            "-U",
            "0",
            "-m",
            "64",
            "-c",
            "1024",
            "-P",
            str(self.root / "run" / "memcached.pid"),
        ]
        if os.getuid() == 0:
            mc += ["-u", "root"]
        try:
            self._spawn("memcached", mc)
            python = _swift_python()
            for kind in SERVER_KINDS:
                conf = str(self.etc / f"{kind}-server.conf")
                self._spawn(kind, [python, str(self.etc / "launch.py"), kind, conf, "-v"])
        finally:
            self._write_pids()

    def _wait_healthy(self, deadline: float) -> None:
        pending = {k: f"http://127.0.0.1:{self.ports[k]}/healthcheck" for k in SERVER_KINDS}
        mc_up = False
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SwiftError(
                        f"Swift {name} server exited with status {p.returncode} during start-up\n"
                        + self.log_tails()
                    )
            if not mc_up:
                mc_up = _port_open(self.ports["memcached"])
            for kind, url in list(pending.items()):
                if _http_status(url, timeout=1.0) == 200:
                    del pending[kind]
            if mc_up and not pending:
                return
            if time.monotonic() > deadline:
                waiting = list(pending) + ([] if mc_up else ["memcached"])
                raise SwiftError(
                    f"Swift under {self.root} not healthy in time "
                    f"(still waiting for: {', '.join(waiting)})\n" + self.log_tails()
                )
            time.sleep(0.2)


def _which(tool: str) -> str | None:
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return shutil.which(tool, path=path)


def _swift_python() -> str:
    """The interpreter the Debian swift scripts use (their shebang), normally /usr/bin/python3."""
    script = _which("swift-proxy-server")
    if script:
        with open(script, "rb") as f:
            first = f.readline().decode("utf-8", "replace").strip()
        if first.startswith("#!"):
            parts = first[2:].split()
            if parts and os.path.basename(parts[0]) != "env" and os.access(parts[0], os.X_OK):
                return parts[0]
    return "/usr/bin/python3"


def _server_env() -> dict[str, str]:
    """The caller's environment minus anything that would steer the system python elsewhere."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYENV", "CONDA"))
    }
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def _marker(root: Path) -> str:
    """What every server command line under `root` contains (its config or pid file path)."""
    return str(root) + os.sep


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _read_pids(root: Path) -> list[int]:
    pids = []
    try:
        text = (root / "pids").read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0].isdigit():
            pids.append(int(fields[0]))
    return pids


def cmd_start(root: Path, port: int, timeout: float) -> int:
    root = root.resolve()
    if any(_alive(pid) and _marker(root) in _cmdline(pid) for pid in _read_pids(root)):
        print(f"swift: already running under {root} (see {root / 'pids'})", file=sys.stderr)
        return 1
    root.mkdir(parents=True, exist_ok=True)
    server = SwiftServer(root, port)

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # a SIGTERM/SIGHUP during start-up must still stop what was started
    old = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        server.start(timeout, stop_at_exit=False)
        server.write_env()
    except BaseException as e:
        server.stop()
        print(
            f"swift: start failed: {e!r}"
            if isinstance(e, KeyboardInterrupt)
            else f"swift: start failed: {e}",
            file=sys.stderr,
        )
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(f"swift: healthy at {server.endpoint} after {server.startup_seconds:.1f} s (root {root})")
    return 0


def cmd_stop(root: Path, grace: float, name: str = "swift") -> int:
    """Stop the processes ROOT/pids lists (also the RGW fixture's: tests/support/rgw.py)."""
    root = root.resolve()
    pids = _read_pids(root)
    if not pids:
        print(f"{name}: nothing to stop ({root / 'pids'} missing or empty)")
        return 0
    stopped = terminate(pids, _marker(root), grace)
    left = [p for p in pids if _alive(p) and _marker(root) in _cmdline(p)]
    if left:
        print(f"{name}: could not stop {left}", file=sys.stderr)
        return 1
    (root / "pids").unlink(missing_ok=True)
    print(f"{name}: stopped {len(stopped)} server(s) under {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.swift", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="start Swift under ROOT; write ROOT/env and ROOT/pids")
    p.add_argument("root", type=Path)
    p.add_argument("--port", type=int, default=0, help="proxy port (default: any free port)")
    p.add_argument("--timeout", type=float, default=START_TIMEOUT)
    p = sub.add_parser("stop", help="stop the servers listed in ROOT/pids")
    p.add_argument("root", type=Path)
    p.add_argument("--grace", type=float, default=STOP_GRACE)
    args = ap.parse_args(argv)
    if args.cmd == "start":
        return cmd_start(args.root, args.port, args.timeout)
    return cmd_stop(args.root, args.grace)


if __name__ == "__main__":
    sys.exit(main())
