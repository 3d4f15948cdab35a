"""Requests in and replies out, as bytes: the pure half of the transport (no system calls).

``Request`` reads the header of a request in a reader's buffer; ``Args`` cuts the input that
follows into the pieces each opcode carries. ``reply``/``error``/``entry_out``... build the
iovecs of an answer.
"""

from __future__ import annotations

import errno
import math
import stat
from dataclasses import dataclass

from ckptfs.fusewire import abi
from ckptfs.fusewire.face import EntryAttributes, StatvfsData


class ProtocolError(Exception):
    pass


@dataclass(slots=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: memoryview  # the input after the header (views the reader's buffer)

    @classmethod
    def parse(cls, view: memoryview) -> Request:
        if len(view) < abi.IN_HEADER.size:
            raise ProtocolError(f"a request of {len(view)} bytes")
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.IN_HEADER.unpack_from(view)
        if length != len(view):
            raise ProtocolError(f"request length {length} but {len(view)} bytes read")
        # (extensions are only sent for features we never ask for: they end the body)
        end = length - extlen * 8
        return cls(opcode, unique, nodeid, uid, gid, pid, view[abi.IN_HEADER.size : end])


def split_names(body: memoryview, count: int) -> list[bytes]:
    """The ``count`` NUL-terminated names that make up ``body``."""
    raw = bytes(body)
    parts = raw.split(b"\0")
    if len(parts) < count + 1:
        raise ProtocolError("a name without its terminating NUL")
    return parts[:count]


def reply(unique: int, *pieces) -> list:
    length = abi.OUT_HEADER.size + sum(len(p) for p in pieces)
    return [abi.OUT_HEADER.pack(length, 0, unique), *pieces]


def error(unique: int, number: int) -> list:
    if not 0 < number < 512:  # the kernel refuses anything else
        number = errno.EIO
    return [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -number, unique)]


def notification(code: int, *pieces) -> list:
    length = abi.OUT_HEADER.size + sum(len(p) for p in pieces)
    return [abi.OUT_HEADER.pack(length, code, 0), *pieces]


def _split_time(seconds: float) -> tuple[int, int]:
    if seconds <= 0:
        return 0, 0
    if seconds >= 1 << 62:
        return 1 << 62, 0
    frac, whole = math.modf(seconds)
    return int(whole), int(frac * 1e9)


def attr(a: EntryAttributes) -> bytes:
    at, mt, ct = a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns
    return abi.ATTR.pack(
        a.st_ino,
        a.st_size,
        a.st_blocks,
        at // 1_000_000_000,
        mt // 1_000_000_000,
        ct // 1_000_000_000,
        at % 1_000_000_000,
        mt % 1_000_000_000,
        ct % 1_000_000_000,
        a.st_mode,
        a.st_nlink,
        a.st_uid,
        a.st_gid,
        a.st_rdev,
        a.st_blksize,
        0,
    )


def entry_out(a: EntryAttributes) -> bytes:
    entry_s, entry_ns = _split_time(a.entry_timeout)
    attr_s, attr_ns = _split_time(a.attr_timeout)
    nodeid = (a.nodeid or a.st_ino) if a.st_ino else 0
    return abi.ENTRY_OUT_HEAD.pack(nodeid, a.generation, entry_s, attr_s, entry_ns, attr_ns) + attr(a)


def attr_out(a: EntryAttributes) -> bytes:
    attr_s, attr_ns = _split_time(a.attr_timeout)
    return abi.ATTR_OUT_HEAD.pack(attr_s, attr_ns, 0) + attr(a)


def statfs_out(s: StatvfsData) -> bytes:
    return abi.KSTATFS.pack(
        s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax, s.f_frsize
    )


def dirent(name: bytes, a: EntryAttributes, next_offset: int, plus: bool) -> bytes:
    """One READDIR(PLUS) entry, padded to 8 bytes."""
    head = abi.DIRENT_HEAD.pack(a.st_ino, next_offset, len(name), stat.S_IFMT(a.st_mode) >> 12)
    body = head + name + b"\0" * (-(len(head) + len(name)) % 8)
    return entry_out(a) + body if plus else body
