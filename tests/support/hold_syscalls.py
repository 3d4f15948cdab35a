"""Hold the system calls by which a process tree changes a local store: one node's link to the
shared store directory in tests/support/cluster.py (root; Linux >= 5.5, x86_64 or aarch64).

    python tests/support/hold_syscalls.py serve STORE_DIR SOCKET    # prints "ready"
    python tests/support/hold_syscalls.py wrap SOCKET -- ARGV...      # e.g. ckptfs mount ...

(SOCKET: a Unix socket path; "@name" for the abstract name "\\0name". The script needs nothing
but the standard library.)

``wrap`` installs a seccomp filter that turns the calls below into user notifications, hands
the filter's listener to the ``serve`` process listening on SOCKET, and execs ARGV: every
process ARGV starts (a ckptfs daemon) carries the filter. ``serve`` looks at each such call: one
that changes nothing under STORE_DIR goes on at once (the kernel runs it as if never stopped);
one that changes the store waits, unanswered, while holding is on, until released (then it
runs) or dropped (then it fails with EIO, never run). Reads, listings and file writes are never
stopped at all.

The calls looked at: rename/renameat/renameat2, link/linkat, symlink/symlinkat, unlink/unlinkat,
rmdir, mkdir/mkdirat, mknod/mknodat, creat, open/openat with O_CREAT or O_TRUNC, truncate,
setxattr/lsetxattr/fsetxattr/setxattrat and removexattr/lremovexattr/fremovexattr/removexattrat.
A call's paths are read from the caller's memory and resolved against its descriptors
(/proc/TID/mem, /proc/TID/fd, /proc/TID/cwd).

What is held, on keys (paths relative to STORE_DIR): everything, except
  - keys under an excepted prefix (and, for mkdir, the directories above one: the local store
    makes them before it renames a record into place);
  - the local store's scratch space, ``.ckptfs-tmp/`` outside ``.ckptfs-tmp/uploads/``: the temp
    file an object is written to before the rename that publishes it (ckptfs/store/local_tree.py),
    and the directory a multipart upload is staged in before its rename into ``uploads/`` starts
    it. Nothing there is an object, a listing or an upload, as a request body in flight is none
    on S3: what publishes it (a rename, which names both paths) is held unless both pass.
So a held node's PUT, copy, delete, metadata change, multipart start, part (each takes a lock
file it creates), completion or abort changes nothing another node sees, as on S3 behind a held
proxy; the node's per-node records (excepted prefixes) still land. Writes into the file of a
published object are not looked at (the local store never writes one in place).

Why system calls and not a FUSE passthrough: a call held inside a FUSE filesystem holds the
kernel's locks taken before it (the parent directory's, and for a rename across directories the
filesystem's rename lock), so every other create, rename or first lookup there by the same node,
the excepted records included, would wait behind it. A seccomp notification stops the caller at
the system call's entry, before any lock.

Control: one command a line on stdin, one answer a line on stdout:
  ``hold ["prefix/", ...]``   hold from now on, except calls on keys under these prefixes
  ``release``                 held calls run; nothing is held from now on
  ``drop``                    held calls fail with EIO without running; so does every later
                              call that would change the store (the node is lost for good)
  ``count``                   the number of calls being held now (of callers still alive)
End of stdin (the test process died or is done): drop and exit (then a filtered call of a
process left behind fails with ENOSYS).
"""

from __future__ import annotations

import array  # noqa: F401 (socket.send_fds imports it: before the filter, not under it)
import ctypes
import errno
import json
import os
import platform
import select
import socket
import struct
import sys

SCRATCH = ".ckptfs-tmp"
SCRATCH_HELD = ".ckptfs-tmp/uploads/"

# seccomp
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
NOTIF_RECV = 0xC0502100  # SECCOMP_IOWR(0, struct seccomp_notif): 80 bytes
NOTIF_SEND = 0xC0182101  # SECCOMP_IOWR(1, struct seccomp_notif_resp): 24 bytes
NOTIF_ID_VALID = 0x40082102  # SECCOMP_IOW(2, __u64)
NOTIF = struct.Struct("=QII iI Q 6Q")  # id, pid, flags, then seccomp_data: nr, arch, ip, args
RESP = struct.Struct("=QqiI")  # id, val, error, flags
AT_FDCWD = -100
O_CREAT, O_TRUNC = 0o100, 0o1000

# BPF
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x06

# Per architecture: audit arch, and syscall number -> (name, how its paths are found). A path
# spec: ("at", dirfd_arg, path_arg) | ("path", path_arg) | ("fd", fd_arg); "open"/"openat" also
# name the argument holding their flags.
_COMMON = {  # the generic numbers (aarch64), also x86_64's for the newest calls
    "setxattrat": (463, [("at", 0, 1)]),
    "removexattrat": (466, [("at", 0, 1)]),
}
ARCHES = {
    "x86_64": (
        0xC000003E,
        {
            "open": (2, [("at", None, 0)]),
            "truncate": (76, [("at", None, 0)]),
            "rename": (82, [("at", None, 0), ("at", None, 1)]),
            "mkdir": (83, [("at", None, 0)]),
            "rmdir": (84, [("at", None, 0)]),
            "creat": (85, [("at", None, 0)]),
            "link": (86, [("at", None, 1)]),
            "unlink": (87, [("at", None, 0)]),
            "symlink": (88, [("at", None, 1)]),
            "mknod": (133, [("at", None, 0)]),
            "setxattr": (188, [("at", None, 0)]),
            "lsetxattr": (189, [("at", None, 0)]),
            "fsetxattr": (190, [("fd", 0)]),
            "removexattr": (197, [("at", None, 0)]),
            "lremovexattr": (198, [("at", None, 0)]),
            "fremovexattr": (199, [("fd", 0)]),
            "openat": (257, [("at", 0, 1)]),
            "mkdirat": (258, [("at", 0, 1)]),
            "mknodat": (259, [("at", 0, 1)]),
            "unlinkat": (263, [("at", 0, 1)]),
            "renameat": (264, [("at", 0, 1), ("at", 2, 3)]),
            "linkat": (265, [("at", 2, 3)]),
            "symlinkat": (266, [("at", 1, 2)]),
            "renameat2": (316, [("at", 0, 1), ("at", 2, 3)]),
            **_COMMON,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "setxattr": (5, [("at", None, 0)]),
            "lsetxattr": (6, [("at", None, 0)]),
            "fsetxattr": (7, [("fd", 0)]),
            "removexattr": (14, [("at", None, 0)]),
            "lremovexattr": (15, [("at", None, 0)]),
            "fremovexattr": (16, [("fd", 0)]),
            "mknodat": (33, [("at", 0, 1)]),
            "mkdirat": (34, [("at", 0, 1)]),
            "unlinkat": (35, [("at", 0, 1)]),
            "symlinkat": (36, [("at", 1, 2)]),
            "linkat": (37, [("at", 2, 3)]),
            "renameat": (38, [("at", 0, 1), ("at", 2, 3)]),
            "truncate": (45, [("at", None, 0)]),
            "openat": (56, [("at", 0, 1)]),
            "renameat2": (276, [("at", 0, 1), ("at", 2, 3)]),
            **_COMMON,
        },
    ),
}
OPEN_FLAGS_ARG = {"open": 1, "openat": 2}  # only these opens are looked at: O_CREAT or O_TRUNC
MKDIRS = {"mkdir", "mkdirat"}
CREATES = MKDIRS | {"mknod", "mknodat", "symlink", "symlinkat", "link", "linkat"}  # (EEXIST if there)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def arch() -> tuple[int, dict]:
    machine = platform.machine()
    if machine not in ARCHES:
        raise OSError(errno.ENOSYS, f"hold_syscalls knows no system call numbers of {machine}")
    return ARCHES[machine]


# ---- the filter (wrap) -------------------------------------------------------------------------


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _program() -> list[tuple[int, int, int, int]]:
    """The BPF program: notify the calls of ARCHES (opens only with O_CREAT or O_TRUNC), allow
    everything else (and every call of another architecture)."""
    audit_arch, calls = arch()
    plain = sorted(nr for name, (nr, _) in calls.items() if name not in OPEN_FLAGS_ARG)
    opens = [(calls[name][0], arg) for name, arg in OPEN_FLAGS_ARG.items() if name in calls]
    # Layout: [0] ld arch, [1] jeq arch, [2] ld nr, then one jeq per plain call (-> NOTIFY), one
    # jeq per open (-> its flags check), ALLOW, NOTIFY, then per open: ld flags, jset, ALLOW, NOTIFY.
    prog: list[tuple[int, int, int, int]] = []
    n_checks = len(plain) + len(opens)
    allow_at = 3 + n_checks
    notify_at = allow_at + 1
    prog.append((BPF_LD_W_ABS, 0, 0, 4))
    prog.append((BPF_JEQ_K, 0, allow_at - 2, audit_arch))
    prog.append((BPF_LD_W_ABS, 0, 0, 0))
    for i, nr in enumerate(plain):
        at = 3 + i
        prog.append((BPF_JEQ_K, notify_at - at - 1, 0, nr))
    for j, (nr, _) in enumerate(opens):
        at = 3 + len(plain) + j
        check_at = notify_at + 1 + 4 * j
        prog.append((BPF_JEQ_K, check_at - at - 1, 0, nr))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF))
    for _, arg in opens:
        prog.append((BPF_LD_W_ABS, 0, 0, 16 + 8 * arg))  # the low half (little-endian)
        prog.append((BPF_JSET_K, 1, 0, O_CREAT | O_TRUNC))
        prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
        prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF))
    return prog


def install_filter() -> int:
    """Install the filter on this thread (inherited by what it starts); the listener's fd."""
    prog = _program()
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    nr_seccomp = {"x86_64": 317, "aarch64": 277}[platform.machine()]
    fd = _libc.syscall(
        nr_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(fprog)
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp(SECCOMP_SET_MODE_FILTER, NEW_LISTENER): {os.strerror(err)}")
    return fd


def _address(sock_path: str) -> str:
    return "\0" + sock_path[1:] if sock_path.startswith("@") else sock_path


def wrap(sock_path: str, argv: list[str]) -> None:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(_address(sock_path))
        listener = install_filter()  # (last: from here on, the calls above wait for `serve`)
        socket.send_fds(conn, [b"L"], [listener])
        os.close(listener)
        if conn.recv(1) != b"k":
            raise SystemExit("hold_syscalls wrap: the server did not take the listener")
    os.execvp(argv[0], argv)


# ---- the server (serve) ------------------------------------------------------------------------


class Held:
    def __init__(self, listener: int, notif_id: int, what: str):
        self.listener, self.id, self.what = listener, notif_id, what


class Server:
    def __init__(self, store_dir: str, sock_path: str):
        self.root = os.path.realpath(store_dir)
        self.calls = {nr: (name, specs) for name, (nr, specs) in arch()[1].items()}
        self.holding = False
        self.dropped = False
        self.except_prefixes: tuple[str, ...] = ()
        self.held: list[Held] = []
        self.listeners: set[int] = set()
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(_address(sock_path))
        self.sock.listen(8)
        self.poll = select.poll()
        self.poll.register(sys.stdin.fileno(), select.POLLIN)
        self.poll.register(self.sock.fileno(), select.POLLIN)

    # -- decisions ----------------------------------------------------------------------------
    def passes(self, rel: str, mkdir: bool) -> bool:
        if rel == SCRATCH or (rel.startswith(SCRATCH + "/") and not rel.startswith(SCRATCH_HELD)):
            return True
        for prefix in self.except_prefixes:
            if rel.startswith(prefix) or (rel + "/").startswith(prefix):
                return True
            if mkdir and prefix.startswith(rel + "/"):
                return True
        return False

    def _store_rel(self, path: str) -> str | None:
        """``path`` (absolute) relative to the store ("" its root); None if outside it."""
        path = os.path.normpath(path)
        if path == self.root:
            return ""
        if path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return None

    @staticmethod
    def _string(tid: int, addr: int) -> str:
        with open(f"/proc/{tid}/mem", "rb", buffering=0) as mem:
            data = b""
            while b"\0" not in data and len(data) < 8192:
                chunk = os.pread(mem.fileno(), 4096 - (addr + len(data)) % 4096, addr + len(data))
                if not chunk:
                    break
                data += chunk
        return os.fsdecode(data.split(b"\0", 1)[0])

    def _paths(self, tid: int, name: str, specs, args) -> list[str]:
        out = []
        for spec in specs:
            if spec[0] == "fd":
                out.append(os.readlink(f"/proc/{tid}/fd/{ctypes.c_int(args[spec[1]]).value}"))
                continue
            _, dirfd_arg, path_arg = spec
            path = self._string(tid, args[path_arg])
            dirfd = AT_FDCWD if dirfd_arg is None else ctypes.c_int(args[dirfd_arg]).value
            if path.startswith("/"):
                out.append(path)
            elif dirfd == AT_FDCWD:
                out.append(os.path.join(os.readlink(f"/proc/{tid}/cwd"), path))
            else:
                base = os.readlink(f"/proc/{tid}/fd/{dirfd}")
                out.append(os.path.join(base, path) if path else base)
        return out

    def decide(self, tid: int, nr: int, args) -> tuple[bool, str]:
        """(whether the call changes the store in a way holding holds, what it is)."""
        name, specs = self.calls[nr]
        paths = self._paths(tid, name, specs, args)
        rels = [self._store_rel(p) for p in paths]
        what = f"{name} {' -> '.join(paths)}"
        if all(rel is None for rel in rels):
            return False, what
        if self._changes_nothing(name, args, paths):
            return False, what
        store_rels = [rel for rel in rels if rel is not None]
        mkdir = name in MKDIRS
        return not all(self.passes(rel, mkdir) for rel in store_rels), what

    @staticmethod
    def _changes_nothing(name: str, args, paths: list[str]) -> bool:
        """A call that only makes a name where one is already (mkdir -p, a creating open of a
        file that exists, without O_TRUNC) fails or opens: it changes nothing."""
        if name in OPEN_FLAGS_ARG:
            flags = args[OPEN_FLAGS_ARG[name]]
            return not flags & O_TRUNC and os.path.lexists(paths[-1])
        return name in CREATES and os.path.lexists(paths[-1])

    # -- notifications ------------------------------------------------------------------------
    def _respond(self, listener: int, notif_id: int, error: int = 0) -> None:
        flags = 0 if error else SECCOMP_USER_NOTIF_FLAG_CONTINUE
        buf = ctypes.create_string_buffer(RESP.pack(notif_id, 0, -error, flags), RESP.size)
        _libc.ioctl(
            listener, ctypes.c_ulong(NOTIF_SEND), buf
        )  # (fails with ENOENT once the caller is gone: fine)

    @staticmethod
    def _valid(listener: int, notif_id: int) -> bool:
        value = ctypes.c_uint64(notif_id)
        return _libc.ioctl(listener, ctypes.c_ulong(NOTIF_ID_VALID), ctypes.byref(value)) == 0

    def _notification(self, listener: int) -> None:
        buf = ctypes.create_string_buffer(NOTIF.size)
        if _libc.ioctl(listener, ctypes.c_ulong(NOTIF_RECV), buf) != 0:
            return  # (the caller went away meanwhile)
        notif_id, tid, _, nr, _, _, *args = NOTIF.unpack(buf.raw)
        try:
            held, what = self.decide(tid, nr, args)
        except OSError as e:  # the caller died, or a bad pointer/descriptor: the kernel will say
            held, what = False, f"nr {nr}: {e}"
        if not self._valid(listener, notif_id):
            return
        if held and self.dropped:
            self._respond(listener, notif_id, errno.EIO)
        elif held and self.holding:
            self.held.append(Held(listener, notif_id, what))
        else:
            self._respond(listener, notif_id)

    def _release(self, error: int = 0) -> None:
        held, self.held = self.held, []
        for h in held:
            self._respond(h.listener, h.id, error)

    def _command(self, line: str) -> str:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "hold":
            self.except_prefixes = tuple(json.loads(arg or "[]"))
            self.holding = True
        elif cmd == "release":
            self.holding = False
            self._release()
        elif cmd == "drop":
            self.dropped = True
            self._release(errno.EIO)
        elif cmd == "count":
            self.held = [h for h in self.held if self._valid(h.listener, h.id)]
            return str(len(self.held))
        elif cmd == "list":
            return json.dumps([h.what for h in self.held if self._valid(h.listener, h.id)])
        else:
            return f"error: unknown command {cmd!r}"
        return "ok"

    def run(self) -> None:
        print("ready", flush=True)
        stdin = sys.stdin.fileno()
        pending = b""
        while True:
            for fd, events in self.poll.poll():
                if fd == stdin:
                    chunk = os.read(stdin, 4096)
                    if not chunk:
                        self.dropped = True
                        self._release(errno.EIO)
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        sys.stdout.write(self._command(line.decode()) + "\n")
                        sys.stdout.flush()
                elif fd == self.sock.fileno():
                    conn, _ = self.sock.accept()
                    with conn:
                        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                        for listener in fds:
                            self.listeners.add(listener)
                            self.poll.register(listener, select.POLLIN)
                        conn.sendall(b"k")
                elif events & select.POLLIN:
                    self._notification(fd)
                elif events & (select.POLLHUP | select.POLLERR):  # no process carries it any more
                    self.poll.unregister(fd)
                    self.listeners.discard(fd)
                    self.held = [h for h in self.held if h.listener != fd]
                    os.close(fd)


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "serve":
        Server(sys.argv[2], sys.argv[3]).run()
    elif len(sys.argv) >= 5 and sys.argv[1] == "wrap" and sys.argv[3] == "--":
        wrap(sys.argv[2], sys.argv[4:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
