"""How a file is cut into the parts of its object: the part layout, and the schedule that picks it.

A *layout* is a list of runs ``(count, size)``: ``count`` parts of ``size`` bytes each, in order;
the last run goes on for as many parts as the file needs. Part ``i`` (0-based; S3's part number
``i + 1``) holds the file's bytes ``[start(i), start(i) + size(i))``, cut at the file's end.
Offset to part is a pure function of the layout, which a manifest records (``runs``).

The schedule (``PartSchedule``), for a base part size B (the cache's block size, ``--part-size``)
and a store's limits (at most N parts of at most ``max_part_size``, objects of at most
``max_object_size``):

- a file of at most N x B bytes: N parts of B, *uniform*, exactly as before the schedule existed
  (same parts, same manifests, same ETags);
- a larger file: the *grown* layout: K parts of B, then M parts of 2B, M of 4B, ... doubling
  every M parts up to the cap (the largest B x 2^g within ``max_part_size``), then parts of the
  cap for good. M = N // 100 (100 for S3's 10,000); K is the largest count (at least N // 2)
  that still lets N parts reach ``max_object_size``. Every part is a whole number of blocks
  (a power of two of them). For S3 (N = 10,000, 5 GiB, 5 TiB) and B = 8 MiB: K = 8,035,
  parts grow to 4 GiB; B = 4 KiB: K = 6,920, parts grow to 4 GiB.
- memory: the part that holds offset X of a grown layout is at most (X - K x B) / M + 2B bytes
  (and at most the cap): a streamed file of S bytes needs at most S / 100 + 2B of cache for the
  part being filled (its blocks stay until the part is sent). See docs/semantics.md.

A file being written (streamed) does not know its final size: its parts are sent in the grown
layout, whose first K parts are the uniform layout's. At the commit a file of at most N x B bytes
takes the uniform layout again (re-sending its parts past K from the cache), unless blocks past
part K were already evicted under cache pressure: then it keeps the grown layout (``grown``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

Run = tuple[int, int]  # (count, size)


@dataclass(frozen=True)
class PartLayout:
    """Parts of a file by runs (see the module doc); ``uniform`` when every part has one size."""

    runs: tuple[Run, ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # first offset of each run
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # first part of each run

    def __post_init__(self) -> None:
        if not self.runs or any(count < 1 or size < 1 for count, size in self.runs):
            raise ValueError(f"bad part runs {self.runs!r}")
        starts, firsts, offset, part = [], [], 0, 0
        for count, size in self.runs:
            starts.append(offset)
            firsts.append(part)
            offset += count * size
            part += count
        object.__setattr__(self, "_starts", tuple(starts))
        object.__setattr__(self, "_firsts", tuple(firsts))

    @classmethod
    def uniform_of(cls, part_size: int) -> PartLayout:
        return cls(((1, part_size),))

    @property
    def base(self) -> int:
        """The first part's size (the ``part_size`` a manifest records)."""
        return self.runs[0][1]

    @property
    def uniform(self) -> bool:
        return len({size for _, size in self.runs}) == 1

    def _run_of_part(self, index: int) -> int:
        return bisect.bisect_right(self._firsts, index) - 1

    def start(self, index: int) -> int:
        """The first byte of part ``index``."""
        run = self._run_of_part(index)
        return self._starts[run] + (index - self._firsts[run]) * self.runs[run][1]

    def size(self, index: int) -> int:
        """Part ``index``'s full size (the last part of a file may be cut short)."""
        return self.runs[self._run_of_part(index)][1]

    def index(self, offset: int) -> int:
        """The part holding byte ``offset``."""
        run = bisect.bisect_right(self._starts, offset) - 1
        return self._firsts[run] + (offset - self._starts[run]) // self.runs[run][1]

    def length(self, index: int, file_size: int) -> int:
        """Bytes of part ``index`` in a file of ``file_size`` bytes (0 past its end)."""
        return max(0, min(self.size(index), file_size - self.start(index)))

    def count(self, file_size: int) -> int:
        """How many parts a file of ``file_size`` bytes has (one for an empty file)."""
        return self.index(file_size - 1) + 1 if file_size > 0 else 1

    def bounds(self, index: int, file_size: int) -> tuple[int, int]:
        """Part ``index`` as (start, length) in a file of ``file_size`` bytes."""
        return self.start(index), self.length(index, file_size)

    def blocks(self, index: int, block_size: int) -> range:
        """The blocks (of ``block_size``, which divides every part size) that part ``index`` holds."""
        start = self.start(index)
        return range(start // block_size, (start + self.size(index)) // block_size)

    def to_json(self) -> list[list[int]]:
        return [[count, size] for count, size in self.runs]

    @classmethod
    def from_json(cls, raw: Sequence) -> PartLayout:
        return cls(tuple((int(count), int(size)) for count, size in raw))


def _cap_shift(base: int, max_part_size: int) -> int:
    """g: the largest B x 2^g within ``max_part_size`` (0 when B itself is the largest)."""
    shift = 0
    while base << (shift + 1) <= max_part_size:
        shift += 1
    return shift


@dataclass(frozen=True)
class PartSchedule:
    """Which layout a file gets (see the module doc): a pure function of the base part size and
    the store's limits."""

    base: int
    max_parts: int
    max_part_size: int
    max_object_size: int

    @property
    def uniform(self) -> PartLayout:
        return PartLayout.uniform_of(self.base)

    @property
    def per_doubling(self) -> int:
        """M: parts of each size between the first K and the cap."""
        return max(1, self.max_parts // 100)

    def _grown_runs(self, shared: int) -> tuple[Run, ...]:
        cap = _cap_shift(self.base, self.max_part_size)
        runs: list[Run] = [(shared, self.base)] if shared else []
        left = self.max_parts - shared
        for shift in range(1, cap):
            count = min(self.per_doubling, left)
            if count <= 0:
                break
            runs.append((count, self.base << shift))
            left -= count
        if cap and left > 0:
            runs.append((left, self.base << cap))
        return tuple(runs) or ((1, self.base),)

    def _reach(self, runs: tuple[Run, ...]) -> int:
        """Bytes the first ``max_parts`` parts of a layout hold."""
        total, left = 0, self.max_parts
        for count, size in runs[:-1]:
            take = min(count, left)
            total, left = total + take * size, left - take
        return total + max(0, left) * runs[-1][1]

    @functools.cached_property
    def shared(self) -> int:
        """K: the grown layout's leading parts of B (the uniform layout's first K parts)."""
        lo, hi = self.max_parts // 2, self.max_parts - 1
        if self._reach(self._grown_runs(lo)) < self.max_object_size:
            return lo  # (limits no layout reaches: a test store's, with few parts)
        while lo < hi:  # reach falls as K grows: the largest K that reaches the object limit
            mid = (lo + hi + 1) // 2
            if self._reach(self._grown_runs(mid)) >= self.max_object_size:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @functools.cached_property
    def grown(self) -> PartLayout:
        return PartLayout(self._grown_runs(self.shared))

    @property
    def largest_part(self) -> int:
        """The grown layout's largest part (the cap; the base when parts cannot grow)."""
        return max(size for _, size in self.grown.runs)

    @property
    def max_file_size(self) -> int:
        """The largest file the schedule can cut into ``max_parts`` parts (at most the object limit)."""
        return min(self.max_object_size, self._reach(self.grown.runs))

    def needs_grown(self, size: int) -> bool:
        return size > self.max_parts * self.base

    def layout(self, size: int, grown: bool = False) -> PartLayout:
        """The layout of a file of ``size`` bytes; ``grown``: it was streamed in the grown layout
        and keeps it (parts past K evicted from the cache)."""
        return self.grown if grown or self.needs_grown(size) else self.uniform

    def keeps_grown(self, remote_blocks) -> bool:
        """Whether a streamed file whose blocks ``remote_blocks`` (indexes) were evicted once sent
        must keep the grown layout: some lie past the parts it shares with the uniform one."""
        shared = self.shared
        return any(index >= shared for index in remote_blocks)
