"""The clean cache index (clean_index.py) on its own: a Cache on tmp_path, no mount.

A clean umount saves which durable files' blocks are cached; the next mount with the same cache
dir adopts them. What it may trust: only its own index, read once (gone after), only blocks
inside the arenas and claimed once, RAM blocks only while the RAM tier is the same incarnation;
anything unreadable means an empty cache, never a failed mount or someone else's bytes.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from ckptfs.cache import clean_index
from ckptfs.cache.arena import DISK, RAM
from ckptfs.cache.cache import Cache
from ckptfs.cache.clean_index import CleanEntry, cached_digest
from ckptfs.errors import MountError
from tests.support.harness import blob

pytestmark = pytest.mark.unit

BS = 64 << 10


def open_cache(tmp_path, ram: str = "ram") -> Cache:
    return Cache(tmp_path / "cache", tmp_path / ram, BS, 8 * BS, 32 * BS)


def cache_file(cache: Cache, data: bytes, tier: int) -> list:
    blocks = []
    for offset in range(0, len(data), BS):
        ref = cache.try_alloc(only=tier)
        chunk = data[offset : offset + BS]
        cache.write(ref, 0, chunk)
        cache.fit(ref, len(chunk))
        blocks.append(ref)
    return blocks


def entry(cache: Cache, key: str, data: bytes, blocks: list) -> CleanEntry:
    return CleanEntry(key, len(data), 1_700_000_000.0, blocks, cached_digest(cache, len(data), blocks))


def read_back(cache: Cache, size: int, blocks: list) -> bytes:
    return b"".join(
        cache.read(ref, 0, min(BS, size - i * BS)) if ref is not None else bytes(min(BS, size - i * BS))
        for i, ref in enumerate(blocks)
    )


@pytest.fixture
def saved(tmp_path):
    """An index of two files, one in RAM (with a hole), one on disk, saved by a cache now closed."""
    cache = open_cache(tmp_path)
    a, b = blob(2 * BS + 100, 1), blob(3 * BS, 2)
    a_blocks = cache_file(cache, a, RAM)
    a_blocks[1] = None  # block 1 evicted before the umount
    entries = [
        entry(cache, "ckpt/a.bin", a, a_blocks),
        entry(cache, "ckpt/b.bin", b, cache_file(cache, b, DISK)),
    ]
    index = tmp_path / "cache" / "clean.index"
    clean_index.save(index, cache, entries)
    cache.close()
    return index, {e.key: e for e in entries}, {"ckpt/a.bin": a, "ckpt/b.bin": b}


def test_round_trip_adopts_the_blocks_and_removes_the_index(tmp_path, saved):
    index, entries, data = saved
    assert os.stat(index).st_mode & 0o777 == 0o600
    cache = open_cache(tmp_path)
    try:
        taken: set = set()
        loaded = clean_index.load(index, cache, taken)
        assert loaded == entries
        assert not index.exists()  # read once: a crash later must not trust reused slots
        for key, e in loaded.items():
            refs = [r for r in e.blocks if r is not None]
            assert all(cache.refcounts[r] == 1 for r in refs) and taken >= set(refs)
            assert cached_digest(cache, e.size, e.blocks) == e.digest
            expected = bytearray(data[key])
            for i, ref in enumerate(e.blocks):
                if ref is None:
                    expected[i * BS : (i + 1) * BS] = bytes(len(expected[i * BS : (i + 1) * BS]))
            assert read_back(cache, e.size, e.blocks) == expected
        assert cache.try_alloc(only=DISK) not in taken  # adopted slots are not handed out again
    finally:
        cache.close()


def test_no_index_is_an_empty_cache(tmp_path):
    cache = open_cache(tmp_path)
    try:
        assert clean_index.load(tmp_path / "cache" / "clean.index", cache, set()) == {}
        assert cache.refcounts == {}
    finally:
        cache.close()


def test_a_new_ram_tier_drops_the_files_with_ram_blocks(tmp_path, saved):
    index, entries, _ = saved
    cache = open_cache(tmp_path, ram="ram-after-reboot")  # a fresh tmpfs arena: another id
    try:
        assert clean_index.load(index, cache, set()) == {"ckpt/b.bin": entries["ckpt/b.bin"]}
        assert all(ref[0] == DISK for ref in cache.refcounts)
    finally:
        cache.close()


def test_blocks_outside_the_arenas_or_claimed_twice_are_not_adopted(tmp_path, saved):
    index, entries, _ = saved
    lines = index.read_text().splitlines()
    b = json.loads(lines[2])
    outside = dict(b, key="ckpt/outside.bin", blocks=[[DISK, 10**9]])
    twice = dict(b, key="ckpt/twice.bin")  # the same slots as b.bin
    bad_tier = dict(b, key="ckpt/tier.bin", blocks=[[7, 0]])
    index.write_text("\n".join([*lines, *map(json.dumps, (outside, twice, bad_tier))]) + "\n")
    cache = open_cache(tmp_path)
    try:
        already = {tuple(entries["ckpt/a.bin"].blocks[0])}  # the journal's files claimed it first
        loaded = clean_index.load(index, cache, set(already))
        assert set(loaded) == {"ckpt/b.bin"}
        assert already.isdisjoint(cache.refcounts) and all(n == 1 for n in cache.refcounts.values())
    finally:
        cache.close()


@pytest.mark.parametrize(
    "text",
    [
        "not json at all\n",
        '{"ram": "x"}\n{"key": "k", "size": 1}\n',
        '{"ram": "x"}\n[1, 2]\n',
        "\n\n",
        '{"ram": "x"}\n{"key": "k"',
    ],
)
def test_a_damaged_index_is_an_empty_cache(tmp_path, saved, text, caplog):
    index, _, _ = saved
    index.write_text(text)
    cache = open_cache(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptfs.cache.clean_index"):
            assert clean_index.load(index, cache, set()) == {}
        assert cache.refcounts == {} and not index.exists()
    finally:
        cache.close()


def test_an_index_that_is_a_symbolic_link_is_refused_not_followed(tmp_path, saved):
    index, _, _ = saved
    elsewhere = tmp_path / "elsewhere"
    os.replace(index, elsewhere)
    index.symlink_to(elsewhere)
    cache = open_cache(tmp_path)
    try:
        with pytest.raises(MountError, match="symbolic link"):
            clean_index.load(index, cache, set())
        assert cache.refcounts == {} and elsewhere.exists()
    finally:
        cache.close()


def test_the_digest_covers_every_cached_byte_and_its_place(tmp_path):
    cache = open_cache(tmp_path)
    try:
        data = blob(2 * BS, 3)
        blocks = cache_file(cache, data, DISK)
        digest = cached_digest(cache, len(data), blocks)
        assert cached_digest(cache, len(data), list(reversed(blocks))) != digest  # blocks swapped
        assert cached_digest(cache, len(data), [blocks[0], None]) != digest
        cache.write(blocks[1], BS - 1, b"\x00" if data[-1] else b"\x01")  # the last byte bent
        assert cached_digest(cache, len(data), blocks) != digest
    finally:
        cache.close()
