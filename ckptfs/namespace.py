"""The directory tree, open handles, and committed versus staged file contents.

The store is the source of truth: on start the tree is the store's listing with
the journal's pending ops laid over it. Each file node has one committed
``Version`` (what readers see); each handle opened for writing stages a private
copy (``StagedFile``), committed on flush/close by the last write: the snapshot
becomes the new version, a ``put`` op goes to the journal and the uploader.
Renames, unlinks and mkdirs become ops too, so the store ends with exactly what
the namespace says.

Every method that changes state does so without awaiting in the middle (trio is
single-threaded), so a change and its journal record are one atomic step.
Errors a user can hit are ``FsError`` with an errno.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from . import integrity
from .cache import DISK, RAM, Cache, Content, StagedFile
from .clean_index import CleanEntry, cached_digest
from .errors import FsError
from .fetcher import Fetcher
from .journal import DELETE, MKDIR, MOVE, PUT, Journal, Op
from .prefill import Prefill
from .store.base import (
    MAX_KEY_BYTES,
    MAX_PARTS,
    RESERVED_PREFIX,
    DirListing,
    ObjectInfo,
    PartInfo,
    StoreError,
)
from .uploader import Stream, Upload, Uploader

log = logging.getLogger(__name__)

ROOT_INODE = 1
MAX_NAME_BYTES = 255
MIN_MULTIPART = 5 << 20  # S3's smallest part: a multipart object is larger
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
CHECKPOINT_GAP_S = 60.0  # shards committed closer together than this belong to one save

# Refresh from the store (another mount's durable files): see "refresh from the store" below.
LIST_THREADS = 8  # listings and HEADs in flight (apart from data transfers)
STORE_MTIME_SLACK_S = 2.0  # S3 dates have whole seconds; a node's clock may be a little off the store's
UNSEEN_GRACE_S = 10.0  # a file this mount made durable is dropped as gone only once a listing could show it
NEGATIVE_CACHE_MAX = 65536  # names remembered as absent (then forgotten all at once)
# How long a readdir waits for the store before it answers from what it knows (a store that does
# not answer must not hang `ls`); shorter while the store is known to be failing (a refresh
# failed, or the shared StoreHealth saw a failed or unanswered call).
STORE_ANSWER_S, STORE_ANSWER_FAILING_S = 10.0, 0.25
# A lookup (and so every create: the kernel looks the name up first) waits at most this long;
# then it answers from what this mount knows and the store counts as failing.
LOOKUP_WAIT_S = 1.5


@dataclass
class Attr:
    ino: int
    is_dir: bool
    mode: int
    size: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    writing: bool = False  # a handle holds a staged copy: the kernel's size may be the writer's


class Version:
    """A committed content of a file; ``seq`` is its pending put op, None once durable."""

    def __init__(self, content: Content, seq: int | None):
        self.content = content.hold()
        self.seq = seq
        self.stamp: ObjectInfo | None = None  # how the store last showed this version (refresh)


class Shadow:
    """A disk-backed copy of a file's content, journaled by fsync as a put op that is not uploaded.

    It is what a restart after a node reboot (RAM tier lost) restores. ``covers`` is the seq of
    the version it stands for (None while it belongs to an open writer that has not committed);
    it retires once that version, or a later one, is durable.
    """

    def __init__(self, op: Op, content: Content, handle: Handle | None, covers: int | None):
        self.op = op
        self.content = content.hold()
        self.handle = handle
        self.covers = covers


class Node:
    def __init__(self, ino: int, name: str, parent: Node | None, is_dir: bool, mode: int, uid: int, gid: int):
        self.ino = ino
        self.name = name
        self.parent = parent
        self.is_dir = is_dir
        self.mode = mode
        self.uid, self.gid = uid, gid
        self.atime_ns = self.mtime_ns = self.ctime_ns = time.time_ns()
        self.children: dict[str, Node] = {}
        self.version: Version | None = None
        self.nlookup = 0
        self.handles = 0
        self.writers = 0  # open handles with a staged copy
        self.kernel_version: Version | None = None  # what the kernel page cache may hold
        self.last_seq = 0  # newest op that concerns this node (for sync PATH)
        self.shadows: list[Shadow] = []
        self.unlinked = False
        self.listed_at: float | None = None  # directories: last merged store listing (monotonic); None: never
        self.gone = False  # taken out because the store no longer has it (another mount deleted it)
        self.changed_here: float | None = None  # directories: last create/unlink/rename in it here (monotonic)

    def key(self) -> str:
        parts = []
        node = self
        while node.parent is not None:
            parts.append(node.name)
            node = node.parent
        key = "/".join(reversed(parts))
        return key + "/" if self.is_dir and key else key

    def size(self) -> int:
        """The committed size. A writer's staged copy is private until it commits, so its
        growing size is not shown (readers of the committed version must not be cut short)."""
        return self.version.content.size if self.version is not None else 0

    def walk(self) -> Iterable[Node]:
        yield self
        for child in list(self.children.values()):
            yield from child.walk()


class Handle:
    def __init__(self, fh: int, node: Node, staged: StagedFile | None, content: Content | None, append: bool):
        self.fh = fh
        self.node = node
        self.staged = staged  # writers: the private copy
        self.content = content  # readers: the version they opened (held)
        self.append = append
        self.dirty = False
        self.error = 0  # sticky: a write that failed (ENOSPC, EIO) poisons the handle's commit
        self.read_end = 0  # where the last read stopped (sequential reads trigger read-ahead)
        self.stream: Stream | None = None  # writers: parts sent before the commit
        # Committed with parts evicted to the store: no more writes (they belong to that upload).
        self.frozen = False


class Namespace:
    def __init__(self, cache: Cache, journal: Journal, uploader: Uploader, fetcher: Fetcher, uid: int, gid: int,
                 list_ttl: float | None = None, umask: int = 0o022, root: tuple[int, int, int] | None = None):
        self.cache = cache
        self.journal = journal
        self.uploader = uploader
        self.fetcher = fetcher
        # Owner and modes of what the store does not say (loaded objects): the mounting user, and
        # 0666/0777 less ``umask``; the root directory: (mode, uid, gid), as the mountpoint was.
        self.uid, self.gid = uid, gid
        self.file_mode, self.dir_mode = 0o666 & ~umask, 0o777 & ~umask
        root_mode, root_uid, root_gid = root or (0o755, uid, gid)
        self.root = Node(ROOT_INODE, "", None, True, stat.S_IFDIR | (root_mode & 0o7777), root_uid, root_gid)
        self.inodes: dict[int, Node] = {ROOT_INODE: self.root}
        self.handles: dict[int, Handle] = {}
        self.shadows: dict[int, Shadow] = {}  # by op seq; kept in the journal through compaction
        uploader.retained_ops = lambda: [shadow.op for shadow in self.shadows.values()]
        cache.reclaim = self._evict_sent_block
        cache.releases_pending = uploader.holds_cache
        cache.pinned = self._pinned
        # The latest checkpoint: the directory of the shards committed in the last burst of
        # saves (their common ancestor), whose clean data is evicted last.
        self.checkpoint_dir = ""
        self._last_shard_commit = 0.0
        self._last_commit, self._burst_bytes = 0.0, 0
        self._verifying: dict[int, trio.Event] = {}
        self.prefill = Prefill(busy=self._busy)
        self._next_ino = ROOT_INODE + 1
        self._next_fh = 1
        # Refresh from the store: seconds a directory listing or a missing name is trusted
        # (0: ask every time; None: never, the tree is the listing at mount plus our changes).
        self.store = fetcher.store
        self.list_ttl = list_ttl
        # Set by the daemon: the kernel drops its cached entry (and so the attributes) of a
        # name, asynchronously. Used when the store changed a file behind the kernel's back.
        self.forget_name: Callable[[int, str], None] = lambda parent_ino, name: None
        self.list_threads = trio.CapacityLimiter(LIST_THREADS)
        self._missing: dict[tuple[int, str], float] = {}  # (dir ino, name) -> absent until (monotonic)
        self._refreshing: dict[int, _Flight] = {}  # dir ino -> the listing in flight
        self._asking: dict[tuple[int, str], _Flight] = {}  # (dir ino, name) -> the store probe in flight
        self._store_failing = False  # a refresh failed: logged once until the store answers again
        self.health = fetcher.health  # the daemon shares one StoreHealth with the uploader

    # -- building the tree ----------------------------------------------------------------
    def load(self, listing: Iterable[ObjectInfo], pending: list[Op],
             clean: dict[str, CleanEntry] | None = None) -> None:
        """The store's listing, then the journal's pending ops on top (in order). ``clean``:
        blocks the last mount left cached, kept for the files the store still holds unchanged."""
        clean = dict(clean or {})
        for info in listing:
            if integrity.is_reserved(info.key):
                continue  # checksum manifests, not files
            parts = _split_key(info.key)
            if parts is None:
                log.warning("not shown: store key %r cannot be a path on the mount", info.key)
                continue
            if info.key.endswith("/"):
                self._ensure_dir(parts)
                continue
            parent = self._ensure_dir(parts[:-1])
            if parent is None or parts[-1] in parent.children:
                log.warning("not shown: store key %r clashes with a directory", info.key)
                continue
            content = Content(self.cache, info.size, [None] * self._n_blocks(info.size), in_store=True)
            content.key = info.key
            content.durable_at = info.mtime
            entry = clean.pop(info.key, None)
            if entry is not None and entry.unchanged_in_store(info.size, info.mtime):
                content.blocks, content.verify, content.durable_at = list(entry.blocks), entry.digest, entry.durable_at
            elif entry is not None:
                _release_blocks(self.cache, entry.blocks)  # the store has another version now
            node = self._add(parent, parts[-1], is_dir=False)
            node.version = Version(content, None)
            node.version.stamp = info
            node.mtime_ns = node.ctime_ns = int(info.mtime * 1e9)
        for entry in clean.values():  # gone from the store
            _release_blocks(self.cache, entry.blocks)
        for op in pending:
            self._replay(op)
        now = self._now()
        for node in self.root.walk():  # the listing just read covers every directory
            if node.is_dir:
                node.listed_at = now
        kept = [n for n in self.root.walk() if not n.is_dir and n.version is not None and n.version.content.verify]
        for node in kept:
            self._maybe_clean(node)
        shards = [n for n in kept if n.version.content.size >= self.cache.block_size]
        if shards:  # the newest shard's directory stands for the latest checkpoint
            newest = max(shards, key=lambda n: n.version.content.durable_at)
            self.checkpoint_dir = newest.parent.key()

    def clean_contents(self) -> list[tuple[str, Content]]:
        """Durable files with cached blocks (what the clean cache index keeps for the next mount)."""
        return [(n.key(), n.version.content) for n in self.root.walk()
                if not n.is_dir and n.version is not None and n.version.seq is None and n.version.content.refs()]

    def _busy(self) -> bool:
        """A save or an upload is running (background work waits for idle time)."""
        return bool(self.uploader.pending) or any(h.staged is not None for h in self.handles.values())

    def _pinned(self, owner: object) -> bool:
        return bool(self.checkpoint_dir) and isinstance(owner, Node) and owner.key().startswith(self.checkpoint_dir)

    def _note_checkpoint(self, node: Node, size: int) -> None:
        """A shard was committed: it belongs to the latest checkpoint (a burst of saves)."""
        if size < self.cache.block_size or node.parent is self.root:
            return  # pointer files and loose top-level files do not say where checkpoints go
        now = time.monotonic()
        directory = node.parent.key()
        if now - self._last_shard_commit > CHECKPOINT_GAP_S or not self.checkpoint_dir:
            self.checkpoint_dir = directory  # a new save began
        else:  # the same save: the common ancestor of its shards' directories (never the root)
            self.checkpoint_dir = _common_dir(self.checkpoint_dir, directory) or directory
        self._last_shard_commit = now

    def _note_save(self, size: int) -> None:
        """Bytes committed in this burst of saves: the cache keeps as much RAM ready for the next."""
        now = time.monotonic()
        if now - self._last_commit > CHECKPOINT_GAP_S:
            self._burst_bytes = 0
        self._burst_bytes += size
        self._last_commit = now
        self.cache.expect_writes(self._burst_bytes)

    async def verify_kept(self, content: Content) -> None:
        """First open of a file whose blocks the last mount left: check them before use."""
        running = self._verifying.get(id(content))
        if running is not None:  # another open is checking it
            await running.wait()
            return
        done = self._verifying[id(content)] = trio.Event()
        content.hold()
        try:
            digest = await trio.to_thread.run_sync(cached_digest, self.cache, content.size, content.blocks)
            if digest != content.verify:
                log.warning("%s: cached copy from the last mount does not match its digest; reading the store",
                            content.key)
                content.drop_blocks()
            content.verify = ""
        finally:
            content.release()
            del self._verifying[id(content)]
            done.set()

    def _replay(self, op: Op) -> None:
        parts = _split_key(op.key)
        node = self._find(parts) if parts is not None else None
        if op.kind == PUT and parts is not None:
            parent = self._ensure_dir(parts[:-1])
            content = Content(self.cache, op.size, list(op.blocks))
            if op.upload:  # parts evicted before the crash: readable once the upload completes
                content.remote = {index: PartInfo(index + 1, token, op.hashes.get(index, ""))
                                  for index, token in op.parts.items()}
                content.upload = Upload(*op.upload)
            if parent is not None and (node is None or not node.is_dir):
                node = node or self._add(parent, parts[-1], is_dir=False)
                self._set_version(node, content, op)
                self.uploader.submit(op, content, self._on_durable(node))
                return
            log.error("journal: cannot show %r (a directory is in the way); uploading it anyway", op.key)
            self.uploader.submit(op, content)
            return
        if op.kind == DELETE and node is not None and (not node.is_dir or not node.children):
            self._detach(node)
        elif op.kind == MKDIR and parts is not None:
            self._ensure_dir(parts)
        elif op.kind == MOVE and parts is not None:
            src = self._find(_split_key(op.src) or [])
            parent = self._ensure_dir(parts[:-1])
            if src is not None and parent is not None and src is not node:
                if node is not None and not node.is_dir:
                    self._detach(node)  # a rename over an existing file
                if parts[-1] not in parent.children:
                    self._move(src, parent, parts[-1])
                    node = src
        self.uploader.submit(op, None, self._on_moved(node) if op.kind == MOVE else None)

    # -- lookups ---------------------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def lookup(self, parent_ino: int, name: str) -> Attr:
        parent = self._dir(parent_ino)
        if name == ".":
            node = parent
        elif name == "..":
            node = parent.parent or parent
        else:
            node = parent.children.get(name)
            if node is None:
                raise FsError(errno.ENOENT)
        node.nlookup += 1
        return self.attr(node)

    def looked_up(self, ino: int) -> None:
        """The kernel learned ``ino`` other than by lookup (a READDIRPLUS entry): it will forget it too."""
        node = self.inodes.get(ino)
        if node is not None:
            node.nlookup += 1

    def forget(self, ino: int, count: int) -> None:
        node = self.inodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.nlookup = max(0, node.nlookup - count)
        self._maybe_drop(node)

    def getattr(self, ino: int) -> Attr:
        node = self.node(ino)
        if node.gone and not node.handles:  # the kernel's entry for it has not expired yet
            raise FsError(errno.ENOENT)
        return self.attr(node)

    def attr(self, node: Node) -> Attr:
        return Attr(
            node.ino, node.is_dir, node.mode, node.size(), node.uid, node.gid,
            node.atime_ns, node.mtime_ns, node.ctime_ns, node.writers > 0,
        )

    def readdir(self, ino: int) -> list[tuple[str, Attr]]:
        parent = self._dir(ino)
        return [(name, self.attr(child)) for name, child in sorted(parent.children.items())]

    def state(self, ino: int) -> str:
        """user.ckptfs.state: writing, pending (committed, not yet in the store) or durable."""
        node = self.node(ino)
        if node.is_dir:
            return "durable" if all(n.version is None or n.version.seq is None for n in node.walk()) else "pending"
        if node.version is None:
            return "writing"
        return "pending" if node.version.seq is not None else "durable"

    async def verification(self, ino: int) -> tuple[str, str]:
        """user.ckptfs.verified and user.ckptfs.xxh3: whether the bytes read from the store are
        checked ("yes"; "no" for an object with no checksums, e.g. put by another tool; "pending"
        before the file is in the store) and the whole file's recorded xxh3 ("" if none)."""
        node = self.node(ino)
        if node.is_dir or node.version is None or node.version.seq is not None:
            return ("pending" if not node.is_dir else ""), ""
        content = node.version.content.hold()
        try:
            checks = await self.fetcher.checksums_of(content)
        finally:
            content.release()
        if checks is None:
            return "pending", ""
        return ("yes" if checks.verified else "no"), checks.xxh3

    # -- refresh from the store: what other mounts made durable ------------------------------------
    # The tree is the store's listing at mount time plus this mount's own changes. Other mounts
    # of the same bucket and prefix (other nodes) publish objects too. So a directory used
    # (listed, or a name looked up in it) whose last listing is older than ``list_ttl`` is
    # listed again, one level, and merged (``_refresh_dir``); a name this mount does not know in
    # a directory listed more recently is asked of the store (``_ask_store``), and an absence is
    # remembered for ``list_ttl`` (so probing loops do not hammer the store). Local changes not
    # yet in the store always win: the merge only ever touches durable, unopened files with no
    # pending op, and names pending ops are about are left alone. Store calls run in threads;
    # what changed here while one was in flight is re-checked after it (no merge across a
    # local change).

    def _now(self) -> float:
        return time.monotonic()

    def _due(self, node: Node) -> bool:
        return (self.list_ttl is not None and not node.unlinked
                and (node.listed_at is None or self._now() - node.listed_at >= self.list_ttl))

    async def refresh(self, ino: int) -> None:
        """List directory ``ino`` again from the store if its listing is older than the TTL
        (opendir calls it before taking the directory's entries)."""
        node = self.node(ino)
        if node.is_dir and self._due(node):
            await self._refresh_dir(node)

    async def lookup_async(self, parent_ino: int, name: str) -> Attr:
        """``lookup`` that keeps up with the store: the directory is listed again first if its
        listing is older than ``list_ttl`` (so known names follow changes and deletions too); a
        name still unknown is asked of the store itself, unless it was found absent less than
        ``list_ttl`` ago (``negative_ttl`` says for how much longer)."""
        with trio.move_on_after(LOOKUP_WAIT_S) as waited:
            await self._catch_up(self._dir(parent_ino), name)
        if waited.cancelled_caught:
            self._store_trouble(f"cannot look up {name}", TimeoutError(f"the store did not answer in {LOOKUP_WAIT_S:g} s"))
        return self.lookup(parent_ino, name)

    async def _catch_up(self, parent: Node, name: str) -> None:
        """Bring what ``parent`` shows under ``name`` up to date with the store (lookup_async)."""
        if self.list_ttl is None or name in (".", "..") or parent.unlinked:
            return
        outcome = await self._refresh_dir(parent) if self._due(parent) else None
        if name not in parent.children:
            if outcome in (_MERGED, _FAILED):  # just listed (or the store fails: not again before the TTL)
                self._remember_missing(parent, name)
            elif self._writing_here(parent):
                pass  # this mount writes here: see _writing_here
            elif not self._known_missing(parent, name):  # (or the listing was not used: changed here)
                await self._ask_store(parent, name)

    async def refresh_paths(self, paths: list[str]) -> None:
        """Before a command walks ``paths`` (all if none) in the tree rather than through the
        kernel (warmup): look each one up as the kernel would, and list every directory at or
        under them whose listing is due, so what other mounts made durable is included."""
        if self.list_ttl is None:
            return
        for path in paths or [""]:
            node = self.root
            for part in [p for p in path.split("/") if p and p != "."]:
                await self._catch_up(node, part)
                node = node.children.get(part)
                if node is None or not node.is_dir:
                    break
            else:
                todo = [node]
                while todo:
                    directory = todo.pop()
                    if self._due(directory):
                        await self._refresh_dir(directory)
                    todo += [child for child in directory.children.values() if child.is_dir]

    def _writing_here(self, parent: Node) -> bool:
        """Whether this mount created, removed or renamed something in ``parent`` less than
        ``list_ttl`` ago. Then a name it does not know is not asked of the store: the lookup
        before each create would cost a round trip (measured on the test S3 server: 27 ms per
        small file instead of 1.5 ms). What other mounts put there still shows up with the next
        listing, at most ``list_ttl`` later: the handoff case (a reader on another node opens
        what a writer published) is not a writer of that directory, and is answered at once."""
        return parent.changed_here is not None and self._now() - parent.changed_here < self.list_ttl

    def negative_ttl(self, parent_ino: int, name: str) -> float:
        """How long the kernel may cache that ``name`` is absent from ``parent_ino``: as long as
        this mount will answer so without asking the store (0: not at all)."""
        until = self._missing.get((parent_ino, name))
        return max(0.0, until - self._now()) if until is not None else 0.0

    def _remember_missing(self, parent: Node, name: str) -> None:
        if not self.list_ttl:
            return
        if len(self._missing) >= NEGATIVE_CACHE_MAX:
            now = self._now()
            self._missing = {k: t for k, t in self._missing.items() if t > now}
            if len(self._missing) >= NEGATIVE_CACHE_MAX:
                self._missing.clear()
        self._missing[(parent.ino, name)] = self._now() + self.list_ttl

    def _known_missing(self, parent: Node, name: str) -> bool:
        until = self._missing.get((parent.ino, name))
        if until is None:
            return False
        if until > self._now():
            return True
        del self._missing[(parent.ino, name)]
        return False

    async def _refresh_dir(self, node: Node) -> str:
        """List directory ``node`` (one level) from the store and merge that into the tree.
        Returns _MERGED, _SKIPPED (it changed here while the listing was in flight: the listing
        is dropped, not merged) or _FAILED (the store failed: the tree stays as it was). Either
        way the directory counts as listed now, so the next try waits for the TTL."""
        flight = self._refreshing.get(node.ino)
        if flight is not None:  # someone is listing it already: share that answer
            await flight.done.wait()
            return flight.outcome
        flight = self._refreshing[node.ino] = _Flight()
        try:
            started = self._now()
            prefix = node.key()
            before = _DirState(node)
            blocked = self._pending_names(prefix)
            try:
                listing = await self._store_call(self.store.list_dir, prefix)
            except Exception as exc:  # noqa: BLE001 - never fail a readdir or lookup for this
                self._store_trouble(f"cannot list {prefix or 'the top directory'}", exc)
                flight.outcome = _FAILED
            else:
                self._store_answers()
                if before.unchanged(node):
                    blocked |= self._pending_names(prefix)  # (and what began during the listing)
                    self._merge_listing(node, prefix, listing, before, blocked)
                    flight.outcome = _MERGED
                else:
                    flight.outcome = _SKIPPED
            if node.listed_at is None or node.listed_at < started:
                node.listed_at = started
            return flight.outcome
        finally:
            del self._refreshing[node.ino]
            flight.done.set()

    def _merge_listing(self, node: Node, prefix: str, listing: DirListing, before: _DirState,
                       blocked: set[str]) -> None:
        """The store's listing of directory ``node`` into the tree (no awaits): new names are
        added, files the store changed are followed, names the store lost are dropped, all only
        where nothing here disagrees (see ``_follow_store`` and ``_removable``)."""
        files = {info.key[len(prefix):]: info for info in listing.files}
        dirs = set(listing.dirs)
        for name in sorted(set(node.children) | set(files) | dirs):
            if name in blocked:
                continue  # a pending op of ours is about it: our view wins until it is done
            child = node.children.get(name)
            info = files.get(name)
            if child is None:
                if info is not None and _split_key(info.key) is not None:
                    self._add_from_store(node, name, info)
                elif info is None and _split_key(prefix + name + "/") is not None:
                    self._add(node, name, is_dir=True)
            elif child.is_dir:
                if info is None and name not in dirs and self._removable(child):
                    self._drop_gone(child)
                # (a file in the store where we have a directory: ours stays, as at mount)
            elif child.version is not before.versions.get(name):
                continue  # committed here meanwhile
            elif info is not None:
                self._follow_store(child, info)
            elif self._removable(child):
                self._drop_gone(child)

    def _drop_gone(self, node: Node) -> None:
        log.info("%s is gone from the store: no longer shown", node.key())
        for n in node.walk():
            n.gone = True
        self.forget_name(node.parent.ino, node.name)
        self._detach(node)

    def _follow_store(self, node: Node, info: ObjectInfo) -> None:
        """The store shows ``info`` for a file we have: if it is another object than the one this
        mount knows (and the file is durable here and not open), show the store's version."""
        version = node.version
        if version is None or version.seq is not None or node.handles:
            return  # pending or being written here (ours wins), or open (readers keep theirs)
        stamp, content = version.stamp, version.content
        if stamp is not None and stamp.key == info.key:
            changed = not _same_object(stamp, info)
        elif stamp is not None:  # renamed here since it was seen: the store copied the object
            changed = info.size != content.size
        else:  # uploaded by this mount (or listed at mount): the store's copy is no newer than that
            changed = info.size != content.size or info.mtime > content.durable_at + STORE_MTIME_SLACK_S
        if not changed:
            version.stamp = info
            return
        log.info("%s changed in the store: showing the new version", info.key)
        self.cache.unmark_clean(node)
        node.version = Version(self._store_content(info), None)
        node.version.stamp = info
        version.content.release()  # its cached blocks go (nobody has it open)
        node.mtime_ns = node.ctime_ns = int(info.mtime * 1e9)
        self.forget_name(node.parent.ino, node.name)  # its size and mtime changed

    def _removable(self, node: Node) -> bool:
        """Whether ``node`` (and all below it) may go because the store no longer has it: only
        files durable here, not open, and that the store has shown before (or that became
        durable long enough ago for a listing to show them)."""
        for n in node.walk():
            if n.handles or n.shadows:
                return False
            if n.is_dir:
                continue
            version = n.version
            if version is None or version.seq is not None:
                return False
            if version.stamp is None and time.time() - version.content.durable_at < UNSEEN_GRACE_S:
                return False
        return True

    def _add_from_store(self, parent: Node, name: str, info: ObjectInfo) -> Node:
        node = self._add(parent, name, is_dir=False)
        node.version = Version(self._store_content(info), None)
        node.version.stamp = info
        node.mtime_ns = node.ctime_ns = int(info.mtime * 1e9)
        return node

    def _store_content(self, info: ObjectInfo) -> Content:
        content = Content(self.cache, info.size, [None] * self._n_blocks(info.size), in_store=True)
        content.key = info.key
        content.durable_at = info.mtime
        return content

    async def _ask_store(self, parent: Node, name: str) -> None:
        """Is there a file ``name`` (HEAD) or a directory (any key under ``name/``) in ``parent``
        in the store? If so it joins the tree; if not, that is remembered for the TTL."""
        key = parent.key() + name
        try:
            if _split_key(key + "/") is None:
                return  # not a name the store can hold: absent
        except UnicodeEncodeError:
            return  # not UTF-8: no key can have it
        slot = (parent.ino, name)
        flight = self._asking.get(slot)
        if flight is not None:  # the same question is on its way: share the answer
            await flight.done.wait()
            return
        flight = self._asking[slot] = _Flight()
        try:
            before = _DirState(parent)
            blocked = self._pending_names(parent.key())
            try:
                info, is_dir = await self._probe(key)
            except Exception as exc:  # noqa: BLE001 - the lookup answers from what we know
                self._store_trouble(f"cannot look up {key}", exc)
                self._remember_missing(parent, name)
                return
            self._store_answers()
            if not before.unchanged(parent):
                return  # changed here meanwhile: the kernel asks again, we decide then
            if name in blocked or name in self._pending_names(parent.key()):
                self._remember_missing(parent, name)  # removed here, not yet from the store: gone
                return
            if info is not None:
                self._add_from_store(parent, name, info)
            elif is_dir:
                self._add(parent, name, is_dir=True)
            else:
                self._remember_missing(parent, name)
        finally:
            del self._asking[slot]
            flight.done.set()

    async def _probe(self, key: str) -> tuple[ObjectInfo | None, bool]:
        """HEAD ``key`` and ask whether anything is under ``key/``, both at once."""
        answers: dict[str, object] = {}

        async def ask(what: str, fn, *args) -> None:
            try:
                answers[what] = await self._store_call(fn, *args)
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the nursery
                answers[what] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "file", self.store.head, key)
            nursery.start_soon(ask, "dir", lambda: self.store.list_dir(key + "/", limit=1).exists)
        for answer in answers.values():
            if isinstance(answer, Exception):
                raise answer
        return answers["file"], bool(answers["dir"])

    async def _store_call(self, fn, *args):
        """``fn(*args)`` in a thread, given up (TimeoutError) if the store takes too long: the
        thread is left to finish on its own, and its answer is dropped."""
        limit = STORE_ANSWER_FAILING_S if self._store_failing or self.health.in_trouble() else STORE_ANSWER_S
        with trio.move_on_after(limit):
            return await trio.to_thread.run_sync(fn, *args, limiter=self.list_threads, abandon_on_cancel=True)
        raise TimeoutError(f"the store did not answer in {limit:g} s")

    def _pending_names(self, prefix: str) -> set[str]:
        """Names right under directory ``prefix`` that a pending op of this mount is about (a put,
        delete or move of them or of anything below): the store's word on them is not final."""
        names = set()
        for task in self.uploader.pending.values():
            for key in (task.op.key, task.op.src):
                if key and key.startswith(prefix) and len(key) > len(prefix):
                    names.add(key[len(prefix):].split("/", 1)[0])
        return names

    def _store_trouble(self, what: str, exc: Exception) -> None:
        if not self._store_failing:  # (once per episode: lookups must not flood the status's errors)
            self.health.failed("", "", f"{what}: {exc}", reachable=False if isinstance(exc, TimeoutError) else None)
            self._store_failing = True
            log.warning("%s: %s; showing what this mount knows (logged once until the store answers)",
                        what, exc, exc_info=not isinstance(exc, (StoreError, TimeoutError)))
        else:
            log.debug("%s: %s", what, exc)

    def _store_answers(self) -> None:
        self.health.answered()
        if self._store_failing:
            self._store_failing = False
            log.info("the store answers listings again")

    # -- directories -----------------------------------------------------------------------------
    def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        parent = self._dir(parent_ino)
        self._check_new_name(parent, name)
        if name in parent.children:
            raise FsError(errno.EEXIST)
        node = self._add(parent, name, is_dir=True, mode=stat.S_IFDIR | (mode & 0o7777), uid=uid, gid=gid)
        node.listed_at = node.changed_here = self._now()  # new: the lookup before mkdir found nothing there
        node.last_seq = self._log(Op(MKDIR, node.key())).seq
        node.nlookup += 1
        self._touch(parent)
        return self.attr(node)

    def rmdir(self, parent_ino: int, name: str) -> None:
        parent = self._dir(parent_ino)
        node = self._child(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        self._log(Op(DELETE, node.key(), small=True))
        self._detach(node)
        self._touch(parent)

    # -- files -------------------------------------------------------------------------------------
    def create(self, parent_ino: int, name: str, mode: int, flags: int, uid: int, gid: int) -> tuple[Handle, Attr]:
        parent = self._dir(parent_ino)
        existing = parent.children.get(name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            raise FsError(errno.EEXIST)  # the kernel only sends create for names it found absent
        self._check_new_name(parent, name)
        node = self._add(parent, name, is_dir=False, mode=stat.S_IFREG | (mode & 0o7777), uid=uid, gid=gid)
        node.nlookup += 1
        handle = self._open_handle(node, StagedFile(self.cache), None, bool(flags & os.O_APPEND))
        handle.dirty = True  # a created file exists once closed, even empty
        self._touch(parent)
        return handle, self.attr(node)

    async def open(self, ino: int, flags: int) -> tuple[Handle, bool, bool]:
        """A handle; whether the kernel may keep its cached pages of this file; whether reads
        must bypass the kernel cache (direct I/O)."""
        node = self.node(ino)
        if node.gone:  # deleted by another mount; the kernel's entry for it has not expired yet
            raise FsError(errno.ENOENT)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        writing = (flags & os.O_ACCMODE) != os.O_RDONLY
        if node.version is not None and node.version.content.verify:
            await self.verify_kept(node.version.content)
        if not writing:
            await self.prefill.settle(node)  # no page of an older version may land after our answer
            content = node.version.content if node.version is not None else Content(self.cache, 0, [])
            # While another handle writes this file, the kernel's idea of its size follows that
            # writer's private copy; a page-cache read would stop at it. Direct reads ask us.
            direct = node.writers > 0
            keep_cache = not direct and node.version is not None and node.kernel_version is node.version
            node.kernel_version = None if direct else node.version
            return self._open_handle(node, None, content.hold(), False), keep_cache, direct
        if flags & os.O_TRUNC or node.version is None:
            staged = StagedFile(self.cache)
        else:
            base = node.version.content
            base.hold()  # keep it while we fetch what is not cached
            try:
                await self._fetch_range(node, base, 0, base.size)
                staged = StagedFile(self.cache, base)
            finally:
                base.release()
        handle = self._open_handle(node, staged, None, bool(flags & os.O_APPEND))
        handle.dirty = bool(flags & os.O_TRUNC)
        return handle, False, True

    async def read(self, fh: int, offset: int, size: int, view: bool = False) -> bytes | memoryview:
        handle = self._handle(fh)
        if handle.staged is not None:
            try:
                return handle.staged.read(offset, size)
            except OSError as exc:
                raise FsError(exc.errno, str(exc)) from None
        content = handle.content
        while content.remote and not content.in_store:
            # Parts evicted under cache pressure come back once the file is in the store.
            if content.orphaned:
                raise FsError(errno.EIO, "this version was replaced before it reached the store")
            await self.uploader.progress.wait()
        if content.in_store:
            if offset == handle.read_end:  # sequential: keep the next blocks coming
                self.fetcher.prefetch(content, (offset + size) // self.cache.block_size)
            handle.read_end = offset + size
            self.cache.touch(handle.node)  # the file being read goes last among clean data
            # Loop: a block fetched for this read may be evicted while the next one arrives.
            while missing := content.missing(offset, size):
                await self.fetcher.fill(content, missing)
        return content.read(offset, size, view)  # (no await since the check: every block is there)

    async def _fetch_range(self, node: Node, content: Content, offset: int, size: int) -> None:
        """Cache a range of ``content`` to build a writer's copy from: none of it may be evicted
        before the copy shares it (a file larger than the cache gets ENOSPC)."""
        self.cache.unmark_clean(node)
        try:
            while missing := content.missing(offset, size):
                await self.fetcher.fill(content, missing)
        finally:
            self._maybe_clean(node)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._handle(fh)
        if handle.staged is None:
            raise FsError(errno.EBADF)
        if handle.error:
            raise FsError(handle.error)
        if handle.frozen:
            raise FsError(errno.EIO, "this file was committed with parts evicted to the store: reopen it to write")
        if handle.append:
            offset = handle.staged.size
        if handle.staged.remote and offset + len(data) > MAX_PARTS * self.cache.block_size:
            raise FsError(errno.EFBIG, "a file streamed through a full cache cannot outgrow 10,000 parts")
        self._send_full_blocks(handle, offset)
        try:
            written = await handle.staged.write(offset, data)
        except OSError as exc:  # the cache disk is full or failing: never commit a torn file
            handle.error = exc.errno or errno.EIO
            log.error("write to %s failed: %s; the file will not be committed", handle.node.key(), exc)
            raise FsError(handle.error) from None
        handle.dirty = True
        handle.node.mtime_ns = handle.node.ctime_ns = time.time_ns()
        return written

    def _send_full_blocks(self, handle: Handle, offset: int) -> None:
        """Streaming upload: blocks the writer filled and has moved past (it now writes at
        ``offset``) are sent at once; the commit re-sends any that change again."""
        staged = handle.staged
        bs = self.cache.block_size
        sealed = [i for i in staged.changed
                  if i < offset // bs and staged.valid[i] == bs and staged.blocks[i] is not None]
        if not sealed or handle.node.unlinked:
            return
        if handle.stream is None:
            handle.stream = self.uploader.open_stream(handle.node.key())
        for index in sealed:
            staged.changed.discard(index)
            self.uploader.stream_part(handle.stream, index, staged.blocks[index], staged.stamps[index])

    def _evict_sent_block(self) -> bool:
        """The cache is full: drop one block of a file being written whose part is already in
        the store (its upload keeps it). Blocks shared with a committed version stay."""
        for handle in self.handles.values():
            stream, staged = handle.stream, handle.staged
            if stream is None or stream.upload is None or stream.key != handle.node.key():
                continue  # (renamed since streaming began: its parts may not stay under that key)
            for index, (stamp, part) in stream.sent.items():
                ref = staged.blocks[index] if index < len(staged.blocks) else None
                if ref is not None and staged.stamps[index] == stamp and self.cache.refcounts.get(ref) == 1:
                    staged.evict(index, part)
                    return True
        return False

    def flush(self, fh: int, commit: bool = True) -> None:
        """Commit what this handle wrote (every close calls it; a clean handle is a no-op).
        ``commit=False``: a close that is not the last (a forked child's copy): only report a
        failed write; the handle stays dirty for the next flush or release."""
        handle = self._handle(fh)
        if handle.error:
            raise FsError(handle.error, "an earlier write failed: the file was not committed")
        if not commit or handle.staged is None or not handle.dirty:
            return
        node = handle.node
        handle.dirty = False
        if node.unlinked:
            return  # written after unlink: nobody can see it
        self._commit(node, self._snapshot(handle), handle)
        if handle.staged.remote:
            handle.frozen = True

    def _snapshot(self, handle: Handle) -> Content:
        content = handle.staged.snapshot()
        if content.remote:
            content.upload = handle.stream.upload
        return content

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        node = handle.node
        if handle.dirty and not handle.error:  # release without flush (should not happen): still commit
            self.handles[fh] = handle
            try:
                self.flush(fh)
            finally:
                del self.handles[fh]
        if handle.stream is not None:  # closed without a commit that took its parts
            self.uploader.abandon(handle.stream)
        if handle.staged is not None:
            handle.staged.discard()
        if handle.content is not None:
            handle.content.release()
        node.handles -= 1
        if handle.staged is not None:
            node.writers -= 1
        if not node.handles:
            self.prefill.closed(node)
        self._maybe_clean(node)
        self._maybe_drop(node)

    async def fsync(self, fh: int) -> None:
        """Local durability: what this handle wrote so far (a writer), or the committed version
        (a reader or a clean writer), survives a node reboot. RAM blocks are copied to the disk
        tier, the disk arena is synced, then a put op naming those blocks is journaled and synced.
        The op is not uploaded (the commit or the version it shadows is); it only matters to a
        restart that lost the RAM tier."""
        handle = self._handle(fh)
        node = handle.node
        if handle.staged is not None and handle.dirty:
            content, covers = self._snapshot(handle), None
        elif node.version is not None and node.version.seq is not None:
            content, covers = node.version.content, node.version.seq
            if not any(ref is not None and ref[0] == RAM for ref in content.blocks):
                content = None  # already on disk: the journal record is enough
        else:
            return  # durable in the store already, or nothing committed
        if content is not None:
            content.hold()
            try:
                disk = await self.cache.on_disk(content)
            finally:
                content.release()
            disk.hold()
            try:
                await trio.to_thread.run_sync(self.cache.tiers[DISK].sync)
                if not node.unlinked and fh in self.handles:
                    self._add_shadow(node, disk, handle if covers is None else None, covers)
            finally:
                disk.release()
        await trio.to_thread.run_sync(self.journal.sync)

    def _add_shadow(self, node: Node, content: Content, handle: Handle | None, covers: int | None) -> None:
        op = self.journal.append(_put_op(node.key(), content))
        for old in [s for s in node.shadows if handle is not None and s.handle is handle]:
            self._retire_shadow(node, old)  # superseded by this later fsync of the same writer
        shadow = Shadow(op, content, handle, covers)
        node.shadows.append(shadow)
        self.shadows[op.seq] = shadow

    def _retire_shadow(self, node: Node, shadow: Shadow) -> None:
        node.shadows.remove(shadow)
        del self.shadows[shadow.op.seq]
        self.journal.cancel(shadow.op.seq)
        shadow.content.release()

    def _retire_shadows(self, node: Node, durable_seq: int | None = None) -> None:
        """Shadows covered by a durable version (all of them when ``durable_seq`` is None)."""
        for shadow in list(node.shadows):
            if durable_seq is None or (shadow.covers is not None and shadow.covers <= durable_seq):
                self._retire_shadow(node, shadow)

    async def setattr(self, ino: int, fh: int | None, size=None, mode=None, uid=None, gid=None, atime_ns=None, mtime_ns=None) -> Attr:
        node = self.node(ino)
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            await self._truncate(node, fh, size)
        if mode is not None:
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        node.ctime_ns = time.time_ns()
        return self.attr(node)

    async def _truncate(self, node: Node, fh: int | None, size: int) -> None:
        handle = self.handles.get(fh) if fh is not None else None
        if handle is not None and handle.staged is not None:  # ftruncate: the writer's staged copy
            staged, bs = handle.staged, self.cache.block_size
            if self.uploader.codec is not None and size < staged.size and size % bs == 0 \
                    and size // bs - 1 in staged.remote:
                # A compressed upload's last part is sent again at commit, followed by the seek
                # table: an evicted block cannot be read back to be that part.
                raise FsError(errno.EIO, "the file's new last block was uploaded and evicted from the cache "
                                         "(cache full): a compressed file cannot end there before it is closed")
            await staged.truncate(size)
            handle.dirty = True
            return
        # No writer: truncate(path) is open + truncate + close.
        base = node.version.content.hold() if node.version is not None else None
        try:
            if base is not None and base.size == size:
                return
            if base is not None and size:
                await self._fetch_range(node, base, 0, min(size, base.size))
            staged = StagedFile(self.cache, base)
        finally:
            if base is not None:
                base.release()
        await staged.truncate(size)
        if not node.unlinked:
            self._commit(node, staged.snapshot())
        staged.discard()

    def unlink(self, parent_ino: int, name: str) -> None:
        parent = self._dir(parent_ino)
        node = self._child(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        # No S3 multipart object (one with a manifest to delete too) is this small: no HEAD first.
        self._log(Op(DELETE, node.key(), small=node.size() <= min(self.cache.block_size, MIN_MULTIPART)))
        self._detach(node)
        self._touch(parent)

    def rename(self, old_parent_ino: int, old_name: str, new_parent_ino: int, new_name: str, flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        old_parent = self._dir(old_parent_ino)
        new_parent = self._dir(new_parent_ino)
        node = self._child(old_parent, old_name)
        target = new_parent.children.get(new_name)
        if target is node:
            return
        moved = set(node.walk())
        if any(h.node in moved and h.staged is not None and h.staged.remote for h in self.handles.values()):
            # Its evicted parts sit in an upload fixed to the current key until the file is closed.
            raise FsError(errno.EBUSY, "a file being written here has parts evicted to the store: "
                                       "rename it after close")
        if target is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        self._check_new_name(new_parent, new_name)
        if node.is_dir:
            ancestor = new_parent
            while ancestor is not None:
                if ancestor is node:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                ancestor = ancestor.parent
            if target is not None and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target is not None and target.children:
                raise FsError(errno.ENOTEMPTY)
            new_prefix = (new_parent.key() + new_name).encode()
            longest = max(len(n.key().encode()) - len(node.key().encode()) for n in node.walk())
            if len(new_prefix) + 1 + longest > MAX_KEY_BYTES:
                raise FsError(errno.ENAMETOOLONG)
        elif target is not None and target.is_dir:
            raise FsError(errno.EISDIR)
        if target is not None:
            if target.is_dir or (not node.is_dir and node.version is None):
                self._log(Op(DELETE, target.key()))
            # Otherwise a file target needs no delete: the moved file's put or copy overwrites
            # its key. A file never committed (still being written) has neither yet.
            self._detach(target)
        old_keys = {n: n.key() for n in node.walk()}
        self._move(node, new_parent, new_name)
        for n in node.walk():
            self._relocate(n, old_keys[n])
        # Old directory markers go last, deepest first: a local store removes a directory
        # only once the files moved out of it.
        for n in reversed(list(node.walk())):
            if n.is_dir:
                self._log(Op(DELETE, old_keys[n]))
        self._touch(old_parent)
        self._touch(new_parent)

    def statfs(self) -> dict:
        usage = self.cache.usage()
        return {"ram": usage["ram"], "disk": usage["disk"], "files": len(self.inodes)}

    def sync_target(self, paths: list[str]) -> int:
        """The op sequence number ``sync`` must wait for (everything if no paths)."""
        if not paths:
            return self.uploader.last_seq()
        target = 0
        for path in paths:
            node = self._find([p for p in path.split("/") if p and p != "."])
            if node is None:
                raise FsError(errno.ENOENT, f"no such file on the mount: {path}")
            for n in node.walk():
                pending = n.version.seq if n.version is not None and n.version.seq is not None else 0
                target = max(target, n.last_seq, pending)
        return target

    def contents_under(self, paths: list[str]) -> list[tuple[Content, Callable[[], None]]]:
        """For warmup: the committed contents of the files at or under ``paths`` (all if none),
        each held and kept out of the clean-eviction list, with the call that ends that (once):
        it releases the content and lets the file's cached blocks be evicted again, now as the
        most recently used."""
        nodes: dict[int, Node] = {}
        for path in paths or [""]:
            node = self._find([p for p in path.split("/") if p and p != "."])
            if node is None:
                raise FsError(errno.ENOENT, f"no such file or directory on the mount: {path}")
            nodes.update((n.ino, n) for n in node.walk() if not n.is_dir and n.version is not None)
        out = []
        for node in nodes.values():
            content = node.version.content.hold()
            self.cache.unmark_clean(node)

            def done(node: Node = node, content: Content = content) -> None:
                content.release()
                self._maybe_clean(node)

            out.append((content, done))
        return out

    def status(self) -> dict:
        writing = sum(1 for h in self.handles.values() if h.staged is not None)
        return {"open_handles": len(self.handles), "open_writers": writing, "inodes": len(self.inodes)}

    # -- internals: commits and store ops --------------------------------------------------------
    def _commit(self, node: Node, content: Content, handle: Handle | None = None) -> None:
        try:
            op = _put_op(node.key(), content)
            op.replaces = self._replaced_manifest(node)
            op = self._log(op)
        except BaseException:
            content.drop_blocks()
            raise
        self._drop_pending(node)
        self._set_version(node, content, op)
        for shadow in node.shadows:
            # This commit supersedes what any writer fsynced before it (the last close wins):
            # those shadows retire once it is durable (until then they guard a node reboot).
            if shadow.covers is None:
                shadow.covers, shadow.handle = op.seq, None
        self._note_checkpoint(node, content.size)
        self._note_save(content.size)
        stream, stamps = None, None
        if handle is not None and handle.stream is not None:
            stream, stamps, handle.stream = handle.stream, list(handle.staged.stamps), None
        self.uploader.submit(op, content, self._on_durable(node), stream, stamps)
        node.mtime_ns = node.ctime_ns = time.time_ns()

    def _replaced_manifest(self, node: Node) -> str:
        """The manifest a new version of ``node`` makes obsolete once it is in the store: the
        durable version's upload id where known, "?" where it may have one (the uploader asks)."""
        version = node.version
        if version is None or version.seq is not None or version.content.key != node.key():
            return ""
        checks = version.content.checksums
        if checks is not None:
            return checks.upload if checks.source == "manifest" else ""
        return "?" if version.content.size > min(self.cache.block_size, MIN_MULTIPART) else ""

    def _set_version(self, node: Node, content: Content, op: Op) -> None:
        old = node.version
        node.version = Version(content, op.seq)
        node.last_seq = op.seq
        self.cache.unmark_clean(node)
        if old is not None:
            old.content.release()

    def _on_durable(self, node: Node):
        version = node.version

        def durable(op: Op) -> None:
            version.seq = None
            version.content.durable_at = time.time()
            version.content.in_store = True
            version.content.key = op.key
            version.content.remote = {}  # evicted parts are now plain store reads
            self._retire_shadows(node, op.seq)
            self._maybe_clean(node)
            if version.content.size >= self.cache.block_size and (node.parent is self.root or self._pinned(node)):
                self.prefill.want(node, version)  # a checkpoint a restart will load: into the page cache

        return durable

    def _on_moved(self, node: Node | None):
        version = node.version if node is not None else None

        def moved(op: Op) -> None:
            if version is not None and version.seq is None:
                version.content.key = op.key

        return moved

    def _drop_pending(self, node: Node) -> None:
        """The node's pending put will never be needed (overwritten, unlinked, replaced)."""
        if node.version is not None and node.version.seq is not None:
            self.uploader.cancel(node.version.seq)

    def _relocate(self, node: Node, old_key: str) -> None:
        """Store ops for one node after a rename moved it from ``old_key``."""
        new_key = node.key()
        if node.is_dir:
            node.last_seq = self._log(Op(MKDIR, new_key)).seq
            return
        for shadow in node.shadows:
            shadow.op.key = new_key
            self.journal.retarget(shadow.op.seq, new_key)
        version = node.version
        if version is None:
            return  # created, never committed: its commit will use the new key
        if version.seq is not None and self.uploader.retarget(version.seq, new_key):
            node.last_seq = version.seq
            self._log(Op(DELETE, old_key))  # an older durable version may sit there
            return
        op = self._log(Op(MOVE, new_key, src=old_key))
        node.last_seq = op.seq
        self.uploader.submit(op, None, self._on_moved(node))

    def _log(self, op: Op) -> Op:
        """Journal an op and hand it to the uploader (a put is handed over by _commit)."""
        try:
            self.journal.append(op)
        except OSError as exc:
            log.error("journal write failed: %s", exc)
            raise FsError(exc.errno or errno.EIO, "journal write failed") from exc
        if op.kind in (DELETE, MKDIR):
            self.uploader.submit(op)
        return op

    # -- internals: tree ---------------------------------------------------------------------------
    def _add(self, parent: Node, name: str, is_dir: bool, mode: int | None = None, uid=None, gid=None) -> Node:
        if mode is None:
            mode = stat.S_IFDIR | self.dir_mode if is_dir else stat.S_IFREG | self.file_mode
        node = Node(self._next_ino, name, parent, is_dir, mode, self.uid if uid is None else uid, self.gid if gid is None else gid)
        self._next_ino += 1
        self.inodes[node.ino] = node
        parent.children[name] = node
        return node

    def _move(self, node: Node, new_parent: Node, new_name: str) -> None:
        del node.parent.children[node.name]
        node.parent = new_parent
        node.name = new_name
        new_parent.children[new_name] = node
        node.ctime_ns = time.time_ns()

    def _detach(self, node: Node) -> None:
        """Take a node out of the tree; it lives on while the kernel or a handle knows it."""
        for n in list(node.walk()):
            if not n.is_dir:
                self._drop_pending(n)
                self._retire_shadows(n)
            self.cache.unmark_clean(n)
            if n.version is not None:
                n.version.content.release()
                n.version = None
            n.unlinked = True
        del node.parent.children[node.name]
        self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if node.unlinked and node.nlookup == 0 and node.handles == 0:
            self.inodes.pop(node.ino, None)

    def _maybe_clean(self, node: Node) -> None:
        """Durable and not being written: its cached bytes may be evicted (the store has them).
        While readers have it open, block by block, so a file larger than the cache can be read."""
        version = node.version
        if version is not None and version.seq is None and node.writers == 0 and not node.unlinked:
            if version.content.in_store and (version.content.refs() or node.handles):
                self.cache.mark_clean(node, version.content, lambda: None, whole=node.handles == 0)

    def _open_handle(self, node: Node, staged: StagedFile | None, content: Content | None, append: bool) -> Handle:
        handle = Handle(self._next_fh, node, staged, content, append)
        self._next_fh += 1
        self.handles[handle.fh] = handle
        node.handles += 1
        if staged is not None:
            node.writers += 1
        self.cache.unmark_clean(node)
        self._maybe_clean(node)  # a reader: evictable block by block
        return handle

    def _ensure_dir(self, parts: list[str]) -> Node | None:
        node = self.root
        for part in parts:
            child = node.children.get(part)
            if child is None:
                child = self._add(node, part, is_dir=True)
            elif not child.is_dir:
                return None
            node = child
        return node

    def _find(self, parts: list[str]) -> Node | None:
        node = self.root
        for part in parts:
            node = node.children.get(part) if node.is_dir else None
            if node is None:
                return None
        return node

    def _dir(self, ino: int) -> Node:
        node = self.node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def _child(self, parent: Node, name: str) -> Node:
        node = parent.children.get(name)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def _check_new_name(self, parent: Node, name: str) -> None:
        try:
            encoded = name.encode("utf-8")
        except UnicodeEncodeError:
            raise FsError(errno.EINVAL, "names must be valid UTF-8 to be stored as keys") from None
        if len(encoded) > MAX_NAME_BYTES:
            raise FsError(errno.ENAMETOOLONG)
        if len(parent.key().encode()) + len(encoded) + 1 > MAX_KEY_BYTES:
            raise FsError(errno.ENAMETOOLONG, "the path is longer than the store's key limit")
        if parent is self.root and name.startswith(RESERVED_PREFIX):
            raise FsError(errno.EINVAL, f"names starting with {RESERVED_PREFIX} are reserved at the top")
        if name in (".", ".."):
            raise FsError(errno.EINVAL)

    def _touch(self, node: Node) -> None:
        node.mtime_ns = node.ctime_ns = time.time_ns()
        node.changed_here = self._now()

    def _n_blocks(self, size: int) -> int:
        return (size + self.cache.block_size - 1) // self.cache.block_size


def _common_dir(a: str, b: str) -> str:
    """The deepest directory key both directory keys ``a`` and ``b`` are under ("" = the root)."""
    common = []
    for x, y in zip(a.split("/")[:-1], b.split("/")[:-1]):
        if x != y:
            break
        common.append(x)
    return "/".join(common) + "/" if common else ""


def _release_blocks(cache: Cache, blocks: list) -> None:
    for ref in blocks:
        if ref is not None:
            cache.decref(ref)


_MERGED, _SKIPPED, _FAILED = "merged", "skipped", "failed"


class _Flight:
    """A store question in flight that other requests wait for instead of asking again."""

    def __init__(self):
        self.done = trio.Event()
        self.outcome = _FAILED


class _DirState:
    """What a directory held when a store call about it began, to tell after the call whether
    it changed here meanwhile (then that answer may be older than our change)."""

    def __init__(self, node: Node):
        self.key = node.key()
        self.ctime_ns = node.ctime_ns  # every create, unlink, mkdir, rmdir, rename in it touches it
        self.children = dict(node.children)
        self.versions = {name: child.version for name, child in node.children.items()}

    def unchanged(self, node: Node) -> bool:
        return (not node.unlinked and node.ctime_ns == self.ctime_ns and node.key() == self.key
                and node.children == self.children)


def _same_object(seen: ObjectInfo, now: ObjectInfo) -> bool:
    """Whether two answers of the store describe the same object (by ETag where it has them)."""
    if seen.size != now.size:
        return False
    if seen.etag and now.etag:
        return seen.etag == now.etag
    return seen.mtime == now.mtime


def _put_op(key: str, content: Content) -> Op:
    op = Op(PUT, key, size=content.size, blocks=list(content.blocks))
    if content.remote:  # the upload holding the evicted parts (a restart completes it)
        upload = content.upload
        op.upload = [upload.key, upload.upload_id, upload.journal_id]
        op.parts = {index: part.token for index, part in content.remote.items()}
        op.hashes = {index: part.xxh3 for index, part in content.remote.items() if part.xxh3}
    return op


def _split_key(key: str) -> list[str] | None:
    """A store key as path parts, or None if it cannot be shown safely (.., empty, overlong)."""
    if not key or key.startswith("/") or len(key.encode()) > MAX_KEY_BYTES:
        return None
    parts = key.rstrip("/").split("/") if key != "/" else []
    if not parts or any(p in ("", ".", "..") or len(p.encode()) > MAX_NAME_BYTES for p in parts):
        return None
    if parts[0].startswith(RESERVED_PREFIX):
        return None
    return parts
