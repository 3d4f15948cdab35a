"""The fetcher on its own: a Cache, a LocalStore behind tests/support/faults.py's FaultyStore, no mount.

Range math (a block, the short last block), whole-part fetches checked against the object's
checksums (one-PUT metadata or a manifest), a range bent on the wire fetched again, one that
never matches failing with EIO, transient store failures retried, one fetch per block however
many readers ask, a read following its object's move, and --read-timeout giving up in an outage.
"""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.errors import FsError
from ckptfs.objects import integrity
from ckptfs.objects.integrity import Checksums
from ckptfs.store.local import LocalStore
from ckptfs.transfer.fetcher import READ_ATTEMPTS, VERIFY_ATTEMPTS, Fetcher
from tests.support.faults import FaultyStore
from tests.support.harness import blob, run_trio, trio_test

pytestmark = pytest.mark.unit

BS = 64 << 10


class BentStore(FaultyStore):
    """Flips one byte in the bodies of the next ``bends`` GETs (a fault on the wire)."""

    def __init__(self, inner, bends: int = 0):
        super().__init__(inner)
        self.bends = bends

    def get_range_meta(self, key, start, length):
        data, metadata = super().get_range_meta(key, start, length)
        if self.bends > 0 and data and not integrity.is_reserved(key):
            self.bends -= 1
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data, metadata


@pytest.fixture
def cache(tmp_path):
    c = Cache(tmp_path / "cache", tmp_path / "ram", BS, 16 * BS, 64 * BS)
    yield c
    c.close()


@pytest.fixture
def object_store(tmp_path):
    return BentStore(LocalStore.at(tmp_path / "store"))


def content_of(cache: Cache, key: str, size: int) -> Content:
    c = Content(cache, size, [None] * -(-size // BS), in_store=True).hold()
    c.key = key
    return c


def put_one(object_store, key: str, data: bytes) -> None:
    """As a one-PUT upload writes it: the whole file's xxh3 in its metadata."""
    object_store.inner.put(key, data, {integrity.XXH3_META: integrity.part_hash(data)})


def put_with_manifest(object_store, key: str, data: bytes, part_size: int, upload: str = "u1") -> None:
    """As a multipart upload writes it: part checksums in a manifest the object's metadata names."""
    parts = [integrity.part_hash(data[i : i + part_size]) for i in range(0, len(data), part_size)]
    manifest = Checksums(len(data), part_size, parts, integrity.part_hash(data), upload, "manifest")
    object_store.inner.put(integrity.manifest_key(upload), manifest.to_manifest())
    object_store.inner.put(
        key, data, {integrity.MANIFEST_META: integrity.ALGORITHM, integrity.UPLOAD_META: upload}
    )


def cached(content: Content) -> list[int]:
    return [i for i, ref in enumerate(content.blocks) if ref is not None]


@trio_test
async def test_a_block_and_the_short_last_block_read_back_exactly(cache, object_store):
    data = blob(3 * BS + 1234, 1)
    object_store.inner.put("f.bin", data)  # no checksums: each block is its own range
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)

    await fetcher.fill(c, [1])
    assert cached(c) == [1]
    await fetcher.fill(c, [3])
    assert cached(c) == [1, 3]
    assert c.read(BS, BS) == data[BS : 2 * BS]
    assert c.read(3 * BS, 2 * BS) == data[3 * BS :]
    assert object_store.count("get_range") == 2 and fetcher.unverified_reads == 2
    assert c.missing(0, len(data)) == [0, 2]


@trio_test
async def test_a_one_put_object_is_fetched_whole_and_checked(cache, object_store):
    data = blob(3 * BS + 7, 2)
    put_one(object_store, "f.bin", data)
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)

    await fetcher.fill(c, [2])
    gets = object_store.count("get_range")
    await fetcher.fill(c, [0, 1, 3])  # all cached by the first fill: no GET
    assert object_store.count("get_range") == gets
    assert cached(c) == [0, 1, 2, 3]
    assert c.read(0, len(data)) == data
    assert (
        c.checksums.source == "metadata" and fetcher.unverified_reads == 0 and fetcher.integrity_retries == 0
    )


@trio_test
async def test_a_multipart_object_is_fetched_in_whole_parts_from_its_manifest(cache, object_store):
    data = blob(5 * BS + 99, 3)
    put_with_manifest(object_store, "f.bin", data, part_size=2 * BS)
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)

    await fetcher.fill(c, [3])  # part 2: blocks 2-3
    assert cached(c) == [2, 3]
    await fetcher.fill(c, [5])  # the last part: block 4 and the short block 5
    assert cached(c) == [2, 3, 4, 5]
    assert c.read(2 * BS, 2 * BS) == data[2 * BS : 4 * BS] and c.read(4 * BS, 2 * BS) == data[4 * BS :]
    assert c.checksums.source == "manifest" and c.checksums.upload == "u1"
    assert object_store.count("get_range", integrity.manifest_key("u1")) == 1  # the manifest is read once


def test_a_range_bent_on_the_wire_is_fetched_again(cache, object_store):
    data = blob(BS, 4)  # one block: the first GET is already the whole part, and checked
    put_one(object_store, "f.bin", data)
    object_store.bends = VERIFY_ATTEMPTS - 1
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)
    run_trio(lambda: fetcher.fill(c, [0]))
    assert c.read(0, len(data)) == data
    assert fetcher.integrity_retries == VERIFY_ATTEMPTS - 1 and not fetcher.integrity_errors


def test_bytes_that_never_match_fail_with_eio_and_are_never_cached(cache, object_store):
    data = blob(2 * BS, 5)
    object_store.inner.put("f.bin", data, {integrity.XXH3_META: integrity.part_hash(b"other bytes")})
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)
    with pytest.raises(FsError) as exc:
        run_trio(lambda: fetcher.fill(c, [1]))
    assert exc.value.errno == errno.EIO and "integrity" in str(exc.value)
    assert cached(c) == [] and cache.refcounts == {}
    assert [e["key"] for e in fetcher.integrity_errors] == ["f.bin"]


def test_transient_store_failures_are_retried(cache, object_store):
    data = blob(BS, 6)
    object_store.inner.put("f.bin", data)
    object_store.fail("get_range", READ_ATTEMPTS - 1)
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=2)
    run_trio(lambda: fetcher.fill(c, [0]))
    assert c.read(0, BS) == data and object_store.count("get_range") == READ_ATTEMPTS


def test_a_store_that_keeps_failing_fails_the_read_with_its_errno(cache, object_store):
    object_store.inner.put("f.bin", blob(BS, 7))
    object_store.fail("get_range", READ_ATTEMPTS)
    c = content_of(cache, "f.bin", BS)
    fetcher = Fetcher(object_store, cache, concurrency=2)
    with pytest.raises(FsError) as exc:
        run_trio(lambda: fetcher.fill(c, [0]))
    assert exc.value.errno == errno.EIO and object_store.count("get_range") == READ_ATTEMPTS
    assert cached(c) == [] and fetcher.health.errors()


@trio_test
async def test_readers_of_one_block_share_one_fetch(cache, object_store):
    data = blob(2 * BS, 8)
    object_store.inner.put("f.bin", data)
    c = content_of(cache, "f.bin", len(data))
    fetcher = Fetcher(object_store, cache, concurrency=4)
    gate = object_store.hold("get_range", "f.bin")

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(fetcher.fill, c, [1])
        await gate.entered()
        await trio.testing.wait_all_tasks_blocked()
        gate.open()
    assert object_store.count("get_range") == 1 and c.read(BS, BS) == data[BS:]


@trio_test
async def test_a_read_follows_its_object_to_the_key_a_rename_moved_it_to(cache, object_store):
    data = blob(BS, 9)
    object_store.inner.put("new.bin", data)
    c = content_of(cache, "old.bin", len(data))  # the move (copy, delete) already happened
    fetcher = Fetcher(object_store, cache, concurrency=2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetcher.fill, c, [0])
        await object_store.called("get_range")  # NotFound at the old key: the reader waits
        c.key = "new.bin"  # what the namespace does once the move is durable
    assert c.read(0, BS) == data and object_store.count("get_range", "new.bin") == 1


def test_read_timeout_gives_up_with_eio_while_the_store_is_in_trouble(cache, object_store):
    object_store.inner.put("f.bin", blob(BS, 10))
    c = content_of(cache, "f.bin", BS)
    fetcher = Fetcher(object_store, cache, concurrency=2)
    fetcher.read_timeout = 0.5
    gate = object_store.hold("get_range", "f.bin")
    failure: list[FsError] = []

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)

            async def reader():
                try:
                    await fetcher.fill(c, [0])
                except FsError as exc:
                    failure.append(exc)
                nursery.cancel_scope.cancel()

            nursery.start_soon(reader)
            await gate.entered()
            fetcher.health.failed("write", "other.bin", "EIO: injected outage")  # the store is down

    try:
        run_trio(main)
    finally:
        gate.open()  # let the abandoned GET thread end
    assert len(failure) == 1 and failure[0].errno == errno.EIO and "--read-timeout" in str(failure[0])
    assert cached(c) == []
