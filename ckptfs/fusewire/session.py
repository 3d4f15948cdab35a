"""A FUSE session: the mount, the INIT handshake, the reader threads, the dispatch of each
request to the filesystem on the trio loop, interrupts, forgets, passthrough backing files and
notifications.

Threads (docs/architecture.md, "The FUSE transport"): each reader owns a cloned ``/dev/fuse``
fd and a buffer sized at INIT. It reads a request with the GIL released, hands it to the trio
loop (``trio.from_thread.run``) and blocks until the handler's answer, which it writes back on
its own fd: the kernel looks a reply up among the requests that fd read. While it waits, the
request's input (a WRITE's payload) stays in its buffer, so no byte is copied into Python
objects; a READ fills the reader's own reply buffer. When the last idle reader takes a request,
another starts (FORGETs do not count), up to ``max_threads``; each holds at most two buffers of
``max_write`` + 4 KiB.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from ckptfs.fusewire import abi, wire
from ckptfs.fusewire import mount as mounting
from ckptfs.fusewire.device import Device, Disconnected
from ckptfs.fusewire.face import (
    Ctx,
    Deferred,
    EntryAttributes,
    FileInfo,
    Filesystem,
    FuseError,
    SetattrFields,
)
from ckptfs.fusewire.wire import ProtocolError, Request

log = logging.getLogger(__name__)

# Not ASYNC_READ: with it the kernel reads ahead in background requests that only SIGKILL can
# end, so a read waiting on a slow store could not be interrupted; without it, a read's requests
# are the reader's own, and a signal interrupts them (Session._interrupt). Nor ASYNC_DIO, for
# the same reason with O_DIRECT reads.
WANTED = (
    abi.ATOMIC_O_TRUNC  # O_TRUNC comes with the OPEN, not as a separate SETATTR
    | abi.BIG_WRITES
    | abi.AUTO_INVAL_DATA  # a changed size or mtime drops a file's cached pages
    | abi.DO_READDIRPLUS  # listings carry attributes (always: the kernel then never asks READDIR)
    | abi.PARALLEL_DIROPS
    | abi.MAX_PAGES
)
MAX_WRITE = 1 << 20  # the largest WRITE (and READ) request: 256 pages, the kernel's usual cap
INIT_WAIT_S = 10.0
# What a signal may cut short (see Session._handle): a READ, and an OPEN, whose filesystem
# shields what it must not leave half done (fuse/ops.py: only fetching the file whole is cut).
INTERRUPTIBLE = frozenset({abi.READ, abi.OPEN})
PARKED_INTERRUPTS = 1024  # interrupts read before their request, kept at most


PR_SET_NAME = 15  # prctl(2)
_libc = ctypes.CDLL(None, use_errno=True)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` for the kernel too (``/proc/PID/task/TID/comm``: top -H,
    perf, the bench's CPU split by thread): Python before 3.14 names only its ``Thread`` object.
    The kernel keeps 15 bytes."""
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Conn:
    """What INIT settled."""

    minor: int
    flags: int
    max_write: int
    passthrough: bool

    @property
    def buffer_size(self) -> int:
        return max(8192, self.max_write + abi.HEADER_ROOM)


@dataclass(slots=True)
class Flight:
    """A request being served: the fd its answer goes back on, the buffer a READ fills, and the
    cancel scope an interrupt cancels."""

    device: Device
    out: memoryview | None = None
    scope: trio.CancelScope | None = None
    interrupted: bool = False
    deferred: Deferred | None = None  # work the handler left to the reader thread
    reply_to: memoryview | None = None  # a deferred READ's buffer


class InFlight:
    """unique -> Flight, shared by the readers (and the trio loop) under a lock. An INTERRUPT may
    be read by another reader before its request is registered: it waits here (parked)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.flights: dict[int, Flight] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()

    def add(self, unique: int, flight: Flight) -> None:
        with self.lock:
            if unique in self.parked:
                del self.parked[unique]
                flight.interrupted = True
            self.flights[unique] = flight

    def drop(self, unique: int) -> None:
        with self.lock:
            self.flights.pop(unique, None)

    def attach(self, unique: int, scope: trio.CancelScope) -> bool:
        """Give the request its cancel scope; False when it was interrupted already."""
        with self.lock:
            flight = self.flights.get(unique)
            if flight is None:
                return True
            flight.scope = scope
            return not flight.interrupted

    def interrupt(self, unique: int) -> trio.CancelScope | None:
        with self.lock:
            flight = self.flights.get(unique)
            if flight is None:
                self.parked[unique] = None
                while len(self.parked) > PARKED_INTERRUPTS:
                    self.parked.popitem(last=False)
                return None
            flight.interrupted = True
            return flight.scope


class BackingFiles:
    """Passthrough backing files registered with the kernel: one per node while any open of it
    uses it (the kernel's rule), counted over opens and closed at the last release."""

    def __init__(self):
        self.by_node: dict[int, list] = {}  # nodeid -> [backing id, opens, (st_dev, st_ino)]
        self.node_of: dict[int, int] = {}  # fh -> nodeid, for passthrough opens
        self.refused: str | None = None  # why passthrough is off for this mount, once refused

    def attach(self, device: Device, nodeid: int, fh: int, fd: int) -> int | None:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        held = self.by_node.get(nodeid)
        if held is not None:
            if held[2] != identity:
                return None  # another file backs this node's open handles
            held[1] += 1
        else:
            held = [device.backing_open(fd), 1, identity]
            self.by_node[nodeid] = held
        self.node_of[fh] = nodeid
        return held[0]

    def detach(self, device: Device, fh: int) -> None:
        nodeid = self.node_of.pop(fh, None)
        if nodeid is None:
            return
        held = self.by_node[nodeid]
        held[1] -= 1
        if held[1] == 0:
            del self.by_node[nodeid]
            try:
                device.backing_close(held[0])
            except OSError as exc:
                log.warning("cannot close passthrough backing file %d: %s", held[0], exc)

    def active(self, nodeid: int) -> bool:
        return nodeid in self.by_node


class Session:
    def __init__(
        self,
        fs: Filesystem,
        mountpoint: str,
        fsname: str,
        subtype: str = "ckptfs",
        options: Iterable[str] = (),
        max_threads: int = 16,
        passthrough: bool = True,
        on_refused: Callable[[int, str], None] | None = None,
    ):
        self.fs = fs
        self.mountpoint = mountpoint
        self.fsname = fsname
        self.subtype = subtype
        self.options = list(options)
        self.max_threads = max(1, max_threads)
        self.want_passthrough = passthrough
        # told (fh, why) when an open answered with a backing file goes out as a plain one
        self.on_refused = on_refused or (lambda fh, why: None)
        self.device: Device | None = None
        self.conn: Conn | None = None
        self.mounted = False
        self.inflight = InFlight()
        self.backing = BackingFiles()
        self.notifier: Notifier | None = None
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._devices: list[Device] = []
        self._idle = 0
        self._stopping = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._finished: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self.requests = 0  # answered, all readers (for status)
        self.passthrough_opens = 0

    # -- mount and INIT ------------------------------------------------------------------------
    def mount(self) -> None:
        """Mount and answer INIT (blocking, before the trio loop serves anything)."""
        self.device = mounting.mount(self.mountpoint, self.fsname, self.subtype, self.options)
        self.mounted = True
        self._devices.append(self.device)
        try:
            self.conn = self._handshake(self.device)
        except BaseException:
            self.close()
            raise
        self.notifier = Notifier(self.device, self.conn)

    def _handshake(self, device: Device) -> Conn:
        buf = bytearray(8192)
        deadline = time.monotonic() + INIT_WAIT_S
        while True:
            if time.monotonic() > deadline:
                raise mounting.MountFailed("the kernel sent no FUSE INIT")
            n = device.read(buf)
            if not n:
                continue
            req = Request.parse(memoryview(buf)[:n])
            if req.opcode != abi.INIT:
                raise mounting.MountFailed(f"FUSE request {req.opcode} before INIT")
            major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(req.body)
            if major > abi.KERNEL_MAJOR:  # it asks again with ours
                device.write(
                    wire.reply(req.unique, abi.INIT_OUT.pack(abi.KERNEL_MAJOR, abi.KERNEL_MINOR, *[0] * 10))
                )
                continue
            if major < abi.KERNEL_MAJOR or minor < abi.MIN_MINOR:
                device.write(wire.error(req.unique, errno.EPROTO))
                raise mounting.MountFailed(f"the kernel's FUSE protocol {major}.{minor} is too old")
            offered = flags
            if flags & abi.INIT_EXT and len(req.body) >= abi.INIT_IN.size + 4:
                offered |= abi.INIT_IN_FLAGS2.unpack_from(req.body, abi.INIT_IN.size)[0] << 32
            # A filesystem that clears set-id bits itself (flagged in WRITE, SETATTR and OPEN)
            # spares the kernel asking for security.capability before every write: a GETXATTR
            # round trip each, 0.4 ms per 8 MiB write through passthrough (docs/machine-facts.md).
            want = (WANTED | (abi.HANDLE_KILLPRIV_V2 if self.fs.clears_setid else 0)) & offered
            passthrough = bool(self.want_passthrough and offered & abi.PASSTHROUGH and os.geteuid() == 0)
            if passthrough:
                want |= abi.PASSTHROUGH | abi.INIT_EXT
            elif offered & abi.PASSTHROUGH == 0:
                self.backing.refused = "the kernel offers no FUSE passthrough (Linux 6.9 or later)"
            elif self.want_passthrough:
                self.backing.refused = "FUSE passthrough needs root (CAP_SYS_ADMIN)"
            max_pages = MAX_WRITE // 4096
            device.write(
                wire.reply(
                    req.unique,
                    abi.INIT_OUT.pack(
                        abi.KERNEL_MAJOR,
                        min(minor, abi.KERNEL_MINOR),
                        max_readahead,
                        want & 0xFFFFFFFF,
                        0,  # max_background: the kernel's default
                        0,
                        MAX_WRITE,
                        1,  # time_gran: nanoseconds
                        max_pages,
                        0,
                        want >> 32,
                        1 if passthrough else 0,  # max_stack_depth: backing files on a plain filesystem
                    ),
                )
            )
            return Conn(minor, want, MAX_WRITE, passthrough)

    def probe_passthrough(self, fd: int) -> bool:
        """Whether the kernel takes ``fd`` (a file where backing files will live) as a backing
        file: it refuses one on overlayfs (ELOOP) and a daemon without CAP_SYS_ADMIN in the
        initial user namespace (EPERM). Refused: passthrough is off for the mount."""
        if self.conn is None or not self.conn.passthrough or self.backing.refused or self.device is None:
            return False
        try:
            self.device.backing_close(self.device.backing_open(fd))
        except OSError as exc:
            self.backing.refused = f"the kernel refuses a backing file there ({os.strerror(exc.errno or 0)})"
            return False
        return True

    # -- serving -------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Serve until unmounted (or ``terminate``)."""
        assert self.device is not None and self.conn is not None, "mount() first"
        self._token = trio.lowlevel.current_trio_token()
        self._finished = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery  # (the answers handed off by the readers run here)
            self._start_reader(self.device)
            try:
                await self._finished.wait()
            finally:
                self._stopping = True
                nursery.cancel_scope.cancel()

    def terminate(self) -> None:
        """Stop serving (on the trio loop): unmount (lazily), let the readers end, and return
        from ``serve`` at once: a reader waiting for a handler stuck on the store ends when
        the loop cancels that handler."""
        self._stopping = True
        self._unmount()
        if self._finished is not None:
            self._finished.set()

    def close(self) -> None:
        """Unmount if still mounted, wait for the readers, close every fd (which ends the
        connection: processes still holding files of the mount get ENOTCONN)."""
        self._stopping = True
        self._unmount()
        deadline = time.monotonic() + 5
        for thread in list(self._readers):
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.notifier is not None:
            self.notifier.close()
        for device in self._devices:
            try:
                device.close()
            except OSError:
                pass
        self._devices.clear()

    def _unmount(self) -> None:
        if not self.mounted:
            return
        self.mounted = False
        if self.device is not None and self.device.gone():
            # Unmounted from outside (umount(8)) or aborted: the path is not ours to unmount, and
            # may hold another mount by now (libfuse checks for POLLERR too).
            return
        try:
            mounting.unmount(self.mountpoint)
        except OSError as exc:
            log.warning("cannot unmount %s: %s", self.mountpoint, exc)

    def _start_reader(self, device: Device) -> None:
        thread = threading.Thread(
            target=self._reader, args=(device,), name=f"ckptfs-fuse-{len(self._readers)}", daemon=True
        )
        with self._lock:
            self._readers.append(thread)
            self._idle += 1
        thread.start()

    def _grow(self) -> None:
        """Called by a reader that took the last idle slot: one more reader, on a cloned fd."""
        with self._lock:
            if self._stopping or len(self._readers) >= self.max_threads:
                return
        assert self.device is not None
        try:
            device = self.device.clone()
        except OSError as exc:
            log.warning("cannot clone /dev/fuse (%s): %d readers", exc, len(self._readers))
            self.max_threads = len(self._readers)
            return
        self._devices.append(device)
        self._start_reader(device)

    def _reader(self, device: Device) -> None:
        assert self.conn is not None and self._token is not None
        name_os_thread(threading.current_thread().name)
        token = self._token
        buf = bytearray(self.conn.buffer_size)
        view = memoryview(buf)
        out: memoryview | None = None
        try:
            while not self._stopping:
                try:
                    n = device.read(buf)
                except Disconnected:
                    self.mounted = False  # (unmounted from outside, or aborted: nothing left to unmount)
                    break
                if not n:
                    continue
                try:
                    req = Request.parse(view[:n])
                except ProtocolError as exc:
                    log.error("bad FUSE request: %s", exc)
                    continue
                if req.opcode in (abi.FORGET, abi.BATCH_FORGET):
                    self._forget(token, req)
                    continue
                if req.opcode == abi.INTERRUPT:
                    self._interrupt(token, req)
                    continue
                if req.opcode not in (abi.READ, abi.WRITE):
                    self._hand_off(token, device, req)
                    continue
                with self._lock:
                    self._idle -= 1
                    grow = self._idle == 0
                if grow:
                    self._grow()
                try:
                    if req.opcode == abi.READ and out is None:
                        out = memoryview(bytearray(self.conn.max_write))
                    flight = Flight(device, out)
                    self.inflight.add(req.unique, flight)
                    try:
                        iov = trio.from_thread.run(self._handle, req, flight, trio_token=token)
                        if flight.deferred is not None:
                            iov = trio.from_thread.run(
                                self._finish, req, flight, self._run(flight), trio_token=token
                            )
                    except (trio.RunFinishedError, trio.Cancelled):
                        break
                    try:
                        device.write(iov)
                    except Disconnected:
                        break
                    except OSError as exc:
                        self._answer_failed(device, req, exc)
                    finally:
                        self.inflight.drop(req.unique)
                    self.requests += 1
                finally:
                    with self._lock:
                        self._idle += 1
        except Exception:
            log.exception("FUSE reader failed")
        finally:
            self._reader_done(token)

    def _hand_off(self, token: trio.lowlevel.TrioToken, device: Device, req: Request) -> None:
        """A request without data is answered from the loop, on this reader's fd: the reader goes
        back to reading at once (one wakeup per request instead of two, which on these VMs is
        most of a small request's cost). Its input is small: copied out of the reader's buffer."""
        copy = Request(
            req.opcode, req.unique, req.nodeid, req.uid, req.gid, req.pid, memoryview(bytes(req.body))
        )
        flight = Flight(device)
        self.inflight.add(req.unique, flight)
        try:
            token.run_sync_soon(self._spawn_answer, copy, flight)
        except trio.RunFinishedError:
            self.inflight.drop(req.unique)

    def _spawn_answer(self, req: Request, flight: Flight) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._answer, req, flight)

    async def _answer(self, req: Request, flight: Flight) -> None:
        try:
            iov = await self._handle(req, flight)
            try:
                flight.device.write(iov)
            except Disconnected:
                pass
            except OSError as exc:
                self._answer_failed(flight.device, req, exc)
            self.requests += 1
        finally:
            self.inflight.drop(req.unique)

    @staticmethod
    def _answer_failed(device: Device, req: Request, exc: OSError) -> None:
        """The kernel refused an answer (a bug of ours): answer EIO instead, so the caller does
        not wait forever."""
        log.error("cannot answer FUSE request %d: %s", req.opcode, exc)
        try:
            device.write(wire.error(req.unique, errno.EIO))
        except (OSError, Disconnected):
            pass

    def _reader_done(self, token: trio.lowlevel.TrioToken) -> None:
        self._stopping = True  # (one reader gone means the connection is)
        with self._lock:
            self._readers.remove(threading.current_thread())
            last = not self._readers
        if last and self._finished is not None:
            try:
                token.run_sync_soon(self._finished.set)
            except trio.RunFinishedError:
                pass

    def _forget(self, token: trio.lowlevel.TrioToken, req: Request) -> None:
        if req.opcode == abi.FORGET:
            items = [(req.nodeid, abi.FORGET_IN.unpack_from(req.body)[0])]
        else:
            count, _ = abi.BATCH_FORGET_IN.unpack_from(req.body)
            items = list(abi.FORGET_ONE.iter_unpack(req.body[abi.BATCH_FORGET_IN.size :][: count * 16]))
        try:
            token.run_sync_soon(self._run_forget, items)
        except trio.RunFinishedError:
            pass

    def _run_forget(self, items) -> None:
        try:
            self.fs.forget(items)
        except Exception:
            log.exception("forget failed")

    def _interrupt(self, token: trio.lowlevel.TrioToken, req: Request) -> None:
        (target,) = abi.INTERRUPT_IN.unpack_from(req.body)
        scope = self.inflight.interrupt(target)
        if scope is not None:
            try:
                token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass

    @staticmethod
    def _run(flight: Flight) -> Exception | None:
        """A handler's deferred copies, here on the reader thread."""
        assert flight.deferred is not None
        try:
            flight.deferred.run()
        except Exception as exc:
            return exc
        return None

    async def _finish(self, req: Request, flight: Flight, failed: Exception | None) -> list:
        assert flight.deferred is not None
        try:
            written = await flight.deferred.finish(failed)
        except FuseError as exc:
            return wire.error(req.unique, exc.errno)
        except Exception:
            log.exception("FUSE request %d failed", req.opcode)
            return wire.error(req.unique, errno.EIO)
        if req.opcode == abi.READ:
            assert flight.reply_to is not None
            return wire.reply(req.unique, flight.reply_to[:written])
        return wire.reply(req.unique, abi.WRITE_OUT.pack(written, 0))

    async def _handle(self, req: Request, flight: Flight) -> list:
        """The answer to one request (on the trio loop): what the handler returns, or its errno."""
        handler = self._handlers.get(req.opcode)
        if handler is None:
            return wire.error(req.unique, errno.ENOSYS)
        ctx = Ctx(req.uid, req.gid, req.pid, 0, req.unique)
        try:
            if req.opcode not in INTERRUPTIBLE:
                return await handler(self, req, ctx, flight)
            # A cancelled handler leaves nothing half done for these (a read only waits; an
            # open shields all but its wait).
            with trio.CancelScope() as scope:
                if not self.inflight.attach(req.unique, scope):
                    scope.cancel()
                return await handler(self, req, ctx, flight)
            return wire.error(req.unique, errno.EINTR)
        except FuseError as exc:
            return wire.error(req.unique, exc.errno)
        except (ProtocolError, ValueError, IndexError) as exc:
            log.error("malformed FUSE request %d: %s", req.opcode, exc)
            return wire.error(req.unique, errno.EINVAL)
        except Exception:
            # (the filesystem's own boundary turns its failures into errno; this is a safety net)
            log.exception("FUSE request %d failed", req.opcode)
            return wire.error(req.unique, errno.EIO)

    # -- one handler per opcode: parse, call the filesystem, encode ------------------------------------
    async def _lookup(self, req, ctx, flight):
        (name,) = wire.split_names(req.body, 1)
        return wire.reply(req.unique, wire.entry_out(await self.fs.lookup(req.nodeid, name, ctx)))

    async def _getattr(self, req, ctx, flight):
        return wire.reply(req.unique, wire.attr_out(await self.fs.getattr(req.nodeid, ctx)))

    async def _setattr(self, req, ctx, flight):
        f = abi.SETATTR_IN.unpack_from(req.body)
        valid, fh, size, atime, mtime = f[0], f[2], f[3], f[5], f[6]
        atimensec, mtimensec, mode, uid, gid = f[8], f[9], f[11], f[13], f[14]
        now = time.time_ns()
        attr = EntryAttributes(
            st_mode=mode,
            st_uid=uid,
            st_gid=gid,
            st_size=size,
            st_atime_ns=now if valid & abi.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimensec,
            st_mtime_ns=now if valid & abi.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimensec,
        )
        fields = SetattrFields(
            update_mode=bool(valid & abi.FATTR_MODE),
            update_uid=bool(valid & abi.FATTR_UID),
            update_gid=bool(valid & abi.FATTR_GID),
            update_size=bool(valid & abi.FATTR_SIZE),
            update_atime=bool(valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW)),
            update_mtime=bool(valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW)),
            # (nothing to set: the kernel's file_remove_privs for a passthrough write it made
            # itself, sent only when the writer lacks CAP_FSETID and set-id bits must go)
            kill_setid=bool(valid & abi.FATTR_KILL_SUIDGID) or valid == 0,
        )
        handle = fh if valid & abi.FATTR_FH else None
        result = await self.fs.setattr(req.nodeid, attr, fields, handle, ctx)
        return wire.reply(req.unique, wire.attr_out(result))

    async def _readlink(self, req, ctx, flight):
        return wire.reply(req.unique, await self.fs.readlink(req.nodeid, ctx))

    async def _symlink(self, req, ctx, flight):
        name, target = wire.split_names(req.body, 2)
        return wire.reply(req.unique, wire.entry_out(await self.fs.symlink(req.nodeid, name, target, ctx)))

    async def _mknod(self, req, ctx, flight):
        mode, rdev, umask, _ = abi.MKNOD_IN.unpack_from(req.body)
        ctx.umask = umask
        (name,) = wire.split_names(req.body[abi.MKNOD_IN.size :], 1)
        return wire.reply(req.unique, wire.entry_out(await self.fs.mknod(req.nodeid, name, mode, rdev, ctx)))

    async def _mkdir(self, req, ctx, flight):
        mode, umask = abi.MKDIR_IN.unpack_from(req.body)
        ctx.umask = umask
        (name,) = wire.split_names(req.body[abi.MKDIR_IN.size :], 1)
        return wire.reply(req.unique, wire.entry_out(await self.fs.mkdir(req.nodeid, name, mode, ctx)))

    async def _unlink(self, req, ctx, flight):
        (name,) = wire.split_names(req.body, 1)
        await self.fs.unlink(req.nodeid, name, ctx)
        return wire.reply(req.unique)

    async def _rmdir(self, req, ctx, flight):
        (name,) = wire.split_names(req.body, 1)
        await self.fs.rmdir(req.nodeid, name, ctx)
        return wire.reply(req.unique)

    async def _rename(self, req, ctx, flight):
        if req.opcode == abi.RENAME2:
            newdir, flags, _ = abi.RENAME2_IN.unpack_from(req.body)
            names = req.body[abi.RENAME2_IN.size :]
        else:
            (newdir,), flags = abi.RENAME_IN.unpack_from(req.body), 0
            names = req.body[abi.RENAME_IN.size :]
        old, new = wire.split_names(names, 2)
        await self.fs.rename(req.nodeid, old, newdir, new, flags, ctx)
        return wire.reply(req.unique)

    async def _link(self, req, ctx, flight):
        (oldnodeid,) = abi.LINK_IN.unpack_from(req.body)
        (name,) = wire.split_names(req.body[abi.LINK_IN.size :], 1)
        return wire.reply(req.unique, wire.entry_out(await self.fs.link(oldnodeid, req.nodeid, name, ctx)))

    def _open_out(self, nodeid: int, info: FileInfo, flight: Flight) -> bytes:
        flags = (abi.FOPEN_DIRECT_IO if info.direct_io else 0) | (
            abi.FOPEN_KEEP_CACHE if info.keep_cache else 0
        )
        backing_id = 0
        if (
            info.backing_fd is not None
            and self.conn is not None
            and self.conn.passthrough
            and not self.backing.refused
        ):
            try:
                backing_id = self.backing.attach(flight.device, nodeid, info.fh, info.backing_fd) or 0
            except OSError as exc:
                self.backing.refused = (
                    f"the kernel refused a passthrough backing file ({os.strerror(exc.errno or 0)})"
                )
                log.warning("%s: files are served through the daemon from now on", self.backing.refused)
            if backing_id:
                self.passthrough_opens += 1
                flags = abi.FOPEN_PASSTHROUGH | (flags & abi.FOPEN_DIRECT_IO)
        if info.backing_fd is not None and not backing_id:
            # Answered as a plain open: the filesystem must count it as one ("": only this open,
            # another file backs the node; else why passthrough is off for the mount).
            self.on_refused(info.fh, self.backing.refused or "")
        return abi.OPEN_OUT.pack(info.fh, flags, backing_id)

    async def _open(self, req, ctx, flight):
        flags, open_flags = abi.OPEN_IN.unpack_from(req.body)
        ctx.kill_setid = bool(open_flags & abi.OPEN_KILL_SUIDGID)
        info = await self.fs.open(req.nodeid, flags, ctx)
        return wire.reply(req.unique, self._open_out(req.nodeid, info, flight))

    async def _create(self, req, ctx, flight):
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(req.body)
        ctx.umask = umask
        (name,) = wire.split_names(req.body[abi.CREATE_IN.size :], 1)
        info, entry = await self.fs.create(req.nodeid, name, mode, flags, ctx)
        nodeid = entry.nodeid or entry.st_ino
        return wire.reply(req.unique, wire.entry_out(entry), self._open_out(nodeid, info, flight))

    async def _read(self, req, ctx, flight):
        fh, offset, size = abi.READ_IN.unpack_from(req.body)[:3]
        out = (
            flight.out if flight.out is not None and size <= len(flight.out) else memoryview(bytearray(size))
        )
        n = await self.fs.read(fh, offset, out[:size])
        if isinstance(n, Deferred):
            flight.deferred, flight.reply_to = n, out
            return []  # (the answer comes from _finish)
        return wire.reply(req.unique, out[:n])

    async def _write(self, req, ctx, flight):
        fh, offset, size, write_flags = abi.WRITE_IN.unpack_from(req.body)[:4]
        data = req.body[abi.WRITE_IN.size : abi.WRITE_IN.size + size]
        if len(data) != size:
            raise ProtocolError(f"WRITE of {size} bytes carries {len(data)}")
        written = await self.fs.write(fh, offset, data, bool(write_flags & abi.WRITE_KILL_SUIDGID))
        if isinstance(written, Deferred):
            flight.deferred = written
            return []  # (the answer comes from _finish)
        return wire.reply(req.unique, abi.WRITE_OUT.pack(written, 0))

    async def _flush(self, req, ctx, flight):
        (fh,) = abi.FLUSH_IN.unpack_from(req.body)[:1]
        await self.fs.flush(fh, ctx)
        return wire.reply(req.unique)

    async def _release(self, req, ctx, flight):
        (fh,) = abi.RELEASE_IN.unpack_from(req.body)[:1]
        try:
            await self.fs.release(fh)
        finally:
            self.backing.detach(flight.device, fh)
        return wire.reply(req.unique)

    async def _fsync(self, req, ctx, flight):
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        await self.fs.fsync(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return wire.reply(req.unique)

    async def _opendir(self, req, ctx, flight):
        fh = await self.fs.opendir(req.nodeid, ctx)
        return wire.reply(req.unique, abi.OPEN_OUT.pack(fh, 0, 0))

    async def _readdir(self, req, ctx, flight):
        fh, offset, size = abi.READ_IN.unpack_from(req.body)[:3]
        plus = req.opcode == abi.READDIRPLUS
        pieces, used = [], 0
        for name, entry, next_offset in await self.fs.readdir(fh, offset):
            piece = wire.dirent(name, entry, next_offset, plus)
            if used + len(piece) > size:
                break
            pieces.append(piece)
            used += len(piece)
            if plus:
                self.fs.entry_sent(entry)
        return wire.reply(
            req.unique, b"".join(pieces)
        )  # (one piece: a reply of 1 MiB holds more entries than IOV_MAX)

    async def _releasedir(self, req, ctx, flight):
        (fh,) = abi.RELEASE_IN.unpack_from(req.body)[:1]
        await self.fs.releasedir(fh)
        return wire.reply(req.unique)

    async def _fsyncdir(self, req, ctx, flight):
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        await self.fs.fsyncdir(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return wire.reply(req.unique)

    async def _statfs(self, req, ctx, flight):
        return wire.reply(req.unique, wire.statfs_out(await self.fs.statfs(ctx)))

    @staticmethod
    def _sized(req: Request, value: bytes, size: int) -> list:
        """An xattr answer: its length when asked with size 0, ERANGE when it does not fit."""
        if size == 0:
            return wire.reply(req.unique, abi.GETXATTR_OUT.pack(len(value), 0))
        if len(value) > size:
            return wire.error(req.unique, errno.ERANGE)
        return wire.reply(req.unique, value)

    async def _getxattr(self, req, ctx, flight):
        size, _ = abi.GETXATTR_IN.unpack_from(req.body)
        (name,) = wire.split_names(req.body[abi.GETXATTR_IN.size :], 1)
        return self._sized(req, await self.fs.getxattr(req.nodeid, name, ctx), size)

    async def _listxattr(self, req, ctx, flight):
        size, _ = abi.GETXATTR_IN.unpack_from(req.body)
        names = await self.fs.listxattr(req.nodeid, ctx)
        return self._sized(req, b"".join(n + b"\0" for n in names), size)

    async def _setxattr(self, req, ctx, flight):
        size, flags = abi.SETXATTR_IN.unpack_from(req.body)
        rest = bytes(req.body[abi.SETXATTR_IN.size :])
        name, _, value = rest.partition(b"\0")
        await self.fs.setxattr(req.nodeid, name, value[:size], flags, ctx)
        return wire.reply(req.unique)

    async def _removexattr(self, req, ctx, flight):
        (name,) = wire.split_names(req.body, 1)
        await self.fs.removexattr(req.nodeid, name, ctx)
        return wire.reply(req.unique)

    async def _destroy(self, req, ctx, flight):
        self._stopping = True
        return wire.reply(req.unique)

    _handlers = {
        abi.LOOKUP: _lookup,
        abi.GETATTR: _getattr,
        abi.SETATTR: _setattr,
        abi.READLINK: _readlink,
        abi.SYMLINK: _symlink,
        abi.MKNOD: _mknod,
        abi.MKDIR: _mkdir,
        abi.UNLINK: _unlink,
        abi.RMDIR: _rmdir,
        abi.RENAME: _rename,
        abi.RENAME2: _rename,
        abi.LINK: _link,
        abi.OPEN: _open,
        abi.CREATE: _create,
        abi.READ: _read,
        abi.WRITE: _write,
        abi.FLUSH: _flush,
        abi.RELEASE: _release,
        abi.FSYNC: _fsync,
        abi.OPENDIR: _opendir,
        abi.READDIR: _readdir,
        abi.READDIRPLUS: _readdir,
        abi.RELEASEDIR: _releasedir,
        abi.FSYNCDIR: _fsyncdir,
        abi.STATFS: _statfs,
        abi.GETXATTR: _getxattr,
        abi.LISTXATTR: _listxattr,
        abi.SETXATTR: _setxattr,
        abi.REMOVEXATTR: _removexattr,
        abi.DESTROY: _destroy,
    }


class Notifier:
    """What the daemon tells the kernel unasked: drop a node's cached pages and attributes, put
    bytes in its page cache (synchronous, from any thread but the trio loop's handlers), and drop
    a name (queued to one thread: the kernel makes it wait for requests in flight on that
    directory, which may be waiting for the trio loop)."""

    QUEUE = 4096

    def __init__(self, device: Device, conn: Conn):
        self.device = device
        self.conn = conn
        self._queue: list[tuple[int, bytes]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def inval_inode(self, nodeid: int) -> None:
        self._send(wire.notification(abi.NOTIFY_INVAL_INODE, abi.NOTIFY_INVAL_INODE_OUT.pack(nodeid, 0, 0)))

    def store(self, nodeid: int, offset: int, data) -> None:
        head = abi.NOTIFY_STORE_OUT.pack(nodeid, offset, len(data), 0)
        self._send(wire.notification(abi.NOTIFY_STORE, head, data))

    def inval_entry(self, parent: int, name: bytes) -> None:
        with self._cond:
            if self._closed:
                return
            if len(self._queue) >= self.QUEUE:
                self.dropped += 1  # (the entry then expires with its timeout)
                return
            self._queue.append((parent, name))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="ckptfs-fuse-notify", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _send(self, iov) -> None:
        try:
            self.device.write(iov)
        except Disconnected:
            pass

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                parent, name = self._queue.pop(0)
            head = abi.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0)
            try:
                self._send(wire.notification(abi.NOTIFY_INVAL_ENTRY, head, name, b"\0"))
            except OSError as exc:
                log.debug("cannot drop the kernel's entry %r: %s", name, exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
