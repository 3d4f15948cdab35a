"""One rank of a torch.distributed.checkpoint job on CPU (gloo), run by tests/test_frameworks.py.

    python -m tests.support.frameworks_dcp ROOT

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment, as torchrun sets them.
First it writes ROOT/dcp-sync with dcp.save and ROOT/dcp-async with dcp.async_save: a matrix
sharded by rows (Shard(0)) across the ranks plus replicated and non-tensor state; prints
"saved". Then it waits for a line on stdin (the test remounts ROOT meanwhile), reads both back
sharded by columns (Shard(1)), a resharding, and exits 1 unless every value is equal. (One
process pair for both halves: starting torch.distributed twice more costs the suite seconds.)
"""

from __future__ import annotations

import os
import sys
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

ROWS, COLS = 64, 48


def expected(seed: int) -> dict:
    """The full (unsharded) state every rank agrees on; the test builds it too."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "weight": torch.randn(ROWS, COLS, generator=gen),
            "bias": torch.randn(COLS, generator=gen).to(torch.bfloat16),
        },
        "step": 1000 + seed,
        "extra": {"lr": 3e-4, "tags": ["dcp", str(seed)]},
    }


def sharded(state: dict, mesh, placement) -> dict:
    """``state`` with its weight split across the mesh by ``placement``."""
    return {
        **state,
        "model": {**state["model"], "weight": distribute_tensor(state["model"]["weight"], mesh, [placement])},
    }


def template(seed: int, mesh, placement) -> dict:
    """What a restarting job builds before dcp.load: the right shapes, wrong values."""
    zeros = {
        "model": {k: torch.zeros_like(v) for k, v in expected(seed)["model"].items()},
        "step": 0,
        "extra": {"lr": 0.0, "tags": []},
    }
    return sharded(zeros, mesh, placement)


def wait(result) -> None:
    if isinstance(result, Future):
        result.result(timeout=120)
    else:  # AsyncSaveResponse: staging, then the upload
        result.staging_completion.result(timeout=120)
        result.upload_completion.result(timeout=120)


def main(root: str) -> int:
    warnings.filterwarnings("ignore")  # DCP's notices about its own APIs, not ours to judge
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        dcp.save(sharded(expected(1), mesh, Shard(0)), checkpoint_id=os.path.join(root, "dcp-sync"))
        wait(
            dcp.async_save(
                sharded(expected(2), mesh, Shard(0)), checkpoint_id=os.path.join(root, "dcp-async")
            )
        )
        dist.barrier()
        print("saved", flush=True)
        if sys.stdin.readline().strip() != "load":
            return 2
        bad = []
        for seed, name in ((1, "dcp-sync"), (2, "dcp-async")):
            state = template(seed, mesh, Shard(1))
            dcp.load(state, checkpoint_id=os.path.join(root, name))
            want = expected(seed)
            weight, full = state["model"]["weight"], want["model"]["weight"]
            local = full.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]  # this rank's columns
            if not torch.equal(weight.to_local(), local) or not torch.equal(weight.full_tensor(), full):
                bad.append(f"{name}: weight")
            bias = state["model"]["bias"]
            if not (bias.dtype == torch.bfloat16 and torch.equal(bias, want["model"]["bias"])):
                bad.append(f"{name}: bias")
            if state["step"] != want["step"] or state["extra"] != want["extra"]:
                bad.append(f"{name}: step/extra {state['step']!r} {state['extra']!r}")
        dist.barrier()  # neither rank tears gloo down while the other still has traffic in flight
        if bad:
            print(f"rank {dist.get_rank()}: not equal after a resharded load: {bad}", file=sys.stderr)
            return 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: torch's C++ threads (async_save's executor, gloo) were
    # seen to abort it ("terminate called without an active exception", SIGABRT) once every
    # checkpoint had been saved and checked; the result above is what this rank reports.
    os._exit(code)
