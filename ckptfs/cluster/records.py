"""Writer records: what this node tells the other nodes of its store about the directories it
is writing, through the store itself (no other channel, no new server).

A node writing into a directory keeps one small object in the store while it holds anything
there that is not yet published: ``.ckptfs-writers/<directory>/<node>.data`` while files are
open or committed and not yet in the store, ``<node>.marks`` once only checkpoint markers wait
(markers wait for the data of other nodes, never for each other's markers: two nodes each
holding a marker of one step do not wait for one another). A node about to publish a marker
lists the records under the step it stands for (``others``): one listing tells it whether any
other node still holds files of that step (``model/gate.py``).

Cost: the record is written once per node per directory, when the first file there is created
(the close waits for it only if it is not in the store yet: for a file written for more than a
store round trip, never; with ``--cluster``, nor for a record every live peer has taken:
``cluster/peer_records.py``), and deleted once the node's files there are all published and the
directory has been idle for ``IDLE_S``. A record must be in the store before the close that
commits a file under it returns: a framework writes its pointer after a barrier that follows
every rank's close, so the pointer's node then sees the record. When the store does not take
it within ``--record-timeout`` (nor, with ``--cluster``, every live peer) the close goes on without
it (one warning, a counter, and the directory in status).

A node lost for good leaves its records. They keep holding the markers of the save it was lost
in, but not those of a save made after its loss into the same directories (a job resumed from
the step before writes that step again): while a node holds records it refreshes a heartbeat
(``.ckptfs-nodes/<node>``) every ``lost_after / 6`` seconds, and a record whose node's heartbeat
is older than ``--lost-node-after`` is ignored for a marker written after that moment.

Node ids are random and kept in the cache dir: a node restarted on its cache dir is the same
node (its journal resumes its uploads, and the sweep at start deletes what it no longer holds).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from ckptfs.store.base import RESERVED_PREFIX, ObjectStore
from ckptfs.util import private_files

log = logging.getLogger(__name__)

PREFIX = RESERVED_PREFIX + "writers/"
NODES_PREFIX = RESERVED_PREFIX + "nodes/"  # a heartbeat per node holding records: <node>
DATA, MARKS = "data", "marks"
IDLE_S = 0.5  # a directory idle this long after its last file was published loses its record
SWEEP_S = 0.25
NODE_FILE = "node.id"

# (key, fn, *args) -> fn's result, retried until it works (the uploader's StoreCalls.call)
StoreCall = Callable[..., Awaitable]


def node_id(cache_dir: Path) -> str:
    """This node's id: read from the cache dir, made once."""
    path = cache_dir / NODE_FILE
    try:
        text = private_files.read_file(path, 64).decode("ascii", "replace").strip()
        if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
            return text
    except FileNotFoundError:
        pass
    text = secrets.token_hex(8)
    private_files.write_file(path, text.encode())
    return text


def dir_key(key: str) -> str:
    """The directory of ``key`` as a key ending in "/" ("" for the top)."""
    directory = key.rsplit("/", 1)[0] if "/" in key else ""
    return directory + "/" if directory else ""


def record_key(directory: str, node: str, state: str) -> str:
    """``directory``: a key ending in "/"."""
    return f"{PREFIX}{directory}{node}.{state}"


@dataclass(frozen=True)
class Record:
    directory: str  # ending in "/"
    node: str
    state: str  # DATA or MARKS
    mtime: float  # when the store took it

    @classmethod
    def parse(cls, key: str, mtime: float) -> Record | None:
        if not key.startswith(PREFIX) or key.endswith("/"):
            return None
        directory, _, leaf = key[len(PREFIX) :].rpartition("/")
        node, _, state = leaf.partition(".")
        if not directory or state not in (DATA, MARKS) or len(node) != 16:
            return None
        return cls(directory + "/", node, state, mtime)


class Relay(Protocol):
    """Records told to the live peers directly (``cluster/peer_records.py``, with --cluster)."""

    def covers(self, directory: str) -> bool: ...
    def others(self, scope: str) -> list[Record]: ...
    def heard(self) -> dict[str, float]: ...
    def forget(self, node: str) -> None: ...
    def poke(self) -> None: ...
    def status(self) -> dict: ...


class WriterRecords:
    """This node's records, kept to what ``in_use`` says. ``in_use()``: directory -> DATA or
    MARKS for every directory (a key ending in "/") where this node holds something unpublished.
    ``call``: a store call retried until it works. ``failing()``: the store is known to be in
    trouble (a close then does not wait for a record)."""

    def __init__(
        self,
        store: ObjectStore,
        node: str,
        in_use: Callable[[], dict[str, str]],
        call: StoreCall,
        failing: Callable[[], bool],
        timeout: float,
        lost_after: float = 300.0,
        relay: Relay | None = None,
    ):
        self.store = store
        self.node = node
        self.in_use = in_use
        self.call = call
        self.failing = failing
        self.timeout = timeout
        self.lost_after = lost_after
        self.beating = False  # the heartbeat is in the store (and kept fresh while records are)
        self.target: dict[str, str] = {}  # directory -> the state its record should have
        self.present: dict[str, set[str]] = {}  # directory -> states of ours the store holds
        self.last_use: dict[str, float] = {}
        self.busy: set[str] = set()  # directories a reconcile task is working on
        self.changed = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.body = json.dumps({"node": node, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        self.written = 0
        self.deleted = 0
        self.unrecorded = 0  # closes that went on without their record (the store did not take it)
        self.unrecorded_since: dict[str, float] = {}  # directory -> when a close first went on without
        self._warned: set[str] = set()
        self.relay = relay  # --cluster: the live peers hear of this node's records directly too

    # -- this node's side (on the trio loop, no awaits) --------------------------------------------
    def want(self, directory: str) -> None:
        """A file is being written under ``directory`` (a key ending in "/"; "" is ignored)."""
        if not directory or not self.room(directory):
            return
        self.last_use[directory] = time.monotonic()
        if self.target.get(directory) != DATA:
            self.target[directory] = DATA
            self._reconcile(directory)

    def room(self, directory: str) -> bool:
        if len(record_key(directory, self.node, MARKS).encode()) <= self.store.key_room():
            return True
        if directory not in self._warned:
            self._warned.add(directory)
            log.warning("no writer record for %s: its key would be too long for the store", directory)
        return False

    def unsettled(self) -> list[str]:
        relay = self.relay
        return [d for d in self.target if not self.present.get(d) and not (relay and relay.covers(d))]

    async def settled(self) -> None:
        """Return once every directory this node writes has its record in the store; at most
        ``timeout`` seconds (not at all while the store is known to be failing)."""
        if not self.unsettled():
            return
        if not self.failing() or self.relay is not None:
            with trio.move_on_after(self.timeout):
                while self.unsettled():
                    await self._wait_change()
                return
        missing = self.unsettled()
        self.unrecorded += 1
        for directory in missing:
            self.unrecorded_since.setdefault(directory, time.time())
        if missing[0] not in self._warned:
            self._warned.add(missing[0])
            log.warning(
                "the store has not taken this node's record of %s yet; going on without it: a "
                "marker another node writes for this step may reach the store before these files",
                missing[0],
            )

    async def let_go(self, timeout: float) -> None:
        """At a clean umount, once everything is published: delete this node's records now (not
        after the idle delay), waiting at most ``timeout`` seconds. A record left (the store
        down) is deleted by the next mount with this cache dir."""
        uses = self.in_use()
        for directory in list(self.target):
            if directory not in uses:
                del self.target[directory]
                self._reconcile(directory)
        with trio.move_on_after(timeout):
            while any(d not in uses for d in self.present):
                await self._wait_change()
            if self.beating and not self.present:
                await self.call(self.heartbeat_key(), self.store.delete, self.heartbeat_key())
                self.beating = False

    def heartbeat_key(self) -> str:
        return NODES_PREFIX + self.node

    # -- other nodes' records --------------------------------------------------------------------------
    def others(self, scope: str) -> list[Record]:
        """Other nodes' records under the directory ``scope`` (blocking: one listing)."""
        found = []
        for info in self.store.list(PREFIX + scope):
            record = Record.parse(info.key, info.mtime)
            if record is not None and record.node != self.node:
                found.append(record)
        if self.relay is not None:  # (what peers told this node, though the store may not hold it)
            listed = {(r.node, r.directory, r.state) for r in found}
            found += [r for r in self.relay.others(scope) if (r.node, r.directory, r.state) not in listed]
        return found

    def heartbeats(self) -> dict[str, float]:
        """Every node's last heartbeat (store time), by node (blocking: one listing)."""
        beats = {}
        for info in self.store.list(NODES_PREFIX):
            node = info.key[len(NODES_PREFIX) :]
            if len(node) == 16 and "/" not in node:
                beats[node] = info.mtime
        if self.relay is not None:
            for node, heard in self.relay.heard().items():
                beats[node] = max(beats.get(node, 0.0), heard)
        return beats

    def lost(self, record: Record, beats: dict[str, float], now: float) -> float | None:
        """When ``record``'s node was last heard of, if it is lost (no heartbeat for
        ``lost_after``; a record with none: since the record), else None."""
        heard = max(beats.get(record.node, 0.0), record.mtime)
        return heard if now - heard > self.lost_after else None

    # -- the worker ----------------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            nursery.start_soon(self._adopt_own)
            nursery.start_soon(self._beat)
            while True:
                self._sweep()
                await trio.sleep(SWEEP_S)

    async def _adopt_own(self) -> None:
        """Records a run of this node before a crash left: the sweep deletes those not in use."""
        try:
            infos = await self.call(PREFIX, lambda: list(self.store.list(PREFIX)))
        except Exception as exc:  # noqa: BLE001 - best effort: a later start sweeps again
            log.warning("could not list this node's old writer records: %s", exc)
            return
        now = time.monotonic()
        for info in infos:
            record = Record.parse(info.key, info.mtime)
            if record is not None and record.node == self.node:
                self.present.setdefault(record.directory, set()).add(record.state)
                self.target.setdefault(record.directory, record.state)
                self.last_use.setdefault(record.directory, now)
        self._sweep()

    async def _beat(self) -> None:
        """The heartbeat, refreshed while this node holds records (an idle node costs nothing)."""
        key = self.heartbeat_key()
        while True:
            if self.target or self.present:
                await self.call(key, self.store.put, key, self.body)
                self.beating = True
                self.signal()
                await trio.sleep(self.lost_after / 6)
            else:
                if self.beating:
                    await self.call(key, self.store.delete, key)
                    self.beating = False
                    continue
                await self._wait_change()

    def _sweep(self) -> None:
        uses = self.in_use()
        now = time.monotonic()
        for directory, state in uses.items():
            if directory and (directory in self.target or self.room(directory)):
                self.last_use[directory] = now
                if self.target.get(directory) != state:
                    self.target[directory] = state
                    self._reconcile(directory)
        for directory in list(self.target):
            if directory not in uses and now - self.last_use.get(directory, 0.0) >= IDLE_S:
                del self.target[directory]
                self.last_use.pop(directory, None)
                self._reconcile(directory)

    def _reconcile(self, directory: str) -> None:
        if self.relay is not None:
            self.relay.poke()
        if directory in self.busy or self.nursery is None:
            return
        self.busy.add(directory)
        self.nursery.start_soon(self._converge, directory)

    async def _converge(self, directory: str) -> None:
        """Make the store hold exactly the record ``target`` says (a new state before the old
        one goes: never a moment without a record while something is held)."""
        try:
            while True:
                want = self.target.get(directory)
                have = self.present.setdefault(directory, set())
                if want is not None and want not in have:
                    key = record_key(directory, self.node, want)
                    await self.call(key, self.store.put, key, self.body)
                    have.add(want)
                    self.written += 1
                    self.signal()
                    continue
                stale = [s for s in have if s != want]
                if not stale:
                    break
                key = record_key(directory, self.node, stale[0])
                await self.call(key, self.store.delete, key)
                have.discard(stale[0])
                self.deleted += 1
                self.signal()
        finally:
            self.busy.discard(directory)
            if not self.present.get(directory):
                self.present.pop(directory, None)

    async def remove_node(self, node: str) -> None:
        """Delete another node's records (its pending files are this node's now: a takeover of
        its replica, cluster/replicas.py)."""
        if self.relay is not None:
            self.relay.forget(node)
        infos = await self.call(PREFIX, lambda: list(self.store.list(PREFIX)))
        for info in infos:
            record = Record.parse(info.key, info.mtime)
            if record is not None and record.node == node:
                await self.call(info.key, self.store.delete, info.key)

    def signal(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _wait_change(self) -> None:
        await self.changed.wait()

    def unrecorded_dirs(self) -> dict[str, float]:
        """Directories where a close went on without its record, still not taken: another
        node's pointer may reach the store before their files (directory -> since)."""
        self.unrecorded_since = {
            d: t for d, t in self.unrecorded_since.items() if d in self.target and not self.present.get(d)
        }
        relay = self.relay
        return {d: t for d, t in self.unrecorded_since.items() if not (relay and relay.covers(d))}

    def status(self) -> dict:
        return {
            "node": self.node,
            "directories": len(self.target),
            "written": self.written,
            "deleted": self.deleted,
            "unrecorded": self.unrecorded,
            "unrecorded_dirs": sorted(self.unrecorded_dirs()),
            "heartbeat": self.beating,
            **({"told_to_peers": self.relay.status()} if self.relay is not None else {}),
        }
