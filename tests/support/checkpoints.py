"""Synthetic but realistic training checkpoints (shared by tests and scripts/bench)."""

from __future__ import annotations

import torch


def make_checkpoint(size_mb: int, seed: int = 0) -> dict:
    """About ``size_mb`` MiB of state: bf16 and fp32 transformer weights, Adam-like
    moments, step counters and plain python objects, as a training loop saves them."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 1024
    # per layer: bf16 weights (2 B/param) + fp32 master copy and two moments (12 B/param)
    layer_params = 4 * hidden * hidden
    n_layers = max(1, (size_mb << 20) // (14 * layer_params))
    model, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
    for i in range(n_layers):
        w = torch.randn(4 * hidden, hidden, generator=gen)
        model[f"layers.{i}.mlp.weight"] = w.to(torch.bfloat16)
        master[f"layers.{i}.mlp.weight"] = w
        exp_avg[f"layers.{i}.mlp.weight"] = torch.randn(4 * hidden, hidden, generator=gen) * 1e-3
        exp_avg_sq[f"layers.{i}.mlp.weight"] = torch.rand(4 * hidden, hidden, generator=gen) * 1e-6
    model["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return {
        "model": model,
        "optimizer": {
            "state": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}],
        },
        "step": 1000 + seed,
        "rng": torch.get_rng_state(),
        "config": {"name": "tiny-llm", "layers": n_layers, "hidden": hidden, "tags": ["bench", "ckptfs"]},
    }


def assert_same(a, b) -> None:
    """Deep equality of checkpoints (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b
