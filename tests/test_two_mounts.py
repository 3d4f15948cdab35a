"""Two mounts of one store (bucket and prefix), each with its own cache dir, as on two nodes.

B is mounted first, with a short ``--list-ttl``; A writes and syncs. B sees what A made
durable: a path it never saw, opened directly, is asked of the store at once (also on C, whose
listings are trusted for long); listings, overwrites and deletions show up within the TTL
(plus the kernel's entry caching, at most as long). Runs on the local store and on the S3
server (the ``store`` fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from tests.support.harness import blob
from tests.support.mounting import ckptfs

TTL = 1.0
SLACK = 4.0  # a loaded 2-core machine: the bound checked is TTL + SLACK
MiB = 1 << 20


def eventually(check, within: float) -> float:
    """Poll ``check`` until it is true; the seconds it took (fails after ``within``)."""
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > within:
            raise AssertionError(f"not true after {within} s: {check.__doc__ or check}")
        time.sleep(0.05)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_second_mount_sees_what_the_first_made_durable(mount_factory):
    b = mount_factory(extra=("--list-ttl", str(TTL))).start()  # the other node: knows nothing yet
    c = mount_factory(extra=("--list-ttl", "600")).start()  # a third, that trusts its listings long
    a = mount_factory().start()
    assert os.listdir(b.path) == []
    assert not (b.path / "late.txt").exists()  # a miss B (and its kernel) remember for the TTL

    model = blob(10 * MiB + 3, 1)  # more than one part: a multipart upload on S3
    shards = {f"shard{i}.pt": blob(100_000 + i, 10 + i) for i in range(3)}
    (a.path / "model.pt").write_bytes(model)
    (a.path / "ckpt" / "step1").mkdir(parents=True)
    for name, data in shards.items():
        (a.path / "ckpt" / "step1" / name).write_bytes(data)
    (a.path / "late.txt").write_bytes(b"late")
    a.sync()

    # A directory B never saw, warmed up (`ckptfs warmup` walks the tree, not the kernel).
    warmed = json.loads(ckptfs("warmup", str(b.path / "ckpt"), "--json").stdout)
    assert warmed["files"] == len(shards) and warmed["total_bytes"] == sum(map(len, shards.values()))
    # Paths B never saw, opened directly: each unknown name is asked of the store, no waiting.
    assert read(b.path / "ckpt" / "step1" / "shard1.pt") == shards["shard1.pt"]
    assert read(b.path / "model.pt") == model
    assert (b.path / "model.pt").stat().st_size == len(model)
    # Even where the directory's listing is trusted for long, a name not known is asked.
    assert read(c.path / "model.pt") == model
    assert read(c.path / "ckpt" / "step1" / "shard2.pt") == shards["shard2.pt"]
    assert sorted(os.listdir(c.path)) == ["ckpt", "model.pt"]  # (the listing waits for its TTL)
    c.stop()
    # Listings (and the name B missed before) within the TTL.
    eventually(lambda: sorted(os.listdir(b.path)) == ["ckpt", "late.txt", "model.pt"], TTL + SLACK)
    assert sorted(os.listdir(b.path / "ckpt" / "step1")) == sorted(shards)
    for name, data in shards.items():
        assert read(b.path / "ckpt" / "step1" / name) == data
    assert read(b.path / "late.txt") == b"late"
    assert os.getxattr(b.path / "model.pt", "user.ckptfs.state") == b"durable"

    # A overwrites a file B has read (and cached) with new bytes of the same size. A reader
    # that has it open on B keeps its version; B's next open after the TTL gets the new one.
    new_model = blob(len(model), 2)
    with open(b.path / "model.pt", "rb") as reader:
        assert reader.read(100) == model[:100]
        (a.path / "model.pt").write_bytes(new_model)
        a.sync()
        time.sleep(TTL + 0.1)
        os.listdir(b.path)  # a refresh is due: it must leave the open file alone
        assert reader.read() == model[100:]
    eventually(lambda: read(b.path / "model.pt") == new_model, TTL + SLACK)
    assert read(b.path / "model.pt") == new_model  # (and stays so: no stale page cache)

    # A deletes a file and a whole directory: B stops showing them.
    (a.path / "late.txt").unlink()
    shutil.rmtree(a.path / "ckpt" / "step1")
    a.sync()
    eventually(lambda: sorted(os.listdir(b.path)) == ["ckpt", "model.pt"], TTL + SLACK)
    eventually(lambda: not (b.path / "ckpt" / "step1" / "shard0.pt").exists(), TTL + SLACK)
    eventually(lambda: os.listdir(b.path / "ckpt") == [], TTL + SLACK)
    assert not (b.path / "late.txt").exists()
    assert read(b.path / "model.pt") == new_model
