"""The store as a mount sees it when objects may be compressed (objects/compression.py): listings and
HEADs give a compressed object's uncompressed size. Every other call passes straight through."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ckptfs.errors import NotFound
from ckptfs.objects import integrity
from ckptfs.objects.compression import FORMAT, FORMAT_META, MARKER_KEY, SIZE_META
from ckptfs.store.base import DirListing, ObjectInfo, ObjectStore, PartInfo


class LogicalStore(ObjectStore):
    """The store with the sizes the mount shows: a compressed object's listing and HEAD give its
    uncompressed size. Listings carry no metadata, so an object is HEADed (and its manifest read,
    for a streamed object whose size was unknown when its upload began) the first time this mount
    sees that version; once per version, and never in a bucket where no mount ever stored a
    compressed object (MARKER_KEY absent: a plain bucket costs one HEAD per listing that shows an
    object version not listed before, and one per MARKER_RECHECK_S)."""

    MARKER_RECHECK_S = 30.0
    MAX_KNOWN = 100_000
    MANIFEST_MAX = 4 << 20

    def __init__(self, store: ObjectStore):
        self.inner = store
        self.url = store.url
        self._marker_seen = False  # (a compressing mount sets it with its first compressed object)
        self._marker_checked = float("-inf")
        self._known: dict[str, tuple[tuple, dict[str, str], int]] = {}  # key -> (stamp, metadata, size)
        self._seen_plain: dict[str, tuple] = {}  # key -> stamp of versions listed while no marker was seen
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="ckptfs-sizes")

    # what the fetcher asks: the metadata seen for the current version of ``key``, if any
    def known_metadata(self, key: str) -> dict[str, str] | None:
        with self._lock:
            found = self._known.get(key)
        return found[1] if found is not None else None

    def _may_be_compressed(self, infos: list[ObjectInfo] | None = None) -> bool:
        """Whether any object may be compressed. The marker is stored before a bucket's first
        compressed object, so it is asked again at once when a listing shows an object version
        this mount has not seen: otherwise another mount's first compressed objects would show
        their stored size until the next recheck."""
        if self._marker_seen:
            return True
        now = time.monotonic()
        unseen = self._unseen(infos) if infos else False
        if unseen or now - self._marker_checked >= self.MARKER_RECHECK_S:
            self._marker_checked = now
            self._marker_seen = self.inner.head(MARKER_KEY) is not None
        return self._marker_seen

    def _unseen(self, infos: list[ObjectInfo]) -> bool:
        """Whether ``infos`` hold an object version not listed before (and remember them)."""
        new = False
        with self._lock:
            if len(self._seen_plain) >= self.MAX_KNOWN:
                self._seen_plain.clear()
            for info in infos:
                stamp = (info.size, info.etag or info.mtime)
                if self._seen_plain.get(info.key) != stamp:
                    self._seen_plain[info.key] = stamp
                    new = True
        return new

    def _logical(self, info: ObjectInfo, headed: bool = False) -> ObjectInfo:
        """``info`` (from a listing, or a HEAD if ``headed``) with the size the mount shows."""
        if info.key.endswith("/") or info.key.startswith(".ckptfs-"):
            return info
        stamp = (info.size, info.etag or info.mtime)
        with self._lock:
            found = self._known.get(info.key)
        if found is not None and found[0] == stamp:
            return replace(info, size=found[2]) if found[2] != info.size else info
        head = info if headed else self.inner.head(info.key)
        if head is None:
            return info
        return self._remember(head)

    def _remember(self, info: ObjectInfo) -> ObjectInfo:
        size = info.size
        if info.metadata.get(FORMAT_META) == FORMAT:
            size = self._uncompressed_size(info)
        with self._lock:
            if len(self._known) >= self.MAX_KNOWN:
                self._known.clear()
            self._known[info.key] = ((info.size, info.etag or info.mtime), dict(info.metadata), size)
        return replace(info, size=size)

    def _uncompressed_size(self, info: ObjectInfo) -> int:
        if info.metadata.get(SIZE_META, "").isdigit():
            return int(info.metadata[SIZE_META])
        upload = info.metadata.get(integrity.UPLOAD_META, "")
        try:
            raw = self.inner.get_range(integrity.manifest_key(upload), 0, self.MANIFEST_MAX)
            return integrity.manifest_size(raw)
        except (NotFound, ValueError):
            return info.size  # (a damaged object: reads of it fail with EIO)

    def _resolve(self, infos: list[ObjectInfo]) -> list[ObjectInfo]:
        if not infos or not self._may_be_compressed(infos):
            return infos
        return list(self._pool.map(self._logical, infos))

    # -- the interface -------------------------------------------------------------------
    def report_to(self, health) -> None:
        self.inner.report_to(health)

    def check(self) -> None:
        self.inner.check()

    @property
    def limits(self):  # type: ignore[override]  # (the wrapped store's, never set through the view)
        return self.inner.limits

    def key_room(self) -> int:
        return self.inner.key_room()

    @property
    def server_checksums(self) -> bool:  # type: ignore[override]  # (as limits)
        return self.inner.server_checksums

    def detect_server_checksums(self) -> bool:
        return self.inner.detect_server_checksums()

    def put(self, key, data, metadata=None) -> None:
        if key == MARKER_KEY:
            self._marker_seen = True
        self.inner.put(key, data, metadata)

    def get_range(self, key, start, length) -> bytes:
        return self.inner.get_range(key, start, length)

    def get_range_meta(self, key, start, length):
        data, metadata = self.inner.get_range_meta(key, start, length)
        if metadata.get(FORMAT_META) == FORMAT:
            self._marker_seen = True  # (before another mount's marker was noticed: list sizes from now on)
        return data, metadata

    def head(self, key):
        info = self.inner.head(key)  # (its metadata says it all: no marker needed)
        if info is None:
            return None
        if info.metadata.get(FORMAT_META) == FORMAT:
            self._marker_seen = True
        return self._logical(info, headed=True)

    def list(self, prefix=""):
        infos = list(self.inner.list(prefix))
        if any(info.key == MARKER_KEY for info in infos):
            self._marker_seen = True
        return iter(self._resolve(infos))

    def list_dir(self, prefix="", limit=None) -> DirListing:
        listing = self.inner.list_dir(prefix, limit)
        return DirListing(self._resolve(listing.files), listing.dirs, listing.exists)

    def delete(self, key) -> None:
        self.inner.delete(key)

    def set_metadata(self, key, metadata) -> None:
        self.inner.set_metadata(key, metadata)

    def copy(self, src, dst) -> None:
        self.inner.copy(src, dst)

    def create_multipart(self, key, metadata=None) -> str:
        return self.inner.create_multipart(key, metadata)

    def upload_part(self, key, upload_id, number, data) -> PartInfo:
        return self.inner.upload_part(key, upload_id, number, data)

    def upload_zero_part(self, key, upload_id, number, length) -> PartInfo:
        return self.inner.upload_zero_part(key, upload_id, number, length)

    def complete_multipart(self, key, upload_id, parts) -> None:
        self.inner.complete_multipart(key, upload_id, parts)

    def abort_multipart(self, key, upload_id) -> None:
        self.inner.abort_multipart(key, upload_id)

    def list_multipart(self, prefix=""):
        return self.inner.list_multipart(prefix)

    def list_multipart_started(self, prefix=""):
        return self.inner.list_multipart_started(prefix)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.inner.close()
