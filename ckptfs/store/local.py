"""The local store: a plain directory (local disk, NFS, Lustre) holds one file per key.

Objects appear only whole: every write goes to a temp file under ``ROOT/.ckptfs-tmp/``
(same filesystem, so the final rename is atomic), is fsynced, then renamed into
place and its directory fsynced. A key ending in ``/`` is a directory. User metadata
lives in ``user.ckptfs.<name>`` xattrs.

A multipart upload is a directory ``.ckptfs-tmp/uploads/<id>/`` whose ``data`` file becomes
the object: each part is written once, in place, at ``(number - 1) * P`` (P: the size of every
part but the last), and ``complete_multipart`` truncates that file and renames it into place.
ckptfs/store/local_multipart.py says how parts are laid out and locked, and what a crash
leaves.

The daemon runs as root, and other users may be able to write into the store directory: no
symbolic link below the root is ever followed. Every path is walked one component at a time,
each directory opened with O_NOFOLLOW relative to its parent's descriptor (openat), and every
file opened, created, renamed or removed relative to its directory's descriptor, so a link
swapped in between a check and a use is not followed either. A link where an object would be
is not an object: listings skip it (with a warning, once per key), reads find nothing, a write
replaces the link itself, and a link where a directory must be fails the write (ELOOP). The
root itself may be reached through links in the path the admin gave.

``LocalStore`` (this module: the object verbs and the listings) holds two collaborators, each
given what it needs at construction: a ``LocalTree`` (local_tree.py: keys to paths, the walk,
publishing a file whole, xattr metadata, over the file primitives of ``localfs``: openat without
following links, whole writes, kernel copies) and a ``LocalMultipart`` (local_multipart.py: the
upload staging), built on the same tree.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckptfs.errors import NotFound, StoreError
from ckptfs.store import localfs as fs
from ckptfs.store.base import DirListing, ObjectInfo, ObjectStore, PartInfo
from ckptfs.store.local_multipart import LocalMultipart
from ckptfs.store.local_tree import (
    LOCAL_LIMITS,
    NOT_AN_OBJECT,
    TMP_DIR,
    UPLOADS,
    XATTR_PREFIX,
    LocalTree,
    etag,
    why,
)

__all__ = ["TMP_DIR", "UPLOADS", "XATTR_PREFIX", "LocalStore"]

log = logging.getLogger(__name__)

_WARNED_LINKS_MAX = 10_000  # links remembered as already warned about (then forgotten at once)


class LocalStore(ObjectStore):
    """The store in a directory: the object verbs and listings here, on its ``tree``; the
    multipart verbs handed to its ``multipart`` (built on the same tree). ``LocalStore.at(root)``
    builds both."""

    limits = LOCAL_LIMITS

    def __init__(self, tree: LocalTree, multipart: LocalMultipart):
        self.tree = tree
        self.multipart = multipart
        self.root = tree.root
        self.url = self.root.as_uri()
        self._warned_links: set[str] = set()  # keys of links a listing skipped, warned about once
        self._warned_lock = threading.Lock()

    @classmethod
    def at(cls, root: Path | str) -> LocalStore:
        """The store in the directory ``root``."""
        tree = LocalTree(root)
        return cls(tree, LocalMultipart(tree, cls.limits.max_parts))

    def _skip_link(self, key: str) -> None:
        """A listing met a symbolic link: it is not shown; say so once per key."""
        with self._warned_lock:
            if key in self._warned_links:
                return
            if len(self._warned_links) >= _WARNED_LINKS_MAX:
                self._warned_links.clear()
            self._warned_links.add(key)
        log.warning("local store %s: %r is a symbolic link: not shown, never followed", self.root, key)

    def _storable_entries(self, fd: int, rel: str) -> list[tuple[os.DirEntry, bool]]:
        """The entries of the directory ``fd`` (key prefix ``rel``) that are objects or prefixes:
        (entry, is_dir). Skips our own temp dir at the top, names that are not UTF-8 (S3 keys
        are), sockets, fifos, and symbolic links (with a warning)."""
        out = []
        with os.scandir(fd) as entries:
            for entry in entries:
                if not rel and entry.name == TMP_DIR:
                    continue
                try:
                    entry.name.encode()
                    if entry.is_symlink():
                        self._skip_link(rel + entry.name)
                        continue
                    is_dir = entry.is_dir(follow_symlinks=False)
                    if is_dir or entry.is_file(follow_symlinks=False):
                        out.append((entry, is_dir))
                except (UnicodeEncodeError, OSError):
                    continue
        return out

    def _file_stat(self, entry: os.DirEntry) -> os.stat_result | None:
        """A listed file's stat (not through a link); None if it went or is no longer a file."""
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    # -- ObjectStore -------------------------------------------------------------

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"local store {self.root} is not a directory", errno_=errno.ENOTDIR) from None
        except OSError as e:
            raise StoreError(
                f"cannot create local store {self.root}: {e.strerror}", errno_=e.errno or errno.EIO
            ) from None
        try:
            self.tree.prepare()
            with self.tree.directory((TMP_DIR,)) as tmp_dir:
                name = f"{uuid.uuid4().hex}.tmp"
                os.close(
                    os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | fs.NOFOLLOW, 0o600, dir_fd=tmp_dir)
                )
                os.unlink(name, dir_fd=tmp_dir)
        except OSError as e:
            raise StoreError(
                f"local store {self.root} is not writable: {why(e)}", errno_=e.errno or errno.EIO
            ) from None

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        parts = self.tree.parts(key)
        try:
            if key.endswith("/"):
                self.tree.prepare()  # the root
                with self.tree.directory(parts, create=True) as d:
                    self.tree.write_metadata(d, metadata)  # a directory's attributes (mode, uid, ...)
                return
            self.tree.publish_new(parts, metadata, lambda fd: fs.pwrite_all(fd, data, 0))
        except OSError as e:
            raise self.tree.err("put", key, e) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._get(key, start, length, False)[0]

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        return self._get(key, start, length, True)

    def _get(self, key: str, start: int, length: int, meta: bool) -> tuple[bytes, dict[str, str]]:
        """Bytes of one open of the object, and (``meta``) its metadata from that same open."""
        if key.endswith("/"):
            try:
                os.close(self.tree.open_dir(self.tree.parts(key)))
                return b"", {}
            except OSError:
                raise NotFound(f"local store {self.root}: no object {key!r}") from None
        fd, _ = self.tree.open_object(key, "get")
        try:
            metadata = self.tree.read_metadata(fd) if meta else {}
            chunks = []
            while length > 0:
                chunk = os.pread(fd, length, start)
                if not chunk:
                    break  # end of file: a short read is fine
                chunks.append(chunk)
                start += len(chunk)
                length -= len(chunk)
            return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), metadata
        except OSError as e:
            raise self.tree.err("get", key, e) from None
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        # "a" and "a/" are different keys, as on S3: a directory is no object "a", a file no "a/".
        if key.endswith("/"):
            try:
                with self.tree.directory(self.tree.parts(key)) as d:
                    return ObjectInfo(key, 0, os.fstat(d).st_mtime, self.tree.read_metadata(d))
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as e:
                if e.errno in NOT_AN_OBJECT:
                    return None
                raise self.tree.err("head", key, e) from None
        try:
            fd, st = self.tree.open_object(key, "head")
        except NotFound:
            return None
        try:
            return ObjectInfo(key, st.st_size, st.st_mtime, self.tree.read_metadata(fd), etag(st))
        except OSError as e:
            raise self.tree.err("head", key, e) from None
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the deepest directory the prefix fully names.
        base = prefix.rpartition("/")[0]
        rel = base + "/" if base else ""
        parts = self.tree.parts(rel) if rel else []
        try:
            fd = self.tree.open_dir(parts)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno in NOT_AN_OBJECT:
                return
            raise self.tree.err("list", prefix, e) from None
        try:
            if rel and prefix == rel:  # the prefix names a directory: its marker comes first
                yield ObjectInfo(rel, 0, os.fstat(fd).st_mtime)
            yield from self._walk(fd, rel, prefix)
        except OSError as e:
            raise self.tree.err("list", prefix, e) from None
        finally:
            os.close(fd)

    def _walk(self, fd: int, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        """Yield the keys under the directory ``fd`` in S3 order (UTF-8 byte order of the whole key)."""
        items = []
        for entry, is_dir in self._storable_entries(fd, rel):
            key = rel + entry.name + ("/" if is_dir else "")
            if key.startswith(prefix):
                items.append((key.encode(), key, is_dir, entry))
        items.sort()
        for _, key, is_dir, entry in items:
            if not is_dir:
                st = self._file_stat(entry)
                if st is not None:  # else removed (or swapped for a link) while we walked
                    yield ObjectInfo(key, st.st_size, st.st_mtime, etag=etag(st))
                continue
            try:
                sub = fs.subdir(fd, entry.name)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._skip_link(key[:-1])
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # removed or swapped while we walked
                raise
            try:
                yield ObjectInfo(key, 0, os.fstat(sub).st_mtime)
                yield from self._walk(sub, key, prefix)
            finally:
                os.close(sub)

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir needs a directory prefix, not {prefix!r}")
        parts = self.tree.parts(prefix) if prefix else []
        try:
            with self.tree.directory(parts) as fd:
                items = []
                for entry, is_dir in self._storable_entries(fd, prefix):
                    items.append((entry.name.encode() + (b"/" if is_dir else b""), entry, is_dir))
                items.sort(key=lambda item: item[0])  # S3 order: UTF-8 bytes of the key
                files: list[ObjectInfo] = []
                dirs: list[str] = []
                for _, entry, is_dir in items:
                    if limit is not None and len(files) + len(dirs) >= limit:
                        break
                    if is_dir:
                        dirs.append(entry.name)
                        continue
                    try:
                        st = self._file_stat(entry)
                    except OSError as e:
                        raise self.tree.err("list", prefix + entry.name, e) from None
                    if st is not None:  # else removed (or swapped for a link) while we listed
                        files.append(ObjectInfo(prefix + entry.name, st.st_size, st.st_mtime, etag=etag(st)))
                return DirListing(files, dirs, True)
        except (FileNotFoundError, NotADirectoryError):
            return DirListing([], [], not prefix)
        except OSError as e:
            if e.errno in NOT_AN_OBJECT:
                return DirListing([], [], not prefix)
            raise self.tree.err("list", prefix, e) from None

    def delete(self, key: str) -> None:
        parts = self.tree.parts(key)
        try:
            with self.tree.directory(parts[:-1]) as d:
                if key.endswith("/"):
                    os.rmdir(parts[-1], dir_fd=d)
                else:
                    os.unlink(parts[-1], dir_fd=d)  # a link there goes itself; its target stays
        except OSError as e:
            # Absent is fine; so is a non-empty directory (it holds other keys), "a" naming a
            # directory (there is no object "a"), and a link on the way (nothing of ours there).
            if e.errno not in (
                errno.ENOENT,
                errno.ENOTDIR,
                errno.ENOTEMPTY,
                errno.EEXIST,
                errno.EISDIR,
                errno.ELOOP,
            ):
                raise self.tree.err("delete", key, e) from None

    def set_metadata(self, key: str, metadata: dict[str, str]) -> None:
        """The xattrs rewritten in place: the data is not touched."""
        if key.endswith("/"):
            self.put(key, b"", metadata)
            return
        fd, _ = self.tree.open_object(key, "set_metadata")
        try:
            self.tree.write_metadata(fd, metadata)
            os.fsync(fd)
        except OSError as e:
            raise self.tree.err("set_metadata", key, e) from None
        finally:
            os.close(fd)

    def copy(self, src: str, dst: str) -> None:
        dst_parts = self.tree.parts(dst)
        if src.endswith("/"):
            if self.head(src) is None:
                raise NotFound(f"local store {self.root}: no object {src!r}")
            self.put(dst, b"")
            return
        sfd, _ = self.tree.open_object(src, "copy")
        try:
            self.tree.publish_new(
                dst_parts, self.tree.read_metadata(sfd), lambda fd: fs.copy_range(sfd, 0, fd, 0)
            )
        except OSError as e:
            raise self.tree.err("copy", f"{src} -> {dst}", e) from None
        finally:
            os.close(sfd)

    # -- multipart uploads: the tree's LocalMultipart ------------------------------------------

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        return self.multipart.create(key, metadata)

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        return self.multipart.upload_part(key, upload_id, number, data)

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        """A hole: the part's bytes are punched out of the file, never written (a sparse object)."""
        return self.multipart.upload_zero_part(key, upload_id, number, length)

    def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[PartInfo]) -> None:
        self.multipart.complete(key, upload_id, parts)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.multipart.abort(key, upload_id)

    def list_multipart(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        return self.multipart.unfinished(prefix)
