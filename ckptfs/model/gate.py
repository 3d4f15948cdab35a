"""Checkpoint markers published only once what they stand for is in the store, whichever node
wrote it: the uploader's ``PublishGate`` (transfer/uploader.py).

On one node, publication in commit order already puts a marker after the files committed
before it. Across nodes it does not: node A's ``.metadata`` or ``latest`` may reach the store
while node B's shards are still in B's cache, and a B lost then leaves a checkpoint that looks
whole. So before a marker (``cluster/markers.py``) is published the gate asks:

1. this node: is any op committed before the marker and still pending (a held marker) under
   what it stands for? (no store call)
2. the other nodes: does any hold unpublished files there? One listing of the writer records
   under the step's directory (``cluster/records.py``): a record of another node's data (for a
   pointer: data or a held marker) means not yet;
3. the files a listing marker names (and the step a pointer names) are in the store: known from
   this node's tree when it published them itself, else one listing of their directory.

Not yet: the uploader holds the marker aside (later files publish as usual) and asks again,
less and less often (at most one listing per marker and round). What each held marker waits
for is kept for status (``waiting``) and for a sync that times out.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio

from ckptfs.cache.contents import Content
from ckptfs.cache.journal import DELETE, MOVE, PUT, Op
from ckptfs.cluster import markers
from ckptfs.cluster.markers import POINTER, Marker
from ckptfs.cluster.records import DATA, MARKS, WriterRecords, dir_key
from ckptfs.model.tree import MODE_META, MTIME_META, Tree
from ckptfs.store.base import ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer import retry
from ckptfs.transfer.upload_tasks import Task, in_thread_if_large

log = logging.getLogger(__name__)


@dataclass
class Wait:
    """Why a marker is not published yet."""

    key: str
    since: float = field(default_factory=time.time)
    here: list[str] = field(default_factory=list)  # this node's files it waits for
    nodes: dict[str, list[str]] = field(default_factory=dict)  # other node -> its directories
    missing: list[str] = field(default_factory=list)  # named files not in the store
    lost: dict[str, list[str]] = field(default_factory=dict)  # records of nodes lost before it, ignored
    checks: int = 0
    absent_since: float | None = None  # (wall clock) since when it names what nobody holds

    def describe(self) -> str:
        parts = []
        if self.here:
            parts.append(f"{_few(self.here)} on this node")
        for node, dirs in sorted(self.nodes.items()):
            parts.append(f"files under {_few(dirs)} on node {node}")
        if self.missing:
            where = "in no store and on no node we know of"
            if self.absent_since is not None:
                where += ", since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.absent_since))
            parts.append(f"{_few(self.missing)}, {where}")
        return "; ".join(parts) or "the store"

    def to_json(self) -> dict:
        return {
            "marker": self.key,
            "since": self.since,
            "this_node": list(self.here),
            "other_nodes": {n: list(d) for n, d in self.nodes.items()},
            "missing": list(self.missing),
            "missing_since": self.absent_since,
            "lost_nodes_ignored": {n: list(d) for n, d in self.lost.items()},
            "checks": self.checks,
        }


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


class MarkerGate:
    def __init__(
        self,
        tree: Tree,
        store: ObjectStore,
        records: WriterRecords,
        health: StoreHealth,
        plain: Iterable[str] = (),
    ):
        self.tree = tree
        self.store = store
        self.records = records
        self.health = health
        self.plain = tuple(plain)  # --no-marker globs
        self.described: dict[int, Marker | None] = {}  # by op seq, once read
        self.waits: dict[int, Wait] = {}  # held markers by op seq
        self.listings = 0  # store listings the gate made (status: its cost)
        self.limiter = trio.CapacityLimiter(2)

    # -- the uploader's questions -----------------------------------------------------------------------
    def gated(self, op: Op) -> bool:
        if op.kind not in (PUT, MOVE):
            return False
        return markers.kind_of(op.key, _mode(op), self.plain) is not None

    async def clear(self, task: Task, earlier: Iterable[Op]) -> bool:
        """Whether the marker ``task`` puts may be published now. ``earlier``: this node's ops
        still pending that were committed before it."""
        op = task.op
        marker = await self._describe(task)
        if marker is None:
            return True
        # (a fresh answer, filled while the store is asked: status shows the last whole one meanwhile)
        last = self.waits.get(op.seq)
        wait = Wait(op.key)
        if last is not None:
            wait.since, wait.checks, wait.absent_since = last.since, last.checks, last.absent_since
        wait.checks += 1
        try:
            ready = await self._check(marker, earlier, wait, self._written_at(op))
        except Exception as exc:  # noqa: BLE001 - asked again next round
            wait.missing = [f"(the store did not answer: {exc})"]
            ready = False
        if not wait.missing:
            wait.absent_since = None
        if op.seq not in self.described:  # forgotten meanwhile (replaced, dropped): keep no wait for it
            return ready
        if ready:
            self.waits.pop(op.seq, None)
        else:
            if op.seq not in self.waits:
                log.info("marker %s waits: %s", op.key, wait.describe())
            self.waits[op.seq] = wait
        return ready

    def drops(self, op: Op, held: Op, published: bool) -> str | None:
        """Why ``op`` (just submitted; or just published, ``published``) leaves the held marker
        ``held`` nothing to do, or None."""
        marker = self.described.get(held.seq)
        if published:
            newer = self.described.get(op.seq)
            if (
                marker is not None
                and newer is not None
                and marker.series == newer.series
                and marker.number is not None
                and newer.number is not None
                and newer.number > marker.number
            ):
                return f"step {newer.number} of its series is in the store ({newer.key})"
            return None
        if op.key == held.key and op.kind in (PUT, MOVE, DELETE):
            return "replaced" if op.kind != DELETE else "deleted"
        if op.kind == DELETE and marker is not None and marker.scope and op.key == marker.scope:
            return f"its step {marker.scope} is deleted"
        return None

    def writing_in(self, pending: Iterable[Op]) -> dict[str, str]:
        """Directories where this node holds something unpublished, for its writer records:
        DATA where files are open for writing or committed and not published, MARKS where only
        markers wait."""
        uses: dict[str, str] = {}
        for op in pending:
            if op.kind in (PUT, MOVE):
                directory = dir_key(op.key)
                if uses.get(directory) != DATA:
                    uses[directory] = MARKS if self.gated(op) else DATA
        for handle in self.tree.handles.values():
            if handle.writing is not None and not handle.node.unlinked:
                uses[dir_key(handle.node.key())] = DATA
        uses.pop("", None)
        return uses

    def forget(self, seq: int) -> None:
        self.described.pop(seq, None)
        self.waits.pop(seq, None)

    def waiting(self) -> list[Wait]:
        return list(self.waits.values())

    # -- the checks ---------------------------------------------------------------------------------------
    async def _describe(self, task: Task) -> Marker | None:
        op = task.op
        known = self.described.get(op.seq)
        if known is not None and known.key == op.key:
            return known
        kind = markers.kind_of(op.key, _mode(op), self.plain)
        marker = None
        if kind is not None:
            content = self._content(task, markers.read_limit(kind, op.key))
            if content is None:  # its bytes are not all in the cache: what its directory holds
                directory = posixpath.dirname(op.key)
                marker = Marker(op.key, markers.STEP, directory + "/") if directory else None
            else:
                try:  # (a DCP .metadata may be tens of MB: read and unpickled off the FUSE loop)
                    data = await in_thread_if_large(self.limiter, content.size, _bytes_of, content)
                    if kind == POINTER:
                        marker = await self._resolve_pointer(op.key, data)
                    else:
                        marker = await in_thread_if_large(
                            self.limiter, len(data), markers.describe, op.key, kind, data
                        )
                finally:
                    content.release()
        self.described[op.seq] = marker
        return marker

    def _content(self, task: Task, limit: int) -> Content | None:
        """The marker's content, held, if all cached (a rename onto a marker's name moves the
        version the tree holds there)."""
        content = task.content
        if task.op.kind == MOVE:
            node = self.tree.find_path(task.op.key)
            content = node.version.content if node is not None and node.version is not None else None
        if content is None or content.size > limit or content.missing(0, content.size):
            return None
        return content.hold()

    async def _resolve_pointer(self, key: str, data: bytes) -> Marker | None:
        """The step a pointer names: a directory or file this node's tree, the store's listing of
        the pointer's directory, or another node's writer records (a step still being written
        elsewhere) knows. None when it names nothing anyone has: no checkpoint pointer as far as
        we can tell (published as it is)."""
        candidates = markers.pointer_candidates(key, data)
        if not candidates:
            return None
        directory = posixpath.dirname(key)
        prefix = directory + "/" if directory else ""
        listing: tuple[set[str], set[str]] | None = None
        elsewhere: set[str] | None = None
        for path, number in candidates:
            node = self.tree.find_path(path)
            found_dir = node.is_dir if node is not None else None
            if found_dir is None:
                if listing is None:
                    listing = await self._list_dir(prefix)
                name = posixpath.basename(path)
                found_dir = True if name in listing[1] else False if name in listing[0] else None
            if found_dir is None:
                if elsewhere is None:
                    elsewhere = {r.directory for r in await self._call(self.records.others, prefix)}
                if any(d.startswith(path + "/") for d in elsewhere):
                    found_dir = True
            if found_dir is None:
                continue
            scope, names = (path + "/", frozenset()) if found_dir else ("", frozenset({path}))
            return Marker(key, POINTER, scope, names, series=directory, number=number)
        return None

    async def _check(self, marker: Marker, earlier: Iterable[Op], wait: Wait, written_at: float) -> bool:
        scope = marker.scope
        for other in earlier:
            for key in (other.key, other.src):
                if key and ((scope and key.startswith(scope)) or key in marker.names):
                    wait.here.append(key)
        if wait.here:
            return False
        if scope:
            blocking = (DATA,) if marker.kind != POINTER else None
            records = [
                r
                for r in await self._call(self.records.others, scope)
                if blocking is None or r.state in blocking
            ]
            if records:  # a node lost before this marker was written holds nothing of its save
                beats = await self._call(self.records.heartbeats)
                now = time.time()
                for record in records:
                    heard = self.records.lost(record, beats, now)
                    if heard is not None and written_at > heard + self.records.lost_after:
                        wait.lost.setdefault(record.node, []).append(record.directory)
                    else:
                        wait.nodes.setdefault(record.node, []).append(record.directory)
            if wait.nodes:
                return False
        unknown = sorted(n for n in marker.names if not self._durable_here(n))
        if unknown:
            present: set[str] = set()
            for directory in sorted({posixpath.dirname(n) for n in unknown}):
                files, _dirs = await self._list_dir(directory + "/" if directory else "")
                present |= {posixpath.join(directory, f) if directory else f for f in files}
            wait.missing = [n for n in unknown if n not in present]
        if marker.kind == POINTER and scope and not self._has_durable_files(scope):
            files, dirs = await self._list_dir(scope)
            if not files and not dirs:
                wait.missing = [scope]
        if not wait.missing:
            return True
        # Named, yet in no store and on no node we know of: held until it shows up, the marker is
        # replaced, its step is deleted or a newer step of its series is published (``drops``),
        # never published on a timeout: a disk never shows a .metadata naming a shard not written.
        if wait.absent_since is None:
            wait.absent_since = time.time()
        return False

    def _written_at(self, op: Op) -> float:
        """When the marker was written (its mtime, journaled with it), wall-clock seconds."""
        text = op.meta.get(MTIME_META, "") if op.meta else ""
        try:
            return float(text)
        except ValueError:
            node = self.tree.find_path(op.key)
            return node.mtime_ns / 1e9 if node is not None else time.time()

    def _durable_here(self, key: str) -> bool:
        node = self.tree.find_path(key)
        return (
            node is not None
            and not node.is_dir
            and node.version is not None
            and node.version.seq is None
            and node.version.content.key == key
        )

    def _has_durable_files(self, scope: str) -> bool:
        node = self.tree.find_path(scope.rstrip("/"))
        if node is None or not node.is_dir:
            return False
        return any(not n.is_dir and n.version is not None and n.version.seq is None for n in node.walk())

    async def _list_dir(self, directory: str) -> tuple[set[str], set[str]]:
        listing = await self._call(self.store.list_dir, directory)
        return {f.key.rsplit("/", 1)[-1] for f in listing.files}, {d.rstrip("/") for d in listing.dirs}

    async def _call(self, fn, *args):
        self.listings += 1
        return await retry.ANSWER.call(fn, *args, failing=self.health.in_trouble(), limiter=self.limiter)


def _bytes_of(content: Content) -> bytes:
    return bytes(content.read(0, content.size))


def _mode(op: Op) -> int:
    try:
        return int(op.meta.get(MODE_META, "0")) if op.meta else 0
    except ValueError:
        return 0
