"""`ckptfs warmup`: real mounts on both stores, then the namespace and fetcher in process.

End to end, files written through one mount are warmed on a second mount with an empty cache
(as on another node); reading them afterwards must fetch nothing from the store (the daemon's
fetched_bytes counter stays put). In process: a reader and warmup share fetches, warmed files
become the most recently used clean data, and a cache that cannot make room fails warmup."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.model.tree import ROOT_INODE
from tests.support.harness import assert_one_line_error, blob, trio_test, write_files
from tests.support.inprocess import BS, GID, UID, create, ino, mkdirs, mounted, read_all, sync
from tests.support.mounting import CKPTFS, ckptfs

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


def test_warmup_directory_then_reads_fetch_nothing(store, mount_factory):
    files = {
        "step-2/model.pt": os.urandom(20 * MiB + 12345),  # multi-part: 3 blocks, the last short
        "step-2/optim/shard-0.pt": os.urandom(18 * MiB),
        "step-2/optim/shard-1.pt": os.urandom(100_000),
        "step-2/latest": b"2",
        "step-2/empty": b"",
        "step-1/model.pt": os.urandom(MiB),  # not asked for: stays cold
    }
    writer = mount_factory().start()
    write_files(writer.path, files)
    writer.stop()  # drains: everything is in the store

    m = mount_factory().start()  # another cache dir: nothing cached
    assert m.fetched_bytes() == 0
    done = ckptfs("warmup", str(m.path / "step-2"))
    warmed = sum(len(data) for name, data in files.items() if name.startswith("step-2/"))
    assert "warmed 5 files" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert m.fetched_bytes() == warmed

    for name, data in files.items():
        if name.startswith("step-2/"):
            assert (m.path / name).read_bytes() == data
    assert m.fetched_bytes() == warmed  # every read came from the cache

    # Again: everything is cached already, nothing is fetched.
    done = ckptfs("warmup", str(m.path / "step-2"), "--json")
    result = json.loads(done.stdout)
    assert (result["files"], result["total_bytes"], result["fetched_bytes"]) == (5, warmed, 0)
    assert result["seconds"] < 5
    assert m.fetched_bytes() == warmed
    m.stop()


def test_warmup_one_file_bad_paths_and_a_cache_too_small(store, mount_factory, tmp_path):
    files = {"ckpt/a.bin": os.urandom(20 * MiB), "ckpt/b.bin": os.urandom(20 * MiB)}
    writer = mount_factory().start()
    write_files(writer.path, files)
    writer.stop()

    m = mount_factory(ram_cache="16MiB", cache_size="16MiB").start()  # four 8 MiB blocks in all
    # A path relative to the cwd, inside the mount.
    done = subprocess.run(
        [*CKPTFS, "warmup", "ckpt/a.bin"],
        cwd=m.path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "warmed 1 file," in done.stderr, done.stderr
    assert m.fetched_bytes() == 20 * MiB  # b.bin stays cold
    assert (m.path / "ckpt/a.bin").read_bytes() == files["ckpt/a.bin"]
    assert m.fetched_bytes() == 20 * MiB

    assert_one_line_error(ckptfs("warmup", str(m.path / "ckpt/nope.bin"), check=False), None, "no such file")
    assert_one_line_error(ckptfs("warmup", str(tmp_path), check=False), None, "is not on a ckptfs mount")
    # Both files need six blocks: the cache holds four. A clear error, not a hang.
    assert_one_line_error(
        ckptfs("warmup", str(m.path / "ckpt"), check=False, timeout=60), None, "cache holds at most"
    )
    assert (m.path / "ckpt/a.bin").read_bytes() == files["ckpt/a.bin"]  # the mount still serves
    assert m.fetched_bytes() == 20 * MiB
    m.stop()


# -- in process: the namespace and the fetcher without FUSE (fast) ------------------------------------


async def warm(m, paths: list[str], progress: list | None = None) -> dict:
    """What the daemon's warmup handler does: hold, warm, release."""
    targets = m.ns.contents_under(paths)

    async def report(update: dict) -> None:
        if progress is not None:
            progress.append(update)

    try:
        return await m.fetcher.warm([c for c, _ in targets], report, interval=0.01)
    finally:
        for _, done in targets:
            done()


@trio_test
async def test_warm_shares_fetches_with_a_reader_and_marks_files_recently_used(tmp_path, local):
    big, small = blob(10 * BS + 7, 1), blob(BS // 2, 2)

    async with mounted(tmp_path / "writer", local) as m:
        await create(m.ns, "big.bin", big)
        await create(m.ns, "small.bin", small)
        await sync(m)
    async with mounted(tmp_path / "reader", local) as m:  # a fresh cache: nothing cached
        nodes = {name: m.ns.inodes[ino(m.ns, name)] for name in ("big.bin", "small.bin")}
        assert await warm(m, ["small.bin"]) == {
            "files": 1,
            "total_bytes": len(small),
            "fetched_bytes": len(small),
        }
        progress: list[dict] = []
        read = {}

        async def reader():
            read["big"] = await read_all(m.ns, "big.bin")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)  # a concurrent reader of the same cold file
            result = await warm(m, [""], progress)
        assert read["big"] == big
        assert result == {"files": 2, "total_bytes": len(big) + len(small), "fetched_bytes": len(big)}
        assert m.fetcher.fetched_bytes == len(big) + len(small)  # each block fetched once
        assert progress[-1] == {
            "done_bytes": len(big) + len(small),
            "total_bytes": len(big) + len(small),
            "files": 2,
            "files_done": 2,
        }
        assert all(n.version.content.holders == 1 for n in nodes.values())  # released again
        assert [n.name for n in m.cache.clean] == ["big.bin", "small.bin"]  # released in tree order
        # Warming a cached file fetches nothing and makes it the most recently used.
        for name in ("small.bin", "big.bin"):
            assert (await warm(m, [name]))["fetched_bytes"] == 0
            assert list(m.cache.clean)[-1] is nodes[name]
        assert await read_all(m.ns, "small.bin") == small
        assert m.fetcher.fetched_bytes == len(big) + len(small)


@trio_test
async def test_warm_into_a_cache_full_of_unsent_data_fails_clearly(tmp_path, local):
    """Blocks written all but their last byte never stream, so nothing can make room: warmup
    fails with ENOSPC and a message saying why, instead of waiting forever."""
    big = blob(10 * BS, 3)

    async with mounted(tmp_path / "writer", local) as m:
        await create(m.ns, "big.bin", big)
        await sync(m)
    async with mounted(tmp_path / "reader", local) as m:
        handle, _ = m.ns.create(ROOT_INODE, "gappy.bin", 0o644, os.O_WRONLY, UID, GID)
        for index in range(76):  # the cache holds 80 blocks
            await m.ns.write(handle.fh, index * BS, blob(BS - 1, index))
        with trio.fail_after(30), pytest.raises(FsError) as info:
            await warm(m, ["big.bin"])
        assert info.value.errno == errno.ENOSPC and "cache is full" in str(info.value)
        node = m.ns.inodes[ino(m.ns, "big.bin")]
        assert node.version.content.holders == 1
        m.ns.release(handle.fh)  # the writer goes away: now it fits
        assert (await warm(m, ["big.bin"]))["total_bytes"] == len(big)
        assert await read_all(m.ns, "big.bin") == big
        assert m.fetcher.fetched_bytes <= 2 * len(big)


@trio_test
async def test_warm_more_than_the_ram_tier_keeps_every_file(tmp_path, local):
    """Files warmed first are not evicted to make room for the ones after them (the RAM tier,
    16 blocks, fills up long before the 40 blocks asked; the disk tier takes the rest)."""
    files = {f"step/{i}.bin": blob(10 * BS, 10 + i) for i in range(4)}

    async with mounted(tmp_path / "writer", local) as m:
        mkdirs(m.ns, "step")
        for name, data in files.items():
            await create(m.ns, name, data)
        await sync(m)
    async with mounted(tmp_path / "reader", local) as m:
        assert (await warm(m, ["step"]))["fetched_bytes"] == 40 * BS
        for name, data in files.items():
            assert await read_all(m.ns, name) == data
        assert m.fetcher.fetched_bytes == 40 * BS
