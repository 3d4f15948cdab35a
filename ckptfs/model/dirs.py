"""Name operations: mkdir, rmdir, unlink and rename, each a change to the tree and its store ops."""

from __future__ import annotations

import errno
import stat

from ckptfs.cache.journal import DELETE, MKDIR, Op
from ckptfs.errors import FsError
from ckptfs.model.commits import Commits
from ckptfs.model.tree import MIN_MULTIPART, RENAME_EXCHANGE, RENAME_NOREPLACE, Attr, Node, attr_metadata


class Dirs:
    def __init__(self, commits: Commits):
        self.commits = commits
        self.tree = commits.tree
        self.block_size = commits.cache.block_size

    def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        parent = self.tree.dir(parent_ino)
        self.tree.check_new_name(parent, name)
        if name in parent.children:
            raise FsError(errno.EEXIST)
        node = self.tree.add(parent, name, is_dir=True, mode=stat.S_IFDIR | (mode & 0o7777), uid=uid, gid=gid)
        node.listed_at = node.changed_here = (
            self.tree.now()
        )  # new: the lookup before mkdir found nothing there
        node.last_seq = self.commits.log(Op(MKDIR, node.key(), meta=attr_metadata(node))).seq
        node.nlookup += 1
        self.tree.touch(parent)
        return self.tree.attr(node)

    def rmdir(self, parent_ino: int, name: str) -> None:
        parent = self.tree.dir(parent_ino)
        node = self.tree.child(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        self.commits.log(Op(DELETE, node.key(), small=True))
        self.commits.detach(node)
        self.tree.touch(parent)

    def unlink(self, parent_ino: int, name: str) -> None:
        parent = self.tree.dir(parent_ino)
        node = self.tree.child(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        # No S3 multipart object (one with a manifest to delete too) is this small: no HEAD first.
        self.commits.log(Op(DELETE, node.key(), small=node.size() <= min(self.block_size, MIN_MULTIPART)))
        self.commits.detach(node)
        self.tree.touch(parent)

    def rename(
        self, old_parent_ino: int, old_name: str, new_parent_ino: int, new_name: str, flags: int
    ) -> None:
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        tree = self.tree
        old_parent = tree.dir(old_parent_ino)
        new_parent = tree.dir(new_parent_ino)
        node = tree.child(old_parent, old_name)
        target = new_parent.children.get(new_name)
        if target is node:
            return
        moved = set(node.walk())
        if any(h.node in moved and h.staged is not None and h.staged.remote for h in tree.handles.values()):
            # Its evicted parts sit in an upload fixed to the current key until the file is closed.
            raise FsError(
                errno.EBUSY, "a file being written here has parts evicted to the store: rename it after close"
            )
        if target is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        tree.check_new_name(new_parent, new_name)
        if node.is_dir:
            ancestor: Node | None = new_parent
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
            if len(new_prefix) + 1 + longest > tree.max_key_bytes:
                raise FsError(errno.ENAMETOOLONG)
        elif target is not None and target.is_dir:
            raise FsError(errno.EISDIR)
        if target is not None:
            if target.is_dir or (not node.is_dir and node.version is None):
                self.commits.log(Op(DELETE, target.key()))
            # Otherwise a file target needs no delete: the moved file's put or copy overwrites
            # its key. A file never committed (still being written) has neither yet.
            self.commits.detach(target)
        old_keys = {n: n.key() for n in node.walk()}
        tree.move(node, new_parent, new_name)
        for n in node.walk():
            self.commits.relocate(n, old_keys[n])
        # Old directory markers go last, deepest first: a local store removes a directory
        # only once the files moved out of it.
        for n in reversed(list(node.walk())):
            if n.is_dir:
                self.commits.log(Op(DELETE, old_keys[n]))
        tree.touch(old_parent)
        tree.touch(new_parent)
