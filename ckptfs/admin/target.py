"""What an admin command works on: a store URL (read directly, no mount needed) or a path on a
ckptfs mount (asked of its daemon). ``resolve`` tells them apart and checks what it can without
touching the network or stat()ing the mount (a hung daemon would block us)."""

from __future__ import annotations

import errno
import os
import posixpath
from dataclasses import dataclass

from ckptfs.config import ckptfs_mounts
from ckptfs.errors import StoreError, UsageError
from ckptfs.store.base import ObjectStore, redact_url


@dataclass(frozen=True)
class Target:
    spec: str  # as given
    url: str | None = None  # a store URL, or None for a mount
    endpoint_url: str | None = None
    mountpoint: str | None = None  # the mount, or None for a store URL
    prefix: str = ""  # the part of a path on the mount below its mountpoint ("" = the whole mount)

    @property
    def is_mount(self) -> bool:
        return self.mountpoint is not None

    def location(self, path: str) -> str:
        """``path`` (relative to the mount or the store URL) as a user would name it."""
        if self.mountpoint is not None:
            return os.path.join(self.mountpoint, path) if path else self.mountpoint
        base = redact_url(self.url or "").rstrip("/")
        return f"{base}/{path}" if path else base

    def open_store(self, max_connections: int = 16) -> ObjectStore:
        from ckptfs.store import open_store  # boto3 is slow to import: only for store URLs

        try:
            store = open_store(self.url, endpoint_url=self.endpoint_url, max_connections=max_connections)
        except StoreError as e:  # open_store does no I/O: what it rejects is the command line
            if e.errno == errno.EINVAL:
                raise UsageError(str(e)) from None
            raise
        root = getattr(store, "root", None)  # a local store: its directory must be there already, as
        if root is not None and not os.path.isdir(root):  # a bucket must; the admin commands never make it
            store.close()
            if os.path.lexists(root):
                raise StoreError(f"local store {root}: not a directory", errno_=errno.ENOTDIR)
            raise StoreError(f"local store {root}: no such directory", errno_=errno.ENOENT)
        return store


def is_url(spec: str) -> bool:
    return "://" in spec


def resolve(spec: str, endpoint_url: str | None = None) -> Target:
    """A store URL (s3://bucket[/prefix], file:///path) or a path on a ckptfs mount."""
    if not spec or not spec.strip():
        raise UsageError("empty STORE_URL or MOUNTPOINT")
    if is_url(spec):
        return Target(spec, url=spec, endpoint_url=endpoint_url)  # (its form is checked when opened)
    if endpoint_url is not None:
        raise UsageError("--endpoint-url applies to a store URL, not to a mount (the mount has its own)")
    mounts = ckptfs_mounts()
    for candidate in (os.path.abspath(spec), os.path.realpath(spec)):
        owners = [m for m in mounts if os.path.commonpath([m, candidate]) == m]
        if owners:
            mountpoint = max(owners, key=len)
            rel = os.path.relpath(candidate, mountpoint)
            return Target(spec, mountpoint=mountpoint, prefix="" if rel == "." else rel)
    if not os.path.exists(spec):
        raise UsageError(
            f"{spec}: no such file or directory, and not a store URL (s3://bucket[/prefix] or file:///path)"
        )
    raise UsageError(
        f"{spec} is not on a ckptfs mount (give a ckptfs mountpoint, or a store URL: "
        "s3://bucket[/prefix] or file:///path)"
    )


def sub_path(target: Target, path: str | None) -> str:
    """PATH given after the target: relative to it, or (on a mount) an absolute path inside the
    mount. The result is relative to the mount's root or the store URL ("" for all of it)."""
    if path is None or path in ("", "."):
        return target.prefix
    if os.path.isabs(path):
        if target.mountpoint is None:
            raise UsageError(f"{path}: a PATH in a store is relative to the store URL")
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.commonpath([target.mountpoint, candidate]) == target.mountpoint:
                rel = os.path.relpath(candidate, target.mountpoint)
                return "" if rel == "." else rel
        raise UsageError(f"{path} is not inside the ckptfs mount {target.mountpoint}")
    joined = posixpath.normpath(posixpath.join(target.prefix, path))
    if joined == ".":
        return ""
    if joined == ".." or joined.startswith("../"):
        raise UsageError(f"{path} is outside {target.location(target.prefix)}")
    return joined
