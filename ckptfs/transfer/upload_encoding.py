"""How the uploader encodes an object: a small file in one PUT; ``--compress``'s zstd frames
(each part a frame, the seek table after the last, the bucket's marker before the first
compressed object); the part checksums of a multipart object (its manifest, written before the
object is visible, deleted after the object it describes).

``Encoder`` makes its store calls through the ``StoreCalls`` it is given (shared with the
uploader and its ``PartSender``, which sends the parts this encodes); it counts the bytes the
store received for file data (``stored_bytes``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import trio

from ckptfs.errors import StoreError
from ckptfs.objects import compression, integrity
from ckptfs.store.base import PartInfo
from ckptfs.transfer.store_calls import StoreCalls
from ckptfs.transfer.upload_tasks import Task, Upload, in_thread_if_large

log = logging.getLogger(__name__)


class Encoder:
    """The uploader's one-PUT objects, compressed frames, checksum manifests."""

    def __init__(
        self,
        calls: StoreCalls,
        part_size: int,
        hash_threads: trio.CapacityLimiter,
        codec: compression.Codec | None,
        governor: compression.Governor,
    ):
        self.calls = calls
        self.store = calls.store
        self.part_size = part_size
        self.hash_threads = hash_threads
        # --compress: parts go up as zstd frames (compression.py), compressed in the store threads
        self.codec = codec
        self.governor = governor
        # Bytes the store received for file data (compressed size where compressed; the sender's
        # uploaded_bytes counts the files' own bytes). Frames are counted from store threads: under a lock.
        self.stored_bytes = 0
        self._stored_lock = threading.Lock()
        self._marked = False  # compression.MARKER_KEY is in the store
        self._zero_frames: dict[int, tuple[bytes, int]] = {}  # a hole part's frame, by length (--compress)

    async def one_put(self, task: Task) -> tuple[bytes, dict[str, str], integrity.Checksums]:
        """A small file's object: its body, metadata and checksums (compressed if that pays;
        the bucket's marker goes up first then)."""
        op = task.op
        content = task.content
        assert content is not None  # a put's task holds its content until finish()
        data = await in_thread_if_large(self.hash_threads, op.size, content.read, 0, op.size)
        metadata = {**op.meta, integrity.XXH3_META: task.xxh3}
        checksums = integrity.Checksums.whole_file(op.size, task.xxh3)
        if self.codec is not None and op.size >= compression.ONE_PUT_MIN:
            frame, by = await trio.to_thread.run_sync(
                compression.encode_part, self.codec, None, data, limiter=self.hash_threads
            )
            if by != compression.RAW:  # (one that does not compress stays a plain object)
                data = frame + compression.seek_table([(len(frame), op.size)])
                metadata.update(
                    self.format_meta(True),
                    **{compression.SIZE_META: str(op.size), compression.FRAMES_META: f"{len(frame)}:{by}"},
                )
                checksums = replace(checksums, frames=((len(frame), by),))
                await self.mark_compressed(op.key)
        return data, metadata, checksums

    # -- compression ---------------------------------------------------------------------------
    def count_stored(self, size: int) -> None:
        with self._stored_lock:
            self.stored_bytes += size

    @staticmethod
    def format_meta(compressed: bool) -> dict[str, str]:
        return {compression.FORMAT_META: compression.FORMAT} if compressed else {}

    def send_frame(
        self,
        upload: Upload,
        number: int,
        body,
        digest: str,
        table: Callable[[int], bytes] | None,
        zeros: int = 0,
    ) -> PartInfo:
        """Upload part ``number`` as a zstd frame (in a store thread). ``table``: this is the last
        part, followed by the seek table that ``table(its frame's size)`` gives; the others are
        padded to S3's smallest part. PartInfo.xxh3 carries the frame (compression.tag).
        ``zeros``: the part is that many zero bytes (a hole; no ``body``), encoded once per length."""
        if zeros:
            frame, by = self._zeros_frame(zeros)
        elif self.codec is None:  # an upload resumed from the journal of a mount that compressed
            frame, by = compression.raw_frame(body), compression.RAW
        else:
            frame, by = compression.encode_part(self.codec, self.governor, body)
        stored = len(frame)
        if table is None:
            frame = compression.pad_to(frame, min(compression.MIN_PART, self.part_size))
            stored = len(frame)
        else:
            frame += table(stored)
        started = time.perf_counter()
        part = self.store.upload_part(upload.key, upload.upload_id, number, frame)
        self.governor.uploaded(len(frame), time.perf_counter() - started)
        self.count_stored(len(frame))
        return replace(part, xxh3=compression.tag(digest, stored, by))

    def _zeros_frame(self, length: int) -> tuple[bytes, int]:
        """The frame of ``length`` zero bytes, encoded at the first hole of that length (a raw
        frame, for an upload resumed from a mount that compressed, is made each time: not kept)."""
        if self.codec is None:
            return compression.raw_frame(bytes(length)), compression.RAW
        frame = self._zero_frames.get(length)
        if frame is None:
            frame = compression.encode_part(self.codec, None, bytes(length))
            # (threads: replaced whole, never changed; a few lengths at most: a part's and a last one's)
            self._zero_frames = {**(self._zero_frames if len(self._zero_frames) < 4 else {}), length: frame}
        return frame

    @staticmethod
    def seek_table_after(task: Task, number: int) -> Callable[[int], bytes] | None:
        """For the last part of a compressed upload: the seek table, given the last frame's size."""
        if number != len(task.parts):
            return None
        # (the parts before the last are sent by now, as frames: each has a PartInfo and a frame)
        frames = [compression.untag(part.xxh3)[1][0] for part in task.parts[:-1]]  # type: ignore[index, union-attr]
        sizes = [task.layout.length(i, task.op.size) for i in range(len(task.parts))]
        return lambda last: compression.seek_table(list(zip(frames + [last], sizes)))

    async def mark_compressed(self, key: str) -> None:
        """Before the bucket's first compressed object: the marker that tells mounts to look for
        uncompressed sizes (logical_store.LogicalStore)."""
        if not self._marked:
            await self.calls.call(key, self.store.put, compression.MARKER_KEY, b"", {})
            self._marked = True

    # -- checksums ---------------------------------------------------------------------------
    @staticmethod
    def checksums(task: Task) -> integrity.Checksums | None:
        """The manifest of a multipart put: every part's xxh3 (None if one is unknown: a part
        resumed from the journal of an older version; the object then reads as unverified)."""
        tags = [compression.untag(part.xxh3) if part is not None else ("", None) for part in task.parts]
        hashes = [digest for digest, _ in tags]
        frames = tuple(frame for _, frame in tags) if task.compressed else ()
        if not all(hashes) or None in frames:
            log.warning("%s: part checksums unknown (journal of an older version): no manifest", task.op.key)
            return None
        upload = task.upload
        assert upload is not None  # only asked of a multipart put whose upload is made (publish_multipart)
        layout = task.layout
        return integrity.Checksums(
            task.op.size,
            layout.base,
            hashes,
            task.xxh3,
            upload.journal_id,
            "manifest",
            cast("tuple[tuple[int, int], ...]", frames),  # (no None: checked above)
            None if layout.uniform else layout.runs,  # (a uniform layout's manifest is as it was)
        )

    async def put_manifest(self, key: str, checksums: integrity.Checksums) -> None:
        mkey = integrity.manifest_key(checksums.upload)
        await self.calls.call(key, self.store.put, mkey, checksums.to_manifest(), {})

    async def drop_manifest(self, key: str, upload_id: str) -> None:
        """Delete the manifest of an object that is gone (a few tries: an orphan is harmless)."""
        mkey = integrity.manifest_key(upload_id)
        try:
            await self.calls.call(key, self.store.delete, mkey, attempts=5)
        except StoreError as exc:
            log.warning("could not delete %s (the manifest of a replaced or deleted %s): %s", mkey, key, exc)

    async def replaced_manifest(self, task: Task) -> str:
        """The upload id of the manifest the put's object replaces ("" if none). The namespace
        knows it, or says "?": then the object in the store now tells (a HEAD)."""
        if task.op.replaces != "?":
            return task.op.replaces
        info = await self.calls.call(task.op.key, self.store.head, task.op.key)
        if info is None or not info.metadata.get(integrity.MANIFEST_META):
            return ""
        upload_id = info.metadata.get(integrity.UPLOAD_META, "")
        # (replayed after our own completion: that manifest is this put's own)
        return "" if task.upload is not None and upload_id == task.upload.journal_id else upload_id
