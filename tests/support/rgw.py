"""A one-box Ceph cluster with the RADOS Gateway (S3) on 127.0.0.1, for tests and benchmarks.

The second real S3 server of the suite, beside Swift (tests/support/swift.py), started the same
way: everything under one root directory, every daemon in a process group of its own, stopped by
PID. One monitor, one OSD, one radosgw; no ceph-mgr, no cephadm, no systemd, no authentication
(the cluster listens on 127.0.0.1 only; RGW checks the S3 signatures itself).

    ROOT/ceph.conf   the cluster's configuration (fsid, ports, paths, the one-box settings)
    ROOT/mon         the monitor's store          ROOT/osd   the OSD's (memstore or bluestore)
    ROOT/log         one log per daemon           ROOT/run   admin sockets
    ROOT/pids        "PID NAME" lines             ROOT/env   `export` lines for boto3 and ckptfs

Use from Python::

    with RgwServer(root) as s3:
        s3.make_bucket("b")

or from a shell::

    python -m tests.support.rgw start ROOT [--objectstore bluestore]
    python -m tests.support.rgw stop ROOT

`memstore` (the default) keeps objects in the OSD's memory: the fastest start (about 5 s), for
tests that store little. `bluestore` keeps them in a sparse file under ROOT/osd (about 10 s to
start), for benchmarks. Measured facts and quirks: docs/machine-facts.md, "S3 servers".
"""

from __future__ import annotations

import argparse
import atexit
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.swift import (
    REGION,
    S3Endpoint,
    _alive,
    _atomic_write,
    _cmdline,
    _http_status,
    _marker,
    _read_pids,
    _server_env,
    _tail,
    _which,
    cmd_stop,
    free_ports,
    terminate,
)

ACCESS_KEY = "ckptfs-tester"
SECRET_KEY = "ckptfs-testing-secret"
START_TIMEOUT = 90.0
STOP_GRACE = 10.0
DEBIAN_PACKAGES = "radosgw ceph-mon ceph-osd"
TOOLS = ("ceph", "ceph-mon", "ceph-osd", "monmaptool", "radosgw", "radosgw-admin")
DAEMONS = ("mon", "osd", "rgw")
# RGW's pools, made before it starts: it would make them one by one, each a round of the
# monitor's consensus (17.7 s to start against 5 s, measured).
RGW_POOLS = (
    ".rgw.root",
    "default.rgw.control",
    "default.rgw.meta",
    "default.rgw.log",
    "default.rgw.buckets.index",
    "default.rgw.buckets.data",
    "default.rgw.buckets.non-ec",
)
BLUESTORE_BYTES = 64 * 1024**3  # the OSD's sparse block file (what is written takes space)
MEMSTORE_BYTES = 8 * 1024**3


class RgwError(RuntimeError):
    pass


class RgwServer(S3Endpoint):
    """One monitor, one OSD and a radosgw under `root`; S3 on 127.0.0.1:`port` (0: any free port)."""

    def __init__(self, root: Path | str, port: int = 0, objectstore: str = "memstore"):
        if objectstore not in ("memstore", "bluestore"):
            raise RgwError(f"objectstore {objectstore!r}: memstore or bluestore")
        self.root = Path(root).resolve()
        self.requested_port = int(port)
        self.objectstore = objectstore
        super().__init__("http://127.0.0.1:0", ACCESS_KEY, SECRET_KEY, REGION)
        self.procs: dict[str, subprocess.Popen] = {}
        self.startup_seconds: float | None = None
        self.deadline = 0.0  # when the start under way gives up (monotonic)
        self.conf = self.root / "ceph.conf"
        self.logdir = self.root / "log"

    # -- public -------------------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT, stop_at_exit: bool = True) -> RgwServer:
        """Make the cluster, start its daemons, create the S3 user; return once S3 answers."""
        if self.procs:
            raise RgwError(f"{self!r} is already started")
        t0 = time.monotonic()
        missing = [t for t in TOOLS if not _which(t)]
        if missing:
            raise RgwError(
                f"missing {', '.join(missing)}: install the Debian packages "
                f"(apt-get install -y --no-install-recommends {DEBIAN_PACKAGES}; scripts/setup --with-rgw)"
            )
        deadline = self.deadline = t0 + timeout  # (every step of the start within it)
        try:
            self._make_cluster()
            self._spawn("mon", [_which("ceph-mon"), "-f", "-i", "a", "-c", str(self.conf)])
            self._ceph("osd", "create")  # (osd.0: the monitor answers once it is up)
            (self.root / "osd" / "0").mkdir(exist_ok=True)
            self._ceph_tool([_which("ceph-osd"), "-i", "0", "--mkfs", "-c", str(self.conf)], deadline)
            self._spawn("osd", [_which("ceph-osd"), "-f", "-i", "0", "-c", str(self.conf)])
            for pool in RGW_POOLS:
                self._ceph("osd", "pool", "create", pool, "8")
                self._ceph("osd", "pool", "application", "enable", pool, "rgw")
            self._spawn("rgw", [_which("radosgw"), "-f", "-n", "client.rgw", "-c", str(self.conf)])
            self._wait_healthy(deadline)
            self._admin(
                "user", "create", "--uid", "ckptfs", "--display-name", "ckptfs tests",
                "--access-key", self.access_key, "--secret", self.secret_key,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        if stop_at_exit:
            atexit.register(self.stop)
        return self

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every daemon this object started (radosgw first), by PID and process group."""
        if not self.procs:
            return
        procs = [self.procs[k] for k in ("rgw", "osd", "mon") if k in self.procs]
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
        _atomic_write(
            self.root / "env", "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env().items())
        )

    def log_tails(self, lines: int = 25) -> str:
        return "\n".join(
            f"--- {path} (last {lines} lines)\n{_tail(path, lines)}"
            for path in sorted(self.logdir.glob("*.log"))
        )

    def __enter__(self) -> RgwServer:
        if not self.procs:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- steps --------------------------------------------------------------------------------
    def _make_cluster(self) -> None:
        for d in (self.root, self.logdir, self.root / "run", self.root / "mon", self.root / "osd"):
            d.mkdir(parents=True, exist_ok=True)
        mon_port, rgw_port = free_ports(2)
        self.port = self.requested_port or rgw_port
        self.endpoint = f"http://127.0.0.1:{self.port}"
        fsid = str(uuid.uuid4())
        _atomic_write(self.conf, self._config(fsid, mon_port))
        monmap = self.root / "monmap"
        self._ceph_tool(
            [_which("monmaptool"), "--create", "--clobber", "--fsid", fsid,
             "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", str(monmap)],
            time.monotonic() + 30,
        )  # fmt: skip
        self._ceph_tool(
            [_which("ceph-mon"), "--mkfs", "-i", "a", "--monmap", str(monmap), "-c", str(self.conf)],
            time.monotonic() + 30,
        )

    def _config(self, fsid: str, mon_port: int) -> str:
        root = self.root
        store = (
            f"osd objectstore = bluestore\nbluestore block create = true\n"
            f"bluestore block size = {BLUESTORE_BYTES}\nbluestore fsck on mkfs = false\n"
            if self.objectstore == "bluestore"
            else f"osd objectstore = memstore\nmemstore device bytes = {MEMSTORE_BYTES}\n"
        )
        return f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port}]
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
paxos propose interval = 0.01
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
mon cluster log to file = false
mon cluster log file = {root}/log/cluster.log
crash dir = {root}/crash
mon data = {root}/mon/$id
osd data = {root}/osd/$id
keyring = /dev/null
{store}
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{self.port}
rgw data = {root}/rgw
rgw dns name = 127.0.0.1
"""

    def _spawn(self, name: str, argv: list) -> None:
        with open(self.logdir / f"{name}.out", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(a) for a in argv],
                cwd=self.root,
                env=_server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        _atomic_write(self.root / "pids", "".join(f"{pid} {n}\n" for n, pid in self.pids().items()))

    def _ceph_tool(self, argv: list, deadline: float) -> str:
        done = subprocess.run(
            [str(a) for a in argv],
            cwd=self.root,
            env=_server_env(),
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        if done.returncode:
            raise RgwError(
                f"{shlex.join(map(str, argv))} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            )
        return done.stdout

    def _ceph(self, *args: str) -> str:
        return self._ceph_tool(
            [_which("ceph"), "-c", str(self.conf), "--connect-timeout", "30", *args], self.deadline
        )

    def _admin(self, *args: str) -> str:
        return self._ceph_tool(
            [_which("radosgw-admin"), "-c", str(self.conf), "-n", "client.rgw", *args], self.deadline
        )

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RgwError(
                        f"ceph {name} exited with status {p.returncode} during start-up\n{self.log_tails()}"
                    )
            if _http_status(self.endpoint + "/", timeout=1.0) == 200:
                return
            if time.monotonic() > deadline:
                raise RgwError(f"radosgw under {self.root} did not answer in time\n{self.log_tails()}")
            time.sleep(0.2)


# -- CLI ----------------------------------------------------------------------------------------
def cmd_start(root: Path, port: int, objectstore: str, timeout: float) -> int:
    root = root.resolve()
    if any(_alive(pid) and _marker(root) in _cmdline(pid) for pid in _read_pids(root)):
        print(f"rgw: already running under {root} (see {root / 'pids'})", file=sys.stderr)
        return 1
    server = RgwServer(root, port, objectstore)
    try:
        server.start(timeout, stop_at_exit=False)
        server.write_env()
    except (RgwError, OSError, subprocess.SubprocessError, KeyboardInterrupt) as e:
        server.stop()
        print(f"rgw: start failed: {e}", file=sys.stderr)
        return 1
    print(f"rgw: answering at {server.endpoint} after {server.startup_seconds:.1f} s (root {root})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.rgw", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "start", help="start a one-box Ceph + radosgw under ROOT; write ROOT/env and ROOT/pids"
    )
    p.add_argument("root", type=Path)
    p.add_argument("--port", type=int, default=0, help="S3 port (default: any free port)")
    p.add_argument("--objectstore", choices=("memstore", "bluestore"), default="memstore")
    p.add_argument("--timeout", type=float, default=START_TIMEOUT)
    p = sub.add_parser("stop", help="stop the daemons listed in ROOT/pids")
    p.add_argument("root", type=Path)
    p.add_argument("--grace", type=float, default=STOP_GRACE)
    args = ap.parse_args(argv)
    if args.cmd == "start":
        return cmd_start(args.root, args.port, args.objectstore, args.timeout)
    return cmd_stop(args.root, args.grace, "rgw")


if __name__ == "__main__":
    sys.exit(main())
