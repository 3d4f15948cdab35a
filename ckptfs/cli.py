"""The ``ckptfs`` command: parse arguments, call the store / daemon / control channel, print.

Errors meant for the user are ``CkptfsError`` or ``StoreError``: printed as one line
``ckptfs: <message>``; exit 2 for bad usage, 1 for anything else.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import humanfriendly

from ckptfs import compression, control, limits, logs, private
from ckptfs.cli_support import (ProgressBar, _call, _fmt, _mount_of, _mountpoint, _positive_int,
                                _relative_paths, _size)
from ckptfs.config import MountConfig, ckptfs_mounts, default_cache_dir, default_store_dir
from ckptfs.errors import CkptfsError, MountError, UsageError, one_line
from ckptfs.paths import check_mount_paths, check_mountpoint
from ckptfs.health import describe as describe_health
from ckptfs.store.base import ObjectStore, StoreError

log = logging.getLogger("ckptfs")

READY_TIMEOUT_S = 60.0  # how long `mount` waits for the detached daemon to serve
UNMOUNT_WAIT_S = 60.0  # how long `umount` waits for the mount and the daemon to go
UMOUNT_TIMEOUT_S = 300.0  # how long `umount` waits for uploads to drain (--timeout)
WATCH_INTERVAL_S = 2.0  # status --watch
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, clear: what top and watch(1) do
LOG_LEVELS = logs.LEVELS


# --- parsing --------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) and, in subcommands, accepts
    options between positionals (``mount s3://b --part-size 16M /mnt``)."""

    intermixed = False

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if not self.intermixed:
            return super().parse_known_args(args, namespace)
        self.intermixed = False  # parse_known_intermixed_args calls back into parse_known_args
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self.intermixed = True


MAX_SECONDS = 366 * 24 * 3600  # a year: longer waits overflow socket timeouts ('inf' among them)


def _compress(text: str) -> int:
    try:
        return compression.parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--compress {text!r}: ")) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is more than a year (at most {MAX_SECONDS})")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _interval(text: str) -> float:
    value = _seconds(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r}: refresh at most ten times a second (0.1 or more)")
    return value


def _umask(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal umask (examples: 0077, 0022)")
    return value


def build_parser() -> argparse.ArgumentParser:
    fmt = lambda n: humanfriendly.format_size(n, binary=True)  # noqa: E731
    parser = _Parser(prog="ckptfs", description="A FUSE filesystem for AI training checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("mount", help="mount a store on a directory; returns once the mount serves",
                       description="Mount STORE_URL on MOUNTPOINT. Sizes take binary units: 512M = 512 MiB.")
    p.add_argument("store_url", nargs="?", metavar="STORE_URL",
                   help=f"s3://bucket[/prefix] or file:///path (default: the local store in {default_store_dir()})")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory")
    p.add_argument("--cache-dir", metavar="DIR", help="write-back cache, journal and log (default: under ~/.cache/ckptfs)")
    p.add_argument("--ram-cache", type=_size, metavar="SIZE", help=f"RAM tier budget (default {fmt(MountConfig.ram_cache)})")
    p.add_argument("--cache-size", type=_size, metavar="SIZE", help=f"disk tier budget (default {fmt(MountConfig.cache_size)})")
    p.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint (MinIO, Ceph RGW, Swift s3api, ...)")
    p.add_argument("--part-size", type=_size, metavar="SIZE", help=f"upload part size (default {fmt(MountConfig.part_size)})")
    p.add_argument("--upload-concurrency", type=_positive_int, metavar="N",
                   help=f"parts uploading at once (default {MountConfig.upload_concurrency})")
    p.add_argument("--compress", type=_compress, metavar="zstd[:LEVEL]",
                   help="store files as zstd seekable streams, each part compressed on its own with its "
                        "bytes grouped where that helps float tensors (default: off; LEVEL 1..19, default "
                        f"{compression.DEFAULT_LEVEL}); any mount reads them")
    p.add_argument("--list-ttl", type=_seconds, metavar="SECONDS",
                   help="how old a directory listing may get before its next use asks the store again, so "
                        "files other mounts made durable show up; also how long a missing name is "
                        f"remembered (default {MountConfig.list_ttl:g}; 0: ask every time)")
    p.add_argument("--write-timeout", type=_seconds, metavar="SECONDS",
                   help="how long a write waits for cache space while nothing gets uploaded (the store is "
                        f"down) before it fails with ENOSPC (default {MountConfig.write_timeout:g})")
    p.add_argument("--read-timeout", type=_seconds, metavar="SECONDS",
                   help="how long a read of data not in the cache waits while the store fails or does not "
                        f"answer before it fails with EIO (default {MountConfig.read_timeout:g})")
    p.add_argument("--shm-dir", metavar="DIR",
                   help=f"the tmpfs that holds the RAM tier (default {MountConfig.shm_dir})")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (only as far as each file's mode allows); default: only you")
    p.add_argument("--umask", type=_umask, metavar="OCTAL",
                   help="for files and directories whose mode the store does not record: 0666/0777 less "
                        f"this, owned by the mounting user (default {MountConfig.umask:04o}: only you)")
    p.add_argument("--keep-ram-cache", action="store_true",
                   help="leave the RAM tier in the shm dir at a clean umount (default: removed; the disk tier is kept)")
    p.add_argument("--foreground", action="store_true", help="serve in this process, logging to stderr")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve Prometheus metrics on this TCP port (0: any free port; see 'ckptfs status')")
    p.add_argument("--metrics-addr", metavar="ADDR", help="address the metrics listen on (default 127.0.0.1)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)} (default {MountConfig.log_level}); only TRACE "
                        "adds the S3 libraries' lines, redacted: credentials, signatures and data never reach the log")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # set by `mount` for its detached daemon
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("sync", help="block until what was committed is durable in the store")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or directories to wait for (default: everything)")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds (exit 1)")
    p.add_argument("--json", action="store_true", help="print what became durable as JSON on stdout")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("warmup", help="prefetch files or directories (recursively) into the cache",
                       description="Fetch whatever is not cached yet of each PATH (a file or a directory, "
                                   "recursively) on a ckptfs mount, in parallel, so a later restore reads "
                                   "from the cache.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="a file or directory on a ckptfs mount")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds (exit 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("status", help="cache use, pending uploads, errors")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="print the daemon's status as JSON")
    p.add_argument("--watch", type=_interval, nargs="?", const=WATCH_INTERVAL_S, metavar="SECONDS",
                   help=f"refresh in place every SECONDS (default {WATCH_INTERVAL_S:g}) until Ctrl-C; "
                        "with --json: one JSON object per line")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("umount", help="drain uploads (with progress), then unmount")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--timeout", type=_seconds, metavar="S", default=UMOUNT_TIMEOUT_S,
                   help="give up draining after S seconds (exit 1, the mount stays; default "
                        f"{UMOUNT_TIMEOUT_S:g})")
    p.add_argument("--no-wait", action="store_true", help="unmount without draining; pending uploads resume at the next mount")
    p.set_defaults(func=cmd_umount)

    from ckptfs import catalog_cli, verify_cli  # ls, checkpoints, gc; verify
    catalog_cli.add_commands(sub)
    verify_cli.add_parser(sub)

    for p in sub.choices.values():
        p.intermixed = True  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CkptfsError as e:
        print(f"ckptfs: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except StoreError as e:
        print(f"ckptfs: {one_line(str(e))}", file=sys.stderr)
        return 1
    except BrokenPipeError as e:
        if not _stdout_gone():
            print(f"ckptfs: {one_line(e.strerror or str(e))}", file=sys.stderr)
            return 1
        # The reader of our output left (`ckptfs ls ... | head`): nothing to report, as for ls(1).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush must not fail too)
        return 141  # (128 + SIGPIPE, what a shell shows for a command the pipe ended)
    except OSError as e:  # a path the checks could not foresee (/proc, a full disk): one line, not a traceback
        where = f": {e.filename}" if e.filename is not None else ""
        print(f"ckptfs: {one_line(e.strerror or str(e))}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ckptfs: interrupted", file=sys.stderr)
        return 130


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


# --- mount ----------------------------------------------------------------------


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
    for name, value in (("MOUNTPOINT", args.mountpoint), ("--cache-dir", args.cache_dir), ("--shm-dir", args.shm_dir)):
        if value is not None and not value.strip():  # an unset shell variable: not "the current directory"
            raise UsageError(f"{name} is empty")
    if args.metrics_addr is not None and args.metrics_port is None:
        raise UsageError("--metrics-addr needs --metrics-port")
    mountpoint = os.path.realpath(args.mountpoint)
    options = {
        "ram_cache": args.ram_cache,
        "cache_size": args.cache_size,
        "part_size": args.part_size,
        "upload_concurrency": args.upload_concurrency,
        "compress": args.compress,
        "list_ttl": args.list_ttl,
        "write_timeout": args.write_timeout,
        "read_timeout": args.read_timeout,
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
        raise UsageError(str(e)) if e.errno == errno.EINVAL else e


def _serve(config: MountConfig, ready_fd: int | None) -> int:
    """Run the daemon in this process. With ``ready_fd``, tell the parent `mount` how start-up went."""
    if ready_fd is not None:
        os.set_inheritable(ready_fd, False)  # helpers such as fusermount3 must not hold the pipe open
    logs.setup(config.log_level, sys.stderr)
    from ckptfs import daemon

    ready = False

    def on_ready() -> None:
        nonlocal ready
        ready = True
        log.info("ckptfs: %s mounted on %s", config.store_url, config.mountpoint)
        if ready_fd is not None:
            _report(ready_fd, "ok")

    try:
        daemon.run(config, on_ready)
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
    argv = ["mount", config.store_url, config.mountpoint, "--cache-dir", config.cache_dir,
            "--ram-cache", str(config.ram_cache), "--cache-size", str(config.cache_size),
            "--part-size", str(config.part_size), "--upload-concurrency", str(config.upload_concurrency),
            "--list-ttl", repr(config.list_ttl), "--write-timeout", repr(config.write_timeout),
            "--read-timeout", repr(config.read_timeout),
            "--shm-dir", config.shm_dir,
            "--log-level", config.log_level, "--foreground"]
    argv += ["--umask", f"{config.umask:04o}"]
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
    private.ensure_dir(cache_dir, "cache dir")  # ours, 0700, before the log goes in it
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
            pass_fds=(w,), start_new_session=True, cwd="/", env=env,
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd)
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
        raise MountError(f"the daemon did not finish mounting within {READY_TIMEOUT_S:g} s (stopped it); see {log_path}")
    if line.startswith("error: "):
        raise MountError(line[len("error: "):])
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


# --- status, sync, umount -------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    mountpoint = _mountpoint(args.mountpoint)
    if args.watch is not None:
        return _watch_status(mountpoint, args.watch, args.json)
    status = _call(mountpoint, "status", timeout=30)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def _watch_status(mountpoint: str, interval: float, as_json: bool) -> int:
    """Status every ``interval`` seconds until Ctrl-C: redrawn in place on a terminal (like
    top), one block per refresh otherwise; JSON: one object per line."""
    redraw = sys.stdout.isatty() and not as_json
    try:
        while True:
            status = _call(mountpoint, "status", timeout=30)
            if as_json:
                text = json.dumps(status, sort_keys=True)
            else:
                stamp = time.strftime("%H:%M:%S")
                text = f"ckptfs status {mountpoint}  (every {interval:g} s, {stamp}; Ctrl-C to quit)\n\n"
                text += format_status(status) + ("" if redraw else "\n")
            print((CLEAR_SCREEN if redraw else "") + text, flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def cmd_sync(args: argparse.Namespace) -> int:
    mountpoint = _mountpoint(args.mountpoint)
    paths = _relative_paths(mountpoint, args.paths)
    bar = ProgressBar("sync")
    try:
        # The daemon enforces the timeout; ours only guards against a hung daemon.
        result = _call(mountpoint, "sync", {"paths": paths, "timeout": args.timeout}, on_progress=bar,
                       timeout=None if args.timeout is None else args.timeout + 30)
    finally:
        bar.close()
    if args.json:  # (older daemons answer only durable_up_to)
        print(json.dumps({k: result.get(k) for k in ("files", "bytes", "seconds", "durable_up_to")}, sort_keys=True))
        return 0
    if result.get("files") is not None:
        files = result["files"]
        done = f"{files} file{'' if files == 1 else 's'}, {_fmt(result.get('bytes'))} in {result.get('seconds', 0):.2f} s"
        print(f"ckptfs: durable ({done if files else 'nothing was pending'})", file=sys.stderr)
    else:
        print(f"ckptfs: durable ({bar.summary() or 'nothing was pending'})", file=sys.stderr)
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    by_mount: dict[str, list[str]] = {}
    for path in args.paths:
        mountpoint, candidate = _mount_of(path)
        by_mount.setdefault(mountpoint, []).append(candidate)
    total = {"files": 0, "total_bytes": 0, "fetched_bytes": 0, "seconds": 0.0}
    for mountpoint, candidates in by_mount.items():
        bar = ProgressBar("warmup")
        try:
            result = _call(mountpoint, "warmup", {"paths": _relative_paths(mountpoint, candidates), "timeout": args.timeout},
                           on_progress=bar, timeout=None if args.timeout is None else args.timeout + 30)
        finally:
            bar.close()
        for key in total:
            total[key] += result.get(key) or 0
    if args.json:
        print(json.dumps(total, sort_keys=True))
        return 0
    files, seconds, fetched = total["files"], total["seconds"], total["fetched_bytes"]
    rate = f"{_fmt(fetched / seconds)}/s" if fetched and seconds > 0 else "nothing to fetch"
    print(f"ckptfs: warmed {files} file{'' if files == 1 else 's'}, {_fmt(total['total_bytes'])} "
          f"({_fmt(fetched)} fetched) in {seconds:.2f} s, {rate}", file=sys.stderr)
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = _mountpoint(args.mountpoint)
    try:
        pid = control.call(mountpoint, "status", timeout=30).get("pid")
    except control.NoDaemon:
        if mountpoint not in ckptfs_mounts():
            raise
        _lazy_unmount(mountpoint)
        print(f"ckptfs: the daemon of {mountpoint} was gone; unmounted it lazily "
              "(pending uploads resume at the next mount with the same cache dir)", file=sys.stderr)
        return 0
    bar = ProgressBar("drain")
    try:
        # The daemon enforces the timeout; ours only guards against a hung daemon.
        result = control.call(mountpoint, "umount", {"wait": not args.no_wait, "timeout": args.timeout},
                              on_progress=bar, timeout=args.timeout + 30)
    finally:
        bar.close()
    _wait_gone(mountpoint, pid if isinstance(pid, int) else None, UNMOUNT_WAIT_S)
    if result.get("pending_files"):
        print(f"ckptfs: unmounted {mountpoint}; {result['pending_files']} pending uploads resume "
              "at the next mount with the same cache dir", file=sys.stderr)
    elif bar.summary():
        print(f"ckptfs: unmounted {mountpoint} ({bar.summary()})", file=sys.stderr)
    return 0


def _wait_gone(mountpoint: str, pid: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while mountpoint in ckptfs_mounts() or (pid is not None and _alive(pid)):
        if time.monotonic() > deadline:
            still = f"{mountpoint} is still mounted" if mountpoint in ckptfs_mounts() else f"the daemon (pid {pid}) is still running"
            raise CkptfsError(f"{still} after {timeout:g} s; see 'ckptfs status {mountpoint}' and the daemon log")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # an exited daemon nobody reaped yet (some container inits never do) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _lazy_unmount(mountpoint: str) -> None:
    commands = [["fusermount3", "-u", "-z", mountpoint]]
    if os.geteuid() == 0:
        commands.append(["umount", "-l", mountpoint])
    why = "fusermount3 not found"
    for command in commands:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
            continue
        if done.returncode == 0:
            return
        why = one_line(done.stderr) or f"{command[0]} exited with status {done.returncode}"
    raise CkptfsError(f"could not unmount {mountpoint}: {why}")


_STATUS_KEYS = {"mountpoint", "store", "cache_dir", "pid", "uptime_s", "part_size", "ram", "disk", "clean_bytes",
                "pending", "uploading", "uploaded_bytes", "stored_bytes", "durable_files", "errors", "upload_rate_bytes_per_s",
                "oldest_pending_s", "training_at_risk_s", "retries", "latest_checkpoint", "metrics_url",
                "written_bytes", "committed_bytes"}


def _seconds_ago(value: object) -> str | None:
    if not isinstance(value, (int, float)):
        return None
    return "0 s" if value <= 0 else humanfriendly.format_timespan(value, max_units=2)


def _uploading(parts: object, nbytes: object) -> str:
    return f"{parts} parts" + (f", {_fmt(nbytes)}" if nbytes is not None else "")


def format_status(s: dict) -> str:
    """A readable summary of the daemon's status dict; missing keys are skipped."""
    rows: list[tuple[str, str]] = []

    def get(*keys: str) -> object:
        value: object = s
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def used_of(key: str) -> str | None:
        used, budget = get(key, "used"), get(key, "budget")
        if used is None and budget is None:
            return None
        return f"{_fmt(used)} of {_fmt(budget)}"

    for label, value in [
        ("mountpoint", get("mountpoint")),
        ("store", get("store")),
        ("store state", describe_health(s["store_health"]) if isinstance(s.get("store_health"), dict) else None),
        ("cache dir", get("cache_dir")),
        ("daemon pid", get("pid")),
        ("uptime", humanfriendly.format_timespan(s["uptime_s"]) if isinstance(s.get("uptime_s"), (int, float)) else None),
        ("part size", _fmt(s["part_size"]) if "part_size" in s else None),
        ("RAM cache", used_of("ram")),
        ("disk cache", used_of("disk")),
        ("clean (cached)", _fmt(s["clean_bytes"]) if "clean_bytes" in s else None),
        ("pending upload", f"{get('pending', 'files')} files, {_fmt(get('pending', 'bytes'))}" if "pending" in s else None),
        ("uploading", _uploading(get("uploading", "parts_in_flight"), get("uploading", "bytes_in_flight")) if "uploading" in s else None),
        ("oldest pending", _seconds_ago(s.get("oldest_pending_s"))),
        ("training at risk", _seconds_ago(s.get("training_at_risk_s"))),
        ("upload rate", f"{_fmt(s['upload_rate_bytes_per_s'])}/s" if "upload_rate_bytes_per_s" in s else None),
        ("uploaded", _fmt(s["uploaded_bytes"]) if "uploaded_bytes" in s else None),
        ("stored (compressed)", _fmt(s["stored_bytes"]) if "stored_bytes" in s else None),
        ("written", _fmt(s["written_bytes"]) if "written_bytes" in s else None),
        ("committed", _fmt(s["committed_bytes"]) if "committed_bytes" in s else None),
        ("durable files", get("durable_files")),
        ("retries", ", ".join(f"{k} {v}" for k, v in s["retries"].items()) if isinstance(s.get("retries"), dict) else None),
        ("latest checkpoint", (s["latest_checkpoint"] + " (pinned in the cache)") if s.get("latest_checkpoint") else
         ("none seen" if "latest_checkpoint" in s else None)),
        ("metrics", get("metrics_url")),
    ]:
        if value is not None:
            rows.append((label, str(value)))

    for key, value in s.items():  # what newer daemons add, shown plainly
        if key not in _STATUS_KEYS and not isinstance(value, (dict, list)):
            rows.append((key.replace("_", " "), _fmt(value) if key.endswith("_bytes") else str(value)))

    errors = s.get("errors")
    if isinstance(errors, list):
        rows.append(("errors", str(len(errors)) if errors else "none"))
    width = max((len(label) for label, _ in rows), default=0)
    lines = [f"{label + ':':<{width + 1}} {value}" for label, value in rows]
    for e in (errors or [])[-10:] if isinstance(errors, list) else []:  # the last ones: key and reason
        e = e if isinstance(e, dict) else {"message": e}
        when = e.get("time")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else str(when or "")
        lines.append(f"  {when} {e.get('key', '')}: {one_line(str(e.get('message', '')))}".rstrip())
    integrity = s.get("integrity_errors")
    if isinstance(integrity, list) and integrity:  # reads failed (EIO): store bytes never matched their checksum
        lines.append(f"integrity errors: {len(integrity)} (reads failed: bytes from the store do not match their checksum)")
        for e in integrity[-10:]:
            e = e if isinstance(e, dict) else {"message": e}
            when = e.get("time")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else ""
            lines.append(f"  {when} {e.get('key', '')}: {one_line(str(e.get('message', '')))}".rstrip())
    return "\n".join(lines)
