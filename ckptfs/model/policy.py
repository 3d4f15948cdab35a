"""Which cached bytes may go, and which go last: the model's side of the cache's eviction.

Two halves, because the cache and the uploader stand between them in the wiring (the cache is
built with its policy, the uploader with the cache):

- ``CheckpointEvictionPolicy``, the cache's ``EvictionPolicy`` (ckptfs/cache/cache.py), built
  with the tree before the cache: ``pinned(owner)`` (the latest checkpoint's clean data goes
  last), ``reclaim()`` (drop one block of a file being written sequentially whose part is already uploaded)
  and ``releases_pending()`` (whether a writer waiting for space can expect some). It keeps
  where the latest checkpoint is.
- ``Retention``, built after the cache and the uploader, what the model tells the cache: a
  commit says how large saves are and where the latest checkpoint is (``note_commit``), a node
  whose data is durable and unopened becomes evictable (``maybe_clean``) or must stay
  (``keep``), and blocks the last mount left are checked before first use (``verify_kept``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from ckptfs.cache.cache import Cache, EvictionPolicy
from ckptfs.cache.clean_index import cached_digest
from ckptfs.cache.contents import Content
from ckptfs.model.tree import Node, Tree, common_dir
from ckptfs.transfer.uploader import Uploader
from ckptfs.util.single_flight import SingleFlight

log = logging.getLogger(__name__)

CHECKPOINT_GAP_S = 60.0  # shards committed closer together than this belong to one save


class CheckpointEvictionPolicy(EvictionPolicy):
    """``uploads_hold_cache``: whether an upload in progress still holds cache blocks (the
    uploader's ``holds_cache``; a function, as the uploader is built after the cache)."""

    def __init__(self, tree: Tree, block_size: int, uploads_hold_cache: Callable[[], bool]):
        self.tree = tree
        self.block_size = block_size
        self.uploads_hold_cache = uploads_hold_cache
        # The latest checkpoint: the directory of the shards committed in the last burst of
        # saves (their common ancestor), whose clean data is evicted last.
        self.checkpoint_dir = ""
        self._last_shard_commit = 0.0

    # -- asked by the cache ---------------------------------------------------------------------
    def pinned(self, owner: object) -> bool:
        return (
            bool(self.checkpoint_dir)
            and isinstance(owner, Node)
            and owner.key().startswith(self.checkpoint_dir)
        )

    def releases_pending(self) -> bool:
        return self.uploads_hold_cache()

    def reclaim(self) -> bool:
        """The cache is full: drop one block of a file being written whose part is already in
        the store (its upload keeps it). Only a writer sequential so far (``Writing.sequential``):
        one that went back may change the block again. Blocks shared with a committed version stay."""
        for handle in self.tree.handles.values():
            stream, staged = handle.stream, handle.staged
            if stream is None or stream.upload is None or stream.key != handle.node.key():
                continue  # (renamed since streaming began: its parts may not stay under that key)
            assert handle.writing is not None  # (a handle with a stream is a writer)
            if not handle.writing.sequential:
                continue  # it went back: it may change those blocks again (it waits for space)
            assert staged is not None  # a handle with a stream is a writer: it has a working copy
            for index, (stamp, part) in stream.sent.items():
                ref = staged.blocks[index] if index < len(staged.blocks) else None
                if ref is not None and staged.stamps[index] == stamp and staged.cache.refcounts.get(ref) == 1:
                    staged.evict(index, part)
                    return True
        return False

    # -- where the latest checkpoint is -----------------------------------------------------------
    def note_shard(self, node: Node, size: int) -> None:
        """A shard was committed: it belongs to the latest checkpoint (a burst of saves)."""
        if size < self.block_size or node.parent is self.tree.root:
            return  # pointer files and loose top-level files do not say where checkpoints go
        now = time.monotonic()
        parent = node.parent
        assert parent is not None  # a committed file is never the root (the only parentless node)
        directory = parent.key()
        if now - self._last_shard_commit > CHECKPOINT_GAP_S or not self.checkpoint_dir:
            self.checkpoint_dir = directory  # a new save began
        else:  # the same save: the common ancestor of its shards' directories (never the root)
            self.checkpoint_dir = common_dir(self.checkpoint_dir, directory) or directory
        self._last_shard_commit = now

    def note_kept(self, kept: list[Node]) -> None:
        """At start-up, ``kept`` the files whose blocks the last mount left cached: the newest
        shard's directory stands for the latest checkpoint."""
        shards = [n for n in kept if _kept_content(n).size >= self.block_size]
        if shards:
            newest = max(shards, key=lambda n: _kept_content(n).durable_at)
            parent = newest.parent
            assert parent is not None  # a file is never the root (the only parentless node)
            self.checkpoint_dir = parent.key()


def _kept_content(node: Node) -> Content:
    """A kept file's committed content (``startup.load`` keeps only files with a version)."""
    assert node.version is not None
    return node.version.content


class Retention:
    """What the model tells the cache about its files' blocks (and whether background work
    should wait: ``busy``)."""

    def __init__(self, tree: Tree, cache: Cache, uploader: Uploader, policy: CheckpointEvictionPolicy):
        self.tree = tree
        self.cache = cache
        self.uploader = uploader
        self.policy = policy
        self._last_commit, self._burst_bytes = 0.0, 0
        self._verifying = SingleFlight()

    def busy(self) -> bool:
        """A save or an upload is running (background work such as prefill waits for idle time)."""
        return bool(self.uploader.pending) or any(h.staged is not None for h in self.tree.handles.values())

    def maybe_clean(self, node: Node) -> None:
        """Durable and not being written: its cached bytes may be evicted (the store has them).
        While readers have it open, block by block, so a file larger than the cache can be read."""
        version = node.version
        if version is not None and version.seq is None and node.writers == 0 and not node.unlinked:
            if version.content.in_store and (version.content.refs() or node.handles):
                self.cache.mark_clean(node, version.content, lambda: None, whole=node.handles == 0)

    def keep(self, node: Node) -> None:
        """``node``'s cached bytes must stay (being written, changed, or needed whole)."""
        self.cache.unmark_clean(node)

    def note_commit(self, node: Node, size: int, in_arenas: bool = True) -> None:
        """``in_arenas``: the version's bytes went through the arenas (not a working file the
        kernel wrote: the next such save takes no RAM slot, so none is made ready for it)."""
        self.policy.note_shard(node, size)
        if in_arenas:
            self._note_save(size)

    def _note_save(self, size: int) -> None:
        """Bytes committed in this burst of saves: the cache keeps as much RAM ready for the next."""
        now = time.monotonic()
        if now - self._last_commit > CHECKPOINT_GAP_S:
            self._burst_bytes = 0
        self._burst_bytes += size
        self._last_commit = now
        self.cache.expect_writes(self._burst_bytes)

    def loaded(self, kept: list[Node]) -> None:
        """At start-up: ``kept`` are the files whose blocks the last mount left cached. They are
        evictable, and the newest shard's directory stands for the latest checkpoint."""
        for node in kept:
            self.maybe_clean(node)
        self.policy.note_kept(kept)

    async def verify_kept(self, content: Content) -> None:
        """First open of a file whose blocks the last mount left: check them before use (one
        check per content however many open it at once)."""
        await self._verifying.run(id(content), lambda: self._verify(content))

    async def _verify(self, content: Content) -> None:
        content.hold()
        try:
            digest = await trio.to_thread.run_sync(cached_digest, self.cache, content.size, content.blocks)
            if digest != content.verify:
                log.warning(
                    "%s: cached copy from the last mount does not match its digest; reading the store",
                    content.key,
                )
                content.drop_blocks()
            content.verify = ""
        finally:
            content.release()
