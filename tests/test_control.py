"""The admin channel: a real ControlServer on a Unix socket, driven by the blocking client."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from ckptfs.control import client as control_client
from ckptfs.control.server import ControlServer
from ckptfs.errors import CkptfsError, ControlError
from tests.support.harness import trio_test

pytestmark = pytest.mark.unit


@pytest.fixture
def sock_path():
    # A short directory: sockaddr_un holds only 108 bytes, pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ckt-") as d:
        yield Path(d) / "run" / "ctl.sock"


async def _echo(request: dict, progress) -> dict:
    return {"echo": request.get("value")}


async def _stream(request: dict, progress) -> dict:
    for left in range(3, 0, -1):
        await progress({"pending_files": left, "pending_bytes": left * 10, "total_bytes": 30})
    return {"done": True}


async def _user_error(request: dict, progress) -> dict:
    raise CkptfsError("sync timed out after 1 s with 2 files pending\nsecond line")


async def _bug(request: dict, progress) -> dict:
    raise RuntimeError("boom")


HANDLERS = {"echo": _echo, "stream": _stream, "user_error": _user_error, "bug": _bug}


def _with_server(sock_path: Path, handlers: dict, client) -> object:
    """Run ``client(sock_path)`` in a thread while a ControlServer serves; return its value."""

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(ControlServer(sock_path, handlers).serve)
            try:
                return await trio.to_thread.run_sync(client, sock_path)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


def test_commands_progress_and_errors(sock_path, caplog):
    def client(path):
        out = {}
        out["echo"] = control_client.call_socket(path, "echo", {"value": [1, "x"]})
        seen = []
        out["stream"] = control_client.call_socket(path, "stream", on_progress=seen.append)
        out["progress"] = seen
        for cmd in ("nope", "user_error", "bug"):
            with pytest.raises(ControlError) as e:
                control_client.call_socket(path, cmd)
            out[cmd] = str(e.value)
        out["after_bug"] = control_client.call_socket(path, "echo", {"value": 2}, timeout=5)
        out["mode"] = stat.S_IMODE(os.stat(path).st_mode)
        out["dir_mode"] = stat.S_IMODE(os.stat(path.parent).st_mode)
        return out

    out = _with_server(sock_path, HANDLERS, client)
    assert out["echo"] == {"echo": [1, "x"]}
    assert out["stream"] == {"done": True}
    assert [p["pending_files"] for p in out["progress"]] == [3, 2, 1]
    assert out["progress"][0] == {"pending_files": 3, "pending_bytes": 30, "total_bytes": 30}
    assert "unknown command 'nope'" in out["nope"] and "echo" in out["nope"]
    assert out["user_error"] == "sync timed out after 1 s with 2 files pending second line"
    assert "internal error" in out["bug"] and "boom" not in out["bug"]
    assert out["after_bug"] == {"echo": 2}  # the server survived the handler's bug
    assert out["mode"] == 0o600 and out["dir_mode"] == 0o700
    assert "boom" in caplog.text  # logged with its traceback
    assert not sock_path.exists()  # removed on shutdown


def test_stale_socket_is_replaced(sock_path):
    sock_path.parent.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nothing listens: what a killed daemon leaves
    assert _with_server(
        sock_path, HANDLERS, lambda p: control_client.call_socket(p, "echo", {"value": 1})
    ) == {"echo": 1}


@trio_test
async def test_live_socket_is_not_stolen(sock_path):
    async with trio.open_nursery() as nursery:
        await nursery.start(ControlServer(sock_path, HANDLERS).serve)
        with pytest.raises(ControlError, match="in use"):
            await ControlServer(sock_path, HANDLERS).serve()
        nursery.cancel_scope.cancel()


@trio_test
async def test_client_hangup_cancels_handler(sock_path):
    cancelled = trio.Event()

    async def wait_forever(request, progress):
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(ControlServer(sock_path, {"wait": wait_forever}).serve)
        with pytest.raises(ControlError, match="no answer"):
            await trio.to_thread.run_sync(lambda: control_client.call_socket(sock_path, "wait", timeout=0.5))
        with trio.fail_after(5):
            await cancelled.wait()
        nursery.cancel_scope.cancel()


def test_half_closed_client_gets_its_answer(sock_path):
    async def slow(request, progress):
        await trio.sleep(0.3)
        return {"ok": 1}

    def client(path):  # what `socat` does: send the request, shut down writing, read
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(b'{"cmd": "slow"}\n')
            s.shutdown(socket.SHUT_WR)
            return s.makefile("rb").read()

    assert _with_server(sock_path, {"slow": slow}, client) == b'{"result": {"ok": 1}}\n'


def test_malformed_request(sock_path):
    def client(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(b"not json\n")
            return s.makefile("rb").readline()

    assert b"malformed request" in _with_server(sock_path, HANDLERS, client)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_other_users_are_refused(sock_path):
    ask = (  # starts as root (the venv may be unreadable to nobody), then drops to nobody
        "import os, socket, sys\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.connect(sys.argv[1])\n"
        's.sendall(b\'{"cmd": "echo"}\\n\')\n'
        "print(s.makefile('rb').readline().decode())\n"
    )

    def client(path):
        for d in (
            path.parent.parent,
            path.parent,
        ):  # let the other user reach the socket: SO_PEERCRED decides
            os.chmod(d, 0o755)
        os.chmod(path, 0o666)
        done = subprocess.run(
            [sys.executable, "-c", ask, str(path)], capture_output=True, text=True, timeout=30
        )
        return done.stdout + done.stderr

    out = _with_server(sock_path, HANDLERS, client)
    assert "only the user who mounted this filesystem (or root) may control it" in out, out


def test_missing_socket(tmp_path):
    with pytest.raises(control_client.NoDaemon, match=f"no ckptfs mount at {tmp_path}"):
        control_client.call(tmp_path, "status")
    with pytest.raises(control_client.NoDaemon, match="no ckptfs mount at /x"):
        control_client.call_socket(tmp_path / "absent.sock", "status", name="/x")


def test_a_large_answer_is_read_in_linear_time(tmp_path):
    # A catalog of a mount with a million files is a ~100 MiB line: reading it must not copy the
    # buffer once per 64 KiB received (that took minutes, past the catalog's timeout).
    import threading
    import time

    path = tmp_path / "s"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    size = 100 << 20  # (one long string: what is measured is the reading, not the JSON decoding)
    answer = b'{"result": {"blob": "' + b"x" * size + b'"}}\n'

    def serve():
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    started = time.monotonic()
    try:
        result = control_client.call_socket(path, "catalog", {}, timeout=300)
    finally:
        server.close()
    elapsed = time.monotonic() - started
    assert len(result["blob"]) == size
    assert elapsed < 30, f"a {len(answer) >> 20} MiB answer took {elapsed:.0f} s to read"
