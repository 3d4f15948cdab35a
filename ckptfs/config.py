"""Mount settings shared by the CLI and the daemon, and where each mount keeps its files."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
VERIFY_JOBS = 8  # parts `ckptfs verify` reads at once (by default)


def default_store_dir() -> Path:
    """The embedded local store used when no STORE_URL is given."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "ckptfs" / "store"


def mount_id(mountpoint: str | os.PathLike) -> str:
    """A short stable name for a mountpoint (for default cache and socket paths)."""
    return hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]


def default_cache_dir(mountpoint: str | os.PathLike) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "ckptfs" / mount_id(mountpoint)


def runtime_dir() -> Path:
    """Where control sockets live: short paths (sockaddr_un holds 108 bytes), private to the user."""
    if os.geteuid() == 0:
        return Path("/run/ckptfs")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "ckptfs" if xdg else Path(f"/tmp/ckptfs-{os.geteuid()}")


def control_socket_path(mountpoint: str | os.PathLike) -> Path:
    return runtime_dir() / f"{mount_id(mountpoint)}.sock"


@dataclass
class MountConfig:
    mountpoint: str
    store_url: str  # s3://bucket[/prefix] or file:///path
    cache_dir: str
    endpoint_url: str | None = None
    ram_cache: int = 1 * GiB  # RAM tier budget (tmpfs arena), bytes
    cache_size: int = 16 * GiB  # NVMe tier budget (arena file in cache_dir), bytes
    part_size: int = 8 * MiB
    upload_concurrency: int = 8  # parts in flight across all files
    # Processes that read, hash, sign and send the parts of an S3 store (transfer/workers.py), so
    # that work holds no lock the FUSE handlers need; 0: the daemon's threads do it; -1: by the
    # cores (``default_store_workers``).
    store_workers: int = -1
    # Threads reading FUSE requests (fusewire/session.py), at most: a request waiting on the
    # store holds one, so this many may wait at once; each holds up to 2 MiB of buffers.
    fuse_threads: int = 16
    # Bytes of complete cached versions kept as plain files in the cache dir, which the kernel
    # reads itself (FUSE passthrough: model/passthrough.py); -1: as much as --cache-size; 0: off.
    passthrough_cache: int = -1
    # A read-only open of a file none of which is cached, up to this many bytes, fetches it whole
    # (through the store workers) into a file of the cache that the kernel then reads itself
    # (model/files.py ``land_whole``): a cold torch.load reads at page-cache speed, with no READ
    # request through the daemon. The open returns once the file is here. 0: never.
    fetch_whole: int = 16 << 30
    # New contents of write-only opens (torch.save, any checkpoint writer) go into files of
    # their own that the kernel writes itself (FUSE passthrough: cache/backing.py); False: every
    # write goes through the daemon's arenas. Off with --replicas (their stream sees the writes).
    passthrough_writes: bool = True
    # Seconds a directory listing from the store is trusted before the next use lists it again
    # (what other mounts made durable shows up), and a name found absent is not asked again.
    # 0: ask the store every time.
    list_ttl: float = 5.0
    # Seconds a write waits for cache space while nothing is uploaded (the store is down)
    # before it fails with ENOSPC.
    write_timeout: float = 60.0
    # Seconds a read of data not in the cache waits while the store is in trouble (failing or
    # not answering) before it fails with EIO. A store that answers, however slowly, never trips it.
    read_timeout: float = 60.0
    # Seconds a close waits for the store to take this node's writer record of the file's
    # directory (cluster/records.py) before it goes on without it.
    record_timeout: float = 10.0
    # Seconds without a heartbeat after which a node holding writer records counts as lost: its
    # records no longer hold the markers of saves made after that (cluster/records.py).
    lost_node_after: float = 300.0
    # Globs of files that are never held as checkpoint markers (model/gate.py): "*" turns it off.
    no_marker: list[str] = field(default_factory=list)
    # --cluster: mounts of one store URL that pass it read each part from the store once and
    # from each other after that (cluster/peers.py), over mutual TLS at ``peer_addr``.
    cluster: bool = False
    peer_addr: str | None = None  # HOST[:PORT] this node serves peers on; None: see peers.default_host
    peer_connections: int = 64  # peers' connections served at once (a thread each)
    # --replicas K (with --cluster): a commit returns once K other live nodes also hold its bytes
    # and journal ops (cluster/replication.py), waiting at most ``replica_timeout`` seconds; a
    # holder publishes a node's pending ops once it has been silent ``takeover_after`` seconds.
    replicas: int = 0
    failure_domain: str = ""  # a label (a rack): replicas go to nodes of other domains first
    replica_timeout: float = 5.0
    takeover_after: float = 30.0
    shm_dir: str = "/dev/shm"  # the tmpfs that holds the RAM tier (a container's may be small)
    allow_other: bool = False  # let other users in (the kernel still checks each file's mode)
    # Modes of what the store does not record (objects loaded from it): 0666/0777 less this.
    umask: int = 0o077
    # --compress zstd[:LEVEL]: the zstd level parts are compressed at (objects/compression.py); 0: off
    compress: int = 0
    keep_ram_cache: bool = False  # a clean umount leaves the RAM arena (else it is removed)
    log_level: str = "INFO"
    foreground: bool = False
    metrics_port: int | None = None  # Prometheus endpoint (daemon/metrics.py); None: none; 0: a free port
    metrics_addr: str = "127.0.0.1"

    def store_worker_count(self) -> int:
        """The store workers this mount runs (transfer/workers.py): an S3 store's only."""
        if not self.store_url.lower().startswith("s3://"):
            return 0
        return self.store_workers if self.store_workers >= 0 else default_store_workers()

    def channels_per_worker(self) -> int:
        """Requests each store worker serves at once: together a part per upload slot, two whole
        files' hashes and a fetch per fetch slot (both --upload-concurrency), spread evenly."""
        return -(-(2 * self.upload_concurrency + 2) // max(1, self.store_worker_count()))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MountConfig:
        return cls(**json.loads(text))


MAX_REPLICAS = 8  # --replicas
MAX_STORE_WORKERS = 16  # --store-workers


def default_store_workers(cores: int | None = None) -> int:
    """A worker process per two cores, one at least and 8 at most: on a small node the store's
    server and the application need the rest."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(8, cores // 2))


MIN_TAKEOVER_S = 4.0  # --takeover-after: two heartbeats (cluster/members.py BEAT_S)


def parse_peer_addr(text: str) -> tuple[str | None, int]:
    """HOST[:PORT], [V6]:PORT, or :PORT (ValueError when malformed)."""
    host, port = text, "0"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "0"
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bad port in {text!r}")
    return host or None, int(port)


def mount_table() -> list[tuple[str, str, str]]:
    """(source, mountpoint, fstype) of every mount in /proc/self/mounts; never stat()s a mount."""
    try:
        text = Path("/proc/self/mounts").read_text(errors="surrogateescape")
    except OSError:
        return []
    return [
        (f[0], re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f[1]), f[2])  # \040 is a space
        for f in (line.split() for line in text.splitlines())
        if len(f) >= 3
    ]


def ckptfs_mounts() -> set[str]:
    """Mountpoints of ckptfs filesystems (live or with a dead daemon)."""
    return {
        mountpoint
        for source, mountpoint, fstype in mount_table()
        if fstype == "fuse.ckptfs" or (fstype.startswith("fuse") and source == "ckptfs")
    }


def mount_owner(mountpoint: str) -> int | None:
    """The uid that mounted the ckptfs filesystem at ``mountpoint`` (the user_id= option FUSE
    records in /proc/self/mountinfo), or None if none is mounted there. Reads the mount table
    only: never stat()s the mount, which a hung daemon would block."""
    try:
        text = Path("/proc/self/mountinfo").read_text(errors="surrogateescape")
    except OSError:
        return None
    owner = None  # the last (topmost) mount there wins
    for line in (
        text.splitlines()
    ):  # ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        fstype, source, options = (fields[dash + 1 : dash + 4] + ["", "", ""])[:3]
        if not (fstype == "fuse.ckptfs" or (fstype.startswith("fuse") and source == "ckptfs")):
            continue
        if re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]) != mountpoint:
            continue
        found = re.search(r"(?:^|,)user_id=(\d+)(?:,|$)", options)
        owner = int(found[1]) if found else 0  # (the kernel requires user_id= on FUSE mounts)
    return owner
