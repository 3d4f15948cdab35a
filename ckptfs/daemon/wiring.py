"""The mount's parts, built and wired in one place: ``build_core`` (used by the daemon and by
tests that want the daemon's wiring without FUSE).

Start-up order matters for crash recovery: the journal is replayed and its blocks adopted by
the cache before anything can allocate, the log is compacted to what is still pending, and only
then (``Core.load``, inside trio with the workers running) does the namespace lay those ops
over the store listing and hand them back to the uploader.

Who gets what (docs/architecture.md, "Wiring"): the cache receives the model's cache policy in
its constructor; the fetcher its health and read timeout; the namespace the policy (and so the
tree) and the shared health. Three links are made after construction, all inside
``build_core``: the policy learns the cache and the uploader (``CachePolicy.bind``, called by
the ``Namespace`` constructor: the cache is built with the policy and the uploader with the
cache, a cycle); the uploader gets the shared health and the journal ops the model keeps
besides its own (``retained_ops``, set by the ``Namespace`` constructor), as uploader.py takes
neither in its constructor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import trio

from ckptfs.cache import clean_index
from ckptfs.cache.arena import RAM
from ckptfs.cache.cache import Cache
from ckptfs.cache.clean_index import CleanEntry
from ckptfs.cache.journal import Journal, Op
from ckptfs.config import MountConfig
from ckptfs.daemon import limits
from ckptfs.model.namespace import Namespace
from ckptfs.model.policy import CachePolicy
from ckptfs.model.tree import Tree
from ckptfs.store.base import ObjectInfo, ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer.fetcher import Fetcher
from ckptfs.transfer.uploader import Uploader

log = logging.getLogger(__name__)

CLEAN_INDEX = "clean.index"
JOURNAL = "journal"


@dataclass
class Core:
    store: ObjectStore
    health: StoreHealth
    cache: Cache
    journal: Journal
    uploader: Uploader
    fetcher: Fetcher
    namespace: Namespace
    pending: list[Op]  # the journal's ops the last run left unfinished
    open_uploads: list  # multipart uploads the journal recorded as open
    clean: dict[str, CleanEntry]  # blocks the last mount left cached, by key

    async def start(self, nursery: trio.Nursery) -> None:
        """The uploader (resuming the open uploads) and the fetcher, in ``nursery``."""
        await nursery.start(self.uploader.run, self.open_uploads)
        await nursery.start(self.fetcher.run)

    def load(self, listing: Iterable[ObjectInfo]) -> None:
        """The tree: the store's ``listing`` with the pending ops replayed (after ``start``)."""
        self.namespace.load(listing, self.pending, self.clean)

    def close(self) -> None:
        self.uploader.close()  # store calls abandoned at shutdown may no longer read the cache
        self.journal.close()
        self.cache.close()


def build_core(
    config: MountConfig,
    store: ObjectStore,
    cache_dir: Path,
    ram_dir: Path,
    root: tuple[int, int, int] | None = None,
    check_ram_room: bool = True,
    health: StoreHealth | None = None,
) -> Core:
    """The cache, journal (replayed), uploader, fetcher and namespace of a mount of ``store``
    with ``config``'s sizes and timeouts. ``cache_dir`` holds the disk arena, the journal and
    the clean index; ``ram_dir`` the RAM arena; ``root``: (mode, uid, gid) of the top
    directory. ``check_ram_room``: refuse a RAM tier larger than its filesystem can back."""
    health = health or StoreHealth()  # one view of the store's trouble, fed by everything that calls it
    tree = Tree(os.getuid(), os.getgid(), config.umask, root, max_key_bytes=store.key_room())
    policy = CachePolicy(tree)
    cache = Cache(
        cache_dir,
        ram_dir,
        config.part_size,
        config.ram_cache,
        config.cache_size,
        policy=policy,
        write_timeout=config.write_timeout,
    )
    try:
        if check_ram_room:
            ram = cache.tiers[RAM]
            limits.check_ram_room(config, ram.budget, ram.fd, ram.held_bytes())
        journal = Journal(cache_dir / JOURNAL, cache.ram_arena_id)
        pending, open_uploads = journal.replay()
        pending = _adopt_blocks(cache, pending)
        journal.open(pending, open_uploads)
    except BaseException:
        cache.close()
        raise
    clean = clean_index.load(
        cache_dir / CLEAN_INDEX, cache, {ref for op in pending for ref in op.blocks if ref is not None}
    )
    if pending:
        log.info("journal: %d operations still pending from the last run; resuming", len(pending))
    uploader = Uploader(
        store,
        cache,
        journal,
        config.part_size,
        config.upload_concurrency,
        compress_level=config.compress or None,
    )
    uploader.health = health
    fetcher = Fetcher(
        store, cache, config.upload_concurrency, health=health, read_timeout=config.read_timeout
    )
    namespace = Namespace(
        cache,
        journal,
        uploader,
        fetcher,
        tree.uid,
        tree.gid,
        list_ttl=config.list_ttl,
        policy=policy,
        health=health,
    )
    return Core(store, health, cache, journal, uploader, fetcher, namespace, pending, open_uploads, clean)


def _adopt_blocks(cache: Cache, pending: list[Op]) -> list[Op]:
    """The cache takes the blocks the journal's ops name; an op naming a block that no longer
    exists (a smaller arena) is dropped."""
    kept = []
    for op in pending:
        bad = [ref for ref in op.blocks if ref is not None and not cache.valid_ref(ref)]
        if bad:
            log.error("journal: %s names cache blocks that no longer exist; dropped", op.key)
            continue
        kept.append(op)
    cache.adopt((op.size, op.blocks) for op in kept)
    return kept
