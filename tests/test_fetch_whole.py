"""A cold read-only open fetches the file whole into a file of the cache, which the kernel then
reads itself (``--fetch-whole``, model/files.py ``land_whole``), on the real S3 server: no READ
reaches the daemon, the bytes are the store's, an opener killed while it waits is let go at
once, ``ckptfs warmup`` lands files the same way, and ``--fetch-whole 0`` reads through the
daemon as before."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from tests.support.faultproxy import FaultProxy, Rule, corrupt_response_body, hold
from tests.support.mounting import Mount, ckptfs

pytestmark = pytest.mark.store

MiB = 1 << 20


def _written(s3_server, url: str, root, files: dict[str, bytes]) -> None:
    w = Mount(url, root, endpoint_url=s3_server.endpoint)
    try:
        w.start()
        for name, data in files.items():
            (w.path / name).write_bytes(data)
        w.stop()
    finally:
        w.cleanup()


def _passthrough(m: Mount) -> dict:
    status = m.status()
    if not status["passthrough"]["on"]:
        pytest.skip(f"no FUSE passthrough here: {status['passthrough'].get('off_because')}")
    return status["passthrough"]


@contextlib.contextmanager
def _through_proxy(s3_server, url: str, root):
    """(proxy, mount): a started mount of ``url`` whose requests go through a fault proxy."""
    with FaultProxy(s3_server.endpoint) as proxy:
        r = Mount(url, root, endpoint_url=proxy.url)
        try:
            r.start()
            _passthrough(r)
            yield proxy, r
        finally:
            r.cleanup()


def test_a_cold_open_fetches_the_file_whole_and_the_kernel_reads_it(s3_server, s3_bucket, tmp_path):
    data = os.urandom(72 * MiB + 12345)  # (a last block shorter than the others)
    url = f"s3://{s3_bucket}/cold"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    r = Mount(url, tmp_path / "r", endpoint_url=s3_server.endpoint)
    try:
        r.start()
        before = _passthrough(r)
        assert (r.path / "ckpt.bin").read_bytes() == data
        after = r.status()
        pt = after["passthrough"]
        assert pt["whole_fetches"] == 1 and pt["whole_fetched_bytes"] == len(data)
        assert pt["opens"] == before["opens"] + 1
        assert pt["daemon_reads"] == before["daemon_reads"]  # every byte read by the kernel
        assert after["store_workers"]["fetches"] > 0  # the GETs went through the store workers
        # Another open reads the same file, and fetches nothing more.
        fetched = r.fetched_bytes()
        assert (r.path / "ckpt.bin").read_bytes() == data
        assert r.fetched_bytes() == fetched and r.status()["passthrough"]["whole_fetches"] == 1
        assert after["integrity_errors"] == []
    finally:
        r.cleanup()


def test_a_file_lands_in_the_ram_tier_when_it_fits_else_on_the_cache_disk(s3_server, s3_bucket, tmp_path):
    """The first cold file fits the RAM budget: it lands on the RAM tier's tmpfs and counts
    against --ram-cache. The second does not fit beside it: it lands in the cache dir and counts
    against --cache-size. Both read back whole, through the kernel."""
    first, second = os.urandom(40 * MiB), os.urandom(40 * MiB + 1)
    url = f"s3://{s3_bucket}/where"
    _written(s3_server, url, tmp_path / "w", {"a.bin": first, "b.bin": second})
    r = Mount(url, tmp_path / "r", endpoint_url=s3_server.endpoint, ram_cache="64MiB")
    try:
        r.start()
        _passthrough(r)
        ram_dir = r.ram_dir()
        assert ram_dir is not None
        assert (r.path / "a.bin").read_bytes() == first
        status = r.status()
        assert 40 * MiB <= status["ram"]["used"] <= status["ram"]["budget"]
        assert [p.stat().st_size for p in (ram_dir / "working").iterdir()] == [len(first)]
        disk_before = status["disk"]["used"]
        assert (r.path / "b.bin").read_bytes() == second
        status = r.status()
        assert status["passthrough"]["whole_fetches"] == 2
        assert status["ram"]["used"] <= status["ram"]["budget"]
        assert status["disk"]["used"] >= disk_before + 40 * MiB
        assert len(list((ram_dir / "working").iterdir())) == 1
        assert status["passthrough"]["daemon_reads"] == 0
    finally:
        r.cleanup()


def test_an_opener_killed_while_the_store_holds_its_file_is_let_go(s3_server, s3_bucket, tmp_path):
    """The open waits for the whole file; SIGKILL ends the opener at once (the kernel's
    INTERRUPT cancels the wait), what was fetched stays, and the next open gets the file."""
    data = os.urandom(40 * MiB)
    url = f"s3://{s3_bucket}/held"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    with _through_proxy(s3_server, url, tmp_path / "r") as (proxy, r):
        held = proxy.add_rule(Rule(hold(), kind="get", path=r"/ckpt\.bin$", count=1))
        opener = subprocess.Popen(
            [sys.executable, "-c", f"open({str(r.path / 'ckpt.bin')!r}, 'rb'); print('opened')"],
            stdout=subprocess.PIPE,
        )
        try:
            held.wait_held()
            time.sleep(0.5)
            assert opener.poll() is None  # still in its open, waiting for the held GET
            opener.kill()
            opener.wait(timeout=10)  # (without the interrupt: until the GET is let go)
        finally:
            if opener.poll() is None:
                opener.kill()
                opener.wait()
        held.release()
        assert (r.path / "ckpt.bin").read_bytes() == data
        assert r.status()["integrity_errors"] == []


def test_warmup_lands_files_the_kernel_then_reads(s3_server, s3_bucket, tmp_path):
    files = {"a.bin": os.urandom(20 * MiB), "b.bin": os.urandom(9 * MiB + 7)}
    url = f"s3://{s3_bucket}/warm"
    _written(s3_server, url, tmp_path / "w", files)
    r = Mount(url, tmp_path / "r", endpoint_url=s3_server.endpoint)
    try:
        r.start()
        before = _passthrough(r)
        ckptfs("warmup", str(r.path))
        pt = r.status()["passthrough"]
        assert pt["whole_fetches"] == 2 and pt["whole_fetched_bytes"] == sum(map(len, files.values()))
        fetched = r.fetched_bytes()
        for name, data in files.items():
            assert (r.path / name).read_bytes() == data
        pt = r.status()["passthrough"]
        assert pt["opens"] == before["opens"] + 2 and pt["daemon_reads"] == before["daemon_reads"]
        assert r.fetched_bytes() == fetched
    finally:
        r.cleanup()


def test_fetch_whole_0_reads_through_the_daemon(s3_server, s3_bucket, tmp_path):
    data = os.urandom(24 * MiB)
    url = f"s3://{s3_bucket}/off"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    r = Mount(url, tmp_path / "r", endpoint_url=s3_server.endpoint, extra=("--fetch-whole", "0"))
    try:
        r.start()
        before = _passthrough(r)
        assert (r.path / "ckpt.bin").read_bytes() == data
        pt = r.status()["passthrough"]
        assert pt["whole_fetches"] == 0 and pt["daemon_reads"] > before["daemon_reads"]
    finally:
        r.cleanup()


def test_a_file_over_the_cache_budgets_is_read_through_the_daemon(s3_server, s3_bucket, tmp_path):
    """No room in --ram-cache nor in --cache-size for the whole file: the open does not wait for it."""
    data = os.urandom(48 * MiB)
    url = f"s3://{s3_bucket}/big"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    r = Mount(url, tmp_path / "r", endpoint_url=s3_server.endpoint, ram_cache="32MiB", cache_size="32MiB")
    try:
        r.start()
        _passthrough(r)
        with open(r.path / "ckpt.bin", "rb") as f:
            assert f.read() == data
        assert r.status()["passthrough"]["whole_fetches"] == 0
    finally:
        r.cleanup()


def test_signal_handlers_see_eintr_not_a_hang(s3_server, s3_bucket, tmp_path):
    """A handled signal during the wait: Python retries the open after its handler (PEP 475),
    which then gets the file; an alarm that raises ends the open with the handler's error."""
    data = os.urandom(16 * MiB)
    url = f"s3://{s3_bucket}/sig"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    with _through_proxy(s3_server, url, tmp_path / "r") as (proxy, r):
        held = proxy.add_rule(Rule(hold(), kind="get", path=r"/ckpt\.bin$", count=1))
        script = (
            "import signal, sys\n"
            "class Late(Exception): pass\n"
            "def alarm(*_): raise Late()\n"
            "signal.signal(signal.SIGALRM, alarm)\n"
            "signal.alarm(1)\n"
            "try:\n"
            f"    open({str(r.path / 'ckpt.bin')!r}, 'rb')\n"
            "except Late:\n"
            "    print('interrupted'); sys.exit(0)\n"
            "print('opened')\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        assert done.stdout.strip() == "interrupted", done
        held.release()
        assert (r.path / "ckpt.bin").read_bytes() == data


def test_a_body_bent_on_the_wire_is_fetched_again_and_the_file_still_lands(s3_server, s3_bucket, tmp_path):
    """Bytes checked before they land: a bent GET body (a worker's) is fetched again, and the file
    still lands whole with the store's bytes."""
    data = os.urandom(40 * MiB)
    url = f"s3://{s3_bucket}/bent"
    _written(s3_server, url, tmp_path / "w", {"ckpt.bin": data})
    with _through_proxy(s3_server, url, tmp_path / "r") as (proxy, r):
        # (the first GET: the first block, fetched alone before the others)
        rule = proxy.add_rule(Rule(corrupt_response_body(), kind="get", path=r"/ckpt\.bin$", count=1))
        assert (r.path / "ckpt.bin").read_bytes() == data
        status = r.status()
        assert rule.hits == 1 and status["integrity_retries"] >= 1
        assert status["integrity_errors"] == []
        assert status["passthrough"]["whole_fetches"] == 1
