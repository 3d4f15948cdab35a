"""`ckptfs ls`, `ckptfs checkpoints` and `ckptfs gc`: argument parsing and printing (the work is
in ckptfs/admin/catalog.py). ``add_commands`` registers them on the ``ckptfs`` parser."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Set as AbstractSet

import humanfriendly

from ckptfs.admin.target import resolve
from ckptfs.cli.common import ENDPOINT_HELP, TARGET_HELP
from ckptfs.errors import CkptfsError


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (0 or more)")
    return value


def _every(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive step interval")
    return value


def add_commands(sub) -> None:
    p = sub.add_parser(
        "ls",
        help="list files with size, time, state and checksum",
        description="List the files at or under PATH in a store or on a ckptfs mount, "
        "recursively: size, modification time, state (pending or durable on a "
        "mount; everything in a store is durable) and the checksum recorded at "
        "upload (or 'unverified' where none was).",
    )
    p.add_argument("target", metavar="STORE_URL|MOUNTPOINT", help=TARGET_HELP)
    p.add_argument(
        "path", nargs="?", metavar="PATH", help="relative to the target (or an absolute path on the mount)"
    )
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)
    p.add_argument(
        "--no-checksums", action="store_true", help="skip the checksum column (no HEAD per object)"
    )
    p.add_argument("--json", action="store_true", help="print the files as JSON")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "checkpoints",
        help="the checkpoint series: steps, completeness, the one to restart from",
        description="Find the checkpoint series (step-N, checkpoint-N, iter_NNNNNNN, global_stepN, "
        "epoch=E-step=S.ckpt, torch.distributed.checkpoint directories) and say for each "
        "step its size, file count and whether it is complete; and which step a restart "
        "should use (the newest complete one). See docs/admin.md.",
    )
    p.add_argument("target", metavar="STORE_URL|MOUNTPOINT", help=TARGET_HELP)
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)
    p.add_argument("--json", action="store_true", help="print the series as JSON")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser(
        "gc",
        help="delete old checkpoint steps, keeping the newest N and every K-th",
        description="Retention of each checkpoint series: keeps the newest N steps and every step "
        "whose number is a multiple of K; never deletes a step still pending upload, a "
        "step a pointer file names, or the newest complete step. Prints what it deletes "
        "and the bytes freed. On a mount, deletes through the filesystem.",
    )
    p.add_argument("target", metavar="STORE_URL|MOUNTPOINT", help=TARGET_HELP)
    p.add_argument(
        "--keep-last", type=_count, required=True, metavar="N", help="keep the newest N steps of each series"
    )
    p.add_argument(
        "--keep-every", type=_every, metavar="K", help="also keep every step whose number is a multiple of K"
    )
    p.add_argument(
        "--pattern",
        metavar="GLOB",
        help="only steps matching GLOB (their name; their path from the target when GLOB has a /)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.add_argument("--endpoint-url", metavar="URL", help=ENDPOINT_HELP)
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_gc)


def _fmt(n: int) -> str:
    return humanfriendly.format_size(n, binary=True)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _table(rows: list[list[str]], right: AbstractSet[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    from ckptfs.admin import catalog  # (imported here: the other commands start without it)

    target = resolve(args.target, args.endpoint_url)
    files = catalog.ls(target, args.path, checksums=not args.no_checksums)
    if args.json:
        print(json.dumps({"root": target.location(""), "files": [f.to_json() for f in files]}, indent=2))
        return 0
    if files:
        header = ["STATE", "SIZE", "MODIFIED", *([] if args.no_checksums else ["CHECKSUM"]), "PATH"]
        rows = [
            [f.state, _fmt(f.size), _when(f.mtime), *([] if args.no_checksums else [f.checksum]), f.path]
            for f in files
        ]
        print("\n".join(_table([header, *rows], right={1})))
    pending = sum(1 for f in files if f.state != "durable")
    print(
        f"{len(files)} file{'s' if len(files) != 1 else ''}, {_fmt(sum(f.size for f in files))}"
        + (f" ({pending} not yet durable)" if pending else "")
    )
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from ckptfs.admin import catalog  # (imported here: the other commands start without it)

    target = resolve(args.target, args.endpoint_url)
    found = catalog.catalog(target)
    if args.json:
        print(json.dumps(found.to_json(), indent=2))
        return 0
    if not found.series:
        print(f"no checkpoints found under {found.root}")
        return 0
    for series in found.series:
        pointers = "; ".join(
            f"{p.path} -> {p.names or repr(p.text) + ' (no such step)'}" for p in series.pointers
        )
        print(
            f"series {series.directory or '.'} ({series.layout})"
            + (f", pointer {pointers}" if pointers else "")
        )
        rows = [["", "STEP", "PATH", "FILES", "SIZE", "SAVED", "STATE", "COMPLETE"]]
        for s in series.steps:
            rows.append(
                [
                    "*" if s.restart else "",
                    "-" if s.number is None else str(s.number),
                    s.path,
                    str(s.files),
                    _fmt(s.size),
                    _when(s.mtime),
                    s.state,
                    "yes" if s.complete else "no: " + "; ".join(s.reasons),
                ]
            )
        print("\n".join("  " + line for line in _table(rows, right={1, 3, 4})))
    restart = found.restart
    print(f"restart from: {restart.location}" if restart else "restart from: none (no complete step)")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from ckptfs.admin import catalog  # (imported here: the other commands start without it)

    target = resolve(args.target, args.endpoint_url)
    verb = "would delete" if args.dry_run else "deleted"
    result = catalog.gc(target, args.keep_last, args.keep_every, args.pattern, args.dry_run)
    if args.json:
        print(json.dumps(result.to_json(target, args.dry_run), indent=2))
    else:
        rows = [["ACTION", "STEP", "PATH", "FILES", "SIZE", "WHY"]]
        for d in result.decisions:
            rows.append(
                [
                    verb if d.delete else "keep",
                    "-" if d.step.number is None else str(d.step.number),
                    d.step.path,
                    str(d.step.files),
                    _fmt(d.step.size),
                    d.why,
                ]
            )
        if len(rows) > 1:
            print("\n".join(_table(rows, right={1, 3, 4})))
        steps = result.deleted_steps
        print(
            f"{'would free' if args.dry_run else 'freed'} {_fmt(result.freed_bytes)} ({steps} "
            f"step{'s' if steps != 1 else ''}, {result.deleted_files} files)"
            + ("" if args.dry_run else f" in {result.seconds:.2f} s")
        )
    if result.failures:
        for failure in result.failures[:10]:
            print(f"ckptfs: could not delete {failure}", file=sys.stderr)
        raise CkptfsError(f"gc: {len(result.failures)} deletions failed (first: {result.failures[0]})")
    return 0
