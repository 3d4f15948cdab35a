"""Replicas on peers, the holder's side: other nodes' pending ops and their bytes, kept in this
node's cache until their origin says they are in the store, and published by this node when
their origin is lost (cluster/replication.py is the origin's side).

A replica stream is a connection of the peer channel opened with ``{"replica": ORIGIN}``; then
messages, each a JSON header and a body, each answered once stored (``A`` + a number, or ``N``):

    block  {"w", "i", "s"} + the bytes   block i of the origin's working copy w (stamp s)
    op     {"op": record, "w", "have"}   a journaled op; a put's blocks are those of ``w`` listed
                                         in ``have`` (a negative w: blocks sent for this op only)
                                         answered with the op's sequence number
    amend  {"rec"}                       the journal's retarget, cancel or done of an op
    forget {"w"}                         working copy w ended

Blocks take cache slots (RAM first, then disk), so replicas are part of the cache budget: a
holder whose cache is full of data not in the store makes the stream wait (and the origin's
close then times out to the local level). Each origin's ops are kept in a log of their own,
``<cache dir>/replicas/<origin>.log`` (the journal's record format, this node's blocks), so a
holder killed and restarted still holds them: its start adopts their blocks with the journal's.

Takeover: once an origin has put no member record for ``--takeover-after`` seconds, a holder
takes the lease ``.ckptfs-cluster/takeover/<origin>.json`` (holder, epoch, the last op it holds),
waits ``LEASE_SETTLE_S`` and reads it back: the store has no compare-and-swap (Swift), so two
holders that write it at once both read the last one, and only its holder goes on. It then
appends the origin's ops, in the origin's order, to its own journal (each naming its origin) and
hands them to its uploader: they are published in order, gated like its own (a marker waits for
the files it stands for), and a restart of this holder resumes them like any pending op. Its
writer records then cover those directories, and the origin's records go. The lease stays, so
an origin that comes back with its cache dir drops what was taken over instead of publishing an
older state over it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from ckptfs.blocks import BlockRef
from ckptfs.cache.arena import RAM
from ckptfs.cache.cache import Cache
from ckptfs.cache.journal import ATTR, DELETE, MKDIR, MOVE, PUT, Op
from ckptfs.cluster.members import TAKEOVER_PREFIX, Members
from ckptfs.cluster.peer_channel import read_frame_body, read_frame_length, recv_into, send_answer
from ckptfs.cluster.replication import CLAIMING, PUBLISHED, TAKEN, read_lease
from ckptfs.store.base import RESERVED_PREFIX, ObjectStore
from ckptfs.util import private_files

log = logging.getLogger(__name__)

DIRECTORY = "replicas"
POLL_S = 1.0
LEASE_SETTLE_S = 2.0  # between writing the lease and reading it back
LEASE_SEEN_S = 10.0  # a lease just taken counts this long before the members' listing shows it
RECORD_LAG_S = 6.0  # an origin's record put this long after its stream began names its holders
FRESH_LISTING_S = 3.0  # silence is judged only on a listing of the members this recent
KINDS = (PUT, DELETE, MOVE, MKDIR, ATTR)
MAX_OBJECT = 5 << 40  # S3's largest object
SESSION_IDLE_S = 300.0  # a stream silent this long is closed (its origin reopens it)
NODE_ID = re.compile(r"[0-9a-f]{16}")  # cluster/records.py node_id
# A message header over this many bytes (an op of a file of many blocks: its list of them) is
# read and handled while no other stream holds one: the daemon's memory holds one such header
# (at most FRAME_HEADER_MAX, and its decoded JSON) at a time, not one per stream (daemon/limits.py).
SMALL_HEADER = 64 << 10
_LARGE_HEADER = threading.Lock()

# Hand a lost origin's ops, in order, to this node's journal and uploader (Commits.take_over):
# the last of them's sequence number here.
Adopt = Callable[[str, list[Op]], int]
# Once those are this node's: make its writer records cover them, drop the origin's, and
# return once they are all in the store (up to that sequence number).
Handover = Callable[[str, int], Awaitable[None]]


class Replica:
    """One origin's pending ops held here, and the blocks of its working copies."""

    def __init__(self, origin: str, path: Path, ram_arena_id: str):
        self.origin = origin
        self.path = path
        self.ram_arena_id = ram_arena_id
        self.ops: dict[int, Op] = {}
        self.files: dict[int, dict[int, tuple[BlockRef, int]]] = {}  # writing -> index -> (ref, stamp)
        self.fd = -1
        self.lines = 0
        self.streamed_at = time.time()  # when its origin's last stream here began (wall clock)

    def block_count(self) -> int:
        return sum(1 for op in self.ops.values() for ref in op.blocks if ref is not None) + sum(
            len(f) for f in self.files.values()
        )

    def record(self, rec: dict) -> None:
        if self.fd < 0:
            self.rewrite()
        os.write(self.fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        self.lines += 1
        if self.lines > 1000 + 4 * len(self.ops):
            self.rewrite()

    def rewrite(self) -> None:
        records = [{"t": "arena", "ram": self.ram_arena_id}] + [
            self.ops[s].to_record() for s in sorted(self.ops)
        ]
        with open(private_files.new_temp(self.path), "w") as f:
            f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        private_files.replace_from_temp(self.path)
        self.close()
        self.fd = private_files.open_file(self.path, os.O_WRONLY | os.O_APPEND)
        self.lines = len(records)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def load(directory: Path, cache: Cache, ram_arena_id: str, taken: dict[str, int]) -> dict[str, Replica]:
    """The replicas a previous run held (at start-up, before anything allocates): their blocks
    are adopted by the cache. ``taken``: origin -> the last of its ops the journal holds already
    (a takeover cut short after the journal took them): those go from its log."""
    private_files.ensure_dir(directory, "replica directory")
    replicas: dict[str, Replica] = {}
    for path in sorted(directory.glob("*.log")):
        origin = path.stem
        replica = Replica(origin, path, ram_arena_id)
        if not NODE_ID.fullmatch(origin):
            replica.remove()
            continue
        arena = None
        try:
            for line in private_files.read_file(path).decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                    kind = rec["t"]
                except (ValueError, KeyError, TypeError):
                    continue  # (a torn last line)
                if kind == "arena":
                    arena = rec["ram"]
                elif kind == "op":
                    replica.ops[rec["seq"]] = Op.from_record(rec)
                elif kind == "retarget" and rec["seq"] in replica.ops:
                    replica.ops[rec["seq"]].key = rec["key"]
                elif kind == "end":
                    replica.ops.pop(rec["seq"], None)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            log.error("replicas: cannot read %s (%s): dropped", path, exc)
            replica.ops.clear()
        for seq in [s for s in replica.ops if s <= taken.get(origin, 0)]:
            del replica.ops[seq]  # (the journal has it: its blocks are the journal's now)
        for seq, op in list(replica.ops.items()):
            lost_ram = arena != ram_arena_id and any(r is not None and r[0] == RAM for r in op.blocks)
            if lost_ram or any(r is not None and not cache.valid_ref(r) for r in op.blocks):
                log.error("replicas: %s of node %s was in a RAM tier lost since: dropped", op.key, origin)
                del replica.ops[seq]
        if not replica.ops:
            replica.remove()
            continue
        cache.adopt((op.size, op.blocks) for op in replica.ops.values())
        replica.rewrite()
        replicas[origin] = replica
    return replicas


class ReplicaHolder:
    """The replicas this node holds for others; the takeover of a lost origin's."""

    def __init__(
        self,
        cache: Cache,
        store: ObjectStore,
        members: Members,
        directory: Path,
        replicas: dict[str, Replica],
        takeover_after: float,
        adopt: Adopt,
        handover: Handover,
        max_streams: int,
        resumed: dict[str, int],
    ):
        self.cache = cache
        self.store = store
        self.members = members
        self.directory = directory
        self.replicas = replicas
        self.takeover_after = takeover_after
        self.adopt = adopt
        self.handover = handover
        self.token: trio.lowlevel.TrioToken | None = None
        # Origins taken over: by the last run (its journal resumes their ops; the hand-over
        # may have been cut short: it is done again) and by this one.
        self.resumed = dict(resumed)
        self.just_taken: dict[str, float] = {}  # origin -> when (until the listing shows the lease)
        self.unlisted: dict[str, float] = {}  # origin -> since when its record does not name this node
        # Replicas take at most half the cache: the rest stays this node's own.
        self.cap = (cache.tiers[0].budget + cache.tiers[1].budget) // 2
        self.held_blocks = sum(r.block_count() for r in replicas.values())
        self.takeovers = 0  # lost origins whose ops this node published
        self.received_bytes = 0
        self.streams = threading.BoundedSemaphore(max_streams)

    # -- life -----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.token = trio.lowlevel.current_trio_token()
        task_status.started()
        async with trio.open_nursery() as nursery:
            for origin, last in sorted(self.resumed.items()):
                nursery.start_soon(self._hand_over, origin, last)
            while True:
                await trio.sleep(POLL_S)
                try:
                    await self._look_after()
                except Exception:  # a bug here must not take the mount down
                    log.exception("replicas: looking after the replicas failed")

    async def _look_after(self) -> None:
        for origin in [o for o in self.just_taken if o in self.members.leases]:
            del self.just_taken[origin]  # (the listing shows the lease now: it decides)
        if time.monotonic() - self.members.listed_at > FRESH_LISTING_S:
            return  # (this node cannot tell who is silent without a fresh listing of the members)
        now = time.monotonic()
        for origin in list(self.replicas):
            replica = self.replicas.get(origin)
            if replica is None:
                continue
            # Its record says where it streams its replicas: a holder it left holds old news.
            record = self.members.known.get(origin, (None, None))[1]
            listed = record is None or self.members.node in record.holders
            # (a record put before its stream here began may not name this node yet)
            put_since = self.members.last_beat.get(origin, 0.0) > replica.streamed_at + RECORD_LAG_S
            moved = not listed and put_since
            if not moved:
                self.unlisted.pop(origin, None)
            elif now - self.unlisted.setdefault(origin, now) > self.takeover_after:
                log.info("replicas: node %s streams to other holders now: dropping its replica here", origin)
                self._drop(replica)
                continue
            if not moved and self.members.silent_for(origin) >= self.takeover_after:
                await self._take_over(replica)

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()

    def holds_blocks(self) -> bool:
        """Whether replicas hold cache blocks (their origins' uploads will free them)."""
        return self.held_blocks > 0

    # -- a stream, in a server thread -----------------------------------------------------------
    def session(self, request: dict, tls: ssl.SSLSocket, fingerprint: str) -> None:
        origin = str(request.get("replica", ""))
        member = self.members.known.get(origin, (None, None))[1]
        if (
            not NODE_ID.fullmatch(origin)
            or request.get("url") != self.store.url
            or member is None
            or member.fingerprint != fingerprint  # (a member streams only its own replica)
            or self._fenced(origin)
        ):
            send_answer(tls, "not a replica this node takes")
            return
        if not self.streams.acquire(blocking=False):
            send_answer(tls, "busy: too many replica streams")
            return
        try:
            send_answer(tls, 0)  # (the stream is taken)
            self._stream(origin, tls)
        finally:
            self.streams.release()

    def _stream(self, origin: str, tls: ssl.SSLSocket) -> None:
        buffer = memoryview(bytearray(self.cache.block_size))  # (one block per stream: daemon/limits.py)
        tls.settimeout(SESSION_IDLE_S)
        while True:
            length = read_frame_length(tls)
            if length is None:
                return
            with _LARGE_HEADER if length > SMALL_HEADER else contextlib.nullcontext():
                if not self._message(origin, tls, length, buffer):
                    return

    def _message(self, origin: str, tls: ssl.SSLSocket, length: int, buffer: memoryview) -> bool:
        """Read, store and answer one message whose header is ``length`` bytes (False: the
        stream ends)."""
        header = read_frame_body(tls, length)
        if header is None:
            return False
        n = header["n"]
        if n > len(buffer):
            send_answer(tls, "a body larger than a block")
            return False
        recv_into(tls, buffer[:n])
        try:
            value = self._on_trio(self._receive, origin, header, buffer[:n])
        except Exception as exc:  # noqa: BLE001 - the origin chooses another holder
            log.warning("replicas: refusing node %s's stream: %s", origin, exc)
            send_answer(tls, f"{type(exc).__name__}: {exc}"[:200])
            return False
        send_answer(tls, value)
        return True

    def _fenced(self, origin: str) -> bool:
        """A holder took ``origin``'s replica over and it has not come back since (its start
        drops what was taken over, then the lease): nothing more of it is held."""
        recent = time.monotonic() - self.just_taken.get(origin, -LEASE_SEEN_S) < LEASE_SEEN_S
        return origin in self.members.leases or recent

    def _on_trio(self, fn, *args):
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    async def _receive(self, origin: str, header: dict, body: memoryview) -> int:
        if self._fenced(origin):
            raise OSError(errno.ESTALE, "taken over")
        replica = self.replicas.get(origin)
        if replica is None:
            replica = self.replicas[origin] = Replica(
                origin, self.directory / f"{origin}.log", self.cache.ram_arena_id
            )
        kind = header.get("t")
        if kind == "block":
            w, index, stamp = _int(header["w"]), _int(header["i"], 0), _int(header["s"])
            if (self.held_blocks + 1) * self.cache.block_size > self.cap:
                raise OSError(errno.ENOSPC, "full: replicas take half this node's cache at most")
            ref = await self.cache.alloc()
            try:
                await trio.to_thread.run_sync(self.cache.fill, ref, body)
            except BaseException:
                self.cache.decref(ref)
                raise
            self.cache.fit(ref, len(body))
            if self.replicas.get(origin) is not replica:  # (dropped or taken over meanwhile)
                self.cache.decref(ref)
                raise OSError(errno.ESTALE, "this replica was dropped")
            old = replica.files.setdefault(w, {}).get(index)
            replica.files[w][index] = (ref, stamp)
            if old is not None:
                self._let_go(old[0])
            self.held_blocks += 1
            self.received_bytes += len(body)
            return 0
        if kind == "op":
            return self._hold_op(replica, header)
        if kind == "amend":
            self._amend(replica, header["rec"])
            return 0
        if kind == "forget":
            self._drop_file(replica, _int(header["w"]))
            return 0
        if kind == "reset":
            replica.streamed_at = time.time()
            keep = {_int(seq, 1) for seq in header["pending"]}
            for seq in [s for s in replica.ops if s not in keep]:
                self._end(replica, seq)
            for w in list(replica.files):
                self._drop_file(replica, w)
            return 0
        raise ValueError(f"unknown message {kind!r}")

    def _hold_op(self, replica: Replica, header: dict) -> int:
        op = _checked_op(header["op"], self.cache.block_size)
        w, have = _int(header["w"]), [_int(i, 0) for i in header["have"]]
        blocks = replica.files.get(w, {})
        held = replica.ops.get(op.seq)
        if held is not None:  # (sent again on a new stream: it is as it is now)
            held.key, held.replaces, held.meta = op.key, op.replaces, op.meta
            replica.record(held.to_record())
            if w < 0:
                self._drop_file(replica, w)
            return op.seq
        if op.kind == PUT:
            count = -(-op.size // self.cache.block_size)
            refs: list[BlockRef | None] = [None] * count
            for index in have:
                if index not in blocks or index >= count:
                    raise ValueError(f"op {op.seq} names block {index}, never sent")
                refs[index] = blocks[index][0]
            for ref in refs:
                if ref is not None:
                    self.cache.incref(ref)
                    self.held_blocks += 1
            op.blocks = refs
        replica.ops[op.seq] = op
        replica.record(op.to_record())
        if w < 0:
            self._drop_file(replica, w)
        return op.seq

    def _let_go(self, ref: BlockRef) -> None:
        self.cache.decref(ref)
        self.held_blocks -= 1

    def _drop_file(self, replica: Replica, w: int) -> None:
        for ref, _ in replica.files.pop(w, {}).values():
            self._let_go(ref)

    def _end(self, replica: Replica, seq: int) -> None:
        op = replica.ops.pop(seq)
        for ref in op.blocks:
            if ref is not None:
                self._let_go(ref)
        replica.record({"t": "end", "seq": seq})

    def _amend(self, replica: Replica, rec: dict) -> None:
        seq = _int(rec["seq"], 1)
        op = replica.ops.get(seq)
        if op is None:
            return
        if rec["t"] == "retarget":
            key = str(rec["key"])
            if not _valid_key(key):
                raise ValueError(f"not a key: {key[:100]!r}")
            op.key, op.replaces = key, ""
            replica.record({"t": "retarget", "seq": seq, "key": op.key})
        elif rec["t"] in ("done", "cancel"):
            self._end(replica, seq)

    # -- takeover -------------------------------------------------------------------------------
    def _lease_key(self, origin: str) -> str:
        return f"{TAKEOVER_PREFIX}{origin}.json"

    async def _put_lease(self, lease: dict) -> float:
        """Write the lease; how long the store took."""
        started = time.monotonic()
        body = json.dumps(lease).encode()
        await trio.to_thread.run_sync(
            self.store.put, self._lease_key(lease["origin"]), body, abandon_on_cancel=True
        )
        return time.monotonic() - started

    async def _take_over(self, replica: Replica) -> None:
        origin, me = replica.origin, self.members.node
        if not replica.ops:
            self._drop(replica)
            return
        seqs = sorted(replica.ops)
        try:
            lease = await read_lease(self.store, origin)
            if lease is not None and lease.get("holder") != me:
                if set(lease.get("seqs", [])) >= set(seqs) and lease.get("state") != CLAIMING:
                    log.info(
                        "replicas: %s took node %s over: dropping its replica", lease.get("holder"), origin
                    )
                    self._drop(replica)
                    return
                if self.members.silent_for(str(lease.get("holder"))) < self.takeover_after:
                    return  # a live holder has it
            ours = lease is not None and lease.get("holder") == me
            epoch = int(lease.get("epoch", 0)) + (0 if ours else 1) if lease is not None else 1
            mine = {"origin": origin, "holder": me, "epoch": epoch, "state": CLAIMING, "seqs": seqs}
            took = await self._put_lease({**mine, "at": time.time()})
            await trio.sleep(LEASE_SETTLE_S)
            lease = await read_lease(self.store, origin)
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            log.warning("replicas: could not take the lease on node %s's replica: %s", origin, exc)
            return
        if lease is None or lease.get("holder") != me or lease.get("epoch") != epoch:
            return  # another holder's, or the origin came back and dropped it
        if took > LEASE_SETTLE_S / 2 or self.members.silent_for(origin) < self.takeover_after:
            return  # (too slow to be sure no other holder read the lease meanwhile; or it is back)
        if self.replicas.get(origin) is not replica or sorted(replica.ops) != seqs:
            return  # (dropped, or changed meanwhile: the next round)
        ops = [replica.ops[s] for s in seqs]
        log.warning(
            "replicas: node %s has been silent for %.0f s: publishing its %d pending operations "
            "(lease epoch %d)",
            origin,
            self.members.silent_for(origin),
            len(ops),
            epoch,
        )
        # The hand-over: the journal takes the ops (and their blocks), then the log goes (a
        # restart that finds both keeps only the log's ops the journal does not have).
        try:
            last = self.adopt(origin, ops)
        except Exception:  # a journal that cannot be written: this node is in trouble anyway
            log.exception("replicas: could not take node %s's operations over", origin)
            return
        self.held_blocks -= sum(1 for op in ops for ref in op.blocks if ref is not None)
        replica.ops = {}
        self._drop(replica)
        self.just_taken[origin] = time.monotonic()
        self.takeovers += 1
        try:
            await self._put_lease({**mine, "state": TAKEN, "at": time.time()})
        except Exception as exc:  # noqa: BLE001 - it stays "claiming": the origin waits a while
            log.warning("replicas: could not record the takeover of node %s: %s", origin, exc)
        await self._hand_over(origin, last, mine)

    async def _hand_over(self, origin: str, last: int, lease: dict | None = None) -> None:
        """This node's writer records cover the ops taken over, the origin's go; once they are
        all in the store, the lease says so (the origin, back, then goes on at once)."""
        try:
            await self.handover(origin, last)
            lease = lease or await read_lease(self.store, origin)
            if lease is not None and lease.get("holder") == self.members.node:
                await self._put_lease({**lease, "state": PUBLISHED, "at": time.time()})
        except Exception as exc:  # noqa: BLE001 - its records age out (--lost-node-after)
            log.warning("replicas: the hand-over of node %s's files: %s", origin, exc)

    def _drop(self, replica: Replica) -> None:
        for seq in list(replica.ops):
            self._end(replica, seq)
        for w in list(replica.files):
            self._drop_file(replica, w)
        replica.remove()
        self.replicas.pop(replica.origin, None)
        self.unlisted.pop(replica.origin, None)

    def status(self) -> dict:
        return {
            "held_for": sorted(self.replicas),
            "replica_held_bytes": self.held_blocks * self.cache.block_size,
            "replica_received_bytes": self.received_bytes,
            "takeovers": self.takeovers,
        }


def _int(value, least: int | None = None) -> int:
    """A number from a peer's message (ValueError if not one, or below ``least``)."""
    if not isinstance(value, int) or isinstance(value, bool) or (least is not None and value < least):
        raise ValueError(f"not a number here: {value!r:.50}")
    return value


def _valid_key(key: str) -> bool:
    """A key a mount could have made: relative, no empty, "." or ".." part, not ckptfs's own."""
    if not key or key.startswith("/") or len(key.encode()) > 1024:
        return False
    parts = key.rstrip("/").split("/")
    return not any(p in ("", ".", "..") for p in parts) and not parts[0].startswith(RESERVED_PREFIX)


def _checked_op(rec, block_size: int) -> Op:
    """An op record from a peer, checked before anything of it is kept."""
    if not isinstance(rec, dict):
        raise ValueError("not an op")
    rec = dict(rec, blocks=[])
    op = Op.from_record(rec)
    _int(op.seq, 1)
    _int(op.size, 0)
    if op.kind not in KINDS or not _valid_key(op.key) or (op.kind == MOVE and not _valid_key(op.src)):
        raise ValueError(f"not an op this node publishes: {op.kind} {op.key[:100]!r}")
    if op.size > MAX_OBJECT or (op.upload is not None and not _upload_ok(op.upload)):
        raise ValueError(f"op {op.seq}: a size or upload out of bounds")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in op.meta.items()):
        raise ValueError(f"op {op.seq}: metadata not strings")
    return op


def _upload_ok(upload) -> bool:
    return isinstance(upload, list) and len(upload) == 3 and all(isinstance(x, str) for x in upload)
