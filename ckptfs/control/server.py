"""The daemon's side of the admin channel (the protocol and the client are in control/client.py):
a trio server on the mount's Unix socket, one handler per command, peers checked with
SO_PEERCRED. Kept apart so the ``ckptfs`` commands start without importing trio."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from ckptfs.control.client import MAX_REQUEST_BYTES, encode_message
from ckptfs.errors import CkptfsError, ControlError, MountError, TimedOut, one_line
from ckptfs.util import private_files

log = logging.getLogger(__name__)

Progress = Callable[[dict], Awaitable[None]]
Handler = Callable[[dict, Progress], Awaitable[dict]]

REQUEST_TIMEOUT_S = 10.0  # a client that connects must send its request promptly


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
                    await stream.send_all(encode_message({"error": error}))
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
            return encode_message({"error": f"unknown command {cmd!r} (this daemon knows: {known})"})

        reply: bytes | None = None
        async with trio.open_nursery() as nursery:
            scope = nursery.cancel_scope
            sending = trio.Lock()  # a handler may report from several tasks

            async def progress(update: dict) -> None:
                try:
                    async with sending:
                        await stream.send_all(encode_message({"progress": update}))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # delivers the cancellation to the handler

            nursery.start_soon(_cancel_on_hangup, stream, scope)
            try:
                result = await handler(request, progress)
                reply = encode_message({"result": {} if result is None else result})
            except CkptfsError as e:
                timed_out = (
                    {"timed_out": True} if isinstance(e, TimedOut) else {}
                )  # (a client raises TimedOut)
                reply = encode_message({"error": one_line(e) or type(e).__name__, **timed_out})
            except Exception as e:
                log.exception("control: command %r failed", cmd)
                reply = encode_message(
                    {"error": f"internal error in {cmd!r} ({type(e).__name__}); see the daemon log"}
                )
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
        private_files.ensure_dir(directory, "control socket directory")
    except MountError as exc:
        raise ControlError(str(exc)) from None
