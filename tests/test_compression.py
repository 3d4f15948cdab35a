"""Opt-in compression (issue 15, compression half): the zstd seekable format (unit tests of the
codec in ckptfs/compression.py), then real mounts on the real Swift s3api server, some through
the fault proxy (tests/support/faultproxy.py) to count and bend requests; the store is read and damaged
straight through the real endpoint (boto3)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import zlib

import numpy
import pytest
import zstandard

from ckptfs.objects import compression
from ckptfs.objects.integrity import Checksums, manifest_key
from tests.support.faultproxy import Rule, corrupt_response_body
from tests.support.harness import floats

pytestmark = pytest.mark.timeout(240)

PREFIX = "run"
MiB = 1 << 20
PART = 8 * MiB


def zstd_cli_decompress(data: bytes) -> bytes:
    """``zstd -d`` where the CLI is installed, else python zstandard reading every frame."""
    if shutil.which("zstd"):
        return subprocess.run(["zstd", "-d", "-c", "-q"], input=data, capture_output=True, check=True).stdout
    return zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()


# -- the codec ---------------------------------------------------------------------------------------
def test_grouping_round_trips_and_is_chosen_for_floats():
    codec = compression.Codec(3)
    for by in (1, 2, 4):
        for data in (b"", b"abc", bytes(range(256)) * 3 + b"x"):
            assert compression.ungroup(compression.group(data, by), by) == data
    assert codec.choose_group(floats(MiB)) == 4  # fp32: grouped by 4 wins
    bf16 = floats(MiB, numpy.float32)[::1]
    halves = numpy.frombuffer(bf16, numpy.uint16)[1::2].tobytes()  # the high halves: bf16
    assert codec.choose_group(halves) in (2, 4)  # bf16: the high bytes together (by 4 does that too)
    assert codec.choose_group(os.urandom(MiB)) == compression.RAW
    assert codec.choose_group(b"text " * 100_000) == 1


def test_raw_frames_are_valid_zstd_and_never_grow():
    for data in (b"", b"x", os.urandom(128 << 10), os.urandom(3 * MiB + 7)):
        frame = compression.raw_frame(data)
        assert zstandard.ZstdDecompressor().decompress(frame) == data
        assert len(frame) - len(data) <= 24 + 3 * (len(data) // (128 << 10) + 1)
    frame, by = compression.Codec(3).encode(os.urandom(PART))
    assert by == compression.RAW and len(frame) < PART * 1.001


def test_a_stream_is_seekable_format_that_zstd_restores():
    """Frames (one padded to S3's smallest part) + seek table: zstd -d gives the bytes back
    (ungrouped frames), the seek table parses, and each frame decodes alone."""
    codec = compression.Codec(3)
    parts = [(b"text, not floats. " * 500_000)[:PART], os.urandom(PART), b"tail" * 1000]
    frames, stored = [], []
    for i, part in enumerate(parts):
        frame, by = codec.encode(part)
        if i < len(parts) - 1:
            frame = compression.pad_to(frame, compression.MIN_PART)
        frames.append(frame)
        stored.append((len(frame), by))
    assert len(frames[0]) == compression.MIN_PART  # text compresses far below 5 MiB: padded
    table = compression.seek_table([(len(f), len(p)) for f, p in zip(frames, parts)])
    obj = b"".join(frames) + table
    assert all(by in (1, compression.RAW) for _, by in stored)
    assert zstd_cli_decompress(obj) == b"".join(parts)
    assert compression.parse_seek_table(obj) == [(len(f), len(p)) for f, p in zip(frames, parts)]
    offset = len(frames[0])
    assert compression.decode(obj[offset : offset + len(frames[1])], [stored[1]], [len(parts[1])]) == parts[1]
    assert compression.decode(obj[: len(frames[0])], [stored[0]], [len(parts[0])]) == parts[0]


def test_a_grouped_frame_needs_its_recorded_group(tmp_path):
    data = floats(2 * MiB)
    frame, by = compression.Codec(3).encode(data)
    assert by == 4 and len(frame) < 0.9 * len(data)
    assert compression.decode(frame, [(len(frame), by)], [len(data)]) == data
    assert zstandard.ZstdDecompressor().decompress(frame) == compression.group(data, 4)  # what zstd -d gives
    # By hand, from a downloaded object and its recorded groups:
    (tmp_path / "obj").write_bytes(frame + compression.seek_table([(len(frame), len(data))]))
    tool = [sys.executable, "-m", "ckptfs.objects.compression", str(tmp_path / "obj")]
    assert subprocess.run([*tool, "--groups", "4"], capture_output=True, check=True).stdout == data
    bad = subprocess.run([*tool, "--groups", "4,4"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--groups needs 1 value" in bad.stderr


def test_a_corrupted_frame_does_not_decode():
    data = floats(MiB)
    for frame, by in (compression.Codec(3).encode(data), (compression.raw_frame(data), compression.RAW)):
        bent = bytearray(frame)
        bent[len(bent) // 2] ^= 0x10
        with pytest.raises(compression.CorruptFrame):
            compression.decode(bytes(bent), [(len(frame), by)], [len(data)])


def test_the_manifest_records_frames_and_checksums_of_uncompressed_bytes():
    checks = Checksums(
        20 * MiB, PART, ["a", "b", "c"], "x", "j1", "manifest", ((6 * MiB, 4), (5 * MiB, 2), (100, 0))
    )
    assert Checksums.from_manifest(checks.to_manifest(), 20 * MiB) == checks
    assert checks.stored_range(PART, PART) == (6 * MiB, 5 * MiB, 1, 2)
    assert checks.stored_range(0, 20 * MiB) == (0, 11 * MiB + 100, 0, 3)
    assert json.loads(checks.to_manifest())["compression"]["format"] == "zstd-seekable"


def test_the_governor_sends_raw_when_compressing_is_slower_than_the_link_and_writers_wait():
    idle = compression.Governor(behind=lambda: False)
    idle.compressed(PART, int(PART * 0.8), 0.1)
    idle.uploaded(PART, 0.01)
    assert all(idle.should_compress() for _ in range(16))  # nobody waits: every part compressed
    fast_link = compression.Governor(behind=lambda: True)
    fast_link.compressed(PART, int(PART * 0.8), 0.1)  # 80 MiB/s, saves 20%
    fast_link.uploaded(PART, 0.01)  # 800 MiB/s per part upload
    assert [fast_link.should_compress() for _ in range(16)].count(True) == 2  # the probes only
    slow_link = compression.Governor(behind=lambda: True)
    slow_link.compressed(PART, int(PART * 0.8), 0.1)
    slow_link.uploaded(PART, 1.0)  # 8 MiB/s
    assert all(slow_link.should_compress() for _ in range(16))


def test_compress_flag_values():
    assert compression.parse_spec("zstd") == compression.DEFAULT_LEVEL
    assert compression.parse_spec("zstd:9") == 9
    for bad in ("lz4", "zstd:0", "zstd:x", "zstd:20", ""):
        with pytest.raises(ValueError):
            compression.parse_spec(bad)


# -- through real mounts on the real S3 server ---------------------------------------------------
def stored(client, bucket: str, name: str) -> tuple[bytes, dict[str, str]]:
    obj = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{name}")
    return obj["Body"].read(), obj["Metadata"]


def manifest_of(client, bucket: str, meta: dict[str, str]) -> bytes:
    raw = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{manifest_key(meta['ckptfs-upload'])}")[
        "Body"
    ].read()
    return raw


def original(client, bucket: str, name: str) -> bytes:
    """The file's bytes from its stored object, as a tool outside ckptfs would rebuild them:
    the seek table from the object, each frame's group from its manifest (or metadata)."""
    data, meta = stored(client, bucket, name)
    assert meta["ckptfs-format"] == "zstd-seekable"
    table = compression.parse_seek_table(data)
    if "ckptfs-frames" in meta:
        groups = [int(meta["ckptfs-frames"].split(":")[1])]
    else:
        groups = [by for _, by in json.loads(manifest_of(client, bucket, meta))["compression"]["frames"]]
    return compression.decode(data, [(s, by) for (s, _), by in zip(table, groups)], [n for _, n in table])


def state_dict():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    sd = {f"fp32.{k}": v for k, v in model.state_dict().items()}
    sd |= {f"bf16.{k}": v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    sd["step"] = torch.tensor(1234)
    return sd  # about 24 MiB: 3 parts and a tail


def test_torch_save_load_mmap_and_another_mount_without_compress(
    s3_server, s3_bucket, client, s3_mounts, tmp_path
):
    import torch

    w = s3_mounts(tmp_path / "w", s3_server.endpoint, "--compress", "zstd:3")
    sd = state_dict()
    torch.save(sd, w.path / "ckpt.pt")
    notes = b"".join(
        b"step %d loss %.4f lr 3e-4\n" % (i, 1 / (i + 1)) for i in range(400_000)
    )  # ~10 MiB text
    (w.path / "train.log").write_bytes(notes)
    (w.path / "config.json").write_bytes(json.dumps({"layers": list(range(3000))}).encode())  # one PUT
    w.sync()
    plain = (w.path / "ckpt.pt").read_bytes()
    for name, body in [
        ("ckpt.pt", plain),
        ("train.log", notes),
        ("config.json", (w.path / "config.json").read_bytes()),
    ]:
        data, meta = stored(client, s3_bucket, name)
        assert meta["ckptfs-format"] == "zstd-seekable", name
        assert len(data) < len(body), name  # it shrank
        assert original(client, s3_bucket, name) == body, name
        assert os.stat(w.path / name).st_size == len(body)
    # Ungrouped frames (text): zstd -d of the raw object is the file.
    assert zstd_cli_decompress(stored(client, s3_bucket, "train.log")[0]) == notes

    r = s3_mounts(tmp_path / "r", s3_server.endpoint)  # no --compress: reads them all the same
    assert os.stat(r.path / "ckpt.pt").st_size == len(plain)
    assert {e.name: e.stat().st_size for e in os.scandir(r.path)} == {
        "ckpt.pt": len(plain),
        "train.log": len(notes),
        "config.json": os.stat(w.path / "config.json").st_size,
    }
    loaded = torch.load(r.path / "ckpt.pt", mmap=True, weights_only=True)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    r2 = s3_mounts(tmp_path / "r2", s3_server.endpoint, "--compress", "zstd")
    with open(r2.path / "ckpt.pt", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert zlib.crc32(m) == zlib.crc32(plain)
    assert r.status()["integrity_errors"] == []


def test_random_reads_at_frame_boundaries(s3_server, s3_bucket, s3_mounts, tmp_path):
    w = s3_mounts(tmp_path / "w", s3_server.endpoint, "--compress", "zstd:1")
    body = floats(3 * PART + 12345, numpy.float32, seed=1)
    half = bytearray(floats(2 * PART, numpy.float16, seed=2))
    half[PART : PART + MiB] = os.urandom(MiB)  # one part partly incompressible
    (w.path / "a.bin").write_bytes(body)
    (w.path / "b.bin").write_bytes(bytes(half))
    w.stop()
    r = s3_mounts(tmp_path / "r", s3_server.endpoint, ram_cache="64MiB")
    rng = random.Random(3)
    for name, data in (("a.bin", body), ("b.bin", bytes(half))):
        points = [k * PART + d for k in range(len(data) // PART + 1) for d in (-3, 0, 1)]
        points += [rng.randrange(len(data)) for _ in range(20)]
        with open(r.path / name, "rb", buffering=0) as f:
            for p in points:
                if 0 <= p < len(data):
                    f.seek(p)
                    assert f.read(4096) == data[p : p + 4096], (name, p)
        assert (r.path / name).read_bytes() == data


def test_a_cold_ranged_read_fetches_only_the_frames_it_needs(
    s3_server, s3_bucket, client, proxy, s3_mounts, tmp_path
):
    w = s3_mounts(tmp_path / "w", s3_server.endpoint, "--compress", "zstd:1")
    body = floats(5 * PART, numpy.float32, seed=4)
    (w.path / "big.bin").write_bytes(body)
    w.stop()
    data, meta = stored(client, s3_bucket, "big.bin")
    frames = json.loads(manifest_of(client, s3_bucket, meta))["compression"]["frames"]
    assert len(frames) == 5 and all(by == 4 for _, by in frames)
    r = s3_mounts(tmp_path / "r", proxy.url, "--fetch-whole", "0")  # (not fetched whole at the open)
    proxy.reset_counts()
    with open(r.path / "big.bin", "rb", buffering=0) as f:
        f.seek(3 * PART + 100)
        assert f.read(1000) == body[3 * PART + 100 : 3 * PART + 1100]
    gets = [req for req in proxy.requests if req.kind == "get" and req.path.endswith("/big.bin")]
    offset = sum(s for s, _ in frames[:3])
    assert [g.headers.get("range") for g in gets] == [f"bytes={offset}-{offset + frames[3][0] - 1}"]
    assert r.status()["fetched_bytes"] == PART  # one part's worth, uncompressed


def test_a_corrupted_frame_is_caught(s3_server, s3_bucket, client, proxy, s3_mounts, tmp_path):
    """Bent on the wire: fetched again, right bytes. Bent in the store: EIO for that part only."""
    w = s3_mounts(tmp_path / "w", s3_server.endpoint, "--compress", "zstd:1")
    body = floats(3 * PART, numpy.float32, seed=5)
    (w.path / "big.bin").write_bytes(body)
    (w.path / "small.bin").write_bytes(body[:300_000])  # one PUT, one frame
    w.stop()
    # (read through the daemon, blocks fetched side by side: each bent body is one block's retry.
    # A file fetched whole at its open fetches its first block alone first: both bent bodies
    # would be that block's, its two attempts, and the open would read through the daemon.)
    r = s3_mounts(tmp_path / "r", proxy.url, "--fetch-whole", "0")
    rule = proxy.add_rule(Rule(corrupt_response_body(), kind="get", path=r"/big\.bin$", count=2))
    assert (r.path / "big.bin").read_bytes() == body
    assert rule.hits == 2 and r.status()["integrity_retries"] >= 2
    data, meta = stored(client, s3_bucket, "big.bin")
    frames = json.loads(manifest_of(client, s3_bucket, meta))["compression"]["frames"]
    bent = bytearray(data)
    bent[frames[0][0] + frames[1][0] // 2] ^= 0x04  # inside frame 2
    client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/big.bin", Body=bytes(bent), Metadata=meta)
    # A compressed object whose frames are not recorded is never served as it is stored.
    small, small_meta = stored(client, s3_bucket, "small.bin")
    del small_meta["ckptfs-frames"]
    client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/small.bin", Body=small, Metadata=small_meta)
    c = s3_mounts(tmp_path / "c", s3_server.endpoint)
    with open(c.path / "big.bin", "rb", buffering=0) as f:
        assert f.read(PART) == body[:PART]
        f.seek(2 * PART)
        assert f.read(PART) == body[2 * PART :]
        f.seek(PART)
        with pytest.raises(OSError) as info:
            f.read(PART)
        assert info.value.errno == errno.EIO
    with pytest.raises(OSError) as info:
        (c.path / "small.bin").read_bytes()
    assert info.value.errno == errno.EIO
    # (big.bin's frame fails its checks; small.bin fails as a short or undecodable read)
    assert "big.bin" in {e["key"] for e in c.status()["integrity_errors"]}


def test_compressed_and_plain_objects_in_one_bucket(s3_server, s3_bucket, client, s3_mounts, tmp_path):
    # (--list-ttl 0: each writing mount then sees what the other made durable at once)
    plain_mount = s3_mounts(tmp_path / "p", s3_server.endpoint, "--list-ttl", "0")
    zmount = s3_mounts(tmp_path / "z", s3_server.endpoint, "--compress", "zstd", "--list-ttl", "0")
    files = {
        "plain/big.bin": floats(2 * PART + 77, seed=6),
        "plain/small.bin": floats(100_000, seed=7),
        "z/big.bin": floats(2 * PART + 99, seed=8),
        "z/small.bin": floats(200_000, seed=9),
        "z/random.bin": os.urandom(PART + 5),
        "z/tiny.txt": b"hi\n",
    }
    for name, body in files.items():
        m = zmount if name.startswith("z/") else plain_mount
        (m.path / name).parent.mkdir(exist_ok=True)
        (m.path / name).write_bytes(body)
    plain_mount.sync()
    zmount.sync()
    kinds = {name: stored(client, s3_bucket, name)[1].get("ckptfs-format") for name in files}
    assert kinds == {
        "plain/big.bin": None,
        "plain/small.bin": None,
        "z/big.bin": "zstd-seekable",
        "z/small.bin": "zstd-seekable",
        "z/random.bin": "zstd-seekable",
        "z/tiny.txt": None,
    }
    assert (
        len(stored(client, s3_bucket, "z/random.bin")[0]) < len(files["z/random.bin"]) * 1.001
    )  # raw frames
    for m in (plain_mount, zmount, s3_mounts(tmp_path / "third", s3_server.endpoint)):
        for name, body in files.items():
            assert os.stat(m.path / name).st_size == len(body), (m.path, name)
            assert (m.path / name).read_bytes() == body, (m.path, name)
    # An overwrite across the two kinds: each mount sees the other's version, with its size.
    (plain_mount.path / "z/small.bin").write_bytes(b"now plain " * 10)
    plain_mount.sync()
    zmount.stop()
    z2 = s3_mounts(tmp_path / "z2", s3_server.endpoint, "--compress", "zstd")
    assert (z2.path / "z/small.bin").read_bytes() == b"now plain " * 10


def test_streamed_renamed_and_remounted_on_either_store(mount_factory):
    """Local directory and S3 store alike: a file streamed while written (parts before the
    close), renamed and overwritten, reads back with its size after a remount; a delete leaves
    no file."""
    m = mount_factory(extra=("--compress", "zstd:1")).start()
    body = floats(3 * PART + 4321, numpy.float16, seed=10)
    with open(m.path / "stream.bin", "wb") as f:
        for i in range(0, len(body), MiB):
            f.write(body[i : i + MiB])
    os.rename(m.path / "stream.bin", m.path / "moved.bin")
    (m.path / "over.bin").write_bytes(os.urandom(PART + 1))
    (m.path / "over.bin").write_bytes(body[: PART + 99])
    (m.path / "gone.bin").write_bytes(body[: 2 * PART])
    m.sync()
    os.unlink(m.path / "gone.bin")
    m.stop()
    r = mount_factory().start()
    assert sorted(os.listdir(r.path)) == ["moved.bin", "over.bin"]
    assert os.stat(r.path / "moved.bin").st_size == len(body)
    assert (r.path / "moved.bin").read_bytes() == body
    assert (r.path / "over.bin").read_bytes() == body[: PART + 99]
    assert r.status()["integrity_errors"] == []
