"""The commit path: the only writer of journal ops and the only submitter to the uploader.

A change to the tree becomes store ops here, journaled before the call returns (no await in
between: trio is single-threaded, so a change and its journal record are one atomic step), and
handed to the uploader with the callback that marks the version durable. fsync shadows (put
ops journaled but not uploaded) are kept here too: the journal keeps them through compaction.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, cast

from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import ATTR, DELETE, MKDIR, MOVE, PUT, Journal, Op
from ckptfs.cluster.records import WriterRecords, dir_key
from ckptfs.errors import FsError
from ckptfs.model.policy import Retention
from ckptfs.model.prefill import Prefill
from ckptfs.model.tree import MIN_MULTIPART, Node, Shadow, Tree, Version, Writing, attr_metadata
from ckptfs.parts import PartSchedule
from ckptfs.transfer.uploader import Uploader

if TYPE_CHECKING:
    from ckptfs.cluster.replication import Replicator  # (TLS: only with --cluster)
    from ckptfs.objects.integrity import Checksums
    from ckptfs.store.base import PartInfo
    from ckptfs.transfer.upload_tasks import Upload

log = logging.getLogger(__name__)


class Shadows:
    """The fsync shadows by op seq, kept in the journal through compaction. Made before both
    their users: the commits add and retire them, and the uploader, built before the commits
    (which submit to it), asks for their ops when it compacts the journal (``retained_ops``)."""

    def __init__(self):
        self.by_seq: dict[int, Shadow] = {}

    def retained_ops(self) -> list[Op]:
        """Ops the journal keeps besides the uploader's pending ones."""
        return [shadow.op for shadow in self.by_seq.values()]


class Commits:
    def __init__(
        self,
        tree: Tree,
        cache: Cache,
        journal: Journal,
        uploader: Uploader,
        retention: Retention,
        prefill: Prefill,
        shadows: Shadows,
        records: WriterRecords | None = None,
        replicator: Replicator | None = None,
    ):
        self.tree = tree
        self.cache = cache
        self.journal = journal
        self.uploader = uploader
        self.retention = retention
        self.prefill = prefill
        self.shadows = shadows
        self.records = records  # this node's writer records in the store (None: none kept)
        self.replicator = replicator  # --replicas: every op also goes to peers (None: off)

    # -- writer records ------------------------------------------------------------------------------
    def writing(self, key: str) -> None:
        """A file is being written (or committed, or moved) at ``key``: this node's record of its
        directory goes to the store now, so that the close finds it there (cluster/records.py)."""
        if self.records is not None:
            self.records.want(dir_key(key))

    async def recorded(self) -> None:
        """Return once the store holds the records of every directory this node writes in
        (bounded by --record-timeout) and, with --replicas, once K peers hold everything
        journaled so far (bounded by --replica-timeout): called before a close, rename or fsync
        returns."""
        if self.records is not None:
            await self.records.settled()
        if self.replicator is not None:  # (and, with --replicas, once peers hold it too)
            await self.replicator.wait(self.journal.next_seq - 1)

    # -- commits -----------------------------------------------------------------------------------
    def commit(self, node: Node, content: Content, writing: Writing | None = None) -> None:
        """``node``'s new version; its mtime is its last write's, as the caller set it (the
        object's metadata says so too)."""
        self.writing(node.key())
        try:
            op = put_op(node.key(), content, attr_metadata(node), self.uploader.schedule)
            op.replaces = self._replaced_manifest(node)
            op = self.log(op, content, writing)
        except BaseException:
            content.drop_blocks()
            raise
        self.drop_pending(node)
        self.set_version(node, content, op)
        for shadow in node.shadows:
            # This commit supersedes what any writer fsynced before it (the last close wins):
            # those shadows retire once it is durable (until then they guard a node reboot).
            if shadow.covers is None:
                shadow.covers, shadow.writing = op.seq, None
        self.retention.note_commit(node, content.size, in_arenas=self.cache.backing_of(content) is None)
        stream, stamps = None, None
        if writing is not None and writing.stream is not None:
            stream, stamps, writing.stream = writing.stream, list(writing.staged.stamps), None
        self.uploader.submit(op, content, self.on_durable(node), stream, stamps)
        # (ctime is not touched: the writes and truncates did that; a close does not, as on a disk)
        if stream is not None and stream.meta != attr_metadata(node, mtime=False):
            self.set_attrs(node)  # changed since its upload began (the upload's metadata is fixed then)

    def set_attrs(self, node: Node) -> None:
        """chmod, chown, utimes: the store learns them by a metadata-only op after the file's
        pending put, if any (a file never committed gets them with its first put)."""
        if node.unlinked or node is self.tree.root or (not node.is_dir and node.version is None):
            return
        op = self.log(Op(ATTR, node.key(), meta=attr_metadata(node)))
        node.last_seq = node.attr_seq = op.seq
        version = node.version

        def copied(_op: Op) -> None:
            # The store's copy in place gave the object a new Last-Modified: it is still ours.
            if version is not None and version.seq is None and version is node.version:
                version.stamp, version.content.durable_at = None, time.time()

        self.uploader.submit(op, None, copied)

    def _replaced_manifest(self, node: Node) -> str:
        """The manifest a new version of ``node`` makes obsolete once it is in the store: the
        durable version's upload id where known, "?" where it may have one (the uploader asks)."""
        version = node.version
        if version is None or version.seq is not None or version.content.key != node.key():
            return ""
        checks = cast("Checksums | None", version.content.checksums)  # (Content types it as object)
        if checks is not None:
            return checks.upload if checks.source == "manifest" else ""
        return "?" if version.content.size > min(self.cache.block_size, MIN_MULTIPART) else ""

    def set_version(self, node: Node, content: Content, op: Op) -> None:
        old = node.version
        node.version = Version(content, op.seq)
        node.last_seq = op.seq
        self.retention.keep(node)
        if old is not None:
            old.content.release()
            self.prefill.replaced(node)

    def on_durable(self, node: Node):
        """The uploader's callback once ``node``'s current version is in the store."""
        version = node.version
        assert version is not None  # called right after set_version gave the node this version

        def durable(op: Op) -> None:
            version.seq = None
            version.content.durable_at = time.time()
            version.content.in_store = True
            version.content.key = op.key
            version.content.remote = {}  # evicted parts are now plain store reads
            self.retire_shadows(node, op.seq)
            self.retention.maybe_clean(node)
            if version.content.size >= self.cache.block_size and (
                node.parent is self.tree.root or self.retention.policy.pinned(node)
            ):
                self.prefill.want(node, version)  # a checkpoint a restart will load: into the page cache

        return durable

    def on_moved(self, node: Node | None):
        """The uploader's callback once a move op is in the store: the version's key follows."""
        version = node.version if node is not None else None

        def moved(op: Op) -> None:
            if version is not None and version.seq is None:
                version.content.key = op.key

        return moved

    def drop_pending(self, node: Node) -> None:
        """The node's pending put will never be needed (overwritten, unlinked, replaced)."""
        if node.version is not None and node.version.seq is not None:
            self.uploader.cancel(node.version.seq)

    def relocate(self, node: Node, old_key: str) -> None:
        """Store ops for one node after a rename moved it from ``old_key``."""
        new_key = node.key()
        if node.is_dir:
            node.last_seq = self.log(Op(MKDIR, new_key, meta=attr_metadata(node))).seq
            return
        self.writing(new_key)
        self._relocate_version(node, old_key, new_key)
        self._rejournal_shadows(node)

    def _relocate_version(self, node: Node, old_key: str, new_key: str) -> None:
        version = node.version
        if version is None:
            return  # created, never committed: its commit will use the new key
        if version.seq is not None and self.uploader.retarget(version.seq, new_key):
            node.last_seq = version.seq
            self.log(Op(DELETE, old_key))  # an older durable version may sit there
            if node.attr_seq > version.seq:  # that op went to the old key: the put carries older ones
                self.set_attrs(node)
            return
        op = self.log(Op(MOVE, new_key, src=old_key))
        node.last_seq = op.seq
        self.uploader.submit(op, None, self.on_moved(node))

    def log(self, op: Op, content: Content | None = None, writing: Writing | None = None) -> Op:
        """Journal an op and hand it to the uploader (a put is handed over by commit), and to
        the peers holding replicas (a put with its content, and the working copy it came from:
        the blocks it streamed to them already)."""
        try:
            self.journal.append(op)
        except OSError as exc:
            log.error("journal write failed: %s", exc)
            raise FsError(exc.errno or errno.EIO, "journal write failed") from exc
        if self.replicator is not None:
            stamps = writing.staged.stamps if writing is not None else None
            self.replicator.op(op, content, writing.serial if writing is not None else None, stamps)
        if op.kind in (DELETE, MKDIR):
            self.uploader.submit(op)
        return op

    def detach(self, node: Node) -> None:
        """Take a node out of the tree; it lives on while the kernel or a handle knows it."""
        for n in list(node.walk()):
            if not n.is_dir:
                self.drop_pending(n)
                self.retire_shadows(n)
            self.retention.keep(n)
            if n.version is not None:
                n.unlinked_size = n.version.content.size  # (what an open descriptor still reads)
                n.version.content.release()
                n.version = None
            n.unlinked = True
        self.tree.take_out(node)
        self.tree.maybe_drop(node)

    def take_over(self, origin: str, ops: list[Op]) -> int:
        """A lost node's pending ops, in its journal order, from the replica this node held
        (cluster/replicas.py): journaled here (naming their origin), then published by this
        node's uploader like its own. A put's blocks pass from the replica to the upload. The
        last one's sequence number here."""
        for op in ops:
            blocks = list(op.blocks)
            op.seq, op.origin = 0, f"{origin}:{op.seq}"
            self.writing(op.key)
            self.journal.append(op)
            content = Content(self.cache, op.size, blocks) if op.kind == PUT else None
            if self.replicator is not None:  # (now this node's: its own holders get them too)
                self.replicator.op(op, content)
            self.uploader.submit(op, content)
        return self.journal.next_seq - 1

    # -- fsync shadows -----------------------------------------------------------------------------
    def add_shadow(self, node: Node, content: Content, writing: Writing | None, covers: int | None) -> None:
        op = self.journal.append(put_op(node.key(), content, attr_metadata(node), self.uploader.schedule))
        for old in [s for s in node.shadows if writing is not None and s.writing is writing]:
            self._retire_shadow(node, old)  # superseded by this later fsync of the same working copy
        shadow = Shadow(op, content, writing, covers)
        node.shadows.append(shadow)
        self.shadows.by_seq[op.seq] = shadow

    def _rejournal_shadows(self, node: Node) -> None:
        """A renamed file's fsync records move to the journal's end under its new key: replay
        applies ops in order, and the rename's own ops (the move of the durable version, the
        delete of the file it replaced) must not land on top of what was fsynced."""
        for shadow in node.shadows:
            old_seq = shadow.op.seq
            shadow.op = self.journal.append(
                put_op(node.key(), shadow.content, attr_metadata(node), self.uploader.schedule)
            )
            self.journal.cancel(old_seq)  # (after the append: a crash between keeps one of them)
            del self.shadows.by_seq[old_seq]
            self.shadows.by_seq[shadow.op.seq] = shadow

    def _retire_shadow(self, node: Node, shadow: Shadow) -> None:
        node.shadows.remove(shadow)
        del self.shadows.by_seq[shadow.op.seq]
        self.journal.cancel(shadow.op.seq)
        shadow.content.release()

    def retire_shadows(self, node: Node, durable_seq: int | None = None) -> None:
        """Shadows covered by a durable version (all of them when ``durable_seq`` is None)."""
        for shadow in list(node.shadows):
            if durable_seq is None or (shadow.covers is not None and shadow.covers <= durable_seq):
                self._retire_shadow(node, shadow)

    # -- questions about pending ops ---------------------------------------------------------------
    def pending_names(self, prefix: str) -> set[str]:
        """Names right under directory ``prefix`` that a pending op of this mount is about (a put,
        delete or move of them or of anything below): the store's word on them is not final."""
        names = set()
        for task in self.uploader.pending.values():
            for key in (task.op.key, task.op.src):
                if key and key.startswith(prefix) and len(key) > len(prefix):
                    names.add(key[len(prefix) :].split("/", 1)[0])
        return names


def put_op(
    key: str, content: Content, meta: dict[str, str] | None = None, schedule: PartSchedule | None = None
) -> Op:
    op = Op(PUT, key, size=content.size, blocks=list(content.blocks))
    if meta is not None:
        op.meta = meta
    if content.remote:  # the upload holding the evicted parts (a restart completes it)
        # (Content types these as object: the upload is set whenever parts are remote.)
        upload = cast("Upload", content.upload)
        remote = cast("dict[int, PartInfo]", content.remote)
        op.upload = [upload.key, upload.upload_id, upload.journal_id]
        # By part index (a part of k blocks: k remote blocks). Parts past those the grown layout
        # shares with the uniform one: the file keeps the grown layout (ckptfs/parts.py).
        op.parts = {part.number - 1: part.token for part in remote.values()}
        op.hashes = {part.number - 1: part.xxh3 for part in remote.values() if part.xxh3}
        op.grown = schedule is not None and schedule.keeps_grown(remote)
    return op
