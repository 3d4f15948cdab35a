"""Checkpoint markers across nodes, in process (model/gate.py, cluster/records.py): two nodes'
namespaces on one local store, each through its own FaultyStore so that one node's uploads can
be held while the other's go on. Real stores and real journals; no FUSE (tests/test_nodes.py
drives real mounts and real frameworks).

A marker (a shard index, a ``latest`` pointer) is published only once what it names is in the
store, whoever wrote it; until then it is held aside and later files publish as usual; a held
marker made obsolete (replaced, its step deleted, a newer step of its series whole) is dropped.
"""

from __future__ import annotations

import json
import os
from contextlib import AsyncExitStack

import pytest
import trio

from ckptfs.cluster import records as writer_records
from ckptfs.errors import FsError
from tests.support.faults import FaultyStore
from tests.support.harness import trio_test, wait_until_async
from tests.support.inprocess import ROOT_INODE, create, ino, mkdirs, mounted, store_files, sync

pytestmark = pytest.mark.unit

GUARD = 30.0


async def write(m, path: str, data: bytes) -> None:
    """create (or open with O_TRUNC) + write + close, then what the FUSE glue awaits before the
    close returns."""
    try:
        existing = ino(m.ns, path)
    except FsError:
        await create(m.ns, path, data)
    else:
        fh = (await m.ns.open(existing, os.O_WRONLY | os.O_TRUNC))[0].fh
        await m.ns.write(fh, 0, data)
        m.ns.flush(fh)
        m.ns.release(fh)
    await m.ns.recorded()


def index(*shards: str) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}}).encode()


def records_in(store) -> set[str]:
    inner = store.inner if isinstance(store, FaultyStore) else store
    return {o.key for o in inner.list(writer_records.PREFIX) if not o.key.endswith("/")}


async def nodes(stack: AsyncExitStack, tmp_path, local, n: int = 2):
    made = []
    for i in range(n):
        root = tmp_path / f"node{i}"
        root.mkdir()
        made.append(await stack.enter_async_context(mounted(root, FaultyStore(local))))
    return made


@trio_test
async def test_an_index_waits_for_the_shard_another_node_still_uploads(tmp_path, local):
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        mkdirs(a.ns, "step_100")
        mkdirs(b.ns, "step_100")
        held = b.store.hold("put", "step_100/shard-1.bin")  # B's upload is never answered
        await write(b, "step_100/shard-1.bin", b"1" * 5000)
        # (the close returned: B's record of step_100/ is in the store)
        assert any(k.startswith(writer_records.PREFIX + "step_100/") for k in records_in(local))
        await write(a, "step_100/shard-0.bin", b"0" * 5000)
        await write(a, "step_100/model.index.json", index("shard-0.bin", "shard-1.bin"))
        await write(a, "unrelated.txt", b"later files go on")
        await wait_until_async(lambda: "unrelated.txt" in store_files(local), GUARD, "a later file published")
        files = store_files(local)
        assert "step_100/shard-0.bin" in files and "step_100/model.index.json" not in files
        (wait,) = a.core.gate.waiting()
        assert wait.key == "step_100/model.index.json" and b.core.records.node in wait.nodes
        assert a.ns.state(ino(a.ns, "step_100/model.index.json")) == "pending"
        # a sync of other paths does not wait for it; one of the whole mount does
        with trio.fail_after(GUARD):
            await a.uploader.wait_durable(
                a.ns.sync_target(["unrelated.txt"]), a.ns.sync_scope(["unrelated.txt"])
            )
        with trio.move_on_after(0.5) as whole:
            await a.uploader.wait_durable(a.ns.sync_target([]), a.ns.sync_scope([]))
        assert whole.cancelled_caught

        held.open()
        with trio.fail_after(GUARD):
            await sync(a)
        files = store_files(local)
        assert files["step_100/model.index.json"] == index("shard-0.bin", "shard-1.bin")
        assert "step_100/shard-1.bin" in files
        assert a.ns.state(ino(a.ns, "step_100/model.index.json")) == "durable"
        assert not a.core.gate.waiting()
        # B's record goes once its files are all published and the directory is idle
        await wait_until_async(lambda: not records_in(local), GUARD, "no writer record left")


@trio_test
async def test_a_pointer_to_a_step_whose_node_is_lost_never_lands_and_gives_way(tmp_path, local):
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        for m in (a, b):
            mkdirs(m.ns, "global_step100")
        b.store.hold("put", "global_step100/mp_rank_01_model_states.pt")  # never answered: B is lost
        await write(b, "global_step100/mp_rank_01_model_states.pt", b"b" * 3000)
        await write(a, "global_step100/mp_rank_00_model_states.pt", b"a" * 3000)
        await write(a, "latest", b"global_step100")
        await trio.sleep(1.0)  # a few rounds of checks
        assert "latest" not in store_files(local)
        (wait,) = a.core.gate.waiting()
        assert wait.key == "latest" and b.core.records.node in wait.nodes

        # The job goes on without B (a replacement node): step 200 is whole, and its pointer
        # replaces the one that could never complete.
        mkdirs(a.ns, "global_step200")
        await write(a, "global_step200/mp_rank_00_model_states.pt", b"A" * 3000)
        await write(a, "global_step200/mp_rank_01_model_states.pt", b"B" * 3000)
        await write(a, "latest", b"global_step200")
        with trio.fail_after(GUARD):
            await sync(a)
        assert store_files(local)["latest"] == b"global_step200"
        # (the rewrite replaced the pending version, as for any file rewritten before its upload)
        assert not a.uploader.held and not a.core.gate.waiting()


@trio_test
async def test_a_stuck_marker_is_dropped_when_a_newer_step_is_whole(tmp_path, local):
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        for m in (a, b):
            mkdirs(m.ns, "ckpts/step_100")
        b.store.hold("put", "ckpts/step_100/b.bin")
        await write(b, "ckpts/step_100/b.bin", b"b" * 100)
        await write(a, "ckpts/step_100/a.bin", b"a" * 100)
        await write(a, "ckpts/step_100/model.index.json", index("a.bin", "b.bin"))
        await wait_until_async(lambda: a.core.gate.waiting(), GUARD, "the index held")
        mkdirs(a.ns, "ckpts/step_200")
        await write(a, "ckpts/step_200/a.bin", b"A" * 100)
        await write(a, "ckpts/step_200/model.index.json", index("a.bin"))
        with trio.fail_after(GUARD):
            await sync(a)
        files = store_files(local)
        assert "ckpts/step_200/model.index.json" in files
        assert "ckpts/step_100/model.index.json" not in files
        assert a.uploader.dropped_count == 1
        assert "step 200" in a.uploader.dropped[0]["reason"]


@trio_test
async def test_deleting_the_step_drops_its_held_marker(tmp_path, local):
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        for m in (a, b):
            mkdirs(m.ns, "iter_0000100")
        b.store.hold("put", "iter_0000100/b.pt")
        await write(b, "iter_0000100/b.pt", b"b")
        await write(a, "iter_0000100/a.pt", b"a")
        await write(a, "latest_checkpointed_iteration.txt", b"100")
        await wait_until_async(lambda: a.core.gate.waiting(), GUARD, "the tracker held")
        with trio.fail_after(GUARD):
            await a.uploader.wait_durable(a.uploader.last_seq() - 1)  # all but the tracker
        # rotation removes the step: the tracker that names it has nothing left to wait for
        a.ns.unlink(ino(a.ns, "iter_0000100"), "a.pt")
        a.ns.rmdir(ROOT_INODE, "iter_0000100")
        with trio.fail_after(GUARD):
            await sync(a)
        assert "latest_checkpointed_iteration.txt" not in store_files(local)
        assert a.uploader.dropped_count == 1


@trio_test
async def test_one_node_publishes_as_before_with_one_listing_per_marker(tmp_path, local):
    async with AsyncExitStack() as stack:
        (a,) = await nodes(stack, tmp_path, local, n=1)
        mkdirs(a.ns, "step_5")
        for i in range(4):
            await write(a, f"step_5/shard-{i}.bin", bytes([i]) * 2000)
        await write(a, "step_5/model.index.json", index(*(f"shard-{i}.bin" for i in range(4))))
        await write(a, "latest", b"step_5")
        with trio.fail_after(GUARD):
            await sync(a)
        assert {"step_5/model.index.json", "latest"} <= set(store_files(local))
        assert a.uploader.dropped_count == 0 and not a.uploader.held
        # the records listing of each marker, and nothing per named file
        assert a.core.gate.listings == 2
        assert a.store.count("head") == 0


@trio_test
async def test_a_node_lost_before_a_save_does_not_hold_its_markers(tmp_path, local):
    """A job resumed after a node was lost writes the torn step again, into the same directory:
    the lost node's record holds the marker of the save it was lost in, not the new one."""
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        for m in (a, b):
            m.core.records.lost_after = 1.0
            mkdirs(m.ns, "step_100")
        b.store.hold("put", "step_100/b.bin")  # B never uploads its shard, nor ever beats
        b.store.hold("put", writer_records.NODES_PREFIX + b.core.records.node)
        await write(b, "step_100/b.bin", b"b" * 100)
        await write(a, "step_100/a.bin", b"a" * 100)
        await write(a, "step_100/model.index.json", index("a.bin", "b.bin"))
        await wait_until_async(lambda: a.core.gate.waiting(), GUARD, "the index held")
        await trio.sleep(2.5)  # B is lost now, but it was alive when that index was written
        (wait,) = a.core.gate.waiting()
        assert b.core.records.node in wait.nodes and not wait.lost
        assert "step_100/model.index.json" not in store_files(local)

        # the job resumes without B: step 100 is written again, whole, by the nodes left
        await write(a, "step_100/b.bin", b"B" * 100)
        await write(a, "step_100/model.index.json", index("a.bin", "b.bin"))
        with trio.fail_after(GUARD):
            await sync(a)
        files = store_files(local)
        assert files["step_100/b.bin"] == b"B" * 100
        assert files["step_100/model.index.json"] == index("a.bin", "b.bin")


@trio_test
async def test_a_pointer_to_a_step_only_another_node_writes_waits_for_it(tmp_path, local):
    async with AsyncExitStack() as stack:
        a, b = await nodes(stack, tmp_path, local)
        mkdirs(b.ns, "step_7")
        held = b.store.hold("put", "step_7/model.pt")
        await write(b, "step_7/model.pt", b"m" * 100)
        await write(a, "latest", b"step_7\n")  # A has nothing of step_7: only B's record says it exists
        await wait_until_async(lambda: a.core.gate.waiting(), GUARD, "the pointer held")
        assert "latest" not in store_files(local)
        held.open()
        with trio.fail_after(GUARD):
            await sync(a)
        assert store_files(local)["latest"] == b"step_7\n"


@trio_test
async def test_an_index_naming_a_shard_nobody_holds_waits_past_the_record_timeout(tmp_path, local):
    """No timeout publishes a marker as written: an index naming a shard that is in no store and
    on no node stays held, round after round, well past --record-timeout, until the shard shows
    up (issue 39)."""
    async with AsyncExitStack() as stack:
        (a,) = await nodes(stack, tmp_path, local, 1)
        a.core.records.timeout = 0.2  # (what the old fallback waited before publishing as written)
        mkdirs(a.ns, "step_7")
        await write(a, "step_7/model.index.json", index("shard-0.bin", "shard-1.bin"))
        await write(a, "step_7/shard-0.bin", b"0" * 100)
        await wait_until_async(lambda: a.core.gate.waiting(), GUARD, "the index held")
        await wait_until_async(
            lambda: a.core.gate.waiting()[0].checks >= 6, GUARD, "six rounds of checks (over 1 s)"
        )
        assert "step_7/model.index.json" not in store_files(local)
        (wait,) = a.core.gate.waiting()
        assert wait.missing == ["step_7/shard-1.bin"] and wait.absent_since is not None
        assert "in no store and on no node we know of, since" in wait.describe()
        await write(a, "step_7/shard-1.bin", b"1" * 100)  # (the shard after all)
        with trio.fail_after(GUARD):
            await sync(a)
        assert "step_7/model.index.json" in store_files(local) and not a.core.gate.waiting()
