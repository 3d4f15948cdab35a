"""The store's byte path in worker processes (transfer/workers.py, issue 42), on the real S3 server:
a worker killed mid-part costs that part a resend, never the file; workers end with the daemon,
even one killed with SIGKILL; ``--store-workers 0`` keeps the parts in the daemon's threads."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time

import pytest
import xxhash

from tests.support.faultproxy import FaultProxy, Rule, hold
from tests.support.harness import wait_until
from tests.support.mounting import Mount

pytestmark = pytest.mark.store

MiB = 1 << 20


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        text = open(f"/proc/{pid}/task/{task}/children").read()
        found.update(int(c) for c in text.split())
    return found


def _stored(s3_server, bucket: str, key: str) -> bytes:
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def test_a_worker_killed_mid_part_costs_a_resend_not_the_file(s3_server, s3_bucket, tmp_path):
    data = os.urandom(40 * MiB)  # five parts
    with FaultProxy(s3_server.endpoint) as proxy:
        m = Mount(
            f"s3://{s3_bucket}/w",
            tmp_path / "m",
            endpoint_url=proxy.url,
            extra=("--store-workers", "1", "--upload-concurrency", "2"),
        )
        try:
            m.start()
            held = proxy.add_rule(Rule(hold(), kind="upload_part", count=1))
            (m.path / "ckpt.bin").write_bytes(data)
            held.wait_held()  # a part is on its way: its worker is waiting for the answer
            workers = m.status()["store_workers"]
            assert workers["processes"] == 1 and len(workers["pids"]) == 1
            victim = workers["pids"][0]
            assert victim in _children(m.pid)
            os.kill(victim, signal.SIGKILL)
            held.release(forward=False)
            m.sync(timeout=120)
            status = m.status()
            assert status["store_workers"]["restarts"] >= 1
            assert victim not in status["store_workers"]["pids"]
            # (the part was sent again; a worker of ours is not the store's failure)
            assert not any("store worker" in e["message"] for e in status["errors"])
            assert status["store_health"]["state"] == "ok"
            stored = _stored(s3_server, s3_bucket, "w/ckpt.bin")
            assert xxhash.xxh3_64_hexdigest(stored) == xxhash.xxh3_64_hexdigest(data)
            assert (m.path / "ckpt.bin").read_bytes() == data
        finally:
            m.cleanup()


def test_workers_end_with_the_daemon_even_a_killed_one(s3_server, s3_bucket, tmp_path):
    m = Mount(
        f"s3://{s3_bucket}/k", tmp_path / "m", endpoint_url=s3_server.endpoint, extra=("--store-workers", "2")
    )
    try:
        m.start()
        (m.path / "a").write_bytes(os.urandom(24 * MiB))
        m.sync()
        pids = m.status()["store_workers"]["pids"]
        assert len(pids) == 2 and set(pids) <= _children(m.pid)
        m.kill()  # SIGKILL: no shutdown of its own
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a store worker outlived its daemon"
        m.start()  # the same cache dir: the file is there, durable
        assert (m.path / "a").stat().st_size == 24 * MiB
        (m.path / "b").write_bytes(os.urandom(24 * MiB))
        m.sync()
        pids = m.status()["store_workers"]["pids"]
        assert pids
        m.stop()  # a clean unmount ends them too
        assert not any(_alive(p) for p in pids)
    finally:
        m.cleanup()


def test_no_workers_keeps_the_parts_in_the_daemon(s3_server, s3_bucket, tmp_path):
    data = os.urandom(20 * MiB)
    m = Mount(
        f"s3://{s3_bucket}/t", tmp_path / "m", endpoint_url=s3_server.endpoint, extra=("--store-workers", "0")
    )
    try:
        m.start()
        (m.path / "a").write_bytes(data)
        m.sync()
        status = m.status()
        assert status["store_workers"] is None
        assert not _children(m.pid)
        assert _stored(s3_server, s3_bucket, "t/a") == data
    finally:
        m.cleanup()


def test_a_streamed_files_parts_are_checked_again_by_the_workers(s3_server, s3_bucket, tmp_path):
    """A file written by the kernel is streamed while open (model/tailing.py); at its commit each
    part sent is read and hashed again, by the workers as the sends were, not in the daemon's
    process; a part written again since is sent again."""
    block = 8 * MiB
    data = bytearray(os.urandom(5 * block))
    m = Mount(
        f"s3://{s3_bucket}/s", tmp_path / "m", endpoint_url=s3_server.endpoint, extra=("--store-workers", "1")
    )
    try:
        m.start()
        hashes = m.status()["store_workers"]["hashes"]
        with open(m.path / "ckpt.bin", "wb") as f:
            f.write(data)
            f.flush()
            wait_until(
                lambda: m.status()["passthrough"]["streamed_bytes"] >= 3 * block, 60, what="parts streamed"
            )
            f.seek(block + 10)  # into a part already sent
            f.write(b"written again")
            data[block + 10 : block + 23] = b"written again"
        m.sync()
        assert _stored(s3_server, s3_bucket, "s/ckpt.bin") == data
        status = m.status()
        verified = status["passthrough"]["verified_bytes"] // block
        assert verified >= 3 and status["passthrough"]["changed_parts"] == 1, status["passthrough"]
        # every part checked again, and the whole file's hash, went through the workers
        assert status["store_workers"]["hashes"] - hashes >= verified + 1, status["store_workers"]
    finally:
        m.cleanup()


def test_a_cold_read_is_fetched_by_the_workers_and_survives_one_killed_mid_get(
    s3_server, s3_bucket, tmp_path
):
    """A range fetched by a worker: GET, checked, written into the cache slots by the worker;
    the worker killed while its GET is held: the read gets its bytes all the same."""
    data = os.urandom(96 * MiB)
    url = f"s3://{s3_bucket}/f"
    w = Mount(url, tmp_path / "w", endpoint_url=s3_server.endpoint)
    try:
        w.start()
        (w.path / "ckpt.bin").write_bytes(data)
        w.stop()
    finally:
        w.cleanup()
    with FaultProxy(s3_server.endpoint) as proxy:
        r = Mount(
            url,
            tmp_path / "r",
            endpoint_url=proxy.url,
            # (reads through the daemon: not fetched whole at the open, tests/test_fetch_whole.py)
            extra=("--store-workers", "1", "--upload-concurrency", "2", "--fetch-whole", "0"),
        )
        try:
            r.start()
            fd = os.open(r.path / "ckpt.bin", os.O_RDONLY | os.O_DIRECT)
            try:
                buf = mmap.mmap(-1, MiB)  # (O_DIRECT: an aligned buffer; one FUSE read per call)
                assert os.preadv(fd, [buf], 0) == MiB and buf[:] == data[:MiB]  # (its checksums known)
                held = proxy.add_rule(Rule(hold(), kind="get", path=r"/ckpt\.bin$", count=1))
                victim: list[int] = []

                def kill_when_held() -> None:
                    held.wait_held()
                    victim.extend(r.status()["store_workers"]["pids"])
                    for pid in victim:
                        os.kill(pid, signal.SIGKILL)
                    held.release(forward=False)

                killer = threading.Thread(target=kill_when_held)
                killer.start()
                at = 80 * MiB
                assert os.preadv(fd, [buf], at) == MiB and buf[:] == data[at : at + MiB]
                killer.join(30)
                assert victim
            finally:
                os.close(fd)
            assert (r.path / "ckpt.bin").read_bytes() == data
            workers = r.status()["store_workers"]
            assert workers["fetches"] > 0 and workers["restarts"] >= 1
            assert r.status()["integrity_errors"] == []
        finally:
            r.cleanup()
