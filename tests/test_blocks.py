"""ckptfs/blocks.py: the block arithmetic, the block list's JSON form and the digests over blocks."""

from __future__ import annotations

import json
import random

import pytest
import xxhash

from ckptfs.blocks import (
    block_length,
    blocks_touched,
    cached_xxh3,
    content_xxh3,
    decode_block_list,
    encode_block_list,
    n_blocks,
)

pytestmark = pytest.mark.unit

BS = 8


def test_block_counts_and_lengths():
    assert [n_blocks(size, BS) for size in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    assert [block_length(19, i, BS) for i in range(4)] == [8, 8, 3, 0]
    assert block_length(0, 0, BS) == 0
    assert list(blocks_touched(0, 1, BS)) == [0]
    assert list(blocks_touched(7, 9, BS)) == [0, 1]
    assert list(blocks_touched(8, 16, BS)) == [1]
    assert list(blocks_touched(5, 5, BS)) == []


def test_block_list_survives_json():
    blocks = [(0, 3), None, (1, 0)]
    assert decode_block_list(json.loads(json.dumps(encode_block_list(blocks)))) == blocks
    assert encode_block_list(blocks) == [[0, 3], None, [1, 0]]


def test_a_run_of_holes_is_one_number_and_old_lists_still_read():
    """A sparse file's journal record costs a few bytes whatever its size (issue 17: a truncate
    to a petabyte wrote one JSON line of 119 million nulls)."""
    tib_of_holes = [None] * ((1 << 40) // (8 << 20))
    blocks = [(0, 1), *tib_of_holes, (1, 2), None, None, (0, 5), None]
    encoded = encode_block_list(blocks)
    assert encoded == [[0, 1], len(tib_of_holes), [1, 2], 2, [0, 5], None]
    assert len(json.dumps(encode_block_list(tib_of_holes))) < 10
    assert decode_block_list(json.loads(json.dumps(encoded))) == blocks
    assert decode_block_list([[0, 1], None, None, None]) == [(0, 1), None, None, None]  # written before runs
    for damaged in ([1], [0], [-3], [True]):
        with pytest.raises((ValueError, TypeError)):  # (what the journal and clean index catch)
            decode_block_list(damaged)


def _arena(data: bytes, holes: set[int]):
    """A stand-in cache: block i in slot (0, i), its bytes from ``data``; ``holes`` not cached."""
    blocks = [None if i in holes else (0, i) for i in range(n_blocks(len(data), BS))]
    return (lambda ref, length: memoryview(data)[ref[1] * BS : ref[1] * BS + length]), blocks


def test_content_xxh3_is_the_whole_files_and_holes_read_as_zeros():
    data = random.Random(1).randbytes(3 * BS + 5)
    view, blocks = _arena(data, set())
    assert content_xxh3(view, len(data), blocks, BS) == xxhash.xxh3_64_hexdigest(data)
    view, blocks = _arena(data, {1})
    zeroed = data[:BS] + bytes(BS) + data[2 * BS :]
    assert content_xxh3(view, len(data), blocks, BS) == xxhash.xxh3_64_hexdigest(zeroed)


def test_cached_xxh3_covers_which_blocks_are_cached_and_their_bytes():
    data = random.Random(2).randbytes(3 * BS)
    view, blocks = _arena(data, {0})
    digest = cached_xxh3(view, len(data), blocks, BS)
    assert digest == cached_xxh3(view, len(data), list(blocks), BS)
    assert digest != cached_xxh3(view, len(data), [None, None, (0, 2)], BS)  # one block fewer
    assert digest != cached_xxh3(view, len(data), [None, (0, 2), (0, 1)], BS)  # same bytes, other places
    changed = data[:BS] + bytes(BS) + data[2 * BS :]
    other_view, _ = _arena(changed, {0})
    assert digest != cached_xxh3(other_view, len(data), blocks, BS)
