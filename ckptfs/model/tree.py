"""The tree: inodes, directories, open handles, and how a path becomes a store key.

Plain data and the bookkeeping of the tree's shape; nothing here talks to the cache, the
journal or the store.
"""

from __future__ import annotations

import errno
import itertools
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal

import trio

from ckptfs.cache.backing import WorkingFile
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content, StagedFile
from ckptfs.cache.journal import Op
from ckptfs.errors import FsError
from ckptfs.store.base import MAX_KEY_BYTES, RESERVED_PREFIX, ObjectInfo
from ckptfs.transfer.upload_tasks import Stream

ROOT_INODE = 1
MAX_NAME_BYTES = 255
MIN_MULTIPART = 5 << 20  # S3's smallest part: a multipart object is larger
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


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
    writing: bool = False  # open for writing: its size moves with every write (no attribute caching)
    nlink: int = 1


class Version:
    """A committed content of a file; ``seq`` is its pending put op, None once durable."""

    def __init__(self, content: Content, seq: int | None):
        self.content = content.hold()
        self.seq = seq
        self.stamp: ObjectInfo | None = None  # how the store last showed this version (refresh)


class Shadow:
    """A disk-backed copy of a file's content, journaled by fsync as a put op that is not uploaded.

    It is what a restart after a node reboot (RAM tier lost) restores. ``covers`` is the seq of
    the version it stands for (None while it belongs to a working copy that has not committed);
    it retires once that version, or a later one, is durable.
    """

    def __init__(self, op: Op, content: Content, writing: Writing | None, covers: int | None):
        self.op = op
        self.content = content.hold()
        self.writing = writing
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
        self.subdirs = 0  # directories among the children (their ".." links: nlink, without a scan)
        self.version: Version | None = None
        self.nlookup = 0
        self.handles = 0
        self.writers = 0  # open handles that may write
        self.writing: Writing | None = None  # the working copy every descriptor sees while open for writing
        self.kernel_version: Version | None = None  # what the kernel page cache may hold
        self.last_seq = 0  # newest op that concerns this node (for sync PATH)
        self.shadows: list[Shadow] = []
        self.unlinked = False
        self.unlinked_size = 0  # its size when unlinked: descriptors still open read that much
        self.listed_at: float | None = None  # directories: last merged store listing (monotonic); None: never
        self.gone = False  # taken out because the store no longer has it (another mount deleted it)
        self.changed_here: float | None = (
            None  # directories: last create/unlink/rename in it here (monotonic)
        )
        # Whether mode, uid, gid and mtime are the store's: False for what a listing showed until
        # its metadata is read (a HEAD before the kernel sees it: see Refresher.learn_attrs).
        self.attrs_known = True
        self.attr_seq = 0  # the last attribute op journaled for it

    def key(self) -> str:
        parts = []
        node = self
        while node.parent is not None:
            parts.append(node.name)
            node = node.parent
        key = "/".join(reversed(parts))
        return key + "/" if self.is_dir and key else key

    def size(self) -> int:
        """The size every descriptor sees: the working copy's while the file is open for
        writing (POSIX on the node), else the committed version's."""
        if self.writing is not None:
            return self.writing.staged.size
        if self.version is not None:
            return self.version.content.size
        return self.unlinked_size if self.unlinked else 0

    def note_writes(self) -> None:
        """The kernel writes a working file itself (passthrough): its writes show here as the
        file's mtime moving, which makes the node's mtime and the working copy dirty."""
        writing = self.writing
        if writing is None:
            return
        written = writing.staged.written_ns()
        if written > writing.seen_ns:
            writing.seen_ns = written
            self.mtime_ns = self.ctime_ns = written
            writing.dirty = True

    def walk(self) -> Iterable[Node]:
        yield self
        for child in list(self.children.values()):
            yield from child.walk()


_writing_serials = itertools.count(1)


class Writing:
    """The one working copy of a file open for writing, shared by all its writers: every
    descriptor on the mount sees its bytes and size as they are written (POSIX on the node).
    It is committed when its last writer closes (atomic in the store)."""

    def __init__(self, staged: StagedFile | WorkingFile):
        self.staged = staged
        self.serial = next(_writing_serials)  # names it in the replica stream (--replicas)
        self.dirty = False  # changed since the last commit
        self.error = 0  # sticky: a write that failed (ENOSPC, EIO) poisons the commit
        self.stream: Stream | None = None  # parts sent before the commit
        # Written sequentially so far (files.Files.write): the copy began empty and no write
        # went back behind the block its furthest byte so far (``high_water``) lies in. Only
        # then are blocks it moved past streamed and, under cache pressure, evicted: a writer
        # that goes back (fsx, a file rewritten in place) may change them again.
        self.sequential = staged.size == 0
        self.high_water = 0  # the end of its furthest write (bytes)
        # Committed with parts evicted to the store: no more writes (they belong to that upload).
        self.frozen = False
        self.handles: set[Handle] = set()  # its open writer handles
        # Held from a write's first half to its second (files.PendingWrite: the copy between
        # runs in another thread), and by what must see no write half done: a commit, an fsync,
        # a truncate (Files.settle_writes).
        self.lock = trio.Semaphore(1)  # (not a Lock: the halves run in different tasks)
        self.closed: set[Handle] = set()  # ... whose opener has closed them (flush with commit)
        self.seen_ns = 0  # a working file's last write seen (Node.note_writes)
        self.opened_at = time.monotonic()  # (model/tailing.py streams a file once open a while)
        self.tailed = 0  # a working file's blocks handed to its stream so far (model/tailing.py)
        self.disk_full = False  # the cache disk was seen full while the kernel wrote it
        self.polled_size = 0  # a working file's size at the tailer's last look
        # The working file a commit sealed, and its mtime then (a forked child may still write it).
        self.sealed: WorkingFile | None = None
        self.sealed_ns = 0
        self.sealed_content: Content | None = None  # (the version it was committed as)


class Handle:
    def __init__(self, fh: int, node: Node, writing: Writing | None, content: Content | None, append: bool):
        self.fh = fh
        self.node = node
        self.writing = writing  # writers: the file's shared working copy
        self.content = content  # readers: the version they read (held)
        self.append = append
        # Its writes clear the file's set-id bits (files.drop_setid): a direct-I/O writer
        # without CAP_FSETID, where the kernel leaves that to the filesystem.
        self.drops_setid = False
        self.read_end = 0  # where the last read stopped (sequential reads trigger read-ahead)

    @property
    def staged(self) -> StagedFile | WorkingFile | None:
        return self.writing.staged if self.writing is not None else None

    @property
    def stream(self) -> Stream | None:
        return self.writing.stream if self.writing is not None else None


class Tree:
    """Inodes by number, the directory tree, open handles by fh, and the model's clock."""

    def __init__(
        self,
        uid: int,
        gid: int,
        umask: int = 0o022,
        root: tuple[int, int, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_key_bytes: int = MAX_KEY_BYTES,
    ):
        # Owner and modes of what the store does not say (loaded objects): the mounting user, and
        # 0666/0777 less ``umask``; the root directory: (mode, uid, gid), as the mountpoint was.
        self.uid, self.gid = uid, gid
        self.file_mode, self.dir_mode = 0o666 & ~umask, 0o777 & ~umask
        root_mode, root_uid, root_gid = root or (0o755, uid, gid)
        self.root = Node(ROOT_INODE, "", None, True, stat.S_IFDIR | (root_mode & 0o7777), root_uid, root_gid)
        self.inodes: dict[int, Node] = {ROOT_INODE: self.root}
        self.handles: dict[int, Handle] = {}
        self.clock = clock
        self.max_key_bytes = max_key_bytes  # the store's key room (S3: 1024 bytes less the prefix's)
        self._next_ino = ROOT_INODE + 1
        self._next_fh = 1

    def now(self) -> float:
        """Monotonic seconds: listing ages, the negative cache, changes made here."""
        return self.clock()

    # -- finding -------------------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def dir(self, ino: int) -> Node:
        node = self.node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    @staticmethod
    def child(parent: Node, name: str) -> Node:
        node = parent.children.get(name)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def find(self, parts: list[str]) -> Node | None:
        node = self.root
        for part in parts:
            child = node.children.get(part) if node.is_dir else None
            if child is None:
                return None
            node = child
        return node

    def find_path(self, path: str) -> Node | None:
        """A path as a control command gives it ("a/b", "/a/./b", "" for the top)."""
        return self.find([p for p in path.split("/") if p and p != "."])

    @staticmethod
    def attr(node: Node) -> Attr:
        # Links as on a local disk: a directory's "." and its entry, and each subdirectory's "..";
        # none once unlinked (a file still open).
        nlink = 2 + node.subdirs if node.is_dir else 1
        # Stored attributes not read yet (a HEAD failed): shown as root's, no permission, never
        # more open than they will be.
        mode, uid, gid = (
            (node.mode, node.uid, node.gid) if node.attrs_known else (stat.S_IFMT(node.mode), 0, 0)
        )
        node.note_writes()
        return Attr(
            node.ino,
            node.is_dir,
            mode,
            node.size(),
            uid,
            gid,
            node.atime_ns,
            node.mtime_ns,
            node.ctime_ns,
            node.writing is not None,
            0 if node.unlinked else nlink,
        )

    def files(self) -> Iterable[Node]:
        return (n for n in self.root.walk() if not n.is_dir)

    # -- shaping ------------------------------------------------------------------------------
    def add(self, parent: Node, name: str, is_dir: bool, mode: int | None = None, uid=None, gid=None) -> Node:
        if mode is None:
            mode = stat.S_IFDIR | self.dir_mode if is_dir else stat.S_IFREG | self.file_mode
        node = Node(
            self._next_ino,
            name,
            parent,
            is_dir,
            mode,
            self.uid if uid is None else uid,
            self.gid if gid is None else gid,
        )
        self._next_ino += 1
        self.inodes[node.ino] = node
        self.put_in(node, parent, name)
        return node

    def ensure_dir(self, parts: list[str]) -> Node | None:
        node = self.root
        for part in parts:
            child = node.children.get(part)
            if child is None:
                child = self.add(node, part, is_dir=True)
            elif not child.is_dir:
                return None
            node = child
        return node

    def move(self, node: Node, new_parent: Node, new_name: str) -> None:
        self.take_out(node)
        self.put_in(node, new_parent, new_name)
        node.ctime_ns = time.time_ns()

    @staticmethod
    def put_in(node: Node, parent: Node, name: str) -> None:
        node.parent, node.name = parent, name
        parent.children[name] = node
        parent.subdirs += node.is_dir

    @staticmethod
    def take_out(node: Node) -> None:
        """Out of its parent's entries (the node keeps ``parent``: an unlinked node's last place)."""
        parent = node.parent
        assert parent is not None  # only a node in the tree is taken out, and the root never is
        del parent.children[node.name]
        parent.subdirs -= node.is_dir

    def touch(self, node: Node) -> None:
        """A directory changed here (create, unlink, rename in it)."""
        node.mtime_ns = node.ctime_ns = time.time_ns()
        node.changed_here = self.now()

    def maybe_drop(self, node: Node) -> None:
        """Forget an unlinked node once neither the kernel nor a handle knows it."""
        if node.unlinked and node.nlookup == 0 and node.handles == 0:
            self.inodes.pop(node.ino, None)

    def new_handle(
        self, node: Node, writing: Writing | None, content: Content | None, append: bool
    ) -> Handle:
        handle = Handle(self._next_fh, node, writing, content, append)
        self._next_fh += 1
        self.handles[handle.fh] = handle
        node.handles += 1
        if writing is not None:
            node.writers += 1
            writing.handles.add(handle)
        return handle

    def check_new_name(self, parent: Node, name: str) -> None:
        try:
            encoded = name.encode("utf-8")
        except UnicodeEncodeError:
            raise FsError(errno.EINVAL, "names must be valid UTF-8 to be stored as keys") from None
        self.check_name_length(parent, encoded)
        if parent is self.root and name.startswith(RESERVED_PREFIX):
            raise FsError(errno.EINVAL, f"names starting with {RESERVED_PREFIX} are reserved at the top")
        if name in (".", ".."):
            raise FsError(errno.EINVAL)

    def check_name_length(self, parent: Node, name: bytes, spare: int = 1) -> None:
        """ENAMETOOLONG for a name over 255 bytes, or one whose key would pass the store's limit
        (``spare``: bytes kept for a new directory's trailing "/"; 0 for a name that may exist)."""
        if len(name) > MAX_NAME_BYTES:
            raise FsError(errno.ENAMETOOLONG)
        if len(parent.key().encode()) + len(name) + spare > self.max_key_bytes:
            raise FsError(errno.ENAMETOOLONG, "the path is longer than the store's key limit")


def split_key(key: str) -> list[str] | None:
    """A store key as path parts, or None if it cannot be shown safely (.., empty, overlong)."""
    if not key or key.startswith("/") or len(key.encode()) > MAX_KEY_BYTES:
        return None
    parts = key.rstrip("/").split("/") if key != "/" else []
    if not parts or any(p in ("", ".", "..") or len(p.encode()) > MAX_NAME_BYTES for p in parts):
        return None
    if parts[0].startswith(RESERVED_PREFIX):
        return None
    return parts


def common_dir(a: str, b: str) -> str:
    """The deepest directory key both directory keys ``a`` and ``b`` are under ("" = the root)."""
    common = []
    for x, y in zip(a.split("/")[:-1], b.split("/")[:-1]):
        if x != y:
            break
        common.append(x)
    return "/".join(common) + "/" if common else ""


def n_blocks(size: int, block_size: int) -> int:
    return (size + block_size - 1) // block_size


def store_content(cache: Cache, info: ObjectInfo) -> Content:
    """A durable file as the store lists it: no block cached yet."""
    content = Content(cache, info.size, [None] * n_blocks(info.size, cache.block_size), in_store=True)
    content.key = info.key
    content.durable_at = info.mtime
    return content


def show_store_version(node: Node, content: Content, info: ObjectInfo, headed: bool = False) -> None:
    """``node`` shows the store's object ``info`` (held in ``content``). ``headed``: ``info``
    came from a HEAD and carries the object's metadata (a listing's does not)."""
    node.version = Version(content, None)
    node.version.stamp = info
    node.mtime_ns = node.ctime_ns = int(info.mtime * 1e9)
    if headed:
        apply_attr_metadata(node, info.metadata)
    else:
        node.attrs_known = False


# The attributes stored with each object, in the metadata s3fs-fuse and rclone read and write
# (x-amz-meta-mode: st_mode in decimal with its type bits; -uid, -gid; -mtime: seconds, which
# s3fs 1.90 writes as "1600000000.123456789" when utime gave it nanoseconds; ckptfs writes whole
# seconds).
MODE_META, UID_META, GID_META, MTIME_META = "mode", "uid", "gid", "mtime"
# A symbolic link: a small object whose body is the target, its mode S_IFLNK | 0777 (as s3fs
# writes it); a target is at most PATH_MAX less its NUL, as on a local disk.
LINK_MODE = stat.S_IFLNK | 0o777
MAX_LINK_TARGET = 4095


def attr_metadata(node: Node, mtime: bool = True) -> dict[str, str]:
    """``node``'s attributes as object metadata (``mtime=False``: without the mtime)."""
    meta = {MODE_META: str(node.mode), UID_META: str(node.uid), GID_META: str(node.gid)}
    if mtime:
        meta[MTIME_META] = mtime_text(node.mtime_ns)
    return meta


def mtime_text(mtime_ns: int) -> str:
    """An mtime as s3fs writes it: whole seconds, with the nanoseconds after a point when there
    are any (rclone reads the same)."""
    seconds, ns = divmod(mtime_ns, 1_000_000_000)
    return f"{seconds}.{ns:09d}" if ns else str(seconds)


def apply_attr_metadata(node: Node, metadata: dict[str, str]) -> None:
    """Show the attributes an object's metadata stores; what it lacks or cannot be read keeps
    the defaults (another tool's object)."""
    node.attrs_known = True
    try:
        mode = int(metadata[MODE_META])
        if not 0 <= mode < 2**32:
            raise ValueError(mode)
    except (KeyError, ValueError):
        mode = None
    if not node.is_dir:
        # An object is a link exactly when its stored mode says S_IFLNK (s3fs's convention);
        # any other object is a regular file, so a file never becomes a link by accident.
        if mode is not None and stat.S_ISLNK(mode):
            node.mode, mode = LINK_MODE, None  # (a link's permissions are always 0777)
        elif stat.S_ISLNK(node.mode):  # a link replaced by a file: its stored mode, else the most closed
            node.mode = stat.S_IFREG | 0o600
    if mode is not None and stat.S_IFMT(mode) in (
        0,
        stat.S_IFMT(node.mode),
    ):  # (a wrong type is not believed)
        node.mode = stat.S_IFMT(node.mode) | (mode & 0o1777)  # (no set-id bit from the store)
    for name, field in ((UID_META, "uid"), (GID_META, "gid")):
        try:
            value = int(metadata[name])
        except (KeyError, ValueError):
            continue
        if 0 <= value < 2**32:
            setattr(node, field, value)
    try:
        seconds = Decimal(metadata[MTIME_META].strip())  # (exact: a float loses s3fs's last nanoseconds)
    except (KeyError, ArithmeticError):  # (decimal.InvalidOperation is an ArithmeticError)
        return
    if seconds.is_finite() and seconds.copy_abs() < 9_000_000_000:  # (nanoseconds within an int64)
        node.mtime_ns = int(seconds * 1_000_000_000)


def release_blocks(cache: Cache, blocks: list) -> None:
    for ref in blocks:
        if ref is not None:
            cache.decref(ref)
