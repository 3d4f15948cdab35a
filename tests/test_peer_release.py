"""An owner lets go of the blocks it pinned for an asker that left mid-ask, through ckptfs's own
path (cluster/peers.py: ``PeerCache._serve`` pins them with ``cache.incref``, ``_answer`` and
``_release`` let them go; cluster/peer_channel.py's ``PeerServer`` notices the asker gone), on
a real mount: node a (``--cluster``) serves, the asker is this test speaking the peer protocol
over TLS with node b's certificate (a member's, published in the store by b itself), and leaves
by resetting its connection:

- before a answered (a's GET of the part held at its S3 proxy, so a is still fetching);
- after a answered, mid-transfer (the asker stops reading, so a's send of the 8 MiB part blocks);
- mid-transfer again, while a is unmounted (``ckptfs umount``): the peer server is stopped
  before the cache closes, every serving thread ends, the daemon exits cleanly.

What a pinned for peers shows in its status (``peers.pinned_blocks`` now, ``pinned_blocks_total``
in all), as do the asks broken off (``asks_broken_off``). S3 only: holding a's fetch needs its
proxy (a local store's link holds only changes).
"""

from __future__ import annotations

import json
import secrets
import socket
import struct
from pathlib import Path

import pytest

from ckptfs.cluster import peer_tls
from ckptfs.objects import integrity
from ckptfs.store import open_store
from tests.support.faultproxy import Rule, hold
from tests.support.harness import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MiB = 1 << 20
KEY = "model.bin"


class Asker:
    """One ask of node ``a``'s peer port with a member's certificate, by hand: the request, then
    as much of the answer as the test wants, then a reset (SO_LINGER 0: the asker vanished)."""

    def __init__(self, host: str, port: int, ctx, request: dict):
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # a small receive window: a part does not fit in the socket buffers, so a's send blocks
        # until this side reads (the "mid-transfer" of a part)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.settimeout(10)
        raw.connect((host, port))
        self.tls = ctx.wrap_socket(raw)
        body = json.dumps(request).encode()
        self.tls.sendall(len(body).to_bytes(4, "big") + body)

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.tls.recv(n - len(out))
            assert chunk, "the owner broke off"
            out += chunk
        return out

    def answer_kind(self) -> bytes:
        """The first answer byte other than a keepalive (W)."""
        while (kind := self.recv_exact(1)) == b"W":
            pass
        return kind

    def drain(self, timeout: float) -> int:
        """Read until the connection ends (or breaks); the bytes read."""
        got = 0
        self.tls.settimeout(timeout)
        try:
            while chunk := self.tls.recv(1 << 20):
                got += len(chunk)
        except OSError:  # (ssl.SSLError too: a reset, or the TLS stream cut short)
            pass
        return got

    def vanish(self) -> None:
        self.tls.close()  # (SO_LINGER 0: a reset, unread bytes dropped)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_an_owner_lets_go_of_what_it_pinned_for_an_asker_that_left(cluster):
    b = cluster.node("b", extra=("--cluster",))
    data = secrets.token_bytes(16 * MiB)  # two 8 MiB parts, each one block of a's cache
    (b.path / KEY).write_bytes(data)
    b.sync()
    a = cluster.node("a", extra=("--cluster",))
    wait_until(lambda: len(a.status()["peers"]["live"]) == 1, 30, what="a to see b")

    # the ask, as a member makes it (transfer/fetcher.py's _ask_peer): the version and the
    # first part from the object's recorded checksums
    backend = open_store(cluster.store.url, cluster.endpoint)
    info = backend.head(KEY)
    assert info is not None
    checks = integrity.load_checksums(backend, info.size, info.metadata)
    begin, span = checks.span(0, 1)
    status = a.status()
    blocks = -(-span // status["part_size"])  # (a's block size is its part size)
    assert checks.verified and span >= 8 * MiB and blocks >= 1
    request = {
        "url": a.store_url,
        "key": KEY,
        "size": len(data),
        "tag": checks.version,
        "begin": begin,
        "span": span,
        "fetch": True,
    }
    host, port = status["peers"]["addr"].rsplit(":", 1)
    b_identity = peer_tls.Identity(Path(b.mount.cache_dir), "unused")  # (b's key, from its cache dir)
    a_cert = (Path(a.mount.cache_dir) / peer_tls.CERT_FILE).read_bytes()
    ctx = b_identity.context(False, [a_cert])

    def peers() -> dict:
        return a.status()["peers"]

    assert peers()["pinned_blocks"] == 0 and peers()["pinned_blocks_total"] == 0

    # 1. The asker leaves before a answered: a is fetching the part (its GET held at its proxy)
    rule = a.proxy.add_rule(Rule(hold(), kind="get", path=KEY))
    try:
        asker = Asker(host, int(port), ctx, request)
        assert asker.recv_exact(1) == b"W"  # (a is working on it)
        rule.wait_held(30)
        asker.vanish()
        # a's server thread finds the asker gone (its next keepalive fails) and cancels the ask
        wait_until(lambda: peers()["asks_broken_off"] == 1, 30, what="a to find the asker gone")
        assert peers()["pinned_blocks_total"] == 0  # (nothing gathered yet)
    finally:
        rule.release()
        a.proxy.remove_rule(rule)
    # the fetch ends: _serve pins the part's blocks, _answer finds the ask cancelled and lets go
    wait_until(lambda: peers()["pinned_blocks_total"] == blocks, 30, what="a to gather the part")
    assert peers()["pinned_blocks"] == 0, peers()
    assert peers()["served_bytes"] == 0

    # 2. The asker leaves after a answered, mid-transfer (a holds the part now: it answers at once)
    asker = Asker(host, int(port), ctx, request)
    assert asker.answer_kind() == b"D"
    assert struct.unpack(">Q", asker.recv_exact(8))[0] == span
    asker.recv_exact(64 << 10)  # (some of the part, then no more reading)
    # a's thread is blocked sending the part: its blocks are pinned meanwhile
    wait_until(lambda: peers()["pinned_blocks"] == blocks, 30, what="the part pinned while being sent")
    assert peers()["pinned_blocks_total"] == 2 * blocks and peers()["served_bytes"] == 0
    asker.vanish()
    wait_until(lambda: peers()["pinned_blocks"] == 0, 30, what="a to let go of the part's blocks")
    state = peers()
    assert state["asks_broken_off"] == 2 and state["served_bytes"] == 0, state  # (broken off mid-part)

    # 3. ckptfs umount of a while it sends a part to an asker that stopped reading: the peer
    # server is stopped before the cache closes (the thread sends from the RAM arena)
    asker = Asker(host, int(port), ctx, request)
    assert asker.answer_kind() == b"D"
    asker.recv_exact(8 + (64 << 10))
    wait_until(lambda: peers()["pinned_blocks"] == blocks, 30, what="the part pinned while being sent")
    log = Path(a.mount.cache_dir) / "ckptfs.log"
    before = log.stat().st_size
    a.stop()  # (`ckptfs umount`: returns once the mount and the daemon are gone)
    got = asker.drain(10)  # the connection was broken off, the part not sent in full
    asker.vanish()
    assert got < span - (64 << 10)
    with open(log, "rb") as f:
        f.seek(before)
        tail = f.read().decode(errors="replace")
    assert f"unmounted {a.path}" in tail, tail[-3000:]  # (logged after the cache closed)
    # no warning (PeerServer.stop's "threads still running", the RAM arena's "still in use by a
    # thread at close"), no error, no traceback
    bad = [line for line in tail.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not bad and "Traceback" not in tail, tail[-3000:]
