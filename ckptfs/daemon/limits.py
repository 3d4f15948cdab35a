"""The flags that size memory, disk and threads, checked against the machine at mount.

One place for every such check: ``ckptfs mount`` runs ``check`` before it starts the
daemon (so a bad value is one line at once, not a daemon dying 50 s later), and the
daemon runs it again (a foreground mount, or a machine that changed). ``check_ram_room``
runs in the daemon once the RAM arena is open: only then is it known how much of the
tmpfs the arena already holds (a remount reuses its pages).

The daemon's memory, stated in docs/architecture.md and tested in tests/test_limits.py:
RSS <= the RAM tier (--ram-cache: pages of the tmpfs arena the daemon touched) +
part-sized buffers ((3 x --upload-concurrency + 4) x --part-size: parts uploading, and,
with the opt-in CRT transport, their copies in its buffers as they go out, blocks being fetched, small files and
disk blocks being hashed or sent whole; allocated when first needed, then reused) + a fixed
overhead (the interpreter, libraries) + 2 MiB per FUSE reader thread (--fuse-threads: its
request and reply buffers, fusewire/session.py); on an s3:// store, with its store workers
(transfer/workers.py), also ``WORKER_OVERHEAD`` per worker and a part buffer per channel; with --cluster, also
(--upload-concurrency + 16) x --part-size (parts asked of peers; a block per replica stream held
for another node) + 2 MiB per thread of the peer channel (--peer-connections + --replicas +
--upload-concurrency + 16) + 128 MiB (TLS libraries, one large replica message header): see
``memory_bound``.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import humanfriendly

from ckptfs.config import MiB, MountConfig
from ckptfs.errors import MountError, UsageError
from ckptfs.store.base import S3_LIMITS

MIN_PART = 4096  # a part is a cache block: at least a page
MAX_PART = S3_LIMITS.max_part_size  # S3's largest part; larger blocks only make every copy and upload coarser
S3_MIN_PART = S3_LIMITS.min_part_size
# Parts in flight are threads and connections (uploads, and as many fetches): past a few dozen
# they add memory and contention, not throughput. A fixed cap, not one per core: uploads wait
# on the network, not the CPU.
MAX_CONCURRENCY = 64
BODIES_SHARE = 4  # upload bodies (concurrency x part size) may take at most 1/4 of the machine's RAM
FIXED_OVERHEAD = 128 * MiB  # interpreter, libraries, FUSE and socket buffers (35 MiB measured idle)
SHM_HINT = (
    "a container's /dev/shm is 64 MiB unless started with a larger one (docker run --shm-size=2g, "
    "or an emptyDir with medium: Memory in Kubernetes)"
)


def fmt(n: int) -> str:
    return humanfriendly.format_size(n, binary=True)


MAX_REPLICA_STREAMS = 16  # other nodes' replica streams held at once (cluster/replicas.py), a block each
MAX_FUSE_THREADS = 256  # --fuse-threads
FUSE_THREAD = 2 * MiB  # a FUSE reader's request buffer (1 MiB + 4 KiB) and READ reply buffer (1 MiB)
MAX_PEER_CONNECTIONS = 256  # --peer-connections: a thread each, and a 1 MiB buffer when sending from disk
# With --cluster, each thread of the peer channel: a served connection (--peer-connections),
# a replica stream to a holder (--replicas), an ask of a peer (--upload-concurrency), a replica
# stream held for another node (MAX_REPLICA_STREAMS). It may hold PEER_BUFFER (a disk block on
# its way out, through cluster/peers.py's block_sender), its TLS state and stack (76 KiB per
# connection measured), an idle client connection (at most --upload-concurrency of those), a
# replica message header of at most 64 KiB (cluster/replicas.py SMALL_HEADER) and its decoded
# JSON (at most 25 bytes per byte of JSON, measured for the worst: lists of empty lists).
PEER_THREAD = 2 * MiB
# With --cluster: OpenSSL and ``cryptography``, and the one replica message header over 64 KiB
# held at a time (at most cluster/peer_channel.py FRAME_HEADER_MAX, 4 MiB; its bytes twice and
# its decoded JSON, up to 25 times).
CLUSTER_OVERHEAD = 128 * MiB
# A store worker process (transfer/workers.py) without its part buffers: the interpreter, boto3
# and its clients, a thread per channel.
WORKER_OVERHEAD = 96 * MiB


def memory_bound(config: MountConfig) -> int:
    """The most the daemon's RSS, with its store workers', may reach with these flags (see the
    module doc). A store worker: its interpreter (``WORKER_OVERHEAD``) and a part buffer per
    channel (transfer/workers.py). With
    --cluster: the parts asked of peers take as much again as the fetches (--upload-concurrency
    x part size: ``PeerCache.threads`` holds an ask given up on until it ends), each replica
    stream this node holds for another (at most ``MAX_REPLICA_STREAMS``) a block, each thread of
    the peer channel ``PEER_THREAD``, and the TLS libraries ``CLUSTER_OVERHEAD``."""
    bound = config.ram_cache + (3 * config.upload_concurrency + 4) * config.part_size + FIXED_OVERHEAD
    bound += config.fuse_threads * FUSE_THREAD
    workers = config.store_worker_count()
    if workers:  # (each its interpreter; a part buffer per channel, a fetched body per fetch)
        channels = config.channels_per_worker() * workers
        bound += workers * WORKER_OVERHEAD + (channels + config.upload_concurrency) * config.part_size
    if config.cluster:
        bound += (config.upload_concurrency + MAX_REPLICA_STREAMS) * config.part_size
        threads = config.peer_connections + config.replicas + config.upload_concurrency + MAX_REPLICA_STREAMS
        bound += threads * PEER_THREAD + CLUSTER_OVERHEAD
    return bound


# Descriptors (issue 42): each cached file the kernel may read or write itself (a working copy,
# a file fetched whole, a passthrough copy: cache/backing.py, model/passthrough.py) keeps one
# open. What the daemon needs besides: the arenas, journal, log, control and metrics sockets, a
# file:// store's files being put or read (``FD_RESERVE``), and per flag a cloned /dev/fuse fd
# per FUSE reader, the store's connections (2 x --upload-concurrency + 4, daemon/run.py), a
# worker's channels, and with --cluster a socket per peer-channel thread.
FD_RESERVE = 256
FD_PER_WORKER = 8  # besides a socket per channel: its pipes, and the descriptors sent to it in flight
MIN_CACHED_FILES = 64  # fewer kept open than this: a warning at mount (more files go through the daemon)
BACKING_SHARE = 4  # working copies and landed files take 3/4 of the budget, passthrough copies 1/4


def _open_file_target() -> tuple[int, int, int]:
    """(soft, hard, what the soft limit may be raised to): the hard limit, or 2^20 (the kernel's
    default nr_open) where the hard one is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard, hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a shell's or systemd's 1024
    is far below what a daemon keeping cached files open needs); return the soft limit now."""
    soft, hard, target = _open_file_target()
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # (a hard limit the kernel caps lower, nr_open: keep the soft one)
    return soft


def descriptors_needed(config: MountConfig) -> int:
    """The descriptors the daemon holds besides cached files kept open, at most (see above)."""
    needed = FD_RESERVE + config.fuse_threads + 2 * config.upload_concurrency + 4
    needed += config.store_worker_count() * (FD_PER_WORKER + config.channels_per_worker())
    if config.cluster:
        needed += config.peer_connections + config.replicas + config.upload_concurrency + MAX_REPLICA_STREAMS
    return needed


def cached_file_budget(config: MountConfig, soft_limit: int) -> tuple[int, int]:
    """How many working copies and files fetched whole (``Cache.max_backing_files``), and how
    many passthrough copies (``PassthroughFiles.max_files``), may be kept open under
    ``soft_limit`` descriptors. Past them a file is written, or read, through the daemon."""
    room = max(0, soft_limit - descriptors_needed(config))
    return room - room // BACKING_SHARE, room // BACKING_SHARE


def _open_file_warning(config: MountConfig) -> str | None:
    _, _, limit = _open_file_target()  # (what the daemon will raise its soft limit to)
    files = sum(cached_file_budget(config, limit))
    if files >= MIN_CACHED_FILES:
        return None
    return (
        f"the open-file limit ({limit}, ulimit -Hn) leaves room for {files} cached files kept open "
        f"besides the {descriptors_needed(config)} descriptors these flags need: past them files are "
        "written and read through the daemon, slower; raise it (ulimit -n, or LimitNOFILE= for a service)"
    )


def machine_memory() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    return min(total, limit) if limit else total


def _cgroup_memory_limit() -> int | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            candidates += [f"/sys/fs/cgroup{path}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in controllers.split(","):  # cgroup v1
            candidates += [
                f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            ]
    for candidate in candidates:
        try:
            text = Path(candidate).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's huge "no limit"
            return int(text)
    return None


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (the cache dir may not exist yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fs_size(path: Path) -> tuple[int, int]:
    """(size, bytes free for us) of the filesystem holding ``path``."""
    st = os.statvfs(_existing(path))
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _allocated(path: Path) -> int:
    """Bytes a file already holds on its filesystem (0 if absent); never follows a symlink."""
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def ram_filesystem(config: MountConfig) -> Path:
    """Where the RAM tier's arena lives: the shm dir, or the cache dir when there is none."""
    return Path(config.shm_dir) if os.path.isdir(config.shm_dir) else Path(config.cache_dir)


def check(config: MountConfig) -> list[str]:
    """Raise UsageError (one line) for a flag this machine cannot honour; return warnings."""
    part, threads = config.part_size, config.upload_concurrency
    if not MIN_PART <= part <= MAX_PART:
        raise UsageError(
            f"--part-size {fmt(part)} is out of range: between {fmt(MIN_PART)} and {fmt(MAX_PART)}"
        )
    if config.store_url.lower().startswith("s3://") and part < S3_MIN_PART:
        raise UsageError(
            f"--part-size {fmt(part)} is out of range: S3 parts must be between {fmt(S3_MIN_PART)} "
            f"and {fmt(S3_LIMITS.max_part_size)}"
        )
    if threads > MAX_CONCURRENCY:
        raise UsageError(
            f"--upload-concurrency {threads} is too many: at most {MAX_CONCURRENCY} "
            "(each part in flight is a thread, a connection and a part-sized buffer)"
        )
    if config.fuse_threads > MAX_FUSE_THREADS:
        raise UsageError(
            f"--fuse-threads {config.fuse_threads} is too many: at most {MAX_FUSE_THREADS} (each is a thread)"
        )
    if config.peer_connections > MAX_PEER_CONNECTIONS:
        raise UsageError(
            f"--peer-connections {config.peer_connections} is too many: at most {MAX_PEER_CONNECTIONS} "
            "(each is a thread)"
        )
    memory = machine_memory()
    bodies = threads * part
    if bodies * BODIES_SHARE > memory:
        raise UsageError(
            f"--upload-concurrency {threads} x --part-size {fmt(part)} = {fmt(bodies)} of upload buffers, "
            f"more than a quarter of this machine's {fmt(memory)} of RAM: "
            "lower --part-size or --upload-concurrency"
        )

    ram = config.ram_cache
    if 0 < ram < part:
        raise UsageError(
            f"--ram-cache {fmt(ram)} cannot hold one part ({fmt(part)}): "
            "give at least --part-size, or 0 for no RAM tier"
        )
    if ram > memory:
        raise UsageError(
            f"--ram-cache {fmt(ram)} is more than this machine's RAM ({fmt(memory)}): lower --ram-cache"
        )
    if ram + bodies > memory:
        raise UsageError(
            f"--ram-cache {fmt(ram)} plus {fmt(bodies)} of upload buffers is more than this machine's "
            f"RAM ({fmt(memory)}): lower --ram-cache, --part-size or --upload-concurrency"
        )
    shm = ram_filesystem(config)
    shm_size, _ = _fs_size(shm)
    if ram > shm_size:
        raise UsageError(
            f"--ram-cache {fmt(ram)} does not fit in {shm} ({fmt(shm_size)} in all): "
            f"lower --ram-cache, or pass --shm-dir on a larger tmpfs; {SHM_HINT}"
        )

    disk = config.cache_size
    if disk < part:
        raise UsageError(
            f"--cache-size {fmt(disk)} cannot hold one part ({fmt(part)}): the disk tier holds "
            "fsynced files and what the RAM tier cannot; give at least --part-size"
        )
    cache_dir = Path(config.cache_dir)
    disk_size, disk_free = _fs_size(cache_dir)
    if disk > disk_size:
        raise UsageError(
            f"--cache-size {fmt(disk)} is more than the whole filesystem of {_existing(cache_dir)} "
            f"({fmt(disk_size)}): lower --cache-size or pass --cache-dir on a larger disk"
        )
    warnings = [w for w in [_open_file_warning(config)] if w]
    room = disk_free + _allocated(cache_dir / "disk.arena")
    if disk > room:
        warnings.append(
            f"--cache-size {fmt(disk)} but only {fmt(room)} is free for it on {_existing(cache_dir)}: "
            "writes get ENOSPC once the disk is full"
        )
    return warnings


def check_ram_room(config: MountConfig, budget: int, arena: int, held: int) -> None:
    """At mount: the RAM tier's filesystem must have room for the budget now. ``arena`` is the
    arena file's descriptor, ``held`` the bytes its pages already take (reused, not new)."""
    st = os.fstatvfs(arena)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if budget > free + held:
        where = ram_filesystem(config)
        raise MountError(
            f"--ram-cache {fmt(budget)} does not fit in {where}: {fmt(free + held)} free of "
            f"{fmt(size)}: lower --ram-cache, pass --shm-dir on a larger tmpfs, or free space "
            f"there; {SHM_HINT}"
        )
