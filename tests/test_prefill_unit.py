"""prefill.py on its own: which versions are pushed into the page cache, in what order, and when not.

The daemon hands Prefill its kernel's caches (a ``KernelCache``: the FUSE transport's store and
inval_inode notifications, a stat through the mount); here a stand-in records what it is asked, so the
rules are checked without a kernel: the invalidate and the stat come before the first page,
every cached block is pushed exactly once at its offset, a file that is open waits for its last
close, and a push stops at the first change (a newer version, an unlink, the kernel forgetting
the inode). test_prefill.py checks the real page cache through a mount.
"""

from __future__ import annotations

import errno
import random

import pytest
import trio

from ckptfs.cache.cache import Cache
from ckptfs.cache.contents import Content
from ckptfs.model.prefill import KernelCache, Prefill
from ckptfs.model.tree import Node, Version
from tests.support.harness import trio_test

pytestmark = pytest.mark.unit

BS = 64 << 10


class Kernel(KernelCache):
    """Records what the prefill asks of the kernel, in order."""

    def __init__(self, fail_at_offset: int | None = None):
        self.calls: list[tuple] = []
        self.pages: dict[int, bytes] = {}
        self.fail_at_offset = fail_at_offset

    def store_pages(self, ino, offset, view) -> None:
        if offset == self.fail_at_offset:
            raise OSError(errno.ENOENT, "the kernel forgot the inode")
        self.calls.append(("store", ino, offset))
        self.pages[offset] = bytes(view)

    def invalidate_inode(self, ino) -> None:
        self.calls.append(("invalidate", ino))

    def stat(self, key) -> None:
        self.calls.append(("stat", key))

    def forget_name(self, parent_ino, name) -> None:
        self.calls.append(("forget", parent_ino, name))


@pytest.fixture
def cache(tmp_path):
    c = Cache(tmp_path / "cache", tmp_path / "ram", BS, 16 * BS, 64 * BS)
    yield c
    c.close()


def cached_file(cache: Cache, data: bytes, evicted: tuple[int, ...] = ()) -> tuple[Node, Version]:
    blocks = []
    for i, offset in enumerate(range(0, len(data), BS)):
        if i in evicted:
            blocks.append(None)
            continue
        ref = cache.try_alloc()
        cache.write(ref, 0, data[offset : offset + BS])
        blocks.append(ref)
    root = Node(1, "", None, True, 0o755, 0, 0)
    node = Node(2, "step1.pt", root, False, 0o644, 0, 0)
    root.children[node.name] = node
    node.version = Version(Content(cache, len(data), blocks, in_store=True), seq=1)
    node.nlookup = 1  # the kernel knows the inode
    return node, node.version


async def until(predicate) -> None:
    while not predicate():
        await trio.sleep(0.01)


@trio_test
async def test_a_closed_file_is_pushed_whole_after_the_kernel_drops_its_pages(cache):
    data = random.Random(1).randbytes(3 * BS + 500)
    node, version = cached_file(cache, data, evicted=(1,))
    kernel = Kernel()
    prefill = Prefill(busy=lambda: False, kernel=kernel)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        prefill.want(node, version)
        await until(lambda: prefill.queued_files == 0 and prefill.pushed_bytes)
        nursery.cancel_scope.cancel()
    assert kernel.calls == [
        ("invalidate", 2),
        ("stat", "step1.pt"),
        ("store", 2, 0),
        ("store", 2, 2 * BS),
        ("store", 2, 3 * BS),
    ]  # block 1 not cached
    assert kernel.pages == {0: data[:BS], 2 * BS: data[2 * BS : 3 * BS], 3 * BS: data[3 * BS :]}
    assert prefill.pushed_bytes == len(data) - BS and node.kernel_version is version
    assert all(n == 1 for n in cache.refcounts.values())  # the pins taken for the copy are back


@trio_test
async def test_an_open_file_waits_for_its_last_close(cache):
    node, version = cached_file(cache, b"x" * BS)
    node.handles = 1
    kernel = Kernel()
    prefill = Prefill(busy=lambda: False, kernel=kernel)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        prefill.want(node, version)
        await until(lambda: node.ino in prefill.deferred)
        assert kernel.calls == [] and prefill.queued_files == 0
        node.handles = 0
        prefill.closed(node)
        await until(lambda: prefill.pushed_bytes == BS)
        nursery.cancel_scope.cancel()
    assert kernel.calls[0] == ("invalidate", 2) and kernel.pages == {0: b"x" * BS}


@trio_test
async def test_nothing_is_pushed_while_the_machine_is_busy(cache):
    node, version = cached_file(cache, b"y" * BS)
    kernel = Kernel()
    state = {"busy": True, "asked": 0}

    def busy() -> bool:
        state["asked"] += 1
        return state["busy"]

    prefill = Prefill(busy=busy, kernel=kernel)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        prefill.want(node, version)
        await until(lambda: state["asked"] >= 3)  # it looked, and looked again
        assert kernel.calls == [] and prefill.queued_files == 1
        state["busy"] = False
        await until(lambda: prefill.pushed_bytes == BS)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("change", ["newer version", "unlinked", "forgotten"])
@trio_test
async def test_a_version_no_longer_current_is_not_pushed(cache, change):
    node, version = cached_file(cache, b"z" * BS)
    if change == "newer version":
        node.version = Version(Content(cache, 0, []), seq=2)
    elif change == "unlinked":
        node.unlinked = True
    else:
        node.nlookup = 0
    kernel = Kernel()
    prefill = Prefill(busy=lambda: False, kernel=kernel)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        prefill.want(node, version)
        await until(lambda: prefill.queued_files == 0)
        nursery.cancel_scope.cancel()
    assert kernel.calls == [] and prefill.pushed_bytes == 0 and node.kernel_version is None


@trio_test
async def test_the_kernel_refusing_a_page_stops_the_push(cache):
    data = random.Random(2).randbytes(3 * BS)
    node, version = cached_file(cache, data)
    kernel = Kernel(fail_at_offset=BS)
    prefill = Prefill(busy=lambda: False, kernel=kernel)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        prefill.want(node, version)
        await until(lambda: prefill.queued_files == 0 and prefill.pushed_bytes)
        nursery.cancel_scope.cancel()
    assert list(kernel.pages) == [0] and prefill.pushed_bytes == BS  # nothing after the refusal
    assert all(n == 1 for n in cache.refcounts.values())


@trio_test
async def test_the_newest_request_goes_first_and_prefill_off_queues_nothing(cache):
    off = Prefill(busy=lambda: False)
    node, version = cached_file(cache, b"a" * BS)
    off.want(node, version)
    assert off.queued_files == 0  # no kernel: the daemon runs without prefill

    older, older_version = node, version
    newer, newer_version = cached_file(cache, b"b" * BS)
    newer.ino = 3
    kernel = Kernel()
    prefill = Prefill(busy=lambda: False, kernel=kernel)
    prefill.want(older, older_version)
    prefill.want(newer, newer_version)

    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        await until(lambda: prefill.queued_files == 0 and prefill.pushed_bytes == 2 * BS)
        nursery.cancel_scope.cancel()
    assert [c[1] for c in kernel.calls if c[0] == "invalidate"] == [3, 2]
