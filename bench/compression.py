"""What ``--compress zstd`` buys (``scripts/bench --compress``; docs/benchmarks.md, Compression).

    scripts/bench --compress [--size MiB] [--rate MiB/s] [--level N]
    .venv/bin/python -m bench.compression [the same options]

1. The codec alone, in memory, on three checkpoints serialized by torch.save: the realistic one
   of the main bench (bench/workloads.py: bf16 weights, fp32 master copy and Adam moments,
   python objects) and the weights of a small transformer built with torch.nn, randomly
   initialised and trained a few SGD steps, once in fp32 and once in bf16. For each: the ratio
   (original / stored) of plain zstd (every 8 MiB part one frame, no grouping) and of ckptfs's
   codec (grouping by 1, 2 or 4 chosen per part, raw when it does not pay), and the CPU seconds
   per GiB to compress and to decompress (one thread).
2. Time to durable of the realistic checkpoint written through a ckptfs mount on the Swift
   server, with and without ``--compress``: unthrottled, and through the test fault proxy
   (tests/support/faultproxy.py) throttled to ``--rate`` MiB/s each way (a slow or shared link).
   The throttled proxy runs in a process of its own; the unthrottled link is Swift itself.
   Time to durable: from the start of torch.save to the end of ``ckptfs sync``; the stall is
   torch.save's own time (the save lands in the RAM cache); the stored bytes are the bucket's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

MiB = 1 << 20
GiB = 1 << 30
PART = 8 * MiB


def small_transformer(dtype) -> dict:
    """The weights of a small transformer (about 25M parameters), trained a few SGD steps."""
    import torch

    torch.manual_seed(0)
    vocab, dim = 8000, 512
    embed = torch.nn.Embedding(vocab, dim)
    layer = torch.nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    head = torch.nn.Linear(dim, vocab)
    model = torch.nn.ModuleDict({"embed": embed, "encoder": encoder, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        tokens = torch.randint(0, vocab, (4, 64))
        logits = head(encoder(embed(tokens)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}


def serialized(state) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def codec_figures(name: str, data: bytes, level: int) -> dict:
    from ckptfs.objects import compression

    parts = [memoryview(data)[i : i + PART] for i in range(0, len(data), PART)]
    plain = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    cpu = time.process_time()
    plain_frames = [plain.compress(p) for p in parts]
    plain_cpu = time.process_time() - cpu
    codec = compression.Codec(level)
    cpu = time.process_time()
    frames = [codec.encode(p) for p in parts]
    ckptfs_cpu = time.process_time() - cpu
    cpu = time.process_time()
    for (frame, by), p in zip(frames, parts):
        assert compression.decode(frame, [(len(frame), by)], [len(p)]) == p
    decode_cpu = time.process_time() - cpu
    gib = len(data) / GiB
    groups = {by: sum(1 for _, b in frames if b == by) for by in (0, 1, 2, 4)}
    return {
        "name": name,
        "mib": len(data) / MiB,
        "plain_ratio": len(data) / sum(map(len, plain_frames)),
        "grouped_ratio": len(data) / sum(len(f) for f, _ in frames),
        "plain_cpu_s_per_gib": plain_cpu / gib,
        "grouped_cpu_s_per_gib": ckptfs_cpu / gib,
        "decode_cpu_s_per_gib": decode_cpu / gib,
        "frames": f"{groups[4]} by 4, {groups[2]} by 2, {groups[1]} ungrouped, {groups[0]} raw",
    }


PROXY = """
import sys
from tests.support.faultproxy import FaultProxy
proxy = FaultProxy(sys.argv[1]).start()
proxy.rate = float(sys.argv[2])
print(proxy.url, flush=True)
sys.stdin.read()  # until the bench closes it
"""


@contextlib.contextmanager
def throttled_proxy(endpoint: str, rate: float):
    """The fault proxy throttled to ``rate`` bytes/s each way, in a process of its own (in the
    bench's process it would share the GIL with torch.save and slow down with it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", PROXY, endpoint, str(rate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        yield child.stdout.readline().strip()
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def durable_figures(state, nbytes: int, rate_mib: float, level: int, work: Path) -> list[dict]:
    import torch

    from tests.support.mounting import Mount
    from tests.support.swift import SwiftServer

    server = SwiftServer(work / "swift").start()
    rows = []
    try:
        os.environ.update(server.env())
        with throttled_proxy(server.endpoint, rate_mib * MiB) as slow:
            for link, endpoint in (("unthrottled", server.endpoint), (f"{rate_mib:g} MiB/s", slow)):
                for compress in (None, f"zstd:{level}"):
                    bucket = f"ckptfs-z{len(rows)}"
                    server.make_bucket(bucket)
                    extra = ("--compress", compress) if compress else ()
                    m = Mount(
                        f"s3://{bucket}",
                        work / bucket,
                        endpoint_url=endpoint,
                        ram_cache=f"{2 * nbytes // MiB + 64}MiB",
                        extra=extra,
                    )
                    m.start()
                    try:
                        daemon_cpu = _cpu(m.pid)
                        start = time.monotonic()
                        torch.save(state, m.path / "ckpt.pt")
                        stall = time.monotonic() - start
                        m.sync(timeout=1800)
                        durable = time.monotonic() - start
                        cpu = _cpu(m.pid) - daemon_cpu
                        stored = server.client().head_object(Bucket=bucket, Key="ckpt.pt")["ContentLength"]
                    finally:
                        m.cleanup()
                    rows.append(
                        {
                            "link": link,
                            "compress": compress or "off",
                            "stall_s": stall,
                            "durable_s": durable,
                            "stored_mib": stored / MiB,
                            "daemon_cpu_s": cpu,
                        }
                    )
                    print(
                        f"  {link:12} --compress {compress or 'off':7}: stall {stall:5.2f} s, durable "
                        f"{durable:6.2f} s, stored {stored / MiB:7.1f} MiB, daemon CPU {cpu:5.1f} s",
                        flush=True,
                    )
    finally:
        server.stop()
    return rows


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench --compress", description=__doc__.splitlines()[0])
    p.add_argument(
        "--size", type=int, default=256, metavar="MiB", help="realistic checkpoint size (default 256)"
    )
    p.add_argument("--rate", type=float, default=50, metavar="MiB/s", help="the throttled link (default 50)")
    p.add_argument("--level", type=int, default=1, help="zstd level (default 1, as --compress zstd)")
    p.add_argument("--skip-durable", action="store_true", help="the codec figures only (no mounts)")
    opts = p.parse_args(argv)
    import torch

    from tests.support.checkpoints import make_checkpoint

    state = make_checkpoint(opts.size)
    realistic = serialized(state)
    print(f"codec, zstd level {opts.level}, {PART // MiB} MiB parts, one thread:", flush=True)
    rows = [
        codec_figures("realistic checkpoint", realistic, opts.level),
        codec_figures("small transformer fp32", serialized(small_transformer(torch.float32)), opts.level),
        codec_figures("small transformer bf16", serialized(small_transformer(torch.bfloat16)), opts.level),
    ]
    print(
        f"  {'checkpoint':24} {'MiB':>6} {'zstd':>6} {'grouped':>8} {'zstd CPU':>9} {'grouped CPU':>12} "
        f"{'decode CPU':>11}  frames"
    )
    for r in rows:
        print(
            f"  {r['name']:24} {r['mib']:6.0f} {r['plain_ratio']:6.3f} {r['grouped_ratio']:8.3f} "
            f"{r['plain_cpu_s_per_gib']:7.2f} s {r['grouped_cpu_s_per_gib']:10.2f} s "
            f"{r['decode_cpu_s_per_gib']:9.2f} s  {r['frames']}  (CPU per GiB)"
        )
    if not opts.skip_durable:
        print(
            f"time to durable of the realistic checkpoint ({len(realistic) / MiB:.0f} MiB), Swift on 127.0.0.1:",
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="ckptfs-bench-z-") as work:
            durable_figures(state, len(realistic), opts.rate, opts.level, Path(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
