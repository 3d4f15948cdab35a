"""Issue 28: a file reopened and rewritten at random offsets (fsx with periodic close and
reopen) under cache pressure, end to end through a real mount. The cache fills with the file's
own earlier versions waiting for their uploads; a writer that is not sequential never has a
part it may change again evicted (docs/semantics.md): it waits for space, and gets ENOSPC
after --write-timeout only when nothing drains. Never EIO."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from tests.support.faultproxy import Rule, hold
from tests.support.harness import wait_until
from tests.support.mounting import Mount

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MiB = 1 << 20
# fsx's case: 64 KiB parts (S3's smallest, 5 MiB, there), no RAM tier, a disk cache twice the
# largest file.
SMALL = dict(ram_cache="0", cache_size="32MiB")


def parts(store) -> tuple[str, ...]:
    return ("--part-size", "5MiB" if store.url.startswith("s3://") else "64KiB")


def largest(store) -> int:
    """The file's largest size: the committed version it is opened on and its working copy (each
    whole 5 MiB blocks on S3) fit the cache together, so space comes back as uploads end."""
    return 15 * MiB if store.url.startswith("s3://") else 16 * MiB


class RandomWriter:
    """fsx-like: random pwrite and ftruncate on one file (up to ``limit`` bytes), closed and
    reopened every ``every`` operations, checked against a model of its bytes."""

    def __init__(self, path, seed: int, limit: int = 16 * MiB, every: int = 20):
        self.path, self.limit, self.every = path, limit, every
        self.rng = random.Random(seed)
        self.model = bytearray()
        self.ops = 0

    def run(self, ops: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Start at full size: every reopen then shares (and copies on write) a 16 MiB base.
            self._write(fd, 0, os.urandom(self.limit))
            for _ in range(ops):
                if self.ops % self.every == self.every - 1:
                    os.close(fd)  # commit a version (its upload pending) and reopen on it
                    fd = -1
                    fd = os.open(self.path, os.O_WRONLY)
                if self.rng.random() < 0.1:
                    size = self.rng.randrange(self.limit // 2, self.limit + 1)
                    os.ftruncate(fd, size)
                    del self.model[size:]
                    self.model.extend(bytes(size - len(self.model)))
                else:
                    length = self.rng.randrange(1, 2 * MiB)
                    offset = self.rng.randrange(0, self.limit - length)
                    self._write(fd, offset, self.rng.randbytes(length))
                self.ops += 1
        finally:
            if fd >= 0:
                os.close(fd)

    def _write(self, fd: int, offset: int, data: bytes) -> None:
        done = 0
        while done < len(data):  # (the kernel splits a large write: a failed piece ends it short)
            done += os.pwrite(fd, data[done:], offset + done)
        if offset > len(self.model):
            self.model.extend(bytes(offset - len(self.model)))
        self.model[offset : offset + len(data)] = data


def test_a_random_writer_under_cache_pressure_completes_without_eio(cluster):
    """Its earlier versions wait for their uploads and fill the cache; the writer waits for them
    to drain, never an EIO, and the last version is the model's. The pressure is made sure of:
    the node's uploads are held (tests/support/cluster.py) from the start until the writer waits
    for cache space, then flow at the store's own pace."""
    node = cluster.node("a", extra=parts(cluster.store), **SMALL)
    writer = RandomWriter(node.path / "fsx.bin", seed=28, limit=largest(cluster.store))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            writer.run(1500)  # (the EIO came after ~2,300 fsx operations; these all write)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    node.hold_uploads()
    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_until(
            lambda: node.status()["writers_waiting"] or not thread.is_alive(),
            120,
            what="the writer waiting for cache space",
        )
    finally:
        node.release_uploads()
        thread.join(240)
    took = time.monotonic() - started
    assert not thread.is_alive() and failed == []
    waits = node.status()["space_waits"]
    assert waits > 0, "the writer never waited for cache space"
    node.sync()
    assert cluster.store.read("fsx.bin") == bytes(writer.model)
    assert (node.path / "fsx.bin").read_bytes() == bytes(writer.model)
    print(
        f"\n{writer.ops} random writes and truncates, {writer.ops // writer.every} reopens: {took:.1f} s; "
        f"the writer waited for cache space {waits} times"
    )
    assert node.status()["errors"] == []


def test_a_random_writer_with_nothing_draining_gets_enospc_after_write_timeout(proxied_store, tmp_path):
    """Every upload held at the store: no space ever comes back. The writer gets ENOSPC after
    --write-timeout (not EIO); once the store answers, what it committed is durable."""
    store = proxied_store
    m = Mount(
        store.url,
        tmp_path / "m",
        endpoint_url=store.endpoint,
        extra=(*store.mount_extra, *parts(store), "--write-timeout", "2"),
        **SMALL,
    )
    try:
        m.start()
        rule = store.fault_proxy.add_rule(Rule(hold(), method="PUT"))
        writer = RandomWriter(m.path / "fsx.bin", seed=29, limit=largest(store))
        with pytest.raises(OSError) as info:
            writer.run(5000)
        assert info.value.errno == errno.ENOSPC, info.value
        print(f"\nENOSPC after {writer.ops} random operations with every upload held")
        rule.release()
        store.fault_proxy.clear()
        m.sync(timeout=120)
        m.stop()
    finally:
        store.fault_proxy.clear()
        m.cleanup()
