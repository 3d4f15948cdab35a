"""DCP-like saves: N rank processes, each holding its own shard, save at the same moment.

Each rank is a spawned process that builds its shard once (`make_checkpoint(shard MiB, seed=rank)`)
and then waits for orders on a pipe. `Ranks.save(specs)` sends every rank its order at once and
returns each rank's (start, end) on the shared CLOCK_MONOTONIC (time.monotonic is system-wide on
Linux, so times compare across processes).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import time

READY_TIMEOUT = 300.0


def _save(spec: tuple, state, cache: dict) -> None:
    import torch

    kind = spec[0]
    if kind == "file":
        torch.save(state, spec[1])
    elif kind == "boto3":
        from bench.targets import transfer_config

        if "s3" not in cache:
            from tests.support.swift import S3Endpoint

            cache["s3"] = S3Endpoint(os.environ["CKPTFS_TEST_S3_ENDPOINT"]).client()
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        cache["s3"].upload_fileobj(buf, spec[1], spec[2], Config=transfer_config())
    elif kind == "s3torch":
        from bench.targets import s3torch_checkpoint

        if "s3torch" not in cache:
            cache["s3torch"] = s3torch_checkpoint(os.environ["CKPTFS_TEST_S3_ENDPOINT"])
        with cache["s3torch"].writer(f"s3://{spec[1]}/{spec[2]}") as writer:
            torch.save(state, writer)
    else:
        raise ValueError(f"unknown save kind {kind!r}")


def _serve(conn, rank: int, shard_mib: int) -> None:
    import signal

    from tests.support.checkpoints import make_checkpoint

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle: it stops the ranks

    state = make_checkpoint(shard_mib, seed=rank)
    cache: dict = {}
    conn.send("ready")
    while (spec := conn.recv()) is not None:
        try:
            start = time.monotonic()
            _save(spec, state, cache)
            conn.send((start, time.monotonic()))
        except Exception as e:  # noqa: BLE001 -- reported by the parent
            conn.send(f"rank {rank}: {type(e).__name__}: {e}")


class Ranks:
    def __init__(self, n: int, shard_mib: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, rank, shard_mib), name=f"rank-{rank}", daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(READY_TIMEOUT) or conn.recv() != "ready":
                raise RuntimeError(f"rank {rank} did not build its shard in {READY_TIMEOUT:.0f} s")

    def save(self, specs: list[tuple]) -> list[tuple[float, float]]:
        for conn, spec in zip(self.conns, specs):
            conn.send(spec)
        answers = [conn.recv() for conn in self.conns]
        errors = [a for a in answers if isinstance(a, str)]
        if errors:
            raise RuntimeError("; ".join(errors))
        return answers

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
