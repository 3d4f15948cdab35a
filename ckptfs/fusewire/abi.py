"""The FUSE kernel ABI ckptfs speaks: opcodes, flags and wire layouts, as ``fuse_kernel.h``
(protocol 7.45) defines them. Only the parts ckptfs uses; ``tests/test_fusewire.py`` pins the sizes.
"""

from __future__ import annotations

import struct

KERNEL_MAJOR = 7
KERNEL_MINOR = 45  # the newest minor we know; the kernel's own, if older, is what we speak
MIN_MINOR = 31  # max_pages (7.28) and the 40-byte read/write inputs (7.9) are both needed

ROOT_ID = 1

# -- opcodes -----------------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42
READDIRPLUS = 44
RENAME2 = 45

# -- INIT flags (64 bits: the high half travels in flags2 when INIT_EXT is set) -------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
HANDLE_KILLPRIV_V2 = 1 << 28
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# -- open reply flags ---------------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

# -- set-id bits the filesystem clears itself (HANDLE_KILLPRIV_V2) -------------------------------
OPEN_KILL_SUIDGID = 1 << 0  # in an OPEN's open_flags: an O_TRUNC open by a caller without CAP_FSETID
WRITE_KILL_SUIDGID = 1 << 2  # in a WRITE's write_flags: a write by a caller without CAP_FSETID

# -- setattr valid bits ---------------------------------------------------------------------------
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_KILL_SUIDGID = 1 << 11  # (HANDLE_KILLPRIV_V2: a truncate or chown clears set-id bits)

FSYNC_FDATASYNC = 1

# -- notifications (the error field of a unique-0 message) ------------------------------------------
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_STORE = 4

# -- ioctls on /dev/fuse ----------------------------------------------------------------------------
DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32)
DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32)

# -- layouts --------------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, -errno, unique
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags (flags2 follows from 7.36)
INIT_IN_FLAGS2 = struct.Struct("<I")
INIT_OUT = struct.Struct("<IIIIHHIIHHII2x22x")  # ... flags2, max_stack_depth, request_timeout, unused
# ino, size, blocks, atime, mtime, ctime, 3 x nsec, mode, nlink, uid, gid, rdev, blksize, flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags, dummy, fh
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
MKNOD_IN = struct.Struct("<IIII")  # mode, rdev, umask, padding
MKDIR_IN = struct.Struct("<II")  # mode, umask
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")  # flags, open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, padding
WRITE_IN = READ_IN
WRITE_OUT = struct.Struct("<II")
FSYNC_IN = struct.Struct("<QII")
KSTATFS = struct.Struct("<QQQQQIII4x24x")  # blocks bfree bavail files ffree bsize namelen frsize
GETXATTR_IN = struct.Struct("<II")  # size, padding
GETXATTR_OUT = struct.Struct("<II")
SETXATTR_IN = struct.Struct("<II")  # size, flags (no SETXATTR_EXT)
INTERRUPT_IN = struct.Struct("<Q")
DIRENT_HEAD = struct.Struct("<QQII")  # ino, off, namelen, type
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")
NOTIFY_STORE_OUT = struct.Struct("<QQII")
BACKING_MAP = struct.Struct("<iIQ")  # fd, flags, padding

ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size
HEADER_ROOM = 4096  # a request's headers and names beside its largest payload (as libfuse)
