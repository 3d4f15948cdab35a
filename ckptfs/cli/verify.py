"""The ``ckptfs verify`` command: its arguments, where it runs (the store itself for a URL, the
mount's daemon for a mountpoint) and its report. The check itself is ckptfs/admin/verify.py."""

from __future__ import annotations

import argparse
import json
import sys

from ckptfs.admin import target
from ckptfs.cli.common import (
    ENDPOINT_HELP,
    TARGET_HELP,
    ProgressBar,
    call_mount,
    format_bytes,
    parse_positive_int,
)
from ckptfs.config import VERIFY_JOBS as JOBS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-read objects and check them against the checksums recorded at upload",
        description="Read back every object at or under each PATH (default: all) from the store "
        "and check it against the checksums ckptfs recorded when it uploaded it. "
        "Exit 1 on any mismatch, missing object or missing manifest (and, with "
        "--strict, on objects with no checksum recorded).",
    )
    p.add_argument("target", metavar="STORE_URL|MOUNTPOINT", help=TARGET_HELP)
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or directories, relative to the target as for ls (or absolute paths inside the mount); "
        "default: all",
    )
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)
    p.add_argument(
        "--jobs", type=_jobs, default=JOBS, metavar="N", help=f"parts read at once (default {JOBS})"
    )
    p.add_argument(
        "--strict", action="store_true", help="objects with no checksum recorded count as failures"
    )
    p.add_argument("--json", action="store_true", help="print every object's result as JSON on stdout")
    p.set_defaults(func=cmd_verify)


def _jobs(text: str) -> int:
    n = parse_positive_int(text)
    if n > 256:
        raise argparse.ArgumentTypeError(f"at most 256, not {n}")
    return n


def cmd_verify(args: argparse.Namespace) -> int:
    where = target.resolve(args.target, args.endpoint_url)
    bar = ProgressBar("verify")
    try:
        # PATHs as for ls: relative to the target (or, on a mount, absolute paths inside it)
        paths = [target.sub_path(where, p) for p in args.paths or [None]]
        paths = [] if "" in paths else paths  # (all of it)
        if where.mountpoint is not None:  # (a mount)
            result = call_mount(
                where.mountpoint, "verify", {"paths": paths, "jobs": args.jobs}, on_progress=bar
            )
        else:
            result = _verify_url(where, paths, args, bar)
    finally:
        bar.close()
    return report(result, args.json, args.strict)


def _verify_url(where, paths: list[str], args: argparse.Namespace, bar) -> dict:
    import trio  # (imported here, as below: the other commands start without them)

    from ckptfs.admin.verify import run
    from ckptfs.objects.logical_store import LogicalStore

    # (sizes as a mount shows them: a compressed object's is its uncompressed size)
    store = LogicalStore(where.open_store(max_connections=args.jobs + 4))
    try:
        store.check()

        async def progress(update: dict) -> None:
            bar(update)

        return trio.run(run, store, paths, progress, args.jobs)
    finally:
        store.close()


def report(result: dict, as_json: bool, strict: bool) -> int:
    from ckptfs.admin.verify import failed

    files = result["files"]
    bad = failed(files, strict)
    counts: dict[str, int] = {}
    for r in files:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    if as_json:
        print(json.dumps({**result, "counts": counts, "ok": not bad}, indent=2, sort_keys=True))
    else:
        for r in files:
            if r["state"] != "ok":
                print(f"{r['state'].upper():17s} {r['key']}: {r['detail']}")
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no objects"
    print(
        f"ckptfs: verified {len(files)} object{'s' if len(files) != 1 else ''} ({format_bytes(result['total_bytes'])}) "
        f"in {result['store']} in {result['seconds']:.1f} s: {summary}",
        file=sys.stderr,
    )
    return 1 if bad else 0
