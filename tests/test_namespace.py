"""The namespace, driven by calling its methods directly (no FUSE), wired like ckptfs/daemon.py
(tests/support/inprocess.py): Cache, Journal, Uploader and Fetcher over a LocalStore on tmp_path, inside
trio with the uploader and fetcher running in a nursery.

Covers commit on flush (old readers keep their version), rename (over a file, of a pending
file, of directories), unlink of a pending file, the errors users can hit, load() from a store
listing (unsafe keys hidden) and the replay of pending ops after a restart.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import trio

from ckptfs.cache.arena import DISK, RAM
from ckptfs.model.namespace import Namespace
from ckptfs.model.tree import RENAME_NOREPLACE, ROOT_INODE, Tree
from ckptfs.store.base import ObjectInfo
from ckptfs.transfer import retry
from tests.support.faults import FaultyStore
from tests.support.harness import blob, trio_test
from tests.support.inprocess import (
    BS,
    GID,
    RDWR,
    UID,
    WRITE,
    aerr,
    assert_xxh3,
    create,
    err,
    ino,
    mkdirs,
    mounted,
    names,
    read_all,
    read_in_pieces,
    store_files,
    store_keys,
    sync,
    write_blocks,
)

pytestmark = pytest.mark.unit

# -- commit on flush --------------------------------------------------------------------------------------


@trio_test
async def test_every_descriptor_sees_the_working_copy_and_the_close_commits_it(tmp_path, local):
    v1, v2 = blob(3 * BS + 5, 1), blob(2 * BS + 9, 2)

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/f.bin", v1)
        assert ns.state(f) == "pending"
        old_reader, *_ = await ns.open(f, os.O_RDONLY)

        writer, *_ = await ns.open(f, os.O_WRONLY | os.O_TRUNC)
        assert ns.getattr(f).size == 0
        await ns.write(writer.fh, 0, v2[:BS])
        # POSIX on the node: new and old readers see the bytes and size as written
        assert ns.getattr(f).size == BS
        assert await read_all(ns, f) == v2[:BS]
        assert await ns.read(old_reader.fh, 0, len(v1) + 1) == v2[:BS]
        await ns.write(writer.fh, BS, v2[BS:])
        ns.flush(writer.fh)  # commit
        assert await read_all(ns, f) == v2
        ns.release(writer.fh)

        assert await ns.read(old_reader.fh, 0, len(v1) + 1) == v2
        ns.release(old_reader.fh)
        await sync(m)
        assert ns.state(f) == "durable"
        assert await read_all(ns, f) == v2
        assert store_files(local) == {"f.bin": v2}
        assert_xxh3(local, "f.bin", v2)


@trio_test
async def test_a_reader_kept_open_across_saves_pins_no_old_version(tmp_path, local):
    """A reader on this mount follows each local commit and lets the version it had go at once:
    a process that keeps `latest` open while it is saved again and again holds no old blocks."""
    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/latest", blob(2 * BS + 1, 0))
        reader, *_ = await ns.open(f, os.O_RDONLY)
        for i in range(1, 4):
            await sync(m)
            old = ns.node(f).version.content
            writer, *_ = await ns.open(f, os.O_WRONLY | os.O_TRUNC)
            await ns.write(writer.fh, 0, blob(2 * BS + 1, i))
            ns.flush(writer.fh)
            ns.release(writer.fh)
            assert old.holders == 0 and old.refs() == []  # nothing holds the version replaced
            assert await ns.read(reader.fh, 0, 3 * BS) == blob(2 * BS + 1, i)
        ns.release(reader.fh)


@trio_test
async def test_random_writes_into_an_existing_file(tmp_path, local):
    v1 = blob(3 * BS, 3)

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/f.bin", v1)
        await sync(m)
        h, *_ = await ns.open(f, RDWR)  # no O_TRUNC: the staged copy starts as v1
        await ns.write(h.fh, BS + 10, b"patch")
        await ns.write(h.fh, 4 * BS, b"past the end")
        expected = bytearray(v1)
        expected[BS + 10 : BS + 15] = b"patch"
        expected += bytes(BS) + b"past the end"
        assert await ns.read(h.fh, 0, len(expected) + 1) == expected  # the writer reads the working copy
        assert await read_all(ns, f) == expected  # and so does every other descriptor
        assert store_files(local) == {"f.bin": v1}  # the store: committed versions only
        ns.flush(h.fh)
        ns.release(h.fh)
        assert await read_all(ns, f) == expected
        await sync(m)
        assert store_files(local) == {"f.bin": bytes(expected)}


@trio_test
async def test_empty_file_is_committed_and_uploaded(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        f = await create(m.ns, "/empty", b"")
        assert m.ns.getattr(f).size == 0
        await sync(m)
    assert store_files(local) == {"empty": b""}


@trio_test
async def test_truncate_by_path_and_by_handle(tmp_path, local):
    v1 = blob(3 * BS, 4)

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/f.bin", v1)
        await sync(m)
        await ns.setattr(f, None, size=BS + 3)  # truncate(path): a commit of its own
        assert await read_all(ns, f) == v1[: BS + 3]
        await ns.setattr(f, None, size=2 * BS)  # extend with zeros
        assert await read_all(ns, f) == v1[: BS + 3] + bytes(BS - 3)
        await sync(m)

        h, *_ = await ns.open(f, RDWR)
        await ns.setattr(f, h.fh, size=10)  # ftruncate: the working copy, seen at once
        assert await read_all(ns, f) == v1[:10]
        await ns.setattr(f, None, size=20)  # truncate(path) while open for writing: the same copy
        assert await read_all(ns, f) == v1[:10] + bytes(10)
        await ns.setattr(f, None, size=10)
        assert store_files(local) == {"f.bin": v1[: BS + 3] + bytes(BS - 3)}  # not committed yet
        ns.flush(h.fh)
        ns.release(h.fh)
        assert await read_all(ns, f) == v1[:10]
        await sync(m)
        assert store_files(local) == {"f.bin": v1[:10]}
        assert await aerr(ns.setattr, ino(ns, ""), None, 0) == errno.EISDIR


@trio_test
async def test_writer_truncate_and_regrow_keeps_old_version_intact(tmp_path, local):
    v1 = b"A" * 1000

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/f.bin", v1)
        await sync(m)
        reader, *_ = await ns.open(f, os.O_RDONLY)
        h, *_ = await ns.open(f, RDWR)
        await ns.setattr(f, h.fh, size=10)  # ftruncate(fd, 10)
        await ns.write(h.fh, BS, b"next block")  # the file grows again
        assert store_files(local) == {"f.bin": v1}  # the committed version's block was copied, not changed
        ns.flush(h.fh)
        ns.release(h.fh)
        assert await read_all(ns, f) == b"A" * 10 + bytes(BS - 10) + b"next block"
        assert await ns.read(reader.fh, 0, 2000) == b"A" * 10 + bytes(1990)
        ns.release(reader.fh)


@trio_test
async def test_writer_truncate_extend_then_shrink(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        ns = m.ns
        handle, attr = ns.create(ROOT_INODE, "pre", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
        await ns.setattr(attr.ino, handle.fh, size=10 * BS)  # preallocate
        await ns.setattr(attr.ino, handle.fh, size=5 * BS)
        ns.flush(handle.fh)
        ns.release(handle.fh)
        assert await read_all(ns, "pre") == bytes(5 * BS)


# -- rename ----------------------------------------------------------------------------------------------


@trio_test
async def test_rename_over_an_existing_file(tmp_path, local):
    a, b, c = blob(100, 1), blob(2 * BS, 2), blob(BS + 1, 3)

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        await create(ns, "/a", a)
        b_ino = await create(ns, "/b", b)
        await sync(m)
        reader, *_ = await ns.open(b_ino, os.O_RDONLY)
        ns.rename(ROOT_INODE, "a", ROOT_INODE, "b", 0)  # durable over durable: copy + delete
        assert err(ns.lookup, ROOT_INODE, "a") == errno.ENOENT
        assert await read_all(ns, "b") == a
        assert await ns.read(reader.fh, 0, 3 * BS) == b  # an open reader keeps the old file
        ns.release(reader.fh)

        await create(ns, "/tmp.c", c)  # pending over durable: retargeted
        ns.rename(ROOT_INODE, "tmp.c", ROOT_INODE, "b", 0)
        assert names(ns) == ["b"]
        assert await read_all(ns, "b") == c

        await create(ns, "/x", b"x")
        assert err(ns.rename, ROOT_INODE, "x", ROOT_INODE, "b", RENAME_NOREPLACE) == errno.EEXIST
        await sync(m)
    assert store_files(local) == {"b": c, "x": b"x"}
    assert_xxh3(local, "b", c)


@trio_test
async def test_rename_of_a_pending_file_retargets_its_upload(tmp_path, local):
    store = FaultyStore(local)
    small, big = blob(300, 1), blob(3 * BS + 7, 2)

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        await create(ns, "/small.tmp", small)
        ns.rename(ROOT_INODE, "small.tmp", ROOT_INODE, "small.bin", 0)  # before any upload

        gate = store.hold("put", "blocker")  # hold the publisher on an earlier file
        await create(ns, "/blocker", b"b")
        big_ino = await create(ns, "/big.tmp", big)
        await gate.entered()
        await m.uploader.pending[ns.node(big_ino).version.seq].ready.wait()  # parts sent
        ns.rename(ROOT_INODE, "big.tmp", ROOT_INODE, "big.bin", 0)
        assert ns.state(big_ino) == "pending"
        gate.open()
        await sync(m)
        assert ns.state(big_ino) == "durable"
        assert await read_all(ns, "big.bin") == big
    assert store_files(local) == {"small.bin": small, "blocker": b"b", "big.bin": big}
    assert store.count("put", "small.tmp") == 0  # retargeted, not uploaded then moved
    assert store.count("copy") == 0
    assert local.list_multipart() == []
    assert_xxh3(local, "big.bin", big)


@pytest.mark.parametrize(
    "durable, first_rename, expected",
    [
        # a pending move of another file to the name: it was published after the retargeted put
        # and left the other file under the name
        ("y", ("y", "a"), {"a": "x"}),
        # a pending move of the file that had the name away (the model run's "committed file
        # missing from the store"): published after the retargeted put, it took the new file along
        ("a", ("a", "z"), {"a": "x", "z": "durable"}),
    ],
    ids=["a-move-there", "a-move-away"],
)
@trio_test
async def test_rename_of_a_pending_file_to_a_name_a_later_pending_move_touches(
    tmp_path, local, durable, first_rename, expected
):
    """Was a bug (found reading the code after the long model run): the pending put was
    retargeted to a key that a later pending op writes or moves away."""
    store = FaultyStore(local)
    data = {"x": blob(300, 1), "durable": blob(200, 2)}

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        await create(ns, "/" + durable, data["durable"])
        await sync(m)  # durable: its rename is a move op
        gate = store.hold("put", "blocker")  # hold the publisher before x's put
        await create(ns, "/blocker", b"b")
        await create(ns, "/x", data["x"])
        await gate.entered()
        ns.rename(ROOT_INODE, first_rename[0], ROOT_INODE, first_rename[1], 0)  # a move op, after x's put
        ns.rename(ROOT_INODE, "x", ROOT_INODE, "a", 0)
        gate.open()
        await sync(m)
        assert names(ns) == sorted(["blocker", *expected])
        for name, which in expected.items():
            assert await read_all(ns, name) == data[which]
    assert store_files(local) == {"blocker": b"b", **{name: data[which] for name, which in expected.items()}}


@pytest.mark.parametrize("tier", ["disk", "ram"])
@pytest.mark.parametrize("flags", [os.O_RDONLY, WRITE], ids=["reader", "writer_with_nothing_new"])
@trio_test
async def test_fsync_of_a_pending_version_on_the_disk_tier_syncs_the_disk_arena(tmp_path, local, tier, flags):
    """Was a bug: a pending version whose blocks were all on the disk tier was fsynced by
    syncing the journal alone: after a node reboot its journal record could name disk slots
    whose bytes never reached the disk. The fsync of a reader, or of a writer that wrote
    nothing (it has nothing new: the committed version is what it makes durable), with the
    version's blocks on the disk tier or in RAM (copied to the disk first): the disk arena is
    synced, and before the journal (the record must not name bytes not yet on the disk)."""
    store = FaultyStore(local)
    async with mounted(tmp_path, store) as m:
        ns = m.ns
        ram_taken = []
        while tier == "disk" and (ref := m.cache.try_alloc(only=RAM)) is not None:  # RAM full
            ram_taken.append(ref)
        gate = store.hold("put", "f")  # the version stays pending
        f = await create(ns, "/f", blob(BS + 1, 1))
        on = DISK if tier == "disk" else RAM
        assert all(ref[0] == on for ref in ns.node(f).version.content.refs())
        disk, journal = m.cache.tiers[DISK], ns.commits.journal
        events: list[str] = []
        disk_sync, journal_sync = disk.sync, journal.sync
        disk.sync = lambda: (events.append("arena"), disk_sync())
        journal.sync = lambda: (events.append("journal"), journal_sync())
        handle, *_ = await ns.open(f, flags)
        await ns.fsync(handle.fh)
        assert "arena" in events, "fsync did not sync the disk arena holding the version's blocks"
        assert "journal" in events, "fsync did not sync the journal"
        assert events.index("arena") < events.index("journal"), f"the journal was synced first: {events}"
        if tier == "ram":  # copied: a journal record names disk blocks holding the version
            assert ns.node(f).version.seq is not None and ns.state(f) == "pending"
        ns.release(handle.fh)
        gate.open()
        for ref in ram_taken:
            m.cache.decref(ref)


@trio_test
async def test_directory_rename_with_durable_and_pending_files(tmp_path, local):
    a, b = blob(100, 1), blob(2 * BS + 1, 2)

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        mkdirs(ns, "/tmp-ckpt/sub")
        await create(ns, "/tmp-ckpt/a.bin", a)
        await sync(m)  # a.bin durable: its rename is a server-side copy
        await create(ns, "/tmp-ckpt/sub/b.bin", b)  # pending: retargeted
        ns.rename(ROOT_INODE, "tmp-ckpt", ROOT_INODE, "ckpt-1", 0)
        assert err(ns.lookup, ROOT_INODE, "tmp-ckpt") == errno.ENOENT
        assert names(ns) == ["ckpt-1"]
        assert names(ns, "ckpt-1") == ["a.bin", "sub"]
        assert await read_all(ns, "ckpt-1/a.bin") == a
        assert await read_all(ns, "ckpt-1/sub/b.bin") == b
        await sync(m)
    assert store_files(local) == {"ckpt-1/a.bin": a, "ckpt-1/sub/b.bin": b}


@trio_test
async def test_directory_rename_leaves_no_old_directory_in_the_store(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        mkdirs(m.ns, "/tmp-ckpt/sub")
        await create(m.ns, "/tmp-ckpt/sub/a.bin", b"a")
        await sync(m)
        m.ns.rename(ROOT_INODE, "tmp-ckpt", ROOT_INODE, "ckpt-1", 0)
        await sync(m)
    assert store_keys(local) == {"ckpt-1/", "ckpt-1/sub/", "ckpt-1/sub/a.bin"}


@trio_test
async def test_rename_a_directory_into_itself_and_over_files(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        ns = m.ns
        d = mkdirs(ns, "/d/inner")
        full = mkdirs(ns, "/full")
        await create(ns, "/full/x", b"x")
        await create(ns, "/file", b"f")
        mkdirs(ns, "/empty")
        assert err(ns.rename, ROOT_INODE, "d", d, "loop", 0) == errno.EINVAL
        assert err(ns.rename, ROOT_INODE, "d", ROOT_INODE, "full", 0) == errno.ENOTEMPTY
        assert err(ns.rename, ROOT_INODE, "d", ROOT_INODE, "file", 0) == errno.ENOTDIR
        assert err(ns.rename, ROOT_INODE, "file", ROOT_INODE, "empty", 0) == errno.EISDIR
        assert err(ns.rename, ROOT_INODE, "nope", ROOT_INODE, "x", 0) == errno.ENOENT
        assert err(ns.rename, ROOT_INODE, "file", ROOT_INODE, "x", 2) == errno.EINVAL  # EXCHANGE
        ns.rename(ROOT_INODE, "d", ROOT_INODE, "empty", 0)  # over an empty directory
        assert names(ns) == ["empty", "file", "full"]
        assert names(ns, "empty") == ["inner"]
        assert ns.lookup(full, "x").size == 1
        await sync(m)
    assert store_files(local) == {"full/x": b"x", "file": b"f"}
    assert "empty/inner/" in store_keys(local)


# -- unlink ------------------------------------------------------------------------------------------------


@trio_test
async def test_unlink_of_a_pending_file_cancels_its_upload(tmp_path, local):
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        await create(ns, "/doomed", blob(1000))
        ns.unlink(ROOT_INODE, "doomed")  # before the uploader ran: cancelled
        assert err(ns.lookup, ROOT_INODE, "doomed") == errno.ENOENT
        await create(ns, "/kept", b"kept")
        await create(ns, "/durable", b"d")
        await sync(m)
        ns.unlink(ROOT_INODE, "durable")  # in the store already: deleted
        await sync(m)
        assert m.cache.refcounts.keys() == set(ns.node(ino(ns, "kept")).version.content.refs())
    assert store.count("put", "doomed") == 0
    assert store_files(local) == {"kept": b"kept"}


@trio_test
async def test_unlinked_file_stays_readable_by_open_handles(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        ns = m.ns
        f = await create(ns, "/f", b"data")
        reader, *_ = await ns.open(f, os.O_RDONLY)
        writer, *_ = await ns.open(f, WRITE)
        ns.unlink(ROOT_INODE, "f")
        assert await ns.read(reader.fh, 0, 100) == b"data"
        await ns.write(writer.fh, 0, b"DATA")
        ns.flush(writer.fh)  # written after unlink: nobody can see it, nothing uploads
        ns.release(writer.fh)
        ns.release(reader.fh)
        await sync(m)
        assert names(ns) == []
        assert m.cache.refcounts == {}
    assert store_files(local) == {}


# -- errors ----------------------------------------------------------------------------------------------


@trio_test
async def test_errors_users_can_hit(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        ns = m.ns
        d = mkdirs(ns, "/d")
        f = await create(ns, "/d/f", b"f")
        assert err(ns.lookup, ROOT_INODE, "missing") == errno.ENOENT
        assert err(ns.getattr, 10**6) == errno.ENOENT
        assert err(ns.mkdir, ROOT_INODE, "d", 0o755, UID, GID) == errno.EEXIST
        assert err(ns.create, d, "f", 0o644, os.O_CREAT | os.O_EXCL, UID, GID) == errno.EEXIST
        assert err(ns.rmdir, ROOT_INODE, "d") == errno.ENOTEMPTY
        assert err(ns.rmdir, d, "f") == errno.ENOTDIR
        assert err(ns.rmdir, ROOT_INODE, "missing") == errno.ENOENT
        assert err(ns.lookup, f, "x") == errno.ENOTDIR
        assert err(ns.readdir, f) == errno.ENOTDIR
        assert err(ns.create, f, "x", 0o644, 0, UID, GID) == errno.ENOTDIR
        assert await aerr(ns.open, d, os.O_RDONLY) == errno.EISDIR
        assert err(ns.unlink, ROOT_INODE, "d") == errno.EISDIR
        assert err(ns.unlink, d, "missing") == errno.ENOENT
        long = "n" * 256
        assert err(ns.create, d, long, 0o644, 0, UID, GID) == errno.ENAMETOOLONG
        assert err(ns.mkdir, d, long, 0o755, UID, GID) == errno.ENAMETOOLONG
        assert err(ns.rename, d, "f", d, long, 0) == errno.ENAMETOOLONG
        ok = "é" * 127  # 254 bytes: fits
        await create(ns, f"/d/{ok}", b"")
        deep = ROOT_INODE
        for i in range(4):  # 4 * 251 bytes of directories: near the 1024-byte key limit
            deep = ns.mkdir(deep, f"{i}" * 250, 0o755, UID, GID).ino
        assert err(ns.create, deep, "x" * 30, 0o644, 0, UID, GID) == errno.ENAMETOOLONG
        bad = "bad\udcff"  # a non-UTF-8 name as the kernel hands it over (surrogateescape)
        assert err(ns.create, d, bad, 0o644, 0, UID, GID) == errno.EINVAL
        assert err(ns.mkdir, d, bad, 0o755, UID, GID) == errno.EINVAL
        assert err(ns.rename, d, "f", d, bad, 0) == errno.EINVAL
        assert err(ns.mkdir, ROOT_INODE, ".ckptfs-tmp", 0o755, UID, GID) == errno.EINVAL
        assert ns.mkdir(d, ".ckptfs-tmp", 0o755, UID, GID)  # reserved only at the top
        reader, *_ = await ns.open(f, os.O_RDONLY)
        assert await aerr(ns.write, reader.fh, 0, b"x") == errno.EBADF
        ns.release(reader.fh)
        assert await aerr(ns.read, 999, 0, 1) == errno.EBADF
        assert names(ns, "d") == sorted([".ckptfs-tmp", "f", ok])
        await sync(m)
    assert store_files(local) == {"d/f": b"f", f"d/{ok}": b""}


# -- load(): the tree from a store listing -------------------------------------------------------------------


def test_load_builds_the_tree_and_hides_unsafe_keys(tmp_path, local):
    files = {"a/b/c.bin": blob(BS + 5, 1), "top.bin": b"top", "a/x": b"x"}
    for key, data in files.items():
        local.put(key, data)
    local.put("empty/nested/", b"")  # directory markers
    unsafe = [
        "../x",
        "/abs",
        "a//b",
        "a/./b",
        "p/" + "z" * 300,
        ".ckptfs-tmp/junk",
        "ok/../../etc",
        "q" * 1025,
    ]
    listing = list(local.list(""))
    listing += [ObjectInfo(k, 1, 0.0) for k in unsafe]
    listing += [ObjectInfo("top.bin/inside", 5, 0.0)]  # clashes with the file top.bin

    async def main():
        async with mounted(tmp_path, local, listing=listing) as m:
            ns = m.ns
            assert names(ns) == ["a", "empty", "top.bin"]
            assert names(ns, "a") == ["b", "x"]
            assert names(ns, "a/b") == ["c.bin"]
            assert names(ns, "empty") == ["nested"]
            assert names(ns, "empty/nested") == []
            assert ns.getattr(ino(ns, "a/b/c.bin")).size == len(files["a/b/c.bin"])
            assert ns.getattr(ino(ns, "top.bin")).mtime_ns > 0
            assert ns.state(ino(ns, "a/b/c.bin")) == "durable"
            for key, data in files.items():
                assert await read_all(ns, key) == data  # fetched from the store
            assert m.fetcher.fetched_bytes == sum(len(d) for d in files.values())
            assert await read_all(ns, "a/b/c.bin") == files["a/b/c.bin"]  # now cached
            assert m.fetcher.fetched_bytes == sum(len(d) for d in files.values())
            paths = {n.key() for n in ns.root.walk()}
            assert not any(".." in p or "//" in p or p.startswith("/") or ".ckptfs" in p for p in paths)
            assert m.uploader.pending_count() == 0  # loading changes nothing in the store

    trio.run(main)


def test_remount_shows_what_the_last_mount_left(tmp_path, local):
    data = blob(2 * BS + 3, 7)

    async def first():
        async with mounted(tmp_path, local) as m:
            mkdirs(m.ns, "/ckpt/empty")
            await create(m.ns, "/ckpt/model.pt", data)
            await sync(m)

    async def second():
        async with mounted(tmp_path / "other", local) as m:  # another cache: every byte from the store
            assert names(m.ns, "ckpt") == ["empty", "model.pt"]
            assert await read_all(m.ns, "ckpt/model.pt") == data

    trio.run(first)
    (tmp_path / "other").mkdir()
    trio.run(second)


# -- replay of pending ops after a restart ---------------------------------------------------------------------


def test_replay_of_pending_ops_over_the_listing(tmp_path, local):
    """A mount whose store refuses every change dies with ops pending; the next mount lays
    them over the store listing at once and applies them."""
    old, gone, new, inner = blob(500, 1), blob(10, 2), blob(3 * BS + 1, 3), blob(77, 4)
    local.put("old.bin", old)
    local.put("gone.bin", gone)
    local.put("keep/k.bin", b"k")
    failing = FaultyStore(local)
    for verb in ("put", "delete", "copy", "create_multipart"):
        failing.fail(verb, 10**9)

    async def first_life():
        async with mounted(tmp_path, failing) as m:
            ns = m.ns
            await create(ns, "/new.bin", new)  # put (multipart)
            ns.unlink(ROOT_INODE, "gone.bin")  # delete
            ns.rename(ROOT_INODE, "old.bin", ROOT_INODE, "moved.bin", 0)  # move (durable file)
            mkdirs(ns, "/nd/empty")  # mkdir
            await create(ns, "/nd/inner.bin", inner)
            await create(ns, "/tmp.bin", b"final")
            ns.rename(ROOT_INODE, "tmp.bin", ROOT_INODE, "final.bin", 0)  # retarget
            await failing.called("create_multipart")
            assert m.uploader.pending_count() > 0
        # the daemon dies: nothing reached the store

    trio.run(first_life)
    assert store_files(local) == {"old.bin": old, "gone.bin": gone, "keep/k.bin": b"k"}

    store = FaultyStore(local)
    gate = store.hold("put")  # keep the store unchanged while we look at the tree

    async def second_life():
        async with mounted(tmp_path, store) as m:
            ns = m.ns
            assert names(ns) == ["final.bin", "keep", "moved.bin", "nd", "new.bin"]
            assert names(ns, "nd") == ["empty", "inner.bin"]
            assert ns.state(ino(ns, "new.bin")) == "pending"
            assert await read_all(ns, "new.bin") == new  # from the adopted cache blocks
            assert await read_all(ns, "nd/inner.bin") == inner
            assert await read_all(ns, "final.bin") == b"final"
            assert await read_all(ns, "moved.bin") == old  # still under old.bin in the store
            gate.open()
            await sync(m)
            assert ns.state(ROOT_INODE) == "durable"
            assert await read_all(ns, "moved.bin") == old

    trio.run(second_life)
    assert store_files(local) == {
        "new.bin": new,
        "moved.bin": old,
        "nd/inner.bin": inner,
        "final.bin": b"final",
        "keep/k.bin": b"k",
    }
    assert "nd/empty/" in store_keys(local)
    assert_xxh3(local, "new.bin", new)
    assert local.list_multipart() == []


def test_replay_of_a_rename_over_an_existing_file(tmp_path, local):
    a, b = blob(300, 1), blob(50, 2)
    local.put("a.bin", a)
    local.put("b.bin", b)
    failing = FaultyStore(local)
    failing.fail("copy", 10**9)

    async def first_life():
        async with mounted(tmp_path, failing) as m:
            m.ns.rename(ROOT_INODE, "a.bin", ROOT_INODE, "b.bin", 0)  # os.replace of durable files
            await failing.called("copy")

    async def second_life():
        async with mounted(tmp_path, local) as m:
            assert names(m.ns) == ["b.bin"]
            assert m.ns.getattr(ino(m.ns, "b.bin")).size == len(a)
            await sync(m)
            assert await read_all(m.ns, "b.bin") == a

    trio.run(first_life)
    trio.run(second_life)
    assert store_files(local) == {"b.bin": a}


# -- streaming upload --------------------------------------------------------------------------------


@trio_test
async def test_full_blocks_upload_before_close(tmp_path, local):
    store = FaultyStore(local)
    data = blob(4 * BS + 100, 1)  # four full blocks and a tail

    async with mounted(tmp_path, store) as m:
        handle, _ = m.ns.create(ROOT_INODE, "ckpt.pt", 0o644, WRITE, UID, GID)
        await write_blocks(m.ns, handle.fh, data)
        # The writer is past blocks 0..3: they are sent while the file is still open.
        await store.called("upload_part", 4)
        assert store_files(store) == {}  # nothing visible before the commit
        m.ns.flush(handle.fh)
        m.ns.release(handle.fh)
        await sync(m)
        assert store_files(store) == {"ckpt.pt": data}
        assert store.count("upload_part") == 5  # the streamed parts were kept: only the tail sent at close
        assert store.count("create_multipart") == 1
        assert local.list_multipart() == []


@trio_test
async def test_a_block_rewritten_after_it_was_sent_is_sent_again(tmp_path, local):
    store = FaultyStore(local)
    data = bytearray(blob(4 * BS, 2))

    async with mounted(tmp_path, store) as m:
        handle, _ = m.ns.create(ROOT_INODE, "f.bin", 0o644, RDWR, UID, GID)
        await write_blocks(m.ns, handle.fh, bytes(data))
        await store.called("upload_part", 3)  # blocks 0..2 sent
        await m.ns.write(handle.fh, BS + 10, b"changed")  # back into block 1
        data[BS + 10 : BS + 17] = b"changed"
        m.ns.flush(handle.fh)
        m.ns.release(handle.fh)
        await sync(m)
        assert store_files(store) == {"f.bin": bytes(data)}
        assert store.count("upload_part") == 5  # 4 parts + block 1 again


@trio_test
async def test_a_file_unlinked_while_written_aborts_its_streamed_upload(tmp_path, local):
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        handle, _ = m.ns.create(ROOT_INODE, "gone.bin", 0o644, WRITE, UID, GID)
        await write_blocks(m.ns, handle.fh, blob(3 * BS + 1, 3))
        await store.called("upload_part", 3)
        assert len(local.list_multipart()) == 1
        m.ns.unlink(ROOT_INODE, "gone.bin")
        m.ns.flush(handle.fh)
        m.ns.release(handle.fh)
        await store.called("abort_multipart")
        assert local.list_multipart() == []
        await sync(m)
        assert store_files(store) == {}


@trio_test
async def test_a_file_renamed_while_written_is_uploaded_under_its_new_name(tmp_path, local):
    store = FaultyStore(local)
    data = blob(3 * BS + 5, 4)

    async with mounted(tmp_path, store) as m:
        handle, _ = m.ns.create(ROOT_INODE, "ckpt.tmp", 0o644, WRITE, UID, GID)
        await write_blocks(m.ns, handle.fh, data)
        await store.called("upload_part", 3)  # streamed under ckpt.tmp
        m.ns.rename(ROOT_INODE, "ckpt.tmp", ROOT_INODE, "ckpt", 0)
        m.ns.flush(handle.fh)
        m.ns.release(handle.fh)
        await sync(m)
        assert store_files(store) == {"ckpt": data}
        await store.called("abort_multipart")
        assert local.list_multipart() == []


@trio_test
async def test_overwrites_while_uploads_stream_leave_the_last_version(tmp_path, local):
    """Each commit cancels the previous version's upload while its parts are in flight."""
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        for i in range(20):
            data = blob(3 * BS + i, i)
            handle, *_ = (
                await m.ns.open(ino(m.ns, "latest.pt"), WRITE | os.O_TRUNC)
                if i
                else (m.ns.create(ROOT_INODE, "latest.pt", 0o644, WRITE, UID, GID)[0],)
            )
            await write_blocks(m.ns, handle.fh, data)
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
        await sync(m)
        assert store_files(store) == {"latest.pt": data}
        for _ in range(100):  # aborts run in the background
            if not local.list_multipart():
                break
            await trio.sleep(0.05)
        assert local.list_multipart() == []


@trio_test
async def test_writers_larger_than_the_cache_flow_at_the_upload_rate(tmp_path, local):
    """Two files written at once, together 1.5x the whole cache (16 + 64 blocks): blocks whose
    part is uploaded are evicted from the open files, the writers wait for uploads instead of
    failing, and the files read back whole once they are in the store."""
    store = FaultyStore(local)
    files = {f"w{i}.bin": blob(60 * BS + 7, 10 + i) for i in range(2)}

    async with mounted(tmp_path, store) as m:
        handles = {name: m.ns.create(ROOT_INODE, name, 0o644, WRITE, UID, GID)[0] for name in files}
        for offset in range(0, 60 * BS + 7, BS // 2):  # interleaved, as two ranks would
            for name, data in files.items():
                await m.ns.write(handles[name].fh, offset, data[offset : offset + BS // 2])
        evicted = next(h for h in handles.values() if h.staged.remote)
        index = min(evicted.staged.remote)
        # Evicted bytes exist only in the multipart upload until the file is committed:
        # the writing handle can neither read nor change them, nor can the file move.
        assert await aerr(m.ns.read, evicted.fh, index * BS, 10) == errno.EIO
        assert await aerr(m.ns.write, evicted.fh, index * BS, b"x") == errno.EIO
        evicted.writing.error = 0  # (a failed write poisons the file's commit; this one was only a probe)
        assert err(m.ns.rename, ROOT_INODE, evicted.node.name, ROOT_INODE, "moved.bin", 0) == errno.EBUSY
        for handle in handles.values():
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
        for name, data in files.items():  # readers wait for the evicted parts to be in the store
            assert (
                await read_in_pieces(m.ns, name) == data
            )  # (as the kernel reads: a file larger than the cache)
        await sync(m)
        assert store_files(store) == files
        assert local.list_multipart() == []


@pytest.mark.parametrize("crash", ["before_completion", "after_completion"])
def test_a_restart_completes_an_upload_whose_parts_were_evicted(tmp_path, local, crash):
    """The parts evicted while the file was written exist only in its multipart upload: the
    journal names them, so a restart completes that upload (or finds it complete)."""
    store = FaultyStore(local)
    data = blob(100 * BS + 3, 20)  # more than the whole cache

    async def first_run():
        async with mounted(tmp_path, store) as m:
            if crash == "before_completion":
                store.fail("complete_multipart", 10**6)
            else:
                gate = store.hold("complete_multipart")  # completes, but the journal never hears it
            handle, _ = m.ns.create(ROOT_INODE, "big.bin", 0o644, WRITE, UID, GID)
            await write_blocks(m.ns, handle.fh, data, chunk=BS)
            assert handle.staged.remote
            m.ns.flush(handle.fh)
            m.ns.release(handle.fh)
            await store.called("upload_part", 101)  # every part is in
            if crash == "after_completion":
                await gate.entered()

    async def second_run():
        async with mounted(tmp_path, store) as m:
            await sync(m)
            assert store_files(store) == {"big.bin": data}
            assert local.list_multipart() == []

    trio.run(first_run)
    store.fail("complete_multipart", 0)
    store._gates.clear()
    trio.run(second_run)


@trio_test
async def test_a_cache_full_of_open_files_that_cannot_stream_gives_enospc_not_a_hang(tmp_path, local):
    """Blocks written all but their last byte are never full, so none can be sent and evicted:
    the write that finds the whole cache (16 + 64 blocks) taken fails instead of waiting forever."""
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        handle, _ = m.ns.create(ROOT_INODE, "gappy.bin", 0o644, WRITE, UID, GID)
        with trio.fail_after(30):
            for index in range(80):  # 80 blocks: exactly the cache
                await m.ns.write(handle.fh, index * BS, blob(BS - 1, index))
            assert await aerr(m.ns.write, handle.fh, 80 * BS, b"one more block") == errno.ENOSPC
        assert err(m.ns.flush, handle.fh) == errno.ENOSPC  # never committed
        m.ns.release(handle.fh)
        (other, _) = m.ns.create(ROOT_INODE, "small.bin", 0o644, WRITE, UID, GID)
        await m.ns.write(other.fh, 0, b"the mount still works")
        m.ns.flush(other.fh)
        m.ns.release(other.fh)
        await sync(m)
        assert store_files(store) == {"small.bin": b"the mount still works"}


@trio_test
async def test_the_latest_checkpoint_is_the_directory_of_the_last_save(tmp_path, local):
    async with mounted(tmp_path, local) as m:
        for step in (1, 2):  # Megatron-style: iter_N/mp_rank_XX/model_optim_rng.pt, then a pointer
            for rank in range(2):
                mkdirs(m.ns, f"iter_{step}/mp_rank_{rank:02d}")
                await create(m.ns, f"iter_{step}/mp_rank_{rank:02d}/model.pt", blob(BS + 1, rank))
            await create(m.ns, f"latest-{step}.txt", str(step).encode())  # (a pointer at the top)
            m.ns.policy._last_shard_commit -= 3600  # the next save comes much later
        assert m.ns.checkpoint_dir == "iter_2/"
        assert m.ns.policy.pinned(m.ns.node(ino(m.ns, "iter_2/mp_rank_01/model.pt")))
        assert not m.ns.policy.pinned(m.ns.node(ino(m.ns, "iter_1/mp_rank_01/model.pt")))


# -- refresh from the store: what another mount made durable ---------------------------------------------


async def alookup(ns: Namespace, path: str) -> int:
    """The kernel's path walk: lookups that ask the store about names this mount does not know."""
    node = ROOT_INODE
    for part in [p for p in path.split("/") if p]:
        node = (await ns.lookup_async(node, part)).ino
    return node


async def alist(ns: Namespace, path: str = "") -> list[str]:
    """opendir + readdir: the directory is listed again from the store if that is due."""
    directory = await alookup(ns, path)
    await ns.refresh(directory)
    return [name for name, _ in ns.readdir(directory)]


@pytest.fixture
def clock(monkeypatch):
    """The namespace's monotonic clock, moved by hand: ``clock[0] += seconds``."""
    now = [1000.0]
    monkeypatch.setattr(Tree, "now", lambda self: now[0])
    return now


@trio_test
async def test_refresh_shows_what_another_mount_made_durable_after_the_ttl(tmp_path, local, clock):
    local.put("d/a", b"a")

    async with mounted(tmp_path, local) as m:
        ns = m.ns
        ns.list_ttl = 5.0
        new = blob(3 * BS + 7, 1)
        local.put("d/new", new)  # another mount publishes
        local.put("d/sub/deep", b"deep")
        local.put("top", b"t")
        clock[0] += 4.9
        assert await alist(ns, "d") == ["a"]  # the listing at mount is trusted for the TTL
        clock[0] += 0.1
        assert await alist(ns, "d") == ["a", "new", "sub"]
        assert await read_all(ns, await alookup(ns, "d/new")) == new
        assert await alist(ns, "d/sub") == ["deep"]  # a directory new here is listed at first use
        assert await read_all(ns, await alookup(ns, "d/sub/deep")) == b"deep"
        assert await alist(ns) == ["d", "top"]
        assert ns.state(ino(ns, "d/new")) == "durable"


@trio_test
async def test_refresh_paths_brings_a_tree_up_to_date_for_warmup(tmp_path, local, clock):
    async with mounted(tmp_path, local) as m:
        m.ns.list_ttl = 5.0
        local.put("ckpt/step2/a", b"a")  # another mount publishes a checkpoint
        local.put("ckpt/step2/sub/b", b"b")
        await m.ns.refresh_paths(["ckpt/step2"])
        held = m.ns.contents_under(["ckpt/step2"])
        assert sorted(content.key for content, _ in held) == ["ckpt/step2/a", "ckpt/step2/sub/b"]
        for _, done in held:
            done()


@trio_test
async def test_lookup_of_an_unknown_name_asks_the_store_and_remembers_a_miss(tmp_path, local, clock):
    store = FaultyStore(local)
    data = blob(2 * BS, 2)

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        ns.list_ttl = 60.0
        local.put("ckpt/step1/model.pt", data)
        # A path never listed here, opened directly: each unknown name is asked of the store.
        assert await read_all(ns, await alookup(ns, "ckpt/step1/model.pt")) == data
        assert names(ns) == ["ckpt"]  # only what was asked: the top is not listed again
        assert store.count("list_dir", "") == 0
        # A miss is remembered for the TTL (import machinery probing names, in a loop) ...
        for _ in range(5):
            assert await aerr(ns.lookup_async, ROOT_INODE, "missing.py") == errno.ENOENT
        assert store.count("head", "missing.py") == 1
        assert ns.negative_ttl(ROOT_INODE, "missing.py") == 60.0  # (the kernel may keep it as long)
        local.put("missing.py", b"now here")
        clock[0] += 59
        assert await aerr(ns.lookup_async, ROOT_INODE, "missing.py") == errno.ENOENT
        assert ns.negative_ttl(ROOT_INODE, "missing.py") == 1.0
        # ... and after it the directory is due: listed again, which finds the name.
        clock[0] += 1
        assert await read_all(ns, await alookup(ns, "missing.py")) == b"now here"
        # (one more HEAD: a listing does not carry the attributes that lookup must answer with)
        assert store.count("head", "missing.py") == 2 and store.count("list_dir", "") == 1
        # Names no key can hold are never asked.
        assert await aerr(ns.lookup_async, ROOT_INODE, ".ckptfs-tmp") == errno.ENOENT
        assert await aerr(ns.lookup_async, ROOT_INODE, "x" * 256) == errno.ENOENT
        assert store.count("head", ".ckptfs-tmp") == 0
        # A store that fails: lookups answer from what is known; the failure is not retried
        # before the TTL.
        store.fail("head", 1)
        assert await aerr(ns.lookup_async, ROOT_INODE, "flaky") == errno.ENOENT
        assert await aerr(ns.lookup_async, ROOT_INODE, "flaky") == errno.ENOENT
        assert store.count("head", "flaky") == 1
        # In a directory this mount writes into, names it does not know are not asked (the
        # lookup before each create would wait on the store); the next listing brings them.
        await create(ns, "mine.txt", b"m")
        local.put("theirs.txt", b"t")
        assert await aerr(ns.lookup_async, ROOT_INODE, "theirs.txt") == errno.ENOENT
        assert store.count("head", "theirs.txt") == 0
        clock[0] += 60
        assert await read_all(ns, await alookup(ns, "theirs.txt")) == b"t"


@trio_test
async def test_a_failed_head_of_a_listed_name_is_eio_and_its_entry_shows_no_permission(tmp_path, local):
    """A name a listing showed is answered only once a HEAD read its attributes: if the HEAD
    fails, lookup gets EIO, and the entry (in a directory listing) shows as root's with no
    permission bits until one succeeds; opendir's refresh reads every entry's attributes."""
    import stat

    local.put("f.bin", b"x", {"mode": str(stat.S_IFREG | 0o644), "uid": "1234", "gid": "1234"})
    store = FaultyStore(local)
    async with mounted(tmp_path, store) as m:
        ns = m.ns

        def shown() -> tuple[int, int, int]:
            attr = dict(ns.readdir(ROOT_INODE))["f.bin"]
            return attr.mode, attr.uid, attr.gid

        assert shown() == (stat.S_IFREG, 0, 0)  # listed, not read yet
        store.fail("head", 100, "f.bin")
        assert await aerr(ns.lookup_async, ROOT_INODE, "f.bin") == errno.EIO
        await ns.refresh(ROOT_INODE)  # opendir: the HEAD fails again, the entry stays closed
        assert shown() == (stat.S_IFREG, 0, 0)
        assert store.count("head", "f.bin") == 2
        store.fail("head", 0, "f.bin")  # the store answers again
        await ns.refresh(ROOT_INODE)  # opendir reads the entries' attributes, no lookup needed
        assert shown() == (stat.S_IFREG | 0o644, 1234, 1234)
        attr = await ns.lookup_async(ROOT_INODE, "f.bin")
        assert (attr.mode, attr.uid) == (stat.S_IFREG | 0o644, 1234)
        assert store.count("head", "f.bin") == 3  # (known now: the lookup asks no more)


def test_a_file_gone_from_the_store_goes_unless_open_or_pending_here(tmp_path, local):
    store = FaultyStore(local)
    for key in ("d/gone", "d/open", "d/unlinked", "d/sub/f"):
        local.put(key, key.encode())

    async def main():
        async with mounted(tmp_path, store) as m:
            ns = m.ns
            ns.list_ttl = 0  # every use lists again
            reader, *_ = await ns.open(ino(ns, "d/open"), os.O_RDONLY)
            assert await ns.read(reader.fh, 0, 100) == b"d/open"
            gone = ino(ns, "d/gone")  # (the kernel holds its entry)
            gate = store.hold("put", "d/mine")
            await create(ns, "d/mine", b"mine")  # committed here, its upload held: pending
            await gate.entered()
            ns.unlink(ino(ns, "d"), "unlinked")  # the delete queues behind that put
            for key in ("d/gone", "d/open", "d/sub/f"):  # another mount deletes these
                local.delete(key)
            local.delete("d/sub/")
            # The pending file stays, the open one stays for its reader; the unlinked one does
            # not come back although the store still has it.
            assert await alist(ns, "d") == ["mine", "open"]
            assert await aerr(ns.lookup_async, ino(ns, "d"), "unlinked") == errno.ENOENT
            assert await aerr(ns.lookup_async, ino(ns, "d"), "gone") == errno.ENOENT
            # Through an entry the kernel still holds: gone too (not an empty file).
            assert err(ns.getattr, gone) == errno.ENOENT
            assert await aerr(ns.open, gone, os.O_RDONLY) == errno.ENOENT
            assert await ns.read(reader.fh, 0, 100) == b"d/open"
            ns.release(reader.fh)
            assert await alist(ns, "d") == ["mine"]
            gate.open()
            await sync(m)
            assert await alist(ns, "d") == ["mine"]  # our own upload, now in the store
            assert store_keys(store) == {"d/", "d/mine"}
            assert await read_all(ns, "d/mine") == b"mine"

    trio.run(main)


@trio_test
async def test_an_object_changed_in_the_store_replaces_clean_cached_content(tmp_path, local):
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        ns.list_ttl = 0
        ours = blob(2 * BS, 1)
        await create(ns, "f", ours)
        await sync(m)
        assert await alist(ns) == ["f"]
        node = ns.node(ino(ns, "f"))
        assert node.version.stamp is not None  # our upload, recognised: its cache stays
        assert all(ref is not None for ref in node.version.content.blocks)
        assert await read_all(ns, "f") == ours and store.count("get_range") == 0
        # Another mount overwrites it (another size), then again (same size, new content).
        for seed, size in ((2, 3 * BS + 1), (3, 3 * BS + 1)):
            theirs = blob(size, seed)
            local.put("f", theirs)
            assert await alist(ns) == ["f"]
            assert ns.getattr(node.ino).size == size
            assert await read_all(ns, "f") == theirs
        # A reader keeps the version it opened; the change shows once it closed.
        reader, *_ = await ns.open(node.ino, os.O_RDONLY)
        local.put("f", b"short")
        await alist(ns)
        assert await ns.read(reader.fh, 0, 1 << 20) == theirs
        ns.release(reader.fh)
        await alist(ns)
        assert await read_all(ns, "f") == b"short"
        # A commit here that is not in the store yet wins over the store's object.
        gate = store.hold("put", "g")
        await create(ns, "g", b"local")
        await gate.entered()
        local.put("g", b"remote!")
        assert await alist(ns) == ["f", "g"]
        assert await read_all(ns, "g") == b"local"
        gate.open()
        await sync(m)
        assert await alist(ns) == ["f", "g"] and await read_all(ns, "g") == b"local"
        assert store_files(store)["g"] == b"local"
        # Overwritten by another mount with the same size before this one listed its own
        # upload again: told apart by the store's date, later than our upload.
        await create(ns, "h", b"ours")
        await sync(m)
        local.put("h", b"them")
        later = time.time() + 30
        os.utime(local.root / "h", (later, later))
        await alist(ns)
        assert await read_all(ns, "h") == b"them"


@trio_test
async def test_a_refresh_that_fails_keeps_the_tree(tmp_path, local, monkeypatch):
    store = FaultyStore(local)
    local.put("d/a", b"a")
    monkeypatch.setattr(retry.ANSWER, "limit_s", 0.5)

    async with mounted(tmp_path, store) as m:
        ns = m.ns
        ns.list_ttl = 0
        local.delete("d/a")
        store.fail("list_dir", 1, key="d/")
        assert await alist(ns, "d") == ["a"]  # the store failed: what we knew stays
        assert await alist(ns, "d") == []
        # A store that does not answer: the listing is given up after a while, not waited for.
        gate = store.hold("list_dir", "d/")
        local.put("d/b", b"b")
        with trio.fail_after(5):
            assert await alist(ns, "d") == []
        gate.open()
        assert await alist(ns, "d") == ["b"]


@trio_test
async def test_no_refresh_without_a_ttl(tmp_path, local):
    store = FaultyStore(local)

    async with mounted(tmp_path, store) as m:
        local.put("late", b"x")
        assert await aerr(m.ns.lookup_async, ROOT_INODE, "late") == errno.ENOENT
        assert await alist(m.ns) == []
        assert m.ns.negative_ttl(ROOT_INODE, "late") == 0
        assert store.count("head") == store.count("list_dir") == 0
