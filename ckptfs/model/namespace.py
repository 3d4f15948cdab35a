"""The namespace: the directory tree, open handles, and committed versus staged file contents,
as one object for the FUSE glue (fuse_ops.py), the control commands and the catalog.

The store is the source of truth: on start the tree is the store's listing with the journal's
pending ops laid over it. Each file node has one committed ``Version``; while it is open for
writing, one working copy (``Writing``, a ``StagedFile``) shared by all its writers, which every
descriptor reads (POSIX on the node). When its last writer closes, the snapshot becomes the new
version, a ``put`` op goes to the journal and the uploader (atomic in the store). Renames,
unlinks and mkdirs become ops too, so the store ends with exactly what the namespace says.

``Namespace`` is a facade: the work is done by the parts in ``ckptfs/model/`` (the tree, the
cache policy, the commit path, start-up, the refresh from the store, file and name operations;
see docs/architecture.md). Every method that changes state does so without awaiting in the
middle (trio is single-threaded), so a change and its journal record are one atomic step.
Errors a user can hit are ``FsError`` with an errno.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable

from ckptfs.cache.backing import WorkingFile
from ckptfs.cache.clean_index import CleanEntry
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import Op
from ckptfs.errors import FsError
from ckptfs.model import startup
from ckptfs.model.commits import Commits
from ckptfs.model.dirs import Dirs
from ckptfs.model.files import Files, PendingRead, PendingWrite
from ckptfs.model.prefill import KernelCache
from ckptfs.model.refresh import Refresher
from ckptfs.model.tailing import Tailer
from ckptfs.model.tree import (
    LINK_MODE,
    MAX_LINK_TARGET,
    ROOT_INODE,
    Attr,
    Handle,
    Node,
)
from ckptfs.store.base import ObjectInfo
from ckptfs.store.health import StoreHealth
from ckptfs.transfer.fetcher import Fetcher


def forget_nothing(parent_ino: int, name: str) -> None:
    """No kernel (the namespace driven in process): no cached entry to drop."""


class Namespace:
    """The facade over ``commits`` (and, through it, the tree, cache, journal, uploader,
    retention and prefill, all built by daemon/wiring.py ``build_core``). ``fetcher`` reads
    what the cache lacks; ``health``: the one view of the store's trouble the uploader and the
    fetcher share; ``list_ttl``: see refresh.py; ``kernel``: the kernel's caches (None without
    a FUSE channel)."""

    def __init__(
        self,
        commits: Commits,
        fetcher: Fetcher,
        health: StoreHealth,
        list_ttl: float | None = None,
        kernel: KernelCache | None = None,
    ):
        self.commits = commits
        self.tree = tree = commits.tree
        self.retention = commits.retention
        self.policy = commits.retention.policy
        self.cache = commits.cache
        self.uploader = commits.uploader
        self.prefill = commits.prefill
        self.fetcher = fetcher
        self.store = fetcher.store
        self.health = health
        self.files = Files(commits, fetcher)
        self.tailer = Tailer(self.files)
        self.dirs = Dirs(commits)
        forget_name = kernel.forget_name if kernel is not None else forget_nothing
        self.refresher = Refresher(tree, commits, self.cache, fetcher.store, health, list_ttl, forget_name)
        self.root, self.inodes, self.handles = tree.root, tree.inodes, tree.handles

    # -- settings shared with the parts ------------------------------------------------------------
    @property
    def list_ttl(self) -> float | None:
        return self.refresher.list_ttl

    @list_ttl.setter
    def list_ttl(self, seconds: float | None) -> None:
        self.refresher.list_ttl = seconds

    @property
    def checkpoint_dir(self) -> str:
        """The latest checkpoint's directory key (its clean data is evicted last)."""
        return self.policy.checkpoint_dir

    # -- start-up and shutdown ---------------------------------------------------------------------
    def load(
        self, listing: Iterable[ObjectInfo], pending: list[Op], clean: dict[str, CleanEntry] | None = None
    ) -> None:
        startup.load(self.commits, listing, pending, clean)

    def clean_contents(self) -> list[tuple[str, Content]]:
        """Durable files with cached blocks (what the clean cache index keeps for the next mount)."""
        return [
            (n.key(), n.version.content)
            for n in self.tree.files()
            if n.version is not None and n.version.seq is None and n.version.content.refs()
        ]

    async def verify_kept(self, content: Content) -> None:
        await self.retention.verify_kept(content)

    # -- lookups -----------------------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        return self.tree.node(ino)

    def check_name_length(self, parent: Node, name: bytes, spare: int = 1) -> None:
        self.tree.check_name_length(parent, name, spare)

    def attr(self, node: Node) -> Attr:
        return self.tree.attr(node)

    def lookup(self, parent_ino: int, name: str) -> Attr:
        parent = self.tree.dir(parent_ino)
        if name == ".":
            node = parent
        elif name == "..":
            node = parent.parent or parent
        else:
            node = self.tree.child(parent, name)
        node.nlookup += 1
        return self.tree.attr(node)

    async def lookup_async(self, parent_ino: int, name: str) -> Attr:
        """``lookup`` that keeps up with the store: the directory is listed again first if its
        listing is older than ``list_ttl`` (so known names follow changes and deletions too); a
        name still unknown is asked of the store itself, unless it was found absent less than
        ``list_ttl`` ago (``negative_ttl`` says for how much longer)."""
        await self.refresher.lookup(self.tree.dir(parent_ino), name)
        parent = self.tree.dir(parent_ino)
        node = parent.children.get(name)
        if node is not None and not await self.refresher.learn_attrs([node]):
            raise FsError(errno.EIO, "the store did not say who may read this file (its attributes)")
        return self.lookup(parent_ino, name)

    def negative_ttl(self, parent_ino: int, name: str) -> float:
        """How long the kernel may cache that ``name`` is absent from ``parent_ino``: as long as
        this mount will answer so without asking the store (0: not at all)."""
        return self.refresher.missing.ttl_left(parent_ino, name)

    async def refresh(self, ino: int) -> None:
        """List directory ``ino`` again from the store if its listing is older than the TTL
        (opendir calls it before taking the directory's entries)."""
        node = self.tree.node(ino)
        if node.is_dir and self.refresher.due(node):
            await self.refresher.refresh_dir(node)
        if node.is_dir:  # READDIRPLUS gives the kernel each entry's attributes: read them first
            await self.refresher.learn_attrs(list(node.children.values()))

    async def refresh_paths(self, paths: list[str]) -> None:
        await self.refresher.refresh_paths(paths)

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
        self.tree.maybe_drop(node)

    def getattr(self, ino: int) -> Attr:
        node = self.tree.node(ino)
        if node.gone and not node.handles:  # the kernel's entry for it has not expired yet
            raise FsError(errno.ENOENT)
        return self.tree.attr(node)

    def readdir(self, ino: int) -> list[tuple[str, Attr]]:
        parent = self.tree.dir(ino)
        return [(name, self.tree.attr(child)) for name, child in sorted(parent.children.items())]

    def state(self, ino: int) -> str:
        """user.ckptfs.state: writing, pending (committed, not yet in the store), replicated
        (pending, and held by the --replicas peers) or durable."""
        node = self.tree.node(ino)
        if node.is_dir:
            return (
                "durable"
                if all(n.version is None or n.version.seq is None for n in node.walk())
                else "pending"
            )
        if node.version is None:
            return "writing"
        seq = node.version.seq
        if seq is None:
            return "durable"
        replicator = self.commits.replicator
        return "replicated" if replicator is not None and replicator.replicated(seq) else "pending"

    async def verification(self, ino: int) -> tuple[str, str]:
        """user.ckptfs.verified and user.ckptfs.xxh3: whether the bytes read from the store are
        checked ("yes"; "no" for an object with no checksums, e.g. put by another tool; "pending"
        before the file is in the store) and the whole file's recorded xxh3 ("" if none)."""
        node = self.tree.node(ino)
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

    # -- operations (see model/files.py and model/dirs.py) -----------------------------------------
    def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        return self.dirs.mkdir(parent_ino, name, mode, uid, gid)

    def rmdir(self, parent_ino: int, name: str) -> None:
        self.dirs.rmdir(parent_ino, name)

    def unlink(self, parent_ino: int, name: str) -> None:
        self.dirs.unlink(parent_ino, name)

    def rename(
        self, old_parent_ino: int, old_name: str, new_parent_ino: int, new_name: str, flags: int
    ) -> None:
        self.dirs.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags)

    def create(
        self, parent_ino: int, name: str, mode: int, flags: int, uid: int, gid: int, keeps_setid: bool = True
    ) -> tuple[Handle, Attr]:
        return self.files.create(parent_ino, name, mode, flags, uid, gid, keeps_setid)

    async def symlink(self, parent_ino: int, name: str, target: bytes, uid: int, gid: int) -> Attr:
        """A symbolic link, stored as s3fs stores one: a small file whose content is the target
        and whose mode is S_IFLNK | 0777. Created, written and committed at once (as mknod
        makes a file), so it is journaled and uploaded like any small file."""
        if len(target) > MAX_LINK_TARGET:
            raise FsError(errno.ENAMETOOLONG, f"a link target is at most {MAX_LINK_TARGET} bytes")
        handle, _ = self.files.create(parent_ino, name, 0o777, os.O_WRONLY | os.O_CREAT | os.O_EXCL, uid, gid)
        node = handle.node
        node.mode = LINK_MODE  # before the commit, whose metadata says what it is
        try:
            await self.files.write(handle.fh, 0, target)
            self.files.flush(handle.fh)
        except BaseException:
            # No link without its target is left behind (taken out first: the release then commits
            # nothing; wherever a rename meanwhile put it), and the kernel, which gets the error,
            # holds no reference to it.
            node.nlookup -= 1
            if not node.unlinked:
                self.commits.detach(node)
            self.files.release(handle.fh)
            raise
        self.files.release(handle.fh)
        await self.commits.recorded()
        return self.tree.attr(node)

    async def readlink(self, ino: int) -> bytes:
        """A link's target: its content, read as any file's (from the cache or the store)."""
        if not stat.S_ISLNK(self.tree.node(ino).mode):
            raise FsError(errno.EINVAL, "not a symbolic link")
        handle, _, _ = await self.files.open(ino, os.O_RDONLY)
        try:
            reading = handle.content
            assert reading is not None  # opened read-only: a reader holds the version it reads
            size = reading.size
            if size > MAX_LINK_TARGET:
                raise FsError(errno.EIO, f"the stored link target is {size} bytes, over {MAX_LINK_TARGET}")
            return bytes(await self.files.read(handle.fh, 0, size))
        finally:
            self.files.release(handle.fh)

    async def open(
        self, ino: int, flags: int, keeps_setid: bool = True, kill_setid: bool = False
    ) -> tuple[Handle, bool, bool]:
        return await self.files.open(ino, flags, keeps_setid, kill_setid)

    def _reads_pass_through(self) -> bool:
        return self.prefill.files is not None and self.prefill.files.on

    async def land_whole(self, fh: int) -> None:
        """A read-only open's version, fetched whole into a file the kernel reads (files.py)."""
        if self._reads_pass_through():
            await self.files.land_whole(fh)

    def start_landings(self, contents: list[Content], landing: list[Content]) -> None:
        """Add to ``landing`` those of ``contents`` (to be fetched: ``ckptfs warmup``) that land in
        files of their own, which the kernel will read itself; the caller ends them
        (``end_landings``)."""
        if self._reads_pass_through():
            taken = 0
            for content in contents:
                if self.files.start_landing(content, taken):
                    landing.append(content)
                    taken += content.size

    def end_landings(self, contents: list[Content]) -> None:
        for content in contents:
            self.files.end_landing(content)

    async def read(self, fh: int, offset: int, size: int, view: bool = False) -> bytes | memoryview:
        """``view``: a block's own bytes may come back as a view of the arena (for a reply sent
        before anything else runs: fuse_ops)."""
        return await self.files.read(fh, offset, size, view)

    def passthrough_fd(self, ino: int, flags: int) -> int | None:
        """A plain file the kernel may serve an open of ``ino`` with ``flags`` from itself (FUSE
        passthrough), or None (the open goes through the daemon):
        - a file open for writing: its working file (cache/backing.py), for write-only opens and,
          with passthrough reads, read-only ones (every descriptor sees the working copy);
        - a read-only open of a committed version: the working file it was committed from, else
          its copy (model/passthrough.py: asked for when there is none, made when idle if the
          version is complete in the cache)."""
        node = self.tree.node(ino)
        files = self.prefill.files
        reads = self._reads_pass_through()
        access = flags & os.O_ACCMODE
        if node.writing is not None:
            staged = node.writing.staged
            if not isinstance(staged, WorkingFile) or not self.files.passthrough_writes:
                return None
            if access == os.O_RDONLY and reads:
                staged.tier.exposed = True  # (the kernel may map it: cache/backing.py)
                return staged.fd
            return staged.fd if access == os.O_WRONLY else None
        if access != os.O_RDONLY or node.version is None or files is None or not reads:
            return None
        whole = self.cache.backing_of(node.version.content)
        if whole is not None:
            whole.exposed = True  # (the kernel may map it: cache/backing.py)
            return whole.fd
        fd = files.fd_for(node)
        if fd is None:
            files.want(node, node.version)
        return fd

    def writes_to_file(self, ino: int, flags: int) -> bool:
        """Whether an open of ``ino`` with ``flags`` would write a working file (model/files.py)."""
        return self.files.writes_to_file(self.tree.node(ino), flags)

    def passthrough_on(self, reads: bool, writes: bool) -> None:
        """The kernel takes backing files: reads of cached files (else their copies are off) and
        writes into working files, as asked."""
        if not reads and self.prefill.files is not None:
            self.prefill.files.off()
        self.files.passthrough_writes = writes

    def passthrough_off(self) -> None:
        if self.prefill.files is not None:
            self.prefill.files.off()
        self.files.passthrough_writes = False

    async def write_begin(self, fh: int, offset: int, data, kill_setid: bool = False) -> PendingWrite:
        """``write`` in two halves: the copy in between runs in any thread (files.PendingWrite)."""
        return await self.files.write_begin(fh, offset, data, kill_setid)

    async def read_begin(self, fh: int, offset: int, out: memoryview) -> int | PendingRead:
        """``read_into`` in two halves: the copy in between runs in any thread (files.PendingRead)."""
        return await self.files.read_begin(fh, offset, out)

    async def settle_writes(self, fh: int) -> None:
        """Before a close commits: the file's write under way, if any, has finished."""
        await self.files.settle_writes(fh)

    async def read_into(self, fh: int, offset: int, out: memoryview) -> int:
        """A read into ``out`` (its length is the size asked): the bytes filled."""
        return await self.files.read_into(fh, offset, out)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        return await self.files.write(fh, offset, data)

    def flush(self, fh: int, commit: bool = True) -> bool:
        """A close; True if it committed a version (then await ``recorded`` before answering)."""
        return self.files.flush(fh, commit)

    async def recorded(self) -> None:
        """Before a close, rename or fsync returns: the store holds this node's writer record of
        every directory it writes in (other nodes' markers then wait for these files)."""
        await self.commits.recorded()

    def release(self, fh: int, commit: bool = True) -> bool:
        return self.files.release(fh, commit)

    async def fsync(self, fh: int) -> None:
        await self.files.fsync(fh)
        await self.commits.recorded()

    async def fsyncdir(self) -> None:
        await self.files.fsyncdir()

    async def setattr(
        self,
        ino: int,
        fh: int | None,
        size=None,
        mode=None,
        uid=None,
        gid=None,
        atime_ns=None,
        mtime_ns=None,
        kill_setid: bool = False,
    ) -> Attr:
        if not await self.refresher.learn_attrs([self.tree.node(ino)]):  # (a change starts from them)
            raise FsError(errno.EIO, "the store did not say this file's attributes")
        return await self.files.setattr(ino, fh, size, mode, uid, gid, atime_ns, mtime_ns, kill_setid)

    # -- control commands --------------------------------------------------------------------------
    def statfs(self) -> dict:
        usage = self.cache.usage()
        return {"ram": usage["ram"], "disk": usage["disk"], "files": len(self.inodes)}

    def sync_target(self, paths: list[str]) -> int:
        """The op sequence number ``sync`` must wait for (everything if no paths)."""
        if not paths:
            return self.uploader.last_seq()
        target = 0
        for path in paths:
            node = self.tree.find_path(path)
            if node is None:
                raise FsError(errno.ENOENT, f"no such file on the mount: {path}")
            for n in node.walk():
                pending = n.version.seq if n.version is not None and n.version.seq is not None else 0
                target = max(target, n.last_seq, pending)
        return target

    def sync_scope(self, paths: list[str]) -> Callable[[Op], bool] | None:
        """Which held checkpoint markers a sync of ``paths`` waits for: those at or under them
        (None: every one, a sync of the whole mount)."""
        if not paths:
            return None
        prefixes = []
        for path in paths:
            node = self.tree.find_path(path)
            if node is not None:
                prefixes.append(node.key())
        if "" in prefixes:  # the top: everything
            return None
        return lambda op: any(op.key == p or (p.endswith("/") and op.key.startswith(p)) for p in prefixes)

    def contents_under(self, paths: list[str]) -> list[tuple[Content, Callable[[], None]]]:
        """For warmup: the committed contents of the files at or under ``paths`` (all if none),
        each held and kept out of the clean-eviction list, with the call that ends that (once):
        it releases the content and lets the file's cached blocks be evicted again, now as the
        most recently used."""
        nodes: dict[int, Node] = {}
        for path in paths or [""]:
            node = self.tree.find_path(path)
            if node is None:
                raise FsError(errno.ENOENT, f"no such file or directory on the mount: {path}")
            nodes.update((n.ino, n) for n in node.walk() if not n.is_dir and n.version is not None)
        out: list[tuple[Content, Callable[[], None]]] = []
        for node in nodes.values():
            version = node.version
            assert version is not None  # only files with a version were collected above
            content = version.content.hold()
            self.retention.keep(node)

            def done(node: Node = node, content: Content = content, version=version) -> None:
                content.release()
                self.retention.maybe_clean(node)
                files = self.prefill.files
                if files is not None and files.on:
                    files.want(node, version)  # warmed: the kernel may read it itself (passthrough)

            out.append((content, done))
        return out

    async def content_for_peer(self, key: str) -> tuple[Content, Callable[[], None]] | None:
        """For a peer asking (cluster/peers.py): the committed content of the file at ``key``
        (looked up in the store if this mount has not seen it yet), held, with the call that
        lets it go (once): the blocks fetched for the peer are then clean cached data, evicted
        like any (the caller keeps the blocks it sends from eviction meanwhile). None if there
        is no such file here."""
        node = self.tree.find_path(key)
        if node is None or node.is_dir:
            await self.refresher.refresh_paths([key])
            node = self.tree.find_path(key)
        if node is None or node.is_dir or node.version is None:
            return None
        content = node.version.content.hold()

        def done(node: Node = node) -> None:
            content.release()
            self.retention.maybe_clean(node)

        return content, done

    def status(self) -> dict:
        writing = sum(1 for h in self.handles.values() if h.staged is not None)
        return {
            "open_handles": len(self.handles),
            "open_writers": writing,
            "inodes": len(self.inodes),
            "attr_heads": self.refresher.attr_heads,
        }
