"""The FUSE transport (ckptfs/fusewire) without a mount: the kernel ABI pinned against
``fuse_kernel.h``, request bytes built by hand and parsed, replies decoded, the INIT handshake,
interrupts, forgets, passthrough backing files and notifications against small fake devices, and
``Session._handle`` driven on trio with a tiny filesystem. (Real mounts:
tests/test_fusewire_mounts.py.)

The layouts and numbers below are written from the kernel's header (include/uapi/linux/fuse.h,
protocol 7.45), not read from ckptfs/fusewire/abi.py: a field moved or resized there fails here.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import struct
import threading
import time

import pytest
import trio
import trio.testing

from ckptfs.fusewire import abi, device, session, wire
from ckptfs.fusewire.device import Disconnected
from ckptfs.fusewire.face import (
    EntryAttributes,
    FileInfo,
    Filesystem,
    FuseError,
    SetattrFields,
    StatvfsData,
)
from ckptfs.fusewire.mount import MountFailed
from ckptfs.fusewire.session import (
    PARKED_INTERRUPTS,
    WANTED,
    BackingFiles,
    Conn,
    Flight,
    InFlight,
    Notifier,
    Session,
)
from ckptfs.fusewire.wire import ProtocolError, Request
from tests.support.harness import trio_test

pytestmark = pytest.mark.unit

GUARD_S = 30  # hang guard of the trio tests: nothing here waits on it otherwise

# =============================================================================================
# The ABI: sizes, numbers and ioctls as fuse_kernel.h has them
# =============================================================================================

# struct name in fuse_kernel.h -> (the abi.py layout, its size there)
KERNEL_SIZES = {
    "fuse_in_header": (abi.IN_HEADER, 40),
    "fuse_out_header": (abi.OUT_HEADER, 16),
    "fuse_init_in (up to flags)": (abi.INIT_IN, 16),
    "fuse_init_in.flags2": (abi.INIT_IN_FLAGS2, 4),
    "fuse_init_out": (abi.INIT_OUT, 64),
    "fuse_attr": (abi.ATTR, 88),
    "fuse_entry_out (before its attr)": (abi.ENTRY_OUT_HEAD, 40),
    "fuse_attr_out (before its attr)": (abi.ATTR_OUT_HEAD, 16),
    "fuse_getattr_in": (abi.GETATTR_IN, 16),
    "fuse_setattr_in": (abi.SETATTR_IN, 88),
    "fuse_forget_in": (abi.FORGET_IN, 8),
    "fuse_batch_forget_in": (abi.BATCH_FORGET_IN, 8),
    "fuse_forget_one": (abi.FORGET_ONE, 16),
    "fuse_mknod_in": (abi.MKNOD_IN, 16),
    "fuse_mkdir_in": (abi.MKDIR_IN, 8),
    "fuse_rename_in": (abi.RENAME_IN, 8),
    "fuse_rename2_in": (abi.RENAME2_IN, 16),
    "fuse_link_in": (abi.LINK_IN, 8),
    "fuse_open_in": (abi.OPEN_IN, 8),
    "fuse_open_out": (abi.OPEN_OUT, 16),
    "fuse_create_in": (abi.CREATE_IN, 16),
    "fuse_release_in": (abi.RELEASE_IN, 24),
    "fuse_flush_in": (abi.FLUSH_IN, 24),
    "fuse_read_in": (abi.READ_IN, 40),
    "fuse_write_in": (abi.WRITE_IN, 40),
    "fuse_write_out": (abi.WRITE_OUT, 8),
    "fuse_fsync_in": (abi.FSYNC_IN, 16),
    "fuse_kstatfs": (abi.KSTATFS, 80),
    "fuse_getxattr_in": (abi.GETXATTR_IN, 8),
    "fuse_getxattr_out": (abi.GETXATTR_OUT, 8),
    "fuse_setxattr_in (FUSE_COMPAT_SETXATTR_IN_SIZE)": (abi.SETXATTR_IN, 8),
    "fuse_interrupt_in": (abi.INTERRUPT_IN, 8),
    "fuse_dirent (before its name)": (abi.DIRENT_HEAD, 24),
    "fuse_notify_inval_inode_out": (abi.NOTIFY_INVAL_INODE_OUT, 24),
    "fuse_notify_inval_entry_out": (abi.NOTIFY_INVAL_ENTRY_OUT, 16),
    "fuse_notify_store_out": (abi.NOTIFY_STORE_OUT, 24),
    "fuse_backing_map": (abi.BACKING_MAP, 16),
}


@pytest.mark.parametrize("name", sorted(KERNEL_SIZES))
def test_struct_sizes_match_the_kernel_header(name):
    layout, size = KERNEL_SIZES[name]
    assert layout.size == size, f"{name}: {layout.size} bytes, the kernel's has {size}"


def test_derived_sizes():
    assert abi.ENTRY_OUT_SIZE == 128  # sizeof(struct fuse_entry_out)
    assert abi.ATTR_OUT_HEAD.size + abi.ATTR.size == 104  # sizeof(struct fuse_attr_out)
    # FUSE_MIN_READ_BUFFER: the kernel refuses a read of /dev/fuse into a smaller buffer
    assert Conn(45, 0, 4096, False).buffer_size >= 8192


def test_opcodes_match_the_kernel_header():
    kernel = {
        "LOOKUP": 1,
        "FORGET": 2,
        "GETATTR": 3,
        "SETATTR": 4,
        "READLINK": 5,
        "SYMLINK": 6,
        "MKNOD": 8,
        "MKDIR": 9,
        "UNLINK": 10,
        "RMDIR": 11,
        "RENAME": 12,
        "LINK": 13,
        "OPEN": 14,
        "READ": 15,
        "WRITE": 16,
        "STATFS": 17,
        "RELEASE": 18,
        "FSYNC": 20,
        "SETXATTR": 21,
        "GETXATTR": 22,
        "LISTXATTR": 23,
        "REMOVEXATTR": 24,
        "FLUSH": 25,
        "INIT": 26,
        "OPENDIR": 27,
        "READDIR": 28,
        "RELEASEDIR": 29,
        "FSYNCDIR": 30,
        "ACCESS": 34,
        "CREATE": 35,
        "INTERRUPT": 36,
        "DESTROY": 38,
        "BATCH_FORGET": 42,
        "READDIRPLUS": 44,
        "RENAME2": 45,
    }
    assert {name: getattr(abi, name) for name in kernel} == kernel


def test_flags_match_the_kernel_header():
    kernel = {
        # FUSE_* init flags (64 bits; the high half travels in flags2)
        "ASYNC_READ": 1 << 0,
        "ATOMIC_O_TRUNC": 1 << 3,
        "BIG_WRITES": 1 << 5,
        "AUTO_INVAL_DATA": 1 << 12,
        "DO_READDIRPLUS": 1 << 13,
        "ASYNC_DIO": 1 << 15,
        "WRITEBACK_CACHE": 1 << 16,
        "PARALLEL_DIROPS": 1 << 18,
        "MAX_PAGES": 1 << 22,
        "INIT_EXT": 1 << 30,
        "PASSTHROUGH": 1 << 37,
        # FOPEN_*
        "FOPEN_DIRECT_IO": 1 << 0,
        "FOPEN_KEEP_CACHE": 1 << 1,
        "FOPEN_PASSTHROUGH": 1 << 7,
        # FATTR_*
        "FATTR_MODE": 1 << 0,
        "FATTR_UID": 1 << 1,
        "FATTR_GID": 1 << 2,
        "FATTR_SIZE": 1 << 3,
        "FATTR_ATIME": 1 << 4,
        "FATTR_MTIME": 1 << 5,
        "FATTR_FH": 1 << 6,
        "FATTR_ATIME_NOW": 1 << 7,
        "FATTR_MTIME_NOW": 1 << 8,
        "FSYNC_FDATASYNC": 1 << 0,
        # enum fuse_notify_code
        "NOTIFY_INVAL_INODE": 2,
        "NOTIFY_INVAL_ENTRY": 3,
        "NOTIFY_STORE": 4,
    }
    assert {name: getattr(abi, name) for name in kernel} == kernel
    assert abi.ROOT_ID == 1  # FUSE_ROOT_ID


def _ioc(direction: int, kind: int, number: int, size: int) -> int:
    """Linux's _IOC (asm-generic/ioctl.h): nr 8 bits, type 8 bits, size 14 bits, dir 2 bits."""
    return direction << 30 | size << 16 | kind << 8 | number


IOC_WRITE, IOC_READ = 1, 2
FUSE_DEV_IOC_MAGIC = 229


def test_ioctl_numbers_from_first_principles():
    uint32 = struct.calcsize("<I")
    backing_map = struct.calcsize("<iIQ")  # fd, flags, padding
    assert abi.DEV_IOC_CLONE == _ioc(IOC_READ, FUSE_DEV_IOC_MAGIC, 0, uint32)  # _IOR(229, 0, uint32_t)
    assert abi.DEV_IOC_BACKING_OPEN == _ioc(IOC_WRITE, FUSE_DEV_IOC_MAGIC, 1, backing_map)
    assert abi.DEV_IOC_BACKING_CLOSE == _ioc(IOC_WRITE, FUSE_DEV_IOC_MAGIC, 2, uint32)


# =============================================================================================
# Requests in, replies out (wire.py): bytes built by hand
# =============================================================================================


def request_bytes(
    opcode: int, body: bytes = b"", unique: int = 77, nodeid: int = 5, extension: bytes = b""
) -> bytearray:
    """A request as the kernel writes it: struct fuse_in_header, the input, then extensions."""
    assert len(extension) % 8 == 0
    length = 40 + len(body) + len(extension)
    header = struct.pack(
        "<IIQQIIIHH", length, opcode, unique, nodeid, 1001, 1002, 4242, len(extension) // 8, 0
    )
    return bytearray(header + body + extension)


def make_request(opcode: int, body: bytes = b"", **kwargs) -> Request:
    return Request.parse(memoryview(request_bytes(opcode, body, **kwargs)))


def read_in(fh: int, offset: int, size: int) -> bytes:
    """struct fuse_read_in (also fuse_write_in's layout): fh, offset, size, read_flags, lock_owner, flags, padding."""
    return struct.pack("<QQIIQII", fh, offset, size, 0, 0xABCDEF, os.O_RDONLY, 0)


def decode(iov) -> tuple[int, int, bytes]:
    """A reply's (-errno or 0, unique, payload); its length field checked against its bytes."""
    data = b"".join(bytes(piece) for piece in iov)
    length, error, unique = struct.unpack_from("<IiQ", data)
    assert length == len(data), f"the header says {length} bytes, the reply has {len(data)}"
    return error, unique, data[16:]


def test_parse_a_lookup():
    req = make_request(abi.LOOKUP, b"model.pt\0", unique=0x1122334455, nodeid=9)
    assert (req.opcode, req.unique, req.nodeid) == (abi.LOOKUP, 0x1122334455, 9)
    assert (req.uid, req.gid, req.pid) == (1001, 1002, 4242)
    assert bytes(req.body) == b"model.pt\0"
    assert wire.split_names(req.body, 1) == [b"model.pt"]


def test_parse_a_write_keeps_its_payload_in_the_buffer():
    payload = bytes(range(256)) * 16
    buf = request_bytes(abi.WRITE, struct.pack("<QQIIQII", 3, 8192, len(payload), 0, 0, 0, 0) + payload)
    req = Request.parse(memoryview(buf))
    fh, offset, size = abi.WRITE_IN.unpack_from(req.body)[:3]
    assert (fh, offset, size) == (3, 8192, len(payload))
    assert bytes(req.body[40:]) == payload
    assert req.body.obj is buf  # a view of the reader's buffer, not a copy


def test_parse_a_rename2_and_a_setattr():
    req = make_request(abi.RENAME2, struct.pack("<QII", 12, 1, 0) + b"a.tmp\0a\0")
    newdir, flags, _ = abi.RENAME2_IN.unpack_from(req.body)
    assert (newdir, flags) == (12, 1)
    assert wire.split_names(req.body[16:], 2) == [b"a.tmp", b"a"]

    body = setattr_in(abi.FATTR_MODE | abi.FATTR_SIZE, fh=7, size=123, mode=0o100640, uid=5, gid=6)
    fields = abi.SETATTR_IN.unpack(make_request(abi.SETATTR, body).body)
    assert (fields[0], fields[2], fields[3], fields[11], fields[13], fields[14]) == (
        abi.FATTR_MODE | abi.FATTR_SIZE,
        7,
        123,
        0o100640,
        5,
        6,
    )


def test_parse_drops_extensions_and_refuses_bad_lengths():
    req = make_request(abi.LOOKUP, b"x\0", extension=b"E" * 16)
    assert bytes(req.body) == b"x\0"  # total_extlen 2: 16 bytes of extensions after the input
    with pytest.raises(ProtocolError):
        Request.parse(memoryview(bytearray(39)))
    short = request_bytes(abi.LOOKUP, b"name\0")
    with pytest.raises(ProtocolError):
        Request.parse(memoryview(short)[:-1])  # fewer bytes than the header's length
    with pytest.raises(ProtocolError):
        wire.split_names(memoryview(b"no terminator"), 1)
    with pytest.raises(ProtocolError):
        wire.split_names(memoryview(b"one\0"), 2)


def test_reply_and_error_headers():
    assert decode(wire.reply(9, b"ab", memoryview(b"cde"))) == (0, 9, b"abcde")
    assert decode(wire.error(9, errno.ENOENT)) == (-errno.ENOENT, 9, b"")
    assert decode(wire.error(9, 511)) == (-511, 9, b"")


@pytest.mark.parametrize("number", [0, -5, 512, 100_000])
def test_an_errno_outside_1_to_511_becomes_eio(number):
    assert decode(wire.error(3, number)) == (-errno.EIO, 3, b"")


def test_notification_header():
    error, unique, payload = decode(wire.notification(abi.NOTIFY_STORE, b"xyz"))
    assert (error, unique, payload) == (abi.NOTIFY_STORE, 0, b"xyz")


def attrs(**kwargs) -> EntryAttributes:
    base = dict(
        st_ino=42,
        st_mode=stat.S_IFREG | 0o644,
        st_nlink=1,
        st_uid=1000,
        st_gid=1001,
        st_size=12345,
        st_blocks=25,
        st_blksize=1 << 20,
        st_atime_ns=1_700_000_000_123_456_789,
        st_mtime_ns=1_700_000_001_000_000_001,
        st_ctime_ns=1_700_000_002_999_999_999,
        entry_timeout=1.0,
        attr_timeout=1.0,
    )
    base.update(kwargs)
    return EntryAttributes(**base)


# struct fuse_attr: ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink
# uid gid rdev blksize flags
FUSE_ATTR = struct.Struct("<6Q10I")
# struct fuse_entry_out before its attr: nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec
ENTRY_HEAD = struct.Struct("<4Q2I")


def test_attr_layout():
    a = attrs()
    fields = FUSE_ATTR.unpack(wire.attr(a))
    assert fields == (
        42,
        12345,
        25,
        1_700_000_000,
        1_700_000_001,
        1_700_000_002,
        123_456_789,
        1,
        999_999_999,
        stat.S_IFREG | 0o644,
        1,
        1000,
        1001,
        0,
        1 << 20,
        0,
    )


def test_entry_out_splits_timeouts_into_seconds_and_nanoseconds():
    data = wire.entry_out(attrs(entry_timeout=2.25, attr_timeout=0.5, generation=3))
    assert len(data) == 128
    assert ENTRY_HEAD.unpack_from(data) == (42, 3, 2, 0, 250_000_000, 500_000_000)
    assert FUSE_ATTR.unpack_from(data, 40)[0] == 42
    # nodeid: the kernel's handle when it differs from st_ino
    assert ENTRY_HEAD.unpack_from(wire.entry_out(attrs(nodeid=99)))[0] == 99
    # no negative or absurd timeouts reach the kernel
    assert ENTRY_HEAD.unpack_from(wire.entry_out(attrs(entry_timeout=-1.0, attr_timeout=0.0)))[2:] == (
        0,
        0,
        0,
        0,
    )
    assert ENTRY_HEAD.unpack_from(wire.entry_out(attrs(entry_timeout=1e30)))[2] == 1 << 62


def test_a_negative_entry_has_nodeid_0():
    data = wire.entry_out(EntryAttributes(st_ino=0, entry_timeout=30.75, nodeid=17))
    nodeid, generation, entry_s, attr_s, entry_ns, attr_ns = ENTRY_HEAD.unpack_from(data)
    assert nodeid == 0  # the name is absent for entry_valid seconds
    assert (entry_s, entry_ns) == (30, 750_000_000)
    assert (attr_s, attr_ns) == (0, 0)


def test_attr_out_layout():
    data = wire.attr_out(attrs(attr_timeout=3.5))
    assert len(data) == 104
    assert struct.unpack_from("<QII", data) == (3, 500_000_000, 0)
    assert data[16:] == wire.attr(attrs())


def test_statfs_layout():
    s = StatvfsData(f_bsize=4096, f_frsize=8192, f_blocks=10, f_bfree=9, f_bavail=8, f_files=7, f_ffree=6)
    data = wire.statfs_out(s)
    assert len(data) == 80
    # blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
    assert struct.unpack("<5Q3II6I", data) == (10, 9, 8, 7, 6, 4096, 255, 8192, 0, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("name", [b"a", b"ab" * 4, b"x" * 9, b"y" * 16, b"z" * 255])
def test_dirent_is_padded_to_8_bytes(name):
    a = attrs(st_ino=7, st_mode=stat.S_IFDIR | 0o755)
    data = wire.dirent(name, a, 3, plus=False)
    assert len(data) % 8 == 0 and len(data) - (24 + len(name)) < 8
    ino, off, namelen, kind = struct.unpack_from("<QQII", data)
    assert (ino, off, namelen, kind) == (7, 3, len(name), 4)  # DT_DIR
    assert data[24 : 24 + len(name)] == name
    assert data[24 + len(name) :] == bytes(len(data) - 24 - len(name))


def test_direntplus_is_an_entry_out_then_the_dirent():
    a = attrs(st_ino=8)
    data = wire.dirent(b"file.bin", a, 11, plus=True)
    assert len(data) == 128 + 24 + 8  # "file.bin" fills its 8 bytes exactly: no padding
    assert data[:128] == wire.entry_out(a)
    assert struct.unpack_from("<QQII", data, 128) == (8, 11, 8, 8)  # DT_REG
    assert data[152:] == b"file.bin"


# =============================================================================================
# InFlight and BackingFiles
# =============================================================================================


class FakeDevice:
    """Stands in for a /dev/fuse fd: records what is written and the backing files registered."""

    def __init__(self, fail_backing: OSError | None = None):
        self.written: list[bytes] = []
        self.opened: list[int] = []  # backing ids handed out
        self.closed: list[int] = []
        self.next_id = 1
        self.fail_backing = fail_backing

    def write(self, iov) -> bool:
        self.written.append(b"".join(bytes(p) for p in iov))
        return True

    def backing_open(self, fd: int) -> int:
        if self.fail_backing is not None:
            raise self.fail_backing
        os.fstat(fd)  # a live fd
        backing_id, self.next_id = self.next_id, self.next_id + 1
        self.opened.append(backing_id)
        return backing_id

    def backing_close(self, backing_id: int) -> None:
        self.closed.append(backing_id)


def test_an_interrupt_read_before_its_request_is_parked():
    flights = InFlight()
    assert flights.interrupt(10) is None  # not there yet: parked
    assert 10 in flights.parked
    flight = Flight(FakeDevice())
    flights.add(10, flight)
    assert flight.interrupted and 10 not in flights.parked
    assert flights.attach(10, trio.CancelScope()) is False  # the handler starts cancelled
    other = Flight(FakeDevice())
    flights.add(11, other)
    assert not other.interrupted and flights.attach(11, trio.CancelScope()) is True


def test_an_interrupt_of_a_known_request_returns_its_scope():
    flights = InFlight()
    flight = Flight(FakeDevice())
    flights.add(5, flight)
    assert flights.interrupt(5) is None and flight.interrupted  # no scope attached (not a READ)
    scope = trio.CancelScope()
    flights.add(6, Flight(FakeDevice()))
    assert flights.attach(6, scope) is True
    assert flights.interrupt(6) is scope
    flights.drop(6)
    assert flights.interrupt(6) is None and 6 in flights.parked  # answered already: parked
    assert flights.attach(99, trio.CancelScope()) is True  # unknown: nothing to cancel


def test_the_parked_interrupts_are_bounded():
    flights = InFlight()
    for unique in range(PARKED_INTERRUPTS + 50):
        flights.interrupt(unique)
    assert len(flights.parked) == PARKED_INTERRUPTS
    oldest, newest = Flight(FakeDevice()), Flight(FakeDevice())
    flights.add(0, oldest)  # dropped: the first ones parked go first
    flights.add(PARKED_INTERRUPTS + 49, newest)
    assert not oldest.interrupted and newest.interrupted


@pytest.fixture
def two_files(tmp_path):
    fds = []
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"data")
        fds.append(os.open(tmp_path / name, os.O_RDONLY))
    yield fds
    for fd in fds:
        os.close(fd)


def test_backing_files_one_id_per_node_counted_over_opens(two_files):
    a, b = two_files
    dev, backing = FakeDevice(), BackingFiles()
    first = backing.attach(dev, nodeid=5, fh=100, fd=a)
    dup = os.dup(a)
    try:
        again = backing.attach(dev, nodeid=5, fh=101, fd=dup)  # the same file by another fd
    finally:
        os.close(dup)
    assert first == again == 1 and dev.opened == [1]
    assert backing.attach(dev, nodeid=5, fh=102, fd=b) is None  # another file for the same node
    assert backing.attach(dev, nodeid=6, fh=103, fd=b) == 2  # another node: its own id
    assert backing.active(5) and backing.active(6)
    backing.detach(dev, 100)
    assert dev.closed == [] and backing.active(5)
    backing.detach(dev, 102)  # refused above: nothing to count down
    backing.detach(dev, 12345)  # never attached
    assert dev.closed == []
    backing.detach(dev, 101)  # the last open of node 5
    assert dev.closed == [1] and not backing.active(5)
    backing.detach(dev, 103)
    assert dev.closed == [1, 2]
    backing.detach(dev, 103)  # released twice: nothing more
    assert dev.closed == [1, 2]


def test_a_backing_close_that_fails_is_logged_not_raised(two_files, caplog):
    class Failing(FakeDevice):
        def backing_close(self, backing_id):
            raise OSError(errno.EINVAL, "gone")

    dev, backing = Failing(), BackingFiles()
    backing.attach(dev, 5, 100, two_files[0])
    with caplog.at_level(logging.WARNING, logger="ckptfs.fusewire.session"):
        backing.detach(dev, 100)
    assert "cannot close passthrough backing file 1" in caplog.text
    assert not backing.active(5)


# =============================================================================================
# Session._handle on trio, with a tiny filesystem
# =============================================================================================


class Tiny(Filesystem):
    """Records what it is asked; answers from what the test set."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.data = b""
        self.xattr = b""
        self.listing: list = []
        self.sent: list[EntryAttributes] = []
        self.forgotten: list = []
        self.entered = trio.Event()  # a read or write started
        self.proceed = trio.Event()  # what a waiting read or write waits for
        self.wait = False
        self.raise_: BaseException | None = None
        self.open_info = FileInfo(fh=100)

    def _check(self):
        if self.raise_ is not None:
            raise self.raise_

    def forget(self, items):
        self.forgotten.append(list(items))
        self._check()

    async def lookup(self, parent, name, ctx):
        self.calls.append(("lookup", parent, name, ctx.uid, ctx.gid, ctx.pid, ctx.unique))
        self._check()
        return attrs(st_ino=50)

    async def getattr(self, nodeid, ctx):
        self.calls.append(("getattr", nodeid))
        return attrs(st_ino=nodeid)

    async def setattr(self, nodeid, attr, fields, fh, ctx):
        self.calls.append(("setattr", nodeid, attr, fields, fh))
        return attrs(st_ino=nodeid, st_size=attr.st_size)

    async def rename(self, parent_old, name_old, parent_new, name_new, flags, ctx):
        self.calls.append(("rename", parent_old, name_old, parent_new, name_new, flags))

    async def mkdir(self, parent, name, mode, ctx):
        self.calls.append(("mkdir", parent, name, mode, ctx.umask))
        return attrs(st_ino=60, st_mode=stat.S_IFDIR | mode)

    async def create(self, parent, name, mode, flags, ctx):
        self.calls.append(("create", parent, name, mode, flags, ctx.umask))
        return self.open_info, attrs(st_ino=61)

    async def open(self, nodeid, flags, ctx):
        self.calls.append(("open", nodeid, flags))
        return self.open_info

    async def read(self, fh, offset, out):
        self.calls.append(("read", fh, offset, len(out)))
        self.entered.set()
        if self.wait:
            await self.proceed.wait()
        chunk = self.data[offset : offset + len(out)]
        out[: len(chunk)] = chunk
        return len(chunk)

    async def write(self, fh, offset, data, kill_setid=False):
        self.calls.append(("write", fh, offset, bytes(data)))
        self.entered.set()
        if self.wait:
            await self.proceed.wait()
        return len(data)

    async def release(self, fh):
        self.calls.append(("release", fh))

    async def readdir(self, fh, offset):
        self.calls.append(("readdir", fh, offset))
        return self.listing[offset:]

    def entry_sent(self, entry):
        self.sent.append(entry)

    async def getxattr(self, nodeid, name, ctx):
        self.calls.append(("getxattr", nodeid, name))
        return self.xattr

    async def listxattr(self, nodeid, ctx):
        return [b"user.a", b"user.bb"]

    async def setxattr(self, nodeid, name, value, flags, ctx):
        self.calls.append(("setxattr", nodeid, name, value, flags))


def new_session(fs: Filesystem, passthrough: bool = False) -> Session:
    """A session that never mounts: what INIT would have settled, set by hand."""
    s = Session(fs, "/nonexistent/ckptfs-test-mountpoint", fsname="test")
    s.conn = Conn(abi.KERNEL_MINOR, WANTED, session.MAX_WRITE, passthrough)
    return s


async def handle(s: Session, req: Request, dev: FakeDevice | None = None) -> tuple[int, int, bytes]:
    """What a reader does around _handle: register the flight (a READ gets its reply buffer),
    ask, drop it."""
    assert s.conn is not None
    out = memoryview(bytearray(s.conn.max_write)) if req.opcode == abi.READ else None
    flight = Flight(dev or FakeDevice(), out)
    s.inflight.add(req.unique, flight)
    try:
        with trio.fail_after(GUARD_S):
            return decode(await s._handle(req, flight))
    finally:
        s.inflight.drop(req.unique)


@trio_test
async def test_an_unknown_opcode_answers_enosys():
    fs = Tiny()
    s = new_session(fs)
    assert await handle(s, make_request(39, b"", unique=3)) == (-errno.ENOSYS, 3, b"")  # FUSE_IOCTL
    assert await handle(s, make_request(9999, b"", unique=4)) == (-errno.ENOSYS, 4, b"")
    # a method the filesystem does not have: the base class refuses with ENOSYS
    assert (await handle(s, make_request(abi.READLINK)))[0] == -errno.ENOSYS
    assert fs.calls == []


@trio_test
async def test_a_lookup_answers_an_entry_and_passes_the_caller():
    fs = Tiny()
    error, unique, payload = await handle(
        new_session(fs), make_request(abi.LOOKUP, b"x.pt\0", unique=8, nodeid=3)
    )
    assert (error, unique) == (0, 8)
    assert payload == wire.entry_out(attrs(st_ino=50))
    assert fs.calls == [("lookup", 3, b"x.pt", 1001, 1002, 4242, 8)]


@trio_test
async def test_a_fuse_error_answers_its_errno():
    fs = Tiny()
    fs.raise_ = FuseError(errno.ENAMETOOLONG)
    assert (await handle(new_session(fs), make_request(abi.LOOKUP, b"n\0")))[0] == -errno.ENAMETOOLONG


@trio_test
async def test_a_handler_bug_answers_eio_and_is_logged(caplog):
    fs = Tiny()
    fs.raise_ = RuntimeError("a bug in the filesystem")
    with caplog.at_level(logging.ERROR, logger="ckptfs.fusewire.session"):
        assert (await handle(new_session(fs), make_request(abi.LOOKUP, b"n\0")))[0] == -errno.EIO
    (record,) = [r for r in caplog.records if r.name == "ckptfs.fusewire.session"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "a bug in the filesystem" in caplog.text


@trio_test
async def test_malformed_requests_answer_einval():
    fs = Tiny()
    s = new_session(fs)
    assert (await handle(s, make_request(abi.LOOKUP, b"no terminator")))[0] == -errno.EINVAL
    # a WRITE whose size says more than it carries
    body = struct.pack("<QQIIQII", 1, 0, 100, 0, 0, 0, 0) + b"x" * 10
    assert (await handle(s, make_request(abi.WRITE, body)))[0] == -errno.EINVAL
    assert (await handle(s, make_request(abi.GETATTR, b"")))[0] == 0  # (no input needed)
    assert [c[0] for c in fs.calls] == ["getattr"]


@trio_test
async def test_read_fills_the_readers_buffer_and_answers_short_at_eof():
    fs = Tiny()
    fs.data = bytes(range(256)) * 40  # 10240 bytes
    s = new_session(fs)
    assert await handle(s, make_request(abi.READ, read_in(100, 4096, 4096), unique=2)) == (
        0,
        2,
        fs.data[4096:8192],
    )
    error, _, payload = await handle(s, make_request(abi.READ, read_in(100, 8192, 65536)))
    assert error == 0 and payload == fs.data[8192:]
    assert fs.calls[-1] == ("read", 100, 8192, 65536)


@trio_test
async def test_write_hands_over_the_payload_and_answers_the_count():
    fs = Tiny()
    payload = os.urandom(5000)
    body = struct.pack("<QQIIQII", 9, 1 << 33, len(payload), 0, 0, 0, 0) + payload
    error, _, out = await handle(new_session(fs), make_request(abi.WRITE, body))
    assert error == 0 and struct.unpack("<II", out) == (5000, 0)
    assert fs.calls == [("write", 9, 1 << 33, payload)]


def setattr_in(
    valid, fh=0, size=0, atime=0, mtime=0, atimensec=0, mtimensec=0, mode=0, uid=0, gid=0
) -> bytes:
    """struct fuse_setattr_in: valid padding fh size lock_owner atime mtime ctime atimensec
    mtimensec ctimensec mode unused4 uid gid unused5."""
    return struct.pack(
        "<IIQQQQQQIIIIIIII",
        valid,
        0,
        fh,
        size,
        0,
        atime,
        mtime,
        0,
        atimensec,
        mtimensec,
        0,
        mode,
        0,
        uid,
        gid,
        0,
    )


@trio_test
async def test_setattr_decodes_what_changes():
    fs = Tiny()
    s = new_session(fs)
    valid = abi.FATTR_SIZE | abi.FATTR_MTIME | abi.FATTR_FH | abi.FATTR_MODE
    body = setattr_in(valid, fh=4, size=777, mtime=1_600_000_000, mtimensec=5, mode=0o600, atime=99)
    error, _, payload = await handle(s, make_request(abi.SETATTR, body, nodeid=12))
    assert error == 0 and len(payload) == 104
    _, nodeid, attr, fields, fh = fs.calls[-1]
    assert (nodeid, fh, attr.st_size, attr.st_mode) == (12, 4, 777, 0o600)
    assert attr.st_mtime_ns == 1_600_000_000_000_000_005
    assert fields == SetattrFields(update_mode=True, update_size=True, update_mtime=True)

    before = time.time_ns()
    body = setattr_in(abi.FATTR_ATIME | abi.FATTR_ATIME_NOW | abi.FATTR_UID, atime=1, uid=33)
    await handle(s, make_request(abi.SETATTR, body, nodeid=12))
    _, _, attr, fields, fh = fs.calls[-1]
    assert fh is None  # no FATTR_FH
    assert fields == SetattrFields(update_uid=True, update_atime=True)
    assert attr.st_uid == 33 and before <= attr.st_atime_ns <= time.time_ns()


@trio_test
async def test_rename_and_rename2():
    fs = Tiny()
    s = new_session(fs)
    await handle(s, make_request(abi.RENAME, struct.pack("<Q", 8) + b"old\0new\0", nodeid=7))
    await handle(s, make_request(abi.RENAME2, struct.pack("<QII", 9, 2, 0) + b"a\0b\0", nodeid=7))
    assert fs.calls == [("rename", 7, b"old", 8, b"new", 0), ("rename", 7, b"a", 9, b"b", 2)]


@trio_test
async def test_mkdir_and_create_pass_the_umask():
    fs = Tiny()
    s = new_session(fs)
    error, _, payload = await handle(
        s, make_request(abi.MKDIR, struct.pack("<II", 0o777, 0o022) + b"d\0", nodeid=1)
    )
    assert error == 0 and len(payload) == 128
    fs.open_info = FileInfo(fh=300, direct_io=True)
    body = struct.pack("<IIII", os.O_WRONLY | os.O_CREAT, 0o100644, 0o027, 0) + b"f.bin\0"
    error, _, payload = await handle(s, make_request(abi.CREATE, body, nodeid=1))
    assert error == 0
    assert payload[:128] == wire.entry_out(attrs(st_ino=61))
    assert struct.unpack("<QIi", payload[128:]) == (300, abi.FOPEN_DIRECT_IO, 0)
    assert fs.calls == [
        ("mkdir", 1, b"d", 0o777, 0o022),
        ("create", 1, b"f.bin", 0o100644, os.O_WRONLY | os.O_CREAT, 0o027),
    ]


@trio_test
async def test_open_flags():
    fs = Tiny()
    s = new_session(fs)
    fs.open_info = FileInfo(fh=5, keep_cache=True)
    assert struct.unpack("<QIi", (await handle(s, make_request(abi.OPEN, struct.pack("<II", 0, 0))))[2]) == (
        5,
        abi.FOPEN_KEEP_CACHE,
        0,
    )
    fs.open_info = FileInfo(fh=6, direct_io=True, keep_cache=True, backing_fd=0)
    # passthrough not settled at INIT: a backing file is not even tried
    assert struct.unpack("<QIi", (await handle(s, make_request(abi.OPEN, struct.pack("<II", 0, 0))))[2]) == (
        6,
        abi.FOPEN_DIRECT_IO | abi.FOPEN_KEEP_CACHE,
        0,
    )


@trio_test
async def test_passthrough_opens_register_one_backing_file_per_node(two_files):
    a, b = two_files
    fs = Tiny()
    s = new_session(fs, passthrough=True)
    dev = FakeDevice()

    async def open_(nodeid, fh, fd):
        fs.open_info = FileInfo(fh=fh, keep_cache=True, backing_fd=fd)
        error, _, payload = await handle(
            s, make_request(abi.OPEN, struct.pack("<II", 0, 0), nodeid=nodeid), dev
        )
        assert error == 0
        return struct.unpack("<QIi", payload)

    assert await open_(5, 100, a) == (100, abi.FOPEN_PASSTHROUGH, 1)  # (keep_cache means nothing then)
    assert await open_(5, 101, a) == (101, abi.FOPEN_PASSTHROUGH, 1)
    assert await open_(5, 102, b) == (102, abi.FOPEN_KEEP_CACHE, 0)  # another file: a plain open
    assert s.passthrough_opens == 2
    for fh in (100, 102, 101):
        assert (await handle(s, make_request(abi.RELEASE, struct.pack("<QIIQ", fh, 0, 0, 0)), dev))[0] == 0
    assert dev.opened == [1] and dev.closed == [1]
    assert ("release", 101) in fs.calls


@trio_test
async def test_a_refused_backing_file_turns_passthrough_off(two_files, caplog):
    fs = Tiny()
    s = new_session(fs, passthrough=True)
    dev = FakeDevice(fail_backing=OSError(errno.EPERM, "no"))
    fs.open_info = FileInfo(fh=7, backing_fd=two_files[0])
    with caplog.at_level(logging.WARNING, logger="ckptfs.fusewire.session"):
        error, _, payload = await handle(s, make_request(abi.OPEN, struct.pack("<II", 0, 0)), dev)
    assert error == 0 and struct.unpack("<QIi", payload) == (7, 0, 0)
    assert s.backing.refused is not None and os.strerror(errno.EPERM) in s.backing.refused
    assert "served through the daemon from now on" in caplog.text
    dev.fail_backing = None
    await handle(s, make_request(abi.OPEN, struct.pack("<II", 0, 0)), dev)
    assert dev.opened == []  # not asked again


@trio_test
async def test_readdirplus_packs_only_what_fits_and_counts_only_those():
    fs = Tiny()
    fs.listing = [(name, attrs(st_ino=ino), ino) for ino, name in enumerate([b"a", b"bb", b"ccc"], 1)]
    s = new_session(fs)
    each = 128 + 24 + 8  # every name here fits 8 bytes
    error, _, payload = await handle(s, make_request(abi.READDIRPLUS, read_in(77, 0, 2 * each + each - 1)))
    assert error == 0 and len(payload) == 2 * each
    assert [e.st_ino for e in fs.sent] == [1, 2]
    names = [payload[i + 152 : i + 152 + struct.unpack_from("<QQII", payload, i + 128)[2]] for i in (0, each)]
    assert names == [b"a", b"bb"]
    # the next call resumes at the offset the kernel saw last
    error, _, payload = await handle(s, make_request(abi.READDIRPLUS, read_in(77, 2, 4096)))
    assert len(payload) == each and [e.st_ino for e in fs.sent] == [1, 2, 3]
    assert fs.calls[-1] == ("readdir", 77, 2)
    # too small for one entry: an empty answer (the kernel's end of the listing)
    assert (await handle(s, make_request(abi.READDIRPLUS, read_in(77, 0, each - 1))))[2] == b""
    # plain READDIR: no attributes, no lookups counted
    error, _, payload = await handle(s, make_request(abi.READDIR, read_in(77, 0, 4096)))
    assert len(payload) == 3 * 32 and len(fs.sent) == 3


@trio_test
async def test_a_readdirplus_of_a_mebibyte_is_one_piece_not_more_than_writev_takes():
    """A large directory's reply holds thousands of entries: sent as one iovec each, writev
    refused it (EINVAL, more than IOV_MAX pieces) and `ls` waited forever."""
    fs = Tiny()
    fs.listing = [(b"f%04d" % ino, attrs(st_ino=ino), ino) for ino in range(1, 5001)]
    s = new_session(fs)
    req = make_request(abi.READDIRPLUS, read_in(77, 0, 1 << 20))
    flight = Flight(FakeDevice())
    s.inflight.add(req.unique, flight)
    iov = await s._handle(req, flight)
    assert len(iov) <= os.sysconf("SC_IOV_MAX") and sum(map(len, iov)) > 1024 * 160
    error, _, payload = decode(iov)
    assert error == 0 and len(payload) // 160 == len(fs.sent) > 1024


@trio_test
async def test_getxattr_and_listxattr_sizes():
    fs = Tiny()
    fs.xattr = b"verified"
    s = new_session(fs)

    def getxattr_in(size):
        return struct.pack("<II", size, 0) + b"user.ckptfs.state\0"

    assert (await handle(s, make_request(abi.GETXATTR, getxattr_in(0))))[::2] == (0, struct.pack("<II", 8, 0))
    assert (await handle(s, make_request(abi.GETXATTR, getxattr_in(7))))[0] == -errno.ERANGE
    assert (await handle(s, make_request(abi.GETXATTR, getxattr_in(8))))[::2] == (0, b"verified")
    assert fs.calls[-1] == ("getxattr", 5, b"user.ckptfs.state")
    names = b"user.a\0user.bb\0"
    listxattr = abi.LISTXATTR
    assert (await handle(s, make_request(listxattr, struct.pack("<II", 0, 0))))[2] == struct.pack(
        "<II", len(names), 0
    )
    assert (await handle(s, make_request(listxattr, struct.pack("<II", 3, 0))))[0] == -errno.ERANGE
    assert (await handle(s, make_request(listxattr, struct.pack("<II", 64, 0))))[2] == names


@trio_test
async def test_setxattr_keeps_a_value_with_nul_bytes():
    fs = Tiny()
    value = b"a\0b\0\0c"
    body = struct.pack("<II", len(value), 2) + b"user.x\0" + value
    assert (await handle(new_session(fs), make_request(abi.SETXATTR, body)))[0] == 0
    assert fs.calls == [("setxattr", 5, b"user.x", value, 2)]


@trio_test
async def test_a_read_interrupted_before_it_started_answers_eintr():
    fs = Tiny()
    fs.data = b"x" * 100
    fs.wait = True
    s = new_session(fs)
    s.inflight.interrupt(31)  # the INTERRUPT came first (another reader took it)
    assert await handle(s, make_request(abi.READ, read_in(1, 0, 100), unique=31)) == (-errno.EINTR, 31, b"")
    assert not s.inflight.parked and not s.inflight.flights


@trio_test
async def test_a_read_interrupted_while_it_waits_answers_eintr():
    fs = Tiny()
    fs.data = b"x" * 100
    fs.wait = True  # the store is slow: the read waits until told
    s = new_session(fs)
    token = trio.lowlevel.current_trio_token()
    answers = []

    async def read():
        answers.append(await handle(s, make_request(abi.READ, read_in(1, 0, 100), unique=40)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        with trio.fail_after(GUARD_S):
            await fs.entered.wait()
        # the INTERRUPT, as a reader thread hands it over
        interrupt = make_request(abi.INTERRUPT, struct.pack("<Q", 40), unique=41)
        await trio.to_thread.run_sync(s._interrupt, token, interrupt)
    assert answers == [(-errno.EINTR, 40, b"")]
    assert not fs.proceed.is_set()


@trio_test
async def test_only_reads_are_cut_short():
    fs = Tiny()
    fs.wait = True
    s = new_session(fs)
    token = trio.lowlevel.current_trio_token()
    answers = []
    body = struct.pack("<QQIIQII", 1, 0, 3, 0, 0, 0, 0) + b"abc"

    async def write():
        answers.append(await handle(s, make_request(abi.WRITE, body, unique=50)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        with trio.fail_after(GUARD_S):
            await fs.entered.wait()
        await trio.to_thread.run_sync(s._interrupt, token, make_request(abi.INTERRUPT, struct.pack("<Q", 50)))
        await trio.testing.wait_all_tasks_blocked()
        assert answers == []  # still waiting: a write is never left half done
        fs.proceed.set()
    assert answers == [(0, 50, struct.pack("<II", 3, 0))]


@trio_test
async def test_forgets_reach_the_filesystem_and_a_failing_one_is_logged(caplog):
    fs = Tiny()
    s = new_session(fs)
    token = trio.lowlevel.current_trio_token()
    s._forget(token, make_request(abi.FORGET, struct.pack("<Q", 3), nodeid=21))
    batch = struct.pack("<II", 2, 0) + struct.pack("<QQ", 30, 1) + struct.pack("<QQ", 31, 7) + b"\xff" * 16
    s._forget(token, make_request(abi.BATCH_FORGET, batch))
    with trio.fail_after(GUARD_S):
        while len(fs.forgotten) < 2:
            await trio.sleep(0.01)
    assert fs.forgotten == [[(21, 3)], [(30, 1), (31, 7)]]
    fs.raise_ = RuntimeError("forget bug")
    with caplog.at_level(logging.ERROR, logger="ckptfs.fusewire.session"):
        s._forget(token, make_request(abi.FORGET, struct.pack("<Q", 1)))
        with trio.fail_after(GUARD_S):
            while len(fs.forgotten) < 3:
                await trio.sleep(0.01)
    assert "forget failed" in caplog.text


# =============================================================================================
# The INIT handshake, against a device that plays the kernel
# =============================================================================================


class KernelDevice(FakeDevice):
    """Hands out queued requests (0 when none: the poll timed out), records the replies."""

    def __init__(self, *requests: bytes):
        super().__init__()
        self.requests = list(requests)

    def read(self, buf: bytearray) -> int:
        if not self.requests:
            time.sleep(0.01)
            return 0
        data = self.requests.pop(0)
        buf[: len(data)] = data
        return len(data)


def init_request(major=7, minor=45, flags=0, unique=1) -> bytes:
    """struct fuse_init_in: major minor max_readahead flags flags2 unused[11]."""
    body = struct.pack("<IIII", major, minor, 128 << 10, flags & 0xFFFFFFFF)
    body += struct.pack("<I", flags >> 32) + bytes(44)
    return bytes(request_bytes(abi.INIT, body, unique=unique, nodeid=0))


# struct fuse_init_out: major minor max_readahead flags max_background congestion_threshold
# max_write time_gran max_pages map_alignment flags2 max_stack_depth request_timeout unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")


def init_reply(dev: KernelDevice, unique: int = 1) -> tuple:
    error, got_unique, payload = decode([dev.written[-1]])
    assert (error, got_unique) == (0, unique) and len(payload) == 64
    return INIT_OUT.unpack(payload)


EVERYTHING = (1 << 64) - 1 & ~(1 << 31)  # every flag the kernel could offer (bit 31: reserved)


@pytest.mark.parametrize("euid", [0, 1000])
def test_init_asks_for_what_it_wants_of_what_is_offered(euid, monkeypatch):
    monkeypatch.setattr(session.os, "geteuid", lambda: euid)
    dev = KernelDevice(init_request(flags=EVERYTHING))
    s = Session(Tiny(), "/nonexistent", fsname="test")
    conn = s._handshake(dev)
    major, minor, readahead, flags, _, _, max_write, gran, pages, _, flags2, depth, _ = init_reply(dev)
    asked = flags | flags2 << 32
    assert (major, minor, readahead, max_write, gran, pages) == (7, 45, 128 << 10, 1 << 20, 1, 256)
    assert asked & ~(abi.PASSTHROUGH | abi.INIT_EXT) == WANTED
    assert not asked & abi.WRITEBACK_CACHE  # offered, not wanted (docs/machine-facts.md)
    if euid == 0:
        assert asked & abi.PASSTHROUGH and asked & abi.INIT_EXT and depth == 1
        assert conn.passthrough and s.backing.refused is None
    else:
        assert not asked & abi.PASSTHROUGH and depth == 0
        assert not conn.passthrough and s.backing.refused == "FUSE passthrough needs root (CAP_SYS_ADMIN)"
    assert conn == Conn(45, asked, 1 << 20, euid == 0)


def test_init_without_passthrough_offered_says_why(monkeypatch):
    monkeypatch.setattr(session.os, "geteuid", lambda: 0)
    dev = KernelDevice(init_request(minor=40, flags=EVERYTHING & 0xFFFFFFFF & ~abi.INIT_EXT))
    s = Session(Tiny(), "/nonexistent", fsname="test")
    conn = s._handshake(dev)
    assert conn.minor == 40 and init_reply(dev)[1] == 40  # the kernel's minor, being older
    assert not conn.passthrough and "offers no FUSE passthrough" in (s.backing.refused or "")
    # passthrough offered but not wanted: nothing refused
    dev = KernelDevice(init_request(flags=EVERYTHING))
    s = Session(Tiny(), "/nonexistent", fsname="test", passthrough=False)
    assert not s._handshake(dev).passthrough and s.backing.refused is None


def test_init_from_a_newer_major_is_answered_with_ours_then_settled():
    dev = KernelDevice(init_request(major=8, minor=0, unique=1), init_request(minor=38, unique=2))
    conn = Session(Tiny(), "/nonexistent", fsname="test")._handshake(dev)
    assert len(dev.written) == 2
    first = decode([dev.written[0]])
    assert first[:2] == (0, 1) and struct.unpack_from("<II", first[2]) == (7, 45)
    assert conn.minor == 38


def test_init_from_a_kernel_too_old_fails_with_eproto():
    dev = KernelDevice(init_request(minor=30))
    with pytest.raises(MountFailed, match="7.30 is too old"):
        Session(Tiny(), "/nonexistent", fsname="test")._handshake(dev)
    assert decode([dev.written[-1]]) == (-errno.EPROTO, 1, b"")


def test_a_request_before_init_fails_the_mount(monkeypatch):
    dev = KernelDevice(bytes(request_bytes(abi.LOOKUP, b"x\0")))
    with pytest.raises(MountFailed, match="before INIT"):
        Session(Tiny(), "/nonexistent", fsname="test")._handshake(dev)
    monkeypatch.setattr(session, "INIT_WAIT_S", 0.2)
    with pytest.raises(MountFailed, match="no FUSE INIT"):
        Session(Tiny(), "/nonexistent", fsname="test")._handshake(KernelDevice())


# =============================================================================================
# The reader threads, on fake devices sharing one queue (as clones of /dev/fuse share one)
# =============================================================================================


class QueueDevice:
    """One fd of a fake connection: reads take requests from the queue the clones share;
    DISCONNECT ends every reader."""

    DISCONNECT = b""

    def __init__(self, conn: dict):
        self.conn = conn
        self.read_uniques: list[int] = []
        self.replies: list[tuple[int, int, bytes]] = []
        conn["devices"].append(self)

    def read(self, buf: bytearray) -> int:
        try:
            data = self.conn["queue"].get(timeout=0.02)
        except queue.Empty:
            return 0
        if data == self.DISCONNECT:
            self.conn["queue"].put(data)  # for the other readers too
            raise Disconnected
        buf[: len(data)] = data
        self.read_uniques.append(struct.unpack_from("<Q", data, 8)[0])
        return len(data)

    def write(self, iov) -> bool:
        self.replies.append(decode(iov))
        return True

    def clone(self) -> QueueDevice:
        self.conn["clones"] += 1
        return QueueDevice(self.conn)

    def close(self) -> None:
        pass


def serving(fs: Filesystem, max_threads: int) -> tuple[Session, dict]:
    conn = {"queue": queue.Queue(), "devices": [], "clones": 0}
    s = Session(fs, "/nonexistent", fsname="test", max_threads=max_threads)
    s.device = QueueDevice(conn)
    s.conn = Conn(abi.KERNEL_MINOR, WANTED, session.MAX_WRITE, False)
    return s, conn


class Gathering(Tiny):
    """Every WRITE waits until ``together`` of them are being served at once (a WRITE holds its
    reader until answered: requests without data are handed to the loop and hold none)."""

    def __init__(self, together: int):
        super().__init__()
        self.together = together
        self.waiting = 0
        self.all_in = trio.Event()

    async def write(self, fh, offset, data, kill_setid=False):
        self.waiting += 1
        if self.waiting >= self.together:
            self.all_in.set()
        await self.all_in.wait()
        return len(data)


def answered(conn: dict) -> dict[int, int]:
    """unique -> the error of its reply, over every fd."""
    return {unique: error for dev in conn["devices"] for error, unique, _ in dev.replies}


@trio_test
async def test_readers_grow_on_clones_and_answer_on_the_fd_that_read():
    fs = Gathering(together=4)  # four at once: one reader alone would wait for ever
    s, conn = serving(fs, max_threads=6)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        for unique in range(100, 104):
            write = struct.pack("<QQIIQII", 5, 0, 3, 0, 0, 0, 0) + b"abc"
            conn["queue"].put(bytes(request_bytes(abi.WRITE, write, unique=unique)))
        conn["queue"].put(bytes(request_bytes(abi.INTERRUPT, struct.pack("<Q", 999), unique=104)))
        conn["queue"].put(bytes(request_bytes(abi.FORGET, struct.pack("<Q", 1), unique=105, nodeid=8)))
        with trio.fail_after(GUARD_S):
            while len(answered(conn)) < 4 or not fs.forgotten:
                await trio.sleep(0.01)
        conn["queue"].put(QueueDevice.DISCONNECT)
    assert answered(conn) == {100: 0, 101: 0, 102: 0, 103: 0}  # FORGET and INTERRUPT: no reply
    assert 4 <= len(conn["devices"]) <= 6 and conn["clones"] == len(conn["devices"]) - 1
    for dev in conn["devices"]:  # each reply went back on the fd its request came from
        assert {u for _, u, _ in dev.replies} <= set(dev.read_uniques)
    assert fs.forgotten == [[(8, 1)]] and 999 in s.inflight.parked
    assert s.requests == 4 and not s._readers


@trio_test
async def test_one_reader_thread_never_clones():
    fs = Tiny()
    s, conn = serving(fs, max_threads=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        for unique in range(10, 30):
            conn["queue"].put(bytes(request_bytes(abi.LOOKUP, b"f\0", unique=unique)))
        with trio.fail_after(GUARD_S):
            while len(answered(conn)) < 20:
                await trio.sleep(0.01)
        conn["queue"].put(QueueDevice.DISCONNECT)
    assert conn["clones"] == 0 and len(conn["devices"]) == 1
    assert sorted(u for _, u, _ in conn["devices"][0].replies) == list(range(10, 30))  # all, on the one fd


# =============================================================================================
# Notifications
# =============================================================================================


def test_notifications_layouts():
    dev = FakeDevice()
    n = Notifier(dev, Conn(45, WANTED, 1 << 20, False))
    n.inval_inode(17)
    n.store(18, 4096, memoryview(b"page bytes"))
    assert decode([dev.written[0]]) == (abi.NOTIFY_INVAL_INODE, 0, struct.pack("<Qqq", 17, 0, 0))
    assert decode([dev.written[1]]) == (
        abi.NOTIFY_STORE,
        0,
        struct.pack("<QQII", 18, 4096, 10, 0) + b"page bytes",
    )
    n.inval_entry(1, b"latest")
    deadline = time.monotonic() + GUARD_S
    while len(dev.written) < 3:
        assert time.monotonic() < deadline, "the entry notification was never sent"
        time.sleep(0.01)
    assert decode([dev.written[2]]) == (abi.NOTIFY_INVAL_ENTRY, 0, struct.pack("<QII", 1, 6, 0) + b"latest\0")
    n.close()
    n.inval_entry(1, b"after-close")
    time.sleep(0.05)
    assert len(dev.written) == 3


def test_entry_notifications_queue_is_bounded_and_a_gone_connection_is_quiet():
    release = threading.Event()

    class Slow(FakeDevice):
        def write(self, iov):
            release.wait(GUARD_S)
            return super().write(iov)

    dev = Slow()
    n = Notifier(dev, Conn(45, WANTED, 1 << 20, False))
    n.QUEUE = 2
    n.inval_entry(1, b"a")  # taken by the thread, which then waits in write
    deadline = time.monotonic() + GUARD_S
    while n._queue:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for name in (b"b", b"c", b"d"):
        n.inval_entry(1, name)
    assert n.dropped == 1
    release.set()
    while len(dev.written) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [w[32:-1] for w in dev.written] == [b"a", b"b", b"c"]
    n.close()

    class Gone(FakeDevice):
        def write(self, iov):
            raise Disconnected

    gone = Notifier(Gone(), Conn(45, WANTED, 1 << 20, False))
    gone.inval_inode(1)  # the mount went away: nothing raised
    gone.store(1, 0, b"x")


# =============================================================================================
# The device's view of the connection, and unmounting
# =============================================================================================


def test_device_gone_is_poll_error_and_leaves_a_polling_reader_alone():
    read_end, write_end = os.pipe()
    reader_dev, writer_dev = device.Device(read_end), device.Device(write_end)
    try:
        assert not writer_dev.gone()
        # a reader polls the device's own poll object meanwhile (POLL_MS at a time)
        failures: list[BaseException] = []

        def read():
            try:
                reader_dev.read(bytearray(16))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.05)
        assert not reader_dev.gone()  # (no concurrent use of the reader's poll object)
        thread.join(GUARD_S)
        assert failures == []
        os.close(read_end)
        assert writer_dev.gone()  # a pipe with no reader: POLLERR, as a FUSE connection that ended
    finally:
        os.close(write_end)
        if not reader_dev.gone():
            os.close(read_end)


@pytest.mark.parametrize("connection_gone", [False, True])
def test_a_session_unmounts_only_a_connection_still_there(connection_gone, monkeypatch):
    class Dev(FakeDevice):
        def gone(self):
            return connection_gone

        def close(self):
            pass

    unmounted = []
    monkeypatch.setattr(session.mounting, "unmount", unmounted.append)
    s = Session(Tiny(), "/nonexistent/mnt", fsname="test")
    s.device, s.mounted = Dev(), True
    s._devices.append(s.device)
    s.close()
    s.close()  # (once only)
    assert unmounted == ([] if connection_gone else ["/nonexistent/mnt"])
