"""Compression with the features written beside it (the orphan-manifest sweep, ls/checkpoints on a
store URL, S3 checksums): on the real S3 server (Swift), the store read straight through boto3;
CRC32C on moto behind the fault proxy that refuses a body not matching its CRC32C
(tests/test_server_checksums.py)."""

from __future__ import annotations

import json
import time

import pytest

from ckptfs.admin.catalog import _Source, ls
from ckptfs.admin.target import resolve
from ckptfs.objects import compression, integrity
from ckptfs.objects.logical_store import LogicalStore
from ckptfs.store.s3 import S3Store
from tests.support.harness import floats
from tests.support.mounting import Mount

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(240)]

PREFIX = "run"
MiB = 1 << 20


@pytest.fixture
def written(s3_server, s3_bucket, tmp_path):
    """A compressed multipart file, a compressed one-PUT file and a DCP-like metadata file,
    written through a --compress mount that is then stopped."""
    files = {
        "big.bin": floats(9 * MiB + 5, seed=1),
        "small.bin": floats(200_000, seed=2),
        "notes.json": json.dumps({"layers": list(range(5000))}).encode(),
    }
    m = Mount(
        f"s3://{s3_bucket}/{PREFIX}",
        tmp_path / "w",
        endpoint_url=s3_server.endpoint,
        extra=("--compress", "zstd"),
    )
    try:
        m.start()
        for name, body in files.items():
            (m.path / name).write_bytes(body)
        m.sync()
        status = m.status()  # the files' own bytes, and what the store received: less
        assert status["uploaded_bytes"] >= sum(map(len, files.values())) > status["stored_bytes"] > 0
        m.stop()
        yield files
    finally:
        m.cleanup()


def test_the_orphan_sweep_keeps_a_compressed_objects_manifest(s3_server, s3_bucket, written):
    """The manifest records the uncompressed size; the object's listing (on a store that is not a
    LogicalStore, or with the bucket's marker gone) gives the stored one: still not an orphan."""
    client = s3_server.client()
    meta = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/big.bin")["Metadata"]
    assert meta.get("ckptfs-format") == "zstd-seekable"
    manifest = f"{PREFIX}/{integrity.manifest_key(meta['ckptfs-upload'])}"
    later = time.time() + 2 * integrity.ORPHAN_MIN_AGE_S
    raw = S3Store.connect(s3_bucket, PREFIX, endpoint_url=s3_server.endpoint)
    logical = LogicalStore(raw)
    try:
        assert integrity.orphan_manifests(raw, later) == []
        assert integrity.orphan_manifests(logical, later) == []
        client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/{compression.MARKER_KEY}")
        assert integrity.orphan_manifests(LogicalStore(raw), later) == []  # (a mount started now)
        client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/big.bin")  # now it is one
        assert [f"{PREFIX}/{k}" for k in integrity.orphan_manifests(raw, later)] == [manifest]
    finally:
        logical.close()  # (and raw)


def test_ls_and_reads_on_a_store_url_see_uncompressed_files(s3_server, s3_bucket, written):
    client = s3_server.client()
    assert (
        client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/notes.json")["Metadata"].get("ckptfs-format")
        == "zstd-seekable"
    )
    target = resolve(f"s3://{s3_bucket}/{PREFIX}", s3_server.endpoint)
    listed = {f.path: f for f in ls(target)}
    assert {path: f.size for path, f in listed.items()} == {name: len(body) for name, body in written.items()}
    assert listed["big.bin"].checksum.startswith("xxh3"), listed["big.bin"].checksum
    with _Source(target) as source:  # what checkpoints reads (pointers, DCP .metadata) by URL
        for name, body in written.items():
            assert source.read(name, 1 << 30) == body, name
        assert source.read("notes.json", 100) == written["notes.json"][:100]


def test_crc32c_covers_the_frames_padding_and_seek_table_sent(verifying, tmp_path):
    """Where the server verifies CRC32C, a compressed upload's parts (frames padded to S3's
    smallest part, the last followed by the seek table) and a compressed one-PUT file each carry
    the CRC32C of the bytes actually sent: none is refused, and the files read back."""
    proxy, client, bucket = verifying
    files = {"big.bin": floats(17 * MiB + 3, seed=3), "small.bin": floats(300_000, seed=4)}
    m = Mount(f"s3://{bucket}/run", tmp_path / "w", endpoint_url=proxy.url, extra=("--compress", "zstd"))
    fresh = Mount(f"s3://{bucket}/run", tmp_path / "r", endpoint_url=proxy.url)
    try:
        m.start()
        assert m.status()["server_checksums"] is True
        refused = proxy.refused_checksums  # (the probe at mount)
        for name, body in files.items():
            (m.path / name).write_bytes(body)
        m.sync(timeout=120)
        assert proxy.refused_checksums == refused
        for name, body in files.items():
            head = client.head_object(Bucket=bucket, Key=f"run/{name}", ChecksumMode="ENABLED")
            assert head["Metadata"].get("ckptfs-format") == "zstd-seekable" and head["ContentLength"] < len(
                body
            )
            assert head.get("ChecksumCRC32C"), name
        parts_sent = [r for r in proxy.requests if r.kind == "upload_part"]
        assert len(parts_sent) >= 3 and all("x-amz-checksum-crc32c" in r.headers for r in parts_sent)
        m.stop()
        fresh.start()
        for name, body in files.items():
            assert (fresh.path / name).read_bytes() == body, name
    finally:
        m.cleanup()
        fresh.cleanup()
