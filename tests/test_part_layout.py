"""The part schedule and layouts (ckptfs/parts.py, issue 28) and the manifest that records them
(objects/integrity.py): files of at most 10,000 parts keep the uniform layout and the manifest
they always had; larger ones grow their parts on a fixed schedule that reaches S3's 5 TiB within
10,000 parts of at most 5 GiB, each a whole number of blocks; old manifests still read."""

from __future__ import annotations

import json
import random

import pytest
import xxhash

from ckptfs.cache.journal import PUT, Op
from ckptfs.objects import compression
from ckptfs.objects.integrity import Checksums, IntegrityError, part_hash
from ckptfs.parts import PartLayout, PartSchedule
from ckptfs.store.base import S3_LIMITS

pytestmark = pytest.mark.unit

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
N = S3_LIMITS.max_parts


def s3_schedule(base: int) -> PartSchedule:
    return PartSchedule(base, N, S3_LIMITS.max_part_size, S3_LIMITS.max_object_size)


# -- the schedule ----------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [4 * KiB, 64 * KiB, 5 * MiB, 8 * MiB, 64 * MiB, 512 * MiB])
def test_the_grown_layout_reaches_5_tib_within_10000_parts_of_whole_blocks(base):
    schedule = s3_schedule(base)
    layout = schedule.layout(5 * TiB)
    assert layout == schedule.grown and not layout.uniform
    assert layout.count(5 * TiB) <= N
    assert schedule.max_file_size == 5 * TiB
    for _, size in layout.runs:
        assert size <= 5 * GiB
        assert size % base == 0
        assert size // base & (size // base - 1) == 0  # a power of two of blocks
    sizes = [size for _, size in layout.runs]
    assert sizes == sorted(sizes) and sizes[0] == base  # growing, from the base


@pytest.mark.parametrize("base", [4 * KiB, 8 * MiB])
def test_files_up_to_10000_parts_keep_the_uniform_layout(base):
    schedule = s3_schedule(base)
    for size in (0, 1, base, base + 1, N * base - 1, N * base):
        assert schedule.layout(size) == PartLayout.uniform_of(base)
    assert schedule.layout(N * base + 1) == schedule.grown
    assert schedule.layout(N * base, grown=True) == schedule.grown  # (a streamed file that kept it)


@pytest.mark.parametrize("base", [4 * KiB, 5 * MiB, 8 * MiB])
def test_the_grown_layout_begins_with_the_uniform_one(base):
    schedule = s3_schedule(base)
    shared = schedule.shared
    assert N // 2 <= shared < N
    uniform, grown = schedule.uniform, schedule.grown
    for index in (0, 1, shared // 2, shared - 1):
        assert grown.bounds(index, 10 * TiB) == uniform.bounds(index, 10 * TiB) == (index * base, base)
    assert grown.size(shared) == 2 * base


def test_the_default_schedule_in_numbers():
    schedule = s3_schedule(8 * MiB)
    assert schedule.shared == 8035 and schedule.per_doubling == 100
    assert max(size for _, size in schedule.grown.runs) == 4 * GiB
    assert schedule.grown.count(5 * TiB) <= N
    assert s3_schedule(4 * KiB).shared == 6920


@pytest.mark.parametrize("base", [4 * KiB, 8 * MiB])
def test_the_part_at_an_offset_is_bounded_by_the_rule(base):
    """The memory a streamed part holds: the part at offset X is at most (X - K*B) / M + 2B."""
    schedule = s3_schedule(base)
    layout, k, m = schedule.grown, schedule.shared, schedule.per_doubling
    rng = random.Random(28)
    for offset in [k * base, N * base, 100 * GiB, TiB, 5 * TiB - 1] + [
        rng.randrange(5 * TiB) for _ in range(200)
    ]:
        size = layout.size(layout.index(offset))
        assert size <= max(base, (offset - k * base) / m + 2 * base)


def test_offsets_parts_and_lengths_agree():
    layout = PartLayout(((3, 4), (2, 8), (1, 16)))
    assert [layout.start(i) for i in range(8)] == [0, 4, 8, 12, 20, 28, 44, 60]
    assert [layout.size(i) for i in range(8)] == [4, 4, 4, 8, 8, 16, 16, 16]
    for offset in range(80):
        index = layout.index(offset)
        assert layout.start(index) <= offset < layout.start(index) + layout.size(index)
    assert layout.count(0) == 1 and layout.count(12) == 3 and layout.count(13) == 4 and layout.count(61) == 8
    assert layout.length(3, 15) == 3 and layout.length(4, 15) == 0
    assert list(layout.blocks(3, 4)) == [3, 4] and list(layout.blocks(5, 4)) == [7, 8, 9, 10]
    assert PartLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    with pytest.raises(ValueError):
        PartLayout(((0, 4),))


def test_a_tiny_test_store_still_gets_a_schedule():
    """A store declaring few parts (a test's) cannot reach 5 TiB: K is half its parts."""
    schedule = PartSchedule(5 * MiB, 20, 5 * GiB, 5 * TiB)
    assert schedule.shared == 10
    assert [size // MiB for _, size in schedule.grown.runs][:4] == [5, 10, 20, 40]
    assert schedule.grown.count(130 * MiB) == 14


def test_evicted_blocks_past_the_shared_parts_keep_the_grown_layout():
    schedule = s3_schedule(4 * KiB)
    assert not schedule.keeps_grown([0, 5, schedule.shared - 1])
    assert schedule.keeps_grown([3, schedule.shared])


# -- the manifest ----------------------------------------------------------------------------------


def _checksums(data: bytes, layout: PartLayout) -> Checksums:
    hashes = [
        part_hash(data[layout.start(i) : layout.start(i) + layout.size(i)])
        for i in range(layout.count(len(data)))
    ]
    runs = None if layout.uniform else layout.runs
    return Checksums(
        len(data), layout.base, hashes, xxhash.xxh3_64_hexdigest(data), "j-28", "manifest", (), runs
    )


def test_a_uniform_manifest_is_byte_for_byte_as_before():
    data = bytes(range(256)) * 40  # 10,240 bytes in parts of 4 KiB
    checks = _checksums(data, PartLayout.uniform_of(4096))
    old = {
        "format": 1,
        "algorithm": "xxh3-64",
        "size": len(data),
        "part_size": 4096,
        "xxh3": xxhash.xxh3_64_hexdigest(data),
        "upload": "j-28",
        "parts": checks.parts,
    }
    assert checks.to_manifest() == json.dumps(old, separators=(",", ":")).encode()


def test_an_old_manifest_still_reads():
    data = random.Random(1).randbytes(20_000)
    parts = [part_hash(data[i : i + 8192]) for i in range(0, len(data), 8192)]
    raw = json.dumps(
        {
            "format": 1,
            "algorithm": "xxh3-64",
            "size": len(data),
            "part_size": 8192,
            "xxh3": "",
            "upload": "u",
            "parts": parts,
        }
    ).encode()
    checks = Checksums.from_manifest(raw, len(data))
    assert checks.runs is None and checks.layout == PartLayout.uniform_of(8192)
    assert checks.span(8192 + 5, 10) == (8192, 8192)
    assert checks.span(16_384, 100) == (16_384, len(data) - 16_384)
    checks.check(0, data)
    checks.check(8192, data[8192:16_384])


def test_a_grown_manifest_round_trips_and_checks_parts_of_every_size():
    layout = PartLayout(((3, 1000), (2, 2000), (1, 4000)))
    data = random.Random(2).randbytes(3 * 1000 + 2 * 2000 + 4000 + 1500)  # the last run goes on
    checks = _checksums(data, layout)
    assert len(checks.parts) == 7
    raw = checks.to_manifest()
    assert json.loads(raw)["runs"] == [[3, 1000], [2, 2000], [1, 4000]]
    back = Checksums.from_manifest(raw, len(data))
    assert back == checks and back.layout == layout
    assert back.span(3500, 10) == (3000, 2000)  # a 2,000-byte part
    assert back.span(2999, 2) == (2000, 3000)  # a small part and a big one
    assert back.span(len(data) - 1, 1) == (11_000, 1500)  # the last part, cut short
    back.check(0, data)
    back.check(3000, data[3000:7000])
    bent = bytearray(data)
    bent[4321] ^= 1
    with pytest.raises(IntegrityError, match="part 4 "):
        back.check(3000, bytes(bent[3000:7000]))


def test_a_manifest_whose_runs_do_not_fit_its_parts_is_refused():
    layout = PartLayout(((2, 1000), (1, 2000)))
    data = bytes(5000)
    raw = json.loads(_checksums(data, layout).to_manifest())
    raw["runs"] = [[1, 1000], [1, 2000]]  # 3 parts in that layout, 2 recorded
    raw["parts"] = raw["parts"][:2]
    with pytest.raises(IntegrityError):
        Checksums.from_manifest(json.dumps(raw).encode(), len(data))
    raw = json.loads(_checksums(data, layout).to_manifest())
    raw["runs"] = [[2, 999], [1, 2000]]  # the base must be the recorded part_size
    with pytest.raises(IntegrityError):
        Checksums.from_manifest(json.dumps(raw).encode(), len(data))


def test_compressed_frames_follow_a_grown_layout():
    layout = PartLayout(((2, 1000), (1, 2000)))
    data = random.Random(3).randbytes(4500)
    frames, stored = [], b""
    for index in range(layout.count(len(data))):
        start, length = layout.bounds(index, len(data))
        frame = compression.raw_frame(data[start : start + length])
        frames.append((len(frame), compression.RAW))
        stored += frame
    checks = _checksums(data, layout)
    checks = Checksums(
        checks.size, checks.part_size, checks.parts, "", "u", "manifest", tuple(frames), layout.runs
    )
    offset, length, first, last = checks.stored_range(*checks.span(2500, 10))
    assert (first, last) == (2, 3) and offset == frames[0][0] + frames[1][0]
    assert checks.decompress(first, last, stored[offset : offset + length]) == data[2000:4000]


# -- the journal -------------------------------------------------------------------------------------


def test_a_put_that_keeps_the_grown_layout_says_so_in_the_journal():
    op = Op(
        PUT, "a.bin", size=100, blocks=[], seq=3, upload=["a.bin", "u", "j"], parts={7000: "t"}, grown=True
    )
    rec = op.to_record()
    assert rec["grown"] is True and rec["parts"] == {"7000": "t"}
    assert Op.from_record(json.loads(json.dumps(rec))) == op
    del rec["grown"]  # a record written before grown layouts
    assert Op.from_record(rec).grown is False
    assert "grown" not in Op(PUT, "b", size=1, seq=4).to_record()


# -- the byte budget of part bodies and fetched parts --------------------------------------------------


def test_a_byte_budget_bounds_bytes_and_lets_a_larger_taker_go_alone():
    import trio

    from ckptfs.util.byte_budget import ByteBudget

    budget = ByteBudget(100)
    peak, order = [0], []

    async def taker(name: str, nbytes: int) -> None:
        async with budget.take(nbytes):
            peak[0] = max(peak[0], budget.used)
            order.append(name)
            await trio.sleep(0.01)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(taker, f"small{i}", 40)
                await trio.sleep(0)
            nursery.start_soon(taker, "huge", 250)  # more than the whole budget: alone
            await trio.sleep(0)
            nursery.start_soon(taker, "late", 10)  # after the huge one, though it would fit

    trio.run(main)
    assert order.index("huge") < order.index("late")
    assert peak[0] == 250  # the huge one alone; the small ones two at a time (80)
    assert budget.used == 0
