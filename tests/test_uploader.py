"""The uploader: part sizes, puts and multipart uploads with xxh3 metadata, ordered publish,
cancel and retarget before publish, retries of transient store failures, journal ``done``.

Runs over a real LocalStore on tmp_path (wrapped in tests.support.faults.FaultyStore to hold or fail
calls), and once over the real S3 server of the test session.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
import xxhash

from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content, StagedFile
from ckptfs.cache.journal import PUT, Journal, Op
from ckptfs.objects.integrity import MANIFEST_META, UPLOAD_META, Checksums, manifest_key, part_hash
from ckptfs.parts import PartLayout, PartSchedule
from ckptfs.store import open_store
from ckptfs.store.base import MAX_PARTS
from ckptfs.store.local import LocalStore
from ckptfs.transfer.uploader import Uploader
from tests.support.faults import FaultyStore
from tests.support.harness import blob, trio_test

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
BS = 64 * KiB  # block size = base part size


# -- part layouts (the schedule itself: tests/test_part_layout.py) -----------------------------------


def test_files_up_to_max_parts_keep_the_uniform_layout():
    schedule = PartSchedule(8 * MiB, MAX_PARTS, 5 * GiB, 5 * TiB)
    for size in (0, 1, 8 * MiB * MAX_PARTS):  # exactly 10,000 parts
        assert schedule.layout(size) == PartLayout.uniform_of(8 * MiB)


def test_a_1_tib_file_grows_its_parts_within_max_parts():
    schedule = PartSchedule(8 * MiB, MAX_PARTS, 5 * GiB, 5 * TiB)
    layout = schedule.layout(TiB)
    assert not layout.uniform and layout.count(TiB) <= MAX_PARTS
    assert layout.size(0) == 8 * MiB and max(size for _, size in layout.runs) <= 5 * GiB


# -- an uploader over a local store -------------------------------------------------------------------


class Env:
    def __init__(self, tmp_path, block_size=BS, ram_blocks=16, disk_blocks=64, store=None):
        self.inner = store or LocalStore.at(tmp_path / "store")
        self.inner.check()
        self.store = FaultyStore(self.inner)
        self.cache = Cache(
            tmp_path / "cache",
            tmp_path / "ram",
            block_size,
            ram_blocks * block_size,
            disk_blocks * block_size,
        )
        self.journal_path = tmp_path / "cache" / "journal"
        self.journal = Journal(self.journal_path, self.cache.ram_arena_id)
        self.journal.open(*self.journal.replay())
        self.up = Uploader(self.store, self.cache, self.journal, block_size, concurrency=4)

    def close(self):
        self.store.open_all()
        self.journal.close()
        self.cache.close()

    async def commit(self, key: str, data: bytes, offset: int = 0):
        """What a close does: snapshot a staged file, journal a put, submit it."""
        staged = StagedFile(self.cache)
        if data:
            await staged.write(offset, data)
        content = staged.snapshot()
        staged.discard()
        op = self.journal.append(Op(PUT, key, size=content.size, blocks=list(content.blocks)))
        return self.up.submit(op, content)

    def assert_object(self, key: str, data: bytes, whole_file_hash: bool = True):
        info = self.inner.head(key)
        assert info is not None, f"{key} is not in the store"
        assert info.size == len(data)
        assert self.inner.get_range(key, 0, len(data) + 1) == data
        assert self.whole_file_hash(info) == (xxhash.xxh3_64(data).hexdigest() if whole_file_hash else None)

    def whole_file_hash(self, info) -> str | None:
        """The whole file's recorded xxh3: a multipart object's in its manifest (put once its
        parts are sent, the hash read beside them), a one-PUT object's in its metadata."""
        if info.metadata.get(MANIFEST_META):
            raw = self.inner.get_range(manifest_key(info.metadata[UPLOAD_META]), 0, 1 << 20)
            assert "xxh3" not in info.metadata  # (not known when the upload was created)
            return Checksums.from_manifest(raw, info.size).xxh3 or None
        return info.metadata.get("xxh3")

    def keys(self) -> set[str]:
        return {o.key for o in self.inner.list("") if not o.key.startswith(".ckptfs-manifest/")}

    def assert_journal_empty(self):
        assert Journal(self.journal_path, self.cache.ram_arena_id).replay() == ([], [])


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


@asynccontextmanager
async def running(env: Env, abort_uploads=()):
    async with trio.open_nursery() as nursery:
        await nursery.start(env.up.run, abort_uploads)
        try:
            yield env.up
        finally:
            env.store.open_all()  # never leave a worker thread held
        nursery.cancel_scope.cancel()


def test_small_and_multipart_files(env):
    files = {
        "empty.bin": b"",
        "small.bin": blob(1000, 1),
        "one-part.bin": blob(BS, 2),  # exactly one part: a plain put
        "dir/multi.bin": blob(5 * BS + 123, 3),  # six parts
    }

    async def main():
        async with running(env) as up:
            for key, data in files.items():
                await env.commit(key, data)
            await up.wait_durable(up.last_seq())
            assert up.pending_count() == 0 and up.pending_bytes() == 0
            assert up.durable_files == 4
        assert env.store.count("put") == 3 + 1  # and the multipart file's manifest
        assert env.store.count("upload_part") == 6
        assert env.store.count("complete_multipart") == 1
        # The manifest is written before the object appears.
        manifest = [i for i, (verb, key) in enumerate(env.store.calls) if key.startswith(".ckptfs-manifest/")]
        complete = env.store.calls.index(("complete_multipart", "dir/multi.bin"))
        assert len(manifest) == 1 and manifest[0] < complete

    trio.run(main)
    for key, data in files.items():
        env.assert_object(key, data)
    meta = env.inner.head("dir/multi.bin").metadata
    assert meta["ckptfs-part-size"] == str(BS)
    # Every part's xxh3 and the whole file's, in the manifest the object's metadata names.
    assert meta["ckptfs-manifest"] == "xxh3-64"
    raw = env.inner.get_range(".ckptfs-manifest/" + meta["ckptfs-upload"], 0, 1 << 20)
    checks = Checksums.from_manifest(raw, len(files["dir/multi.bin"]))
    data = files["dir/multi.bin"]
    assert checks.parts == [xxhash.xxh3_64_hexdigest(data[i : i + BS]) for i in range(0, len(data), BS)]
    assert checks.xxh3 == xxhash.xxh3_64_hexdigest(data) and checks.part_size == BS
    assert env.inner.list_multipart() == []
    assert env.cache.refcounts == {}  # published: the uploader released the contents
    env.assert_journal_empty()


@trio_test
async def test_a_files_holes_are_stored_as_zeros_without_being_read_hashed_or_sent(env):
    data = bytes(3 * BS + 10) + b"tail"  # blocks 0..2 were never written

    async with running(env) as up:
        task = await env.commit("sparse.bin", b"tail", offset=3 * BS + 10)
        assert task.content.blocks[:3] == [None, None, None]
        await up.wait_durable(up.last_seq())
        # The three hole parts are made by the store (a punched hole here, a copy on S3); only
        # the last part's bytes were sent, and no whole-file hash read the holes.
        assert env.store.count("upload_zero_part", "sparse.bin") == 3
        assert env.store.count("upload_part", "sparse.bin") == 1
        assert up.stored_bytes == 14
    env.assert_object("sparse.bin", data, whole_file_hash=False)
    upload = env.inner.head("sparse.bin").metadata[UPLOAD_META]
    checks = Checksums.from_manifest(env.inner.get_range(manifest_key(upload), 0, 1 << 20), len(data))
    assert checks.parts == [part_hash(data[i : i + BS]) for i in range(0, len(data), BS)]


@trio_test
async def test_a_hole_shorter_than_a_part_is_read_and_sent_as_usual(env):
    data = b"head" + bytes(2 * BS) + b"tail"  # block 1 is a hole, parts 1 and 3 are not

    async with running(env) as up:
        await env.commit("dense.bin", data)
        await up.wait_durable(up.last_seq())
        assert env.store.count("upload_zero_part", "dense.bin") == 0
    env.assert_object("dense.bin", data)


@trio_test
async def test_ordered_publish(env):
    first, second, third = blob(1000, 1), blob(2000, 2), blob(3 * BS, 3)
    gate = env.store.hold("put", "first.bin")

    async with running(env) as up:
        await env.commit("first.bin", first)
        t2 = await env.commit("second.bin", second)
        t3 = await env.commit("third.bin", third)
        await gate.entered()  # the publisher is stuck on the first file
        await t2.ready.wait()  # the later files are hashed, and the big one's parts are sent
        await t3.ready.wait()
        assert env.store.count("upload_part", "third.bin") == 3
        assert env.keys() == set()  # ... but nothing may appear before the first file
        assert up.pending_count() == 3
        gate.open()
        await up.wait_durable(t2.op.seq)
        assert {"first.bin", "second.bin"} <= env.keys()
        await up.wait_durable(up.last_seq())
    publishes = [
        c
        for c in env.store.calls
        if c[0] in ("put", "complete_multipart") and not c[1].startswith(".ckptfs-manifest/")
    ]
    assert publishes == [("put", "first.bin"), ("put", "second.bin"), ("complete_multipart", "third.bin")]
    for key, data in [("first.bin", first), ("second.bin", second), ("third.bin", third)]:
        env.assert_object(key, data)
    env.assert_journal_empty()


@trio_test
async def test_cancel_after_parts_sent_aborts_the_multipart_upload(env):
    gate = env.store.hold("put", "blocker.bin")

    async with running(env) as up:
        await env.commit("blocker.bin", b"x")
        task = await env.commit("big.bin", blob(3 * BS))
        await gate.entered()
        await task.ready.wait()
        assert len(env.inner.list_multipart()) == 1
        assert up.cancel(task.op.seq)
        assert not up.cancel(task.op.seq)  # gone already
        gate.open()
        await up.wait_durable(up.last_seq())
        # A bound, not a timing check: the abort never comes (it takes milliseconds when it does).
        await env.store.called("abort_multipart", guard_s=5)
    assert env.keys() == {"blocker.bin"}
    assert env.inner.list_multipart() == []


@trio_test
async def test_cancel_while_parts_upload_aborts_the_multipart_upload(env):
    gate = env.store.hold("upload_part", "big.bin")

    async with running(env) as up:
        task = await env.commit("big.bin", blob(3 * BS))
        small = await env.commit("small.bin", b"after")
        await gate.entered()  # parts are on their way
        assert len(env.inner.list_multipart()) == 1
        assert up.cancel(task.op.seq)
        gate.open()
        await env.store.called("abort_multipart")
        await up.wait_durable(small.op.seq)
    assert env.keys() == {"small.bin"}
    assert env.inner.list_multipart() == []
    assert env.cache.refcounts == {}  # the cancelled content was released
    env.assert_journal_empty()


@trio_test
async def test_cancel_small_file_before_publish(env):
    gate = env.store.hold("put", "blocker.bin")

    async with running(env) as up:
        await env.commit("blocker.bin", b"x")
        task = await env.commit("small.bin", b"never")
        await gate.entered()
        assert up.cancel(task.op.seq)
        gate.open()
        await up.wait_durable(up.last_seq())
    assert env.keys() == {"blocker.bin"}
    assert env.store.count("put", "small.bin") == 0
    env.assert_journal_empty()


@trio_test
async def test_retarget_before_publish(env):
    small, big = blob(500, 1), blob(4 * BS + 7, 2)
    gate = env.store.hold("put", "blocker.bin")

    async with running(env) as up:
        await env.commit("blocker.bin", b"x")
        t_small = await env.commit("tmp/small.bin", small)
        t_big = await env.commit("tmp/big.bin", big)
        await gate.entered()
        await t_big.ready.wait()  # parts already sent under the old key
        assert up.retarget(t_small.op.seq, "final/small.bin")
        assert up.retarget(t_big.op.seq, "final/big.bin")
        gate.open()
        await up.wait_durable(up.last_seq())
        assert not up.retarget(t_big.op.seq, "too-late")  # published: no longer pending
    assert {k for k in env.keys() if not k.endswith("/")} == {
        "blocker.bin",
        "final/small.bin",
        "final/big.bin",
    }
    env.assert_object("final/small.bin", small)
    env.assert_object("final/big.bin", big)
    assert env.inner.list_multipart() == []  # the upload under the old key was aborted
    env.assert_journal_empty()


@trio_test
async def test_transient_failures_are_retried(env):
    big, small = blob(4 * BS, 5), blob(100, 6)
    env.store.fail("upload_part", 3)
    env.store.fail("put", 2, key="small.bin")

    async with running(env) as up:
        await env.commit("big.bin", big)
        await env.commit("small.bin", small)
        await up.wait_durable(up.last_seq())
    env.assert_object("big.bin", big)
    env.assert_object("small.bin", small)
    assert env.store.count("upload_part") == 4 + 3
    assert env.store.count("put", "small.bin") == 1 + 2
    errors = list(env.up.errors)
    assert len(errors) == 5
    assert sorted(e["key"] for e in errors) == ["big.bin"] * 3 + ["small.bin"] * 2
    assert all("injected failure" in e["message"] for e in errors)
    env.assert_journal_empty()


@trio_test
async def test_journal_records_done(env):
    async with running(env) as up:
        for i in range(3):
            await env.commit(f"f{i}", blob(10 + i, i))
        await up.wait_durable(up.last_seq())
    text = env.journal_path.read_text()
    assert text.count('"t":"done"') == 3
    env.assert_journal_empty()


def test_pending_ops_resume_after_restart(tmp_path):
    """Ops left in the journal by a daemon that died are applied by the next one, and the
    multipart upload it had open is aborted."""
    data = blob(3 * BS + 1, 9)
    env = Env(tmp_path)
    env.store.fail("complete_multipart", 10**9)  # the first daemon never gets to publish

    async def first_life():
        async with running(env):
            await env.commit("big.bin", data)
            await env.commit("small.bin", b"small")
            await env.store.called("complete_multipart")
        # leaving the nursery cancels the uploader: the daemon is gone

    trio.run(first_life)
    blocks = [list(t.op.blocks) for t in env.up.pending.values()]
    env.close()
    assert env.keys() == set()
    assert len(env.inner.list_multipart()) == 1

    env2 = Env(tmp_path)
    pending, uploads = Journal(env2.journal_path, env2.cache.ram_arena_id).replay()
    assert [op.key for op in pending] == ["big.bin", "small.bin"]
    assert [op.blocks for op in pending] == blocks
    assert [key for _, key, _ in uploads] == ["big.bin"]
    env2.cache.adopt((op.size, op.blocks) for op in pending)
    env2.journal.open(pending, uploads)

    async def second_life():
        async with running(env2, uploads) as up:
            for op in pending:
                up.submit(op, Content(env2.cache, op.size, list(op.blocks)))
            await up.wait_durable(max(op.seq for op in pending))
            await env2.store.called("abort_multipart")

    try:
        trio.run(second_life)
        env2.assert_object("big.bin", data)
        env2.assert_object("small.bin", b"small")
        assert env2.inner.list_multipart() == []
        assert env2.cache.refcounts == {}
        env2.assert_journal_empty()
    finally:
        env2.close()


# -- the real S3 server ----------------------------------------------------------------------------------


def test_multipart_upload_to_s3(tmp_path, s3_server, s3_bucket):
    bs = 5 * MiB  # S3's minimum part size
    data = blob(12 * MiB + 321, 11)
    s3 = open_store(f"s3://{s3_bucket}/ckpt", endpoint_url=s3_server.endpoint)
    s3.check()
    env = Env(tmp_path, block_size=bs, ram_blocks=2, disk_blocks=4, store=s3)

    async def main():
        async with running(env) as up:
            task = await env.commit("step-100/model.pt", data)
            await env.commit("latest", b"step-100")
            await up.wait_durable(up.last_seq())
            assert task.multipart and task.layout == PartLayout.uniform_of(bs)

    try:
        trio.run(main)
        assert env.store.count("upload_part") == 3
        env.assert_object("step-100/model.pt", data)
        env.assert_object("latest", b"step-100")
        assert s3.list_multipart() == []
        env.assert_journal_empty()
    finally:
        env.close()
        s3.close()
