"""S3's own checksums (issue 15): where the server verifies ``x-amz-checksum-crc32c``, every part
and one-PUT file carries its CRC32C and a part damaged on the way is refused and sent again; where
it does not (Swift here), detection says so at mount and nothing changes.

No server installed here verifies them: Swift 2.30 ignores the header and moto 5.2 stores it
without checking it (``test_moto_stores_a_wrong_crc32c``). The positive path runs on moto behind
the fault proxy with ``verify_checksums`` on, which refuses a body that does not match its CRC32C
exactly as AWS S3 does (400 BadDigest); the bytes go on to moto, which keeps the checksums."""

from __future__ import annotations

import os

import pytest

from ckptfs.store.base import PartInfo
from ckptfs.store.s3 import S3Store
from ckptfs.store.s3_client import PROBE_PREFIX, crc32c_b64
from tests.support.faultproxy import Rule, corrupt_request_body, delay, status
from tests.support.mounting import Mount

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20


@pytest.fixture
def mounts():
    made: list[Mount] = []

    def make(url: str, root, endpoint: str) -> Mount:
        m = Mount(url, root, endpoint_url=endpoint)
        made.append(m)
        return m.start()

    yield make
    for m in made:
        m.cleanup()


def _reserved_keys(client, bucket: str) -> list[str]:
    answer = client.list_objects_v2(Bucket=bucket, Prefix="run/" + PROBE_PREFIX)
    return [o["Key"] for o in answer.get("Contents", [])]


def test_moto_stores_a_wrong_crc32c(moto):
    """Why the proxy plays the verifying server: moto accepts a wrong checksum, and detection
    (a probe with a wrong CRC32C) therefore says this server does not verify."""
    endpoint, client, bucket = moto
    client.put_object(Bucket=bucket, Key="x", Body=b"abc", ChecksumCRC32C=crc32c_b64(b"abd"))
    store = S3Store.connect(bucket, "run", endpoint_url=endpoint)
    assert store.detect_server_checksums() is False and store.server_checksums is False
    assert _reserved_keys(client, bucket) == []  # the probe was deleted


def test_detection_finds_a_verifying_server_and_leaves_no_probe(verifying):
    proxy, client, bucket = verifying
    store = S3Store.connect(bucket, "run", endpoint_url=proxy.url)
    assert store.detect_server_checksums() is True
    assert proxy.refused_checksums == 1  # the deliberately wrong probe
    assert _reserved_keys(client, bucket) == []


def test_a_part_damaged_on_the_way_is_refused_by_the_server_and_sent_again(verifying, mounts, tmp_path):
    proxy, client, bucket = verifying
    m = mounts(f"s3://{bucket}/run", tmp_path / "w", proxy.url)
    assert m.status()["server_checksums"] is True
    refused = proxy.refused_checksums  # (the probe at mount)
    bent_part = proxy.add_rule(
        Rule(corrupt_request_body(), kind="upload_part", query="partNumber=2", count=1)
    )
    bent_put = proxy.add_rule(Rule(corrupt_request_body(), kind="put", path="/small.bin", count=1))
    big, small = os.urandom(20 * MiB + 3), os.urandom(1 * MiB)
    (m.path / "big.bin").write_bytes(big)
    (m.path / "small.bin").write_bytes(small)
    m.sync(timeout=120)
    assert bent_part.hits == 1 and bent_put.hits == 1
    assert proxy.refused_checksums == refused + 2  # both refused by the "server", then sent again
    # What the server keeps is right, and carries S3's own checksums.
    assert client.get_object(Bucket=bucket, Key="run/big.bin")["Body"].read() == big
    assert client.get_object(Bucket=bucket, Key="run/small.bin")["Body"].read() == small
    head = client.head_object(Bucket=bucket, Key="run/small.bin", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == crc32c_b64(small)
    head = client.head_object(Bucket=bucket, Key="run/big.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C")  # composite: the CRC32C of the part CRC32Cs, "-3"
    parts_sent = [r for r in proxy.requests if r.kind == "upload_part"]
    assert parts_sent and all("x-amz-checksum-crc32c" in r.headers for r in parts_sent)
    # The CRC32C the server verifies protects those bodies: no SHA-256 payload signature on them.
    with_bodies = parts_sent + [
        r
        for r in proxy.requests
        if r.kind == "put" and "x-amz-checksum-crc32c" in r.headers and "checksum-probe" not in r.path
    ]  # (the probe at mount: signed, 55 bytes)
    assert {r.headers.get("x-amz-content-sha256") for r in with_bodies} == {"UNSIGNED-PAYLOAD"}
    # A fresh mount (empty cache) reads both back equal.
    m.stop()
    fresh = mounts(f"s3://{bucket}/run", tmp_path / "r", proxy.url)
    assert (fresh.path / "big.bin").read_bytes() == big
    assert (fresh.path / "small.bin").read_bytes() == small


def test_swift_does_not_verify_so_no_checksum_headers_are_sent(s3_server, s3_bucket, proxy, mounts, tmp_path):
    """The fallback: detection says unsupported, uploads work as before, no x-amz-checksum header."""
    m = mounts(f"s3://{s3_bucket}/run", tmp_path / "w", proxy.url)
    assert m.status()["server_checksums"] is False
    tagged = proxy.add_rule(Rule(delay(0), headers={"x-amz-checksum-crc32c": "."}))
    big, small = os.urandom(17 * MiB), os.urandom(100_000)
    (m.path / "big.bin").write_bytes(big)
    (m.path / "small.bin").write_bytes(small)
    m.sync(timeout=120)
    assert tagged.hits == 0
    assert proxy.count(kind="upload_part") >= 3 and proxy.count(kind="put") >= 1
    # Nothing else protects the bodies on the way over plain http: each is signed (SHA-256).
    bodies = [r for r in proxy.requests if r.kind in ("upload_part", "put")]
    assert all(len(r.headers.get("x-amz-content-sha256", "")) == 64 for r in bodies)
    assert _reserved_keys(s3_server.client(), s3_bucket) == []  # the probe was deleted
    m.stop()
    fresh = mounts(f"s3://{s3_bucket}/run", tmp_path / "r", proxy.url)
    assert (fresh.path / "big.bin").read_bytes() == big
    assert (fresh.path / "small.bin").read_bytes() == small


def test_a_server_that_refuses_checksums_on_multipart_uploads_gets_them_without(verifying, mounts, tmp_path):
    """Verifies a PUT's CRC32C but answers 400 to ChecksumAlgorithm on CreateMultipartUpload:
    the upload is created again without it, and later ones go without it at once."""
    proxy, client, bucket = verifying
    m = mounts(f"s3://{bucket}/run", tmp_path / "w", proxy.url)
    refusal = proxy.add_rule(
        Rule(
            status(400, "InvalidArgument"),
            kind="create_multipart",
            headers={"x-amz-checksum-algorithm": "CRC32C"},
        )
    )
    first, second = os.urandom(18 * MiB), os.urandom(17 * MiB)
    (m.path / "first.bin").write_bytes(first)
    m.sync(timeout=120)
    (m.path / "second.bin").write_bytes(second)
    m.sync(timeout=120)
    assert refusal.hits == 1
    assert client.get_object(Bucket=bucket, Key="run/first.bin")["Body"].read() == first
    assert client.get_object(Bucket=bucket, Key="run/second.bin")["Body"].read() == second
    assert not any("x-amz-checksum-crc32c" in r.headers for r in proxy.requests if r.kind == "upload_part")


def test_an_upload_resumed_by_another_process_keeps_its_checksums(verifying):
    """A restart resumes an upload created with CRC32C: the new process learns that from the
    list of unfinished uploads, sends the CRC32C of the parts it uploads, and completes with the
    checksums of all parts (those sent before the restart come back in their journaled tokens)."""
    proxy, client, bucket = verifying
    before = S3Store.connect(bucket, "run", endpoint_url=proxy.url)
    assert before.detect_server_checksums()
    one, two = os.urandom(5 * MiB), os.urandom(1 * MiB)
    upload = before.create_multipart("resumed.bin")
    sent = before.upload_part("resumed.bin", upload, 1, one)
    assert sent.token.endswith(" " + crc32c_b64(one))
    after = S3Store.connect(bucket, "run", endpoint_url=proxy.url)  # the process after the restart
    assert after.detect_server_checksums()
    proxy.reset_counts()
    second = after.upload_part("resumed.bin", upload, 2, two)
    assert second.token.endswith(" " + crc32c_b64(two))
    parts = [r for r in proxy.requests if r.kind == "upload_part"]
    assert len(parts) == 1 and "x-amz-checksum-crc32c" in parts[0].headers
    after.complete_multipart("resumed.bin", upload, [PartInfo(1, sent.token), second])
    assert client.get_object(Bucket=bucket, Key="run/resumed.bin")["Body"].read() == one + two
    lists = [r for r in proxy.requests if r.kind == "list" and "uploads" in r.query]
    assert len(lists) == 1  # ListMultipartUploads, once, to learn the upload's algorithm
    assert client.head_object(Bucket=bucket, Key="run/resumed.bin", ChecksumMode="ENABLED").get(
        "ChecksumCRC32C"
    )
