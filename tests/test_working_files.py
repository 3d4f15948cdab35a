"""Working copies that are files of their own (cache/backing.py), in process: the kernel's
passthrough writes are stood in for by ``os.pwrite`` on the working file's fd, which is what the
kernel does to it. The namespace must then see the size and mtime from the file, commit the file
as the version, stream its parts by tailing it and keep only the ones still unchanged at the
commit (model/tailing.py), hold the file while any version or upload names it, survive a
restart through the journal, and drop a file no record names."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.cache.backing import FIRST_TIER, WorkingFile
from ckptfs.model.tree import ROOT_INODE
from tests.support.faults import FaultyStore
from tests.support.harness import blob, trio_test
from tests.support.inprocess import BS, GID, UID, aerr, mounted, read_all, store_files, sync

pytestmark = pytest.mark.unit

NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def working_dir(tmp_path):
    return tmp_path / "cache" / "working"


def new_file(m, name: str):
    """A write-only create: its working copy is a file (passthrough writes on)."""
    m.ns.files.passthrough_writes = True
    handle, attr = m.ns.create(ROOT_INODE, name, 0o644, NEW, UID, GID)
    assert isinstance(handle.staged, WorkingFile)
    return handle, attr


def close(m, handle) -> None:
    m.ns.flush(handle.fh)
    m.ns.release(handle.fh)


@trio_test
async def test_the_kernels_writes_show_in_stat_and_the_close_commits_the_file(tmp_path, local):
    data = blob(3 * BS + 100, 1)
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "f.bin")
        fd = handle.staged.fd
        before = m.ns.getattr(attr.ino)
        await trio.sleep(0.01)
        os.pwrite(fd, data, 0)  # (the kernel, writing the file itself)
        seen = m.ns.getattr(attr.ino)
        assert seen.size == len(data) and seen.mtime_ns > before.mtime_ns
        close(m, handle)
        content = m.ns.node(attr.ino).version.content
        assert all(ref is not None and ref[0] >= FIRST_TIER for ref in content.blocks)
        assert m.cache.backing_of(content) is not None
        assert await read_all(m.ns, "f.bin") == data  # (through the daemon: the same file)
        await sync(m)
        assert store_files(local) == {"f.bin": data}
        assert len(os.listdir(working_dir(tmp_path))) == 1


@trio_test
async def test_streamed_parts_changed_before_the_commit_are_sent_again(tmp_path, local):
    data = bytearray(blob(6 * BS, 2))
    async with mounted(tmp_path, local) as m:
        handle, _ = new_file(m, "s.bin")
        fd = handle.staged.fd
        os.pwrite(fd, data, 0)
        m.ns.tailer.stream_after = 0  # (a file is streamed once open a while: at once, here)
        m.ns.tailer.poll()  # blocks 0-4 are behind the writer: streamed
        sender = m.uploader.sender
        with trio.fail_after(30):
            while sender.streamed_bytes < 5 * BS:
                await trio.sleep(0.01)
        os.pwrite(fd, b"late", BS + 7)  # into a part already sent
        data[BS + 7 : BS + 11] = b"late"
        close(m, handle)
        await sync(m)
        assert store_files(local) == {"s.bin": bytes(data)}
        assert sender.changed_parts == 1
        assert sender.verified_bytes >= 5 * BS


@trio_test
async def test_a_rewrite_gets_a_new_file_and_an_update_in_place_leaves_the_old_one(tmp_path, local):
    first, second = blob(2 * BS, 3), blob(2 * BS + 5, 4)
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "r.bin")
        os.pwrite(handle.staged.fd, first, 0)
        close(m, handle)
        old = m.ns.node(attr.ino).version.content.hold()  # (a reader still on it)
        handle, *_ = await m.ns.open(attr.ino, os.O_WRONLY | os.O_TRUNC)
        assert isinstance(handle.staged, WorkingFile)
        os.pwrite(handle.staged.fd, second, 0)
        close(m, handle)
        assert old.read(0, len(first)) == first  # the old file was not touched
        handle, *_ = await m.ns.open(attr.ino, os.O_RDWR)  # in place: copy on write into the arenas
        assert not isinstance(handle.staged, WorkingFile)
        assert await m.ns.write(handle.fh, 1, b"xy") == 2
        close(m, handle)
        assert old.read(0, len(first)) == first
        old.release()
        await sync(m)
        assert store_files(local) == {"r.bin": second[:1] + b"xy" + second[3:]}
        with trio.fail_after(10):
            while len(os.listdir(working_dir(tmp_path))) > 1:  # the first file, held by no one
                await trio.sleep(0.01)


@trio_test
async def test_a_committed_file_is_uploaded_after_a_restart_and_an_uncommitted_one_dropped(tmp_path, local):
    store = FaultyStore(local)
    data = blob(2 * BS + 9, 5)
    async with mounted(tmp_path, store) as m:
        store.hold("put", "done.bin")
        store.hold("create_multipart", "done.bin")
        handle, _ = new_file(m, "done.bin")
        os.pwrite(handle.staged.fd, data, 0)
        close(m, handle)  # committed, not in the store (the daemon stops now, as if killed)
        open_handle, _ = new_file(m, "open.bin")
        os.pwrite(open_handle.staged.fd, b"never committed", 0)
    assert len(os.listdir(working_dir(tmp_path))) == 2
    async with mounted(tmp_path, local) as m:
        assert len(os.listdir(working_dir(tmp_path))) == 1, "the uncommitted working file is gone"
        await sync(m)
        assert store_files(local) == {"done.bin": data}
        assert await read_all(m.ns, "done.bin") == data


@trio_test
async def test_an_fsync_of_a_writer_keeps_a_copy_the_later_writes_do_not_change(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "f.bin")
        os.pwrite(handle.staged.fd, b"a" * BS, 0)
        await m.ns.fsync(handle.fh)
        shadow = m.ns.node(attr.ino).shadows[-1]
        assert all(ref is not None and ref[0] < FIRST_TIER for ref in shadow.content.blocks)
        os.pwrite(handle.staged.fd, b"b" * BS, 0)
        assert shadow.content.read(0, BS) == b"a" * BS
        close(m, handle)
        await sync(m)
        assert store_files(local) == {"f.bin": b"b" * BS}


@trio_test
async def test_a_sparse_working_file_commits_its_holes_as_holes(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "sparse.bin")
        await m.ns.setattr(attr.ino, handle.fh, size=200 * BS)  # (ftruncate: a SETATTR)
        os.pwrite(handle.staged.fd, b"end", 200 * BS - 3)
        close(m, handle)
        blocks = m.ns.node(attr.ino).version.content.blocks
        assert len(blocks) == 200 and sum(ref is not None for ref in blocks) == 1
        await sync(m)
        assert store_files(local) == {"sparse.bin": bytes(200 * BS - 3) + b"end"}


@trio_test
async def test_a_committed_file_is_sealed_before_its_writer_is_released(tmp_path, local):
    """Between the close that commits (FLUSH) and the writer's RELEASE, a new O_TRUNC open (the
    next save of the same name) must not truncate the file that is now the committed version."""
    data = blob(2 * BS + 1, 6)
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "latest.pt")
        os.pwrite(handle.staged.fd, data, 0)
        m.ns.flush(handle.fh)  # committed; not released yet
        committed = m.ns.node(attr.ino).version.content.hold()
        second, *_ = await m.ns.open(attr.ino, os.O_WRONLY | os.O_TRUNC)
        assert isinstance(second.staged, WorkingFile) and second.staged.fd != m.cache.backing_of(committed).fd
        assert committed.read(0, len(data)) == data
        assert await aerr(m.ns.write, handle.fh, 0, b"late") == errno.EIO  # (committed: reopen to write)
        assert committed.read(0, len(data)) == data
        os.pwrite(second.staged.fd, b"next", 0)
        m.ns.release(handle.fh)
        close(m, second)
        committed.release()
        await sync(m)
        assert store_files(local) == {"latest.pt": b"next"}


@trio_test
async def test_an_empty_committed_file_stays_the_forked_childs_until_its_release(tmp_path, local):
    """mknod, or a create closed unwritten: an empty version, which holds no block of the file.
    The file must still be there for a forked child's descriptor, which the kernel writes through:
    its release commits what the child wrote (before, the file was closed at the commit, and the
    release's look at it failed with EBADF)."""
    async with mounted(tmp_path, local) as m:
        handle, attr = new_file(m, "made.bin")
        fd = handle.staged.fd
        m.ns.flush(handle.fh)  # the opener's close: committed, empty
        assert m.ns.getattr(attr.ino).size == 0
        await trio.sleep(0.01)
        os.pwrite(fd, b"child", 0)  # (the child, through the kernel)
        m.ns.release(handle.fh)
        assert m.ns.getattr(attr.ino).size == 5
        await sync(m)
        assert store_files(local) == {"made.bin": b"child"}
