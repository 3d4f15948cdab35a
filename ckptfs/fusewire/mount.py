"""Mount and unmount a FUSE filesystem: mount(2) as root, otherwise through ``fusermount3``,
which mounts for a user and hands the ``/dev/fuse`` fd back over a socket (``_FUSE_COMMFD``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import stat
import subprocess

from ckptfs.fusewire.device import Device

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
FUSERMOUNT = "fusermount3"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountFailed(Exception):
    pass


def _escape(value: str) -> str:
    # fusermount3 splits its -o at unescaped commas (and takes a backslash as the escape)
    return value.replace("\\", "\\\\").replace(",", "\\,")


def mount(mountpoint: str, fsname: str, subtype: str, options: list[str]) -> Device:
    """Mount at ``mountpoint``: the device the kernel sends its requests to. ``options``: the
    generic FUSE ones (``default_permissions``, ``allow_other``)."""
    if os.geteuid() == 0:
        return _mount_as_root(mountpoint, fsname, subtype, options)
    return _mount_with_fusermount(mountpoint, fsname, subtype, options)


def _mount_as_root(mountpoint: str, fsname: str, subtype: str, options: list[str]) -> Device:
    device = Device.open()
    root_mode = stat.S_IFMT(os.stat(mountpoint).st_mode)
    data = ",".join([f"fd={device.fd}", f"rootmode={root_mode:o}", "user_id=0", "group_id=0", *options])
    result = _libc.mount(
        os.fsencode(fsname),
        os.fsencode(mountpoint),
        f"fuse.{subtype}".encode(),
        MS_NOSUID | MS_NODEV,
        data.encode(),
    )
    if result != 0:
        number = ctypes.get_errno()
        device.close()
        raise MountFailed(f"mount: {os.strerror(number)}")
    return device


def _mount_with_fusermount(mountpoint: str, fsname: str, subtype: str, options: list[str]) -> Device:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        opts = ",".join([*options, f"fsname={_escape(fsname)}", f"subtype={subtype}"])
        try:
            done = subprocess.run(
                [FUSERMOUNT, "-o", opts, "--", mountpoint],
                env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                pass_fds=(theirs.fileno(),),
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MountFailed(f"{FUSERMOUNT}: {exc}") from None
        if done.returncode != 0:
            raise MountFailed(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else FUSERMOUNT)
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise MountFailed(f"{FUSERMOUNT} sent no /dev/fuse descriptor")
    return Device(fds[0])


def unmount(mountpoint: str) -> None:
    """Detach the mount (lazily: processes still inside see it until they leave)."""
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH) != 0:
            number = ctypes.get_errno()
            raise OSError(number, os.strerror(number), mountpoint)
        return
    done = subprocess.run(
        [FUSERMOUNT, "-u", "-q", "-z", "--", mountpoint], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        raise OSError(done.stderr.strip() or f"{FUSERMOUNT} -u failed")
