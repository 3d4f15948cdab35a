"""The write-back cache: arenas, reference counts, budgets, backpressure, eviction, staged files.

A StagedFile is checked against a plain bytearray model under random writes, truncates and
reads; snapshots (committed Contents) must never change afterwards (copy on write).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading

import pytest
import trio
import trio.testing

from ckptfs.cache.arena import DISK, RAM, Tier
from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content, StagedFile
from tests.support.harness import trio_test

pytestmark = pytest.mark.unit

BS = 64 << 10  # block size: small, so files of a few blocks exercise every boundary


def make_cache(tmp_path, ram_blocks=4, disk_blocks=8) -> Cache:
    return Cache(tmp_path / "cache", tmp_path / "ram", BS, ram_blocks * BS, disk_blocks * BS)


@pytest.fixture
def cache(tmp_path):
    c = make_cache(tmp_path, ram_blocks=16, disk_blocks=256)
    yield c
    c.close()


def assert_all_free(cache: Cache) -> None:
    assert cache.refcounts == {}
    for tier in cache.tiers:
        assert sorted(tier.free) == list(range(tier.n_slots))
        assert tier.charged == {} and tier.charged_bytes == 0


class Model:
    """A StagedFile and the bytes it must hold."""

    def __init__(self, cache: Cache, base: tuple[Content, bytes] | None = None):
        self.staged = StagedFile(cache, base[0] if base else None)
        self.data = bytearray(base[1] if base else b"")

    async def write(self, offset: int, data: bytes) -> None:
        assert await self.staged.write(offset, data) == len(data)
        if offset > len(self.data):
            self.data.extend(bytes(offset - len(self.data)))
        self.data[offset : offset + len(data)] = data

    async def truncate(self, size: int) -> None:
        await self.staged.truncate(size)
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data.extend(bytes(size - len(self.data)))

    def check(self, rng: random.Random | None = None) -> None:
        assert self.staged.size == len(self.data)
        assert self.staged.read(0, len(self.data) + BS) == bytes(self.data)
        if rng is not None:  # a random window, possibly past the end
            offset = rng.randrange(0, len(self.data) + BS)
            length = rng.randrange(0, 3 * BS)
            assert self.staged.read(offset, length) == bytes(self.data[offset : offset + length])


async def random_session(cache: Cache, seed: int, steps: int, safe_truncates: bool) -> None:
    """Random writes (gaps past the end, spanning blocks), truncates, reads and snapshots.

    Every snapshot is held and re-checked at the end: later writes and truncates of the
    staged file must not have changed it. ``safe_truncates`` limits shrinks to block
    boundaries inside the allocated blocks, with no shrink once a snapshot shares the blocks.
    """
    rng = random.Random(seed)
    m = Model(cache)
    snapshots: list[tuple[Content, bytes]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.55:
            offset = rng.randrange(0, len(m.data) + 2 * BS)
            await m.write(offset, rng.randbytes(rng.randrange(1, BS + BS // 2)))
        elif r < 0.75:
            size = rng.randrange(0, len(m.data) + 2 * BS)
            if safe_truncates and size < len(m.data):
                if snapshots:
                    continue
                size = min(size // BS, len(m.staged.blocks)) * BS
            await m.truncate(size)
        elif r < 0.85 and len(snapshots) < 8:
            snap = m.staged.snapshot().hold()
            assert snap.size == len(m.data)
            assert snap.read(0, snap.size) == bytes(m.data)
            snapshots.append((snap, bytes(m.data)))
        else:
            m.check(rng)
    m.check()
    for snap, expected in snapshots:
        assert snap.size == len(expected)
        assert snap.read(0, snap.size + 1) == expected
        snap.release()
    m.staged.discard()
    assert_all_free(cache)


# -- StagedFile against the model -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_staged_file_matches_model(cache, seed):
    trio.run(random_session, cache, seed, 250, True)


@pytest.mark.parametrize("seed", range(12))  # 0 and 6 once found truncate bugs
def test_staged_file_matches_model_any_truncate(cache, seed):
    trio.run(random_session, cache, seed, 250, False)


@trio_test
async def test_writes_spanning_blocks_and_gaps(cache):
    m = Model(cache)
    await m.write(10, b"a" * (2 * BS))  # starts mid block 0, ends in block 2
    m.check()
    await m.write(5 * BS + 7, b"b" * 3)  # a gap past the end: blocks 3 and 4 are holes
    m.check()
    assert m.staged.blocks[3] is None and m.staged.blocks[4] is None
    await m.write(3 * BS + 100, b"c" * 10)  # into a hole, leaving a gap inside the block
    m.check()
    await m.write(BS - 1, b"xyz")  # across a block boundary
    m.check()
    snap = m.staged.snapshot().hold()
    assert snap.read(0, snap.size) == bytes(m.data)
    assert snap.blocks[4] is None  # holes stay holes in the content
    snap.release()
    m.staged.discard()
    assert_all_free(cache)


@trio_test
async def test_truncate_shrink_and_extend(cache):
    m = Model(cache)
    await m.write(0, bytes(range(256)) * (3 * BS // 256))
    await m.truncate(BS + 10)  # mid block 1: block 2 is freed
    m.check()
    assert len(m.staged.blocks) == 2
    await m.truncate(3 * BS)  # extend: the old bytes past BS + 10 must read as zeros
    m.check()
    await m.write(2 * BS, b"tail")
    m.check()
    await m.truncate(0)
    m.check()
    assert_all_free(cache)


# -- copy on write -----------------------------------------------------------------------------------


@trio_test
async def test_snapshot_is_immutable_copy_on_write(cache):
    m = Model(cache)
    await m.write(0, b"A" * (2 * BS + 100))
    snap = m.staged.snapshot().hold()
    v1 = bytes(m.data)
    shared = list(snap.blocks)
    assert m.staged.blocks == shared  # shared, not copied, at commit
    assert all(cache.refcounts[ref] == 2 for ref in shared)

    await m.write(BS + 5, b"B" * 10)  # block 1 is copied before the write
    await m.write(2 * BS + 50, b"C" * 200)  # partial last block: copied, then extended
    await m.truncate(2 * BS + 300)
    m.check()
    assert snap.read(0, snap.size) == v1
    assert m.staged.blocks[0] == shared[0]  # untouched block still shared
    assert m.staged.blocks[1] != shared[1] and m.staged.blocks[2] != shared[2]

    # A staged file opened on the content (reopen for writing) shares it the same way.
    m2 = Model(cache, (snap, v1))
    await m2.write(0, b"D")
    m2.check()
    assert snap.read(0, snap.size) == v1
    m2.staged.discard()
    m.staged.discard()
    assert snap.read(0, snap.size) == v1
    snap.release()
    assert_all_free(cache)


@trio_test
async def test_shrink_then_grow_does_not_change_committed_content(cache):
    m = Model(cache)
    await m.write(0, b"A" * 100)
    committed = m.staged.snapshot().hold()
    m.staged.discard()
    m = Model(cache, (committed, b"A" * 100))  # reopen for writing
    await m.truncate(10)
    await m.truncate(100)  # or any write past the block: the file grows again
    m.check()  # the staged file itself reads right
    m.staged.snapshot().hold()  # commit (or fsync) of the staged file
    assert committed.read(0, 100) == b"A" * 100


@trio_test
async def test_truncate_extend_then_shrink_inside_the_hole(cache):
    staged = StagedFile(cache)
    await staged.truncate(10 * BS)
    await staged.truncate(5 * BS)
    assert staged.size == 5 * BS
    assert staged.read(0, 10 * BS) == bytes(5 * BS)


# -- reference counts, tiers, budgets ------------------------------------------------------------------


@trio_test
async def test_content_release_frees_blocks(cache):
    s = StagedFile(cache)
    await s.write(0, b"x" * (3 * BS))
    content = s.snapshot()
    s.discard()
    assert [cache.refcounts[r] for r in content.refs()] == [1, 1, 1]
    content.hold()
    content.hold()
    content.release()
    assert len(cache.refcounts) == 3  # one holder left
    content.release()
    assert content.blocks == [None, None, None]
    assert_all_free(cache)


def test_ram_tier_fills_then_spills_to_disk(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=3, disk_blocks=4)
    try:
        refs = [cache.try_alloc() for _ in range(7)]
        assert [t for t, _ in refs] == [RAM] * 3 + [DISK] * 4
        assert len(set(refs)) == 7
        assert cache.try_alloc() is None  # full, nothing clean to evict
        usage = cache.usage()
        assert usage["ram"] == {"used": 3 * BS, "budget": 3 * BS}
        assert usage["disk"] == {"used": 4 * BS, "budget": 4 * BS}
        cache.decref(refs[1])
        assert cache.try_alloc() == refs[1]  # a freed RAM slot is reused first
        # Data lands where the slot is, on either tier.
        for i, ref in enumerate(refs):
            cache.write(ref, 0, bytes([i]) * 100)
        assert [cache.read(ref, 0, 100) for ref in refs] == [bytes([i]) * 100 for i in range(7)]
        for ref in refs:
            cache.decref(ref)
        assert_all_free(cache)
    finally:
        cache.close()


def test_small_files_cost_the_disk_budget_their_bytes_not_whole_blocks(tmp_path):
    """A committed file's last block is charged (and kept on disk) for the pages it holds: a
    directory of small files fits a disk budget of a few blocks, and the arena grows for it."""
    page = 4096
    cache = make_cache(tmp_path, ram_blocks=1, disk_blocks=8)
    disk = cache.tiers[DISK]
    sizes = [random.Random(n).randrange(1, 2 * page) for n in range(40)]  # 40 files of 1-2 pages
    cache.policy.releases_pending = lambda: False  # out of room: ENOSPC, not a wait

    async def main():
        contents, datas = [], []
        for n, size in enumerate(sizes):
            staged = StagedFile(cache)
            datas.append(random.Random(n).randbytes(size))
            await staged.write(0, datas[-1])
            contents.append(staged.snapshot())
            staged.discard()
        return contents, datas

    contents, datas = trio.run(main)
    try:
        assert disk.n_slots > 8  # more files than the budget has whole blocks
        on_disk = [c for c in contents if c.blocks[0][0] == DISK]
        assert len(on_disk) == 39  # one took the RAM slot
        assert disk.charged_bytes == sum(-(-c.size // page) * page for c in on_disk) <= disk.budget
        assert cache.usage()["disk"]["used"] == disk.charged_bytes
        assert [c.read(0, c.size) for c in contents] == datas
        # The filesystem holds only those pages too (the rest of each slot is a hole).
        assert os.stat(disk.path).st_blocks * 512 <= disk.charged_bytes + 16 * page
        # A whole block still needs a block's worth of room: 8 blocks minus at most 5 used leaves 3.
        assert cache.try_alloc() is not None and cache.try_alloc() is not None
    finally:
        cache.close()


def test_a_fitted_disk_block_written_past_its_end_is_charged_again(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=0, disk_blocks=2)
    try:
        ref = cache.try_alloc()
        cache.write(ref, 0, b"x" * 100)
        cache.fit(ref, 100)
        assert cache.charged(ref) == 4096
        cache.write(ref, 5000, b"y" * 5000)  # its content was dropped; a writer took it back
        assert cache.charged(ref) == 12288
        assert cache.read(ref, 5000, 5000) == b"y" * 5000
        cache.decref(ref)
        assert_all_free(cache)
    finally:
        cache.close()


def test_adopted_disk_blocks_are_charged_for_what_they_hold(tmp_path):
    async def write():
        cache = make_cache(tmp_path, ram_blocks=0, disk_blocks=4)
        staged = StagedFile(cache)
        await staged.write(0, b"z" * (BS + 10))
        content = staged.snapshot()
        cache.close()  # a crash
        return content.size, list(content.blocks)

    size, refs = trio.run(write)
    cache = make_cache(tmp_path, ram_blocks=0, disk_blocks=4)
    try:
        cache.adopt([(size, refs)])
        assert cache.usage()["disk"]["used"] == BS + 4096
        assert Content(cache, size, refs).hold().read(0, size) == b"z" * size
    finally:
        cache.close()


def test_only_forces_a_tier(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=2, disk_blocks=2)
    try:
        assert cache.try_alloc(only=DISK)[0] == DISK
        assert cache.try_alloc(only=RAM)[0] == RAM
        assert cache.try_alloc(only=DISK)[0] == DISK
        assert cache.try_alloc(only=DISK) is None  # RAM has room, but DISK was asked for
    finally:
        cache.close()


def test_backpressure_waits_for_a_decref(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=2, disk_blocks=2)

    async def main():
        held = [await cache.alloc() for _ in range(4)]
        got = []

        async def writer():
            got.append(await cache.alloc())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and cache.waiters == 1
            assert cache.usage()["writers_waiting"] == 1 and cache.usage()["space_waits"] == 1
            cache.incref(held[2])
            cache.decref(held[2])  # still referenced: no space yet
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            cache.decref(held[3])  # the last reference: the slot is free
        assert got == [held[3]] and cache.waiters == 0
        assert cache.usage()["space_waits"] == 1  # one allocation waited (however often it woke)
        for ref in held[:3] + got:
            cache.decref(ref)
        assert_all_free(cache)

    try:
        trio.run(main)
    finally:
        cache.close()


def test_a_writer_gets_enospc_after_write_timeout_with_nothing_freed(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=1, disk_blocks=1)
    cache.write_timeout = 0.5

    async def main():
        held = [await cache.alloc() for _ in range(2)]
        assert cache.try_alloc() is None  # full
        got, failed = [], []

        async def writer():
            try:
                got.append(await cache.alloc())
            except OSError as exc:
                failed.append((exc, trio.current_time() - started))

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            nursery.start_soon(writer)
            await trio.sleep(0.4)
            cache.incref(held[0])
            cache.decref(held[0])  # still referenced: nothing freed
            cache.decref(held[1])  # freed: one writer takes it, the other's timeout starts again
        assert got == [held[1]] and len(failed) == 1
        exc, waited = failed[0]
        assert exc.errno == errno.ENOSPC and "--write-timeout" in str(exc)
        assert 0.85 <= waited < 5, waited  # 0.4 s + a whole timeout after the block was freed
        assert cache.waiters == 0
        cache.decref(held[0])
        cache.decref(got[0])
        assert_all_free(cache)

    try:
        trio.run(main)
    finally:
        cache.close()


def test_clean_content_is_evicted_to_make_room(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=2, disk_blocks=2)

    async def main():
        s = StagedFile(cache)
        await s.write(0, b"c" * (2 * BS))  # fills RAM
        clean = s.snapshot().hold()
        s.discard()
        held = [await cache.alloc(), await cache.alloc()]  # fills disk
        assert [t for t, _ in held] == [DISK, DISK]
        evicted = []
        cache.mark_clean("clean-file", clean, lambda: evicted.append("clean-file"))
        assert cache.usage()["clean_bytes"] == 2 * BS

        ref = await cache.alloc()  # evicts the clean content rather than waiting
        assert evicted == ["clean-file"]
        assert clean.blocks == [None, None]
        assert ref[0] == RAM
        assert cache.usage()["clean_bytes"] == 0
        # Its other block went back to the free list.
        assert cache.try_alloc()[0] == RAM
        assert cache.try_alloc() is None

    try:
        trio.run(main)
    finally:
        cache.close()


def test_mark_clean_wakes_a_waiting_writer(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=1, disk_blocks=1)

    async def main():
        s = StagedFile(cache)
        await s.write(0, b"c" * 10)
        content = s.snapshot().hold()
        s.discard()
        other = await cache.alloc()
        evicted = []
        got = []

        async def writer():
            got.append(await cache.alloc())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            cache.mark_clean("f", content, lambda: evicted.append("f"))  # uploaded: may go
        assert evicted == ["f"] and len(got) == 1
        cache.unmark_clean("f")  # unknown owner now: no error
        cache.decref(other)
        cache.decref(got[0])
        assert_all_free(cache)

    try:
        trio.run(main)
    finally:
        cache.close()


def test_unmarked_content_is_not_evicted(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=1, disk_blocks=0)
    try:
        ref = cache.try_alloc()
        content = Content(cache, 10, [ref]).hold()
        cache.mark_clean("f", content, lambda: pytest.fail("evicted after unmark_clean"))
        cache.unmark_clean("f")  # reopened: it must stay
        assert cache.try_alloc() is None
        assert content.blocks == [ref]
    finally:
        cache.close()


# -- arenas outlive the Cache object -------------------------------------------------------------------


def test_arenas_survive_a_new_cache_object(tmp_path):
    data = random.Random(7).randbytes(5 * BS + 123)

    async def write():
        cache = make_cache(tmp_path, ram_blocks=2, disk_blocks=8)
        s = StagedFile(cache)
        await s.write(0, data)
        content = s.snapshot()
        refs = list(content.blocks)
        arena_id = cache.ram_arena_id
        cache.close()  # a crash: nothing released, nothing synced explicitly
        return refs, arena_id

    refs, arena_id = trio.run(write)
    assert {t for t, _ in refs} == {RAM, DISK}  # both tiers hold part of the file

    cache = make_cache(tmp_path, ram_blocks=2, disk_blocks=8)
    try:
        assert cache.ram_arena_id == arena_id  # same tmpfs arena: the RAM blocks are valid
        assert all(cache.valid_ref(r) for r in refs)
        cache.adopt([(len(data), refs)])
        content = Content(cache, len(data), refs).hold()
        assert content.read(0, len(data)) == data
        # Adopted slots are not handed out again; the others are.
        fresh = [cache.try_alloc() for _ in range(4)]
        assert None not in fresh and not set(fresh) & set(refs)
        assert cache.try_alloc() is None
        for ref in fresh:
            cache.decref(ref)
        content.release()
        assert_all_free(cache)
    finally:
        cache.close()


def test_new_ram_arena_gets_a_new_id(tmp_path):
    cache = make_cache(tmp_path)
    first = cache.ram_arena_id
    cache.close()
    for p in (tmp_path / "ram").iterdir():  # a reboot empties tmpfs
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    cache = make_cache(tmp_path)
    try:
        assert cache.ram_arena_id != first
    finally:
        cache.close()


def test_the_latest_checkpoint_is_evicted_last(tmp_path):
    """Clean data goes least recently used first, but the pinned (latest checkpoint) content
    only once nothing else is left."""
    cache = Cache(tmp_path / "c", tmp_path / "r", 4096, 3 * 4096, 0)
    contents = {}
    for owner in ("old-a", "latest", "old-b"):
        ref = cache.try_alloc()
        contents[owner] = Content(cache, 4096, [ref], in_store=True)
        cache.mark_clean(owner, contents[owner], lambda: None)
    cache.policy.pinned = lambda owner: owner == "latest"
    evicted = []
    for _ in range(3):
        assert cache.try_alloc() is not None
        evicted.append(next(o for o, c in contents.items() if c.blocks[0] is None and o not in evicted))
    assert evicted == ["old-a", "old-b", "latest"]


def test_a_read_moves_clean_data_to_the_end_of_the_eviction_order(tmp_path):
    """Least recently used, not first in first out: the oldest clean content, read since (the
    read path calls ``touch`` at every read of a file in the store), goes after the others; a
    touch of an owner with no clean data changes nothing."""
    cache = Cache(tmp_path / "c", tmp_path / "r", 4096, 3 * 4096, 0)
    contents = {}
    for owner in ("first", "second", "third"):
        ref = cache.try_alloc()
        contents[owner] = Content(cache, 4096, [ref], in_store=True)
        cache.mark_clean(owner, contents[owner], lambda: None)
    cache.touch("first")  # read: now the most recently used
    cache.touch("not-clean")
    evicted = []
    for _ in range(3):
        assert cache.try_alloc() is not None
        evicted.append(next(o for o, c in contents.items() if c.blocks[0] is None and o not in evicted))
    assert evicted == ["second", "third", "first"]  # (in insertion order: first, second, third)


@trio_test
async def test_the_ram_slots_of_the_next_save_are_touched_ahead(tmp_path):
    """After a save of 2 blocks, the 2 free RAM slots the next allocations take get their pages
    in the background (and no more: a small save does not touch the whole budget)."""
    from ckptfs.util.background import BackgroundThreads

    cache = make_cache(tmp_path, ram_blocks=6)
    ram = cache.tiers[RAM]

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run_populate, BackgroundThreads(1, "t"))
        first = [cache.try_alloc() for _ in range(2)]  # the first save takes fresh slots
        assert {slot for _, slot in first} == ram.touched
        cache.expect_writes(2 * cache.block_size)
        with trio.fail_after(10):
            while len(ram.touched) < 4:
                await trio.sleep(0.01)
        upcoming = {ram.free[-1], ram.free[-2]}
        assert upcoming <= ram.touched and len(ram.touched) == 4
        nxt = [cache.try_alloc() for _ in range(2)]
        assert {slot for _, slot in nxt} == upcoming  # what was touched is what the next save takes
        nursery.cancel_scope.cancel()
    cache.close()


def test_a_dropped_backing_file_leaves_the_directory_at_once_and_is_closed_off_the_loop(tmp_path):
    """Its unlink is immediate (a sweep or a listing never sees it); its last close, which frees
    its extents, runs in the cache's own thread, and ``close`` waits for it."""
    cache = make_cache(tmp_path)
    tier = cache.new_backing()
    os.pwrite(tier.fd, b"x" * 3 * BS, 0)
    fd, before = tier.fd, os.fstat(tier.fd)
    closed_by: list[str] = []
    close = tier.close
    tier.close = lambda remove: (closed_by.append(threading.current_thread().name), close(remove))  # type: ignore[method-assign]
    cache.drop_backing_if_unused(tier)  # (no writer, no block held: unused)
    assert not tier.path.exists() and tier.index not in cache.backing
    cache.close()
    try:  # (closed; or the number reused by another file since)
        after = os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF
    else:
        assert (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)
    assert len(closed_by) == 1 and closed_by[0].startswith("ckptfs-drop"), closed_by


# -- files fetched whole beside the RAM arena (issue 42) ------------------------------------------


def test_a_ram_slot_without_pages_waits_for_room_beside_files_fetched_whole(tmp_path):
    """A file fetched whole on the RAM tier's tmpfs takes pages of the budget: the arena then
    takes only slots that have their pages already, never the tmpfs past --ram-cache."""
    tier = Tier(RAM, tmp_path / "ram.arena", BS, 4 * BS, mapped=True)
    try:
        tier.reset_free(set())  # (taken from the end: 0 first)
        assert tier.back(3) and tier.back(2)
        tier.outside = 2 * BS
        assert sorted([tier.take(), tier.take()]) == [2, 3]
        assert tier.take() is None
    finally:
        tier.close()


def test_a_file_fetched_whole_lands_on_the_ram_tier_when_its_budget_has_room(tmp_path):
    cache = make_cache(tmp_path, ram_blocks=6, disk_blocks=8)
    try:
        refs = [cache.try_alloc() for _ in range(2)]  # two RAM slots get their pages, then go
        assert [ref[0] for ref in refs] == [RAM, RAM]
        for ref in refs:
            cache.decref(ref)
        first = cache.new_landing(3 * BS)
        assert first.home == RAM and first.path.parent == tmp_path / "ram" / "working"
        assert cache.tiers[RAM].outside == 3 * BS and cache.usage()["ram"]["used"] == 3 * BS
        second = cache.new_landing(2 * BS)  # (2 + 3 + 2 blocks of pages: past the budget)
        assert second.home == DISK and second.path.parent == tmp_path / "cache" / "working"
        cache.landed(first.index)  # (nothing landed in it: it goes, and its budget with it)
        assert cache.tiers[RAM].outside == 0 and not first.path.exists()
        cache.landed(second.index)
    finally:
        cache.close()
