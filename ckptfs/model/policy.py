"""Which cached bytes may go, and which go last: the model's side of the cache's eviction.

The cache calls three methods of ``CachePolicy`` (it receives the policy in its constructor):
``pinned(owner)`` (the latest checkpoint's clean data goes last), ``reclaim()`` (drop one block
of a file being written whose part is already uploaded) and ``releases_pending()`` (whether a
writer waiting for space can expect some). The model calls the rest: a commit says where the
latest checkpoint is (``note_commit``), a node whose data is durable and unopened becomes
evictable (``maybe_clean``), and blocks the last mount left are checked before first use
(``verify_kept``).
"""

from __future__ import annotations

import logging
import time

import trio

from ckptfs.cache.cache import Cache
from ckptfs.cache.clean_index import cached_digest
from ckptfs.cache.contents import Content
from ckptfs.model.tree import Node, Tree, common_dir
from ckptfs.transfer.uploader import Uploader
from ckptfs.util.single_flight import SingleFlight

log = logging.getLogger(__name__)

CHECKPOINT_GAP_S = 60.0  # shards committed closer together than this belong to one save


class CachePolicy:
    def __init__(self, tree: Tree):
        self.tree = tree
        self.cache: Cache | None = None  # (bound with the uploader: both are built after the policy)
        self.uploader: Uploader | None = None
        # The latest checkpoint: the directory of the shards committed in the last burst of
        # saves (their common ancestor), whose clean data is evicted last.
        self.checkpoint_dir = ""
        self._last_shard_commit = 0.0
        self._last_commit, self._burst_bytes = 0.0, 0
        self._verifying = SingleFlight()

    def bind(self, cache: Cache, uploader: Uploader) -> None:
        """The cache is built with this policy, the uploader with that cache: the one cycle of
        the wiring, closed here once both exist."""
        self.cache, self.uploader = cache, uploader

    # -- asked by the cache ---------------------------------------------------------------------
    def pinned(self, owner: object) -> bool:
        return (
            bool(self.checkpoint_dir)
            and isinstance(owner, Node)
            and owner.key().startswith(self.checkpoint_dir)
        )

    def releases_pending(self) -> bool:
        """Whether some holder of blocks will let go of them by itself (an upload in progress)."""
        return self.uploader is None or self.uploader.holds_cache()

    def reclaim(self) -> bool:
        """The cache is full: drop one block of a file being written whose part is already in
        the store (its upload keeps it). Blocks shared with a committed version stay."""
        for handle in self.tree.handles.values():
            stream, staged = handle.stream, handle.staged
            if stream is None or stream.upload is None or stream.key != handle.node.key():
                continue  # (renamed since streaming began: its parts may not stay under that key)
            for index, (stamp, part) in stream.sent.items():
                ref = staged.blocks[index] if index < len(staged.blocks) else None
                if ref is not None and staged.stamps[index] == stamp and staged.cache.refcounts.get(ref) == 1:
                    staged.evict(index, part)
                    return True
        return False

    # -- told by the model ----------------------------------------------------------------------
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

    def note_commit(self, node: Node, size: int) -> None:
        self._note_checkpoint(node, size)
        self._note_save(size)

    def _note_checkpoint(self, node: Node, size: int) -> None:
        """A shard was committed: it belongs to the latest checkpoint (a burst of saves)."""
        if size < self.cache.block_size or node.parent is self.tree.root:
            return  # pointer files and loose top-level files do not say where checkpoints go
        now = time.monotonic()
        directory = node.parent.key()
        if now - self._last_shard_commit > CHECKPOINT_GAP_S or not self.checkpoint_dir:
            self.checkpoint_dir = directory  # a new save began
        else:  # the same save: the common ancestor of its shards' directories (never the root)
            self.checkpoint_dir = common_dir(self.checkpoint_dir, directory) or directory
        self._last_shard_commit = now

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
        shards = [n for n in kept if n.version.content.size >= self.cache.block_size]
        if shards:
            newest = max(shards, key=lambda n: n.version.content.durable_at)
            self.checkpoint_dir = newest.parent.key()

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
