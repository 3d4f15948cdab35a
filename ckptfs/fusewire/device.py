"""``/dev/fuse`` and its clones: read a request, write a reply, register backing files. No
parsing here.

Every fd is non-blocking and read after ``poll`` with a timeout: the clones share one input
queue, so a reader woken for a request another took gets EAGAIN and polls again, and a reader
sees the session stopping within ``POLL_MS`` even where no fusectl can abort the connection.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import struct

from ckptfs.fusewire import abi

POLL_MS = 250
IOV_MAX = os.sysconf("SC_IOV_MAX")


class Disconnected(Exception):
    """The connection is gone (unmounted or aborted)."""


class Device:
    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def open(cls) -> Device:
        return cls(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))

    def clone(self) -> Device:
        """A new fd on the same connection: requests it reads are answered on it."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, abi.DEV_IOC_CLONE, struct.pack("<I", self.fd))
        except OSError:
            os.close(fd)
            raise
        return Device(fd)

    def read(self, buf: bytearray) -> int:
        """One request into ``buf``; 0 when none came within POLL_MS (or another reader took it)."""
        try:
            if not self._poll.poll(POLL_MS):
                return 0
            return os.readv(self.fd, [buf])
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR, errno.ENOENT):
                return 0  # (ENOENT: the request was interrupted before we read it)
            if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                raise Disconnected from None
            raise

    def write(self, iov) -> bool:
        """Send one reply or notification; False when the kernel no longer waits for it (the
        request was interrupted, or a notification's node is gone)."""
        if len(iov) > IOV_MAX:  # (writev refuses more pieces: EINVAL)
            iov = [b"".join(iov)]
        try:
            os.writev(self.fd, iov)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                raise Disconnected from None
            raise
        return True

    def gone(self) -> bool:
        """Whether the kernel has ended the connection (unmounted or aborted): poll says POLLERR.
        (A poll object of its own: a reader may be polling on the shared one.)"""
        poller = select.poll()
        poller.register(self.fd, 0)  # (POLLERR and POLLNVAL are always reported)
        return any(mask & (select.POLLERR | select.POLLNVAL) for _, mask in poller.poll(0))

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` as a backing file (needs CAP_SYS_ADMIN): its id for an open reply."""
        # (a mutable argument: ioctl then returns the call's own result, the id)
        return fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, bytearray(abi.BACKING_MAP.pack(fd, 0, 0)), True)

    def backing_close(self, backing_id: int) -> None:
        fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))

    def close(self) -> None:
        os.close(self.fd)
