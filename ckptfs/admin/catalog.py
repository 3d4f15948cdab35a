"""What is in a store or on a mount, its checkpoint series, and retention (gc): the I/O around
ckptfs/series.py. A store URL is read directly (everything listed is durable); on a mount the
daemon says what each file's state is (``catalog`` control command) and files are read and
deleted through the filesystem, so the mount's namespace and journal see every change.

Python API for training scripts::

    from ckptfs.catalog import checkpoints
    found = checkpoints("/mnt/ckpt/run1")          # or "s3://bucket/run1"
    if found.restart is not None:
        model.load_state_dict(torch.load(found.restart.location))
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptfs.admin.series import Decision, Entry, Series, Step, analyse, plan_gc
from ckptfs.admin.target import Target, resolve, sub_path
from ckptfs.cluster import records as writer_records
from ckptfs.config import ckptfs_mounts
from ckptfs.control import client
from ckptfs.errors import CkptfsError, StoreError
from ckptfs.objects import compression, integrity
from ckptfs.objects.logical_store import LogicalStore
from ckptfs.store.base import RESERVED_PREFIX, ObjectStore

CATALOG_TIMEOUT_S = 300.0  # a catalog of a very large mount (HEADs for checksums) may take a while
LOOKUP_THREADS = 16  # HEADs / manifest GETs in flight on a store URL
DELETE_THREADS = 32  # deletes in flight (a 1,000-file step must not take minutes)


def describe(verified: bool, xxh3: str, parts: int = 0) -> str:
    """How `ckptfs ls` shows a recorded checksum (of a store URL's files, and the daemon's
    ``catalog`` of a mount's)."""
    if not verified:
        return "unverified"
    if xxh3:
        return f"xxh3:{xxh3}"
    return f"xxh3 per part ({parts} parts)" if parts else "xxh3 per part"


@dataclass
class Listed:
    """One file of `ckptfs ls`."""

    path: str  # relative to the mount's root or the store URL
    size: int
    mtime: float
    state: str  # durable, pending or writing
    checksum: str = ""  # "xxh3:<hex>", "xxh3 per part (N parts)", "unverified", "-" (not in the store yet)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "bytes": self.size,
            "mtime": self.mtime,
            "state": self.state,
            "checksum": self.checksum,
        }


@dataclass
class Checkpoints:
    """The checkpoint series found under a mount path or store URL."""

    root: str  # what was looked at, as a user names it
    series: list[Series] = field(default_factory=list)

    @property
    def restart(self) -> Step | None:
        """The step a restart should use: the restart step of the series saved to last."""
        candidates = [s.restart for s in self.series if s.restart is not None]
        return max(candidates, key=lambda s: s.mtime, default=None)

    def to_json(self) -> dict:
        restart = self.restart
        return {
            "root": self.root,
            "restart": restart.location if restart else None,
            "series": [s.to_json() for s in self.series],
        }


def checkpoints(url_or_mountpoint: str, endpoint_url: str | None = None) -> Checkpoints:
    """The checkpoint series at ``url_or_mountpoint`` (a store URL, a mountpoint or a path on a
    ckptfs mount): steps, completeness, and ``.restart``, the step to restart from (None if no
    step is complete). Each step's ``location`` is a path on the mount or a URL in the store.
    Raises CkptfsError (a bad URL, a path on no ckptfs mount, a store or daemon that fails)."""
    target = resolve(url_or_mountpoint, endpoint_url)
    try:
        with _Source(target) as source:
            return source.checkpoints(target.prefix)
    except StoreError as e:  # (the API's errors are CkptfsErrors: the store module's are not exported)
        raise CkptfsError(str(e)) from None


# --- sources --------------------------------------------------------------------------------------


class _Source:
    """Lists and reads one target: a store (opened here) or a mount (via its daemon and its files)."""

    def __init__(self, target: Target):
        self.target = target
        self.store: ObjectStore | None = None
        self.etags: dict[str, str] = {}  # store objects listed: key -> ETag

    def __enter__(self) -> _Source:
        if not self.target.is_mount:
            # (the sizes a mount shows: a compressed object's uncompressed size)
            self.store = LogicalStore(self.target.open_store(max_connections=DELETE_THREADS))
        return self

    def __exit__(self, *exc) -> None:
        if self.store is not None:
            self.store.close()

    @property
    def opened_store(self) -> ObjectStore:
        """The store of a store URL's target, opened by ``__enter__``."""
        if self.store is None:
            raise RuntimeError(f"{self.target.spec}: no store open (a mount, or used outside 'with')")
        return self.store

    @property
    def mountpoint(self) -> str:
        return _mountpoint_of(self.target)

    # listing
    def entries(self, path: str, checksums: bool = False) -> tuple[list[Entry], dict[str, str]]:
        """Files and directories at or under ``path`` (relative to the root), paths relative to
        the root; and, if asked, each file's recorded checksum."""
        if self.target.is_mount:
            return self._mount_entries(path, checksums)
        return self._store_entries(path, checksums)

    def _mount_entries(self, path: str, checksums: bool) -> tuple[list[Entry], dict[str, str]]:
        mountpoint = self.mountpoint
        try:
            result = client.call(
                mountpoint, "catalog", {"path": path, "checksums": checksums}, timeout=CATALOG_TIMEOUT_S
            )
        except client.NoDaemon:
            if mountpoint in ckptfs_mounts():
                raise CkptfsError(
                    f"the ckptfs daemon of {mountpoint} is gone (stale mount): mount it again, "
                    f"or run 'ckptfs umount {mountpoint}'"
                ) from None
            raise
        entries, sums = [], {}
        for e in result.get("entries", []):
            entries.append(
                Entry(
                    e["path"],
                    int(e.get("size") or 0),
                    float(e.get("mtime") or 0),
                    e.get("state", "durable"),
                    bool(e.get("dir")),
                )
            )
            if "checksum" in e:
                sums[e["path"]] = e["checksum"]
        return entries, sums

    def _store_entries(self, path: str, checksums: bool) -> tuple[list[Entry], dict[str, str]]:
        infos = [i for i in self.opened_store.list(path + "/" if path else "") if _shown(i.key)]
        if path and not infos:  # a single file, or nothing at all
            info = self.opened_store.head(path)
            if info is None:
                raise CkptfsError(f"{self.target.location(path)}: no such file or directory in the store")
            infos = [info]
        entries = [Entry(i.key.rstrip("/"), i.size, i.mtime, "durable", i.key.endswith("/")) for i in infos]
        self.etags.update((i.key, i.etag) for i in infos)
        entries = [e for e in entries if e.path]
        sums = {}
        if checksums:
            files = [e for e in entries if not e.is_dir]
            with ThreadPoolExecutor(LOOKUP_THREADS) as pool:
                for entry, checksum in zip(
                    files, pool.map(lambda e: self._store_checksum(e.path, e.size), files)
                ):
                    sums[entry.path] = checksum
        return entries, sums

    def _store_checksum(self, key: str, size: int) -> str:
        try:
            info = self.opened_store.head(key)
            if info is None:
                return "-"  # deleted while we looked
            found = integrity.from_metadata(info.size, info.metadata)
            if (
                isinstance(found, integrity.Checksums)
                and not found.verified
                and info.metadata.get(integrity.XXH3_META)
            ):
                # a one-PUT file too large to check per read: its checksum is recorded all the same
                return describe(True, info.metadata[integrity.XXH3_META])
            if isinstance(found, str):  # a multipart object: its manifest has the part checksums
                raw = self.opened_store.get_range(integrity.manifest_key(found), 0, 64 << 20)
                found = integrity.Checksums.from_manifest(raw, info.size)
        except StoreError as e:
            return f"unknown ({e})" if e.errno != errno.ENOENT else "unverified (its manifest is missing)"
        except integrity.IntegrityError:
            return "unverified (its manifest is unreadable)"
        return describe(found.verified, found.xxh3, len(found.parts) if found.source == "manifest" else 0)

    # reading small files (pointers, DCP metadata, shard indexes)
    def read(self, path: str, limit: int) -> bytes:
        if self.target.is_mount:
            # (as gc deletes: one name at a time, on the mount alone; root reads what it names)
            mount_fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                parent, name = posixpath.split(path)
                dir_fd = _open_dir_on(mount_fd, os.fstat(mount_fd).st_dev, parent)
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
                except OSError as e:
                    if e.errno != errno.ELOOP:
                        raise
                    # A symbolic link (``latest`` -> global_step200): its target, never followed,
                    # which is what the store holds for it (s3fs's convention) and reads on the URL.
                    return os.fsencode(os.readlink(name, dir_fd=dir_fd))[:limit]
                finally:
                    os.close(dir_fd)
            finally:
                os.close(mount_fd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                return f.read(limit)
        try:
            data, metadata = self.opened_store.get_range_meta(path, 0, limit)
            if metadata.get(compression.FORMAT_META) != compression.FORMAT:
                return data
            return self._read_compressed(path, limit)
        except StoreError as e:
            raise OSError(e.errno, str(e)) from None
        except integrity.IntegrityError as e:
            raise OSError(errno.EIO, f"{path}: {e}") from None

    def _read_compressed(self, key: str, limit: int) -> bytes:
        """The first ``limit`` bytes of a compressed object, decoded from the frames holding them."""
        info = self.opened_store.head(key)  # (its uncompressed size, and the metadata naming its manifest)
        if info is None:
            raise OSError(errno.ENOENT, f"{key}: deleted from the store while read")
        checks = integrity.load_checksums(self.opened_store, info.size, info.metadata)
        if not checks.compressed:
            raise integrity.IntegrityError("stored compressed, but its frames are not recorded")
        length = min(limit, checks.size)
        if length <= 0:
            return b""
        stored, stored_length, first, last = checks.stored_range(0, length)
        plain = checks.decompress(first, last, self.opened_store.get_range(key, stored, stored_length))
        return plain[:length]

    def checkpoints(self, path: str) -> Checkpoints:
        entries, _ = self.entries(path)
        # The series module sees paths relative to what was asked for.
        base = path + "/" if path else ""
        relative = [
            Entry(e.path[len(base) :], e.size, e.mtime, e.state, e.is_dir)
            for e in entries
            if e.path.startswith(base)
        ]
        found = analyse(relative, lambda p, limit: self.read(base + p, limit))
        for series in found:
            series.directory = posixpath.join(path, series.directory) if series.directory else path
            for step in series.steps:
                step.path = base + step.path
                step.location = self.target.location(step.path)
                step.entries = [
                    Entry(base + e.path, e.size, e.mtime, e.state, e.is_dir) for e in step.entries
                ]
            for pointer in series.pointers:
                pointer.path = base + pointer.path
                pointer.names = base + pointer.names if pointer.names else None
        return Checkpoints(self.target.location(path), found)


def _shown(key: str) -> bool:
    """Keys a mount would show: not the reserved prefix (checksum manifests, the local store's own)."""
    return (
        bool(key)
        and not key.startswith(RESERVED_PREFIX)
        and not key.startswith("/")
        and ".." not in key.split("/")
    )


# --- ls -------------------------------------------------------------------------------------------


def ls(target: Target, path: str | None = None, checksums: bool = True) -> list[Listed]:
    where = sub_path(target, path)
    with _Source(target) as source:
        entries, sums = source.entries(where, checksums)
    return sorted(
        (Listed(e.path, e.size, e.mtime, e.state, sums.get(e.path, "")) for e in entries if not e.is_dir),
        key=lambda f: f.path.encode(),
    )  # key order, as a store lists


def catalog(target: Target) -> Checkpoints:
    with _Source(target) as source:
        return source.checkpoints(target.prefix)


# --- gc -------------------------------------------------------------------------------------------


@dataclass
class GcResult:
    decisions: list[Decision]
    deleted_steps: int = 0
    deleted_files: int = 0
    freed_bytes: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # "path: reason"

    def to_json(self, target: Target, dry_run: bool) -> dict:
        return {
            "dry_run": dry_run,
            "freed_bytes": self.freed_bytes,
            "deleted_steps": self.deleted_steps,
            "deleted_files": self.deleted_files,
            "seconds": round(self.seconds, 3),
            "failures": self.failures,
            "steps": [
                {
                    "path": d.step.path,
                    "location": target.location(d.step.path),
                    "step": d.step.number,
                    "action": "delete" if d.delete else "keep",
                    "why": d.why,
                    "files": d.step.files,
                    "bytes": d.step.size,
                }
                for d in self.decisions
            ],
        }


def gc(
    target: Target,
    keep_last: int,
    keep_every: int | None = None,
    pattern: str | None = None,
    dry_run: bool = False,
    on_deleted: Callable[[Step], None] | None = None,
) -> GcResult:
    """Apply retention to the series at ``target`` (see series.plan_gc): delete what it does not
    keep, in parallel, unless ``dry_run``. ``on_deleted`` is called after each step is gone."""
    with _Source(target) as source:
        found = source.checkpoints(target.prefix)
        decisions = plan_gc(found.series, keep_last, keep_every, pattern)
        result = GcResult(decisions)
        doomed = [d.step for d in decisions if d.delete]
        started = time.monotonic()
        for step in doomed:
            failures = (
                []
                if dry_run
                else (
                    _delete_on_mount(target, step)
                    if target.is_mount
                    else _delete_in_store(source.opened_store, step, source.etags)
                )
            )
            result.failures += failures
            if not failures:  # (a step only partly deleted does not count as freed)
                result.deleted_steps += 1
                result.deleted_files += step.files
                result.freed_bytes += step.size
                if on_deleted is not None and not dry_run:
                    on_deleted(step)
        result.seconds = time.monotonic() - started
        return result


def _delete_on_mount(target: Target, step: Step) -> list[str]:
    """Unlink the step's files through the mount, in parallel, then its directories, deepest first.
    Paths are walked from the mountpoint one name at a time, never through a link and never off
    the mount's filesystem: what gc listed is the daemon's tree, and something may since have been
    mounted over a directory of it (any user may FUSE-mount on a directory they own), which must
    not lead root to delete elsewhere."""
    mountpoint = _mountpoint_of(target)
    try:
        mount_fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        return [f"{mountpoint}: {e.strerror}"]
    try:
        device = os.fstat(mount_fd).st_dev

        def remove(path: str, rmdir: bool = False) -> None:
            parent, name = posixpath.split(path)
            fd = _open_dir_on(mount_fd, device, parent)
            try:
                (os.rmdir if rmdir else os.unlink)(name, dir_fd=fd)
            finally:
                os.close(fd)

        files = [e.path for e in step.entries if not e.is_dir]
        failures = _parallel(remove, files, None)
        if step.is_file or failures:
            return failures
        dirs = {e.path for e in step.entries if e.is_dir} | {step.path}
        for directory in sorted(
            dirs, key=lambda d: -d.count("/")
        ):  # (names made since the listing stay, and so does their dir)
            try:
                remove(directory, rmdir=True)
            except FileNotFoundError:
                pass
            except OSError as e:
                failures.append(f"{directory}: {e.strerror}")
        return failures
    finally:
        os.close(mount_fd)


def _mountpoint_of(target: Target) -> str:
    """The mountpoint of a mount's target (a store URL's target has none)."""
    if target.mountpoint is None:
        raise RuntimeError(f"{target.spec} is a store URL, not a mount")
    return target.mountpoint


def _open_dir_on(mount_fd: int, device: int, path: str) -> int:
    """A descriptor of the directory ``path`` (relative to the mount), reached one name at a time
    with O_NOFOLLOW, each on the mount's own filesystem (EXDEV otherwise)."""
    fd = os.dup(mount_fd)
    try:
        for name in [p for p in path.split("/") if p]:
            if name in (".", ".."):
                raise OSError(errno.EINVAL, f"{name!r} in a path on the mount")
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            if os.fstat(fd).st_dev != device:
                raise OSError(errno.EXDEV, "another filesystem is mounted there: not deleted through it")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _delete_in_store(store: ObjectStore, step: Step, etags: dict[str, str]) -> list[str]:
    """Delete the step's objects, each with the checksum manifest its metadata names, then its
    directory markers, deepest first, then the writer records of nodes under it
    (cluster/records.py: a lost node's stay otherwise)."""

    def delete(key: str) -> None:
        # Only a multipart object has a manifest: on S3 its ETag says so ("<md5>-<parts>"), and a
        # one-PUT object needs no HEAD (halves the requests). Other stores: ask each object.
        etag = etags.get(key, "")
        info = store.head(key) if not etag or "-" in etag else None
        store.delete(key)
        if (
            info is not None
            and info.metadata.get(integrity.MANIFEST_META)
            and info.metadata.get(integrity.UPLOAD_META)
        ):
            store.delete(integrity.manifest_key(info.metadata[integrity.UPLOAD_META]))  # after its object

    files = [e.path for e in step.entries if not e.is_dir]
    failures = _parallel(delete, files, None)
    if failures:
        return failures
    marker_set = {e.path + "/" for e in step.entries if e.is_dir} | (
        set() if step.is_file else {step.path + "/"}
    )
    markers = sorted(marker_set, key=lambda k: -k.count("/"))
    for marker in markers:
        try:
            store.delete(marker)
        except StoreError as e:
            failures.append(f"{marker}: {e}")
    if not step.is_file and not failures:  # the writer records a lost node left there: its step is gone
        try:
            for info in list(store.list(writer_records.PREFIX + step.path + "/")):
                store.delete(info.key)
        except StoreError as e:
            failures.append(f"{writer_records.PREFIX}{step.path}/: {e}")
    return failures


def _parallel(fn: Callable[[str], None], items: list[str], relative_to: str | None) -> list[str]:
    failures = []

    def one(item: str) -> None:
        try:
            fn(item)
        except FileNotFoundError:
            pass  # gone already: that is what we wanted
        except (OSError, StoreError) as e:
            name = os.path.relpath(item, relative_to) if relative_to else item
            failures.append(f"{name}: {getattr(e, 'strerror', None) or e}")

    with ThreadPoolExecutor(min(DELETE_THREADS, max(len(items), 1))) as pool:
        list(pool.map(one, items))
    return failures


__all__ = ["Checkpoints", "GcResult", "Listed", "catalog", "checkpoints", "gc", "ls"]
