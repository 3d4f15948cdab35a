"""The namespace driven in-process, built by ``build_core`` as the daemon builds it (no FUSE: no
kernel, so no page-cache prefill), over an object store (a LocalStore on tmp_path, or a
FaultyStore around one), inside trio with the uploader and fetcher running in a nursery; and
helpers that send what the kernel would."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import pytest
import trio
import xxhash

from ckptfs.config import MountConfig
from ckptfs.daemon.wiring import build_core
from ckptfs.errors import FsError
from ckptfs.model.namespace import Namespace
from ckptfs.model.tree import ROOT_INODE
from ckptfs.objects.integrity import is_reserved
from tests.support.faults import FaultyStore

BS = 64 << 10
UID, GID = os.getuid(), os.getgid()
WRITE = os.O_WRONLY
RDWR = os.O_RDWR


def config(tmp_path) -> MountConfig:
    """Small blocks and cache; the tree is the listing at mount plus this mount's changes
    (list_ttl None), writers wait for space as long as it takes, reads as long as the store."""
    return MountConfig(
        mountpoint=str(tmp_path / "mnt"),
        store_url="",
        cache_dir=str(tmp_path / "cache"),
        part_size=BS,
        ram_cache=16 * BS,
        cache_size=64 * BS,
        upload_concurrency=4,
        list_ttl=None,
        write_timeout=None,
        read_timeout=None,
        umask=0o022,
    )


class InProcessMount:
    """The daemon's parts around one namespace (``build_core``'s ``Core``, as ``Daemon.run``
    makes it)."""

    def __init__(self, tmp_path, store):
        self.store = store
        self.core = build_core(
            config(tmp_path), store, tmp_path / "cache", tmp_path / "ram", check_ram_room=False
        )
        self.cache, self.journal = self.core.cache, self.core.journal
        self.uploader, self.fetcher, self.ns = self.core.uploader, self.core.fetcher, self.core.namespace

    def close(self):
        self.core.close()


@asynccontextmanager
async def mounted(tmp_path, store, listing=None):
    """A namespace serving ``store`` (built from ``listing``, or the store's own listing)."""
    m = InProcessMount(tmp_path, store)
    try:
        async with trio.open_nursery() as nursery:
            await m.core.start(nursery)
            m.core.load(list(store.list("")) if listing is None else listing)
            try:
                yield m
            finally:
                if isinstance(store, FaultyStore):
                    store.open_all()
            nursery.cancel_scope.cancel()
    finally:
        m.close()


# -- what the kernel would send ---------------------------------------------------------------


def ino(ns: Namespace, path: str) -> int:
    node = ROOT_INODE
    for part in [p for p in path.split("/") if p]:
        node = ns.lookup(node, part).ino
    return node


async def create(ns: Namespace, path: str, data: bytes) -> int:
    """create + write + close: the file is committed."""
    parent, _, name = path.rpartition("/")
    handle, attr = ns.create(ino(ns, parent), name, 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    if data:
        assert await ns.write(handle.fh, 0, data) == len(data)
    ns.flush(handle.fh)
    ns.release(handle.fh)
    return attr.ino


async def read_all(ns: Namespace, path_or_ino) -> bytes:
    i = ino(ns, path_or_ino) if isinstance(path_or_ino, str) else path_or_ino
    handle, *_ = await ns.open(i, os.O_RDONLY)
    try:
        return await ns.read(handle.fh, 0, 1 << 30)  # clamped to the version's size
    finally:
        ns.release(handle.fh)


async def read_in_pieces(ns: Namespace, path: str, piece: int = BS // 2) -> bytes:
    """Reads of at most ``piece`` bytes, as the kernel sends them (a file may exceed the cache)."""
    handle, *_ = await ns.open(ino(ns, path), os.O_RDONLY)
    try:
        out = bytearray()
        while chunk := await ns.read(handle.fh, len(out), piece):
            out += chunk
        return bytes(out)
    finally:
        ns.release(handle.fh)


def mkdirs(ns: Namespace, path: str) -> int:
    node = ROOT_INODE
    for part in [p for p in path.split("/") if p]:
        try:
            node = ns.lookup(node, part).ino
        except FsError:
            node = ns.mkdir(node, part, 0o755, UID, GID).ino
    return node


def names(ns: Namespace, path: str = "") -> list[str]:
    return [name for name, _ in ns.readdir(ino(ns, path))]


def err(fn, *args) -> int:
    with pytest.raises(FsError) as info:
        fn(*args)
    return info.value.errno


async def aerr(fn, *args) -> int:
    with pytest.raises(FsError) as info:
        await fn(*args)
    return info.value.errno


async def sync(m: InProcessMount) -> None:
    await m.uploader.wait_durable(m.uploader.last_seq())


def store_files(store) -> dict[str, bytes]:
    """The files in the store (checksum manifests are not files)."""
    inner = store.inner if isinstance(store, FaultyStore) else store
    return {
        o.key: inner.get_range(o.key, 0, o.size)
        for o in inner.list("")
        if not o.key.endswith("/") and not is_reserved(o.key)
    }


def store_keys(store) -> set[str]:
    inner = store.inner if isinstance(store, FaultyStore) else store
    return {o.key for o in inner.list("") if not is_reserved(o.key)}


def assert_xxh3(store, key: str, data: bytes) -> None:
    """The object holds ``data``; its xxh3 metadata, when it has one, agrees (a file streamed
    while it was written has none: the upload began before its last byte was known)."""
    inner = store.inner if isinstance(store, FaultyStore) else store
    info = inner.head(key)
    assert (
        xxhash.xxh3_64(inner.get_range(key, 0, info.size + 1)).hexdigest() == xxhash.xxh3_64(data).hexdigest()
    )
    assert info.metadata.get("xxh3", xxhash.xxh3_64(data).hexdigest()) == xxhash.xxh3_64(data).hexdigest()


async def write_blocks(ns: Namespace, fh: int, data: bytes, chunk: int = BS // 4) -> None:
    """Sequential writes in pieces, as torch.save sends them."""
    for offset in range(0, len(data), chunk):
        await ns.write(fh, offset, data[offset : offset + chunk])
