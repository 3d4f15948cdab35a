"""What checkpoints whole across nodes cost one mount (issue 29): the writer record a close may
wait for, and the listings a marker costs. Swift on 127.0.0.1, one ckptfs mount on S3.

    python -m bench.records_cost [--dirs N]

Prints the median close of a one-byte file that is the first in its directory (its close waits
for the record the create started) beside one in a directory whose record is in the store, and
for one save of a step (8 shards of 1 MiB, a shard index, a ``latest`` pointer): the records
written and deleted and the listings its markers cost, from ``ckptfs status``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _close_ms(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(b"x")
    return (time.perf_counter() - started) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.records_cost", description=__doc__.splitlines()[0])
    p.add_argument("--dirs", type=int, default=50, help="new directories (and files in one) to time")
    opts = p.parse_args(argv)
    from tests.support.mounting import Mount
    from tests.support.swift import SwiftServer

    with tempfile.TemporaryDirectory(prefix="ckptfs-bench-rec-") as tmp:
        work = Path(tmp)
        server = SwiftServer(work / "swift").start()
        try:
            os.environ.update(server.env())
            server.make_bucket("records")
            m = Mount("s3://records/run", work / "m", endpoint_url=server.endpoint)
            m.start()
            try:
                first = [_close_ms(_mkdir(m.path / f"d{i}") / "f") for i in range(opts.dirs)]
                (m.path / "same").mkdir()
                _close_ms(m.path / "same" / "warm")
                same = [_close_ms(m.path / "same" / f"f{i}") for i in range(opts.dirs)]
                m.sync()
                time.sleep(1.5)  # (the records of idle directories go)
                before = m.status()["writer_records"]
                step = m.path / "step_1"
                step.mkdir()
                names = [f"model-{i + 1:05d}-of-00008.safetensors" for i in range(8)]
                for name in names:
                    (step / name).write_bytes(os.urandom(MiB))
                index = {"weight_map": {f"w{i}": n for i, n in enumerate(names)}}
                (step / "model.safetensors.index.json").write_text(json.dumps(index))
                (m.path / "latest").write_text("step_1\n")
                m.sync()
                time.sleep(1.5)
                after = m.status()["writer_records"]
            finally:
                m.cleanup()
        finally:
            server.stop()
    print(f"close of a 1-byte file, median of {opts.dirs} (Swift on 127.0.0.1):")
    print(f"  first in a new directory (waits for its record): {statistics.median(first):6.2f} ms")
    print(f"  in a directory already recorded:                 {statistics.median(same):6.2f} ms")
    print("one step saved (8 shards, an index, latest):")
    for key, what in (
        ("written", "records put"),
        ("deleted", "records deleted"),
        ("marker_listings", "listings"),
    ):
        print(f"  {what:16} {after[key] - before[key]}")
    return 0


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


if __name__ == "__main__":
    sys.exit(main())
