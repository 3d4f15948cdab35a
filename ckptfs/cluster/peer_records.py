"""Writer records pushed over the peer channel (``--cluster``): a node tells its live peers what
it holds unpublished, so that their checkpoint markers wait for its files even when its records
never reach the store. A node cut off from the store (a partition, a dead route, an endpoint it
alone cannot reach) is the node most likely to be lost before its uploads end, and without this
its peers would not know it holds anything.

Sender: the whole set (directory -> DATA or MARKS, ``records.py``'s ``target``) goes to every
live peer when it changes, again every ``PUSH_S`` while it is not empty (the push is the peers'
heartbeat of it) and once more when it empties. A close counts its record as taken when the
store holds it or when every live peer has acknowledged a set naming its directory
(``WriterRecords.settled``): a framework writes its pointer after a barrier that follows that
close, so the pointer's node has the record by then.

Receiver: each node's last set, with when it was last heard, stands beside that node's records
in the store: the gate lists both (``WriterRecords.others``) and a node not heard from for
``--lost-node-after`` counts as lost for markers written after that, as with the store's
heartbeats. The sets are kept in the cache dir (``peer-records.json``, 0600), so a restart of
this node does not forget what a lost peer held. Bounded: a set is at most ``PUSH_MAX`` bytes of
JSON (the directories past it are not pushed: their closes wait for the store, as without
``--cluster``), at most ``NODES_MAX`` nodes are kept (the longest silent goes first).

A takeover of a lost node's replicas (``--replicas``) makes its files the holder's: the holder
tells its peers to forget the lost node's set (``forget`` in its pushes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ckptfs.cluster.members import Member
from ckptfs.cluster.records import DATA, MARKS, Record
from ckptfs.util import private_files

log = logging.getLogger(__name__)

PUSH_S = 2.0  # a set that is not empty is pushed again this often
PUSH_MAX = 5 << 10  # a pushed set's directories at most, as JSON (a peer channel request is at most 8 KiB)
NODES_MAX = 64  # other nodes' sets kept (with the sets: well under 1 MiB)
FORGOTTEN_MAX = 16  # lost nodes this node took over, told to the peers in every push
FILE = "peer-records.json"

# Push one set to one member: True once it acknowledged it.
Push = Callable[[Member, dict], Awaitable[bool]]


@dataclass
class Pushed:
    dirs: dict[str, str]  # directory (ending in "/") -> DATA or MARKS
    heard: float  # time.time() of its last push


def _valid_node(node: object) -> bool:
    return isinstance(node, str) and len(node) == 16 and all(c in "0123456789abcdef" for c in node)


class PeerRecords:
    """This node's records pushed to its peers, and the peers' records pushed to it."""

    def __init__(
        self,
        node: str,
        target: Callable[[], dict[str, str]],
        live: Callable[[], list[Member]],
        push: Push,
        changed: Callable[[], None],
        path: Path,
    ):
        self.node = node
        self.target = target  # what this node holds unpublished now (records.py's target)
        self.live = live
        self.push = push
        self.changed = changed  # wakes a close waiting in WriterRecords.settled
        self.path = path
        self.lock = threading.Lock()  # (``others`` and ``heard`` run in the gate's threads)
        self.sets: dict[str, Pushed] = self._load()
        self.acked: dict[str, dict[str, str]] = {}  # peer -> the last set it acknowledged
        self.forgotten: list[str] = []
        self.wake = trio.Event()
        self.dirty = trio.Event()
        self.pushes = 0
        self.push_failures = 0
        self.received = 0

    # -- this node's side -------------------------------------------------------------------------
    def covers(self, directory: str) -> bool:
        """Whether every live peer (at least one) has acknowledged a set naming ``directory``."""
        live = self.live()
        return bool(live) and all(directory in self.acked.get(m.node, {}) for m in live)

    def forget(self, node: str) -> None:
        """``node``'s files are this node's now (a takeover): drop its set here and tell the peers."""
        with self.lock:
            self.sets.pop(node, None)
        if node not in self.forgotten:
            self.forgotten = [*self.forgotten, node][-FORGOTTEN_MAX:]
        self.acked = {}  # (every peer hears of it, even those that hold nothing of ours)
        self.dirty.set()
        self.poke()

    def poke(self) -> None:
        """This node's set changed: push it now."""
        self.wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep)
            task_status.started()
            while True:
                with trio.move_on_after(PUSH_S):
                    await self.wake.wait()
                self.wake = trio.Event()
                dirs = self._bounded(self.target())
                request = {"records": 1, "node": self.node, "dirs": dirs, "forget": list(self.forgotten)}
                # (an empty set goes once to each peer that may still hold an older one)
                peers = [m for m in self.live() if dirs or self.acked.get(m.node) != {}]
                async with trio.open_nursery() as round_:
                    for member in peers:
                        round_.start_soon(self._push_one, member, request, dirs)

    async def _push_one(self, member: Member, request: dict, dirs: dict[str, str]) -> None:
        self.pushes += 1
        if await self.push(member, request):
            self.acked[member.node] = dirs
            self.changed()
        else:
            self.push_failures += 1

    def _bounded(self, dirs: dict[str, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        room = PUSH_MAX
        for directory, state in sorted(dirs.items()):
            room -= len(json.dumps(directory)) + 10
            if room < 0:
                break
            out[directory] = state
        return out

    # -- the peers' side ----------------------------------------------------------------------------
    def receive(self, node: str, request: dict) -> str:
        """A set ``node`` pushed (on the trio thread); "" when taken, else why not."""
        dirs, forget = request.get("dirs"), request.get("forget", [])
        if not isinstance(dirs, dict) or not isinstance(forget, list) or request.get("node") != node:
            return "bad records"
        if not all(isinstance(d, str) and d.endswith("/") and s in (DATA, MARKS) for d, s in dirs.items()):
            return "bad records"
        self.received += 1
        with self.lock:
            for lost in forget:
                if _valid_node(lost) and lost != self.node and lost != node:
                    self.sets.pop(lost, None)
            before = self.sets.get(node)
            if dirs:
                self.sets[node] = Pushed(dict(dirs), time.time())
                if len(self.sets) > NODES_MAX:
                    oldest = min(self.sets, key=lambda n: self.sets[n].heard)
                    del self.sets[oldest]
            else:
                self.sets.pop(node, None)
        if before is None or dirs != before.dirs or forget:
            self.dirty.set()
        return ""

    def others(self, scope: str) -> list[Record]:
        """Other nodes' pushed records under the directory ``scope`` (from any thread)."""
        with self.lock:
            return [
                Record(directory, node, state, pushed.heard)
                for node, pushed in self.sets.items()
                for directory, state in pushed.dirs.items()
                if directory.startswith(scope) and node != self.node
            ]

    def heard(self) -> dict[str, float]:
        """When each node that pushed a set was last heard (time.time(); from any thread)."""
        with self.lock:
            return {node: pushed.heard for node, pushed in self.sets.items()}

    def status(self) -> dict:
        with self.lock:
            held = {node: sorted(p.dirs) for node, p in self.sets.items()}
        return {
            "pushed": self.pushes,
            "push_failures": self.push_failures,
            "received": self.received,
            "peers_acknowledged": sorted(self.acked),
            "held_for_peers": held,
        }

    # -- kept in the cache dir ----------------------------------------------------------------------
    async def _keep(self) -> None:
        """Write the received sets to the cache dir after each change (off the trio thread)."""
        while True:
            await self.dirty.wait()
            self.dirty = trio.Event()
            with self.lock:
                data = {n: {"dirs": p.dirs, "heard": p.heard} for n, p in self.sets.items()}
            raw = json.dumps(data, separators=(",", ":")).encode()
            try:
                await trio.to_thread.run_sync(private_files.write_file, self.path, raw)
            except OSError as exc:
                log.warning("could not keep the peers' records in %s: %s", self.path, exc.strerror)
            await trio.sleep(0.05)  # (a burst of pushes costs one write)

    def _load(self) -> dict[str, Pushed]:
        try:
            data = json.loads(private_files.read_file(self.path, NODES_MAX * (PUSH_MAX + 256)))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring the peers' records in %s: %s", self.path, exc)
            return {}
        sets = {}
        for node, entry in data.items() if isinstance(data, dict) else ():
            try:
                dirs, heard = dict(entry["dirs"]), float(entry["heard"])
            except (KeyError, TypeError, ValueError):
                continue
            if _valid_node(node) and node != self.node and all(s in (DATA, MARKS) for s in dirs.values()):
                sets[node] = Pushed(dirs, heard)
        return sets
