"""The ``ckptfs`` command: the parser and the dispatcher. Each command group lives in its own
module of this package and registers its subcommands here: mount.py (mount), control.py (sync,
warmup, status, umount: a running mount's daemon), catalog.py (ls, checkpoints, gc), verify.py
(verify); common.py holds what they share.

Errors meant for the user are ``CkptfsError`` or ``StoreError``: printed as one line
``ckptfs: <message>``; exit 2 for bad usage, 1 for anything else.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence

from ckptfs.cli import catalog, control
from ckptfs.cli import mount as cli_mount
from ckptfs.cli import verify as cli_verify
from ckptfs.errors import CkptfsError, StoreError, UsageError, one_line


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) and, in subcommands, accepts
    options between positionals (``mount s3://b --part-size 16M /mnt``)."""

    intermixed = False

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed:
            return super().parse_known_args(args, namespace)
        self.intermixed = False  # parse_known_intermixed_args calls back into parse_known_args
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self.intermixed = True


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ckptfs", description="A FUSE filesystem for AI training checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_mount.add_parser(sub)  # mount
    control.add_commands(sub)  # sync, warmup, status, umount
    catalog.add_commands(sub)  # ls, checkpoints, gc
    cli_verify.add_parser(sub)  # verify
    for p in sub.choices.values():
        p.intermixed = True
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
    except (
        OSError
    ) as e:  # a path the checks could not foresee (/proc, a full disk): one line, not a traceback
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
