"""``core.build_core``: the daemon's wiring of the parts, without FUSE, over a local store."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.config import MountConfig
from ckptfs.daemon.wiring import build_core
from ckptfs.model.policy import CheckpointEvictionPolicy
from ckptfs.model.tree import ROOT_INODE
from ckptfs.store.local import LocalStore

pytestmark = pytest.mark.unit

BS = 64 << 10


def config(tmp_path) -> MountConfig:
    return MountConfig(
        mountpoint=str(tmp_path / "mnt"),
        store_url=f"file://{tmp_path / 'store'}",
        cache_dir=str(tmp_path / "cache"),
        part_size=BS,
        ram_cache=16 * BS,
        cache_size=64 * BS,
        upload_concurrency=4,
        list_ttl=0.0,
        write_timeout=7.5,
        read_timeout=9.0,
        umask=0o022,
    )


def test_the_parts_share_one_policy_one_health_and_the_configured_timeouts(tmp_path):
    store = LocalStore.at(tmp_path / "store")
    store.check()
    core = build_core(config(tmp_path), store, tmp_path / "cache", tmp_path / "ram", check_ram_room=False)
    try:
        policy, retention = core.namespace.policy, core.namespace.retention
        assert isinstance(policy, CheckpointEvictionPolicy) and core.cache.policy is policy
        assert (
            retention.policy is policy
            and retention.cache is core.cache
            and retention.uploader is core.uploader
        )
        assert policy.tree is core.namespace.tree and policy.block_size == core.cache.block_size
        assert policy.releases_pending() == core.uploader.holds_cache()  # (asks the uploader)
        assert core.namespace.commits.retention is retention and core.namespace.prefill.kernel is None
        assert core.uploader.health is core.fetcher.health is core.namespace.health is core.health
        assert core.namespace.refresher.health is core.health
        assert (core.cache.write_timeout, core.fetcher.read_timeout, core.namespace.list_ttl) == (
            7.5,
            9.0,
            0.0,
        )
        assert core.uploader.retained_ops() == []  # (the namespace's shadows: none yet)
        assert core.uploader.retained_ops == core.namespace.commits.shadows.retained_ops
    finally:
        core.close()


def test_a_file_written_through_the_core_is_in_the_store_and_shown_by_the_next_core(tmp_path):
    store = LocalStore.at(tmp_path / "store")
    store.check()
    data = os.urandom(3 * BS + 5)

    async def mount_and(work):
        core = build_core(config(tmp_path), store, tmp_path / "cache", tmp_path / "ram", check_ram_room=False)
        try:
            async with trio.open_nursery() as nursery:
                await core.start(nursery)
                core.load(list(store.list("")))
                await work(core)
                nursery.cancel_scope.cancel()
        finally:
            core.close()

    async def write(core):
        ns = core.namespace
        handle, _ = ns.create(ROOT_INODE, "f.bin", 0o644, os.O_WRONLY | os.O_CREAT, os.getuid(), os.getgid())
        await ns.write(handle.fh, 0, data)
        ns.flush(handle.fh)
        ns.release(handle.fh)
        await core.uploader.wait_durable(core.uploader.last_seq())

    async def read(core):
        ns = core.namespace
        attr = ns.lookup(ROOT_INODE, "f.bin")
        handle, *_ = await ns.open(attr.ino, os.O_RDONLY)
        try:
            assert await ns.read(handle.fh, 0, len(data) + 1) == data
        finally:
            ns.release(handle.fh)

    trio.run(mount_and, write)
    assert store.get_range("f.bin", 0, len(data)) == data
    trio.run(mount_and, read)
