"""A file's content as fixed-size blocks: the arithmetic, the block list's JSON form and the
digests over the blocks, in one place.

Block ``i`` of a file holds its bytes ``[i * block_size, (i + 1) * block_size)``; the last one is
short (or empty, for an empty file's none). The cache keeps each block in a slot (a ``BlockRef``,
``(tier, slot)``) or nowhere (``None``: a hole, or a block only the store holds). The journal and
the clean-cache index record block lists as JSON; the uploader hashes a file's blocks for its
whole-file xxh3, and the clean-cache index hashes the blocks it kept across mounts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import xxhash

BlockRef = tuple[int, int]  # (tier, slot)
# The bytes of a cached block: view(ref, length) (Cache.view).
BlockView = Callable[[BlockRef, int], "bytes | memoryview"]


def n_blocks(size: int, block_size: int) -> int:
    """How many blocks a file of ``size`` bytes has."""
    return -(-size // block_size)


def block_length(size: int, index: int, block_size: int) -> int:
    """Bytes of block ``index`` in a file of ``size`` bytes (0 past its end)."""
    return max(0, min(block_size, size - index * block_size))


def blocks_touched(offset: int, end: int, block_size: int) -> range:
    """The indexes of the blocks that bytes ``[offset, end)`` touch (none where ``end <= offset``)."""
    return range(offset // block_size, n_blocks(end, block_size)) if end > offset else range(0)


def encode_block_list(blocks: Sequence[BlockRef | None]) -> list[list[int] | int | None]:
    """A block list as JSON holds it: [tier, slot] for a cached block, null for one that is not,
    and a run of two or more such as their count, so a sparse file's holes cost a few bytes
    (a 1 TiB hole: one number, not 131,072 nulls)."""
    out: list[list[int] | int | None] = []
    run = 0
    for ref in blocks:
        if ref is None:
            run += 1
            continue
        if run:
            out.append(run if run > 1 else None)
            run = 0
        out.append(list(ref))
    if run:
        out.append(run if run > 1 else None)
    return out


def decode_block_list(raw: Sequence) -> list[BlockRef | None]:
    """``encode_block_list``'s inverse (journals written before runs were counted hold nulls only)."""
    blocks: list[BlockRef | None] = []
    for item in raw:
        if item is None:
            blocks.append(None)
        elif isinstance(item, int) and not isinstance(item, bool):
            if item < 2:
                raise ValueError(f"a run of {item} holes in a block list")
            blocks.extend([None] * item)
        else:
            blocks.append((item[0], item[1]))
    return blocks


def content_xxh3(view: BlockView, size: int, blocks: Sequence[BlockRef | None], block_size: int) -> str:
    """xxh3-64 of a file's bytes (holes read as zeros), from its cached blocks: the whole file's
    checksum, equal to ``integrity.part_hash`` of all of it."""
    hasher = xxhash.xxh3_64()
    for index, ref in enumerate(blocks):
        length = block_length(size, index, block_size)
        hasher.update(view(ref, length) if ref is not None else bytes(length))
    return hasher.hexdigest()


@functools.lru_cache(maxsize=16)
def zeros_xxh3(length: int) -> str:
    """xxh3-64 of ``length`` zero bytes (a hole as a part), worked out once per length: a
    sparse file's hole parts are named without hashing a byte per byte of hole."""
    hasher, zeros = xxhash.xxh3_64(), memoryview(bytes(min(length, 1 << 20)))
    for start in range(0, length, len(zeros) or 1):
        hasher.update(zeros[: min(len(zeros), length - start)])
    return hasher.hexdigest()


def cached_xxh3(view: BlockView, size: int, blocks: Sequence[BlockRef | None], block_size: int) -> str:
    """xxh3-64 of the cached blocks only, each with its index: what the clean-cache index records
    and a remount checks before serving the blocks it kept."""
    hasher = xxhash.xxh3_64()
    for index, ref in enumerate(blocks):
        if ref is not None:
            hasher.update(index.to_bytes(8, "little"))
            hasher.update(view(ref, block_length(size, index, block_size)))
    return hasher.hexdigest()
