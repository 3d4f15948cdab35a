"""`ckptfs mount`: its arguments, the checks before anything is mounted, and the daemon, served
in this process (--foreground) or detached (the parent waits for its "ok" on a pipe)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import humanfriendly

from ckptfs.cli.common import parse_positive_int, parse_seconds_arg, parse_size_arg
from ckptfs.config import (
    MAX_REPLICAS,
    MAX_STORE_WORKERS,
    MIN_TAKEOVER_S,
    MountConfig,
    default_cache_dir,
    default_store_dir,
    default_store_workers,
    parse_peer_addr,
)
from ckptfs.daemon import limits, logs
from ckptfs.daemon.mount_paths import check_mount_paths, check_mountpoint
from ckptfs.errors import CkptfsError, MountError, StoreError, UsageError, one_line
from ckptfs.objects import compression
from ckptfs.store.base import ObjectStore
from ckptfs.util import private_files

log = logging.getLogger("ckptfs")

READY_TIMEOUT_S = 60.0  # how long `mount` waits for the detached daemon to serve
LOG_LEVELS = logs.LEVELS


def _zero_to(high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 0 to ``high``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not 0 <= n <= high:
            raise argparse.ArgumentTypeError(f"give 0 to {high}, not {n}")
        return n

    return parse


parse_replicas = _zero_to(MAX_REPLICAS)  # --replicas K: 0 (off) to MAX_REPLICAS
parse_store_workers = _zero_to(MAX_STORE_WORKERS)  # --store-workers N: 0 (the daemon's threads) to 16


def _compress(text: str) -> int:
    try:
        return compression.parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--compress {text!r}: ")) from None


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _umask(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal umask (examples: 0077, 0022)")
    return value


def add_parser(sub) -> None:
    fmt = lambda n: humanfriendly.format_size(n, binary=True)  # noqa: E731
    p = sub.add_parser(
        "mount",
        help="mount a store on a directory; returns once the mount serves",
        description="Mount STORE_URL on MOUNTPOINT. Sizes take binary units: 512M = 512 MiB.",
    )
    p.add_argument(
        "store_url",
        nargs="?",
        metavar="STORE_URL",
        help=f"s3://bucket[/prefix] or file:///path (default: the local store in {default_store_dir()})",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="write-back cache, journal and log (default: under ~/.cache/ckptfs)",
    )
    p.add_argument(
        "--ram-cache",
        type=parse_size_arg,
        metavar="SIZE",
        help=f"RAM tier budget (default {fmt(MountConfig.ram_cache)})",
    )
    p.add_argument(
        "--cache-size",
        type=parse_size_arg,
        metavar="SIZE",
        help=f"disk tier budget (default {fmt(MountConfig.cache_size)})",
    )
    p.add_argument(
        "--endpoint-url", metavar="URL", help="S3-compatible endpoint (MinIO, Ceph RGW, Swift s3api, ...)"
    )
    p.add_argument(
        "--part-size",
        type=parse_size_arg,
        metavar="SIZE",
        help=f"upload part size (default {fmt(MountConfig.part_size)})",
    )
    p.add_argument(
        "--upload-concurrency",
        type=parse_positive_int,
        metavar="N",
        help=f"parts uploading at once (default {MountConfig.upload_concurrency})",
    )
    p.add_argument(
        "--store-workers",
        type=parse_store_workers,
        metavar="N",
        help="processes that move the bytes of an s3:// store (parts sent, blocks fetched); 0: the daemon's "
        f"threads do it (default: one per two cores, 1 to 8: {default_store_workers()} here)",
    )
    p.add_argument(
        "--fuse-threads",
        type=parse_positive_int,
        metavar="N",
        help="threads that read FUSE requests, at most; each holds up to 2 MiB of buffers "
        f"(default {MountConfig.fuse_threads})",
    )
    p.add_argument(
        "--passthrough-cache",
        type=parse_size_arg,
        metavar="SIZE",
        help="bytes of complete cached files kept as plain files in the cache dir, which the kernel "
        "reads itself (FUSE passthrough: Linux 6.9+, as root); 0 turns passthrough reads off "
        "(default: as much as --cache-size)",
    )
    p.add_argument(
        "--fetch-whole",
        type=parse_size_arg,
        metavar="SIZE",
        help="a read-only open of a file not cached, from --part-size up to SIZE, fetches it whole first, into a "
        "file of the cache the kernel then reads itself (with passthrough reads); larger files "
        "are read through the daemon as they are fetched; 0: always that way "
        f"(default {MountConfig.fetch_whole >> 30}G)",
    )
    p.add_argument(
        "--compress",
        type=_compress,
        metavar="zstd[:LEVEL]",
        help="store files as zstd seekable streams, each part compressed on its own with its "
        "bytes grouped where that helps float tensors (default: off; LEVEL 1..19, default "
        f"{compression.DEFAULT_LEVEL}); any mount reads them",
    )
    p.add_argument(
        "--list-ttl",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="how old a directory listing may get before its next use asks the store again, so "
        "files other mounts made durable show up; also how long a missing name is "
        f"remembered (default {MountConfig.list_ttl:g}; 0: ask every time)",
    )
    p.add_argument(
        "--write-timeout",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="how long a write waits for cache space while nothing gets uploaded (the store is "
        f"down) before it fails with ENOSPC (default {MountConfig.write_timeout:g})",
    )
    p.add_argument(
        "--read-timeout",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="how long a read of data not in the cache waits while the store fails or does not "
        f"answer before it fails with EIO (default {MountConfig.read_timeout:g})",
    )
    p.add_argument(
        "--record-timeout",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="how long a close waits for the store to take this node's record of the directory it "
        "writes in (other nodes' checkpoint markers wait for files it names) before it goes on "
        f"without it (default {MountConfig.record_timeout:g})",
    )
    p.add_argument(
        "--lost-node-after",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="how long a node holding unpublished files may go without a heartbeat in the store "
        "before it counts as lost: its files then no longer hold back the markers of checkpoints "
        f"saved after that (default {MountConfig.lost_node_after:g})",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        default=None,
        help="join the other mounts of this store URL that pass --cluster: each part of a "
        "checkpoint is read from the store by one node and taken from it by the others, over "
        "mutual TLS with certificates the nodes publish in the store (default: off)",
    )
    p.add_argument(
        "--peer-addr",
        metavar="HOST[:PORT]",
        help="with --cluster: where this node serves its peers (default: the address of the "
        "interface that routes to the store, any free port)",
    )
    p.add_argument(
        "--peer-connections",
        type=parse_positive_int,
        metavar="N",
        help=f"with --cluster: peers' connections served at once (default {MountConfig.peer_connections})",
    )
    p.add_argument(
        "--replicas",
        type=parse_replicas,
        metavar="K",
        help="with --cluster: a close (or fsync) returns once K other live nodes also hold the "
        "file's bytes and journal ops in their cache, so a node lost before its uploads end "
        "loses nothing: a holder publishes them (default 0: off)",
    )
    p.add_argument(
        "--failure-domain",
        metavar="LABEL",
        help="with --replicas: this node's failure domain (a rack, a power feed); replicas go to "
        "nodes of other domains first",
    )
    p.add_argument(
        "--replica-timeout",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="with --replicas: the longest a close waits for its replicas before it returns with "
        f"the file on this node only (a warning and a counter; default {MountConfig.replica_timeout:g})",
    )
    p.add_argument(
        "--takeover-after",
        type=parse_seconds_arg,
        metavar="SECONDS",
        help="with --replicas: how long a node may miss its heartbeats before a holder of its "
        f"replicas publishes its pending files (at least {MIN_TAKEOVER_S:g}; default "
        f"{MountConfig.takeover_after:g})",
    )
    p.add_argument(
        "--no-marker",
        action="append",
        metavar="GLOB",
        help="files matching GLOB (a path or a name: 'latest', '*.index.json') are published as "
        "plain files, never held until the checkpoint they mark is whole in the store; "
        "repeatable; '*' turns the hold off",
    )
    p.add_argument(
        "--shm-dir", metavar="DIR", help=f"the tmpfs that holds the RAM tier (default {MountConfig.shm_dir})"
    )
    p.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users use the mount (only as far as each file's mode allows); default: only you",
    )
    p.add_argument(
        "--umask",
        type=_umask,
        metavar="OCTAL",
        help="for files and directories whose mode the store does not record: 0666/0777 less "
        f"this, owned by the mounting user (default {MountConfig.umask:04o}: only you)",
    )
    p.add_argument(
        "--no-passthrough-writes",
        dest="passthrough_writes",
        action="store_false",
        default=None,
        help="write every file through the daemon's RAM and disk arenas; default: a new file or a "
        "truncating rewrite opened write-only goes into a file of its own in the cache dir, which "
        "the kernel writes itself (FUSE passthrough: Linux 6.9+, as root)",
    )
    p.add_argument(
        "--keep-ram-cache",
        action="store_true",
        help="leave the RAM tier in the shm dir at a clean umount (default: removed; the disk tier is kept)",
    )
    p.add_argument("--foreground", action="store_true", help="serve in this process, logging to stderr")
    p.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this TCP port (0: any free port; see 'ckptfs status')",
    )
    p.add_argument("--metrics-addr", metavar="ADDR", help="address the metrics listen on (default 127.0.0.1)")
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"one of {', '.join(LOG_LEVELS)} (default {MountConfig.log_level}); only TRACE "
        "adds the S3 libraries' lines, redacted: credentials, signatures and data never reach the log",
    )
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # set by `mount` for its detached daemon
    p.set_defaults(func=cmd_mount)


def cmd_mount(args: argparse.Namespace) -> int:
    config = mount_config(args)
    if args.ready_fd is None:  # the detached daemon's parent already checked these
        store = _open_store(config)
        try:
            check_mountpoint(config.mountpoint)
            check_mount_paths(config)
            _check_limits(config)
            store.check()
        finally:
            store.close()
    else:
        _check_limits(config)  # again: the machine may have changed (the paths: daemon.run checks them)
    if args.foreground:
        return _serve(config, args.ready_fd)
    return _spawn_daemon(config)


def mount_config(args: argparse.Namespace) -> MountConfig:
    for name, value in (
        ("MOUNTPOINT", args.mountpoint),
        ("--cache-dir", args.cache_dir),
        ("--shm-dir", args.shm_dir),
    ):
        if value is not None and not value.strip():  # an unset shell variable: not "the current directory"
            raise UsageError(f"{name} is empty")
    if args.metrics_addr is not None and args.metrics_port is None:
        raise UsageError("--metrics-addr needs --metrics-port")
    if (args.peer_addr is not None or args.peer_connections is not None) and not args.cluster:
        raise UsageError("--peer-addr and --peer-connections need --cluster")
    replica_flags = (args.failure_domain, args.replica_timeout, args.takeover_after)
    if (args.replicas or any(v is not None for v in replica_flags)) and not args.cluster:
        raise UsageError(
            "--replicas, --failure-domain, --replica-timeout and --takeover-after need --cluster"
        )
    if any(v is not None for v in replica_flags) and not args.replicas:
        raise UsageError("--failure-domain, --replica-timeout and --takeover-after need --replicas")
    if args.failure_domain is not None and not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", args.failure_domain):
        raise UsageError("--failure-domain: give 1-64 letters, digits or . _ : -")
    if args.takeover_after is not None and args.takeover_after < MIN_TAKEOVER_S:
        raise UsageError(
            f"--takeover-after: at least {MIN_TAKEOVER_S:g} s (a node's heartbeat comes every 2 s)"
        )
    if args.peer_addr is not None:
        try:
            parse_peer_addr(args.peer_addr)
        except ValueError as exc:
            raise UsageError(f"--peer-addr: {exc} (give HOST, HOST:PORT or [IPv6]:PORT)") from None
    mountpoint = os.path.realpath(args.mountpoint)
    options = {
        "ram_cache": args.ram_cache,
        "cache_size": args.cache_size,
        "part_size": args.part_size,
        "upload_concurrency": args.upload_concurrency,
        "store_workers": args.store_workers,
        "fuse_threads": args.fuse_threads,
        "passthrough_cache": args.passthrough_cache,
        "passthrough_writes": args.passthrough_writes,
        "fetch_whole": args.fetch_whole,
        "compress": args.compress,
        "list_ttl": args.list_ttl,
        "write_timeout": args.write_timeout,
        "read_timeout": args.read_timeout,
        "record_timeout": args.record_timeout,
        "lost_node_after": args.lost_node_after,
        "no_marker": args.no_marker,
        "cluster": args.cluster,
        "peer_addr": args.peer_addr,
        "peer_connections": args.peer_connections,
        "replicas": args.replicas,
        "failure_domain": args.failure_domain,
        "replica_timeout": args.replica_timeout,
        "takeover_after": args.takeover_after,
        "shm_dir": args.shm_dir and os.path.abspath(args.shm_dir),
        "umask": args.umask,
        "log_level": args.log_level,
        "metrics_port": args.metrics_port,
        "metrics_addr": args.metrics_addr,
    }
    config = MountConfig(
        mountpoint=mountpoint,
        store_url=args.store_url or f"file://{default_store_dir()}",
        cache_dir=os.path.abspath(args.cache_dir or default_cache_dir(mountpoint)),
        endpoint_url=args.endpoint_url,
        allow_other=args.allow_other,
        keep_ram_cache=args.keep_ram_cache,
        foreground=args.foreground and args.ready_fd is None,  # a person is watching the log
        **{k: v for k, v in options.items() if v is not None},
    )
    return config


def _check_limits(config: MountConfig) -> None:
    for warning in limits.check(config):  # (raises UsageError for what this machine cannot honour)
        print(f"ckptfs: warning: {warning}", file=sys.stderr)


def _open_store(config: MountConfig) -> ObjectStore:
    from ckptfs.store import open_store  # the s3 store pulls in boto3: only `mount` needs it

    try:
        return open_store(config.store_url, endpoint_url=config.endpoint_url)
    except StoreError as e:
        # open_store does no I/O: what it rejects is the command line itself.
        if e.errno == errno.EINVAL:
            raise UsageError(str(e)) from None
        raise


def _serve(config: MountConfig, ready_fd: int | None) -> int:
    """Run the daemon in this process. With ``ready_fd``, tell the parent `mount` how start-up went."""
    if ready_fd is not None:
        os.set_inheritable(ready_fd, False)  # helpers such as fusermount3 must not hold the pipe open
    logs.setup(config.log_level, sys.stderr)
    from ckptfs.daemon import run as daemon_run

    ready = False

    def on_ready() -> None:
        nonlocal ready
        ready = True
        log.info("ckptfs: %s mounted on %s", config.store_url, config.mountpoint)
        if ready_fd is not None:
            _report(ready_fd, "ok")

    try:
        daemon_run.run(config, on_ready)
    except (CkptfsError, StoreError) as e:
        if ready_fd is not None and not ready:
            _report(ready_fd, f"error: {one_line(str(e))}")
        raise
    return 0


def _report(fd: int, line: str) -> None:
    try:
        os.write(fd, line.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass  # the parent is gone (Ctrl-C): keep serving anyway


def daemon_argv(config: MountConfig) -> list[str]:
    """The `ckptfs mount ... --foreground` arguments that rebuild ``config`` in the detached daemon."""
    argv = [
        "mount",
        config.store_url,
        config.mountpoint,
        "--cache-dir",
        config.cache_dir,
        "--ram-cache",
        str(config.ram_cache),
        "--cache-size",
        str(config.cache_size),
        "--part-size",
        str(config.part_size),
        "--upload-concurrency",
        str(config.upload_concurrency),
        "--fuse-threads",
        str(config.fuse_threads),
        "--list-ttl",
        repr(config.list_ttl),
        "--write-timeout",
        repr(config.write_timeout),
        "--read-timeout",
        repr(config.read_timeout),
        "--record-timeout",
        repr(config.record_timeout),
        "--lost-node-after",
        repr(config.lost_node_after),
        "--shm-dir",
        config.shm_dir,
        "--log-level",
        config.log_level,
        "--foreground",
    ]
    argv += ["--umask", f"{config.umask:04o}"]
    argv += ["--passthrough-cache", str(config.passthrough_cache)] * (config.passthrough_cache >= 0)
    argv += ["--store-workers", str(config.store_workers)] * (config.store_workers >= 0)
    argv += ["--fetch-whole", str(config.fetch_whole)]
    argv += ["--no-passthrough-writes"] * (not config.passthrough_writes)
    for glob in config.no_marker:
        argv += [f"--no-marker={glob}"]
    if config.cluster:
        argv += ["--cluster", "--peer-connections", str(config.peer_connections)]
        argv += [f"--peer-addr={config.peer_addr}"] * bool(config.peer_addr)
    if config.replicas:
        argv += ["--replicas", str(config.replicas), "--replica-timeout", repr(config.replica_timeout)]
        argv += ["--takeover-after", repr(config.takeover_after)]
        argv += [f"--failure-domain={config.failure_domain}"] * bool(config.failure_domain)
    argv += ["--compress", f"zstd:{config.compress}"] * bool(config.compress)
    argv += ["--allow-other"] * config.allow_other + ["--keep-ram-cache"] * config.keep_ram_cache
    if config.endpoint_url:
        argv += ["--endpoint-url", config.endpoint_url]
    if config.metrics_port is not None:
        argv += ["--metrics-port", str(config.metrics_port), "--metrics-addr", config.metrics_addr]
    return argv


def _spawn_daemon(config: MountConfig) -> int:
    cache_dir = Path(config.cache_dir)
    if cache_dir.is_symlink():  # whoever can make the link would choose where root writes the log
        raise MountError(f"refusing the cache dir {cache_dir}: it is a symbolic link")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    private_files.ensure_dir(cache_dir, "cache dir")  # ours, 0700, before the log goes in it
    log_path = cache_dir / "ckptfs.log"
    # Run the same ckptfs code as this process, from / so the daemon pins no directory.
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    log_fd = logs.open_log_file(log_path)  # 0600, no link followed, ours
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfs", *daemon_argv(config), "--ready-fd", str(w)],
            pass_fds=(w,),
            start_new_session=True,
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
        )
    finally:
        os.close(w)
        os.close(log_fd)
    try:
        line = read_ready(r, READY_TIMEOUT_S)
    finally:
        os.close(r)
    if line == "ok":
        return 0
    if line is None:
        proc.terminate()
        raise MountError(
            f"the daemon did not finish mounting within {READY_TIMEOUT_S:g} s (stopped it); see {log_path}"
        )
    if line.startswith("error: "):
        raise MountError(line[len("error: ") :])
    raise MountError(f"the daemon exited during start-up; see {log_path}")


def read_ready(fd: int, timeout: float) -> str | None:
    """The first line written to ``fd`` ("" on EOF without one), or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()
