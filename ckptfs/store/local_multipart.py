"""The local store's multipart uploads: parts written once, in place, into the object to be.

A multipart upload is a directory ``.ckptfs-tmp/uploads/<id>/`` whose ``data`` file becomes the
object: each part is written once, in place, at ``(number - 1) * P`` (P: the size of every part
but the last), and ``complete_multipart`` truncates that file and renames it into place. The
comment at the top of ``LocalMultipart`` says how parts are laid out and locked, and what a
crash leaves.
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
import struct
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from ckptfs.blocks import zeros_xxh3
from ckptfs.errors import NotFound, StoreError
from ckptfs.store import localfs as fs
from ckptfs.store.base import PartInfo
from ckptfs.store.local_tree import NOT_AN_OBJECT, TMP_DIR, UPLOADS, LocalTree

log = logging.getLogger("ckptfs.store.local")

_UPLOAD_ID = re.compile(r"[0-9a-f]{32}\Z")

# Records of a multipart upload's ``index`` file (see LocalMultipart):
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
    body, crc = raw[: layout.size], raw[layout.size : layout.size + _CRC.size]
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


def _read_parts(index: int, max_parts: int) -> dict[int, _Part]:
    """Every part recorded in the index (numbers 1..max_parts): {number: part}."""
    raw = os.pread(index, (max_parts + 1) * _RECORD, 0)
    parts = {}
    for number in range(1, len(raw) // _RECORD):
        part = _parse_part(raw[number * _RECORD : (number + 1) * _RECORD], number)
        if part is not None:
            parts[number] = part
    return parts


def _write_records(index: int, records: dict[int, _Part | None]) -> None:
    """Write part records (None wipes one), then make them durable."""
    if not records:
        return
    for number, part in records.items():
        raw = (
            bytes(_RECORD)
            if part is None
            else _pack(_PART, number, part.length, part.offset, part.token.encode())
        )
        fs.pwrite_all(index, raw, number * _RECORD)
    os.fdatasync(index)


class LocalMultipart:
    """The local store's multipart uploads, in the directory of its ``tree`` (``LocalStore``'s
    multipart verbs call these), of at most ``max_parts`` parts."""

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

    def __init__(self, tree: LocalTree, max_parts: int):
        self.tree = tree
        self.max_parts = max_parts
        self._slot_sizes: dict[str, int] = {}  # upload id -> P, once known (it never changes)
        self._begun: dict[str, dict[int, int]] = {}  # upload id -> {number: length} of parts begun here
        self._begun_lock = threading.Lock()

    def _upload_dir(self, key: str, upload_id: str) -> int:
        """A descriptor of the upload's directory (the caller closes it); NotFound if it does not
        exist or is for another key."""
        missing = NotFound(f"local store {self.tree.root}: no upload {upload_id!r} for {key!r}")
        if not _UPLOAD_ID.match(upload_id):
            raise missing
        try:
            d = self.tree.open_dir((*UPLOADS, upload_id))
        except (FileNotFoundError, NotADirectoryError):
            raise missing from None
        except OSError as e:
            if e.errno in NOT_AN_OBJECT:
                raise missing from None
            raise self.tree.err("multipart", key, e) from None
        try:
            if fs.read_small(d, "key") == key.encode():
                return d
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            os.close(d)
            if e.errno in NOT_AN_OBJECT:
                raise missing from None
            raise self.tree.err("multipart", key, e) from None
        os.close(d)
        raise missing

    @contextlib.contextmanager
    def _locked_upload(self, key: str, upload_id: str, how: int) -> Iterator[tuple[int, int]]:
        """The upload's directory and its index (descriptors), the index flocked ``how``;
        NotFound if the upload is gone or went (completed, aborted) while we waited for the lock."""
        d = self._upload_dir(key, upload_id)
        try:
            try:
                index = os.open("index", os.O_RDWR | fs.NOFOLLOW, dir_fd=d)
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
        return NotFound(f"local store {self.tree.root}: upload {upload_id!r} for {key!r} is gone")

    def _drop_upload(self, upload_id: str) -> None:
        with contextlib.suppress(OSError), self.tree.directory(UPLOADS) as uploads:
            with contextlib.suppress(OSError), fs.closing(fs.subdir(uploads, upload_id)) as d:
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
        with fs.flocked(d, "0.lock", fcntl.LOCK_EX, create=True):
            header = _unpack(_HEADER, os.pread(index, _RECORD, 0))
            if header is not None:
                size = header[1]
            else:
                lengths = {n: part.length for n, part in _read_parts(index, self.max_parts).items()}
                with self._begun_lock:
                    lengths |= self._begun.get(upload_id, {})
                top = max(lengths, default=0)
                size = next((lengths[n] for n in sorted(lengths) if (n == 1 or n < top) and lengths[n]), None)
                if size is None:
                    return None
                fs.pwrite_all(index, _pack(_HEADER, size), 0)
                os.fdatasync(index)
        self._slot_sizes[upload_id] = size
        with self._begun_lock:
            self._begun.pop(upload_id, None)
        return size

    def create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        self.tree.parts(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex
        try:
            self.tree.prepare()
            # Build the upload dir under a temp name, then rename: it appears whole, with its key.
            with (
                self.tree.directory((TMP_DIR,), create=True) as tmp_dir,
                fs.closing(fs.subdir(tmp_dir, "uploads", create=True)) as uploads,
            ):
                tmp = f"{upload_id}.upload"
                with fs.closing(fs.subdir(tmp_dir, tmp, create=True)) as u:
                    for name, content in (
                        ("key", key),
                        ("metadata.json", json.dumps(metadata or {})),
                        ("data", ""),
                        ("index", ""),
                    ):
                        fd = os.open(
                            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | fs.NOFOLLOW, 0o644, dir_fd=u
                        )
                        try:
                            if content:
                                fs.pwrite_all(fd, content.encode(), 0)
                                os.fdatasync(fd)
                        finally:
                            os.close(fd)
                    os.fsync(u)
                os.rename(tmp, upload_id, src_dir_fd=tmp_dir, dst_dir_fd=uploads)
                os.fsync(uploads)  # parts are durable once stored: so must their upload be
        except OSError as e:
            raise self.tree.err("create_multipart", key, e) from None
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> PartInfo:
        view = memoryview(data).cast("B")
        # The token names the part's content, so complete_multipart uses exactly the
        # bytes the caller uploaded (like an S3 ETag) and a stale token fails.
        return self._store_part(
            key,
            upload_id,
            number,
            len(view),
            lambda: xxhash.xxh3_64_hexdigest(view),
            lambda fd, offset: fs.pwrite_all(fd, view, offset),
        )

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        """A hole: the part's bytes are punched out of the file, never written (a sparse object)."""
        return self._store_part(
            key,
            upload_id,
            number,
            length,
            lambda: zeros_xxh3(length),
            lambda fd, offset: fs.zero_range(fd, offset, length),
        )

    def _store_part(self, key: str, upload_id: str, number: int, length: int, token_of, write) -> PartInfo:
        """Part ``number`` of ``length`` bytes: ``token_of()`` names its content, ``write(fd,
        offset)`` puts its bytes (into ``data`` at its slot, or into a file of its own)."""
        if not 1 <= number <= self.max_parts:
            raise StoreError(
                f"local store {self.tree.root}: part number {number} not in 1..{self.max_parts}",
                errno_=errno.EINVAL,
            )
        if upload_id not in self._slot_sizes:
            with self._begun_lock:  # before hashing: parts sent at once have all begun when P is decided
                self._begun.setdefault(upload_id, {})[number] = length
        token = token_of()
        try:
            with (
                self._locked_upload(key, upload_id, fcntl.LOCK_SH) as (d, index),
                fs.flocked(d, f"{number}.lock", fcntl.LOCK_EX, create=True),
            ):
                size = self._slot_size(d, upload_id, index, number, length)
                in_slot = size is not None and length <= size
                new = _Part(length, (number - 1) * size if size is not None and in_slot else _OWN_FILE, token)
                old = _read_part(index, number)
                if old == new:
                    return PartInfo(number, token)  # these very bytes are there already (a retry)
                if old is not None:
                    _write_records(index, {number: None})  # a re-upload: no record over changing bytes
                own = f"{number}.part"
                fd = (
                    os.open("data", os.O_WRONLY | fs.NOFOLLOW, dir_fd=d)
                    if in_slot
                    else os.open(own, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | fs.NOFOLLOW, 0o644, dir_fd=d)
                )
                try:
                    if not in_slot:
                        os.ftruncate(fd, length)  # (a hole punched past the end would not count)
                    write(fd, new.offset if in_slot else 0)
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
            raise self.tree.err("upload_part", key, e) from None
        return PartInfo(number, token)

    def complete(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        dest = self.tree.parts(key)
        numbers = [p.number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError(
                f"local store {self.tree.root}: complete {key!r}: parts must be non-empty and ascending",
                errno_=errno.EINVAL,
            )
        try:
            with self._locked_upload(key, upload_id, fcntl.LOCK_EX) as (d, index):
                recorded = _read_parts(index, self.max_parts)
                chosen: list[tuple[int, _Part]] = []
                for p in parts:
                    part = recorded.get(p.number)
                    if part is None or part.token != p.token:
                        raise StoreError(
                            f"local store {self.tree.root}: complete {key!r}: part {p.number} "
                            f"with token {p.token!r} was not uploaded",
                            errno_=errno.EINVAL,
                        )
                    chosen.append((p.number, part))
                metadata = json.loads(fs.read_small(d, "metadata.json"))
                try:
                    fd = os.open("data", os.O_RDWR | fs.NOFOLLOW, dir_fd=d)
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
                        log.debug(
                            "local store %s: parts of %r out of their slots: copying them",
                            self.tree.root,
                            key,
                        )
                        self._complete_by_copy(d, fd, chosen, metadata, dest)
                finally:
                    os.close(fd)
                self._drop_upload(upload_id)
        except OSError as e:
            raise self.tree.err("complete_multipart", key, e) from None

    def _copy_part(self, d: int, number: int, part: _Part, data: int, dst: int, dst_offset: int) -> None:
        """Copy a part (from its slot in ``data`` or its own file) to ``dst`` at ``dst_offset``."""
        own = part.offset == _OWN_FILE
        src = os.open(f"{number}.part", os.O_RDONLY | fs.NOFOLLOW, dir_fd=d) if own else data
        try:
            copied = fs.copy_range(src, 0 if own else part.offset, dst, dst_offset, part.length)
        finally:
            if own:
                os.close(src)
        if copied != part.length:
            raise OSError(errno.EIO, f"part {number} has {copied} bytes, not {part.length}")

    def _complete_in_place(
        self,
        d: int,
        index: int,
        data: int,
        chosen: list[tuple[int, _Part]],
        recorded: dict[int, _Part],
        size: int,
        metadata: dict[str, str],
        dest: Sequence[str],
    ) -> None:
        """The data file becomes the object: copy in the parts kept in files of their own (at most
        a few: the last, or parts sent before P was known), cut it to size, rename it into place."""
        # Those copies and the truncation overwrite the slots of parts left out of the object:
        # wipe their records first, so a crash here leaves no record over changed bytes.
        chosen_numbers = {number for number, _ in chosen}
        _write_records(
            index,
            {n: None for n, part in recorded.items() if n not in chosen_numbers and part.offset != _OWN_FILE},
        )
        offset = 0
        for number, part in chosen:
            if part.offset == _OWN_FILE:
                self._copy_part(d, number, part, data, data, offset)
            offset += part.length
        os.ftruncate(data, size)
        self.tree.write_metadata(data, metadata)
        self.tree.publish(data, d, "data", dest)

    def _complete_by_copy(
        self,
        d: int,
        data: int,
        chosen: list[tuple[int, _Part]],
        metadata: dict[str, str],
        dest: Sequence[str],
    ) -> None:
        """Parts not in the simple layout (sizes that vary, numbers with gaps): concatenate them
        into a new file."""

        def concatenate(fd: int) -> None:
            offset = 0
            for number, part in chosen:
                self._copy_part(d, number, part, data, fd, offset)
                offset += part.length

        self.tree.publish_new(dest, metadata, concatenate)

    def abort(self, key: str, upload_id: str) -> None:
        try:
            d = self._upload_dir(key, upload_id)
        except NotFound:
            return
        try:
            with fs.flocked(d, "index", fcntl.LOCK_EX):  # waits for parts being written
                self._drop_upload(upload_id)
        except FileNotFoundError:
            self._drop_upload(upload_id)  # removed meanwhile, or an upload without an index
        except OSError as e:
            raise self.tree.err("abort_multipart", key, e) from None
        finally:
            os.close(d)

    def unfinished(self, prefix: str = "") -> list[tuple[str, str]]:
        try:
            uploads = self.tree.open_dir(UPLOADS)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, *NOT_AN_OBJECT):
                return []
            raise self.tree.err("list_multipart", prefix, e) from None
        out = []
        try:
            with os.scandir(uploads) as entries:
                names = [entry.name for entry in entries if _UPLOAD_ID.match(entry.name)]
            for name in names:
                try:
                    with fs.closing(fs.subdir(uploads, name)) as d:
                        key = fs.read_small(d, "key").decode()
                except (OSError, UnicodeDecodeError):
                    continue  # being aborted or completed right now
                if key.startswith(prefix):
                    out.append((key, name))
        finally:
            os.close(uploads)
        return sorted(out)
