"""Refresh from the store: what other mounts made durable.

The tree is the store's listing at mount time plus this mount's own changes. Other mounts of
the same bucket and prefix (other nodes) publish objects too. So a directory used (listed, or
a name looked up in it) whose last listing is older than ``list_ttl`` is listed again, one
level, and merged (``refresh_dir``); a name this mount does not know in a directory listed more
recently is asked of the store (``_ask_store``), and an absence is remembered for ``list_ttl``
(so probing loops do not hammer the store). Local changes not yet in the store always win: the
merge only ever touches durable, unopened files with no pending op, and names pending ops are
about are left alone. Store calls run in threads; what changed here while one was in flight is
re-checked after it (no merge across a local change). One listing per directory and one probe
per name at a time (``SingleFlight``); a store that does not answer is given up on after a
deadline (``retry.ANSWER``), and the tree answers from what it knows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import trio

from ckptfs.cache.cache import Cache
from ckptfs.errors import StoreError
from ckptfs.model.commits import Commits
from ckptfs.model.tree import Node, Tree, apply_attr_metadata, show_store_version, split_key, store_content
from ckptfs.store.base import DirListing, ObjectInfo, ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer import retry
from ckptfs.util.single_flight import SingleFlight

log = logging.getLogger(__name__)

LIST_THREADS = 8  # listings and HEADs in flight (apart from data transfers)
STORE_MTIME_SLACK_S = 2.0  # S3 dates have whole seconds; a node's clock may be a little off the store's
UNSEEN_GRACE_S = 10.0  # a file this mount made durable is dropped as gone only once a listing could show it
NEGATIVE_CACHE_MAX = 65536  # names remembered as absent (then forgotten all at once)
# A lookup (and so every create: the kernel looks the name up first) waits at most this long;
# then it answers from what this mount knows and the store counts as failing.
LOOKUP_WAIT_S = 1.5

MERGED, SKIPPED, FAILED = "merged", "skipped", "failed"


class Refresher:
    def __init__(
        self,
        tree: Tree,
        commits: Commits,
        cache: Cache,
        store: ObjectStore,
        health: StoreHealth,
        list_ttl: float | None,
        forget_name: Callable[[int, str], None],
    ):
        self.tree = tree
        self.commits = commits
        self.cache = cache
        self.store = store
        self.health = health
        # Seconds a directory listing or a missing name is trusted (0: ask every time; None:
        # never, the tree is the listing at mount plus our changes).
        self.list_ttl = list_ttl
        # The kernel drops its cached entry (and so the attributes) of a name, asynchronously:
        # the store changed a file behind the kernel's back (KernelCache.forget_name).
        self.forget_name = forget_name
        self.list_threads = trio.CapacityLimiter(LIST_THREADS)
        self.missing = NegativeCache(tree)
        self._listing = SingleFlight(default=FAILED)  # dir ino -> the listing in flight
        self._asking = SingleFlight()  # (dir ino, name) -> the store probe in flight
        self._heading = SingleFlight(default=False)  # ino -> the HEAD for its attributes in flight
        self.attr_heads = 0  # HEADs sent for attributes (status, the docs' request cost)
        self._store_failing = False  # a refresh failed: logged once until the store answers again

    def due(self, node: Node) -> bool:
        return (
            self.list_ttl is not None
            and not node.unlinked
            and (node.listed_at is None or self.tree.now() - node.listed_at >= self.list_ttl)
        )

    async def lookup(self, parent: Node, name: str) -> None:
        """Before a lookup: bring ``parent`` up to date, waiting at most LOOKUP_WAIT_S."""
        with trio.move_on_after(LOOKUP_WAIT_S) as waited:
            await self.catch_up(parent, name)
        if waited.cancelled_caught:
            self._store_trouble(
                f"cannot look up {name}", TimeoutError(f"the store did not answer in {LOOKUP_WAIT_S:g} s")
            )

    async def catch_up(self, parent: Node, name: str) -> None:
        """Bring what ``parent`` shows under ``name`` up to date with the store."""
        if self.list_ttl is None or name in (".", "..") or parent.unlinked:
            return
        outcome = await self.refresh_dir(parent) if self.due(parent) else None
        if name not in parent.children:
            if outcome in (MERGED, FAILED):  # just listed (or the store fails: not again before the TTL)
                self.missing.remember(parent, name, self.list_ttl)
            elif self._writing_here(parent):
                pass  # this mount writes here: see _writing_here
            elif not self.missing.known(parent, name):  # (or the listing was not used: changed here)
                await self._ask_store(parent, name)

    async def refresh_paths(self, paths: list[str]) -> None:
        """Before a command walks ``paths`` (all if none) in the tree rather than through the
        kernel (warmup): look each one up as the kernel would, and list every directory at or
        under them whose listing is due, so what other mounts made durable is included."""
        if self.list_ttl is None:
            return
        for path in paths or [""]:
            node = self.tree.root
            for part in [p for p in path.split("/") if p and p != "."]:
                await self.catch_up(node, part)
                child = node.children.get(part)
                if child is None or not child.is_dir:
                    break
                node = child
            else:
                todo = [node]
                while todo:
                    directory = todo.pop()
                    if self.due(directory):
                        await self.refresh_dir(directory)
                    todo += [child for child in directory.children.values() if child.is_dir]

    def _writing_here(self, parent: Node) -> bool:
        """Whether this mount created, removed or renamed something in ``parent`` less than
        ``list_ttl`` ago. Then a name it does not know is not asked of the store: the lookup
        before each create would cost a round trip (measured on the test S3 server: 27 ms per
        small file instead of 1.5 ms). What other mounts put there still shows up with the next
        listing, at most ``list_ttl`` later: the handoff case (a reader on another node opens
        what a writer published) is not a writer of that directory, and is answered at once."""
        ttl = self.list_ttl
        assert ttl is not None  # asked only by catch_up, which returns first when listings are off
        return parent.changed_here is not None and self.tree.now() - parent.changed_here < ttl

    # -- listing a directory -----------------------------------------------------------------------
    async def refresh_dir(self, node: Node) -> str:
        """List directory ``node`` (one level) from the store and merge that into the tree.
        Returns MERGED, SKIPPED (it changed here while the listing was in flight: the listing
        is dropped, not merged) or FAILED (the store failed: the tree stays as it was). Either
        way the directory counts as listed now, so the next try waits for the TTL."""
        # (SingleFlight returns object: here _list's str, or its default FAILED)
        return cast(str, await self._listing.run(node.ino, lambda: self._list(node)))

    async def _list(self, node: Node) -> str:
        started = self.tree.now()
        prefix = node.key()
        before = _DirState(node)
        blocked = self.commits.pending_names(prefix)
        try:
            listing = await self._store_call(self.store.list_dir, prefix)
        except Exception as exc:  # noqa: BLE001 - never fail a readdir or lookup for this
            self._store_trouble(f"cannot list {prefix or 'the top directory'}", exc)
            outcome = FAILED
        else:
            self._store_answers()
            if before.unchanged(node):
                blocked |= self.commits.pending_names(prefix)  # (and what began during the listing)
                self._merge_listing(node, prefix, listing, before, blocked)
                outcome = MERGED
            else:
                outcome = SKIPPED
        if node.listed_at is None or node.listed_at < started:
            node.listed_at = started
        return outcome

    def _merge_listing(
        self, node: Node, prefix: str, listing: DirListing, before: _DirState, blocked: set[str]
    ) -> None:
        """The store's listing of directory ``node`` into the tree (no awaits): new names are
        added, files the store changed are followed, names the store lost are dropped, all only
        where nothing here disagrees (see ``_follow_store`` and ``_removable``)."""
        files = {info.key[len(prefix) :]: info for info in listing.files}
        dirs = set(listing.dirs)
        for name in sorted(set(node.children) | set(files) | dirs):
            if name in blocked:
                continue  # a pending op of ours is about it: our view wins until it is done
            child = node.children.get(name)
            info = files.get(name)
            if child is None:
                if info is not None and split_key(info.key) is not None:
                    self._add_from_store(node, name, info)
                elif info is None and split_key(prefix + name + "/") is not None:
                    self.tree.add(node, name, is_dir=True).attrs_known = False
            elif child.is_dir:
                if info is None and name not in dirs and _removable(child):
                    self._drop_gone(child)
                # (a file in the store where we have a directory: ours stays, as at mount)
            elif child.version is not before.versions.get(name):
                continue  # committed here meanwhile
            elif info is not None:
                self._follow_store(child, info)
            elif _removable(child):
                self._drop_gone(child)

    def _drop_gone(self, node: Node) -> None:
        log.info("%s is gone from the store: no longer shown", node.key())
        for n in node.walk():
            n.gone = True
        parent = node.parent
        assert parent is not None  # a child a listing of its directory no longer shows
        self.forget_name(parent.ino, node.name)
        self.commits.detach(node)

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
        self.commits.retention.keep(node)
        show_store_version(node, store_content(self.cache, info), info)
        version.content.release()  # its cached blocks go (nobody has it open)
        parent = node.parent
        assert parent is not None  # a child of the directory just listed
        self.forget_name(parent.ino, node.name)  # its size and mtime changed

    def _add_from_store(self, parent: Node, name: str, info: ObjectInfo, headed: bool = False) -> Node:
        node = self.tree.add(parent, name, is_dir=False)
        show_store_version(node, store_content(self.cache, info), info, headed)
        return node

    # -- asking about one name ---------------------------------------------------------------------
    async def _ask_store(self, parent: Node, name: str) -> None:
        """Is there a file ``name`` (HEAD) or a directory (any key under ``name/``) in ``parent``
        in the store? If so it joins the tree; if not, that is remembered for the TTL."""
        key = parent.key() + name
        try:
            if split_key(key + "/") is None:
                return  # not a name the store can hold: absent
        except UnicodeEncodeError:
            return  # not UTF-8: no key can have it
        await self._asking.run((parent.ino, name), lambda: self._ask(parent, name, key))

    async def _ask(self, parent: Node, name: str, key: str) -> None:
        before = _DirState(parent)
        blocked = self.commits.pending_names(parent.key())
        try:
            info, is_dir = await self._probe(key)
        except Exception as exc:  # noqa: BLE001 - the lookup answers from what we know
            self._store_trouble(f"cannot look up {key}", exc)
            self.missing.remember(parent, name, self.list_ttl)
            return
        self._store_answers()
        if not before.unchanged(parent):
            return  # changed here meanwhile: the kernel asks again, we decide then
        if name in blocked or name in self.commits.pending_names(parent.key()):
            self.missing.remember(parent, name, self.list_ttl)  # removed here, not yet from the store: gone
            return
        if info is not None:
            self._add_from_store(parent, name, info, headed=True)
        elif is_dir:
            self.tree.add(parent, name, is_dir=True).attrs_known = False  # its marker may carry them
        else:
            self.missing.remember(parent, name, self.list_ttl)

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
        # (answers are typed object; exceptions were raised above: the HEAD's ObjectInfo | None)
        return cast("ObjectInfo | None", answers["file"]), bool(answers["dir"])

    # -- attributes ---------------------------------------------------------------------------------
    async def learn_attrs(self, nodes: list[Node]) -> bool:
        """Read the stored attributes (mode, uid, gid, mtime) of nodes a listing showed: one HEAD
        each (a directory's marker), at most LIST_THREADS at once, one per node in flight. False
        if one could not be read (the store failed): that node stays shown as root's, mode 0."""
        unknown = [n for n in nodes if not n.attrs_known and not n.unlinked]
        if not unknown:
            return True
        if len(unknown) == 1:
            # (SingleFlight returns object: here _head_attrs's bool, or its default False)
            return cast(bool, await self._heading.run(unknown[0].ino, lambda: self._head_attrs(unknown[0])))
        results = []

        async def one(node: Node) -> None:
            results.append(await self._heading.run(node.ino, lambda: self._head_attrs(node)))

        async with trio.open_nursery() as nursery:
            for node in unknown:
                nursery.start_soon(one, node)
        return all(results)

    async def _head_attrs(self, node: Node) -> bool:
        key = node.key()
        self.attr_heads += 1
        try:
            info = await self._store_call(self.store.head, key)
        except Exception as exc:  # noqa: BLE001 - the caller refuses what it cannot show safely
            self._store_trouble(f"cannot read the attributes of {key}", exc)
            return False
        self._store_answers()
        if not node.attrs_known:  # (nobody showed a newer version meanwhile)
            apply_attr_metadata(node, info.metadata if info is not None else {})
        return True

    # -- the store's health, as listings see it ----------------------------------------------------
    async def _store_call(self, fn, *args):
        """``fn(*args)`` in a thread under the ANSWER policy: one try, given up (TimeoutError)
        if the store takes too long, sooner while it is known to be failing."""
        failing = self._store_failing or self.health.in_trouble()
        return await retry.ANSWER.call(fn, *args, failing=failing, limiter=self.list_threads)

    def _store_trouble(self, what: str, exc: Exception) -> None:
        if not self._store_failing:  # (once per episode: lookups must not flood the status's errors)
            self.health.failed(
                "", "", f"{what}: {exc}", reachable=False if isinstance(exc, TimeoutError) else None
            )
            self._store_failing = True
            log.warning(
                "%s: %s; showing what this mount knows (logged once until the store answers)",
                what,
                exc,
                exc_info=not isinstance(exc, (StoreError, TimeoutError)),
            )
        else:
            log.debug("%s: %s", what, exc)

    def _store_answers(self) -> None:
        self.health.answered()
        if self._store_failing:
            self._store_failing = False
            log.info("the store answers listings again")


class NegativeCache:
    """Names found absent from a directory, remembered for a while (bounded)."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self._until: dict[tuple[int, str], float] = {}  # (dir ino, name) -> absent until (monotonic)

    def remember(self, parent: Node, name: str, ttl: float | None) -> None:
        if not ttl:
            return
        if len(self._until) >= NEGATIVE_CACHE_MAX:
            now = self.tree.now()
            self._until = {k: t for k, t in self._until.items() if t > now}
            if len(self._until) >= NEGATIVE_CACHE_MAX:
                self._until.clear()
        self._until[(parent.ino, name)] = self.tree.now() + ttl

    def known(self, parent: Node, name: str) -> bool:
        until = self._until.get((parent.ino, name))
        if until is None:
            return False
        if until > self.tree.now():
            return True
        del self._until[(parent.ino, name)]
        return False

    def ttl_left(self, parent_ino: int, name: str) -> float:
        until = self._until.get((parent_ino, name))
        return max(0.0, until - self.tree.now()) if until is not None else 0.0


class _DirState:
    """What a directory held when a store call about it began, to tell after the call whether
    it changed here meanwhile (then that answer may be older than our change)."""

    def __init__(self, node: Node):
        self.key = node.key()
        self.ctime_ns = node.ctime_ns  # every create, unlink, mkdir, rmdir, rename in it touches it
        self.children = dict(node.children)
        self.versions = {name: child.version for name, child in node.children.items()}

    def unchanged(self, node: Node) -> bool:
        return (
            not node.unlinked
            and node.ctime_ns == self.ctime_ns
            and node.key() == self.key
            and node.children == self.children
        )


def _removable(node: Node) -> bool:
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


def _same_object(seen: ObjectInfo, now: ObjectInfo) -> bool:
    """Whether two answers of the store describe the same object (by ETag where it has them)."""
    if seen.size != now.size:
        return False
    if seen.etag and now.etag:
        return seen.etag == now.etag
    return seen.mtime == now.mtime
