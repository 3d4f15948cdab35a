"""The peer channel (cluster/peer_channel.py) on real sockets and real TLS, in process: what an
owner pinned for an asker that left is let go, a stop breaks every connection and ends every
thread, and a record's certificate is taken only if OpenSSL would load it as a trust anchor."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from ckptfs.cluster import peer_tls
from ckptfs.cluster.members import Member
from ckptfs.cluster.peer_channel import PeerClient, PeerServer, Served
from tests.support.harness import wait_until

pytestmark = pytest.mark.unit


def identity(root: Path, name: str) -> peer_tls.Identity:
    path = root / name
    path.mkdir(mode=0o700)
    return peer_tls.Identity(path, name)


class Owner:
    """A PeerServer whose trio side is this test: each ask's Future is kept for the test to
    answer (or not)."""

    def __init__(self, me: peer_tls.Identity, asker: peer_tls.Identity):
        self.asks: list[concurrent.futures.Future] = []
        self.released: list[str] = []
        self.server = PeerServer(
            lambda: me.context(True, [asker.cert_pem]),
            lambda fingerprint: fingerprint == asker.fingerprint,
            self._gather,
            lambda release: release(),
            4,
        )
        self.port = self.server.start("127.0.0.1", 0)
        self.member = Member("owner", "127.0.0.1", self.port, me.cert_pem, me.fingerprint)

    def _gather(self, request: dict) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.asks.append(future)
        return future

    def answer(self, future: concurrent.futures.Future, data: bytes, name: str) -> bool:
        """What PeerCache._answer does: answer unless the asker left; then let the pins go."""
        served = Served([(lambda sock: sock.sendall(data), len(data))], lambda: self.released.append(name))
        if future.set_running_or_notify_cancel():
            future.set_result(served)
            return True
        served.release()
        return False


def ask_and_leave(asker: peer_tls.Identity, owner: Owner) -> None:
    ctx = asker.context(False, [owner.member.cert])
    with socket.create_connection(("127.0.0.1", owner.port), timeout=10) as raw:
        with ctx.wrap_socket(raw) as tls:
            body = json.dumps({"key": "k", "begin": 0, "span": 4}).encode()
            tls.sendall(len(body).to_bytes(4, "big") + body)
            assert tls.recv(1) == b"W"  # (the owner is working on it)


def test_an_asker_that_leaves_mid_ask_gets_its_pins_let_go(tmp_path):
    me, asker = identity(tmp_path, "owner"), identity(tmp_path, "asker")
    owner = Owner(me, asker)
    try:
        # gone before the owner answered: the ask is cancelled, and the answer lets its pins go
        ask_and_leave(asker, owner)
        wait_until(lambda: owner.asks and owner.asks[0].cancelled(), 30, what="the ask to be cancelled")
        assert not owner.answer(owner.asks[0], b"data", "first")
        assert owner.released == ["first"]
        # answered, and sent: released once sent
        client = PeerClient(lambda member: asker.context(False, [member.cert]))
        done = []
        thread = threading.Thread(
            target=lambda: done.append(client.take(owner.member, {"key": "k"}, 4, time.monotonic() + 30))
        )
        thread.start()
        wait_until(lambda: len(owner.asks) == 2, 30)
        assert owner.answer(owner.asks[1], b"data", "second")
        thread.join(30)
        assert done == [bytearray(b"data")]
        # (the server thread lets the pins go right after its last send: the client may be first)
        wait_until(lambda: owner.released == ["first", "second"], 10, what="the pins to be let go")
        client.close()
    finally:
        owner.server.stop()


def test_stop_breaks_every_connection_and_ends_every_thread(tmp_path):
    me, asker = identity(tmp_path, "owner"), identity(tmp_path, "asker")
    owner = Owner(me, asker)
    client = PeerClient(lambda member: asker.context(False, [member.cert]))
    thread = threading.Thread(
        target=lambda: client.take(owner.member, {"key": "k"}, 2, time.monotonic() + 30)
    )
    thread.start()
    wait_until(lambda: owner.asks, 30)
    owner.answer(owner.asks[0], b"ok", "one")
    thread.join(30)  # (the client keeps that connection idle; the server's thread waits on it)
    started = time.monotonic()
    owner.server.stop(timeout=10)
    assert time.monotonic() - started < 5
    assert not any(t.is_alive() for t in owner.server.threads)
    client.close()


def test_a_record_certificate_must_load_as_one_trust_anchor(tmp_path):
    cert = identity(tmp_path, "node").cert_pem
    assert peer_tls.valid_cert(cert)
    assert not peer_tls.valid_cert(b"not a certificate")
    assert not peer_tls.valid_cert(cert + b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert not peer_tls.valid_cert(cert + cert)
