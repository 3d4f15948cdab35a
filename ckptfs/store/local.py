"""The local store: a plain directory (local disk, NFS, Lustre) holds one file per key.

Objects appear only whole: every write goes to a temp file under ``ROOT/.ckptfs-tmp/``
(same filesystem, so the final ``os.replace`` is atomic), is fsynced, then renamed into
place and its directory fsynced. A key ending in ``/`` is a directory. User metadata
lives in ``user.ckptfs.<name>`` xattrs. Multipart uploads are directories under
``.ckptfs-tmp/uploads/<id>/`` that ``complete_multipart`` concatenates.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
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
XATTR_PREFIX = "user.ckptfs."
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}\Z")
_NO_XATTR = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
# Errors where trying again later may succeed (space freed, NFS server back).
_TRANSIENT = {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EINTR,
              errno.ETIMEDOUT, errno.ESTALE, errno.EBUSY}
_COPY_CHUNK = 64 << 20


def _storable_entries(path: Path, top: bool) -> list[tuple[os.DirEntry, bool]]:
    """The entries of a directory that are objects or prefixes: (entry, is_dir). Skips our own
    temp dir at the top, names that are not UTF-8 (S3 keys are), sockets, fifos, broken links."""
    out = []
    for entry in os.scandir(path):
        if top and entry.name == TMP_DIR:
            continue
        try:
            entry.name.encode()
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir or entry.is_file():
                out.append((entry, is_dir))
        except (UnicodeEncodeError, OSError):
            continue
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_fd(src: int, dst: int, dst_offset: int) -> int:
    """Append all of ``src`` (from offset 0) to ``dst`` at ``dst_offset``; returns bytes copied.
    copy_file_range lets the kernel (or an NFS/Lustre server) copy without user space."""
    copied = 0
    try:
        while n := os.copy_file_range(src, dst, _COPY_CHUNK, copied, dst_offset + copied):
            copied += n
        return copied
    except OSError as e:
        # Not supported on this filesystem pair: fall back to read/write below.
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    while data := os.pread(src, _COPY_CHUNK, copied):
        view = memoryview(data)
        while view:
            n = os.pwrite(dst, view, dst_offset + copied)
            copied += n
            view = view[n:]
    return copied


def _etag(st: os.stat_result) -> str:
    """Which file holds the object: every write publishes a new file (a new inode), and a
    filesystem's clock may not tell two writes in one tick apart."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}"


class LocalStore(ObjectStore):
    def __init__(self, root: Path | str):
        self.root = Path(os.path.abspath(root))
        self.url = self.root.as_uri()
        self._tmp = self.root / TMP_DIR
        self._uploads = self._tmp / "uploads"
        self._xattrs = True  # cleared the first time the filesystem refuses them
        self._ready = False

    # -- helpers ---------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """The path for ``key``; ValueError for keys that would escape the root."""
        if not key or key.startswith("/") or "\0" in key:
            raise ValueError(f"invalid store key {key!r}")
        parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid store key {key!r}: empty, '.' or '..' component")
        if parts[0] == TMP_DIR:
            raise ValueError(f"invalid store key {key!r}: {TMP_DIR} is reserved")
        return self.root.joinpath(*parts)

    def _err(self, op: str, key: str, e: OSError) -> StoreError:
        code = e.errno or errno.EIO
        return StoreError(f"local store {self.root}: {op} {key!r}: {e.strerror or e}",
                          transient=code in _TRANSIENT, errno_=code)

    def _prepare(self) -> None:
        if not self._ready:
            self._uploads.mkdir(parents=True, exist_ok=True)
            self._ready = True

    def _tmpfile(self) -> tuple[int, Path]:
        self._prepare()
        path = self._tmp / f"{uuid.uuid4().hex}.tmp"
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), path

    def _makedirs(self, path: Path) -> None:
        """mkdir -p that fsyncs each parent it changes, so new dirs survive a crash."""
        if path == self.root or path.is_dir():
            return
        self._makedirs(path.parent)
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(path)) from None
            return
        _fsync_dir(path.parent)

    def _publish(self, fd: int, tmp: Path, dest: Path) -> None:
        """fsync the temp file, rename it over ``dest`` and make the rename durable."""
        os.fsync(fd)
        self._makedirs(dest.parent)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)

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

    def _get_metadata(self, path: Path | int) -> dict[str, str]:
        if not self._xattrs:
            return {}
        try:
            names = [n for n in os.listxattr(path) if n.startswith(XATTR_PREFIX)]
            return {n[len(XATTR_PREFIX):]: os.getxattr(path, n).decode() for n in names}
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
            fd, tmp = self._tmpfile()
            os.close(fd)
            tmp.unlink()
        except OSError as e:
            raise StoreError(f"local store {self.root} is not writable: {e.strerror}", errno_=e.errno or errno.EIO) from None

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
        dest = self._path(key)
        try:
            if key.endswith("/"):
                self._makedirs(dest)
                return
            fd, tmp = self._tmpfile()
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                self._set_metadata(fd, metadata)
                self._publish(fd, tmp, dest)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        except OSError as e:
            raise self._err("put", key, e) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        if key.endswith("/"):
            if path.is_dir():
                return b""
            raise NotFound(f"local store {self.root}: no object {key!r}")
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"local store {self.root}: no object {key!r}") from None
        except OSError as e:
            raise self._err("get", key, e) from None
        try:
            chunks = []
            while length > 0:
                chunk = os.pread(fd, length, start)
                if not chunk:
                    break  # end of file: a short read is fine
                chunks.append(chunk)
                start += len(chunk)
                length -= len(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except IsADirectoryError:
            raise NotFound(f"local store {self.root}: no object {key!r} (a directory)") from None
        except OSError as e:
            raise self._err("get", key, e) from None
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = os.stat(path)
            is_dir = os.path.isdir(path)
            if is_dir != key.endswith("/"):
                return None  # "a" and "a/" are different keys, as on S3
            if is_dir:
                return ObjectInfo(key, 0, st.st_mtime)
            return ObjectInfo(key, st.st_size, st.st_mtime, self._get_metadata(path), _etag(st))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._err("head", key, e) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the deepest directory the prefix fully names.
        base = prefix.rpartition("/")[0]
        start = self._path(base + "/") if base else self.root
        rel = base + "/" if base else ""
        try:
            if rel and prefix == rel:  # the prefix names a directory: its marker comes first
                try:
                    st = os.stat(start)
                except (FileNotFoundError, NotADirectoryError):
                    return
                yield ObjectInfo(rel, 0, st.st_mtime)
            yield from self._walk(start, rel, prefix)
        except OSError as e:
            raise self._err("list", prefix, e) from None

    def _walk(self, path: Path, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        """Yield the keys under ``path`` in S3 order (UTF-8 byte order of the whole key)."""
        try:
            entries = _storable_entries(path, top=not rel)
        except (FileNotFoundError, NotADirectoryError):
            return
        items = []
        for entry, is_dir in entries:
            key = rel + entry.name + ("/" if is_dir else "")
            if key.startswith(prefix):
                items.append((key.encode(), key, is_dir, entry))
        items.sort()
        for _, key, is_dir, entry in items:
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed while we walked
            yield ObjectInfo(key, 0 if is_dir else st.st_size, st.st_mtime, etag="" if is_dir else _etag(st))
            if is_dir:
                yield from self._walk(Path(entry.path), key, prefix)

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir needs a directory prefix, not {prefix!r}")
        path = self._path(prefix) if prefix else self.root
        try:
            entries = _storable_entries(path, top=not prefix)
        except (FileNotFoundError, NotADirectoryError):
            return DirListing([], [], not prefix)
        except OSError as e:
            raise self._err("list", prefix, e) from None
        items = []
        for entry, is_dir in entries:
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
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed while we listed
            except OSError as e:
                raise self._err("list", prefix + entry.name, e) from None
            files.append(ObjectInfo(prefix + entry.name, st.st_size, st.st_mtime, etag=_etag(st)))
        return DirListing(files, dirs, True)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            if key.endswith("/"):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError as e:
            # Absent is fine; so is a non-empty directory (it holds other keys), and
            # "a" naming a directory (there is no object "a").
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
                raise self._err("delete", key, e) from None

    def copy(self, src: str, dst: str) -> None:
        src_path, dst_path = self._path(src), self._path(dst)
        if src.endswith("/"):
            if not src_path.is_dir():
                raise NotFound(f"local store {self.root}: no object {src!r}")
            self.put(dst, b"")
            return
        try:
            sfd = os.open(src_path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"local store {self.root}: no object {src!r}") from None
        except OSError as e:
            raise self._err("copy", src, e) from None
        try:
            if os.path.isdir(src_path):
                raise NotFound(f"local store {self.root}: no object {src!r} (a directory)")
            fd, tmp = self._tmpfile()
            try:
                _copy_fd(sfd, fd, 0)
                self._set_metadata(fd, self._get_metadata(sfd))
                self._publish(fd, tmp, dst_path)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        except OSError as e:
            raise self._err("copy", f"{src} -> {dst}", e) from None
        finally:
            os.close(sfd)

    # -- multipart ---------------------------------------------------------------

    def _upload_dir(self, key: str, upload_id: str) -> Path:
        """The upload's directory; NotFound if it does not exist or is for another key."""
        d = self._uploads / upload_id
        try:
            if _UPLOAD_ID.match(upload_id) and (d / "key").read_text() == key:
                return d
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise self._err("multipart", key, e) from None
        raise NotFound(f"local store {self.root}: no upload {upload_id!r} for {key!r}")

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        self._path(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex
        try:
            self._prepare()
            # Build the upload dir under a temp name, then rename: it appears with its key.
            tmp = self._tmp / f"{upload_id}.upload"
            tmp.mkdir()
            (tmp / "key").write_text(key)
            (tmp / "metadata.json").write_text(json.dumps(metadata or {}))
            os.rename(tmp, self._uploads / upload_id)
        except OSError as e:
            raise self._err("create_multipart", key, e) from None
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        if not 1 <= number <= MAX_PARTS:
            raise StoreError(f"local store {self.root}: part number {number} not in 1..{MAX_PARTS}",
                             errno_=errno.EINVAL)
        d = self._upload_dir(key, upload_id)
        # The token names the part's content, so complete_multipart uses exactly the
        # bytes the caller uploaded (like an S3 ETag) and a stale token fails.
        token = xxhash.xxh3_64_hexdigest(data)
        name = f"{number:05d}-{token}"
        try:
            tmp = d / f"{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, d / name)
            for old in d.glob(f"{number:05d}-*"):
                if old.name != name:
                    old.unlink(missing_ok=True)  # a re-upload replaces the part
        except FileNotFoundError:
            raise NotFound(f"local store {self.root}: upload {upload_id!r} for {key!r} is gone") from None
        except OSError as e:
            raise self._err("upload_part", key, e) from None
        return PartInfo(number, token)

    def complete_multipart(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        dest = self._path(key)
        d = self._upload_dir(key, upload_id)
        numbers = [p.number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError(f"local store {self.root}: complete {key!r}: parts must be non-empty and ascending",
                             errno_=errno.EINVAL)
        try:
            metadata = json.loads((d / "metadata.json").read_text())
            fd, tmp = self._tmpfile()
            try:
                offset = 0
                for p in parts:
                    try:
                        pfd = os.open(d / f"{p.number:05d}-{p.token}", os.O_RDONLY)
                    except FileNotFoundError:
                        raise StoreError(f"local store {self.root}: complete {key!r}: part {p.number} "
                                         f"with token {p.token!r} was not uploaded", errno_=errno.EINVAL) from None
                    try:
                        offset += _copy_fd(pfd, fd, offset)
                    finally:
                        os.close(pfd)
                self._set_metadata(fd, metadata)
                self._publish(fd, tmp, dest)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            shutil.rmtree(d, ignore_errors=True)
        except OSError as e:
            raise self._err("complete_multipart", key, e) from None

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            d = self._upload_dir(key, upload_id)
        except NotFound:
            return
        shutil.rmtree(d, ignore_errors=True)

    def list_multipart(self, prefix: str = "") -> list[tuple[str, str]]:
        out = []
        try:
            entries = list(os.scandir(self._uploads))
        except FileNotFoundError:
            return []
        for entry in entries:
            try:
                key = Path(entry.path, "key").read_text()
            except OSError:
                continue  # being aborted or completed right now
            if key.startswith(prefix):
                out.append((key, entry.name))
        return sorted(out)
