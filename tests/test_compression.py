"""Opt-in compression (issue 15, compression half): the zstd seekable format (unit tests of the
codec in ckptfs/compression.py), then real mounts on the real Swift s3api server, some through
the fault proxy (tests/faultproxy.py) to count and bend requests; the store is read and damaged
straight through the real endpoint (boto3)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import shutil
import subprocess
import zlib

import numpy
import pytest
import zstandard

from ckptfs import compression
from ckptfs.integrity import Checksums, manifest_key
from tests.faultproxy import Rule, corrupt_response_body
from tests.mounting import Mount

pytestmark = pytest.mark.timeout(240)

PREFIX = "run"
MiB = 1 << 20
PART = 8 * MiB


def floats(n_bytes: int, dtype=numpy.float32, seed: int = 0) -> bytes:
    """Weight-like data: small normally distributed values (the exponent bytes repeat)."""
    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal(n_bytes // numpy.dtype(dtype).itemsize) * 0.02).astype(dtype).tobytes()


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
    assert compression.decode(obj[offset:offset + len(frames[1])], [stored[1]], [len(parts[1])]) == parts[1]
    assert compression.decode(obj[:len(frames[0])], [stored[0]], [len(parts[0])]) == parts[0]


def test_a_grouped_frame_needs_its_recorded_group():
    data = floats(2 * MiB)
    frame, by = compression.Codec(3).encode(data)
    assert by == 4 and len(frame) < 0.9 * len(data)
    assert compression.decode(frame, [(len(frame), by)], [len(data)]) == data
    assert zstandard.ZstdDecompressor().decompress(frame) == compression.group(data, 4)  # what zstd -d gives


def test_a_corrupted_frame_does_not_decode():
    data = floats(MiB)
    for frame, by in (compression.Codec(3).encode(data), (compression.raw_frame(data), compression.RAW)):
        bent = bytearray(frame)
        bent[len(bent) // 2] ^= 0x10
        with pytest.raises(compression.CorruptFrame):
            compression.decode(bytes(bent), [(len(frame), by)], [len(data)])


def test_the_manifest_records_frames_and_checksums_of_uncompressed_bytes():
    checks = Checksums(20 * MiB, PART, ["a", "b", "c"], "x", "j1", "manifest", ((6 * MiB, 4), (5 * MiB, 2), (100, 0)))
    assert Checksums.from_manifest(checks.to_manifest(), 20 * MiB) == checks
    assert checks.stored_range(PART, PART) == (6 * MiB, 5 * MiB, 1, 2)
    assert checks.stored_range(0, 20 * MiB) == (0, 11 * MiB + 100, 0, 3)
    assert json.loads(checks.to_manifest())["compression"]["format"] == "zstd-seekable"


def test_the_governor_sends_raw_when_compressing_is_slower_than_the_link():
    fast_link = compression.Governor()
    fast_link.compressed(PART, int(PART * 0.8), 0.1)  # 80 MiB/s, saves 20%
    fast_link.uploaded(PART, 0.01)  # 800 MiB/s per part upload
    assert [fast_link.should_compress() for _ in range(16)].count(True) == 2  # the probes only
    slow_link = compression.Governor()
    slow_link.compressed(PART, int(PART * 0.8), 0.1)
    slow_link.uploaded(PART, 1.0)  # 8 MiB/s
    assert all(slow_link.should_compress() for _ in range(16))


def test_compress_flag_values():
    assert compression.parse_spec("zstd") == compression.DEFAULT_LEVEL
    assert compression.parse_spec("zstd:9") == 9
    for bad in ("lz4", "zstd:0", "zstd:x", "zstd:20", ""):
        with pytest.raises(ValueError):
            compression.parse_spec(bad)
