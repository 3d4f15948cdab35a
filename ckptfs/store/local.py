"""The local store: a plain directory (local disk, NFS, Lustre) holds one file per key.

Objects appear only whole: every write goes to a temp file under ``ROOT/.ckptfs-tmp/``
(same filesystem, so the final rename is atomic), is fsynced, then renamed into
place and its directory fsynced. A key ending in ``/`` is a directory. User metadata
lives in ``user.ckptfs.<name>`` xattrs.

A multipart upload is a directory ``.ckptfs-tmp/uploads/<id>/`` whose ``data`` file becomes
the object: each part is written once, in place, at ``(number - 1) * P`` (P: the size of every
part but the last), and ``complete_multipart`` truncates that file and renames it into place.
The multipart section of LocalStore says how parts are laid out and locked, and what a crash
leaves.

The daemon runs as root, and other users may be able to write into the store directory: no
symbolic link below the root is ever followed. Every path is walked one component at a time,
each directory opened with O_NOFOLLOW relative to its parent's descriptor (openat), and every
file opened, created, renamed or removed relative to its directory's descriptor, so a link
swapped in between a check and a use is not followed either. A link where an object would be
is not an object: listings skip it (with a warning, once per key), reads find nothing, a write
replaces the link itself, and a link where a directory must be fails the write (ELOOP). The
root itself may be reached through links in the path the admin gave.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .base import (
    MAX_PARTS,
    DirListing,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PartInfo,
    StoreError,
)

log = logging.getLogger(__name__)

TMP_DIR = ".ckptfs-tmp"
UPLOADS = (TMP_DIR, "uploads")
XATTR_PREFIX = "user.ckptfs."
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}\Z")
_NO_XATTR = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
# Errors where trying again later may succeed (space freed, NFS server back).
_TRANSIENT = {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EINTR,
              errno.ETIMEDOUT, errno.ESTALE, errno.EBUSY}
# Opening a name that is no object: a symbolic link (ELOOP), a socket (ENXIO).
_NOT_AN_OBJECT = {errno.ELOOP, errno.ENXIO, errno.ENODEV}
_COPY_CHUNK = 64 << 20
_SMALL_FILE = 1 << 20  # the most read of an upload's ``key`` or ``metadata.json``
_WARNED_LINKS_MAX = 10_000  # links remembered as already warned about (then forgotten at once)

# Every open below the root: never through a symbolic link, never inherited by helpers.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW


def _subdir(parent: int, name: str, create: bool = False) -> int:
    """A descriptor of the directory ``name`` in ``parent``, never through a symbolic link
    (one there: ELOOP; a file: ENOTDIR). With ``create``, made if missing (and ``parent``
    fsynced, so it survives a crash)."""
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except NotADirectoryError:
        # O_DIRECTORY|O_NOFOLLOW says ENOTDIR for a link too: tell the two apart for the message.
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
        raise
    try:
        os.mkdir(name, dir_fd=parent)
        os.fsync(parent)
    except FileExistsError:
        pass  # made meanwhile: opened below with the same checks
    return _subdir(parent, name)


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _read_small(dir_fd: int, name: str) -> bytes:
    """The content of a small file (at most _SMALL_FILE bytes) in ``dir_fd``, not through a link."""
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    try:
        chunks, size = [], 0
        while size < _SMALL_FILE and (chunk := os.read(fd, _SMALL_FILE - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (a write may be short); returns its length."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int | None = None) -> int:
    """Copy ``length`` bytes (None: up to the end of ``src``) from ``src`` at ``src_offset`` to
    ``dst`` at ``dst_offset``; returns the bytes copied (fewer where ``src`` ends first).
    copy_file_range lets the kernel (or an NFS/Lustre server) copy without user space."""
    copied = 0

    def chunk() -> int:
        return _COPY_CHUNK if length is None else min(_COPY_CHUNK, length - copied)

    try:
        while (n := chunk()) and (n := os.copy_file_range(src, dst, n, src_offset + copied, dst_offset + copied)):
            copied += n
        return copied
    except OSError as e:
        # Not supported on this filesystem pair: fall back to read/write below.
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    while (n := chunk()) and (data := os.pread(src, n, src_offset + copied)):
        copied += _pwrite_all(dst, data, dst_offset + copied)
    return copied


# Records of a multipart upload's ``index`` file (see the multipart section of LocalStore):
# fixed-size, each with its own checksum, so a torn or wiped record reads as no record.
_RECORD = 64
_HEADER = struct.Struct("<4sQ")  # magic, P (the slot size)
_PART = struct.Struct("<4sIQQ16s")  # magic, number, length, offset in ``data`` or _OWN_FILE, token
_MAGIC = {_HEADER: b"CKPS", _PART: b"CKPP"}
_CRC = struct.Struct("<Q")
_OWN_FILE = (1 << 64) - 1  # the part is in ``<number>.part``


@dataclass(frozen=True)
class _Part:
    length: int
    offset: int  # where in ``data``, or _OWN_FILE
    token: str


def _pack(layout: struct.Struct, *fields) -> bytes:
    body = layout.pack(_MAGIC[layout], *fields)
    return (body + _CRC.pack(xxhash.xxh64_intdigest(body))).ljust(_RECORD, b"\0")


def _unpack(layout: struct.Struct, raw: bytes) -> tuple | None:
    """A record's fields, or None for one missing, torn or wiped."""
    body, crc = raw[:layout.size], raw[layout.size:layout.size + _CRC.size]
    if len(crc) < _CRC.size or _CRC.unpack(crc)[0] != xxhash.xxh64_intdigest(body):
        return None
    fields = layout.unpack(body)
    return fields if fields[0] == _MAGIC[layout] else None


def _parse_part(raw: bytes, number: int) -> _Part | None:
    fields = _unpack(_PART, raw)
    if fields is None or fields[1] != number:
        return None
    return _Part(fields[2], fields[3], fields[4].decode("ascii", "replace"))


def _read_part(index: int, number: int) -> _Part | None:
    return _parse_part(os.pread(index, _RECORD, number * _RECORD), number)


def _read_parts(index: int) -> dict[int, _Part]:
    """Every part recorded in the index: {number: part}."""
    raw = os.pread(index, (MAX_PARTS + 1) * _RECORD, 0)
    parts = {}
    for number in range(1, len(raw) // _RECORD):
        part = _parse_part(raw[number * _RECORD:(number + 1) * _RECORD], number)
        if part is not None:
            parts[number] = part
    return parts


def _write_records(index: int, records: dict[int, _Part | None]) -> None:
    """Write part records (None wipes one), then make them durable."""
    if not records:
        return
    for number, part in records.items():
        raw = bytes(_RECORD) if part is None else _pack(_PART, number, part.length, part.offset,
                                                        part.token.encode())
        _pwrite_all(index, raw, number * _RECORD)
    os.fdatasync(index)


@contextlib.contextmanager
def _flocked(dir_fd: int, name: str, how: int, create: bool = False) -> Iterator[int]:
    """``name`` in ``dir_fd`` opened (not through a link) and flocked ``how`` (closing it
    releases the lock)."""
    fd = os.open(name, os.O_RDWR | _NOFOLLOW | (os.O_CREAT if create else 0), 0o644, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)


def _etag(st: os.stat_result) -> str:
    """Which file holds the object: every write publishes a new file (a new inode), and a
    filesystem's clock may not tell two writes in one tick apart."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}"


class LocalStore(ObjectStore):
    def __init__(self, root: Path | str):
        self.root = Path(os.path.abspath(root))
        self.url = self.root.as_uri()
        self._xattrs = True  # cleared the first time the filesystem refuses them
        self._slot_sizes: dict[str, int] = {}  # upload id -> P, once known (it never changes)
        self._begun: dict[str, dict[int, int]] = {}  # upload id -> {number: length} of parts begun here
        self._begun_lock = threading.Lock()
        self._warned_links: set[str] = set()  # keys of links a listing skipped, warned about once
        self._warned_lock = threading.Lock()
        self._ready = False

    # -- helpers ---------------------------------------------------------------

    def _parts(self, key: str) -> list[str]:
        """The path components of ``key`` below the root; ValueError for keys that would escape it."""
        if not key or key.startswith("/") or "\0" in key:
            raise ValueError(f"invalid store key {key!r}")
        parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid store key {key!r}: empty, '.' or '..' component")
        if parts[0] == TMP_DIR:
            raise ValueError(f"invalid store key {key!r}: {TMP_DIR} is reserved")
        return parts

    def _open_dir(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of the directory ROOT/parts..., each component opened relative to the
        one before and never through a link (see the module doc). With ``create``: mkdir -p."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in parts:
                child = _subdir(fd, name, create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _dir(self, parts: Sequence[str], create: bool = False) -> Iterator[int]:
        fd = self._open_dir(parts, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_object(self, key: str, op: str) -> tuple[int, os.stat_result]:
        """The regular file holding ``key``, opened read-only, and its stat; NotFound where there
        is none (a directory, a link, anything else)."""
        parts = self._parts(key)
        try:
            with self._dir(parts[:-1]) as d:
                # O_NONBLOCK: opening a fifo someone put there must not hang; no effect on a file.
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=d)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"local store {self.root}: no object {key!r}") from None
        except OSError as e:
            if e.errno in _NOT_AN_OBJECT:
                raise NotFound(f"local store {self.root}: no object {key!r} ({self._why(e)})") from None
            raise self._err(op, key, e) from None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise self._err(op, key, e) from None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotFound(f"local store {self.root}: no object {key!r} (not a file)")
        return fd, st

    @staticmethod
    def _why(e: OSError) -> str:
        if e.errno == errno.ELOOP:
            return f"{e.filename or 'a name on the way'} is a symbolic link (links in the store are never followed)"
        return e.strerror or str(e)

    def _err(self, op: str, key: str, e: OSError) -> StoreError:
        code = e.errno or errno.EIO
        return StoreError(f"local store {self.root}: {op} {key!r}: {self._why(e)}",
                          transient=code in _TRANSIENT, errno_=code)

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

    def _prepare(self) -> None:
        if not self._ready:
            self.root.mkdir(parents=True, exist_ok=True)
            os.close(self._open_dir(UPLOADS, create=True))
            self._ready = True

    def _publish(self, fd: int, src_dir: int, src_name: str, dest: Sequence[str]) -> None:
        """fsync the file ``fd`` (named ``src_name`` in ``src_dir``), rename it over the key
        ``dest`` (its components) and make the rename durable. The rename replaces a link at
        ``dest`` itself, never what it points to."""
        os.fsync(fd)
        with self._dir(dest[:-1], create=True) as d:
            os.rename(src_name, dest[-1], src_dir_fd=src_dir, dst_dir_fd=d)
            os.fsync(d)

    def _publish_new(self, dest: Sequence[str], metadata: dict[str, str] | None,
                     fill: Callable[[int], object]) -> None:
        """A new object at ``dest``: a temp file that ``fill(fd)`` writes, then ``_publish``."""
        self._prepare()
        with self._dir((TMP_DIR,), create=True) as tmp_dir:
            name = f"{uuid.uuid4().hex}.tmp"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=tmp_dir)
            try:
                fill(fd)
                self._set_metadata(fd, metadata)
                self._publish(fd, tmp_dir, name, dest)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=tmp_dir)

    def _set_metadata(self, fd: int, metadata: dict[str, str] | None) -> None:
        for name, value in (metadata or {}).items():
            if not self._xattrs:
                return
            try:
                os.setxattr(fd, XATTR_PREFIX + name, value.encode())
            except OSError as e:
                if e.errno not in _NO_XATTR:
                    raise
                self._xattrs = False
                log.debug("local store %s: no xattr support (%s): metadata is not kept", self.root, e.strerror)

    def _get_metadata(self, fd: int) -> dict[str, str]:
        if not self._xattrs:
            return {}
        try:
            names = [n for n in os.listxattr(fd) if n.startswith(XATTR_PREFIX)]
            return {n[len(XATTR_PREFIX):]: os.getxattr(fd, n).decode() for n in names}
        except OSError as e:
            if e.errno in _NO_XATTR:
                return {}
            raise

    # -- ObjectStore -------------------------------------------------------------

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"local store {self.root} is not a directory", errno_=errno.ENOTDIR) from None
        except OSError as e:
            raise StoreError(f"cannot create local store {self.root}: {e.strerror}", errno_=e.errno or errno.EIO) from None
        try:
            self._prepare()
            with self._dir((TMP_DIR,)) as tmp_dir:
                name = f"{uuid.uuid4().hex}.tmp"
                os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=tmp_dir))
                os.unlink(name, dir_fd=tmp_dir)
        except OSError as e:
            raise StoreError(f"local store {self.root} is not writable: {self._why(e)}",
                             errno_=e.errno or errno.EIO) from None

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        parts = self._parts(key)
        try:
            if key.endswith("/"):
                self._prepare()  # the root
                os.close(self._open_dir(parts, create=True))
                return
            self._publish_new(parts, metadata, lambda fd: _pwrite_all(fd, data, 0))
        except OSError as e:
            raise self._err("put", key, e) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._get(key, start, length, False)[0]

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        return self._get(key, start, length, True)

    def _get(self, key: str, start: int, length: int, meta: bool) -> tuple[bytes, dict[str, str]]:
        """Bytes of one open of the object, and (``meta``) its metadata from that same open."""
        if key.endswith("/"):
            try:
                os.close(self._open_dir(self._parts(key)))
                return b"", {}
            except OSError:
                raise NotFound(f"local store {self.root}: no object {key!r}") from None
        fd, _ = self._open_object(key, "get")
        try:
            metadata = self._get_metadata(fd) if meta else {}
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
            raise self._err("get", key, e) from None
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        # "a" and "a/" are different keys, as on S3: a directory is no object "a", a file no "a/".
        if key.endswith("/"):
            try:
                with self._dir(self._parts(key)) as d:
                    return ObjectInfo(key, 0, os.fstat(d).st_mtime)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as e:
                if e.errno in _NOT_AN_OBJECT:
                    return None
                raise self._err("head", key, e) from None
        try:
            fd, st = self._open_object(key, "head")
        except NotFound:
            return None
        try:
            return ObjectInfo(key, st.st_size, st.st_mtime, self._get_metadata(fd), _etag(st))
        except OSError as e:
            raise self._err("head", key, e) from None
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the deepest directory the prefix fully names.
        base = prefix.rpartition("/")[0]
        rel = base + "/" if base else ""
        parts = self._parts(rel) if rel else []
        try:
            fd = self._open_dir(parts)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno in _NOT_AN_OBJECT:
                return
            raise self._err("list", prefix, e) from None
        try:
            if rel and prefix == rel:  # the prefix names a directory: its marker comes first
                yield ObjectInfo(rel, 0, os.fstat(fd).st_mtime)
            yield from self._walk(fd, rel, prefix)
        except OSError as e:
            raise self._err("list", prefix, e) from None
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
                    yield ObjectInfo(key, st.st_size, st.st_mtime, etag=_etag(st))
                continue
            try:
                sub = _subdir(fd, entry.name)
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
        parts = self._parts(prefix) if prefix else []
        try:
            with self._dir(parts) as fd:
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
                        raise self._err("list", prefix + entry.name, e) from None
                    if st is not None:  # else removed (or swapped for a link) while we listed
                        files.append(ObjectInfo(prefix + entry.name, st.st_size, st.st_mtime, etag=_etag(st)))
                return DirListing(files, dirs, True)
        except (FileNotFoundError, NotADirectoryError):
            return DirListing([], [], not prefix)
        except OSError as e:
            if e.errno in _NOT_AN_OBJECT:
                return DirListing([], [], not prefix)
            raise self._err("list", prefix, e) from None

    def delete(self, key: str) -> None:
        parts = self._parts(key)
        try:
            with self._dir(parts[:-1]) as d:
                if key.endswith("/"):
                    os.rmdir(parts[-1], dir_fd=d)
                else:
                    os.unlink(parts[-1], dir_fd=d)  # a link there goes itself; its target stays
        except OSError as e:
            # Absent is fine; so is a non-empty directory (it holds other keys), "a" naming a
            # directory (there is no object "a"), and a link on the way (nothing of ours there).
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR,
                               errno.ELOOP):
                raise self._err("delete", key, e) from None

    def copy(self, src: str, dst: str) -> None:
        dst_parts = self._parts(dst)
        if src.endswith("/"):
            if self.head(src) is None:
                raise NotFound(f"local store {self.root}: no object {src!r}")
            self.put(dst, b"")
            return
        sfd, _ = self._open_object(src, "copy")
        try:
            self._publish_new(dst_parts, self._get_metadata(sfd), lambda fd: _copy_range(sfd, 0, fd, 0))
        except OSError as e:
            raise self._err("copy", f"{src} -> {dst}", e) from None
        finally:
            os.close(sfd)

    # -- multipart ---------------------------------------------------------------
    #
    # Each upload is a directory .ckptfs-tmp/uploads/<id>/ holding
    #   key, metadata.json  what create_multipart was given (``key`` also says the upload exists)
    #   data                the object to be: part n lies at (n - 1) * P, its slot
    #   index               64-byte records: record 0 holds P once known, record n where part n is
    #   <n>.lock            flocked while part n is written (0.lock while P is decided)
    #   <n>.part            a part that does not fit a slot: it came before P was known, or it is
    #                       bigger than P
    # A record is written (and fdatasynced) only after its bytes are synced, and wiped (and
    # synced) before they are overwritten, under the part's lock: a record never names bytes that
    # are not there, whatever the crash. Parts hold the index flocked shared; complete and abort
    # hold it exclusively, so they wait for parts being written. Like everything below the root,
    # the upload's files are reached through the descriptor of its directory, never a link.

    def _upload_dir(self, key: str, upload_id: str) -> int:
        """A descriptor of the upload's directory (the caller closes it); NotFound if it does not
        exist or is for another key."""
        missing = NotFound(f"local store {self.root}: no upload {upload_id!r} for {key!r}")
        if not _UPLOAD_ID.match(upload_id):
            raise missing
        try:
            d = self._open_dir((*UPLOADS, upload_id))
        except (FileNotFoundError, NotADirectoryError):
            raise missing from None
        except OSError as e:
            if e.errno in _NOT_AN_OBJECT:
                raise missing from None
            raise self._err("multipart", key, e) from None
        try:
            if _read_small(d, "key") == key.encode():
                return d
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            os.close(d)
            if e.errno in _NOT_AN_OBJECT:
                raise missing from None
            raise self._err("multipart", key, e) from None
        os.close(d)
        raise missing

    @contextlib.contextmanager
    def _locked_upload(self, key: str, upload_id: str, how: int) -> Iterator[tuple[int, int]]:
        """The upload's directory and its index (descriptors), the index flocked ``how``;
        NotFound if the upload is gone or went (completed, aborted) while we waited for the lock."""
        d = self._upload_dir(key, upload_id)
        try:
            try:
                index = os.open("index", os.O_RDWR | _NOFOLLOW, dir_fd=d)
            except FileNotFoundError:
                raise self._gone(key, upload_id) from None
            try:
                fcntl.flock(index, how)
                if os.fstat(index).st_nlink == 0:
                    raise self._gone(key, upload_id)
                yield d, index
            finally:
                os.close(index)
        finally:
            os.close(d)

    def _gone(self, key: str, upload_id: str) -> NotFound:
        return NotFound(f"local store {self.root}: upload {upload_id!r} for {key!r} is gone")

    def _drop_upload(self, upload_id: str) -> None:
        with contextlib.suppress(OSError), self._dir(UPLOADS) as uploads:
            with contextlib.suppress(OSError), _closing(_subdir(uploads, upload_id)) as d:
                os.unlink("key", dir_fd=d)  # out of list_multipart first
            shutil.rmtree(upload_id, dir_fd=uploads, ignore_errors=True)  # never follows a link
        self._slot_sizes.pop(upload_id, None)
        self._begun.pop(upload_id, None)

    def _slot_size(self, d: int, upload_id: str, index: int, number: int, length: int) -> int | None:
        """P, the size of every part but the last, or None while unknown. It is set, once, to the
        length of a part that must be a full one: part 1, or a part below another (begun here, or
        recorded). A part that may be the last, smaller one sets nothing: while P is unknown it
        goes to a file of its own, copied in place at completion. (Parts of other sizes are
        correct too, only slower: see complete_multipart.)"""
        size = self._slot_sizes.get(upload_id)
        if size is not None:
            return size
        with _flocked(d, "0.lock", fcntl.LOCK_EX, create=True):
            header = _unpack(_HEADER, os.pread(index, _RECORD, 0))
            if header is not None:
                size = header[1]
            else:
                lengths = {n: part.length for n, part in _read_parts(index).items()}
                with self._begun_lock:
                    lengths |= self._begun.get(upload_id, {})
                top = max(lengths, default=0)
                size = next((lengths[n] for n in sorted(lengths) if (n == 1 or n < top) and lengths[n]), None)
                if size is None:
                    return None
                _pwrite_all(index, _pack(_HEADER, size), 0)
                os.fdatasync(index)
        self._slot_sizes[upload_id] = size
        with self._begun_lock:
            self._begun.pop(upload_id, None)
        return size

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        self._parts(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex
        try:
            self._prepare()
            # Build the upload dir under a temp name, then rename: it appears whole, with its key.
            with self._dir((TMP_DIR,), create=True) as tmp_dir, \
                    _closing(_subdir(tmp_dir, "uploads", create=True)) as uploads:
                tmp = f"{upload_id}.upload"
                with _closing(_subdir(tmp_dir, tmp, create=True)) as u:
                    for name, content in (("key", key), ("metadata.json", json.dumps(metadata or {})),
                                          ("data", ""), ("index", "")):
                        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=u)
                        try:
                            if content:
                                _pwrite_all(fd, content.encode(), 0)
                                os.fdatasync(fd)
                        finally:
                            os.close(fd)
                    os.fsync(u)
                os.rename(tmp, upload_id, src_dir_fd=tmp_dir, dst_dir_fd=uploads)
                os.fsync(uploads)  # parts are durable once stored: so must their upload be
        except OSError as e:
            raise self._err("create_multipart", key, e) from None
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        if not 1 <= number <= MAX_PARTS:
            raise StoreError(f"local store {self.root}: part number {number} not in 1..{MAX_PARTS}",
                             errno_=errno.EINVAL)
        view = memoryview(data).cast("B")
        if upload_id not in self._slot_sizes:
            with self._begun_lock:  # before hashing: parts sent at once have all begun when P is decided
                self._begun.setdefault(upload_id, {})[number] = len(view)
        # The token names the part's content, so complete_multipart uses exactly the
        # bytes the caller uploaded (like an S3 ETag) and a stale token fails.
        token = xxhash.xxh3_64_hexdigest(view)
        try:
            with self._locked_upload(key, upload_id, fcntl.LOCK_SH) as (d, index), \
                    _flocked(d, f"{number}.lock", fcntl.LOCK_EX, create=True):
                size = self._slot_size(d, upload_id, index, number, len(view))
                in_slot = size is not None and len(view) <= size
                new = _Part(len(view), (number - 1) * size if in_slot else _OWN_FILE, token)
                old = _read_part(index, number)
                if old == new:
                    return PartInfo(number, token)  # these very bytes are there already (a retry)
                if old is not None:
                    _write_records(index, {number: None})  # a re-upload: no record over changing bytes
                own = f"{number}.part"
                fd = os.open("data", os.O_WRONLY | _NOFOLLOW, dir_fd=d) if in_slot else \
                    os.open(own, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644, dir_fd=d)
                try:
                    _pwrite_all(fd, view, new.offset if in_slot else 0)
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
                if not in_slot:
                    os.fsync(d)  # the file's name
                elif old is not None and old.offset == _OWN_FILE:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(own, dir_fd=d)
                _write_records(index, {number: new})
        except OSError as e:
            raise self._err("upload_part", key, e) from None
        return PartInfo(number, token)

    def complete_multipart(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        dest = self._parts(key)
        numbers = [p.number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError(f"local store {self.root}: complete {key!r}: parts must be non-empty and ascending",
                             errno_=errno.EINVAL)
        try:
            with self._locked_upload(key, upload_id, fcntl.LOCK_EX) as (d, index):
                recorded = _read_parts(index)
                chosen: list[tuple[int, _Part]] = []
                for p in parts:
                    part = recorded.get(p.number)
                    if part is None or part.token != p.token:
                        raise StoreError(f"local store {self.root}: complete {key!r}: part {p.number} "
                                         f"with token {p.token!r} was not uploaded", errno_=errno.EINVAL)
                    chosen.append((p.number, part))
                metadata = json.loads(_read_small(d, "metadata.json"))
                try:
                    fd = os.open("data", os.O_RDWR | _NOFOLLOW, dir_fd=d)
                except FileNotFoundError:  # published just before a crash: only the cleanup was left
                    raise self._gone(key, upload_id) from None
                try:
                    # Every part in a slot must already lie where the object needs it.
                    offset, in_place = 0, True
                    for _, part in chosen:
                        if part.offset not in (_OWN_FILE, offset) and part.length:
                            in_place = False
                        offset += part.length
                    if in_place:
                        self._complete_in_place(d, index, fd, chosen, recorded, offset, metadata, dest)
                    else:
                        log.debug("local store %s: parts of %r out of their slots: copying them", self.root, key)
                        self._complete_by_copy(d, fd, chosen, metadata, dest)
                finally:
                    os.close(fd)
                self._drop_upload(upload_id)
        except OSError as e:
            raise self._err("complete_multipart", key, e) from None

    def _copy_part(self, d: int, number: int, part: _Part, data: int, dst: int, dst_offset: int) -> None:
        """Copy a part (from its slot in ``data`` or its own file) to ``dst`` at ``dst_offset``."""
        own = part.offset == _OWN_FILE
        src = os.open(f"{number}.part", os.O_RDONLY | _NOFOLLOW, dir_fd=d) if own else data
        try:
            copied = _copy_range(src, 0 if own else part.offset, dst, dst_offset, part.length)
        finally:
            if own:
                os.close(src)
        if copied != part.length:
            raise OSError(errno.EIO, f"part {number} has {copied} bytes, not {part.length}")

    def _complete_in_place(self, d: int, index: int, data: int, chosen: list[tuple[int, _Part]],
                           recorded: dict[int, _Part], size: int, metadata: dict[str, str],
                           dest: Sequence[str]) -> None:
        """The data file becomes the object: copy in the parts kept in files of their own (at most
        a few: the last, or parts sent before P was known), cut it to size, rename it into place."""
        # Those copies and the truncation overwrite the slots of parts left out of the object:
        # wipe their records first, so a crash here leaves no record over changed bytes.
        chosen_numbers = {number for number, _ in chosen}
        _write_records(index, {n: None for n, part in recorded.items()
                               if n not in chosen_numbers and part.offset != _OWN_FILE})
        offset = 0
        for number, part in chosen:
            if part.offset == _OWN_FILE:
                self._copy_part(d, number, part, data, data, offset)
            offset += part.length
        os.ftruncate(data, size)
        self._set_metadata(data, metadata)
        self._publish(data, d, "data", dest)

    def _complete_by_copy(self, d: int, data: int, chosen: list[tuple[int, _Part]],
                          metadata: dict[str, str], dest: Sequence[str]) -> None:
        """Parts not in the simple layout (sizes that vary, numbers with gaps): concatenate them
        into a new file."""
        def concatenate(fd: int) -> None:
            offset = 0
            for number, part in chosen:
                self._copy_part(d, number, part, data, fd, offset)
                offset += part.length

        self._publish_new(dest, metadata, concatenate)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            d = self._upload_dir(key, upload_id)
        except NotFound:
            return
        try:
            with _flocked(d, "index", fcntl.LOCK_EX):  # waits for parts being written
                self._drop_upload(upload_id)
        except FileNotFoundError:
            self._drop_upload(upload_id)  # removed meanwhile, or an upload without an index
        except OSError as e:
            raise self._err("abort_multipart", key, e) from None
        finally:
            os.close(d)

    def list_multipart(self, prefix: str = "") -> list[tuple[str, str]]:
        try:
            uploads = self._open_dir(UPLOADS)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, *_NOT_AN_OBJECT):
                return []
            raise self._err("list_multipart", prefix, e) from None
        out = []
        try:
            with os.scandir(uploads) as entries:
                names = [entry.name for entry in entries if _UPLOAD_ID.match(entry.name)]
            for name in names:
                try:
                    with _closing(_subdir(uploads, name)) as d:
                        key = _read_small(d, "key").decode()
                except (OSError, UnicodeDecodeError):
                    continue  # being aborted or completed right now
                if key.startswith(prefix):
                    out.append((key, name))
        finally:
            os.close(uploads)
        return sorted(out)

