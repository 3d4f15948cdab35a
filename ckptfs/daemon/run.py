"""The daemon: the mountpoint and cache dir checks, the store, the parts (``wiring.build_core``:
the wiring and the start-up order crash recovery needs), the FUSE loop, the control commands
and the workers in one trio nursery, signals and a clean shutdown.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ckptfs.cache import clean_index
from ckptfs.cache.arena import RAM
from ckptfs.cache.journal import Journal
from ckptfs.config import MountConfig, control_socket_path, mount_table
from ckptfs.control.server import ControlServer
from ckptfs.daemon import limits
from ckptfs.daemon.commands import Commands
from ckptfs.daemon.mount_paths import check_mount_paths, prepare_mountpoint
from ckptfs.daemon.wiring import CLEAN_INDEX, build_core
from ckptfs.errors import MountError, StoreError
from ckptfs.fuse.ops import Operations
from ckptfs.fusewire.mount import MountFailed
from ckptfs.fusewire.session import Notifier, Session
from ckptfs.model.prefill import KernelCache
from ckptfs.objects import integrity
from ckptfs.objects.logical_store import LogicalStore
from ckptfs.store import open_store
from ckptfs.util import private_files
from ckptfs.util.background import BackgroundThreads

if TYPE_CHECKING:
    from ckptfs.daemon.metrics import MetricsServer

log = logging.getLogger(__name__)

READ_AHEAD_KB = 1024  # read requests of 1 MiB instead of 128 KiB (docs/machine-facts.md)


def run(config: MountConfig, on_ready: Callable[[], None] | None = None) -> None:
    """Mount and serve until unmounted. Raises MountError if the mount cannot start."""
    Daemon(config).run(on_ready or (lambda: None))


RAM_OWNER = "owner"  # in a RAM tier's directory: the cache dir it belongs to
RAM_DIR_RECORD = "ram.dir"  # in the cache dir: which RAM tier directory is its own
RAM_PREFIX = "ckptfs-"


def recorded_ram_dir(cache_dir: Path) -> Path | None:
    """The RAM tier directory a cache dir recorded at its last mount (None if none)."""
    try:
        return Path(os.fsdecode(private_files.read_file(Path(cache_dir) / RAM_DIR_RECORD, 4096)))
    except FileNotFoundError:
        return None


def claim_ram_dir(cache_dir: Path, shm_dir: Path) -> Path:
    """The RAM tier's directory under ``shm_dir``: the one this cache dir recorded if it is still
    ours, so a remount after a crash finds its arena; otherwise a fresh one with a random name
    (made 0700 and exclusively, so another user can neither guess nor pre-create it). Sweeps
    away first the RAM tiers of cache dirs that no longer exist: they would hold their RAM
    until reboot otherwise."""
    if not shm_dir.is_dir():
        return cache_dir / "ram"
    private_files.check_shared_parent(shm_dir, "shm dir")
    _sweep_ram_dirs(shm_dir)
    recorded = recorded_ram_dir(cache_dir)
    if (
        recorded is not None
        and recorded.name.startswith(RAM_PREFIX)
        and private_files.is_private_dir(recorded)
        and _ram_dir_owner(recorded) == cache_dir
    ):
        if recorded.parent != shm_dir:  # --shm-dir changed: its blocks may be committed data, keep them
            private_files.check_shared_parent(recorded.parent, "shm dir of the last mount")
            log.warning(
                "using the RAM tier %s of the last mount; --shm-dir applies after a clean umount", recorded
            )
        return recorded
    if recorded is not None:
        log.info(
            "the RAM tier %s of the last mount is gone (a reboot?) or not usable: starting a fresh one",
            recorded,
        )
    ram_dir = Path(tempfile.mkdtemp(prefix=RAM_PREFIX, dir=shm_dir))
    with os.fdopen(private_files.open_file(ram_dir / RAM_OWNER, os.O_WRONLY, new=True), "wb") as f:
        f.write(os.fsencode(cache_dir))
    private_files.write_file(cache_dir / RAM_DIR_RECORD, os.fsencode(ram_dir))
    return ram_dir


def _ram_dir_owner(ram_dir: Path) -> Path | None:
    """The cache dir a RAM tier directory of ours belongs to, read without following links."""
    try:
        return Path(os.fsdecode(private_files.read_file(ram_dir / RAM_OWNER, 4096)))
    except (OSError, MountError):
        return None


def _sweep_ram_dirs(shm_dir: Path) -> None:
    """Remove the RAM tiers whose cache dir is gone. Only directories of ours (owned by us, 0700,
    not links) are looked into: nothing another user made there is ever read or logged."""
    with os.scandir(shm_dir) as entries:
        candidates = [Path(e.path) for e in entries if e.name.startswith(RAM_PREFIX)]
    fuse_mounts = [Path(mp) for _, mp, fstype in mount_table() if fstype.startswith("fuse")]
    for ram_dir in candidates:
        if not private_files.is_private_dir(ram_dir):
            continue
        owner = _ram_dir_owner(ram_dir)
        if owner is None or any(m == owner or m in owner.parents for m in fuse_mounts):
            continue  # never stat() into a FUSE mount: a stopped daemon there would hang our start-up
        if not owner.exists():
            log.info("removing the RAM tier of %s (that cache dir is gone): %s", owner, ram_dir)
            shutil.rmtree(ram_dir, ignore_errors=True)


class FuseKernelCache(KernelCache):
    """The kernel's caches through the FUSE session's notifications. Asked only once the session
    is mounted: the pushes and refreshes that call it start after ``Session.mount``."""

    def __init__(self, mountpoint: str):
        self.mountpoint = mountpoint
        self.notifier: Notifier | None = None  # set once mounted

    def store_pages(self, ino: int, offset: int, data) -> None:
        if self.notifier is not None:
            self.notifier.store(ino, offset, data)

    def invalidate_inode(self, ino: int) -> None:
        if self.notifier is not None:
            self.notifier.inval_inode(ino)

    def stat(self, key: str) -> os.stat_result:
        return os.stat(os.path.join(self.mountpoint, key))

    def forget_name(self, parent_ino: int, name: str) -> None:
        if self.notifier is not None:
            self.notifier.inval_entry(parent_ino, os.fsencode(name))


class Daemon:
    def __init__(self, config: MountConfig):
        self.config = config
        self.mountpoint = os.path.abspath(config.mountpoint)
        self.cache_dir = Path(config.cache_dir).expanduser().resolve()
        self.started = time.time()
        self.stop_requested: trio.Event | None = None  # made inside trio.run
        self.trio_token: trio.lowlevel.TrioToken | None = None  # while serving: for the metrics thread
        self.metrics: MetricsServer | None = None  # with --metrics-port

    def run(self, on_ready: Callable[[], None]) -> None:
        self._start_metrics()  # first: a port taken fails the mount before anything is made
        try:
            self._run(on_ready)
        finally:
            self._stop_metrics()

    def _run(self, on_ready: Callable[[], None]) -> None:
        prepare_mountpoint(self.mountpoint)
        check_mount_paths(self.config)
        given = Path(self.config.cache_dir).expanduser()
        if given.is_symlink():  # whoever can make the link would choose where root writes
            raise MountError(f"refusing the cache dir {given}: it is a symbolic link")
        self.cache_dir.parent.mkdir(parents=True, exist_ok=True)
        private_files.ensure_dir(self.cache_dir, "cache dir")
        self._lock = self._lock_cache_dir()
        try:
            # (sizes as the mount shows them: a compressed object's are its uncompressed ones)
            self.store = LogicalStore(
                open_store(
                    self.config.store_url,
                    self.config.endpoint_url,
                    max_connections=self.config.upload_concurrency * 2 + 4,
                )
            )
            self.store.check()
            self.store.detect_server_checksums()  # (once: S3 CRC32C per part where the server checks it)
            listing = list(self.store.list(""))
        except StoreError as exc:
            raise MountError(str(exc)) from exc
        self.ram_dir = claim_ram_dir(self.cache_dir, Path(self.config.shm_dir))
        covered = os.stat(self.mountpoint)  # the root looks like the directory it covers
        kernel = FuseKernelCache(self.mountpoint)
        open_files = limits.raise_open_file_limit()
        cached_files = limits.cached_file_budget(self.config, open_files)
        log.info("open-file limit %d: up to %d + %d cache files kept open", open_files, *cached_files)
        self.core = build_core(
            self.config,
            self.store,
            self.cache_dir,
            self.ram_dir,
            root=(covered.st_mode, covered.st_uid, covered.st_gid),
            kernel=kernel,
            cached_files=cached_files,
        )
        core = self.core
        self.health, self.cache, self.journal = core.health, core.cache, core.journal
        self.uploader, self.fetcher, self.namespace = core.uploader, core.fetcher, core.namespace
        self.store.report_to(self.health)
        self.ops = Operations(self.namespace, self.config.part_size, self.mountpoint)
        # default_permissions: the kernel checks every access against the modes, so other users,
        # when allowed in at all, reach only what the modes let them. The source in the mount
        # table is the store URL, as an fstab line names it: `mount -a` then knows the line is
        # mounted already.
        options = ["default_permissions"]
        if self.config.allow_other:
            options.append("allow_other")
        self.session = Session(
            self.ops,
            self.mountpoint,
            fsname=self.store.url,
            options=options,
            max_threads=self.config.fuse_threads,
            passthrough=self.config.passthrough_cache != 0 or self._wants_passthrough_writes(),
            on_refused=self.ops.passthrough_refused,
        )
        try:
            self.session.mount()
        except (MountFailed, OSError) as exc:
            core.close()
            self.store.close()
            raise MountError(f"cannot mount at {self.mountpoint}: {exc}") from exc
        kernel.notifier = self.session.notifier
        files = self.namespace.prefill.files
        reads = files is not None and files.on
        writes = self._wants_passthrough_writes()
        if (reads or writes) and self._probe_passthrough(self.cache.working_dir):
            self.ops.passthrough_on = True
            self.ops.passthrough_off_reason = ""
            self.namespace.passthrough_on(reads, writes)
            log.info(
                "passthrough: reads of cached files %s, writes %s",
                "on" if reads else "off (--passthrough-cache 0)",
                "on" if writes else f"off ({self._writes_off_reason()})",
            )
        else:
            self.namespace.passthrough_off()
            self.ops.passthrough_off_reason = self.passthrough_off_reason()
            log.info(
                "passthrough off: %s; every read and write goes through the daemon",
                self.ops.passthrough_off_reason,
            )
        try:
            trio.run(self._serve, listing, on_ready)
            self._save_clean_index()
        finally:
            self.session.close()
            core.close()
            self.store.close()
            log.info("unmounted %s", self.mountpoint)
        self._drop_ram_tier()  # a clean stop only: after a crash the next mount needs it

    def _probe_passthrough(self, directory: Path) -> bool:
        """A backing file in ``directory`` is taken by the kernel (checked once, at mount)."""
        probe = directory / ".probe"
        probe.unlink(missing_ok=True)
        fd = private_files.open_file(probe, os.O_RDWR, new=True)
        try:
            return self.session.probe_passthrough(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _wants_passthrough_writes(self) -> bool:
        return self.config.passthrough_writes and not self.config.replicas

    def _writes_off_reason(self) -> str:
        return (
            "--replicas: their stream sees every write" if self.config.replicas else "--no-passthrough-writes"
        )

    def passthrough_off_reason(self) -> str:
        if self.config.passthrough_cache == 0 and not self._wants_passthrough_writes():
            return f"--passthrough-cache 0, {self._writes_off_reason()}"
        return self.session.backing.refused or "no FUSE channel"

    # -- start-up helpers ---------------------------------------------------------------
    def _drop_ram_tier(self) -> None:
        """Give the RAM arena (and the weights in it) back to the node, unless asked to keep it or
        the journal still needs blocks in it (uploads left pending by `umount --no-wait` or a
        stop with the store down): those resume from it at the next mount."""
        if self.config.keep_ram_cache or self.ram_dir.parent == self.cache_dir:
            return
        try:
            pending, _ = Journal(self.journal.path, self.cache.ram_arena_id).replay()
        except (OSError, ValueError, KeyError, TypeError, MountError) as exc:
            log.warning("keeping the RAM tier %s: cannot read the journal back (%s)", self.ram_dir, exc)
            return
        if any(ref is not None and ref[0] == RAM for op in pending for ref in op.blocks):
            log.info(
                "keeping the RAM tier %s: pending uploads have data there (the next mount resumes them)",
                self.ram_dir,
            )
            return
        shutil.rmtree(self.ram_dir, ignore_errors=True)
        (self.cache_dir / RAM_DIR_RECORD).unlink(missing_ok=True)
        log.info("removed the RAM tier %s", self.ram_dir)

    def _lock_cache_dir(self):
        lock = open(private_files.open_file(self.cache_dir / "lock", os.O_RDWR | os.O_CREAT), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise MountError(f"cache dir {self.cache_dir} is in use by another ckptfs mount") from None
        return lock

    # -- serving ---------------------------------------------------------------------------------
    def _save_clean_index(self) -> None:
        """Leave the cached durable files for the next mount with this cache dir."""
        started = time.monotonic()
        entries = [
            clean_index.CleanEntry(
                key,
                c.size,
                c.durable_at,
                list(c.blocks),
                clean_index.cached_digest(self.cache, c.size, c.blocks),
            )
            for key, c in self.namespace.clean_contents()
        ]
        try:
            clean_index.save(self.cache_dir / CLEAN_INDEX, self.cache, entries)
        except OSError as exc:
            log.warning("cannot save the clean cache index (the next mount starts cold): %s", exc)
            return
        log.info(
            "kept %d cached files (%s) for the next mount (%.1f s)",
            len(entries),
            sum(len([b for b in e.blocks if b]) for e in entries) * self.cache.block_size,
            time.monotonic() - started,
        )

    def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from ckptfs.daemon.metrics import MetricsServer  # (prometheus_client: only when asked for)

        metrics = MetricsServer(self.config.metrics_addr, self.config.metrics_port, self._figures_from_thread)
        self.metrics = metrics
        metrics.start()

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _figures_from_thread(self) -> dict | None:
        """The figures, taken on the trio loop (its dicts change there); None when not serving."""
        token = self.trio_token
        if token is None:
            return None
        try:
            return trio.from_thread.run_sync(self.commands.figures, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            return None

    async def _serve(self, listing, on_ready) -> None:
        self.stop_requested = trio.Event()
        self.commands = Commands(
            self.core,
            self.config,
            self.mountpoint,
            self.cache_dir,
            self.started,
            self.ops,
            self.metrics,
            self.stop_requested,
        )
        self.serving = trio.Event()  # the start-up stat through the mount has returned
        self.trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await self.core.start(nursery)
            await nursery.start(self.namespace.prefill.run)
            await nursery.start(self.namespace.tailer.run)
            files = self.namespace.prefill.files
            if files is not None and files.on:
                await nursery.start(files.run)
            await nursery.start(self.cache.run_populate, BackgroundThreads(1, "ckptfs-populate"))
            await self.core.fence()
            self.core.load(listing)
            server = ControlServer(control_socket_path(self.mountpoint), self.commands.handlers())
            await nursery.start(server.serve)
            nursery.start_soon(self._watch_signals)
            nursery.start_soon(self._when_serving, on_ready)
            nursery.start_soon(self._stopper)
            nursery.start_soon(self._sweep_manifests)
            try:
                await self.session.serve()
            finally:
                self.trio_token = None  # the metrics thread stops asking the loop
            # Shutdown: store calls in flight are abandoned, not awaited (a dead store would hold
            # the mount for minutes); pending work stays in the journal (docs/architecture.md).
            self.uploader.abandon_calls()
            nursery.cancel_scope.cancel()

    async def _when_serving(self, on_ready) -> None:
        try:
            st = await trio.to_thread.run_sync(os.stat, self.mountpoint)
        finally:
            self.serving.set()
        bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
        try:
            bdi.write_text(str(READ_AHEAD_KB))
        except OSError as exc:
            log.debug("cannot raise read-ahead (%s): reads stay at 128 KiB", exc)
        log.info("serving %s on %s (cache %s)", self.store.url, self.mountpoint, self.cache_dir)
        on_ready()

    async def _watch_signals(self) -> None:
        stop_requested = self.stop_requested
        assert stop_requested is not None  # made in _serve before its tasks start
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: unmounting; pending uploads resume on the next mount", signum)
                stop_requested.set()

    async def _stopper(self) -> None:
        stop_requested = self.stop_requested
        assert stop_requested is not None  # made in _serve before its tasks start
        await stop_requested.wait()
        # Our own calls through the mount (the start-up stat, the prefill's stat and invalidate)
        # end first: once the FUSE loop stops they would wait forever for the daemon's answer.
        await self.serving.wait()
        await self.namespace.prefill.stop()
        if self.core.peers is not None:
            await self.core.peers.leave()  # (the other nodes stop asking this one at once)
        await trio.sleep(0.05)  # let the umount reply reach the client
        self.session.terminate()

    async def _sweep_manifests(self) -> None:
        """Delete the manifests no object will need again (integrity.orphan_manifests), once a
        day over all mounts of the store, in the background: never in the way of the mount."""
        try:
            if not await trio.to_thread.run_sync(
                integrity.sweep_due, self.store, time.time(), abandon_on_cancel=True
            ):
                log.info("manifest sweep: not due (a mount of this store swept within the day)")
                return
            # The store's own listing: a manifest matches its object by either size (the LogicalStore
            # would HEAD every object of a bucket with compressed ones to give uncompressed sizes).
            orphans = await trio.to_thread.run_sync(
                integrity.orphan_manifests, self.store.inner, time.time(), abandon_on_cancel=True
            )
            for key in orphans:
                await trio.to_thread.run_sync(self.store.delete, key, abandon_on_cancel=True)
            log.info("manifest sweep: %d orphan manifests deleted", len(orphans))
        except StoreError as exc:
            log.info("manifest sweep skipped: %s", exc)
        except Exception:  # a bug here must not take the mount down
            log.exception("manifest sweep failed")
