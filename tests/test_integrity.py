"""Every byte checked end to end (issue 15): real mounts on the real Swift s3api server, some of
them through the fault proxy (tests/support/faultproxy.py) that flips bytes in GET response bodies or in
part uploads. The store is checked and damaged straight through the real endpoint (boto3)."""

from __future__ import annotations

import errno
import os

import pytest
import xxhash

from ckptfs.objects.integrity import Checksums, IntegrityError, manifest_key
from tests.support.faultproxy import Rule, corrupt_request_body, corrupt_response_body
from tests.support.mounting import ckptfs

pytestmark = pytest.mark.timeout(240)

PREFIX = "run"
MiB = 1 << 20


def files() -> dict[str, bytes]:
    return {
        "big.bin": os.urandom(24 * MiB + 5),  # written in one go: streamed, 4 parts, a manifest
        "small.bin": os.urandom(3 * MiB),  # one PUT: its xxh3 is in the object's metadata
    }


def save(s3_mounts, root, endpoint: str, data: dict[str, bytes]) -> None:
    """Write the files through a mount of their own and unmount (drains the uploads)."""
    m = s3_mounts(root, endpoint, "--log-level", "debug")
    for name, body in data.items():
        (m.path / name).write_bytes(body)
    m.stop()


def read_or_errno(path) -> bytes | int:
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc.errno


def manifests(client, bucket: str) -> dict[str, bytes]:
    prefix = f"{PREFIX}/.ckptfs-manifest/"
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) :]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def assert_matches_its_manifest(client, bucket: str, key: str) -> Checksums:
    obj = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{key}")
    data, meta = obj["Body"].read(), obj["Metadata"]
    raw = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{manifest_key(meta['ckptfs-upload'])}")[
        "Body"
    ].read()
    checks = Checksums.from_manifest(raw, len(data))
    checks.check(0, data)
    assert checks.xxh3 == xxhash.xxh3_64_hexdigest(data)
    return checks


def test_flipped_bytes_in_get_bodies_are_fetched_again_on_another_mount(
    s3_server, s3_bucket, proxy, client, s3_mounts, tmp_path
):
    """A cold read on a mount that did not write the files (the checksums come from the store:
    the manifest, the metadata): each GET whose body was bent is fetched again; right bytes."""
    data = files()
    save(s3_mounts, tmp_path / "w", s3_server.endpoint, data)
    assert len(manifests(client, s3_bucket)) == 1  # big.bin's; small.bin carries its xxh3 itself
    r = s3_mounts(tmp_path / "r", proxy.url)
    rules = {
        name: proxy.add_rule(Rule(corrupt_response_body(), kind="get", path=rf"/{name}$", count=2))
        for name in data
    }
    rules["manifest"] = proxy.add_rule(
        Rule(corrupt_response_body(), kind="get", path=r"/\.ckptfs-manifest/", count=1)
    )
    for name, body in data.items():
        assert (r.path / name).read_bytes() == body
    assert [rule.hits for rule in rules.values()] == [2, 2, 1]
    status = r.status()
    assert status["integrity_errors"] == []
    # Each bent body is fetched again (a bent block whose manifest came bent in the same round
    # is one retry for both).
    assert 2 + 2 <= status["integrity_retries"] <= 2 + 2 + 1
    for name, body in data.items():
        assert os.getxattr(r.path / name, "user.ckptfs.verified") == b"yes"
        assert os.getxattr(r.path / name, "user.ckptfs.xxh3") == xxhash.xxh3_64_hexdigest(body).encode()


def test_flipped_bytes_in_get_bodies_are_fetched_again_on_the_writing_mount(proxy, s3_mounts, tmp_path):
    """The mount that wrote the files reads back what its small cache evicted: checked against
    the checksums it recorded at upload."""
    m = s3_mounts(tmp_path / "w", proxy.url, ram_cache="16MiB", cache_size="32MiB")
    data = {"big.bin": os.urandom(64 * MiB), "small.bin": os.urandom(3 * MiB)}
    for name, body in data.items():
        (m.path / name).write_bytes(body)
    m.sync(timeout=120)
    rule = proxy.add_rule(Rule(corrupt_response_body(), kind="get", path=r"/big\.bin$", count=2))
    assert (m.path / "big.bin").read_bytes() == data["big.bin"]  # 64 MiB through a 48 MiB cache: fetched
    assert rule.hits == 2
    status = m.status()
    assert status["integrity_retries"] == 2 and status["integrity_errors"] == []
    assert status["fetched_bytes"] >= 16 * MiB


def test_every_get_body_bent_fails_the_read_with_eio_never_wrong_bytes(
    s3_server, s3_bucket, proxy, client, s3_mounts, tmp_path
):
    data = files()
    save(s3_mounts, tmp_path / "w", s3_server.endpoint, data)
    r = s3_mounts(tmp_path / "r", proxy.url)
    rule = proxy.add_rule(Rule(corrupt_response_body(), kind="get", path=r"\.bin$"))
    for name in data:
        assert read_or_errno(r.path / name) == errno.EIO
    errors = r.status()["integrity_errors"]
    assert {e["key"] for e in errors} == set(data)
    assert all(e["message"].startswith("part ") and "recorded" in e["message"] for e in errors), errors
    shown = ckptfs("status", str(r.path)).stdout
    assert "integrity errors: " in shown and "big.bin: part " in shown and "small.bin: part 1 " in shown
    proxy.remove_rule(rule)  # the wire heals: nothing bad was cached, the same reads now succeed
    for name, body in data.items():
        assert (r.path / name).read_bytes() == body


def test_an_object_damaged_in_the_store_reads_as_eio(s3_server, s3_bucket, client, s3_mounts, tmp_path):
    """Bytes changed in the store behind ckptfs's back (metadata and manifest kept): EIO, logged,
    in status; never the damaged bytes."""
    data = files()
    save(s3_mounts, tmp_path / "w", s3_server.endpoint, data)
    for name, body in data.items():
        key = f"{PREFIX}/{name}"
        meta = client.head_object(Bucket=s3_bucket, Key=key)["Metadata"]
        bent = bytearray(body)
        bent[len(bent) // 3] ^= 0x01
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(bent), Metadata=meta)
    r = s3_mounts(tmp_path / "r", s3_server.endpoint)
    for name in data:
        assert read_or_errno(r.path / name) == errno.EIO
        assert os.getxattr(r.path / name, "user.ckptfs.verified") == b"yes"  # it has checksums: they fail
    errors = r.status()["integrity_errors"]
    assert {e["key"] for e in errors} == set(data)
    # The damaged part only: the rest of the file reads fine.
    with open(r.path / "big.bin", "rb") as f:
        assert f.read(MiB) == data["big.bin"][:MiB]


def test_an_object_put_by_another_tool_reads_fine_and_says_unverified(
    s3_server, s3_bucket, client, s3_mounts, tmp_path
):
    foreign = {"foreign-big.bin": os.urandom(20 * MiB), "foreign-small.bin": os.urandom(1000)}
    for name, body in foreign.items():
        client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{name}", Body=body)
    r = s3_mounts(tmp_path / "r", s3_server.endpoint)
    (r.path / "ours.bin").write_bytes(b"checked" * 1000)
    r.sync()
    for name, body in foreign.items():
        assert (r.path / name).read_bytes() == body
        assert os.getxattr(r.path / name, "user.ckptfs.verified") == b"no"
        with pytest.raises(OSError) as info:
            os.getxattr(r.path / name, "user.ckptfs.xxh3")
        assert info.value.errno == errno.ENODATA
    assert os.getxattr(r.path / "ours.bin", "user.ckptfs.verified") == b"yes"
    assert b"user.ckptfs.verified" in [n.encode() for n in os.listxattr(r.path / "ours.bin")]
    status = r.status()
    assert status["unverified_reads"] >= 2 and status["integrity_errors"] == []


def test_a_part_bent_on_upload_is_sent_again_and_the_object_matches_its_manifest(
    s3_server, s3_bucket, proxy, client, s3_mounts, tmp_path
):
    """SigV4 (plain http) makes the server refuse the bent part; the manifest, written from the
    bytes before they left, matches what the store finally holds."""
    m = s3_mounts(tmp_path / "w", proxy.url)
    rule = proxy.add_rule(Rule(corrupt_request_body(), kind="upload_part", query="partNumber=2", count=1))
    body = os.urandom(30 * MiB)
    (m.path / "model.bin").write_bytes(body)
    m.sync(timeout=120)
    assert rule.hits == 1
    checks = assert_matches_its_manifest(client, s3_bucket, "model.bin")
    assert len(checks.parts) == 4 and checks.part_size == 8 * MiB


def test_rename_keeps_and_delete_removes_the_manifest(s3_server, s3_bucket, client, s3_mounts, tmp_path):
    """A rename of a durable file is a server-side copy: the copy names the same manifest. An
    overwrite removes the manifest of the object it replaced, a delete the manifest after the
    object: no manifest outlives its objects."""
    data = files()
    a = s3_mounts(tmp_path / "a", s3_server.endpoint)
    for name, body in data.items():
        (a.path / name).write_bytes(body)
    a.sync()
    os.rename(a.path / "big.bin", a.path / "moved.bin")
    a.sync()
    assert len(manifests(client, s3_bucket)) == 1
    assert_matches_its_manifest(client, s3_bucket, "moved.bin")
    b = s3_mounts(tmp_path / "b", s3_server.endpoint)
    assert (b.path / "moved.bin").read_bytes() == data["big.bin"]
    assert os.getxattr(b.path / "moved.bin", "user.ckptfs.verified") == b"yes"
    assert b.status()["unverified_reads"] == 0
    # An overwrite replaces the manifest: by the mount that knows the old one (it wrote it) ...
    (a.path / "moved.bin").write_bytes(os.urandom(17 * MiB))
    a.sync()
    assert len(manifests(client, s3_bucket)) == 1
    assert_matches_its_manifest(client, s3_bucket, "moved.bin")
    # ... and by one that never read it (it asks the store which manifest the old object names).
    c = s3_mounts(tmp_path / "c", s3_server.endpoint)
    (c.path / "moved.bin").write_bytes(os.urandom(9 * MiB))
    c.sync()
    assert len(manifests(client, s3_bucket)) == 1
    assert_matches_its_manifest(client, s3_bucket, "moved.bin")
    os.unlink(a.path / "moved.bin")
    os.unlink(a.path / "small.bin")
    a.sync()
    assert manifests(client, s3_bucket) == {}
    assert os.listdir(a.path) == []  # the reserved prefix is never shown


def test_request_cost_per_file(s3_server, s3_bucket, proxy, s3_mounts, tmp_path):
    """What the checksums cost in requests (docs/architecture.md, Integrity), counted at the proxy:
    a multipart file: one PUT (its manifest) when written, one GET (the manifest) per mount that
    reads it cold, a HEAD and a DELETE more when deleted; a one-PUT file: nothing; a rename: nothing.
    A mount: one PUT and one DELETE (the probe for S3 checksums, store/s3_client.py)."""
    data = files()
    w = s3_mounts(tmp_path / "w", proxy.url)
    probes = [req for req in proxy.requests if "checksum-probe-" in req.path]
    assert [req.kind for req in probes] == ["put", "delete"]
    proxy.reset_counts()
    for name, body in data.items():
        (w.path / name).write_bytes(body)
    w.sync()
    puts = [
        r for r in proxy.requests if r.kind == "put" and "manifest-sweep" not in r.path
    ]  # (the daily sweep's stamp)
    assert len(puts) == 2  # small.bin and big.bin's manifest
    assert len([r for r in proxy.requests if r.kind == "put" and "ckptfs-manifest" in r.path]) == 1
    assert proxy.count(kind="upload_part") == 4 and proxy.count(kind="complete_multipart") == 1

    proxy.reset_counts()
    r = s3_mounts(tmp_path / "r", proxy.url)
    for name, body in data.items():
        assert (r.path / name).read_bytes() == body
    gets = [req.path for req in proxy.requests if req.kind == "get"]
    assert len([p for p in gets if "ckptfs-manifest" in p]) == 1  # big.bin's, once
    assert (
        len([p for p in gets if p.endswith("/big.bin")]) == 4
        and len([p for p in gets if p.endswith("/small.bin")]) == 1
    )
    # One HEAD per file, the attribute read before its first lookup answers (docs/architecture.md,
    # "Where attributes live"); the checksums themselves cost none.
    heads = sorted(
        req.path.rsplit("/", 1)[1]
        for req in proxy.requests
        if req.kind == "head" and req.path.endswith(".bin")
    )
    assert heads == ["big.bin", "small.bin"], heads

    proxy.reset_counts()
    os.rename(w.path / "big.bin", w.path / "moved.bin")
    w.sync()
    assert proxy.count(kind="copy") == 1 and proxy.count(kind="delete") == 1
    assert [r for r in proxy.requests if r.kind == "put" and "manifest-sweep" not in r.path] == []

    proxy.reset_counts()
    os.unlink(w.path / "moved.bin")
    os.unlink(w.path / "small.bin")
    w.sync()
    heads = [req.path for req in proxy.requests if req.kind == "head" and req.path.endswith(".bin")]
    assert heads == [
        f"/{s3_bucket}/{PREFIX}/moved.bin"
    ]  # (small.bin is known to be too small for a manifest)
    deletes = [req.path for req in proxy.requests if req.kind == "delete"]
    assert len(deletes) == 3 and len([p for p in deletes if "ckptfs-manifest" in p]) == 1


def test_checksums_cover_whole_parts():
    """Unit: which range a block's check needs, and what a check refuses."""
    part = 8
    data = bytes(range(20))
    hashes = [xxhash.xxh3_64_hexdigest(data[i : i + part]) for i in range(0, len(data), part)]
    checks = Checksums(len(data), part, hashes, xxhash.xxh3_64_hexdigest(data), "j-1", "manifest")
    assert checks.span(8, 8) == (8, 8) and checks.span(16, 4) == (16, 4)  # block = part
    assert checks.span(4, 4) == (0, 8) and checks.span(6, 4) == (0, 16)  # smaller blocks: whole parts
    checks.check(0, data)
    checks.check(16, data[16:])
    bent = bytearray(data)
    bent[9] ^= 1
    with pytest.raises(IntegrityError, match="part 2 "):
        checks.check(0, bent)
    assert Checksums.from_manifest(checks.to_manifest(), len(data)) == checks
    for raw, size in [(checks.to_manifest(), 21), (checks.to_manifest()[:-3], 20), (b"\xff{}", 20)]:
        with pytest.raises(IntegrityError):
            Checksums.from_manifest(raw, size)
    whole = Checksums.whole_file(len(data), xxhash.xxh3_64_hexdigest(data))
    assert whole.span(8, 8) == (0, 20)
    whole.check(0, data)
    assert not Checksums.unverified(20, "none").verified and Checksums.unverified(20, "none").span(8, 8) == (
        8,
        8,
    )
