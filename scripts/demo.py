"""The main job, end to end: mount ckptfs on the embedded local store, save and reload a real
checkpoint of a small model with unmodified torch.save/torch.load, show where the bytes are.

    scripts/demo [--store local|swift|rgw]

``--store swift`` or ``rgw`` (or CKPTFS_DEMO_STORE) does the same on a real S3 server started for
the demo on 127.0.0.1 (OpenStack Swift, or Ceph's RADOS Gateway: tests/support/), stopped after."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CKPTFS = [sys.executable, "-m", "ckptfs"]


def ckptfs(*args: str) -> None:
    print(f"\n$ ckptfs {' '.join(args)}", flush=True)
    subprocess.run([*CKPTFS, *args], check=True)


def train_a_little() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(8192, 512),
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 4),
        torch.nn.Linear(512, 8192),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 8192, (4, 64))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, "loss": loss.item()}


@contextlib.contextmanager
def s3_server(kind: str):
    """A Swift or RGW server of the demo's own in a temporary directory, with a bucket: the
    mount's arguments; the server stopped (by PID) and its directory removed afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.rgw import RgwServer
    from tests.support.swift import SwiftServer

    root = Path(tempfile.mkdtemp(prefix=f"ckptfs-demo-{kind}-"))
    server = SwiftServer(root) if kind == "swift" else RgwServer(root)
    try:
        print(
            f"starting {'OpenStack Swift' if kind == 'swift' else 'Ceph RADOS Gateway'} under {root} ...",
            flush=True,
        )
        server.start()
        print(f"S3 on {server.endpoint} after {server.startup_seconds:.1f} s", flush=True)
        server.make_bucket("ckptfs-demo")
        os.environ.update(server.env())
        yield ["s3://ckptfs-demo/run", "--endpoint-url", server.endpoint]
    finally:
        server.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store",
        choices=("local", "swift", "rgw"),
        default=os.environ.get("CKPTFS_DEMO_STORE", "local"),
        help="where the checkpoint goes: the embedded local store (default), or an S3 server started for the demo",
    )
    store = parser.parse_args().store
    with contextlib.ExitStack() as stack:
        store_args = [] if store == "local" else stack.enter_context(s3_server(store))
        return demo(store_args)


def demo(store_args: list[str]) -> int:
    # A fixed mountpoint: its default cache dir (and RAM arena) is reused by the next demo run.
    mountpoint = Path(tempfile.gettempdir()) / "ckptfs-demo"
    mountpoint.mkdir(exist_ok=True)
    ckptfs("mount", *store_args, str(mountpoint))  # (no store arguments: the embedded local store)
    try:
        state = train_a_little()
        path = mountpoint / "demo" / "step-1" / "model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        torch.save(state, path)
        stall = time.perf_counter() - start
        size = path.stat().st_size
        print(
            f"\ntorch.save -> {path}: {size / 2**20:.1f} MiB in {stall:.2f} s (returned once committed in the cache)"
        )
        print(f"state right after close: {os.getxattr(path, 'user.ckptfs.state').decode()}")
        ckptfs("status", str(mountpoint))
        ckptfs("sync", str(mountpoint))
        print(f"state after sync: {os.getxattr(path, 'user.ckptfs.state').decode()}")
        loaded = torch.load(path)
        same = all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
        print(f"torch.load: {'identical' if same else 'DIFFERENT'} weights, step {loaded['step']}")
        ckptfs("status", str(mountpoint))
        if not same:
            return 1
    finally:
        ckptfs("umount", str(mountpoint))
        mountpoint.rmdir()
    if store_args:
        print(f"\nthe checkpoint in the store: {store_args[0]}/demo/step-1/model.pt")
        ckptfs("ls", *store_args, "demo/step-1")
        return 0
    from ckptfs.config import default_store_dir

    stored = default_store_dir() / "demo" / "step-1" / "model.pt"
    print(f"\nthe checkpoint in the store: {stored} ({stored.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
