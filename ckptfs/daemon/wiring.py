"""The mount's parts, built and wired in one place: ``build_core``, used by the daemon and by
the tests that drive the namespace in process (tests/support/inprocess.py). Every link between
the parts is a constructor argument; nothing is attached to a part after it is built.

Start-up order matters for crash recovery: the journal is replayed and its blocks adopted by
the cache before anything can allocate, the log is compacted to what is still pending, and only
then (``Core.load``, inside trio with the workers running) does the namespace lay those ops
over the store listing and hand them back to the uploader.

The build order, and the two cycles in it (docs/architecture.md, "Wiring"):

- the tree, then the cache's eviction policy (``CheckpointEvictionPolicy``, with the tree), then
  the cache (with the policy), the journal (replayed, its blocks adopted), the uploader (with
  the cache and journal) and the fetcher; then the model's side, each with what it needs:
  ``Retention`` (cache, uploader, policy), ``Prefill`` (the kernel's caches), ``Commits``,
  ``Namespace``.
- cache -> policy -> uploader -> cache: the cache asks its policy whether an upload will free
  blocks, which only the uploader knows, and the uploader is built with the cache. So the
  policy is given a function (``uploads_hold_cache``, in ``build_core``) that reads the
  uploader built a few lines later: nothing allocates (so nothing asks) before ``build_core``
  returns.
- uploader <-> commits: the commits submit to the uploader, which keeps the fsync shadows'
  ops when it compacts the journal. The shadows are a holder (``Shadows``) made first and
  handed to both.
- one ``StoreHealth`` for the uploader, the fetcher and the namespace (its refresh).
- records -> uploader -> gate -> records: this node's writer records (cluster/records.py) are
  kept to what it has pending (the uploader's ops) and written through the uploader's store
  calls, while the uploader asks the marker gate, which reads other nodes' records. So the
  records are given two functions (``writing_in``, ``store_call``) that read the uploader built
  a few lines later; they run only once the workers start.
- peers -> namespace, fetcher -> peers (``--cluster``): the peer cache serves other nodes from
  this node's files (the namespace) and fetches them from the store (the fetcher), and the
  fetcher asks it which peer owns a part. So it is given two functions (``lookup``, ``fill``)
  that read the namespace and fetcher built a few lines later; they run only once a peer asks.
- records <-> relay <-> peers (``--cluster``): this node's writer records are also pushed to the
  live peers (cluster/peer_records.py), which needs the peer channel, which hands the peers'
  pushes to the relay. So the relay is given functions (``target``, ``live``, ``push``,
  ``changed``) that read the records and peers built a few lines later; they run only once the
  workers start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ckptfs.cache import clean_index
from ckptfs.cache.arena import DISK, RAM
from ckptfs.cache.cache import Cache
from ckptfs.cache.clean_index import CleanEntry
from ckptfs.cache.journal import Journal, Op
from ckptfs.cluster import records as writer_records
from ckptfs.cluster.records import WriterRecords
from ckptfs.config import MountConfig, parse_peer_addr
from ckptfs.daemon import limits
from ckptfs.model.commits import Commits, Shadows
from ckptfs.model.gate import MarkerGate
from ckptfs.model.namespace import Namespace
from ckptfs.model.passthrough import PassthroughFiles
from ckptfs.model.policy import CheckpointEvictionPolicy, Retention
from ckptfs.model.prefill import KernelCache, Prefill
from ckptfs.model.tree import Tree

if TYPE_CHECKING:
    from ckptfs.cluster.peer_records import PeerRecords
    from ckptfs.cluster.peers import PeerCache
    from ckptfs.cluster.replicas import ReplicaHolder
    from ckptfs.cluster.replication import Replicator
from ckptfs.store.base import ObjectInfo, ObjectStore
from ckptfs.store.health import StoreHealth
from ckptfs.transfer.fetcher import Fetcher
from ckptfs.transfer.uploader import Uploader
from ckptfs.transfer.workers import StoreWorkers

log = logging.getLogger(__name__)

CLEAN_INDEX = "clean.index"
JOURNAL = "journal"
PASSTHROUGH_DIR = (
    "passthrough"  # complete versions as plain files, for passthrough reads (model/passthrough.py)
)
REPLICAS = "replicas"  # the replicas this node holds for others (cluster/replicas.py)
FENCE_WAIT_S = 30.0  # how long a start waits for a takeover of this node to end


@dataclass
class Core:
    store: ObjectStore
    health: StoreHealth
    cache: Cache
    journal: Journal
    uploader: Uploader
    fetcher: Fetcher
    records: WriterRecords
    gate: MarkerGate
    namespace: Namespace
    pending: list[Op]  # the journal's ops the last run left unfinished
    open_uploads: list  # multipart uploads the journal recorded as open
    clean: dict[str, CleanEntry]  # blocks the last mount left cached, by key
    peers: PeerCache | None = None  # --cluster
    relay: PeerRecords | None = None  # --cluster: writer records told to the peers directly
    holder: ReplicaHolder | None = None  # --cluster: replicas this node holds for others
    replicator: Replicator | None = None  # --replicas: this node's replicas on others

    async def start(self, nursery: trio.Nursery) -> None:
        """The uploader (resuming the open uploads) and the fetcher, in ``nursery``."""
        await nursery.start(self.uploader.run, self.open_uploads)
        await nursery.start(self.fetcher.run)
        await nursery.start(self.records.run)
        if self.peers is not None:
            await nursery.start(self.peers.run)
        if self.relay is not None:
            await nursery.start(self.relay.run)
        if self.holder is not None:
            await nursery.start(self.holder.run)
        if self.replicator is not None:
            await nursery.start(self.replicator.run)

    async def fence(self) -> None:
        """(--cluster, before ``load``) A holder of this node's replicas published what this node
        left pending while it was gone: drop exactly those ops rather than publish an older state
        over what came after (cluster/replicas.py). A takeover still being claimed, or still
        publishing, is waited for a while."""
        if self.peers is None:
            return
        from ckptfs.cluster import replication

        node = self.records.node
        taken = await replication.taken_over(self.store, node, FENCE_WAIT_S)
        if taken is None:
            return
        dropped = [op for op in self.pending if op.seq in taken]
        for op in dropped:
            self.journal.cancel(op.seq)
            for ref in op.blocks:
                if ref is not None:
                    self.cache.decref(ref)
        self.pending = [op for op in self.pending if op.seq not in taken]
        if dropped:
            log.warning("replicas: %d pending operations dropped: a holder published them", len(dropped))
        await replication.drop_lease(self.store, node)

    def load(self, listing: Iterable[ObjectInfo]) -> None:
        """The tree: the store's ``listing`` with the pending ops replayed (after ``start``)."""
        self.namespace.load(listing, self.pending, self.clean)
        if self.replicator is not None:
            self.replicator.loaded.set()

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.stop()  # (its threads send from the cache's arena)
        if self.peers is not None:
            self.peers.stop()  # (so do the server's)
        if self.holder is not None:
            self.holder.close()
        self.uploader.close()  # store calls abandoned at shutdown may no longer read the cache
        files = self.namespace.prefill.files
        if files is not None:
            files.close()  # (its copies read from the cache's arenas)
        self.journal.close()
        self.cache.close()


def _store_workers(config: MountConfig, store: ObjectStore, health: StoreHealth) -> StoreWorkers | None:
    """The processes that send parts and fetch ranges (transfer/workers.py), for a store whose
    byte path they do."""
    inner = getattr(store, "inner", store)  # (under the LogicalStore)
    count = config.store_worker_count()
    if not count or not inner.sends_from_workers:
        return None
    return StoreWorkers(inner, count, config.channels_per_worker(), config.part_size, health)


def build_core(
    config: MountConfig,
    store: ObjectStore,
    cache_dir: Path,
    ram_dir: Path,
    root: tuple[int, int, int] | None = None,
    check_ram_room: bool = True,
    health: StoreHealth | None = None,
    kernel: KernelCache | None = None,
    cached_files: tuple[int, int] | None = None,
) -> Core:
    """The cache, journal (replayed), uploader, fetcher and namespace of a mount of ``store``
    with ``config``'s sizes and timeouts. ``cache_dir`` holds the disk arena, the journal and
    the clean index; ``ram_dir`` the RAM arena; ``root``: (mode, uid, gid) of the top
    directory. ``check_ram_room``: refuse a RAM tier larger than its filesystem can back.
    ``kernel``: the kernel's caches, for the page-cache prefill and the refresh (None: no
    FUSE channel; prefill is off). ``cached_files``: how many backing files and passthrough
    copies may be kept open (daemon/limits.py ``cached_file_budget``; None: no bound)."""
    health = health or StoreHealth()  # one view of the store's trouble, fed by everything that calls it
    tree = Tree(os.getuid(), os.getgid(), config.umask, root, max_key_bytes=store.key_room())

    def uploads_hold_cache() -> bool:
        # (the cycle cache -> policy -> uploader -> cache: see the module doc; replicas held for
        # other nodes go as their uploads end, like this node's own)
        return uploader.holds_cache() or (holder is not None and holder.holds_blocks())

    policy = CheckpointEvictionPolicy(tree, config.part_size, uploads_hold_cache)
    cache = Cache(
        cache_dir,
        ram_dir,
        config.part_size,
        config.ram_cache,
        config.cache_size,
        policy=policy,
        write_timeout=config.write_timeout,
    )
    if cached_files is not None:
        cache.max_backing_files = cached_files[0]
    try:
        if check_ram_room:
            ram = cache.tiers[RAM]
            limits.check_ram_room(config, ram.budget, ram.fd, ram.held_bytes())

        def journal_amended(rec: dict) -> None:
            # (the cycle journal -> replicator: see the module doc)
            if replicator is not None:
                replicator.amend(rec)

        journal = Journal(cache_dir / JOURNAL, cache.ram_arena_id, journal_amended)
        pending, open_uploads = journal.replay()
        pending = _adopt_blocks(cache, pending)
        journal.open(pending, open_uploads)
        held: dict = {}
        if config.cluster:  # the replicas this node held for others (adopted like the journal's)
            from ckptfs.cluster import replicas  # (TLS: only with --cluster)

            held = replicas.load(cache_dir / REPLICAS, cache, cache.ram_arena_id, _taken(pending))
        else:
            _drop_replicas(cache_dir / REPLICAS)
    except BaseException:
        cache.close()
        raise
    in_use = {ref for op in pending for ref in op.blocks if ref is not None}
    in_use |= {ref for r in held.values() for op in r.ops.values() for ref in op.blocks if ref is not None}
    clean = clean_index.load(cache_dir / CLEAN_INDEX, cache, in_use)
    cache.sweep_backing()  # (working copies a crash left uncommitted go)
    if pending:
        log.info("journal: %d operations still pending from the last run; resuming", len(pending))
    shadows = Shadows()  # (the cycle uploader <-> commits: see the module doc)

    def writing_in() -> dict[str, str]:
        # (the cycle records -> uploader -> gate -> records: see the module doc)
        return gate.writing_in(t.op for t in uploader.pending.values())

    async def store_call(key: str, fn, *args):
        return await uploader.calls.call(key, fn, *args)

    node = writer_records.node_id(cache_dir)
    relay = None
    if config.cluster:  # (the cycle records <-> relay <-> peers: see the module doc)
        from ckptfs.cluster.peer_records import FILE as PEER_RECORDS
        from ckptfs.cluster.peer_records import PeerRecords  # (TLS: only with --cluster)

        async def push(member, request) -> bool:
            assert peers is not None
            return await peers.push_records(member, request)

        relay = PeerRecords(
            node,
            lambda: dict(records.target),
            lambda: peers.members.live() if peers is not None else [],
            push,
            lambda: records.signal(),
            cache_dir / PEER_RECORDS,
        )
    records = WriterRecords(
        store,
        node,
        writing_in,
        store_call,
        health.in_trouble,
        config.record_timeout,
        config.lost_node_after,
        relay,
    )
    gate = MarkerGate(tree, store, records, health, config.no_marker)

    def replicas_behind() -> bool:
        # (--replicas: a close waits for its replicas, not for the store; the cycle uploader ->
        # replicator, built a few lines later)
        return replicator is not None and replicator.behind()

    workers = _store_workers(config, store, health)
    uploader = Uploader(
        store,
        cache,
        journal,
        config.part_size,
        config.upload_concurrency,
        compress_level=config.compress or None,
        health=health,
        retained_ops=shadows.retained_ops,
        gate=gate,
        yield_to=replicas_behind,
        workers=workers,
    )
    peers, holder, replicator = None, None, None
    if config.cluster:  # (the cycle peers -> namespace, fetcher -> peers: see the module doc)

        async def lookup(key: str):
            return await namespace.content_for_peer(key)

        async def fill(content, indexes: list[int]) -> None:
            await fetcher.fill_from_store(content, indexes)

        from ckptfs.cluster.peers import UNSPECIFIED, PeerCache, default_host  # (TLS: only with --cluster)

        def session(request, tls, fingerprint: str) -> None:
            # (a replica stream, cycle peers -> holder: built a few lines later)
            assert holder is not None
            holder.session(request, tls, fingerprint)

        host, port = parse_peer_addr(config.peer_addr or "")
        routed = default_host(config.store_url, config.endpoint_url)
        peers = PeerCache(
            store,
            cache,
            cache_dir,
            records.node,
            (host or routed, port),
            routed if host in UNSPECIFIED or host is None else host,
            config.peer_connections,
            lookup,
            fill,
            config.failure_domain,
            session,
            asks=config.upload_concurrency,
            on_records=relay.receive if relay is not None else None,
            trust_for=config.lost_node_after,  # (a node cut off from the store is not lost before that)
        )
        from ckptfs.cluster.replicas import ReplicaHolder
        from ckptfs.cluster.replication import Replicator

        async def handover(origin: str, last: int) -> None:
            await records.settled()  # (this node's records cover those files before the origin's go)
            await records.remove_node(origin)
            await uploader.wait_durable(last)

        holder = ReplicaHolder(
            cache,
            store,
            peers.members,
            cache_dir / REPLICAS,
            held,
            config.takeover_after,
            lambda origin, ops: commits.take_over(origin, ops),
            handover,
            limits.MAX_REPLICA_STREAMS,
            {
                origin: max(op.seq for op in pending if op.origin.startswith(origin + ":"))
                for origin in _taken(pending)
            },
        )
        if config.replicas:
            replicator = Replicator(
                cache,
                store,
                peers.members,
                peers.client,
                config.replicas,
                config.replica_timeout,
                lambda: uploader.pending,
            )
    fetcher = Fetcher(
        store,
        cache,
        config.upload_concurrency,
        health=health,
        read_timeout=config.read_timeout,
        peers=peers,
        workers=workers,
    )
    retention = Retention(tree, cache, uploader, policy)
    # Passthrough reads need the kernel's channel; the files live beside the disk tier.
    budget = config.cache_size if config.passthrough_cache < 0 else config.passthrough_cache
    disk = cache.tiers[DISK]

    def spare() -> int:
        st = os.statvfs(cache_dir)
        return st.f_bavail * st.f_frsize - max(0, disk.budget - disk.charged_bytes - disk.outside)

    files = PassthroughFiles(
        cache_dir / PASSTHROUGH_DIR,
        budget if kernel is not None else 0,
        retention.busy,
        spare,
        max_files=cached_files[1] if cached_files is not None else 1 << 30,
    )
    files.start()
    prefill = Prefill(retention.busy, kernel, files)
    commits = Commits(tree, cache, journal, uploader, retention, prefill, shadows, records, replicator)
    namespace = Namespace(commits, fetcher, health, list_ttl=config.list_ttl, kernel=kernel)
    namespace.files.fetch_whole = config.fetch_whole
    return Core(
        store,
        health,
        cache,
        journal,
        uploader,
        fetcher,
        records,
        gate,
        namespace,
        pending,
        open_uploads,
        clean,
        peers,
        relay,
        holder,
        replicator,
    )


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


def _drop_replicas(directory: Path) -> None:
    """A mount without --cluster holds no replicas: logs a --cluster run left name blocks this
    run may reuse, so they go (the origins they came from choose other holders)."""
    for log_path in sorted(directory.glob("*.log")) if directory.is_dir() else []:
        log.warning("replicas: not a --cluster mount: dropping the replica log %s", log_path.name)
        log_path.unlink(missing_ok=True)


def _taken(pending: list[Op]) -> dict[str, int]:
    """Origin -> the last of its ops (its own number) this node's journal took over."""
    taken: dict[str, int] = {}
    for op in pending:
        origin, _, seq = op.origin.partition(":")
        if origin and seq.isdigit():
            taken[origin] = max(taken.get(origin, 0), int(seq))
    return taken
