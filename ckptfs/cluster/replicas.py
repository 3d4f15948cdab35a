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
from ckptfs.cache.journal import PUT, Op
from ckptfs.cluster.members import TAKEOVER_PREFIX, Members
from ckptfs.cluster.peer_channel import read_frame_header, recv_into, send_answer
from ckptfs.cluster.replication import read_lease
from ckptfs.store.base import ObjectStore
from ckptfs.util import private_files

log = logging.getLogger(__name__)

DIRECTORY = "replicas"
POLL_S = 1.0
LEASE_SETTLE_S = 2.0  # between writing the lease and reading it back
LEASE_SEEN_S = 10.0  # a lease just taken counts this long before the members' listing shows it
SESSION_IDLE_S = 300.0  # a stream silent this long is closed (its origin reopens it)
NODE_ID = re.compile(r"[0-9a-f]{16}")  # cluster/records.py node_id

# Hand a lost origin's ops, in order, to this node's journal and uploader (Commits.take_over).
Adopt = Callable[[str, list[Op]], None]
# Once those are this node's: make its writer records cover them and drop the origin's.
Handover = Callable[[str], Awaitable[None]]


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

    def held_bytes(self, block_size: int) -> int:
        blocks = sum(1 for op in self.ops.values() for ref in op.blocks if ref is not None)
        return (blocks + sum(len(f) for f in self.files.values())) * block_size

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


def load(directory: Path, cache: Cache, ram_arena_id: str, taken: set[str]) -> dict[str, Replica]:
    """The replicas a previous run held (at start-up, before anything allocates): their blocks
    are adopted by the cache. ``taken``: origins whose ops the journal already holds (a takeover
    that was cut short after its hand-over): their logs go."""
    private_files.ensure_dir(directory, "replica directory")
    replicas: dict[str, Replica] = {}
    for path in sorted(directory.glob("*.log")):
        origin = path.stem
        replica = Replica(origin, path, ram_arena_id)
        if not NODE_ID.fullmatch(origin) or origin in taken:
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
        resumed: set[str],
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
        # Origins taken over (their streams are refused): by this run, and by the last one,
        # whose ops its journal resumes (their hand-over may have been cut short: done again).
        self.taken: set[str] = set(resumed)
        self.just_taken: dict[str, float] = {}
        self.takeovers = 0  # lost origins whose ops this node published
        self.received_bytes = 0
        self.streams = threading.BoundedSemaphore(max_streams)

    # -- life -----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.token = trio.lowlevel.current_trio_token()
        task_status.started()
        for origin in sorted(self.taken):
            await self._hand_over(origin)
        while True:
            await trio.sleep(POLL_S)
            for origin in [o for o in self.just_taken if o in self.members.leases]:
                del self.just_taken[origin]  # (the listing shows the lease now: it decides)
            for origin in list(self.replicas):
                replica = self.replicas.get(origin)
                if replica is not None and self.members.silent_for(origin) >= self.takeover_after:
                    await self._take_over(replica)

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()

    # -- a stream, in a server thread -----------------------------------------------------------
    def session(self, request: dict, tls: ssl.SSLSocket) -> None:
        origin = str(request.get("replica", ""))
        if not NODE_ID.fullmatch(origin) or request.get("url") != self.store.url or self._fenced(origin):
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
            header = read_frame_header(tls)
            if header is None:
                return
            n = header["n"]
            if n > len(buffer):
                send_answer(tls, "a body larger than a block")
                return
            recv_into(tls, buffer[:n])
            try:
                value = self._on_trio(self._receive, origin, header, buffer[:n])
            except Exception as exc:  # noqa: BLE001 - the origin chooses another holder
                log.warning("replicas: refusing node %s's stream: %s", origin, exc)
                send_answer(tls, f"{type(exc).__name__}: {exc}")
                return
            send_answer(tls, value)

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
            w, index, stamp = int(header["w"]), int(header["i"]), int(header["s"])
            ref = await self.cache.alloc()
            try:
                await trio.to_thread.run_sync(self.cache.fill, ref, body)
            except BaseException:
                self.cache.decref(ref)
                raise
            self.cache.fit(ref, len(body))
            old = replica.files.setdefault(w, {}).get(index)
            replica.files[w][index] = (ref, stamp)
            if old is not None:
                self.cache.decref(old[0])
            self.received_bytes += len(body)
            return 0
        if kind == "op":
            return self._hold_op(replica, header)
        if kind == "amend":
            self._amend(replica, header["rec"])
            return 0
        if kind == "forget":
            for ref, _ in replica.files.pop(int(header["w"]), {}).values():
                self.cache.decref(ref)
            return 0
        raise ValueError(f"unknown message {kind!r}")

    def _hold_op(self, replica: Replica, header: dict) -> int:
        rec = dict(header["op"])
        rec["blocks"] = []
        op = Op.from_record(rec)
        w, have = int(header["w"]), [int(i) for i in header["have"]]
        blocks = replica.files.get(w, {})
        if op.seq in replica.ops:  # (sent again to a holder that kept it)
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
            op.blocks = refs
        replica.ops[op.seq] = op
        replica.record(op.to_record())
        if w < 0:
            self._drop_file(replica, w)
        return op.seq

    def _drop_file(self, replica: Replica, w: int) -> None:
        for ref, _ in replica.files.pop(w, {}).values():
            self.cache.decref(ref)

    def _amend(self, replica: Replica, rec: dict) -> None:
        seq = int(rec["seq"])
        op = replica.ops.get(seq)
        if op is None:
            return
        if rec["t"] == "retarget":
            op.key, op.replaces = str(rec["key"]), ""
            replica.record({"t": "retarget", "seq": seq, "key": op.key})
        elif rec["t"] in ("done", "cancel"):
            del replica.ops[seq]
            for ref in op.blocks:
                if ref is not None:
                    self.cache.decref(ref)
            replica.record({"t": "end", "seq": seq})

    # -- takeover -------------------------------------------------------------------------------
    def _lease_key(self, origin: str) -> str:
        return f"{TAKEOVER_PREFIX}{origin}.json"

    async def _take_over(self, replica: Replica) -> None:
        origin, me = replica.origin, self.members.node
        if not replica.ops:
            self._drop(replica)
            return
        through = max(replica.ops)
        try:
            lease = await read_lease(self.store, origin)
            if lease is not None and lease.get("holder") != me:
                if int(lease.get("through", 0)) >= through:
                    log.info(
                        "replicas: node %s was taken over by %s: dropping its replica",
                        origin,
                        lease.get("holder"),
                    )
                    self._drop(replica)
                    return
                if self.members.silent_for(str(lease.get("holder"))) < self.takeover_after:
                    return  # a live holder has it
            ours = lease is not None and lease.get("holder") == me
            epoch = int(lease.get("epoch", 0)) + (0 if ours else 1) if lease is not None else 1
            mine = {"origin": origin, "holder": me, "epoch": epoch, "through": through, "at": time.time()}
            await trio.to_thread.run_sync(self.store.put, self._lease_key(origin), json.dumps(mine).encode())
            await trio.sleep(LEASE_SETTLE_S)
            lease = await read_lease(self.store, origin)
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            log.warning("replicas: could not take the lease on node %s's replica: %s", origin, exc)
            return
        if lease is None or lease.get("holder") != me or lease.get("epoch") != epoch:
            return  # another holder's
        if self.replicas.get(origin) is not replica:
            return  # (dropped meanwhile)
        ops = [replica.ops[s] for s in sorted(replica.ops)]
        log.warning(
            "replicas: node %s has been silent for %.0f s: publishing its %d pending operations "
            "(lease epoch %d)",
            origin,
            self.members.silent_for(origin),
            len(ops),
            epoch,
        )
        # The hand-over: the journal takes the ops (and their blocks), then the log goes (a
        # restart that finds both drops the log: the journal's ops name their origin).
        self.adopt(origin, ops)
        replica.ops = {}
        self._drop(replica)
        self.taken.add(origin)
        self.just_taken[origin] = time.monotonic()  # (until the members' listing shows the lease)
        self.takeovers += 1
        await self._hand_over(origin)

    async def _hand_over(self, origin: str) -> None:
        try:
            await self.handover(origin)
        except Exception as exc:  # noqa: BLE001 - its records age out (--lost-node-after)
            log.warning("replicas: could not drop node %s's writer records: %s", origin, exc)

    def _drop(self, replica: Replica) -> None:
        for op in replica.ops.values():
            for ref in op.blocks:
                if ref is not None:
                    self.cache.decref(ref)
        replica.ops = {}
        for w in list(replica.files):
            self._drop_file(replica, w)
        replica.remove()
        self.replicas.pop(replica.origin, None)

    def status(self) -> dict:
        bs = self.cache.block_size
        return {
            "held_for": sorted(self.replicas),
            "replica_held_bytes": sum(r.held_bytes(bs) for r in self.replicas.values()),
            "replica_received_bytes": self.received_bytes,
            "takeovers": self.takeovers,
        }
