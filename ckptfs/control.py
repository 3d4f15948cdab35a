"""The admin channel between the ``ckptfs`` command and a running daemon.

A Unix stream socket at ``control_socket_path(mountpoint)`` speaks newline-delimited
JSON. The client sends one request ``{"cmd": NAME, ...args}``; the server answers
with zero or more ``{"progress": {...}}`` lines, then exactly one
``{"result": {...}}`` or ``{"error": "one line"}``, and closes the connection.

A new command is a new entry in the handler dict given to ``ControlServer``::

    async def handle_sync(request: dict, progress: Progress) -> dict:
        await progress({"pending_files": 3, "pending_bytes": 10, "total_bytes": 20})
        return {"synced_files": 3}

A handler raises ``CkptfsError`` for an error the user should read. If the client
hangs up (Ctrl-C), the handler is cancelled; one that must finish anyway shields
itself (``trio.CancelScope(shield=True)``).

Only the daemon's own (effective) uid and root may use the socket: the directory is
0700, the socket 0600, and each peer is checked with SO_PEERCRED. The client finds the
socket from the mount's owner in the mount table (``socket_of``).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import select
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from ckptfs import private
from ckptfs.config import control_socket_path, mount_owner
from ckptfs.errors import CkptfsError, ControlError, MountError, TimedOut, one_line

log = logging.getLogger(__name__)

Progress = Callable[[dict], Awaitable[None]]
Handler = Callable[[dict, Progress], Awaitable[dict]]

MAX_REQUEST_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10.0  # a client that connects must send its request promptly


class NoDaemon(ControlError):
    """Nothing listens on the mount's control socket (not mounted, or the daemon died)."""


def _encode(message: dict) -> bytes:
    # json.dumps escapes control characters, so the line never contains a raw newline.
    return json.dumps(message).encode() + b"\n"


def _peer_uid(sock: Any) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class ControlServer:
    def __init__(self, socket_path: str | os.PathLike, handlers: dict[str, Handler]):
        self.socket_path = Path(socket_path)
        self.handlers: dict[str, Handler] = dict(handlers)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the socket file is removed on the way out."""
        sock = await self._bind()
        ino = os.stat(self.socket_path).st_ino
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_connection, [trio.SocketListener(sock)])
                task_status.started()
        finally:
            sock.close()
            # Remove the file only if it is still ours (a newer daemon may have replaced it).
            try:
                if os.stat(self.socket_path).st_ino == ino:
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    async def _bind(self) -> trio.socket.SocketType:
        path = self.socket_path
        _ensure_private_dir(path.parent)
        if path.exists() or path.is_symlink():
            if await _is_listening(path):
                raise ControlError(f"control socket {path} is in use by another running daemon")
        # Bind under a temporary name, restrict it, then rename over any stale
        # socket: the final path is never visible with loose permissions.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(str(tmp))
            os.chmod(tmp, 0o600)
            sock.listen(64)
            os.replace(tmp, path)
        except BaseException:
            sock.close()
            tmp.unlink(missing_ok=True)
            raise
        return sock

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        # Never raises: one bad connection must not take the server down.
        try:
            async with stream:
                # Read the request even from a peer we refuse: closing with unread
                # data would reset the connection before the client sees why.
                with trio.move_on_after(REQUEST_TIMEOUT_S) as timer:
                    request, error = await _read_request(stream)
                if timer.cancelled_caught:
                    return
                uid = _peer_uid(stream.socket)
                if uid not in (0, os.geteuid()):
                    log.warning("control: refused a connection from uid %d", uid)
                    error = "permission denied: only the user who mounted this filesystem (or root) may control it"
                if error is not None:
                    await stream.send_all(_encode({"error": error}))
                    return
                reply = await self._answer(stream, request)
                if reply is not None:
                    await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        except Exception:
            log.exception("control: connection failed")

    async def _answer(self, stream: trio.SocketStream, request: dict) -> bytes | None:
        """Run the handler; returns the final line, or None if the client hung up."""
        cmd = request["cmd"]
        handler = self.handlers.get(cmd)
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            return _encode({"error": f"unknown command {cmd!r} (this daemon knows: {known})"})

        reply: bytes | None = None
        async with trio.open_nursery() as nursery:
            scope = nursery.cancel_scope
            sending = trio.Lock()  # a handler may report from several tasks

            async def progress(update: dict) -> None:
                try:
                    async with sending:
                        await stream.send_all(_encode({"progress": update}))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # delivers the cancellation to the handler

            nursery.start_soon(_cancel_on_hangup, stream, scope)
            try:
                result = await handler(request, progress)
                reply = _encode({"result": {} if result is None else result})
            except CkptfsError as e:
                timed_out = {"timed_out": True} if isinstance(e, TimedOut) else {}  # (a client raises TimedOut)
                reply = _encode({"error": one_line(e) or type(e).__name__, **timed_out})
            except Exception as e:
                log.exception("control: command %r failed", cmd)
                reply = _encode({"error": f"internal error in {cmd!r} ({type(e).__name__}); see the daemon log"})
            scope.cancel()  # stops the hang-up watcher
        return reply


async def _read_request(stream: trio.SocketStream) -> tuple[dict, str | None]:
    buf = b""
    while b"\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            return {}, "request too large"
    try:
        request = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return {}, "malformed request: expected one line of JSON"
    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
        return {}, 'malformed request: expected {"cmd": NAME, ...}'
    return request, None


async def _cancel_on_hangup(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        while await stream.receive_some(65536):
            pass  # clients send nothing after the request; ignore it
        # EOF: the client closed, or only shut down its sending side (socat, nc -N)
        # and still reads. POLLHUP tells them apart on a Unix socket.
        while not _hung_up(stream.socket.fileno()):
            await trio.sleep(1)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


def _hung_up(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


async def _is_listening(path: Path) -> bool:
    probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with trio.move_on_after(2):
            await probe.connect(str(path))
        return True  # connected, or a connect that hangs: a live (busy) listener
    except OSError:
        return False  # refused: a stale file left by a dead daemon
    finally:
        probe.close()


def _ensure_private_dir(directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        private.ensure_dir(directory, "control socket directory")
    except MountError as exc:
        raise ControlError(str(exc)) from None


# --- client -------------------------------------------------------------------


def call(
    mountpoint: str | os.PathLike,
    cmd: str,
    args: dict | None = None,
    on_progress: Callable[[dict], None] | None = None,
    timeout: float | None = None,
) -> dict:
    """Send one command to the daemon serving ``mountpoint``; return its result.

    ``on_progress`` receives each progress dict; ``timeout`` bounds the whole call.
    Raises NoDaemon if nothing serves there, ControlError with the daemon's text otherwise.
    """
    mountpoint = os.path.abspath(mountpoint)
    return call_socket(socket_of(mountpoint), cmd, args, on_progress, timeout, name=mountpoint)


def socket_of(mountpoint: str) -> Path:
    """The control socket of the daemon serving ``mountpoint``, found from who mounted it (the
    mount table's user_id=): each user's daemon keeps its socket in that user's runtime dir.

    ControlError for another user's mount unless we are root: the daemon would refuse us anyway,
    and nothing we could find in our own runtime dir is its socket.
    """
    me, owner = os.geteuid(), mount_owner(mountpoint)
    if owner is None or owner == me:
        return control_socket_path(mountpoint)
    if me != 0:
        raise ControlError(f"permission denied: the ckptfs mount at {mountpoint} belongs to {_user(owner)}; "
                           "only that user or root may control it")
    name = control_socket_path(mountpoint).name
    # Where a daemon run by that user puts its socket (config.runtime_dir), in a directory only it owns.
    for directory in (Path(f"/run/user/{owner}/ckptfs"), Path(f"/tmp/ckptfs-{owner}")):
        try:
            st = os.lstat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == owner and (directory / name).exists():
            return directory / name
    raise ControlError(f"cannot find the control socket of the ckptfs mount at {mountpoint} (mounted by "
                       f"{_user(owner)}, who may have set XDG_RUNTIME_DIR): ask that user, or if its daemon "
                       f"is gone, unmount it with 'umount -l {mountpoint}'")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def call_socket(
    socket_path: str | os.PathLike,
    cmd: str,
    args: dict | None = None,
    on_progress: Callable[[dict], None] | None = None,
    timeout: float | None = None,
    *,
    name: str | None = None,
) -> dict:
    """``call`` on an explicit socket path; ``name`` is what error messages call the mount."""
    name = name or str(socket_path)
    deadline = None if timeout is None else time.monotonic() + timeout
    if args and "cmd" in args:
        raise ValueError("'cmd' is reserved in control requests")

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout)
            sock.connect(os.fspath(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoDaemon(f"no ckptfs mount at {name}") from None
        except PermissionError:
            raise ControlError(f"permission denied on the control socket of {name} (mounted by another user?)") from None
        except TimeoutError:
            raise ControlError(f"the ckptfs daemon at {name} did not accept the connection within {timeout:g} s") from None

        try:
            try:
                sock.sendall(_encode({"cmd": cmd, **(args or {})}))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered early (a refusal) and closed: read why below
            buf, scanned = bytearray(), 0  # (grown in place, searched only where new: a catalog
            while True:                      # answer of ~100 MiB must not be copied per chunk)
                while (end := buf.find(b"\n", scanned)) >= 0:
                    line = bytes(buf[:end])
                    del buf[:end + 1]
                    scanned = 0
                    message = _decode(line, name)
                    if "progress" in message:
                        if on_progress is not None:
                            on_progress(message["progress"])
                    elif "result" in message:
                        return message["result"]
                    elif "error" in message:
                        raise (TimedOut if message.get("timed_out") else ControlError)(str(message["error"]))
                if deadline is not None:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(65536)
                if not chunk:
                    raise ControlError(f"the ckptfs daemon at {name} closed the connection without an answer (see its log)")
                scanned = len(buf)
                buf += chunk
        except TimedOut:
            raise  # the daemon's own answer (a TimeoutError too)
        except TimeoutError:
            raise ControlError(f"no answer from the ckptfs daemon at {name} within {timeout:g} s") from None
        except (ConnectionResetError, BrokenPipeError):
            raise ControlError(f"the ckptfs daemon at {name} dropped the connection (see its log)") from None
    finally:
        sock.close()


def _decode(line: bytes, name: str) -> dict:
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        raise ControlError(f"the ckptfs daemon at {name} sent a malformed answer")
    return message
