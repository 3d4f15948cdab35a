"""Cluster membership through the store: who the live peers are, where they listen, and the
certificate each one proves itself with.

A mount with ``--cluster`` keeps one record in the store, ``.ckptfs-cluster/<node>.json``: its
node id, its peer address and its TLS certificate (``peer_tls.py``). It puts the record again
every ``BEAT_S`` seconds; the store's modification time of the record is the heartbeat. Every
``POLL_S`` seconds it lists the prefix (one request) and reads the records that are new or
changed. A peer is live while its record is younger than ``LOST_S``, and this node has not
found it unreachable in the last ``DOWN_S`` seconds (``down``): a peer killed mid-transfer
costs one failed connection, not a wait for its record to age. A clean umount deletes the
record at once.

Only who can write the store can publish a record, so only they can become peers: the store's
credentials are the cluster's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ckptfs.cluster import peer_tls
from ckptfs.store.base import RESERVED_PREFIX, ObjectStore

log = logging.getLogger(__name__)

PREFIX = RESERVED_PREFIX + "cluster/"
TAKEOVER_PREFIX = PREFIX + "takeover/"  # <node>.json: the lease on a lost node's replicas
BEAT_S = 2.0  # the record is put again this often
POLL_S = 1.0  # the members are listed this often
LOST_S = 10.0  # a record not put again for this long: its node is gone
DOWN_S = 10.0  # a peer this node could not reach is left alone this long
RECORD_MAX = 16 << 10


@dataclass(frozen=True)
class Member:
    node: str
    host: str
    port: int
    cert: bytes  # PEM
    fingerprint: str
    domain: str = ""  # --failure-domain (replicas go to other domains first)
    holders: tuple[str, ...] = ()  # the nodes it streams its replicas to (--replicas)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


class Members:
    """This node's record in the store, and the other live members it lists there."""

    def __init__(
        self,
        store: ObjectStore,
        node: str,
        identity: peer_tls.Identity,
        on_change: Callable[[], None],
        domain: str = "",
        trust_for: float = LOST_S,
    ):
        self.store = store
        self.node = node
        self.domain = domain
        # A record this old still admits its node's connections: a node cut off from the store
        # (its record not refreshed) keeps telling its peers what it holds (peer_records.py).
        self.trust_for = max(LOST_S, trust_for)
        self.identity = identity
        self.on_change = on_change  # the trusted certificates changed (the server's context follows)
        self.host, self.port = "", 0  # where this node listens (set by ``publish``)
        self.known: dict[str, tuple[tuple, Member | None]] = {}  # node -> (listing stamp, record)
        self.seen: dict[str, float] = {}  # node -> the record's mtime in the last listing
        # node -> the newest mtime its record ever had (kept after the record goes: how long a
        # node has been silent, for the takeover of its replicas) and when this run began
        self.last_beat: dict[str, float] = {}
        self.started = time.time()
        self.holders: list[str] = []  # where this node streams its replicas (the replicator sets it)
        self.listed_at = -1e9  # time.monotonic() of the last listing that worked
        self.leases: set[str] = set()  # nodes whose replicas a holder took over (TAKEOVER_PREFIX)
        self.down: dict[str, float] = {}  # node -> time.monotonic() it was found unreachable
        self.listed = trio.Event()  # set once the first listing is in
        self.left = False  # a clean umount deleted the record: no beat puts it back
        self._writing = trio.Lock()  # (a put in flight must not land after the delete)
        self._trusted: frozenset[str] = frozenset()  # fingerprints at the last on_change
        self.failures = 0  # listings or puts that failed (the cluster goes on with what it knew)

    def key(self, node: str | None = None) -> str:
        return f"{PREFIX}{node or self.node}.json"

    def publish(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def body(self) -> bytes:
        record = {
            "node": self.node,
            "host": self.host,
            "port": self.port,
            "cert": self.identity.cert_pem.decode(),
            "domain": self.domain,
            "holders": self.holders,
        }
        return json.dumps(record).encode()

    def live(self) -> list[Member]:
        """The other members that are live now, in node order."""
        now, mono = time.time(), time.monotonic()
        out = []
        for node, (_, member) in sorted(self.known.items()):
            if member is None or node == self.node:
                continue
            if now - self.seen.get(node, 0.0) > LOST_S or mono - self.down.get(node, -DOWN_S) < DOWN_S:
                continue
            out.append(member)
        return out

    def trusted(self) -> list[Member]:
        """Members whose certificates a server admits: every record seen in the last
        ``trust_for`` seconds (a peer that only this node cannot reach may still reach it, and a
        peer cut off from the store may still reach this node)."""
        now = time.time()
        return [
            m
            for n, (_, m) in self.known.items()
            if m is not None and now - self.seen.get(n, 0.0) <= self.trust_for
        ]

    def node_of(self, fingerprint: str) -> str | None:
        """The node whose record shows this certificate fingerprint, if any."""
        for node, (_, member) in self.known.items():
            if member is not None and member.fingerprint == fingerprint:
                return node
        return None

    def silent_for(self, node: str) -> float:
        """Seconds since ``node`` last put its record (since this run began, if never seen)."""
        return time.time() - self.last_beat.get(node, self.started)

    def unreachable(self, node: str) -> None:
        if node not in self.down or time.monotonic() - self.down[node] >= DOWN_S:
            log.warning("peer %s is unreachable: reading from the store instead for %g s", node, DOWN_S)
        self.down[node] = time.monotonic()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self._put()
        await self._poll()
        self.listed.set()
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._beat)
            while True:
                await trio.sleep(POLL_S)
                await self._poll()

    async def leave(self) -> None:
        """Delete this node's record (a clean umount): the others stop asking it at once."""
        with trio.move_on_after(5):
            async with self._writing:
                self.left = True
            try:
                await trio.to_thread.run_sync(self.store.delete, self.key(), abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - it ages out in LOST_S anyway
                log.info("could not delete this node's cluster record: %s", exc)

    async def _beat(self) -> None:
        while True:
            await trio.sleep(BEAT_S)
            await self._put()

    async def _put(self) -> None:
        async with self._writing:
            if self.left:
                return
            try:
                await trio.to_thread.run_sync(self.store.put, self.key(), self.body(), abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                self.failures += 1
                log.warning("could not refresh this node's cluster record: %s", exc)

    async def _poll(self) -> None:
        try:
            infos = await trio.to_thread.run_sync(
                lambda: list(self.store.list(PREFIX)), abandon_on_cancel=True
            )
        except Exception as exc:  # noqa: BLE001 - peers known so far stay until they age out
            self.failures += 1
            log.info("could not list the cluster's members: %s", exc)
            return
        listed = set()
        self.listed_at = time.monotonic()
        self.leases = {
            info.key[len(TAKEOVER_PREFIX) :].removesuffix(".json")
            for info in infos
            if info.key.startswith(TAKEOVER_PREFIX)
        }
        for info in infos:
            node = info.key[len(PREFIX) :].removesuffix(".json")
            if not info.key.endswith(".json") or "/" in node or node == self.node:
                continue
            listed.add(node)
            self.seen[node] = info.mtime
            self.last_beat[node] = max(self.last_beat.get(node, 0.0), info.mtime)
            stamp = (info.size, info.etag, info.mtime if not info.etag else 0)
            if node in self.known and self.known[node][0] == stamp:
                continue
            member = await self._read(info.key)
            self.known[node] = (stamp, member)
        for node in set(self.known) - listed:
            del self.known[node]
            self.seen.pop(node, None)
        # (records age in and out without changing: the trusted set is judged every time)
        trusted = frozenset(m.fingerprint for m in self.trusted())
        if trusted != self._trusted:
            self._trusted = trusted
            try:
                self.on_change()
            except Exception as exc:  # noqa: BLE001 - keep the last good contexts
                log.warning("cluster members changed, but their certificates could not be loaded: %s", exc)

    async def _read(self, key: str) -> Member | None:
        try:
            raw = await trio.to_thread.run_sync(
                self.store.get_range, key, 0, RECORD_MAX, abandon_on_cancel=True
            )
            record = json.loads(raw)
            cert = record["cert"].encode("ascii")
            if not peer_tls.valid_cert(cert):
                raise ValueError("not a certificate")
            return Member(
                str(record["node"]),
                str(record["host"]),
                int(record["port"]),
                cert,
                peer_tls.fingerprint(cert),
                str(record.get("domain", ""))[:64],
                tuple(str(n)[:64] for n in record.get("holders", [])[:16]),
            )
        except Exception as exc:  # noqa: BLE001 - a damaged or vanished record: not a member
            log.info("ignoring the cluster record %s: %s", key, exc)
            return None

    def status(self) -> dict:
        return {
            "node": self.node,
            "addr": f"{self.host}:{self.port}",
            "live": [{"node": m.node, "addr": m.addr, "holders": list(m.holders)} for m in self.live()],
            "unreachable": sorted(n for n, t in self.down.items() if time.monotonic() - t < DOWN_S),
            "membership_failures": self.failures,
        }
