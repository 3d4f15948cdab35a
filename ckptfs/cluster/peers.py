"""The peer cache: the nodes of a cluster read each block of a checkpoint from the store once,
and from each other after that.

Who fetches what: every part of every object version has one owner among the live members,
chosen by rendezvous hashing of (node, key, version, part): each node computes the same owner
from the same member list, with no message and no coordinator, and a member that leaves moves
only its own share. A node that needs a part it does not hold asks its owner (``take``); the
owner answers from its cache, or fetches the part from the store into its cache first (its own
fetches are single flight, so N nodes asking at once cost one GET). The owner keeps the part
cached as clean data, so a reader coming later (staggered restores) finds it there too. A part
a node owns itself it fetches from the store, as a mount without ``--cluster`` does.

Why an owner and not announcements of what each node holds: the first readers of a checkpoint
all start at once, before anyone holds anything; an owner is known before the first byte
arrives, so exactly one fetch starts, and nothing has to be announced or kept in step.

Nothing a peer sends is trusted: the fetcher (transfer/fetcher.py) checks every part against
the checksums it read from the store itself, as it checks bytes from the store; a peer that
sends wrong bytes, stalls, refuses or vanishes costs one fetch from the store. Only verified
objects (with recorded part checksums) go through peers.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import trio
import xxhash

from ckptfs.cache.arena import RAM
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.cluster import peer_tls
from ckptfs.cluster.members import Member, Members
from ckptfs.cluster.peer_channel import IDLE_S, PeerClient, PeerError, PeerServer, Served
from ckptfs.errors import FsError
from ckptfs.objects.integrity import Checksums
from ckptfs.store.base import ObjectStore

log = logging.getLogger(__name__)

PEER_BUFFER = 1 << 20  # a disk block is sent through a buffer this large (daemon/limits.py counts it)
PUSH_THREADS = 4  # writer records pushed to peers at once (cluster/peer_records.py)
ASK_MAX_S = 600.0  # an ask's bound without --read-timeout
UNSPECIFIED = ("0.0.0.0", "::", "")  # listen on every interface: publish the one that routes to the store

# The content a key names on this node, held, with the call that lets it go (None: not here).
Lookup = Callable[[str], Awaitable["tuple[Content, Callable[[], None]] | None"]]
# Fetch blocks of a content from the store (never from peers: an owner does not forward).
Fill = Callable[[Content, list[int]], Awaitable[None]]


def default_host(store_url: str, endpoint_url: str | None) -> str:
    """The address of this machine's interface that routes to the store (no packet is sent)."""
    target = urlsplit(endpoint_url).hostname if endpoint_url else None
    if target is None and store_url.startswith("s3://"):
        target = "s3.amazonaws.com"
    if target is None or target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(target), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class PeerCache:
    """Membership, the channel's both ends, and which peer to ask for what (the fetcher's
    ``PeerSource``)."""

    def __init__(
        self,
        store: ObjectStore,
        cache: Cache,
        cache_dir: Path,
        node: str,
        addr: tuple[str, int],
        publish_host: str,
        max_connections: int,
        lookup: Lookup,
        fill: Fill,
        domain: str = "",
        session: Callable[[dict, ssl.SSLSocket, str], None] | None = None,
        asks: int = 4,
        on_records: Callable[[str, dict], str] | None = None,
        trust_for: float = 0.0,
    ):
        self.url = store.url
        self.cache = cache
        self.identity = peer_tls.Identity(cache_dir, node)
        self.members = Members(store, node, self.identity, self._members_changed, domain, trust_for)
        self.addr = addr  # where to listen
        self.publish_host = publish_host  # the address the others are told
        self.lookup = lookup
        self.fill = fill
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self._server_context = self.identity.context(True, [self.identity.cert_pem])
        self._client_contexts: dict[str, object] = {}
        self._trusted: frozenset[str] = frozenset()  # the members' certificate fingerprints
        self.server = PeerServer(
            lambda: self._server_context,
            self._admitted,
            self._gather,
            self._release,
            max_connections,
            session,
        )
        self.client = PeerClient(self.client_context, max_idle=asks)
        # Asks at once, each a thread and a part-sized buffer: as many as the fetcher's (its
        # ``peer_bodies``); an ask given up on (a read interrupted) keeps its thread and buffer
        # until it ends, and its place here with them (daemon/limits.py counts ``asks`` parts).
        self.threads = trio.CapacityLimiter(asks)
        # (node, request) -> "" when taken, else why not: the writer records peers push to this
        # node (cluster/peer_records.py); pushed in threads of their own (no part buffer)
        self.on_records = on_records
        self.push_threads = trio.CapacityLimiter(PUSH_THREADS)
        self.taken_bytes = 0  # bytes of parts taken from peers (and so not from the store)
        self.failures = 0  # asks that came back with nothing: the store served them instead
        self.refusals = 0  # asks a peer declined (not its version, not there)
        self.mismatches = 0  # parts a peer sent that did not match their checksums
        # Blocks of the cache pinned for peers' asks (``_serve``), kept from eviction until sent or
        # the asker gone: now, and in all.
        self.pinned_blocks = 0
        self.pinned_total = 0

    # -- life -------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen, publish this node's record, learn the members; serve until cancelled."""
        self.token = trio.lowlevel.current_trio_token()
        host, port = self.addr
        try:
            port = self.server.start(host, port)
        except OSError as exc:
            raise FsError(
                errno.EADDRNOTAVAIL, f"cannot listen for peers on {host}:{port}: {exc.strerror}"
            ) from None
        self.members.publish(self.publish_host, port)
        log.info("cluster: node %s serving peers on %s:%d", self.members.node, self.publish_host, port)
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await nursery.start(self.members.run)
                task_status.started()
        finally:
            self.nursery = None

    def stop(self) -> None:
        """Stop serving (before the cache closes: a sending thread reads the arena)."""
        self.server.stop()
        self.client.close()

    async def leave(self) -> None:
        await self.members.leave()

    # -- the fetcher's side -----------------------------------------------------------------
    def route(self, key: str, tag: str, begin: int) -> tuple[Member, bool] | None:
        """Whom to ask for this part: its owner (True: it fetches the part if it must), or, when
        this node owns it, the peer that owned it before this node joined, which may hold it
        (False: only if it does); None: no live peer."""
        live = self.members.live()
        if not live:
            return None
        ranked = sorted(
            [(self.members.node, None), *((m.node, m) for m in live)],
            key=lambda nm: xxhash.xxh3_64_intdigest(f"{nm[0]}\0{key}\0{tag}\0{begin}".encode()),
            reverse=True,
        )
        first, second = ranked[0][1], ranked[1][1]
        if first is not None:
            return first, True
        assert second is not None  # (this node is in the ranking once)
        return second, False

    async def take(
        self,
        owner: Member,
        fetch: bool,
        key: str,
        size: int,
        tag: str,
        begin: int,
        span: int,
        timeout: float | None,
    ) -> bytearray | None:
        """Part [begin, begin + span) of that version from ``owner`` (``fetch``: which fetches it
        from the store if it does not hold it), unchecked (the caller checks it), or None: read
        it from the store."""
        request = {"url": self.url, "key": key, "size": size, "tag": tag, "begin": begin, "span": span}
        request["fetch"] = fetch
        # (half the read's budget: the store still has the other half if the peer fails)
        deadline = time.monotonic() + (timeout / 2 if timeout is not None else ASK_MAX_S)
        try:
            answer = await trio.to_thread.run_sync(
                self.client.take, owner, request, span, deadline, limiter=self.threads, abandon_on_cancel=True
            )
        except PeerError as exc:
            self.failures += 1
            log.info(
                "peer %s (%s) failed for %s: %s; reading from the store", owner.node, owner.addr, key, exc
            )
            if exc.lost:  # (a refused handshake is a busy peer, not a lost one)
                self.members.unreachable(owner.node)
            return None
        if isinstance(answer, str):
            self.refusals += fetch  # (a peer asked only if it holds a part: no news if not)
            log.debug("peer %s does not serve %s @%d: %s", owner.node, key, begin, answer)
            return None
        self.taken_bytes += len(answer)
        return answer

    def mismatch(self, owner: Member, key: str, why: str) -> None:
        """``owner`` sent bytes that did not match: leave it alone for a while."""
        self.mismatches += 1
        log.warning(
            "peer %s sent bytes of %s that do not match their checksum (%s): reading from the store",
            owner.node,
            key,
            why,
        )
        self.members.unreachable(owner.node)

    # -- the server's side ------------------------------------------------------------------
    def _admitted(self, fingerprint: str) -> bool:
        return fingerprint in self._trusted  # (from a server thread: one read of a frozenset)

    def _members_changed(self) -> None:
        trusted = self.members.trusted()
        self._trusted = frozenset(m.fingerprint for m in trusted)
        self._server_context = self.identity.context(
            True, [m.cert for m in trusted] or [self.identity.cert_pem]
        )
        self.client.forget({m.fingerprint for m in trusted})

    def client_context(self, member: Member):
        context = self._client_contexts.get(member.fingerprint)
        if context is None:
            if len(self._client_contexts) > 1000:
                self._client_contexts.clear()
            context = self._client_contexts[member.fingerprint] = self.identity.context(False, [member.cert])
        return context

    def _gather(self, request: dict) -> concurrent.futures.Future:
        """(From a server thread) start gathering on the trio side; the Future gets the ``Served``."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            if self.nursery is None:
                future.set_result(Served([], lambda: None, "shutting down"))
            else:
                self.nursery.start_soon(self._answer, request, future)

        try:
            trio.from_thread.run_sync(start, trio_token=self.token)
        except trio.RunFinishedError:
            future.set_result(Served([], lambda: None, "shutting down"))
        return future

    def _release(self, release: Callable[[], None]) -> None:
        try:
            trio.from_thread.run_sync(release, trio_token=self.token)
        except trio.RunFinishedError:
            pass

    async def _answer(self, request: dict, future: concurrent.futures.Future) -> None:
        served = Served([], lambda: None, "shutting down")
        try:
            served = await self._serve(request)
        except Exception as exc:  # noqa: BLE001 - the peer reads from the store
            served = Served([], lambda: None, f"{type(exc).__name__}: {exc}")
        finally:  # (also when cancelled: the server thread waits for an answer)
            if future.set_running_or_notify_cancel():
                future.set_result(served)
            else:  # the asker left meanwhile
                served.release()

    async def _serve(self, request: dict) -> Served:
        if "records" in request:
            return Served([], lambda: None, self._take_records(request))
        try:
            url, key, tag = str(request["url"]), str(request["key"]), str(request["tag"])
            size, begin, span = int(request["size"]), int(request["begin"]), int(request["span"])
        except (KeyError, TypeError, ValueError):
            return Served([], lambda: None, "bad request")
        if url != self.url:
            return Served([], lambda: None, "another store")
        bs = self.cache.block_size
        if (
            begin < 0
            or begin % bs
            or span <= 0
            or begin + span > size
            or (span % bs and begin + span != size)
        ):
            return Served([], lambda: None, "not whole blocks")
        found = await self.lookup(key)
        if found is None:
            return Served([], lambda: None, "not here")
        content, done = found
        try:
            if content.size != size or content.key != key or not content.in_store:
                return Served([], lambda: None, "another version")
            known = content.checksums
            if isinstance(known, Checksums) and known.version != tag:
                return Served([], lambda: None, "another version")
            indexes = list(range(begin // bs, (begin + span - 1) // bs + 1))
            if not request.get("fetch", True) and any(content.blocks[i] is None for i in indexes):
                return Served([], lambda: None, "not cached here")
            with content.reading(begin, span):  # (eviction passes these blocks by meanwhile)
                # One part, never more (an ask is bounded like a fetch): its first block first,
                # which teaches this node the version's checksums if it did not know them yet.
                await self.fill(content, [i for i in indexes[:1] if content.blocks[i] is None])
                known = content.checksums
                if not isinstance(known, Checksums) or known.version != tag:
                    return Served([], lambda: None, "another version")
                if known.span(begin, 1) != (begin, span):
                    return Served([], lambda: None, "not one part")
                await self.fill(content, [i for i in indexes if content.blocks[i] is None])
                if content.checksums != known:
                    return Served([], lambda: None, "another version")
                refs = [content.blocks[i] for i in indexes]
                if any(ref is None for ref in refs):
                    return Served([], lambda: None, "evicted meanwhile")
                slices = []
                for index, ref in zip(indexes, refs):
                    assert ref is not None
                    self.cache.incref(ref)  # (pinned until sent, whatever evicts the content's)
                    self.pinned_blocks += 1
                    self.pinned_total += 1
                    length = content.block_length(index)
                    slices.append((block_sender(self.cache, ref, length), length))
        finally:
            done()

        def release() -> None:
            for ref in refs:
                assert ref is not None
                self.cache.decref(ref)
            self.pinned_blocks -= len(refs)

        return Served(slices, release)

    def _take_records(self, request: dict) -> str:
        sender = self.members.node_of(str(request.get("from", "")))
        if sender is None:
            return "not a member"
        if request.get("url") != self.url:
            return "another store"
        if self.on_records is None:
            return "not kept here"
        return self.on_records(sender, request)

    async def push_records(self, member: Member, request: dict) -> bool:
        """Tell ``member`` this node's writer records; True once it took them."""
        deadline = time.monotonic() + IDLE_S
        try:
            answer = await trio.to_thread.run_sync(
                self.client.take,
                member,
                {**request, "url": self.url},
                0,
                deadline,
                limiter=self.push_threads,
                abandon_on_cancel=True,
            )
        except PeerError as exc:
            log.debug("could not tell peer %s this node's writer records: %s", member.node, exc)
            return False
        if isinstance(answer, str):
            log.debug("peer %s did not take this node's writer records: %s", member.node, answer)
            return False
        return True

    def status(self) -> dict:
        return {
            **self.members.status(),
            "served_bytes": self.server.served_bytes,
            "taken_bytes": self.taken_bytes,
            "requests_served": self.server.requests,
            "asks_failed": self.failures,
            "asks_declined": self.refusals,
            "mismatches": self.mismatches,
            "refused_clients": self.server.refused_clients,
            "asks_broken_off": self.server.broken_off,
            "pinned_blocks": self.pinned_blocks,
            "pinned_blocks_total": self.pinned_total,
        }


def block_sender(cache: Cache, ref, length: int) -> Callable[[ssl.SSLSocket], None]:
    """Send block ``ref``'s first ``length`` bytes (from a thread; the caller pins the block):
    a RAM block straight from the arena's mapping (TLS encrypts from it), a disk block through
    one small buffer."""
    if ref[0] == RAM:
        return lambda sock: sock.sendall(cache.view_range(ref, 0, length))

    def send(sock: ssl.SSLSocket) -> None:
        buffer = memoryview(bytearray(min(length, PEER_BUFFER)))
        done = 0
        while done < length:
            chunk = buffer[: min(len(buffer), length - done)]
            cache.read_into(ref, done, chunk)
            sock.sendall(chunk)
            done += len(chunk)

    return send
