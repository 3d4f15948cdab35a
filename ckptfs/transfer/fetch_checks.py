"""The fetcher's integrity checks: which part checksums an object is read against (its GET's
metadata for a one-PUT file, its manifest for a multipart one, loaded once per upload however
many readers ask), and what a range that does not match them does (fetched again, then EIO,
kept for ``ckptfs status``). ``Fetcher`` inherits them; their state (``integrity_errors``,
``integrity_retries``, the manifests in flight) is set up in ``Fetcher.__init__``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time

import trio

from ckptfs.cache.contents import Content
from ckptfs.errors import FsError, NotFound, StoreError
from ckptfs.objects import compression, integrity
from ckptfs.objects.integrity import Checksums, IntegrityError
from ckptfs.transfer import retry

log = logging.getLogger(__name__)

VERIFY_ATTEMPTS = 3  # fetches of a range whose bytes do not match their checksum, before EIO


class FetchChecks:
    """Fetcher's part checksums: lookup (metadata, manifest) and mismatches."""

    async def _known_compressed(self, content: Content) -> None:
        """Before the first fetch of an object the store layer already HEADed (a listing of a bucket
        with compressed objects): if it is compressed, learn its frames first, so that fetch asks
        for them and not for bytes of the stored stream that are of no use."""
        known = getattr(self.store, "known_metadata", None)
        metadata = known(content.key) if known is not None and content.key else None
        if metadata and metadata.get(compression.FORMAT_META) == compression.FORMAT:
            with contextlib.suppress(IntegrityError):  # (the fetch finds it again, and says so)
                await self._checksums(content, metadata)

    async def _checksums(self, content: Content, metadata: dict[str, str]) -> Checksums:
        """The checksums of the object a GET answered from (its metadata says which), kept on
        ``content``. Raises IntegrityError when the manifest it names is missing or unreadable."""
        found = integrity.from_metadata(content.size, metadata)
        current = content.checksums
        if isinstance(found, Checksums):
            if current != found:
                if not found.verified:
                    self._log_once(
                        content.key or "",
                        found.source,
                        logging.INFO,
                        "%s: read unchecked: %s",
                        content.key,
                        found.source,
                    )
                content.checksums = found
            return found
        if current is not None and current.source == "manifest" and current.upload == found:
            return current
        content.checksums = await self._manifest(content, found)
        return content.checksums

    async def _manifest(self, content: Content, upload: str) -> Checksums:
        """The manifest of upload ``upload`` (one load at a time per upload; others wait for it)."""
        while (event := self._manifests.get(upload)) is not None:
            await event.wait()
            current = content.checksums
            if current is not None and current.source == "manifest" and current.upload == upload:
                return current
        event = self._manifests[upload] = trio.Event()
        mkey = integrity.manifest_key(upload)
        try:
            try:
                raw = await retry.call(
                    retry.reading,
                    lambda: trio.to_thread.run_sync(
                        self.store.get_range,
                        mkey,
                        0,
                        integrity.MANIFEST_MAX,
                        limiter=self.threads,
                        abandon_on_cancel=True,
                    ),
                )
            except NotFound:
                raise IntegrityError(f"its manifest {mkey} is missing from the store") from None
            except StoreError as exc:
                raise FsError(exc.errno, f"{content.key}: cannot read its manifest: {exc}") from exc
            return Checksums.from_manifest(raw, content.size)
        finally:
            del self._manifests[upload]
            event.set()

    async def checksums_of(self, content: Content) -> Checksums | None:
        """What ``content``'s object is checked against (a HEAD, and its manifest, if not known
        yet); None while it is not in the store. For the ``user.ckptfs.verified`` xattr."""
        if content.checksums is not None or not content.in_store or not content.key:
            return content.checksums
        try:
            info = await trio.to_thread.run_sync(
                self.store.head, content.key, limiter=self.threads, abandon_on_cancel=True
            )
        except StoreError as exc:
            raise FsError(exc.errno, str(exc)) from exc
        if info is None:
            return None
        try:
            return await self._checksums(content, info.metadata)
        except IntegrityError as exc:
            return Checksums.unverified(content.size, str(exc))

    def _mismatch(self, content: Content, index: int, exc: IntegrityError, final: bool) -> None:
        """Fetched bytes did not match: count, log once per key and part; EIO when ``final``."""
        key = content.key or ""
        if not final:
            self.integrity_retries += 1
            self._log_once(
                key,
                f"retry block {index}",
                logging.WARNING,
                "%s: bytes from the store do not match their checksum (%s); fetching again",
                key,
                exc,
            )
            return
        self.integrity_errors.append({"time": time.time(), "key": key, "block": index, "message": str(exc)})
        self._log_once(
            key,
            f"failed block {index}",
            logging.ERROR,
            "%s: bytes from the store do not match their checksum (%s), %d fetches: read fails (EIO)",
            key,
            exc,
            VERIFY_ATTEMPTS,
        )
        raise FsError(errno.EIO, f"{key}: integrity check failed: {exc}")

    def _log_once(self, key: str, reason: str, level: int, msg: str, *args) -> None:
        if (key, reason) not in self._logged:
            if len(self._logged) > 10_000:
                self._logged.clear()
            self._logged.add((key, reason))
            log.log(level, msg, *args)
