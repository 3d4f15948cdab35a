"""A compressed upload whose parts were evicted from the cache while the file was written (they
then exist only in the multipart upload): it completes, also after a restart of a mount without
--compress. On the namespace with its uploader, over the local store (tests/support/inprocess.py)."""

from __future__ import annotations

import errno

import pytest
import trio

from ckptfs.model.tree import ROOT_INODE
from ckptfs.objects import compression, integrity
from ckptfs.objects.logical_store import LogicalStore
from tests.support.faults import FaultyStore
from tests.support.harness import blob, trio_test
from tests.support.inprocess import BS, GID, UID, WRITE, aerr, mounted, sync, write_blocks

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def decoded(store, key: str) -> bytes:
    """The file's bytes from its compressed object (its frames, per its manifest)."""
    info = LogicalStore(store).head(key)
    assert info.metadata.get(compression.FORMAT_META) == compression.FORMAT
    checks = integrity.load_checksums(store, info.size, info.metadata)
    stored = store.head(key).size
    data = checks.decompress(0, len(checks.parts), store.get_range(key, 0, stored))
    checks.check(0, data)
    return data


def compressing(m) -> None:
    m.uploader.codec = compression.Codec(1)


@trio_test
async def test_a_compressed_file_cannot_be_cut_back_to_an_evicted_last_block(tmp_path, local):
    """A file written past a block that was then sent and evicted (the cache was full): a
    compressed upload sends its last part again at commit, with the seek table after it, so an
    ftruncate that would make an evicted block the last one fails (EIO, as a write to it does)
    instead of leaving an upload that can never complete. Both files complete as written."""
    store = FaultyStore(local)
    files = {"a.bin": blob(20 * BS + 100, 1), "b.bin": blob(79 * BS + 9, 2)}

    async with mounted(tmp_path, store) as m:
        compressing(m)
        handles = {}
        for name, data in files.items():
            handles[name], _ = m.ns.create(ROOT_INODE, name, 0o644, WRITE, UID, GID)
            await write_blocks(m.ns, handles[name].fh, data, chunk=BS)
            with trio.fail_after(30):  # (every block written past is sent: each may be evicted)
                while len(handles[name].stream.sent) < len(data) // BS:
                    await trio.sleep(0.01)
        a = handles["a.bin"]
        assert 19 in a.staged.remote  # (the case: that part lives only in a's upload)
        assert await aerr(m.ns.setattr, a.node.ino, a.fh, 20 * BS) == errno.EIO
        for handle in handles.values():
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
        with trio.fail_after(60):
            await sync(m)
        assert {name: decoded(local, name) for name in files} == files
        assert local.list_multipart() == []


def test_a_compressed_upload_with_evicted_parts_completes_after_a_restart_without_compress(tmp_path, local):
    store = FaultyStore(local)
    data = blob(100 * BS + 3, 20)  # more than the whole cache

    async def first_run():
        async with mounted(tmp_path, store) as m:
            compressing(m)
            store.fail("complete_multipart", 10**6)
            handle, _ = m.ns.create(ROOT_INODE, "big.bin", 0o644, WRITE, UID, GID)
            await write_blocks(m.ns, handle.fh, data, chunk=BS)
            assert handle.staged.remote
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
            await store.called("upload_part", 101)  # every part is in

    async def second_run():  # (no codec: this mount does not compress)
        async with mounted(tmp_path, store) as m:
            with trio.fail_after(60):
                await sync(m)
            assert decoded(local, "big.bin") == data
            assert local.list_multipart() == []

    trio.run(first_run)
    store.fail("complete_multipart", 0)
    trio.run(second_run)
