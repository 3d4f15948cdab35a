"""Restore once per cluster (``--cluster``, ckptfs/cluster/peers.py), with real mounts, real
``torch.load`` and real peers over mutual TLS: each node of tests/support/cluster.py has its
own mount, cache dir, RAM tier and link to the store. Both stores (``cluster`` fixture).

- N nodes restoring one checkpoint at once, and one after another: every node reads the same
  bytes, and the store sends about the checkpoint's size in all (the nodes' own count of what
  the store sent, and on S3 the proxies' count of what they passed);
- a peer lost (kill -9) mid-restore costs a retry from the store, not a failed or stalled read;
- a peer that answers with flipped bytes (a rogue member this test runs, with a certificate
  published in the store) is caught: the read returns the right bytes, from the store;
- a client without a member's certificate gets nothing from the peer port.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptfs.cluster import peer_tls
from ckptfs.cluster.members import BEAT_S, PREFIX
from ckptfs.cluster.peer_channel import PeerServer, Served
from tests.support.harness import wait_until
from tests.support.mounting import ckptfs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
CLUSTER = ("--cluster",)
SLACK = 1.10  # the store may send at most this much of the checkpoint's size in all

SAVE = """
import hashlib, sys, torch
size, seed = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(seed)
n = size // 4 // 8
sd = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(8)}
torch.save(sd, sys.argv[1])
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].numpy().tobytes())
print(h.hexdigest())
"""
LOAD = """
import hashlib, sys, torch
f = open(sys.argv[1], "rb")
if len(sys.argv) > 2:  # read a first piece, say so, and wait for a line before the rest
    f.read(int(sys.argv[2])); f.seek(0)
    print("started", flush=True); sys.stdin.readline()
sd = torch.load(f, weights_only=True)
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].numpy().tobytes())
print(h.hexdigest())
"""


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, **kwargs
    )


def _result(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exited {proc.returncode}: {(err or '')[-2000:]}"
    return out.strip().splitlines()[-1]


def _checkpoint(cluster, size: int) -> tuple[str, int]:
    """A checkpoint of about ``size`` bytes saved through a plain mount and synced: its digest
    and its size in the store."""
    writer = cluster.node("writer")
    path = writer.path / "ckpt" / "model.pt"
    path.parent.mkdir()
    digest = _result(_python(SAVE, str(path), str(size), "7"))
    writer.sync()
    return digest, path.stat().st_size


def _members(cluster, names: list[str], more: dict[str, tuple[str, ...]] | None = None, **kwargs) -> list:
    """Nodes ``names`` that see each other (``more``: a node's own extra mount arguments)."""
    more = more or {}
    nodes = [cluster.node(name, extra=(*CLUSTER, *more.get(name, ())), **kwargs) for name in names]
    for node in nodes:  # (a node that has not seen the others yet would fetch their parts itself)
        wait_until(
            lambda node=node: len(node.status()["peers"]["live"]) == len(nodes) - 1,
            30,
            what=f"{node.name} to see its {len(nodes) - 1} peers",
        )
    return nodes


def _store_sent(nodes) -> int:
    return sum(node.status()["store_read_bytes"] for node in nodes)


def _proxies_sent(nodes) -> int | None:
    proxies = [node.proxy for node in nodes]
    return None if None in proxies else sum(p.sent_bytes for p in proxies)


def test_four_nodes_restore_at_once_read_the_store_once(cluster):
    digest, size = _checkpoint(cluster, 256 * MiB)
    nodes = _members(cluster, ["a", "b", "c", "d"])
    before = _proxies_sent(nodes)
    readers = [_python(LOAD, str(node.path / "ckpt" / "model.pt")) for node in nodes]
    assert [_result(r) for r in readers] == [digest] * 4
    sent = _store_sent(nodes)
    assert sent <= SLACK * size, f"the store sent {sent / size:.2f}x the checkpoint"
    if before is not None:  # S3: what the proxies passed (listings, records and manifests too)
        through = _proxies_sent(nodes) - before
        assert through <= SLACK * size, f"the proxies passed {through / size:.2f}x the checkpoint"
    peers = [node.status()["peers"] for node in nodes]
    assert sum(p["taken_bytes"] for p in peers) >= 2 * size  # (each node took most of it from others)
    assert not any(p["mismatches"] or p["asks_failed"] for p in peers)

    def balanced() -> bool:  # (a server counts a slice just after sending it: the asker may be first)
        peers = [node.status()["peers"] for node in nodes]
        return sum(p["served_bytes"] for p in peers) == sum(p["taken_bytes"] for p in peers)

    wait_until(balanced, 10, what="what peers served to equal what they took")


def test_staggered_restores_read_the_store_once(cluster):
    digest, size = _checkpoint(cluster, 64 * MiB)
    nodes = _members(cluster, ["a", "b", "c"])
    # one after another: the parts the first readers' owners fetched stay cached; b warms up
    # (`ckptfs warmup` takes the same path as a read) before loading
    ckptfs("warmup", str(nodes[1].path))
    for node in nodes:
        assert _result(_python(LOAD, str(node.path / "ckpt" / "model.pt"))) == digest
    sent = _store_sent(nodes)
    assert sent <= SLACK * size, f"the store sent {sent / size:.2f}x the checkpoint"


def test_a_peer_lost_mid_restore_costs_a_retry(cluster):
    digest, size = _checkpoint(cluster, 96 * MiB)
    # (a reads through its daemon as it fetches, so the read can pause with the rest to come:
    # fetched whole at the open it would have it all before b is lost; its read-ahead, as many
    # blocks as --upload-concurrency, kept to 2 of the 12, so that on a loaded machine it has
    # not taken every part of b's before b is lost)
    a, b, c = _members(
        cluster, ["a", "b", "c"], more={"a": ("--fetch-whole", "0", "--upload-concurrency", "2")}
    )
    if b.proxy is not None:  # S3: b's link is slow, so b's fetches for a are on the wire when it dies
        b.proxy.rate = 20 * MiB
    reader = _python(LOAD, str(a.path / "ckpt" / "model.pt"), str(4 * MiB), stdin=subprocess.PIPE)
    assert reader.stdout.readline().strip() == "started"
    wait_until(
        lambda: a.status()["peers"]["taken_bytes"] > 0 or b.status()["peers"]["requests_served"] > 0, 60
    )
    b.lose()
    started = time.monotonic()
    reader.stdin.write("go\n")
    reader.stdin.flush()
    assert _result(reader) == digest
    took = time.monotonic() - started
    status = a.status()
    assert status["integrity_errors"] == [] and not status["errors"]
    # b's parts came from the store after one failed ask each (connection refused or broken
    # off), never after a read timeout (60 s): a bound on the stall, generous for a loaded VM
    assert took < 45, f"the read stalled {took:.0f} s after the peer was lost"
    # the race was hit: a asked b after b was lost (refused, or broken off mid-ask), and read
    # that part from the store
    assert status["peers"]["asks_failed"] >= 1, status["peers"]
    wait_until(lambda: len(a.status()["peers"]["live"]) == 1, 30, what="a to drop b from its peers")
    # c still reads, with a as its only peer
    assert _result(_python(LOAD, str(c.path / "ckpt" / "model.pt"))) == digest


class RoguePeer:
    """A member of the cluster that answers every ask with the right part, one byte flipped:
    its certificate is published in the store like any node's (a holder of the store
    credentials gone bad, or a bit flipped in a peer's memory)."""

    def __init__(self, cluster, node, data: bytes, trusted: bytes, root: Path, shows=None):
        root.mkdir(mode=0o700)
        self.id = secrets.token_hex(8)
        self.identity = peer_tls.Identity(root, self.id)  # (the certificate its record publishes)
        shown = shows or self.identity  # (the one its server presents: ``shows``, never published)
        self.data, self.cluster, self.node = data, cluster, node
        self.asked = 0
        self.server = PeerServer(
            lambda: shown.context(True, [trusted]),
            lambda fingerprint: True,
            self._gather,
            lambda release: release(),
            4,
        )
        self.port = self.server.start("127.0.0.1", 0)
        self.stop = threading.Event()
        self._publish()
        self.beat = threading.Thread(target=self._beat, daemon=True)
        self.beat.start()

    def _gather(self, request: dict) -> concurrent.futures.Future:
        self.asked += 1
        begin, span = request["begin"], request["span"]
        part = bytearray(self.data[begin : begin + span])
        part[span // 2] ^= 0x01
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(Served([(lambda sock: sock.sendall(part), span)], lambda: None))
        return future

    def _publish(self) -> None:
        body = json.dumps(
            {"node": self.id, "host": "127.0.0.1", "port": self.port, "cert": self.identity.cert_pem.decode()}
        ).encode()
        key = f"{PREFIX}{self.id}.json"
        if self.node.proxy is not None:
            self.node.put_through_link(key, body)
        else:  # (the local store keeps an object as a file under its key: its mtime is the beat)
            path = Path(self.cluster.directory) / key
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(body)

    def _beat(self) -> None:
        while not self.stop.wait(BEAT_S):
            self._publish()

    def close(self) -> None:
        self.stop.set()
        self.beat.join()
        self.server.stop()


def test_a_peer_sending_flipped_bytes_is_caught(cluster, tmp_path):
    writer = cluster.node("writer")
    data = secrets.token_bytes(48 * MiB)
    (writer.path / "model.bin").write_bytes(data)
    writer.sync()
    a = cluster.node("a", extra=CLUSTER)
    cert = peer_tls.Identity(Path(a.mount.cache_dir), "unused").cert_pem  # (a's, kept in its cache dir)
    rogue = RoguePeer(cluster, a, data, cert, tmp_path / "rogue")
    try:
        wait_until(lambda: len(a.status()["peers"]["live"]) == 1, 30, what="a to see the rogue peer")
        assert (a.path / "model.bin").read_bytes() == data
    finally:
        rogue.close()
    status = a.status()
    assert rogue.asked >= 1 and status["peers"]["mismatches"] >= 1
    assert status["peer_read_bytes"] == 0 and status["integrity_errors"] == []


def test_no_member_certificate_gets_nothing(cluster, tmp_path):
    writer = cluster.node("writer")
    (writer.path / "secret.bin").write_bytes(secrets.token_bytes(2 * MiB))
    writer.sync()
    a, b = _members(cluster, ["a", "b"])
    host, port = a.status()["peers"]["addr"].rsplit(":", 1)
    request = json.dumps(
        {"url": "x", "key": "secret.bin", "size": 2 * MiB, "tag": "", "begin": 0, "span": MiB}
    )

    def plain() -> bytes:  # no TLS at all: a request in the clear
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(len(request).to_bytes(4, "big") + request.encode())
            return _read_all(s)

    def tls(identity) -> bytes:  # TLS, with a certificate no member published (or none)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if identity is not None:
            ctx.load_cert_chain(identity.cert_path, identity.key_path)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            try:
                with ctx.wrap_socket(raw) as s:
                    s.sendall(len(request).to_bytes(4, "big") + request.encode())
                    return _read_all(s)
            except (ssl.SSLError, OSError):
                return b""

    stranger = tmp_path / "stranger"
    stranger.mkdir(mode=0o700)
    # (at most a TLS alert comes back: a few bytes, never a header or a part)
    assert len(plain()) < 64
    assert len(tls(None)) < 64
    assert len(tls(peer_tls.Identity(stranger, "stranger"))) < 64
    # (counted by the server thread just after its alert went out: the client may be first)
    wait_until(lambda: a.status()["peers"]["refused_clients"] >= 3, 10, what="the 3 refusals counted")
    assert (b.path / "secret.bin").stat().st_size == 2 * MiB  # members still talk


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_peer_tls_is_1_3_both_ends_check_and_the_record_holds_no_key(cluster, tmp_path):
    """The peer channel's security as a node runs it: a member's connection is TLS 1.3, a TLS 1.2
    client (with a member's certificate) is refused; a node asking a member whose server
    presents a certificate that was never published (a rogue at a member's address) refuses it
    and reads from the store, counted; a node's record in the store holds its certificate and no
    key; its key is made once (the same across a remount with the same cache dir)."""
    writer = cluster.node("writer")
    data = secrets.token_bytes(8 * MiB)
    (writer.path / "model.bin").write_bytes(data)
    writer.sync()
    a, b = _members(cluster, ["a", "b"])
    a_dir, b_dir = Path(a.mount.cache_dir), Path(b.mount.cache_dir)
    a_cert = (a_dir / peer_tls.CERT_FILE).read_bytes()
    b_identity = peer_tls.Identity(b_dir, "unused")  # (b's key and certificate, from its cache dir)
    host, port = a.status()["peers"]["addr"].rsplit(":", 1)

    def handshake(ctx: ssl.SSLContext) -> str:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with ctx.wrap_socket(raw) as tls:
                return str(tls.version())

    # TLS 1.3 between members; TLS 1.2 refused by the server even with b's certificate
    assert handshake(b_identity.context(False, [a_cert])) == "TLSv1.3"
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.check_hostname = False
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    old.load_cert_chain(b_identity.cert_path, b_identity.key_path)
    old.load_verify_locations(cadata=a_cert.decode())
    with pytest.raises(ssl.SSLError):
        handshake(old)

    # a's record in the store: its certificate, no key
    node = a.status()["peers"]["node"]
    raw_record = cluster.store.read(f"{PREFIX}{node}.json")
    record = json.loads(raw_record)
    assert record["cert"].encode() == a_cert and peer_tls.valid_cert(a_cert)
    key = (a_dir / peer_tls.KEY_FILE).read_bytes()
    assert b"PRIVATE" not in raw_record and key.strip() not in raw_record
    assert b"PRIVATE" in key  # (what was looked for is what the key file holds)

    # the asking side: a member's record whose address serves another, unpublished certificate
    b.stop()  # (a's only peer: the rogue)
    rogue = RoguePeer(
        cluster,
        a,
        data,
        a_cert,
        tmp_path / "rogue",
        shows=peer_tls.Identity(_private(tmp_path / "unpublished"), "x"),
    )
    try:
        wait_until(
            lambda: [m["node"] for m in a.status()["peers"]["live"]] == [rogue.id],
            30,
            what="a to see the rogue",
        )
        assert (a.path / "model.bin").read_bytes() == data
    finally:
        rogue.close()
    peers = a.status()["peers"]
    assert peers["asks_failed"] >= 1 and peers["taken_bytes"] == 0, peers
    assert rogue.server.requests == 0 and rogue.asked == 0  # (no request got through)

    # the key is made once: a remount with the same cache dir keeps it and its certificate
    a.stop()
    a.start()
    assert (a_dir / peer_tls.KEY_FILE).read_bytes() == key
    record = json.loads(cluster.store.read(f"{PREFIX}{a.status()['peers']['node']}.json"))
    assert record["cert"].encode() == a_cert


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def _read_all(sock) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ssl.SSLError, OSError):
        pass
    return out


@pytest.mark.skipif(not os.environ.get("CKPTFS_LONG"), reason="long mode (scripts/test --long)")
@pytest.mark.timeout(5400)
def test_peer_loss_torture(cluster):
    """Four nodes restore one checkpoint again and again, each round from cold caches on
    every reader (the nodes are replaced); in each round a random node (or none) is killed at a
    random moment of the restore, sometimes with its link slowed first (S3). Every surviving
    reader must get the checkpoint's bytes, with no integrity error, every round
    (``CKPTFS_PEER_LOSSES`` losses, ``CKPTFS_TORTURE_SEED``)."""
    import random

    losses_wanted = int(os.environ.get("CKPTFS_PEER_LOSSES", "50"))
    rng = random.Random(int(os.environ.get("CKPTFS_TORTURE_SEED", "30")))
    digest, _ = _checkpoint(cluster, 48 * MiB)
    made, losses, rounds = 0, 0, 0
    while losses < losses_wanted:
        names = [f"r{made + i}" for i in range(4)]
        made += 4
        nodes = _members(cluster, names)
        victim = rng.choice(nodes)
        if victim.proxy is not None and rng.random() < 0.5:
            victim.proxy.rate = 10 * MiB
        readers = {
            node.name: _python(
                LOAD,
                str(node.path / "ckpt" / "model.pt"),
                str(MiB),
                stdin=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for node in nodes  # (the victim's reader fails: ENOTCONN; the others' errors show in _result)
        }
        for reader in readers.values():
            assert reader.stdout.readline().strip() == "started"
        for reader in readers.values():
            reader.stdin.write("go\n")
            reader.stdin.flush()
        time.sleep(rng.uniform(0.0, 2.0))
        victim.lose()
        losses += 1
        for node in nodes:
            if node is victim:
                readers[node.name].kill()
                readers[node.name].wait()
                continue
            assert _result(readers[node.name]) == digest, f"round {rounds}: {node.name} read other bytes"
            assert node.status()["integrity_errors"] == [], f"round {rounds}: {node.name}"
        for node in nodes:
            if node is not victim:
                node.stop()
        rounds += 1
    print(
        f"peer-loss torture: {losses} losses over {rounds} rounds, every surviving reader read the checkpoint"
    )
