"""Save stall and time to durable of ckptfs against baselines measured in the same run.

    scripts/bench [--size MiB] [--runs N]

Targets (each measured --runs times, median with min and max):
  cache-disk     torch.save into a directory on the cache disk (the floor for the stall)
  ckptfs-local   torch.save into a ckptfs mount on a local-directory store
  ckptfs-s3      torch.save into a ckptfs mount on the S3 server (OpenStack Swift on 127.0.0.1)
  boto3          upload_fileobj (8 MiB parts) of the same bytes already in memory (time to durable),
                 download_fileobj of the object (the baseline for a cold load)
Time to durable runs from the start of the save until `ckptfs sync` returns (the object is whole
in the store). Loads: warm = torch.load of the latest checkpoint through the mount that saved it
vs the cache-disk file (page cache warm); cold = a fresh mount (empty cache, page cache dropped).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.swift import SwiftServer  # noqa: E402

CKPTFS = [sys.executable, "-m", "ckptfs"]
MiB = 1 << 20


def ckptfs(*args: str) -> str:
    return subprocess.run([*CKPTFS, *args], check=True, capture_output=True, text=True).stdout


def timed_save(state, path: Path) -> float:
    start = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - start


def bench_mount(name, store_url, endpoint, work: Path, state, runs: int, results: dict) -> None:
    mnt, cache = work / f"{name}-mnt", work / f"{name}-cache"
    mnt.mkdir()
    args = [store_url, str(mnt), "--cache-dir", str(cache), "--ram-cache", "3GiB", "--cache-size", "8GiB"]
    if endpoint:
        args += ["--endpoint-url", endpoint]
    ckptfs("mount", *args)
    try:
        pid = json.loads(ckptfs("status", str(mnt), "--json"))["pid"]
        cpu0 = _cpu_seconds(pid)
        for i in range(runs):
            path = mnt / f"step-{i}" / "model.pt"
            path.parent.mkdir()
            start = time.perf_counter()
            torch.save(state, path)
            stall = time.perf_counter() - start
            ckptfs("sync", str(mnt))
            durable = time.perf_counter() - start
            results.setdefault(f"{name} save stall", []).append(stall)
            results.setdefault(f"{name} time to durable", []).append(durable)
            print(f"  {name} run {i}: stall {stall:.2f} s, durable {durable:.2f} s", flush=True)
        start = time.perf_counter()  # a restarted job on this node loads the latest checkpoint
        torch.load(path, weights_only=False)
        results.setdefault(f"{name} warm load", []).append(time.perf_counter() - start)
        start = time.perf_counter()  # again: the kernel kept the pages of the unchanged file
        torch.load(path, weights_only=False)
        results.setdefault(f"{name} warm load again", []).append(time.perf_counter() - start)
        results[f"{name} daemon CPU s/GiB"] = [(_cpu_seconds(pid) - cpu0) / runs / (path.stat().st_size / (1 << 30))]
    finally:
        ckptfs("umount", str(mnt))
        from ckptfs.daemon import ram_dir_for
        shutil.rmtree(ram_dir_for(cache), ignore_errors=True)


def bench_loads(store_url, endpoint, work: Path, floor_file: Path, runs: int, results: dict) -> None:
    """Cold loads through fresh mounts (another node, or an evicted cache), and the floor's warm load."""
    from ckptfs.daemon import ram_dir_for
    for i in range(runs):
        mnt, cache = work / f"cold-{i}-mnt", work / f"cold-{i}-cache"
        mnt.mkdir()
        ckptfs("mount", store_url, str(mnt), "--cache-dir", str(cache), "--ram-cache", "3GiB",
               "--cache-size", "8GiB", "--endpoint-url", endpoint)
        try:
            _drop_page_cache()
            start = time.perf_counter()
            torch.load(mnt / "step-0" / "model.pt", weights_only=False)
            results.setdefault("ckptfs-s3 cold load", []).append(time.perf_counter() - start)
        finally:
            ckptfs("umount", str(mnt))
            shutil.rmtree(ram_dir_for(cache), ignore_errors=True)
        torch.load(floor_file, weights_only=False)
        start = time.perf_counter()
        torch.load(floor_file, weights_only=False)
        results.setdefault("cache-disk warm load", []).append(time.perf_counter() - start)
    bench_shared_cold_read(store_url, endpoint, work, results)


def bench_shared_cold_read(store_url, endpoint, work: Path, results: dict) -> None:
    """4 ranks restore the same checkpoint at once on a fresh mount: each byte should cross the
    network once (fetched bytes / file size = 1.0)."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptfs.daemon import ram_dir_for
    mnt, cache = work / "shared-mnt", work / "shared-cache"
    mnt.mkdir()
    ckptfs("mount", store_url, str(mnt), "--cache-dir", str(cache), "--ram-cache", "3GiB",
           "--cache-size", "8GiB", "--endpoint-url", endpoint)
    try:
        _drop_page_cache()
        path = mnt / "step-0" / "model.pt"
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: torch.load(path, weights_only=False), range(4)))
        results.setdefault("ckptfs-s3 4 concurrent cold loads", []).append(time.perf_counter() - start)
        fetched = json.loads(ckptfs("status", str(mnt), "--json"))["fetched_bytes"]
        results["ckptfs-s3 4 cold readers: fetched / file size"] = [fetched / path.stat().st_size]
        print(f"  4 concurrent cold readers fetched {fetched} bytes for a {path.stat().st_size}-byte file "
              f"({fetched / (8 << 20):.0f} GETs of 8 MiB)", flush=True)
    finally:
        ckptfs("umount", str(mnt))
        shutil.rmtree(ram_dir_for(cache), ignore_errors=True)


def _drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        print("  (cannot drop the page cache: not root)", flush=True)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--runs", type=int, default=3)
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-"))
    server = SwiftServer(work / "swift")
    try:
        server.start()
        os.environ.update(server.env())
        client = server.client()
        client.create_bucket(Bucket="bench")
        state = make_checkpoint(opts.size)
        buf = io.BytesIO()
        torch.save(state, buf)
        size = buf.tell()
        print(f"checkpoint: {size / MiB:.0f} MiB; Swift at {server.endpoint}", flush=True)
        results: dict[str, list[float]] = {}

        floor = work / "cache-disk"
        floor.mkdir()
        for i in range(opts.runs):
            results.setdefault("cache-disk save stall", []).append(timed_save(state, floor / f"model-{i}.pt"))
            if i:
                (floor / f"model-{i}.pt").unlink()
        from boto3.s3.transfer import TransferConfig
        config = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=8)
        for i in range(opts.runs):
            buf.seek(0)
            start = time.perf_counter()
            client.upload_fileobj(buf, "bench", f"boto3/model-{i}.pt", Config=config)
            results.setdefault("boto3 upload (time to durable)", []).append(time.perf_counter() - start)
        for i in range(opts.runs):
            _drop_page_cache()
            start = time.perf_counter()
            client.download_fileobj("bench", f"boto3/model-{i}.pt", io.BytesIO(), Config=config)
            results.setdefault("boto3 download (cold load baseline)", []).append(time.perf_counter() - start)
        bench_mount("ckptfs-local", f"file://{work / 'local-store'}", None, work, state, opts.runs, results)
        bench_mount("ckptfs-s3", "s3://bench/ckptfs", server.endpoint, work, state, opts.runs, results)
        bench_loads("s3://bench/ckptfs", server.endpoint, work, floor / "model-0.pt", opts.runs, results)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'figure':40} {'median':>8} {'min':>8} {'max':>8}")
    for name, values in results.items():
        print(f"{name:40} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nsave stall, ckptfs-s3 / cache disk:         {med['ckptfs-s3 save stall'] / med['cache-disk save stall']:.2f}x")
    print(f"time to durable, ckptfs-s3 / boto3 upload:  {med['ckptfs-s3 time to durable'] / med['boto3 upload (time to durable)']:.2f}x")
    print(f"warm load, ckptfs-s3 / cache disk:          {med['ckptfs-s3 warm load'] / med['cache-disk warm load']:.2f}x"
          f" (again, page cache kept: {med['ckptfs-s3 warm load again'] / med['cache-disk warm load']:.2f}x)")
    print(f"cold load throughput, ckptfs-s3 / boto3:    {med['boto3 download (cold load baseline)'] / med['ckptfs-s3 cold load']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
