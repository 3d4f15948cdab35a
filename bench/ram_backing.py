"""What backing RAM slots with fallocate (cache.Tier.back) costs the write path.

    .venv/bin/python -m bench.ram_backing [--slots 64] [--rounds 5] [--dir /dev/shm]

Writes ``slots`` blocks of 8 MiB into a fresh RAM arena (first use: every page is new), then
again into the same slots, several times (reuse, the normal case: a save takes the slots the last one freed),
with the fallocate step and without it (the old way: pages appear at the writer's first touch,
a SIGBUS when tmpfs is full). Prints the median seconds of each over ``rounds`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ckptfs.cache import cache
from ckptfs.config import MiB

BLOCK = 8 * MiB
REUSE_PASSES = 5  # the fastest counts: on a loaded machine the others measure the neighbours


def one_round(where: Path, slots: int, backed: bool) -> tuple[float, float, float]:
    """(first use, fastest reuse, allocations alone on reuse) in seconds."""
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        c = cache.Cache(Path(tmp) / "disk", Path(tmp) / "ram", BLOCK, slots * BLOCK, BLOCK)
        ram = c.tiers[cache.RAM]
        if not backed:
            ram.back = lambda slot: ram.touched.add(slot) or True  # type: ignore[method-assign]
        data = memoryview(bytearray(b"\x01" * BLOCK))
        times = []
        for _ in range(REUSE_PASSES + 1):
            started = time.perf_counter()
            refs = []
            for _ in range(slots):
                ref = c.try_alloc()
                c.write(ref, 0, data)
                refs.append(ref)
            times.append(time.perf_counter() - started)
            for ref in refs:
                c.decref(ref)
        started = time.perf_counter()
        refs = [c.try_alloc() for _ in range(slots)]
        times.append(time.perf_counter() - started)
        for ref in refs:
            c.decref(ref)
        c.close()
        return times[0], min(times[1:-1]), times[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):  # alternate, so load on the machine hits both alike
        for backed in (True, False):
            results[backed].append(one_round(Path(args.dir), args.slots, backed))
    size = args.slots * BLOCK / (1 << 30)
    print(f"{args.slots} slots of 8 MiB ({size:g} GiB), median of {args.rounds} rounds")
    for backed in (True, False):
        first, reuse, alloc = (statistics.median(r[i] for r in results[backed]) for i in range(3))
        name = "fallocate first" if backed else "no fallocate (old)"
        print(
            f"{name:20} first use {first:.3f} s ({size / first:.2f} GiB/s)   reuse {reuse:.3f} s "
            f"({size / reuse:.2f} GiB/s)   {args.slots} allocations on reuse {alloc * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()
