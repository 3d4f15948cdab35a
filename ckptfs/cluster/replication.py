"""Replicas on peers, the origin's side (``--replicas K``): every op this node journals, with the
bytes of a put, goes to K other live members, which keep it in their cache until this node says
it is in the store (cluster/replicas.py is the holder's side). A close returns once K holders
acknowledged everything committed so far, or after ``--replica-timeout`` (the file is then on
this node only: a warning and a counter), so a node lost before its uploads end loses nothing
whose close returned: a holder publishes it.

The stream mirrors the journal, in its order, on one TLS connection per holder (a thread each,
the peer channel's identities and trust): blocks a writer filled and moved past go as they are
sealed (the close waits only for the tail), each op after the blocks it names, then the
journal's retargets, cancels and dones. A holder answers every message once it has stored it
(up to ``WINDOW`` messages are on their way); ops are acknowledged by sequence number, so one
watermark per holder says what it holds. While blocks wait to go, the uploads give way (one
part at a time): a close waits for its replicas, not for the store.

Holders are chosen by rendezvous hashing of (this node, member), nodes of another failure domain
first (``--failure-domain``): each origin has its own holders, so the replicas of a cluster
spread over its nodes. A holder stays chosen while it is live and its stream works; a new one
gets every op still pending first. Blocks queued for a holder are pinned (one reference) until
sent: the queue is bounded by the cache, whose budget the writer waits on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
import xxhash

from ckptfs.cache.cache import Cache
from ckptfs.cache.journal import PUT, Op
from ckptfs.cluster.members import TAKEOVER_PREFIX, Member, Members
from ckptfs.cluster.peer_channel import PeerClient, PeerError, read_answer, send_frame, send_request
from ckptfs.cluster.peers import block_sender
from ckptfs.store.base import ObjectStore

if TYPE_CHECKING:
    from ckptfs.cache.contents import Content
    from ckptfs.transfer.upload_tasks import Task

log = logging.getLogger(__name__)

POLL_S = 1.0  # the holders are checked (and replaced) this often
WINDOW = 4  # messages sent to a holder before its answer to the first
ANSWER_S = 90.0  # a holder silent this long on a message (its cache full for good) is dropped
WARN_EVERY_S = 60.0
CLAIMING, TAKEN, PUBLISHED = "claiming", "taken", "published"  # a takeover lease's states
LEASE_MAX = 8 << 20  # a lease lists the ops it took (their sequence numbers)
REFUSED_S = 10.0  # a holder that refused our stream (busy, full) is left alone this long


class Link:
    """One holder: a thread sending this node's replica stream to it, message by message, each
    answered before the next goes. The trio side queues; the thread calls back through
    ``token`` (acknowledgements, pins to release, its end)."""

    def __init__(
        self,
        member: Member,
        client: PeerClient,
        request: dict,
        token: trio.lowlevel.TrioToken,
        on_answer: Callable[[Link, int, int], None],
        on_end: Callable[[Link, str, bool], None],
        release: Callable[[list], None],
    ):
        self.member = member
        self.client = client
        self.request = request
        self.token = token
        self.on_answer, self.on_end, self.release = on_answer, on_end, release
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # (trio side)
        self.acked = 0  # the highest op this holder acknowledged
        self.sent: dict[int, dict[int, int]] = {}  # writing -> block index -> stamp queued
        self.dead = False
        self.ready = False  # the holder took the stream
        self.queued_bytes = 0
        self.tls: ssl.SSLSocket | None = None
        self.thread = threading.Thread(target=self._run, name="ckptfs-replica-send", daemon=True)
        self.thread.start()

    def put(self, header: dict, slices: list, pins: list) -> None:
        if self.dead:
            self.release(pins)
            return
        self.queued_bytes += sum(length for _, length in slices)
        self.queue.put((header, slices, pins))

    def close(self) -> None:
        """(trio side) Stop: what is queued is let go, the connection broken off."""
        self.dead = True
        tls = self.tls
        if tls is not None:
            with contextlib.suppress(OSError):
                tls.shutdown(socket.SHUT_RDWR)
        self.drain()
        self.queue.put(None)

    def drain(self) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self.release(item[2])

    def _call(self, fn, *args) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(fn, *args)

    def _run(self) -> None:
        why, lost = "closed", False
        try:
            self.tls = self.client.open(self.member)
            self.tls.settimeout(ANSWER_S)
            send_request(self.tls, self.request)
            read_answer(self.tls)  # (the holder took the stream)
            self._call(self.on_answer, self, 0, 0)
            lost = True  # (from now on a failure is the holder's, not a refused handshake)
            sent: collections.deque[int] = collections.deque()  # bytes of messages not answered yet
            while True:
                # Up to WINDOW messages on their way: the holder stores one while the next
                # arrives. Answers are read in one thread with the sends, never at once.
                if sent and (len(sent) >= WINDOW or self.queue.empty()):
                    value = read_answer(self.tls)
                    self._call(self.on_answer, self, value, sent.popleft())
                    continue
                item = self.queue.get()
                if item is None:
                    return
                header, slices, pins = item
                try:
                    send_frame(self.tls, header, slices)
                finally:
                    self._call(self.release, pins)  # (sent: a new stream sends from the content)
                sent.append(sum(length for _, length in slices))
        except PeerError as exc:  # (a refused handshake, before the stream was taken: not lost)
            why, lost = str(exc), lost or exc.lost
        except (OSError, ssl.SSLError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
        finally:
            if self.tls is not None:
                self.tls.close()
            self._call(self.on_end, self, why, lost)


class Replicator:
    """This node's replicas on its peers: which holders, what each acknowledged, and the wait of
    a commit for them."""

    def __init__(
        self,
        cache: Cache,
        store: ObjectStore,
        members: Members,
        client: PeerClient,
        replicas: int,
        timeout: float,
        pending: Callable[[], dict[int, Task]],
    ):
        self.cache = cache
        self.store = store
        self.members = members
        self.client = client
        self.k = replicas
        self.timeout = timeout
        self.pending = pending  # the uploader's pending ops (what a new holder must get first)
        self.links: dict[str, Link] = {}
        self.token: trio.lowlevel.TrioToken | None = None
        self.changed = trio.Event()
        self.loaded = trio.Event()  # the journal's pending ops are the uploader's (Core.load)
        self.refused: dict[str, float] = {}  # holder -> when it refused our stream (left alone a while)
        # A holder's queue beyond this (blocks pinned, not yet sent): it is too slow, another is chosen.
        self.queue_cap = max(cache.block_size, (cache.tiers[0].budget + cache.tiers[1].budget) // 4)
        self.replicated_bytes = 0  # bytes holders acknowledged
        self.local_commits = 0  # commits that returned without their replicas (timeout, no peer)
        self.holder_losses = 0  # streams that ended (a holder lost, full or refusing)
        self._warned = -WARN_EVERY_S

    # -- life -----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.token = trio.lowlevel.current_trio_token()
        task_status.started()
        await self.members.listed.wait()
        await self.loaded.wait()  # (a holder first gets every op still pending: the resumed ones too)
        self._relink()
        while True:
            await trio.sleep(POLL_S)
            self._relink()

    def stop(self) -> None:
        """Break every stream off and wait for the threads (they read the cache's arena)."""
        links = list(self.links.values())
        for link in links:
            link.close()
        self.links.clear()
        deadline = time.monotonic() + 5
        for link in links:
            link.thread.join(max(0.0, deadline - time.monotonic()))

    # -- choosing holders -------------------------------------------------------------------------
    def _ranked(self) -> list[Member]:
        own = self.members.domain
        return sorted(
            self.members.live(),
            key=lambda m: (
                bool(own) and m.domain == own,  # another failure domain first
                -xxhash.xxh3_64_intdigest(f"{self.members.node}\0{m.node}".encode()),
            ),
        )

    def _relink(self) -> None:
        """Keep K working streams: a holder stays while it is live; a dead one is replaced."""
        live = {m.node: m for m in self.members.live()}
        for node, link in list(self.links.items()):
            current = live.get(node)
            too_slow = link.queued_bytes > self.queue_cap
            if too_slow and not link.dead:
                log.warning("replicas: holder %s is too slow; choosing another", node)
                self.refused[node] = time.monotonic()
            if link.dead or too_slow or current is None or current.fingerprint != link.member.fingerprint:
                link.close()
                del self.links[node]
                self._signal()
        now = time.monotonic()
        for member in self._ranked():
            if len(self.links) >= self.k:
                break
            if member.node not in self.links and now - self.refused.get(member.node, -REFUSED_S) >= REFUSED_S:
                self._open(member)
        self.members.holders = sorted(self.links)  # (in this node's record: who holds what it commits)

    def _open(self, member: Member) -> None:
        assert self.token is not None
        link = Link(
            member,
            self.client,
            {"replica": self.members.node, "url": self.store.url},
            self.token,
            self._answered,
            self._ended,
            self._unpin,
        )
        self.links[member.node] = link
        log.info("replicas: streaming this node's pending files to %s (%s)", member.node, member.addr)
        pending = sorted(self.pending().items())
        # The holder drops whatever else it holds of this node (a stream cut off may have lost a
        # retarget or done), then gets what it missed, in journal order, each op as it is now.
        link.put({"t": "reset", "pending": [seq for seq, _ in pending]}, [], [])
        for _, task in pending:
            self._send_op(link, task.op, task.content, None)

    def _answered(self, link: Link, value: int, nbytes: int) -> None:
        link.queued_bytes -= nbytes
        link.ready = True
        self.replicated_bytes += nbytes
        if value > link.acked:
            link.acked = value
            self._signal()

    def _ended(self, link: Link, why: str, lost: bool) -> None:
        if not link.dead and not link.ready:  # (it has not listed this node's record yet, or is busy)
            log.info("replicas: %s did not take the stream (%s); trying again", link.member.node, why)
        elif not link.dead:
            self.holder_losses += 1
            log.warning(
                "replicas: the stream to %s ended (%s); choosing another holder", link.member.node, why
            )
            if lost:  # (not a refused handshake: it has not seen this node's record yet, or is busy)
                self.members.unreachable(link.member.node)
            elif link.ready or "refused" in why:
                self.refused[link.member.node] = time.monotonic()  # (busy, full: try another)
        link.dead = True
        link.drain()
        self._signal()

    def _unpin(self, pins: list) -> None:
        for ref in pins:
            self.cache.decref(ref)

    def _signal(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    # -- the stream (called by the model, no awaits) ---------------------------------------------
    def seal(self, writing: int, index: int, ref, length: int, stamp: int) -> None:
        """A block a writer filled and moved past: to every holder now."""
        for link in self.links.values():
            if link.sent.get(writing, {}).get(index) != stamp:
                self._send_block(link, writing, index, ref, length, stamp)

    def op(self, op: Op, content: Content | None = None, writing: int | None = None, stamps=None) -> None:
        """A journaled op (with its content for a put, and the working copy it came from)."""
        for link in self.links.values():
            self._send_op(link, op, content, writing, stamps)

    def amend(self, rec: dict) -> None:
        """A retarget, cancel or done the journal recorded."""
        for link in self.links.values():
            link.put({"t": "amend", "rec": rec}, [], [])
        if rec["t"] in ("done", "cancel"):
            self._signal()  # (an op in the store needs no replica: a close may wait for it)

    def forget(self, writing: int) -> None:
        """A working copy ended: its streamed blocks are of no more use to the holders."""
        for link in self.links.values():
            if link.sent.pop(writing, None) is not None:
                link.put({"t": "forget", "w": writing}, [], [])

    def _send_block(self, link: Link, writing: int, index: int, ref, length: int, stamp: int) -> None:
        self.cache.incref(ref)  # (pinned until sent)
        header = {"t": "block", "w": writing, "i": index, "s": stamp}
        link.put(header, [(block_sender(self.cache, ref, length), length)], [ref])
        link.sent.setdefault(writing, {})[index] = stamp

    def _send_op(self, link: Link, op: Op, content: Content | None, writing: int | None, stamps=None) -> None:
        have = []
        w = writing if writing is not None else -op.seq  # (an op's own blocks: taken by the op)
        if op.kind == PUT and content is not None:
            for index, ref in enumerate(content.blocks):
                if ref is None:
                    continue  # a hole, or a part already in the store (op.upload names it)
                have.append(index)
                stamp = stamps[index] if stamps is not None and index < len(stamps) else 0
                if writing is None or link.sent.get(w, {}).get(index) != stamp:
                    self._send_block(link, w, index, ref, content.block_length(index), stamp)
        record = op.to_record()
        record.pop("blocks", None)
        link.put({"t": "op", "op": record, "w": w, "have": have}, [], [])
        if writing is None:
            link.sent.pop(w, None)

    # -- the commit's wait ------------------------------------------------------------------------
    def _held(self, seq: int, k: int | None = None) -> bool:
        """Op ``seq`` is held by K (or ``k``) holders (each acknowledges ops in journal order)."""
        held = sum(1 for link in self.links.values() if not link.dead and link.acked >= seq)
        return held >= (self.k if k is None else k)

    def covered(self, seq: int, k: int | None = None) -> bool:
        """Whether every op journaled up to ``seq`` is in the store already or held by K (or
        ``k``) holders (an fsync shadow is journaled but never pending: the ops before it count)."""
        last = max((s for s in self.pending() if s <= seq), default=None)
        return last is None or self._held(last, k)

    def replicated(self, seq: int) -> bool:
        """Op ``seq`` is pending and held by K holders (``user.ckptfs.state``: replicated)."""
        return seq in self.pending() and self._held(seq)

    async def wait(self, seq: int) -> None:
        """Return once everything journaled up to ``seq`` is covered, or after the timeout."""
        if self.k == 0 or seq <= 0:
            return
        with trio.move_on_after(self.timeout):
            # (fewer live members than K: what they can hold, without waiting for the others)
            while not self.covered(seq, min(self.k, len(self.members.live()))):
                await self.changed.wait()
        if self.covered(seq):
            return
        self.local_commits += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(
                "replicas: %s; this commit returns with the file on this node only until it is in "
                "the store (counted in 'ckptfs status' as local commits)",
                f"{len(self.members.live())} live peer(s) of the {self.k} wanted"
                if len(self.members.live()) < self.k
                else f"no reply from the holders in {self.timeout:g} s",
            )

    def behind(self) -> bool:
        """Blocks wait to go to a holder (the uploads give way meanwhile)."""
        return any(link.queued_bytes > 0 for link in self.links.values() if not link.dead)

    def at_risk_seconds(self) -> float:
        """Seconds since the oldest commit that is neither in the store nor replicated."""
        now = time.monotonic()
        ages = [now - t.submitted for s, t in self.pending().items() if not self._held(s)]
        return max(ages, default=0.0)

    def status(self) -> dict:
        return {
            "replicas": self.k,
            "holders": sorted(n for n, link in self.links.items() if link.ready and not link.dead),
            "replicated_bytes": self.replicated_bytes,
            "replica_queue_bytes": sum(link.queued_bytes for link in self.links.values()),
            "local_commits": self.local_commits,
            "holder_losses": self.holder_losses,
        }


async def read_lease(store: ObjectStore, node: str) -> dict | None:
    """The lease a holder took on ``node``'s replicas (cluster/replicas.py; None: none). A store
    error is raised: "none" must mean none."""
    key = f"{TAKEOVER_PREFIX}{node}.json"
    if await trio.to_thread.run_sync(store.head, key, abandon_on_cancel=True) is None:
        return None
    try:
        raw = await trio.to_thread.run_sync(store.get_range, key, 0, LEASE_MAX, abandon_on_cancel=True)
        lease = json.loads(raw)
    except FileNotFoundError:
        return None  # (gone meanwhile)
    except ValueError:
        log.warning("replicas: the lease %s is not JSON: ignored", key)
        return None
    return lease if isinstance(lease, dict) else None


async def taken_over(store: ObjectStore, node: str, wait_s: float) -> set[int] | None:
    """At ``node``'s start: the sequence numbers of its ops a holder took over while it was
    gone (an empty set: a lease whose holder never finished claiming: nothing was taken), or
    None (no lease, or the store cannot say). A takeover still claiming or publishing is waited
    for up to ``wait_s`` (its older publication must not land after what this node does next)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lease = await read_lease(store, node)
        except Exception as exc:  # noqa: BLE001 - a store that fails now: this mount cannot tell
            log.error("replicas: cannot read this node's takeover lease (%s): not fenced", exc)
            return None
        if lease is None:
            return None
        state, holder = lease.get("state"), lease.get("holder")
        if state == PUBLISHED or time.monotonic() > deadline:
            break
        log.info("replicas: node %s is taking this node's files over (%s): waiting", holder, state)
        await trio.sleep(1)
    if state == CLAIMING:
        log.warning("replicas: node %s never finished taking this node over", holder)
        return set()
    log.warning(
        "replicas: node %s published this node's pending operations while it was gone (%s)",
        holder,
        "all in the store" if state == PUBLISHED else "still publishing",
    )
    return {seq for seq in lease.get("seqs", []) if isinstance(seq, int)}


async def drop_lease(store: ObjectStore, node: str) -> None:
    with contextlib.suppress(Exception):
        await trio.to_thread.run_sync(store.delete, f"{TAKEOVER_PREFIX}{node}.json")
