"""CPU cost of the namespace's own work per operation, in-process (no FUSE), over a local store.

    .venv/bin/python -m bench.namespace_ops [--files 1500] [--lookups 30000] [--rounds 3]

Builds the parts with ``core.build_core`` (as the daemon does), then times, in CPU seconds of
the trio thread (``time.thread_time``: the neighbours' load on a shared machine counts less):
creating, writing 4 KiB into, and closing ``files`` files (each commit also runs the uploader's
steps on this thread), and ``lookups`` rounds of lookup + getattr + forget. Prints the best
round of each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import trio

from ckptfs.config import MountConfig
from ckptfs.daemon.wiring import build_core
from ckptfs.model.tree import ROOT_INODE
from ckptfs.store.local import LocalStore

BS = 64 << 10


async def one_round(tmp: Path, files: int, lookups: int) -> tuple[float, float]:
    store = LocalStore.at(tmp / "store")
    store.check()
    config = MountConfig(
        mountpoint=str(tmp / "mnt"),
        store_url=f"file://{tmp / 'store'}",
        cache_dir=str(tmp / "cache"),
        part_size=BS,
        ram_cache=16 * BS,
        cache_size=64 * BS,
        upload_concurrency=4,
        list_ttl=None,
    )
    core = build_core(config, store, tmp / "cache", tmp / "ram", check_ram_room=False)
    try:
        async with trio.open_nursery() as nursery:
            await core.start(nursery)
            core.load([])
            ns, data = core.namespace, b"x" * 4096
            started = time.thread_time()
            for i in range(files):
                handle, _ = ns.create(
                    ROOT_INODE, f"f{i}", 0o644, os.O_WRONLY | os.O_CREAT, os.getuid(), os.getgid()
                )
                await ns.write(handle.fh, 0, data)
                ns.flush(handle.fh)
                ns.release(handle.fh)
            committed = time.thread_time()
            for i in range(lookups):
                attr = ns.lookup(ROOT_INODE, f"f{i % files}")
                ns.getattr(attr.ino)
                ns.forget(attr.ino, 1)
            looked = time.thread_time()
            await core.uploader.wait_durable(core.uploader.last_seq())
            nursery.cancel_scope.cancel()
    finally:
        core.close()
    return (committed - started) / files, (looked - committed) / lookups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--lookups", type=int, default=30000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(trio.run(one_round, Path(tmp), args.files, args.lookups))
    commit, lookup = min(r[0] for r in results), min(r[1] for r in results)
    print(
        f"commit of a 4 KiB file: {commit * 1e6:.0f} us CPU; lookup + getattr + forget: {lookup * 1e6:.2f} us CPU"
    )


if __name__ == "__main__":
    main()
