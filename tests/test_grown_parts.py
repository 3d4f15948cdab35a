"""Files of more than 10,000 parts at their starting part size (issue 28): streamed through a cache
smaller than themselves, they take the grown part layout (ckptfs/parts.py) and are stored, made
durable and read back whole through a fresh mount (an empty cache: every byte fetched and checked
against the manifest's part checksums).

- The local store through FUSE, scaled down: ``--part-size 4KiB`` (10,000 parts are 40 MiB), a
  44 MiB file, an 8 MiB cache with no RAM tier; the same with a real ``torch.save``/``torch.load``.
- S3 (the test Swift server): its smallest part is 5 MiB, so a real 10,001-part file is 50 GiB.
  The same schedule is run with a store whose ``StoreLimits.max_parts`` is lowered to 20 (an
  instance attribute of the store, nothing else changed), in-process (``build_core``, as the
  daemon builds it: a FUSE daemon has no way to be handed a store object): a 130 MiB file of
  5 MiB parts through an 80 MiB cache, read back by a second in-process mount with a fresh cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import trio
import xxhash

from ckptfs.daemon.wiring import build_core
from ckptfs.model.tree import ROOT_INODE
from ckptfs.objects import integrity
from ckptfs.parts import PartLayout
from ckptfs.store import open_store
from ckptfs.store.base import S3_LIMITS
from tests.support import inprocess
from tests.support.faults import FaultyStore
from tests.support.harness import blob, stored

UID, GID = os.getuid(), os.getgid()

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.timeout(900)


def _manifest(store_url: str, endpoint: str | None, key: str) -> dict:
    backend = open_store(store_url, endpoint)
    try:
        head = backend.head(key)
        assert head is not None
        upload = head.metadata[integrity.UPLOAD_META]
        return json.loads(backend.get_range(integrity.manifest_key(upload), 0, integrity.MANIFEST_MAX))
    finally:
        backend.close()


def _write_sequentially(path, data: bytes, chunk: int = 1 * MiB) -> None:
    with open(path, "wb") as f:
        for offset in range(0, len(data), chunk):
            f.write(data[offset : offset + chunk])


def _xxh3_of(path) -> str:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            hasher.update(chunk)
    return hasher.hexdigest()


SMALL = dict(ram_cache="0", cache_size="8MiB", extra=("--part-size", "4KiB"))


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_file_of_more_than_10000_parts_streams_through_a_small_cache(store, mount_factory):
    size = 44 * MiB + 12_345  # 11,268 blocks of 4 KiB: past 10,000 parts, 5.5 times the cache
    data = blob(size, 28)
    m = mount_factory("w", **SMALL).start()
    _write_sequentially(m.path / "big.bin", data)
    m.sync()
    assert m.status()["pending"] == {"files": 0, "bytes": 0}
    m.stop()

    assert stored(store, "big.bin").size == size
    manifest = _manifest(store.url, store.endpoint, "big.bin")
    layout = PartLayout.from_json(manifest["runs"])  # the grown layout, recorded
    assert manifest["part_size"] == 4 * KiB and layout.size(0) == 4 * KiB
    assert len(manifest["parts"]) == layout.count(size) <= 10_000

    other = mount_factory("r", **SMALL).start()  # a fresh cache dir: every byte from the store
    assert _xxh3_of(other.path / "big.bin") == xxhash.xxh3_64_hexdigest(data)
    assert os.getxattr(other.path / "big.bin", "user.ckptfs.verified") == b"yes"


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_torch_save_of_more_than_10000_parts_loads_back(store, mount_factory):
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(28)
    state = {
        "embed.weight": torch.randn(2048, 2048, generator=generator),  # 16 MiB
        "layers.0.weight": torch.randn(2048, 2048, generator=generator).to(torch.bfloat16),  # 8 MiB
        "layers.1.weight": torch.randn(2048, 2560, generator=generator),  # 20 MiB
        "step": torch.tensor(28),
    }
    m = mount_factory("w", **SMALL).start()
    torch.save(state, m.path / "model.pt")
    m.sync()
    m.stop()
    size = stored(store, "model.pt").size
    assert size > 10_000 * 4 * KiB
    assert "runs" in _manifest(store.url, store.endpoint, "model.pt")

    other = mount_factory("r", **SMALL).start()
    loaded = torch.load(other.path / "model.pt", weights_only=True)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def _s3_core(tmp_path, store, cache_size: int):
    config = replace(
        inprocess.config(tmp_path),
        part_size=5 * MiB,
        ram_cache=0,
        cache_size=cache_size,
        upload_concurrency=2,
    )
    return build_core(config, store, tmp_path / "cache", tmp_path / "ram", check_ram_room=False)


@pytest.mark.store
def test_s3_the_same_schedule_with_max_parts_lowered(tmp_path, s3_server, s3_bucket):
    limits = replace(S3_LIMITS, max_parts=20)  # 20 parts of 5 MiB: 100 MiB before parts grow

    def s3():
        backend = open_store(f"s3://{s3_bucket}/grown", endpoint_url=s3_server.endpoint)
        backend.limits = limits  # (the one change: the store declares fewer parts)
        return backend

    size = 130 * MiB + 4321  # 10 parts of 5 MiB, then 10, 20, 40 MiB and the last
    data = blob(size, 2828)
    writer_store, reader_store = s3(), s3()

    async def write():
        core = _s3_core(tmp_path / "w", writer_store, 80 * MiB)  # 16 blocks: less than the file
        try:
            async with trio.open_nursery() as nursery:
                await core.start(nursery)
                core.load(list(writer_store.list("")))
                ns = core.namespace
                handle, _ = ns.create(ROOT_INODE, "big.bin", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
                await inprocess.write_blocks(ns, handle.fh, data, chunk=1 * MiB)
                ns.flush(handle.fh)
                ns.release(handle.fh)
                await core.uploader.wait_durable(core.uploader.last_seq())
                assert core.uploader.sender.streamed_bytes > 0
                nursery.cancel_scope.cancel()
        finally:
            core.close()

    async def read() -> bytes:
        core = _s3_core(tmp_path / "r", reader_store, 80 * MiB)
        try:
            async with trio.open_nursery() as nursery:
                await core.start(nursery)
                core.load(list(reader_store.list("")))
                ns = core.namespace
                node = ns.lookup(ROOT_INODE, "big.bin").ino
                handle, *_ = await ns.open(node, os.O_RDONLY)
                out = bytearray()
                while chunk := await ns.read(handle.fh, len(out), 1 * MiB):
                    out += chunk
                ns.release(handle.fh)
                nursery.cancel_scope.cancel()
                return bytes(out)
        finally:
            core.close()

    try:
        trio.run(write)
        head = writer_store.head("big.bin")
        assert head is not None and head.size == size
        manifest = json.loads(
            writer_store.get_range(
                integrity.manifest_key(head.metadata[integrity.UPLOAD_META]), 0, integrity.MANIFEST_MAX
            )
        )
        layout = PartLayout.from_json(manifest["runs"])
        assert layout.size(0) == 5 * MiB and len(manifest["parts"]) == layout.count(size) <= 20
        assert writer_store.list_multipart() == []
        got = trio.run(read)
        assert xxhash.xxh3_64_hexdigest(got) == xxhash.xxh3_64_hexdigest(data)
    finally:
        writer_store.close()
        reader_store.close()


@pytest.mark.unit
@pytest.mark.parametrize("crash", ["before_completion", "after_completion"])
def test_a_restart_completes_a_grown_upload_whose_parts_were_evicted(tmp_path, local, crash):
    """kill -9 after the commit of a file streamed in the grown layout through a full cache (its
    evicted parts, of several blocks each, exist only in the multipart upload): the journal names
    them by part, and the next run completes that upload (or finds it complete). In-process, a
    local store declaring 40 parts (64 KiB blocks: parts grow past 2.5 MiB)."""
    local.limits = replace(local.limits, max_parts=40)
    store = FaultyStore(local)
    store.limits = local.limits
    data = blob(100 * inprocess.BS + 3, 28)  # more than the whole cache (80 blocks)

    async def first_run():
        async with inprocess.mounted(tmp_path, store) as m:
            if crash == "before_completion":
                store.fail("complete_multipart", 10**6)
            else:
                gate = store.hold("complete_multipart")  # completes, but the journal never hears it
            handle, _ = m.ns.create(ROOT_INODE, "big.bin", 0o644, os.O_WRONLY, UID, GID)
            await inprocess.write_blocks(m.ns, handle.fh, data, chunk=inprocess.BS)
            assert any(index >= m.uploader.schedule.shared for index in handle.staged.remote)
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
            parts = m.uploader.schedule.grown.count(len(data))
            await store.called("upload_part", parts)  # every part is in (some sent twice: fine)
            if crash == "after_completion":
                await gate.entered()

    async def second_run():
        async with inprocess.mounted(tmp_path, store) as m:
            await inprocess.sync(m)
            assert inprocess.store_files(store) == {"big.bin": data}
            assert local.list_multipart() == []
            assert await inprocess.read_in_pieces(m.ns, "big.bin") == data

    async def fresh_mount_reads_each_part_once():
        async with inprocess.mounted(tmp_path / "fresh", store) as m:
            before = store.done["get_range_meta"] + store.done["get_range"]
            assert await inprocess.read_in_pieces(m.ns, "big.bin") == data
            gets = store.done["get_range_meta"] + store.done["get_range"] - before
            # One GET per part (read-ahead of a part's blocks shares it), the manifest, and the
            # first block read before the checksums were known.
            assert gets <= m.uploader.schedule.grown.count(len(data)) + 3

    trio.run(first_run)
    store.fail("complete_multipart", 0)
    store._gates.clear()
    trio.run(second_run)
    (tmp_path / "fresh").mkdir()
    trio.run(fresh_mount_reads_each_part_once)
    manifest = json.loads(
        local.get_range(
            integrity.manifest_key(local.head("big.bin").metadata[integrity.UPLOAD_META]), 0, 1 << 20
        )
    )
    assert "runs" in manifest and len(manifest["parts"]) <= 40
