"""The frameworks people save checkpoints with, end to end on a real mount over the real S3 server.

Each test saves with the framework's own API onto a ckptfs mount, runs `ckptfs sync`, checks the
objects in the bucket (boto3 listing), then loads back through a fresh mount with an empty cache
dir (every byte from the store) and compares bit for bit. Tiny models, few steps: the whole file
runs in well under three minutes on a loaded 2-core machine. The frameworks' own logging and
warnings are silenced inside each test only (`quiet`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import S3StoreView

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(s3_server, s3_bucket):
    """These tests run on the S3 server only (overrides the local/s3 pair of conftest)."""
    return S3StoreView(s3_server, s3_bucket)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub, no telemetry, no tokenizer threads: nothing leaves the machine."""
    for name, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
                        "WANDB_DISABLED": "true", "WANDB_MODE": "disabled"}.items():
        monkeypatch.setenv(name, value)


@contextlib.contextmanager
def quiet(*loggers: str):
    """The frameworks' INFO logs and warnings silenced for one test, put back afterwards."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    try:
        for name in loggers:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


def fetched(m) -> int:
    return m.status()["fetched_bytes"]


# =============================================================================================
# torch.distributed.checkpoint: 2 ranks (gloo, CPU), save + async_save, resharded loads
# =============================================================================================


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(mode: str, root: Path, world: int = 2) -> None:
    """`world` processes of tests/frameworks_dcp.py, as torchrun would start them."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.frameworks_dcp", mode, str(root)], cwd=REPO,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"dcp {mode} rank {rank} exited {p.returncode}:\n{err[-3000:]}"


def test_torch_distributed_checkpoint_two_ranks_save_async_save_and_resharded_load(store, mount_factory):
    import torch.distributed.checkpoint as dcp

    from tests.frameworks_dcp import expected

    m = mount_factory().start()
    _run_ranks("save", m.path)  # dcp.save to dcp-sync, dcp.async_save to dcp-async; Shard(0) rows
    m.sync()
    layout = {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert store.keys() == {f"{name}/{f}" for name in ("dcp-sync", "dcp-async") for f in layout}
    for name in ("dcp-sync", "dcp-async"):
        for f in layout:
            assert store.read(f"{name}/{f}") == (m.path / name / f).read_bytes()
    m.stop()

    fresh = mount_factory().start()
    _run_ranks("load", fresh.path)  # the same 2 ranks, sharded by columns (Shard(1)): each rank checks
    assert fetched(fresh) > 0
    with quiet("torch.distributed.checkpoint"):
        for seed, name in ((1, "dcp-sync"), (2, "dcp-async")):  # one process, no process group, full tensors
            want = expected(seed)
            state = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0,
                     "extra": {"lr": 0.0, "tags": []}}
            dcp.load(state, checkpoint_id=fresh.path / name, no_dist=True)
            assert_same_tensors(state["model"], want["model"])
            assert state["step"] == want["step"] and state["extra"] == want["extra"]
    fresh.stop()


# =============================================================================================
# safetensors
# =============================================================================================


def test_safetensors_save_file_load_file_and_safe_open(store, mount_factory):
    from safetensors import safe_open
    from safetensors.torch import load, load_file, save_file

    gen = torch.Generator().manual_seed(5)
    tensors = {
        "embed.weight": torch.randn(1024, 2560, generator=gen),  # 10 MiB: spans two 8 MiB parts
        "layer.0.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.randn(64, generator=gen).to(torch.float16),
        "positions": torch.arange(100, dtype=torch.int64),
        "mask": torch.rand(33, generator=gen) > 0.5,
    }
    metadata = {"format": "pt", "step": "1000"}
    m = mount_factory().start()
    (m.path / "step-1000").mkdir()
    save_file(tensors, m.path / "step-1000" / "model.safetensors", metadata=metadata)
    assert_same_tensors(load_file(m.path / "step-1000" / "model.safetensors"), tensors)  # warm, same mount
    m.sync()
    saved = (m.path / "step-1000" / "model.safetensors").read_bytes()
    assert store.keys() == {"step-1000/model.safetensors"}
    assert store.read("step-1000/model.safetensors") == saved
    m.stop()

    fresh = mount_factory().start()
    path = fresh.path / "step-1000" / "model.safetensors"
    with safe_open(path, framework="pt") as f:  # mmap of the file: reads only the ranges asked for
        assert f.metadata() == metadata
        assert set(f.keys()) == set(tensors)
        rows = f.get_slice("embed.weight")[400:500]  # bytes 4.0-5.1 MiB of the tensor, cold
        assert torch.equal(rows, tensors["embed.weight"][400:500])
        assert torch.equal(f.get_tensor("layer.0.weight"), tensors["layer.0.weight"])
    assert_same_tensors(load_file(path), tensors)
    assert_same_tensors(load(path.read_bytes()), tensors)
    assert fetched(fresh) >= len(saved)
    fresh.stop()
