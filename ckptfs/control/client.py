"""The admin channel between the ``ckptfs`` command and a running daemon.

A Unix stream socket at ``control_socket_path(mountpoint)`` speaks newline-delimited
JSON. The client sends one request ``{"cmd": NAME, ...args}``; the server answers
with zero or more ``{"progress": {...}}`` lines, then exactly one
``{"result": {...}}`` or ``{"error": "one line"}``, and closes the connection.

A new command is a new entry in the handler dict given to ``ckptfs.control.server.ControlServer``::

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
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from ckptfs.config import control_socket_path, mount_owner
from ckptfs.errors import ControlError, TimedOut

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20


class NoDaemon(ControlError):
    """Nothing listens on the mount's control socket (not mounted, or the daemon died)."""


class Dropped(ControlError):
    """The daemon closed or reset the connection without an answer (it crashed, or is dying)."""


def encode_message(message: dict) -> bytes:
    # json.dumps escapes control characters, so the line never contains a raw newline.
    return json.dumps(message).encode() + b"\n"


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
        raise ControlError(
            f"permission denied: the ckptfs mount at {mountpoint} belongs to {_user(owner)}; "
            "only that user or root may control it"
        )
    name = control_socket_path(mountpoint).name
    # Where a daemon run by that user puts its socket (config.runtime_dir), in a directory only it owns.
    for directory in (Path(f"/run/user/{owner}/ckptfs"), Path(f"/tmp/ckptfs-{owner}")):
        try:
            st = os.lstat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == owner and (directory / name).exists():
            return directory / name
    raise ControlError(
        f"cannot find the control socket of the ckptfs mount at {mountpoint} (mounted by "
        f"{_user(owner)}, who may have set XDG_RUNTIME_DIR): ask that user, or if its daemon "
        f"is gone, unmount it with 'umount -l {mountpoint}'"
    )


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
            raise ControlError(
                f"permission denied on the control socket of {name} (mounted by another user?)"
            ) from None
        except TimeoutError:
            raise ControlError(
                f"the ckptfs daemon at {name} did not accept the connection within {timeout:g} s"
            ) from None

        try:
            try:
                sock.sendall(encode_message({"cmd": cmd, **(args or {})}))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered early (a refusal) and closed: read why below
            buf, scanned = bytearray(), 0  # (grown in place, searched only where new: a catalog
            while True:  # answer of ~100 MiB must not be copied per chunk)
                while (end := buf.find(b"\n", scanned)) >= 0:
                    line = bytes(buf[:end])
                    del buf[: end + 1]
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
                    raise Dropped(
                        f"the ckptfs daemon at {name} closed the connection without an answer (see its log)"
                    )
                scanned = len(buf)
                buf += chunk
        except TimedOut:
            raise  # the daemon's own answer (a TimeoutError too)
        except TimeoutError:
            raise ControlError(f"no answer from the ckptfs daemon at {name} within {timeout:g} s") from None
        except (ConnectionResetError, BrokenPipeError):
            raise Dropped(f"the ckptfs daemon at {name} dropped the connection (see its log)") from None
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
