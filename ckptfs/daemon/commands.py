"""The control commands a mount's daemon answers (status, sync, warmup, verify, catalog, umount)
and the live figures behind ``ckptfs status`` and the metrics: questions to the parts, on the
trio loop, never through the mount."""

from __future__ import annotations

import os
import time

import humanfriendly
import trio

from ckptfs.admin import catalog, verify
from ckptfs.config import VERIFY_JOBS, MountConfig
from ckptfs.daemon.wiring import Core
from ckptfs.errors import CkptfsError, FsError, StoreError, TimedOut
from ckptfs.store.health import describe

PROGRESS_INTERVAL_S = 0.5
LET_GO_S = 5.0  # umount: at most this long deleting this node's writer records
CHECKSUM_LOOKUPS = 16  # catalog: HEADs (and manifest GETs) in flight for checksums=true
YIELD_EVERY = 2000  # catalog: nodes walked between yields to the FUSE loop (a huge tree must not stall it)


class Commands:
    def __init__(
        self,
        core: Core,
        config: MountConfig,
        mountpoint: str,
        cache_dir,
        started: float,
        ops,
        metrics,
        stop_requested: trio.Event,
    ):
        self.config, self.mountpoint, self.cache_dir, self.started = config, mountpoint, cache_dir, started
        self.store, self.health, self.cache = core.store, core.health, core.cache
        self.uploader, self.fetcher, self.namespace = core.uploader, core.fetcher, core.namespace
        self.gate, self.records, self.peers = core.gate, core.records, core.peers
        self.holder, self.replicator = core.holder, core.replicator
        self.ops = ops  # fuse_ops.Operations: bytes written, save stalls
        self.metrics = metrics  # metrics.MetricsServer with --metrics-port, else None
        self.stop_requested = stop_requested  # set by umount: the daemon unmounts

    def handlers(self) -> dict:
        """The commands for control.ControlServer, by name."""
        return {
            "status": self.status,
            "sync": self.sync,
            "warmup": self.warmup,
            "verify": self.verify,
            "catalog": self.catalog,
            "umount": self.umount,
        }

    def figures(self) -> dict:
        """Live figures for status and the metrics (on the trio loop)."""
        up, usage, health = self.uploader, self.cache.usage(), self.health.status()
        files, size = up.pending_files_and_size()
        return {
            # (through the daemon's WRITEs, and the files the kernel wrote itself, as committed)
            "written_bytes": self.ops.written_bytes + self.namespace.files.kernel_written,
            "committed_bytes": up.committed_bytes,
            "uploaded_bytes": up.uploaded_bytes,
            "stored_bytes": up.stored_bytes,
            "fetched_bytes": self.fetcher.fetched_bytes,
            "durable_files": up.durable_files,
            "pending_files": files,
            "pending_size": size,
            "pending_bytes": up.pending_bytes(),
            "upload_rate": up.upload_rate.rate(),
            "oldest_pending_s": up.oldest_pending_age(),
            # (with --replicas only what is neither in the store nor held by K peers is at risk)
            "at_risk_s": self.replicator.at_risk_seconds() if self.replicator else up.at_risk_seconds(),
            "cache": {"ram": usage["ram"], "disk": usage["disk"]},
            "clean_bytes": usage["clean_bytes"],
            "upload_latency": up.call_latency.snapshot(),
            "fetch_latency": self.fetcher.get_latency.snapshot(),
            "save_stall": self.ops.save_stall.snapshot(),
            "retries": {
                "upload": up.retries,
                "fetch": self.fetcher.retries,
                "integrity": self.fetcher.integrity_retries,
            },
            "errors": self.health.failures.snapshot(),
            "store_up": 1 if health.get("state") == "ok" else 0,
            "markers_waiting": len(up.held),
            "markers_dropped": up.dropped_count,
            "unrecorded_closes": self.records.unrecorded,
            "store_read_bytes": self.fetcher.store_bytes,
            "peer_read_bytes": self.fetcher.peer_bytes,
            "peers_live": len(self.peers.members.live()) if self.peers is not None else 0,
            "peer_served_bytes": self.peers.server.served_bytes if self.peers is not None else 0,
            "peer_asks_failed": self.peers.failures if self.peers is not None else 0,
            "peer_mismatches": self.peers.mismatches if self.peers is not None else 0,
            "peer_refused_clients": self.peers.server.refused_clients if self.peers is not None else 0,
            **self._replica_figures(),
        }

    def _replica_figures(self) -> dict:
        holder = self.holder.status() if self.holder is not None else {}
        origin = self.replicator.status() if self.replicator is not None else {}
        return {
            "replica_held_bytes": holder.get("replica_held_bytes", 0),
            "replica_received_bytes": holder.get("replica_received_bytes", 0),
            "takeovers": holder.get("takeovers", 0),
            "replicated_bytes": origin.get("replicated_bytes", 0),
            "replica_local_commits": origin.get("local_commits", 0),
            "replica_holder_losses": origin.get("holder_losses", 0),
        }

    # -- control commands -------------------------------------------------------------------------
    async def status(self, request: dict, progress) -> dict:
        usage = self.cache.usage()
        up = self.uploader
        f = self.figures()
        return {
            "mountpoint": self.mountpoint,
            "store": self.store.url,
            "cache_dir": str(self.cache_dir),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "part_size": self.config.part_size,
            "ram": usage["ram"],
            "disk": usage["disk"],
            "clean_bytes": usage["clean_bytes"],
            "writers_waiting": usage["writers_waiting"],
            "space_waits": usage["space_waits"],  # allocations that waited for room, since the mount
            "pending": {"files": up.pending_count(), "bytes": up.pending_bytes()},
            "uploading": {"parts_in_flight": self.config.upload_concurrency - up.part_slots.value},
            # Processes sending parts (transfer/workers.py): their pids, restarts, parts sent
            "store_workers": up.sender.workers.status() if up.sender.workers is not None else None,
            "uploaded_bytes": up.uploaded_bytes,
            "stored_bytes": up.stored_bytes,  # (compressed size where compressed)
            "durable_files": up.durable_files,
            "fetched_bytes": self.fetcher.fetched_bytes,
            "store_read_bytes": self.fetcher.store_bytes,  # (of those, what the store sent ...)
            "peer_read_bytes": self.fetcher.peer_bytes,  # (... and what peers did, checked)
            # --cluster: the live peers, bytes served to and taken from them
            **({"peers": self._peers_status()} if self.peers is not None else {}),
            "page_cache_pushed_bytes": self.namespace.prefill.pushed_bytes,
            "page_cache_queued_files": self.namespace.prefill.queued_files,
            "passthrough": self._passthrough_status(),
            "errors": self.health.errors(),
            "store_health": self.health.status(),
            # Reads whose bytes never matched their checksum (EIO), and mismatches fetched again.
            "integrity_errors": list(self.fetcher.integrity_errors),
            "integrity_retries": self.fetcher.integrity_retries,
            "unverified_reads": self.fetcher.unverified_reads,
            "written_bytes": f["written_bytes"],
            "committed_bytes": f["committed_bytes"],
            "upload_rate_bytes_per_s": round(f["upload_rate"]),
            "oldest_pending_s": round(f["oldest_pending_s"], 1),
            "training_at_risk_s": round(f["at_risk_s"], 1),
            "retries": f["retries"],
            "latest_checkpoint": self.namespace.checkpoint_dir or None,  # pinned: evicted last
            "metrics_url": self.metrics.url if self.metrics is not None else None,
            "server_checksums": self.store.server_checksums,
            # checkpoint markers held until what they stand for is in the store (model/gate.py)
            "markers_waiting": [{**w.to_json(), "waits_for": w.describe()} for w in self.gate.waiting()],
            "markers_dropped": list(up.dropped),
            "writer_records": {**self.records.status(), "marker_listings": self.gate.listings},
            **self.namespace.status(),
        }

    def _passthrough_status(self) -> dict:
        """Whether the kernel reads complete cached files itself (FUSE passthrough), and why not."""
        files = self.namespace.prefill.files
        return {
            "on": self.ops.passthrough_on,
            **({} if self.ops.passthrough_on else {"off_because": self.ops.passthrough_off_reason}),
            "opens": self.ops.passthrough_opens,  # opens the kernel served from a file, since the mount
            "daemon_reads": self.ops.read_requests,  # READ requests the daemon served, since the mount
            "writes": self.namespace.files.passthrough_writes,  # new files written by the kernel itself
            "daemon_writes": self.ops.write_requests,  # WRITE requests the daemon served, since the mount
            # GETXATTR requests, since the mount: the kernel asks security.capability before a write
            # only after a file's attributes were refreshed (the filesystem clears set-id bits itself)
            "getxattr_requests": self.ops.getxattr_requests,
            "working_files": self.namespace.files.working_files,  # such files made, since the mount
            # cold read-only opens answered after fetching the file whole (--fetch-whole), since the mount
            "whole_fetches": self.namespace.files.whole_fetches,
            "whole_fetched_bytes": self.namespace.files.whole_fetched_bytes,
            # working copies and files fetched whole kept open now, and at most (the open-file limit)
            "backing_files": len(self.cache.backing),
            "max_backing_files": self.cache.max_backing_files,
            # their streamed parts read again at the commit: bytes, seconds, parts found changed
            "streamed_bytes": self.uploader.sender.streamed_bytes,  # parts sent before a close (all files)
            "verified_bytes": self.uploader.sender.verified_bytes,
            "verify_seconds": round(self.uploader.sender.verify_seconds, 3),
            "changed_parts": self.uploader.sender.changed_parts,
            **(files.status() if files is not None else {}),
        }

    def _peers_status(self) -> dict:
        assert self.peers is not None
        return {
            **self.peers.status(),
            "store_bytes": self.fetcher.store_bytes,
            "saved_bytes": self.fetcher.peer_bytes,
            **(self.holder.status() if self.holder is not None else {}),
            **(self.replicator.status() if self.replicator is not None else {}),
        }

    async def sync(self, request: dict, progress) -> dict:
        try:
            target = self.namespace.sync_target(request.get("paths") or [])
        except FsError as exc:
            raise CkptfsError(str(exc)) from None
        timeout = request.get("timeout")
        started = time.monotonic()
        files, size = self.uploader.pending_files_and_size(target)  # what this sync makes durable
        held_counts = self.namespace.sync_scope(request.get("paths") or [])
        with trio.move_on_after(timeout if timeout is not None else float("inf")) as scope:
            await self._drain(target, progress, held_counts)
        if scope.cancelled_caught:
            up = self.uploader
            markers = self._markers_waiting(target)
            raise TimedOut(
                f"timed out after {timeout:g} s: {up.pending_count(target)} operations "
                f"({up.pending_bytes(target)} bytes) not yet in the store "
                f"(store: {describe(self.health.status())}){markers}; nothing is lost, they stay pending"
            )
        return {
            "durable_up_to": target,
            "files": files,
            "bytes": size,
            "seconds": round(time.monotonic() - started, 3),
        }

    async def warmup(self, request: dict, progress) -> dict:
        """Fetch the files at or under ``paths`` into the cache, reporting progress."""
        started = time.monotonic()
        await self.namespace.refresh_paths(request.get("paths") or [])  # (what other mounts published)
        try:
            targets = self.namespace.contents_under(request.get("paths") or [])
        except FsError as exc:
            raise CkptfsError(str(exc)) from None
        last: dict = {}

        async def report(update: dict) -> None:
            last.update(update)
            await progress(update)

        timeout = request.get("timeout")
        landing: list = []
        try:
            with trio.move_on_after(timeout if timeout is not None else float("inf")) as scope:
                for content, _ in targets:  # blocks kept from the last mount are checked before they count
                    if content.verify:
                        await self.namespace.verify_kept(content)
                contents = [content for content, _ in targets]
                # (files not cached at all land in files of their own: opened, the kernel reads them)
                self.namespace.start_landings(contents, landing)
                result = await self.fetcher.warm(contents, report, PROGRESS_INTERVAL_S)
        except FsError as exc:
            raise CkptfsError(str(exc)) from None
        finally:
            self.namespace.end_landings(landing)
            for _, done in targets:  # in order: the last file becomes the most recently used
                done()
        if scope.cancelled_caught:
            cached, total = (
                humanfriendly.format_size(last.get(key, 0), binary=True)
                for key in ("done_bytes", "total_bytes")
            )
            raise TimedOut(f"timed out after {timeout:g} s: {cached} of {total} cached")
        return {**result, "seconds": round(time.monotonic() - started, 3)}

    async def verify(self, request: dict, progress) -> dict:
        """``ckptfs verify MOUNTPOINT``: read back what is in the store, with the mount's store."""
        paths, jobs = request.get("paths") or [], request.get("jobs", VERIFY_JOBS)
        if (
            not isinstance(paths, list)
            or not all(isinstance(p, str) for p in paths)
            or not isinstance(jobs, int)
            or not 1 <= jobs <= 256
        ):
            raise CkptfsError("verify: paths must be a list of strings and jobs 1 to 256")
        try:
            return await verify.run(self.store, paths, progress, jobs)
        except StoreError as exc:
            raise CkptfsError(str(exc)) from None

    async def catalog(self, request: dict, progress) -> dict:
        """The files at or under a path on the mount with their size, time and state (the
        ``user.ckptfs.state`` of each), and their recorded checksums if asked: what `ckptfs ls`,
        `ckptfs checkpoints` and `ckptfs gc` read on a mountpoint."""
        namespace = self.namespace
        path = str(request.get("path") or "")
        parts = [p for p in path.split("/") if p and p != "."]
        await namespace.refresh_paths(["/".join(parts)] if parts else [])  # what other mounts published
        node = namespace.root
        for part in parts:  # the tree, not the kernel: never stat()s through our own mount
            child = node.children.get(part) if node.is_dir else None
            if child is None:
                raise CkptfsError(f"no such file or directory on the mount: {path}")
            node = child
        entries, files = [], []
        for count, n in enumerate(node.walk(), 1):
            if count % YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()  # (walk copies each child list: changes meanwhile are safe)
            if n is namespace.root or n.unlinked:
                continue
            entry = {
                "path": n.key().rstrip("/"),
                "dir": n.is_dir,
                "size": n.size(),
                "mtime": n.mtime_ns / 1e9,
            }
            if not n.is_dir:
                try:
                    entry["state"] = namespace.state(n.ino)
                except FsError:
                    continue  # forgotten while we yielded
                files.append((n.ino, entry))
            entries.append(entry)
        if request.get("checksums"):
            await self._checksums(files)
        return {"entries": entries}

    async def _checksums(self, files: list[tuple[int, dict]]) -> None:
        limiter = trio.CapacityLimiter(CHECKSUM_LOOKUPS)

        async def one(ino: int, entry: dict) -> None:
            if entry["state"] != "durable":
                entry["checksum"] = "-"
                return
            async with limiter:
                try:
                    verified, xxh3 = await self.namespace.verification(ino)
                except (FsError, KeyError) as e:  # the store does not answer; or the file went meanwhile
                    entry["checksum"] = f"unknown ({e})" if isinstance(e, FsError) else "-"
                    return
            entry["checksum"] = catalog.describe(verified == "yes", xxh3)

        async with trio.open_nursery() as nursery:
            for ino, entry in files:
                nursery.start_soon(one, ino, entry)

    async def umount(self, request: dict, progress) -> dict:
        if request.get("wait", True):
            target, timeout = self.uploader.last_seq(), request.get("timeout")
            with trio.move_on_after(timeout if timeout is not None else float("inf")) as scope:
                await self._drain(target, progress)
            if scope.cancelled_caught:  # the mount stays: the caller decides whether to leave anyway
                up = self.uploader
                store = describe(self.health.status()) + self._markers_waiting(target)
                raise TimedOut(
                    f"gave up after {timeout:g} s: {up.pending_count(target)} files "
                    f"({humanfriendly.format_size(up.pending_bytes(target), binary=True)}) not yet in the store "
                    f"(store: {store}); {self.mountpoint} stays mounted. To unmount now: "
                    f"'ckptfs umount --no-wait {self.mountpoint}' (pending uploads resume at the next mount "
                    "with the same cache dir)"
                )
            await self.records.let_go(LET_GO_S)  # (nothing of ours unpublished: others need not wait)
        self.stop_requested.set()
        return {"pending_files": self.uploader.pending_count()}

    def _markers_waiting(self, target: int) -> str:
        """What each held marker up to ``target`` waits for (model/gate.py), for a timeout's message."""
        return "".join(
            f"; {w.key} waits for {w.describe()}"
            for seq, w in sorted(self.gate.waits.items())
            if seq <= target
        )

    async def _drain(self, target: int, progress, held_counts=None) -> None:
        """Wait until every op up to ``target`` is in the store, reporting progress."""
        up = self.uploader
        total = up.pending_bytes(target)
        async with trio.open_nursery() as nursery:

            async def report():
                while True:
                    left = up.pending_bytes(target)
                    await progress(
                        {
                            "pending_files": up.pending_count(target),
                            "pending_bytes": left,
                            "total_bytes": max(total, left),
                            "store": describe(self.health.status()),
                        }
                    )
                    await trio.sleep(PROGRESS_INTERVAL_S)

            nursery.start_soon(report)
            await up.wait_durable(target, held_counts)
            nursery.cancel_scope.cancel()
        await progress({"pending_files": 0, "pending_bytes": 0, "total_bytes": total})
