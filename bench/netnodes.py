"""Simulated nodes for the cluster scenario (bench/cluster.py): network namespaces on this machine.

Node I is the namespace ``ckbnI`` with two links:
  - to the store: a veth pair ckbnIh (host, 10.232.I.1/30) - ckbnIn (node, 10.232.I.2/30), capped
    by a tbf qdisc at ``rate`` (tc's units) on both ends. A forwarder (a thread here) listens on
    10.232.I.1 and relays to the S3 server on 127.0.0.1, which the node cannot reach; it counts
    the bytes the server sent to the node (``Forwarder.served``).
  - to the other nodes: a veth pair ckbnIp (host) - ckbnIq (node, 10.233.0.(10+I)/24), the host
    end a port of the bridge ckbbr0 (10.233.0.1/24). Not capped.
Processes run in a node through ``nsenter --net=`` only (``Node.prefix``): the mount namespace
stays the host's, so a FUSE mount a daemon makes there is seen here (``ip netns exec`` would
remount /sys in a mount namespace of its own).

Every namespace and the bridge is recorded in /run/ckptfs-bench-netns/NAME (the bench's PID)
before it is made; ``Nodes.stop`` removes what it made, and a later bench reclaims what a dead
one left (a name recorded by a live process is never touched).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

RECORDS = Path("/run/ckptfs-bench-netns")
BRIDGE = "ckbbr0"
BRIDGE_IP = "10.233.0.1"


def rate_bytes(rate: str) -> float:
    """tc's rate ("400mbit", "50mbps", ...) in bytes per second."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"not a rate in tc's units: {rate!r} (e.g. 400mbit, 50mbps)")
    scale = 1000 ** " kmgt".index(m.group(2) or " ")
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def _exists(name: str) -> bool:
    return Path(f"/run/netns/{name}").exists() or _ip("ip", "link", "show", name, check=False).returncode == 0


def _owner(name: str) -> int | None:
    """The PID recorded for ``name`` if that process still runs (None: no record, or it is dead)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((RECORDS / name).read_text().split()[0])
        if Path(f"/proc/{pid}").exists():
            return pid
    return None


def _sweep() -> None:
    """Remove every namespace and bridge whose bench is dead (killed before its cleanup)."""
    for record in RECORDS.glob("ckb*") if RECORDS.is_dir() else ():
        if _owner(record.name) is None:
            _remove(record.name)


def _claim(name: str) -> None:
    """Record ``name`` as ours; remove what a dead bench left under that name first."""
    record = RECORDS / name
    pid = _owner(name)
    if pid is not None and pid != os.getpid():
        raise RuntimeError(f"{name} belongs to a running bench (pid {pid}); try again after it")
    if _exists(name) and not record.exists():
        raise RuntimeError(f"{name} exists and is not the bench's: remove it or let its owner do so")
    _remove(name)
    RECORDS.mkdir(parents=True, exist_ok=True)
    record.write_text(f"{os.getpid()}\n")


def _remove(name: str) -> None:
    """The namespace (or bridge) ``name``, its veths and its record."""
    if name == BRIDGE:
        _ip("ip", "link", "del", name, check=False)
    else:
        for end in ("h", "p"):  # (deleting the host end deletes the pair)
            _ip("ip", "link", "del", f"{name}{end}", check=False)
        _ip("ip", "netns", "del", name, check=False)
    (RECORDS / name).unlink(missing_ok=True)


class Forwarder:
    """TCP from ``listen`` (host, port 0: any) to ``upstream``; counts upstream -> client bytes."""

    def __init__(self, host: str, upstream: tuple[str, int]):
        self.upstream = upstream
        self.served = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server((host, 0))
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True, name=f"fwd {host}").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            self._socks |= {client, server}
        up = threading.Thread(target=self._pump, args=(client, server, False), daemon=True)
        up.start()
        self._pump(server, client, True)
        up.join()
        with self._lock:
            self._socks -= {client, server}
        client.close()
        server.close()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        buf = bytearray(256 << 10)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
                if count:
                    with self._lock:
                        self.served += n
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@dataclass
class Node:
    index: int
    name: str
    store_ip: str  # the host end of the store link: the forwarder listens there
    peer_ip: str  # the node's address on the bridge
    forwarder: Forwarder | None = None
    made: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        host, port = self.forwarder.address
        return f"http://{host}:{port}"

    @property
    def prefix(self) -> list[str]:
        """Run a command in this node: ``[*node.prefix, argv...]`` (the host's mount namespace)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--"]


class Nodes:
    """``count`` nodes, each with a capped link to ``upstream`` (the S3 server) and an uncapped
    one to the others; ``stop`` (also after a failed start) removes everything it made."""

    def __init__(self, count: int, rate: str, upstream: tuple[str, int]):
        for tool in ("ip", "tc", "nsenter"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the cluster scenario needs `{tool}` (iproute2, util-linux)")
        if os.geteuid() != 0:
            raise RuntimeError("the cluster scenario needs root (network namespaces, tc)")
        rate_bytes(rate)  # (a clear error for a bad rate)
        self.rate, self.upstream = rate, upstream
        self.nodes = [Node(i, f"ckbn{i}", f"10.232.{i}.1", f"10.233.0.{10 + i}") for i in range(count)]
        self._made: list[str] = []

    def start(self) -> Nodes:
        try:
            _sweep()
            _claim(BRIDGE)
            self._made.append(BRIDGE)
            _ip("ip", "link", "add", BRIDGE, "type", "bridge")
            _ip("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
            _ip("ip", "link", "set", BRIDGE, "up")
            for node in self.nodes:
                self._make(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _make(self, node: Node) -> None:
        name, i = node.name, node.index
        _claim(name)
        self._made.append(name)
        _ip("ip", "netns", "add", name)
        _ip("ip", "-n", name, "link", "set", "lo", "up")
        # the store link, capped both ways
        _ip("ip", "link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n", "netns", name)
        _ip("ip", "addr", "add", f"{node.store_ip}/30", "dev", f"{name}h")
        _ip("ip", "link", "set", f"{name}h", "up")
        _ip("ip", "-n", name, "addr", "add", f"10.232.{i}.2/30", "dev", f"{name}n")
        _ip("ip", "-n", name, "link", "set", f"{name}n", "up")
        tbf = ("root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "50ms")
        _ip("tc", "qdisc", "add", "dev", f"{name}h", *tbf)
        _ip("tc", "-n", name, "qdisc", "add", "dev", f"{name}n", *tbf)
        # the peer link, on the bridge
        _ip("ip", "link", "add", f"{name}p", "type", "veth", "peer", "name", f"{name}q", "netns", name)
        _ip("ip", "link", "set", f"{name}p", "master", BRIDGE)
        _ip("ip", "link", "set", f"{name}p", "up")
        _ip("ip", "-n", name, "addr", "add", f"{node.peer_ip}/24", "dev", f"{name}q")
        _ip("ip", "-n", name, "link", "set", f"{name}q", "up")
        node.forwarder = Forwarder(node.store_ip, self.upstream)

    def served(self) -> list[int]:
        """Bytes the store sent to each node so far."""
        return [n.forwarder.served if n.forwarder else 0 for n in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            if node.forwarder is not None:
                node.forwarder.stop()
                node.forwarder = None
        while self._made:
            _remove(self._made.pop())
