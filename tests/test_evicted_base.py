"""Issue 28's silent corruption: a version committed with blocks evicted to its multipart upload
(a writer streamed it through a full cache) is the base of a new working copy (reopened for
writing, or truncate(path)) before that upload completes. Its evicted blocks are neither cached
nor in the store's object yet: the copy must wait for the upload, never take them for holes
(which committed zeros where the file had data: the random writer of tests/test_random_writer.py,
whose writes ended inside a block the previous version had evicted)."""

from __future__ import annotations

import pytest
import trio

from ckptfs.model.tree import ROOT_INODE
from tests.support.faults import FaultyStore
from tests.support.harness import blob, trio_test
from tests.support.inprocess import BS, GID, UID, WRITE, mounted, store_files, sync, write_blocks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("change", ["reopen", "truncate"])
@trio_test
async def test_a_copy_of_a_version_with_evicted_blocks_waits_for_its_upload(tmp_path, local, change):
    store = FaultyStore(local)
    other, data = blob(40 * BS, 1), blob(50 * BS + 3, 2)  # together more than the cache's 80 blocks
    async with mounted(tmp_path, store) as m:
        ns = m.ns
        held = store.hold("complete_multipart", "other.bin")  # its blocks stay until it is stored
        handle, _ = ns.create(ROOT_INODE, "other.bin", 0o644, WRITE, UID, GID)
        await write_blocks(ns, handle.fh, other, chunk=BS)
        ns.flush(handle.fh)
        ns.release(handle.fh)
        await held.entered()
        completing = store.hold("complete_multipart", "f.bin")
        handle, attr = ns.create(ROOT_INODE, "f.bin", 0o644, WRITE, UID, GID)
        await write_blocks(ns, handle.fh, data, chunk=BS)  # a sequential writer: streamed, evicted
        assert handle.staged.remote, "the cache never filled: no block of f.bin was evicted"
        ns.flush(handle.fh)
        ns.release(handle.fh)  # committed, its evicted blocks only in the upload, not completed
        held.open()

        async def complete_upload():
            await completing.entered()
            completing.open()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete_upload)
            if change == "reopen":
                handle, *_ = await ns.open(attr.ino, WRITE)
                assert await ns.write(handle.fh, 1, b"new") == 3
                ns.flush(handle.fh)
                ns.release(handle.fh)
                expected = data[:1] + b"new" + data[4:]
            else:
                await ns.setattr(attr.ino, None, size=len(data) - 1)
                expected = data[:-1]
        await sync(m)
        stored = store_files(store)
        assert stored.keys() == {"other.bin", "f.bin"} and stored["other.bin"] == other
        assert len(stored["f.bin"]) == len(expected)
        wrong = [
            i // BS
            for i in range(0, len(expected), BS)
            if stored["f.bin"][i : i + BS] != expected[i : i + BS]
        ]
        zeros = [stored["f.bin"][i * BS : (i + 1) * BS].count(0) for i in wrong[:3]]
        assert not wrong, f"blocks {wrong} of f.bin differ (zero bytes in the first: {zeros})"
