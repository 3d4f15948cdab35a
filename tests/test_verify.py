"""``ckptfs verify`` (issue 18): objects read back from the real S3 server (Swift) and checked
against the checksums recorded at upload, driven as a user would (``python -m ckptfs verify``),
on a store URL and on a mountpoint. The store is damaged by hand straight through boto3."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.mounting import CKPTFS, Mount

pytestmark = pytest.mark.timeout(240)

PREFIX = "run"
MiB = 1 << 20


@pytest.fixture
def written(s3_server, s3_bucket, tmp_path):
    """A mount of s3://bucket/run that wrote and synced three files (one streamed with a manifest,
    two one-PUT with an xxh3); yields (mount, {name: bytes}); unmounted at the end."""
    m = Mount(f"s3://{s3_bucket}/{PREFIX}", tmp_path / "w", endpoint_url=s3_server.endpoint)
    data = {
        "big.bin": os.urandom(20 * MiB + 7),
        "small.bin": os.urandom(300_000),
        "step-1/shard.bin": os.urandom(2 * MiB),
    }
    try:
        m.start()
        for name, body in data.items():
            (m.path / name).parent.mkdir(exist_ok=True)
            (m.path / name).write_bytes(body)
        m.sync(timeout=120)
        yield m, data
    finally:
        m.cleanup()


def verify(*args: str) -> tuple[int, dict | None, str]:
    """Run ``ckptfs verify ARGS`` as a user would: (exit status, parsed --json output, stderr)."""
    done = subprocess.run([*CKPTFS, "verify", *args], capture_output=True, text=True, timeout=180)
    out = json.loads(done.stdout) if "--json" in args and done.stdout.strip() else None
    return done.returncode, out, done.stderr


def states(out: dict) -> dict[str, str]:
    return {r["key"]: r["state"] for r in out["files"]}


def url_args(s3_server, s3_bucket) -> list[str]:
    return [f"s3://{s3_bucket}/{PREFIX}", "--endpoint-url", s3_server.endpoint]


def test_verify_a_clean_store_by_url_and_by_mountpoint(s3_server, s3_bucket, written):
    m, data = written
    rc, out, err = verify(*url_args(s3_server, s3_bucket), "--json")
    assert rc == 0, err
    assert states(out) == {name: "ok" for name in data}
    assert out["total_bytes"] == sum(len(b) for b in data.values()) and out["ok"] is True
    assert "3 parts (manifest)" in {r["key"]: r["detail"] for r in out["files"]}["big.bin"]
    rc, out, err = verify(str(m.path), "--json")
    assert rc == 0, err
    assert states(out) == {name: "ok" for name in data}
    # PATHs on the mount: a directory, and a file given by its path.
    rc, out, err = verify(str(m.path), str(m.path / "step-1"), str(m.path / "small.bin"), "--json")
    assert rc == 0, err
    assert states(out) == {"step-1/shard.bin": "ok", "small.bin": "ok"}
    # Human output: nothing to list, a summary on stderr.
    rc, _, err = verify(str(m.path))
    assert rc == 0 and "verified 3 objects" in err and "3 ok" in err


def test_verify_finds_objects_damaged_in_the_store(s3_server, s3_bucket, client, written):
    """Bytes changed behind ckptfs's back, metadata kept: a part of a manifest object and a
    one-PUT file; verify names both and exits 1. A missing manifest fails too."""
    m, data = written
    for name in ("big.bin", "small.bin"):
        key = f"{PREFIX}/{name}"
        meta = client.head_object(Bucket=s3_bucket, Key=key)["Metadata"]
        bent = bytearray(data[name])
        bent[len(bent) // 2] ^= 0x01
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(bent), Metadata=meta)
    rc, out, _ = verify(*url_args(s3_server, s3_bucket), "--json")
    assert rc == 1
    assert states(out) == {"big.bin": "mismatch", "small.bin": "mismatch", "step-1/shard.bin": "ok"}
    detail = {r["key"]: r["detail"] for r in out["files"]}
    assert "part 2 " in detail["big.bin"]  # the middle of 20 MiB: the second 8 MiB part
    # Human output, through the mount's daemon: a line per failed object on stdout.
    done = subprocess.run([*CKPTFS, "verify", str(m.path)], capture_output=True, text=True, timeout=180)
    lines = done.stdout.splitlines()
    assert done.returncode == 1
    assert any(line.startswith("MISMATCH") and "big.bin" in line for line in lines)
    assert any(line.startswith("MISMATCH") and "small.bin" in line for line in lines)
    # The manifest of big.bin gone: the mount would refuse to read it; verify fails it.
    upload = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/big.bin")["Metadata"]["ckptfs-upload"]
    client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/.ckptfs-manifest/{upload}")
    rc, out, _ = verify(*url_args(s3_server, s3_bucket), "big.bin", "--json")
    assert rc == 1 and states(out) == {"big.bin": "missing-manifest"}


def test_a_deleted_object_named_in_path_is_missing(s3_server, s3_bucket, client, written):
    client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/small.bin")
    rc, out, _ = verify(*url_args(s3_server, s3_bucket), "small.bin", "step-1", "--json")
    assert rc == 1
    assert states(out) == {"small.bin": "missing", "step-1/shard.bin": "ok"}
    rc, out, _ = verify(*url_args(s3_server, s3_bucket), "no/such/dir", "--json")
    assert rc == 1 and states(out) == {"no/such/dir": "missing"}


def test_an_object_put_by_another_tool_is_unverified_not_failed(s3_server, s3_bucket, client, written):
    client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/foreign.bin", Body=os.urandom(5000))
    rc, out, err = verify(*url_args(s3_server, s3_bucket), "--json")
    assert rc == 0, err
    assert states(out)["foreign.bin"] == "unverified" and out["counts"] == {"ok": 3, "unverified": 1}
    rc, out, _ = verify(*url_args(s3_server, s3_bucket), "foreign.bin", "--strict", "--json")
    assert rc == 1 and states(out) == {"foreign.bin": "unverified"}
    done = subprocess.run(
        [*CKPTFS, "verify", *url_args(s3_server, s3_bucket)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and "UNVERIFIED" in done.stdout and "foreign.bin" in done.stdout


def test_verify_errors_are_one_line_and_nonzero(s3_server, s3_bucket, written, tmp_path):
    m, _ = written
    cases = [
        [str(tmp_path)],  # a directory that is not a ckptfs mount
        [str(m.path), str(tmp_path)],  # a PATH outside the mount
        ["bogus://bucket"],  # a bad URL
        [f"s3://no-such-bucket-{os.getpid()}", "--endpoint-url", s3_server.endpoint],  # a missing bucket
        [f"s3://{s3_bucket}", "--endpoint-url", "not a url"],
        [str(m.path), "--endpoint-url", s3_server.endpoint],  # a mount uses its own store
    ]
    for args in cases:
        rc, _, err = verify(*args)
        assert rc != 0, args
        assert err.startswith("ckptfs: ") and len(err.strip().splitlines()) == 1, (args, err)
        assert "Traceback" not in err


def test_verify_reads_in_parallel_with_a_bound(s3_server, s3_bucket, written):
    """--jobs bounds the part reads; any value gives the same answer."""
    rc, out, err = verify(*url_args(s3_server, s3_bucket), "--jobs", "1", "--json")
    assert rc == 0, err
    assert set(states(out).values()) == {"ok"}
    rc, _, err = verify(*url_args(s3_server, s3_bucket), "--jobs", "0")
    assert rc == 2 and err.startswith("ckptfs: ")


def test_verify_reads_compressed_objects_through_their_frames(s3_server, s3_bucket, client, tmp_path):
    """Objects a --compress mount stored as zstd frames (byte-grouped floats, a one-PUT text file)
    verify ok by URL and by mountpoint: each part's frame is decoded and checked against the
    xxh3 of the uncompressed bytes. A frame damaged in the store is a mismatch."""
    import numpy

    floats = numpy.linspace(0, 1, (20 * MiB) // 4, dtype=numpy.float32).tobytes()  # 3 parts, grouped
    text = b"step 1 loss 0.5\n" * 40_000
    m = Mount(
        f"s3://{s3_bucket}/{PREFIX}",
        tmp_path / "c",
        endpoint_url=s3_server.endpoint,
        extra=("--compress", "zstd"),
    )
    try:
        m.start()
        (m.path / "weights.bin").write_bytes(floats)
        (m.path / "train.log").write_bytes(text)
        m.sync(timeout=120)
        stored = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/weights.bin")["ContentLength"]
        assert stored < len(floats)  # (really compressed: else this test proves nothing new)
        for target in (url_args(s3_server, s3_bucket), [str(m.path)]):
            rc, out, err = verify(*target, "--json")
            assert rc == 0, err
            assert states(out) == {"weights.bin": "ok", "train.log": "ok"}
            assert out["total_bytes"] == len(floats) + len(text)
        # One byte of the second frame changed in the store, metadata kept.
        obj = client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/weights.bin")
        body, meta = bytearray(obj["Body"].read()), obj["Metadata"]
        body[len(body) // 2] ^= 0xFF
        client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/weights.bin", Body=bytes(body), Metadata=meta)
        rc, out, err = verify(*url_args(s3_server, s3_bucket), "--json")
        assert rc == 1
        assert states(out) == {"weights.bin": "mismatch", "train.log": "ok"}
    finally:
        m.cleanup()


def test_verify_keeps_off_the_default_thread_limiter(tmp_path):
    # In the daemon, trio's default limiter (40 threads) carries the journal's fsync and the cache's
    # copies: an admin's verify (up to 256 jobs) must use threads of its own, or a save waits on it.
    import trio

    from ckptfs.admin import verify as verify_mod
    from ckptfs.store.local import LocalStore

    store = LocalStore.at(tmp_path / "store")
    for n in range(64):
        store.put(f"step-1/shard-{n}.pt", b"x" * 1000)
    most = 0

    async def main():
        nonlocal most
        default = trio.to_thread.current_default_thread_limiter()
        async with trio.open_nursery() as nursery:

            async def sample():
                nonlocal most
                while True:
                    most = max(most, default.borrowed_tokens)
                    await trio.sleep(0)

            nursery.start_soon(sample)
            result = await verify_mod.run(store, [], None, jobs=16)
            nursery.cancel_scope.cancel()
        return result

    result = trio.run(main)
    assert len(result["files"]) == 64 and {f["state"] for f in result["files"]} == {"unverified"}
    assert most == 0, f"verify borrowed {most} of the default limiter's threads"
