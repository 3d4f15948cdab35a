"""`ckptfs sync`, `warmup`, `status` and `umount`: the commands that ask a running mount's daemon
(over its control socket), and the status report they print."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import humanfriendly

from ckptfs.cli.common import (
    ProgressBar,
    call_mount,
    canonical_mountpoint,
    format_bytes,
    mount_holding,
    not_a_mount,
    parse_seconds_arg,
    relative_paths,
)
from ckptfs.config import ckptfs_mounts
from ckptfs.control import client
from ckptfs.daemon.mount_paths import lazy_unmount
from ckptfs.errors import CkptfsError, one_line
from ckptfs.store.health import describe as describe_health

UNMOUNT_WAIT_S = 60.0  # how long `umount` waits for the mount and the daemon to go
UMOUNT_TIMEOUT_S = 300.0  # how long `umount` waits for uploads to drain (--timeout)
WATCH_INTERVAL_S = 2.0  # status --watch
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, clear: what top and watch(1) do


def _interval(text: str) -> float:
    value = parse_seconds_arg(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r}: refresh at most ten times a second (0.1 or more)")
    return value


def add_commands(sub) -> None:
    p = sub.add_parser("sync", help="block until what was committed is durable in the store")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="files or directories to wait for (default: everything)"
    )
    p.add_argument("--timeout", type=parse_seconds_arg, metavar="S", help="give up after S seconds (exit 1)")
    p.add_argument("--json", action="store_true", help="print what became durable as JSON on stdout")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser(
        "warmup",
        help="prefetch files or directories (recursively) into the cache",
        description="Fetch whatever is not cached yet of each PATH (a file or a directory, "
        "recursively) on a ckptfs mount, in parallel, so a later restore reads "
        "from the cache.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="a file or directory on a ckptfs mount")
    p.add_argument("--timeout", type=parse_seconds_arg, metavar="S", help="give up after S seconds (exit 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("status", help="cache use, pending uploads, errors")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="print the daemon's status as JSON")
    p.add_argument(
        "--watch",
        type=_interval,
        nargs="?",
        const=WATCH_INTERVAL_S,
        metavar="SECONDS",
        help=f"refresh in place every SECONDS (default {WATCH_INTERVAL_S:g}) until Ctrl-C; "
        "with --json: one JSON object per line",
    )
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("umount", help="drain uploads (with progress), then unmount")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--timeout",
        type=parse_seconds_arg,
        metavar="S",
        default=UMOUNT_TIMEOUT_S,
        help=f"give up draining after S seconds (exit 1, the mount stays; default {UMOUNT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="unmount without draining; pending uploads resume at the next mount",
    )
    p.set_defaults(func=cmd_umount)


def cmd_status(args: argparse.Namespace) -> int:
    mountpoint = canonical_mountpoint(args.mountpoint)
    if args.watch is not None:
        return _watch_status(mountpoint, args.watch, args.json)
    status = call_mount(mountpoint, "status", timeout=30)
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
            status = call_mount(mountpoint, "status", timeout=30)
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
    mountpoint = canonical_mountpoint(args.mountpoint)
    paths = relative_paths(mountpoint, args.paths)
    bar = ProgressBar("sync")
    try:
        # The daemon enforces the timeout; ours only guards against a hung daemon.
        result = call_mount(
            mountpoint,
            "sync",
            {"paths": paths, "timeout": args.timeout},
            on_progress=bar,
            timeout=None if args.timeout is None else args.timeout + 30,
        )
    finally:
        bar.close()
    if args.json:  # (older daemons answer only durable_up_to)
        print(
            json.dumps(
                {k: result.get(k) for k in ("files", "bytes", "seconds", "durable_up_to")}, sort_keys=True
            )
        )
        return 0
    if result.get("files") is not None:
        files = result["files"]
        plural = "" if files == 1 else "s"
        done = (
            f"{files} file{plural}, {format_bytes(result.get('bytes'))} in {result.get('seconds', 0):.2f} s"
        )
        print(f"ckptfs: durable ({done if files else 'nothing was pending'})", file=sys.stderr)
    else:
        print(f"ckptfs: durable ({bar.summary() or 'nothing was pending'})", file=sys.stderr)
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    by_mount: dict[str, list[str]] = {}
    for path in args.paths:
        mountpoint, candidate = mount_holding(path)
        by_mount.setdefault(mountpoint, []).append(candidate)
    total = {"files": 0, "total_bytes": 0, "fetched_bytes": 0, "seconds": 0.0}
    for mountpoint, candidates in by_mount.items():
        bar = ProgressBar("warmup")
        try:
            result = call_mount(
                mountpoint,
                "warmup",
                {"paths": relative_paths(mountpoint, candidates), "timeout": args.timeout},
                on_progress=bar,
                timeout=None if args.timeout is None else args.timeout + 30,
            )
        finally:
            bar.close()
        for key in total:
            total[key] += result.get(key) or 0
    if args.json:
        print(json.dumps(total, sort_keys=True))
        return 0
    files, seconds, fetched = total["files"], total["seconds"], total["fetched_bytes"]
    rate = f"{format_bytes(fetched / seconds)}/s" if fetched and seconds > 0 else "nothing to fetch"
    print(
        f"ckptfs: warmed {files} file{'' if files == 1 else 's'}, {format_bytes(total['total_bytes'])} "
        f"({format_bytes(fetched)} fetched) in {seconds:.2f} s, {rate}",
        file=sys.stderr,
    )
    return 0


def _daemon_pid(mountpoint: str):
    """The pid its daemon reports. A daemon that drops the connection unanswered may be dying
    (killed, its threads still closing its files): asked once more, it is gone (NoDaemon)."""
    try:
        return client.call(mountpoint, "status", timeout=30).get("pid")
    except client.Dropped:
        time.sleep(1.0)
        return client.call(mountpoint, "status", timeout=30).get("pid")


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = canonical_mountpoint(args.mountpoint)
    try:
        pid = _daemon_pid(mountpoint)
    except client.NoDaemon as e:
        if mountpoint not in ckptfs_mounts():
            raise not_a_mount(e) from None
        lazy_unmount(mountpoint)
        print(
            f"ckptfs: the daemon of {mountpoint} was gone; unmounted it lazily "
            "(pending uploads resume at the next mount with the same cache dir)",
            file=sys.stderr,
        )
        return 0
    bar = ProgressBar("drain")
    try:
        # The daemon enforces the timeout; ours only guards against a hung daemon.
        result = client.call(
            mountpoint,
            "umount",
            {"wait": not args.no_wait, "timeout": args.timeout},
            on_progress=bar,
            timeout=args.timeout + 30,
        )
    finally:
        bar.close()
    _wait_gone(mountpoint, pid if isinstance(pid, int) else None, UNMOUNT_WAIT_S)
    if result.get("pending_files"):
        print(
            f"ckptfs: unmounted {mountpoint}; {result['pending_files']} pending uploads resume "
            "at the next mount with the same cache dir",
            file=sys.stderr,
        )
    elif bar.summary():
        print(f"ckptfs: unmounted {mountpoint} ({bar.summary()})", file=sys.stderr)
    return 0


def _wait_gone(mountpoint: str, pid: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while mountpoint in ckptfs_mounts() or (pid is not None and _alive(pid)):
        if time.monotonic() > deadline:
            still = (
                f"{mountpoint} is still mounted"
                if mountpoint in ckptfs_mounts()
                else f"the daemon (pid {pid}) is still running"
            )
            raise CkptfsError(
                f"{still} after {timeout:g} s; see 'ckptfs status {mountpoint}' and the daemon log"
            )
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


_STATUS_KEYS = {
    "mountpoint",
    "store",
    "cache_dir",
    "pid",
    "uptime_s",
    "part_size",
    "ram",
    "disk",
    "clean_bytes",
    "pending",
    "uploading",
    "uploaded_bytes",
    "stored_bytes",
    "durable_files",
    "errors",
    "upload_rate_bytes_per_s",
    "oldest_pending_s",
    "training_at_risk_s",
    "retries",
    "latest_checkpoint",
    "metrics_url",
    "written_bytes",
    "committed_bytes",
}


def _passthrough(figures) -> str | None:
    """on: the kernel reads complete cached files itself (how many, since the mount); off: why."""
    if not isinstance(figures, dict):
        return None
    if not figures.get("on"):
        return f"off ({figures.get('off_because', 'unknown')})"
    writes = f"writes: {figures.get('working_files', 0)} files" if figures.get("writes") else "writes off"
    return (
        f"on: {figures.get('opens', 0)} opens, {figures.get('files', 0)} read copies "
        f"({format_bytes(figures.get('bytes', 0))} of {format_bytes(figures.get('budget', 0))}); {writes}"
    )


def _seconds_ago(value: object) -> str | None:
    if not isinstance(value, (int, float)):
        return None
    return "0 s" if value <= 0 else humanfriendly.format_timespan(value, max_units=2)


def _plain(value: object) -> str:
    """A value in words: yes/no for a boolean, none for a null (not Python's True/False/None)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "none" if value is None else str(value)


def _uploading(parts: object, nbytes: object) -> str:
    return f"{parts} parts" + (f", {format_bytes(nbytes)}" if nbytes is not None else "")


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
        return f"{format_bytes(used)} of {format_bytes(budget)}"

    for label, value in [
        ("mountpoint", get("mountpoint")),
        ("store", get("store")),
        (
            "store state",
            describe_health(s["store_health"]) if isinstance(s.get("store_health"), dict) else None,
        ),
        ("cache dir", get("cache_dir")),
        ("daemon pid", get("pid")),
        (
            "uptime",
            humanfriendly.format_timespan(s["uptime_s"])
            if isinstance(s.get("uptime_s"), (int, float))
            else None,
        ),
        ("part size", format_bytes(s["part_size"]) if "part_size" in s else None),
        ("RAM cache", used_of("ram")),
        ("disk cache", used_of("disk")),
        ("clean (cached)", format_bytes(s["clean_bytes"]) if "clean_bytes" in s else None),
        (
            "pending upload",
            f"{get('pending', 'files')} files, {format_bytes(get('pending', 'bytes'))}"
            if "pending" in s
            else None,
        ),
        (
            "uploading",
            _uploading(get("uploading", "parts_in_flight"), get("uploading", "bytes_in_flight"))
            if "uploading" in s
            else None,
        ),
        ("oldest pending", _seconds_ago(s.get("oldest_pending_s"))),
        ("training at risk", _seconds_ago(s.get("training_at_risk_s"))),
        (
            "upload rate",
            f"{format_bytes(s['upload_rate_bytes_per_s'])}/s" if "upload_rate_bytes_per_s" in s else None,
        ),
        ("uploaded", format_bytes(s["uploaded_bytes"]) if "uploaded_bytes" in s else None),
        ("stored (compressed)", format_bytes(s["stored_bytes"]) if "stored_bytes" in s else None),
        ("written", format_bytes(s["written_bytes"]) if "written_bytes" in s else None),
        ("committed", format_bytes(s["committed_bytes"]) if "committed_bytes" in s else None),
        ("durable files", get("durable_files")),
        ("passthrough reads", _passthrough(s.get("passthrough"))),
        (
            "retries",
            ", ".join(f"{k} {v}" for k, v in s["retries"].items())
            if isinstance(s.get("retries"), dict)
            else None,
        ),
        (
            "latest checkpoint",
            (s["latest_checkpoint"] + " (pinned in the cache)")
            if s.get("latest_checkpoint")
            else ("none seen" if "latest_checkpoint" in s else None),
        ),
        ("metrics", get("metrics_url")),
    ]:
        if value is not None:
            rows.append((label, str(value)))

    for key, value in s.items():  # what newer daemons add, shown plainly
        if key not in _STATUS_KEYS and not isinstance(value, (dict, list)):
            rows.append(
                (key.replace("_", " "), format_bytes(value) if key.endswith("_bytes") else _plain(value))
            )

    errors = s.get("errors")
    if isinstance(errors, list):
        rows.append(("errors", str(len(errors)) if errors else "none"))
    width = max((len(label) for label, _ in rows), default=0)
    lines = [f"{label + ':':<{width + 1}} {value}" for label, value in rows]
    for e in (errors or [])[-10:] if isinstance(errors, list) else []:  # the last ones: key and reason
        e = e if isinstance(e, dict) else {"message": e}
        when = e.get("time")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
            if isinstance(when, (int, float))
            else str(when or "")
        )
        lines.append(f"  {when} {e.get('key', '')}: {one_line(str(e.get('message', '')))}".rstrip())
    waiting = s.get("markers_waiting")
    if isinstance(waiting, list) and waiting:  # held until their checkpoint is whole in the store
        lines.append(f"markers waiting: {len(waiting)}")
        for w in waiting[:10]:
            if isinstance(w, dict):
                since = w.get("since")
                age = _seconds_ago(time.time() - since) if isinstance(since, (int, float)) else None
                lines.append(f"  {w.get('marker', '')}: waits for {w.get('waits_for', '')}; since {age}")
    dropped = s.get("markers_dropped")
    if isinstance(dropped, list) and dropped:
        lines.append(f"markers dropped: {len(dropped)}")
        for d in dropped[-5:]:
            if isinstance(d, dict):
                lines.append(f"  {d.get('marker', '')}: {d.get('reason', '')}")
    records = s.get("writer_records")
    unrecorded = records.get("unrecorded_dirs") if isinstance(records, dict) else None
    if isinstance(unrecorded, list) and unrecorded:  # (a node cut off from the store: cluster/records.py)
        lines.append(
            f"warning: files closed in {len(unrecorded)} directories without this node's writer record "
            "in the store: another node's pointer to them may reach the store before they do"
        )
        lines.extend(f"  {d}" for d in unrecorded[:10])
    peers = s.get("peers")
    if isinstance(peers, dict):  # --cluster
        live = [p for p in peers.get("live", []) if isinstance(p, dict)]
        lines.append(
            f"cluster: node {peers.get('node', '?')} on {peers.get('addr', '?')}, {len(live)} live peers; "
            f"taken from peers {format_bytes(peers.get('taken_bytes', 0))}, served to peers "
            f"{format_bytes(peers.get('served_bytes', 0))}, read from the store "
            f"{format_bytes(peers.get('store_bytes', 0))}"
        )
        for p in live[:20]:
            lines.append(f"  peer {p.get('node', '')} at {p.get('addr', '')}")
        if peers.get("replicas"):  # --replicas
            holders = ", ".join(peers.get("holders") or []) or "none"
            lines.append(
                f"  replicas: {peers['replicas']} wanted, held by {holders}; "
                f"replicated {format_bytes(peers.get('replicated_bytes', 0))}"
            )
        if peers.get("held_for") or peers.get("takeovers"):
            lines.append(
                f"  holding replicas of {len(peers.get('held_for') or [])} node(s): "
                f"{format_bytes(peers.get('replica_held_bytes', 0))}"
            )
        for label, key in (
            ("commits that returned without their replicas", "local_commits"),
            ("lost nodes taken over (their files published here)", "takeovers"),
            ("asks failed (read from the store)", "asks_failed"),
            ("parts that did not match (read from the store)", "mismatches"),
            ("connections refused (no member's certificate)", "refused_clients"),
        ):
            if peers.get(key):
                lines.append(f"  {label}: {peers[key]}")
    integrity = s.get("integrity_errors")
    if (
        isinstance(integrity, list) and integrity
    ):  # reads failed (EIO): store bytes never matched their checksum
        lines.append(
            f"integrity errors: {len(integrity)} (reads failed: bytes from the store do not match their checksum)"
        )
        for e in integrity[-10:]:
            e = e if isinstance(e, dict) else {"message": e}
            when = e.get("time")
            when = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
                if isinstance(when, (int, float))
                else ""
            )
            lines.append(f"  {when} {e.get('key', '')}: {one_line(str(e.get('message', '')))}".rstrip())
    return "\n".join(lines)
