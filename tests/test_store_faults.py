"""End to end under store faults: a real mount whose S3 endpoint is a fault-injecting proxy
(tests/support/faultproxy.py) in front of the real Swift s3api server. The store is always checked
through the real endpoint, never through the proxy."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from tests.support.faultproxy import (
    Rule,
    blackhole,
    corrupt_request_body,
    delay,
    drop_response,
    reset_mid_body,
    status,
)
from tests.support.harness import write_files
from tests.support.mounting import ckptfs

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(180)]

PREFIX = "run"
MiB = 1 << 20


@pytest.fixture
def store(proxied_store):
    """s3://bucket/run: mounts reach it through the fault proxy, the test reads it straight from
    the real endpoint."""
    return proxied_store


@pytest.fixture
def mount(mount_factory):
    """A started mount of s3://bucket/run whose endpoint is the proxy."""
    return mount_factory("m").start()


def test_slowdown_on_first_puts_and_parts_is_retried(proxy, store, mount):
    slow_down = status(503, "SlowDown", "Please reduce your request rate.")
    # botocore retries a call 3 times by itself (invisible to ckptfs); 4 in a row reach ckptfs's own retry
    rules = [
        proxy.add_rule(Rule(slow_down, kind="upload_part", query="partNumber=1", count=4)),
        proxy.add_rule(Rule(slow_down, kind="put", path=r"/small\.bin$", count=4)),
        proxy.add_rule(Rule(slow_down, kind=("upload_part", "put"), count=8)),
    ]
    files = {"big.bin": os.urandom(40 * MiB), "small.bin": os.urandom(3000)}
    write_files(mount.path, files)
    mount.sync(timeout=120)
    assert [r.hits for r in rules] == [4, 4, 8]
    assert proxy.count(kind="upload_part") >= 5 + 4  # 5 parts, some sent again
    store.assert_holds(files)
    errors = mount.status()["errors"]
    for key in files:
        assert any(e["key"] == key and "SlowDown" in e["message"] for e in errors), errors


def test_resets_and_lost_answers_on_parts_and_completion(proxy, store, mount):
    rules = [
        proxy.add_rule(Rule(reset_mid_body(), kind="upload_part", count=2)),  # server never gets the part
        proxy.add_rule(
            Rule(drop_response(), kind="upload_part", count=2)
        ),  # server has it, client never hears
        # 4 in a row outlast botocore's own retries: ckptfs's retry then finds the upload completed
        proxy.add_rule(Rule(drop_response(), kind="complete_multipart", path=r"/a\.bin$", count=4)),
        proxy.add_rule(Rule(reset_mid_body(), kind="complete_multipart", path=r"/b\.bin$", count=1)),
        proxy.add_rule(Rule(drop_response(), kind="put", count=1)),
    ]
    files = {"a.bin": os.urandom(20 * MiB + 5), "b.bin": os.urandom(17 * MiB), "c.txt": b"small" * 100}
    write_files(mount.path, files)
    mount.sync(timeout=120)
    assert [r.hits for r in rules] == [2, 2, 4, 1, 1]
    store.assert_holds(files)
    assert store.multipart_uploads() == []
    assert any(e["key"] == "a.bin" for e in mount.status()["errors"])  # ckptfs's own retry was needed
    assert (mount.path / "a.bin").read_bytes() == files["a.bin"]


def test_store_down_keeps_writes_and_cached_reads_working(s3_server, proxy, store, mount):
    before = os.urandom(12 * MiB)
    (mount.path / "before.bin").write_bytes(before)
    mount.sync()
    outage_s = 20
    rule = proxy.add_rule(Rule(blackhole(), for_s=outage_s))  # every request: accepted, never answered
    outage_ends = time.monotonic() + outage_s
    during = os.urandom(20 * MiB)
    with open(mount.path / "during.bin", "wb") as f:
        f.write(during)
    closed = time.monotonic()
    (mount.path / "latest").write_text("during.bin")
    assert (mount.path / "before.bin").read_bytes() == before  # from the cache
    assert (mount.path / "during.bin").read_bytes() == during
    assert sorted(os.listdir(mount.path)) == ["before.bin", "during.bin", "latest"]
    failed = ckptfs("sync", str(mount.path), "--timeout", "5", check=False, timeout=60)
    checked = time.monotonic()
    assert closed < outage_ends, "close() waited for the store"
    assert checked < outage_ends, "the checks outlasted the outage: lengthen it"
    assert proxy.count() > 0 and rule.hits > 0  # the daemon did try the store meanwhile
    assert failed.returncode != 0
    message = failed.stderr.strip()
    assert message.startswith("ckptfs: ") and "\n" not in message, failed.stderr
    assert mount.status()["pending"]["files"] >= 2
    proxy.remove_rule(rule)  # the store is back
    mount.sync(timeout=120)
    store.assert_holds({"before.bin": before, "during.bin": during, "latest": b"during.bin"})
    assert store.multipart_uploads() == []


def test_ordered_publish_under_a_slow_completion(proxy, store, mount):
    rule = proxy.add_rule(Rule(delay(4), kind="complete_multipart", path=r"/ckpt/shard-0\.bin$", count=1))
    files = {
        "ckpt/shard-0.bin": os.urandom(24 * MiB),
        "ckpt/shard-1.bin": os.urandom(16 * MiB),
        "ckpt/shard-2.bin": os.urandom(200_000),
        "latest": b"ckpt\n",
    }
    order = list(files)
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), store.sizes()))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        write_files(mount.path, files)  # in this order: `latest` is committed last
        committed = time.monotonic()
        mount.sync(timeout=120)
    finally:
        stop.set()
        sampler.join()
    assert rule.hits == 1
    assert len(samples) > 20
    for _, seen in samples:
        present = [key in seen for key in order]
        assert present == sorted(present, reverse=True), f"published out of order: {sorted(seen)}"
        for key in seen:
            assert seen[key] == len(files[key]), f"{key} listed with {seen[key]} bytes"
    held_back = [seen for t, seen in samples if t > committed and "latest" not in seen]
    assert held_back, "no sample while everything was committed and the first file held back"
    store.assert_holds(files)


def test_access_denied_for_a_while_is_reported_without_secrets(s3_server, proxy, store, mount):
    rule = proxy.add_rule(
        Rule(
            status(403, "AccessDenied", "Access Denied."),
            method="PUT",
            path=rf"/{PREFIX}/denied\.bin$",
            for_s=10,
        )
    )
    data = os.urandom(50_000)
    (mount.path / "denied.bin").write_bytes(data)
    deadline = time.monotonic() + 8
    reported = []
    while not reported and time.monotonic() < deadline:
        st = mount.status()
        reported = [e for e in st["errors"] if e["key"] == "denied.bin"]
        time.sleep(0.2)
    assert reported, "status never showed the error"
    assert "denied" in reported[0]["message"].lower() and "AccessDenied" in reported[0]["message"]
    assert st["pending"]["files"] == 1
    mount.sync(timeout=120)  # once the rule lapses, the retries get through
    assert rule.hits >= 1
    store.assert_holds({"denied.bin": data})
    log = (mount.cache_dir / "ckptfs.log").read_text()
    lines = [line for line in log.splitlines() if "denied.bin" in line]
    assert len(lines) == 1 and "AccessDenied" in lines[0], lines  # logged once per key and reason
    signatures = {
        m[1]
        for r in proxy.requests
        if (m := re.search(r"Signature=([0-9a-f]+)", r.headers.get("authorization", "")))
    }
    assert signatures
    status_text = json.dumps(mount.status())
    for text in (log, status_text):
        assert s3_server.secret_key not in text
        assert not any(sig in text for sig in signatures)
        assert "AWS4-HMAC-SHA256" not in text and "Credential=" not in text


def test_corrupted_part_on_the_wire_is_caught_and_sent_again(proxy, store, mount):
    rule = proxy.add_rule(Rule(corrupt_request_body(), kind="upload_part", query="partNumber=2", count=1))
    files = {"model.bin": os.urandom(30 * MiB)}
    write_files(mount.path, files)
    mount.sync(timeout=120)
    assert rule.hits == 1
    store.assert_holds(files)
    assert store.multipart_uploads() == []
    # Who caught it: not a ckptfs part checksum (none is sent) but SigV4: botocore signs each part's
    # SHA-256 (x-amz-content-sha256) and the server refuses the bent part (Swift: BadDigest; Ceph
    # RGW: XAmzContentSHA256Mismatch); ckptfs sends it again.
    parts = [r for r in proxy.requests if r.kind == "upload_part"]
    assert all(re.fullmatch(r"[0-9a-f]{64}", r.headers.get("x-amz-content-sha256", "")) for r in parts)
    assert [r.status for r in parts if r.action == "corrupt_request_body"] == [400]
    errors = mount.status()["errors"]
    refused = ("BadDigest", "XAmzContentSHA256Mismatch")
    assert any(e["key"] == "model.bin" and any(r in e["message"] for r in refused) for e in errors), errors


@pytest.fixture
def cold(mount, mount_factory):
    """(a fresh mount through the proxy with an empty cache, the bytes of its 20 MiB ckpt.bin)."""
    data = os.urandom(20 * MiB)
    (mount.path / "ckpt.bin").write_bytes(data)
    mount.stop()  # drains
    return mount_factory("fresh").start(), data


def test_reset_mid_download_of_a_read_ahead_block_keeps_the_mount(proxy, cold):
    fresh, data = cold
    rule = proxy.add_rule(
        Rule(reset_mid_body(), kind="get", headers={"range": rf"^bytes={8 * MiB}-"}, count=1)
    )
    got = (fresh.path / "ckpt.bin").read_bytes()
    assert rule.hits == 1
    assert got == data
    assert fresh.status()["fetched_bytes"] >= len(data)
    assert "Traceback" not in (fresh.cache_dir / "ckptfs.log").read_text()  # a store error, not a crash


def test_cold_read_survives_resets_mid_download(proxy, cold):
    fresh, data = cold
    rule = proxy.add_rule(Rule(reset_mid_body(), kind="get", headers={"range": r"^bytes=0-"}, count=2))
    assert (fresh.path / "ckpt.bin").read_bytes() == data
    assert rule.hits == 2
    assert fresh.status()["pid"] == fresh.pid
