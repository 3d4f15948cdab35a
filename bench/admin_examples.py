"""The example output of docs/admin.md and its gc timings: a Swift server, a mount through the
fault proxy, DCP and Megatron series, a step kept pending (its PUTs blackholed), then ls,
checkpoints and gc on the mount and on the store URL, and 1,000-file steps deleted both ways.

    .venv/bin/python -m bench.admin_examples      # about 2 minutes; prints each command and its output

Paths under its temporary directory print as /m/mnt; docs/admin.md shows them as /mnt/ckpt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.faultproxy import FaultProxy, Rule, blackhole
from tests.support.mounting import Mount
from tests.support.swift import SwiftServer

UPLOADS = ("put", "upload_part", "create_multipart", "complete_multipart")


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    root = Path(tempfile.mkdtemp(prefix="ckptfs-admin-examples-"))
    server = SwiftServer(root / "swift").start()
    os.environ.update(server.env())
    os.environ["AWS_REGION"] = server.region
    server.make_bucket("ckpt")
    url = ["--endpoint-url", server.endpoint]

    def run(*args: str) -> None:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True)
        shown = " ".join(["ckptfs", *args]).replace(str(root), "")
        print(f"$ {shown}   # {time.monotonic() - started:.2f} s, rc={done.returncode}")
        print((done.stdout + done.stderr).replace(str(root), ""), flush=True)

    def many(directory: Path) -> None:
        directory.mkdir(parents=True)
        for i in range(1000):
            (directory / f"shard-{i:04d}.pt").write_bytes(b"s" * 1000)

    with FaultProxy(server.endpoint) as proxy:
        m = Mount("s3://ckpt/run42", root / "m", endpoint_url=proxy.url)
        try:
            m.start()
            mp = m.path
            for n in (1000, 2000, 3000):
                dcp.save(
                    {"w": torch.randn(1024, 1024), "step": n}, checkpoint_id=str(mp / "dcp" / f"step-{n}")
                )
            for n in (100, 200, 300):
                rank = mp / "megatron" / f"iter_{n:07d}" / "mp_rank_00"
                rank.mkdir(parents=True)
                torch.save({"x": torch.randn(256, 256)}, rank / "model_optim_rng.pt")
                if n < 300:
                    (mp / "megatron" / "latest_checkpointed_iteration.txt").write_text(str(n))
            m.sync()
            rule = proxy.add_rule(Rule(blackhole(), kind=UPLOADS))  # the next step stays pending
            dcp.save(
                {"w": torch.randn(1024, 1024), "step": 4000}, checkpoint_id=str(mp / "dcp" / "step-4000")
            )
            run("ls", str(mp), "dcp")
            run("checkpoints", str(mp))
            run("gc", str(mp), "--keep-last", "1", "--dry-run")
            run("gc", str(mp), "--keep-last", "1", "--pattern", "dcp/*")
            proxy.remove_rule(rule)
            m.sync()
            run("checkpoints", "s3://ckpt/run42/megatron", *url)
            run("ls", "s3://ckpt/run42", "megatron", *url)
            run("gc", "s3://ckpt/run42", "--keep-last", "1", *url)
            many(mp / "many" / "step-1")
            many(mp / "many" / "step-2")
            m.sync()
            run("gc", str(mp / "many"), "--keep-last", "1")  # through the mount
            m.sync()
            many(mp / "many" / "step-3")
            m.sync()
            run("gc", "s3://ckpt/run42/many", "--keep-last", "1", *url)  # with the store API
        finally:
            proxy.clear()
            m.cleanup()
            server.stop()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
