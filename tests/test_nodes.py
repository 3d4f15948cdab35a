"""Checkpoints whole across nodes, with real mounts and real frameworks (docs/semantics.md,
"Across nodes"): each rank of a job runs on its own node (tests/support/cluster.py: its own
mount, cache dir, RAM tier and link to the store) and writes through that node's mount. Node B's
uploads are held (its link never answers them; its small writer records and heartbeats pass),
the job's save returns, then B is lost (kill -9, cache dir and RAM tier wiped, never back). The
store must never show a marker (DCP's `.metadata`, a shard index, a tracker or `latest`, HF's
`trainer_state.json`) for the torn step; `ckptfs checkpoints` on the store URL must name the step
before as the restart; and a replacement node's next save, the torn step written again after
the job resumed, must land whole, every sync returning. Both stores (`cluster` fixture).

The long mode adds a torture: three nodes save steps in a loop, each save's index written by a
random node after a barrier, and a random node is lost at a random moment of a random save;
after every loss the store is checked for a marker naming anything it lacks.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.harness import free_port
from tests.support.mounting import ckptfs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
LOST_AFTER = 3.0  # --lost-node-after: a replacement's save comes after B counts as lost
NODE = ("--lost-node-after", str(LOST_AFTER))
LONG = bool(os.environ.get("CKPTFS_LONG"))
PASS = (".ckptfs-writers/", ".ckptfs-nodes/")  # what a held link still lets through: records, heartbeats


class Job:
    """One rank per node of tests/support/cluster_jobs.py, as torchrun on each node starts them.
    A context manager: none is left running."""

    def __init__(self, kind: str, roots: list[Path], step: int, logs: Path):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(len(roots)),
            "LOCAL_WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"{kind}-{step}-rank{rank}.err" for rank in range(len(roots))]
        self.procs = []
        for rank, (root, log) in enumerate(zip(roots, self.logs, strict=True)):
            with open(log, "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.support.cluster_jobs", kind, str(root), str(step)],
                        cwd=REPO,
                        text=True,
                        env={**env, "RANK": str(rank)},
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                    )
                )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def wait_saved(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(self.procs):
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline().strip() if ready else ""
            if line != f"saved {step}":
                raise AssertionError(
                    f"rank {rank} did not save step {step} ({line!r}):\n{self.logs[rank].read_text()[-3000:]}"
                )

    def tell(self, line: str) -> None:
        for p in self.procs:
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def end(self, timeout: float = 120) -> None:
        self.tell("end")
        for rank, p in enumerate(self.procs):
            if p.wait(timeout) != 0:
                raise AssertionError(
                    f"rank {rank} exited {p.returncode}:\n{self.logs[rank].read_text()[-3000:]}"
                )


def save(kind: str, nodes, step: int, logs: Path) -> None:
    """One save of ``step`` by one rank per node (rank 0 on the first), to its end."""
    with Job(kind, [n.path for n in nodes], step, logs) as job:
        job.wait_saved(step)
        job.end()


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def waiting_markers(node) -> list[dict]:
    return node.status()["markers_waiting"]


def restart_step(cluster) -> str | None:
    found = cluster.checkpoints()
    restarts = [s["restart"] for s in found["series"] if s.get("restart")]
    return restarts[-1] if restarts else None


def lose_b_in_a_save(cluster, kind: str, marker: str, step: int, tmp_path: Path):
    """Nodes A and B save ``step - 1`` whole, then ``step`` with B's uploads held; B is lost
    once A holds ``marker`` (a path under A's mount) back. Returns A and B's node id."""
    a = cluster.node("a", extra=NODE)
    b = cluster.node("b", extra=NODE)
    save(kind, [a, b], step - 1, tmp_path / "logs")
    a.sync()
    b.sync()
    b_id = b.status()["writer_records"]["node"]
    b.hold_uploads(except_prefixes=PASS)
    save(kind, [a, b], step, tmp_path / "logs")
    wait_for(lambda: b.held_count() > 0, 60, "B's upload held")  # B's files never reach the store
    held = wait_for(lambda: waiting_markers(a), 60, f"A holds {marker} back")
    assert [w["marker"] for w in held] == [marker], held
    assert b_id in held[0]["other_nodes"], held
    wait_for(lambda: a.status()["training_at_risk_s"] > 0, 10, "A's training at risk counts")
    b.lose()
    return a, b_id


def replace_and_save_again(cluster, a, kind: str, step: int, tmp_path: Path, extra=NODE):
    """B's replacement C joins; the job, resumed from the step before, saves ``step`` again."""
    time.sleep(LOST_AFTER + 1)  # (the job restarts after the node's loss: minutes, in real life)
    c = cluster.node("c", extra=extra)
    save(kind, [a, c], step, tmp_path / "logs")
    a.sync(timeout=120)
    c.sync(timeout=120)
    assert not waiting_markers(a) and not waiting_markers(c)
    return c


def test_dcp_across_two_nodes_a_lost_node_leaves_no_torn_checkpoint(cluster, tmp_path):
    store = cluster.store
    a, b_id = lose_b_in_a_save(cluster, "dcp", "step_2/.metadata", 2, tmp_path)
    keys = store.keys()
    assert {"step_1/.metadata", "step_1/__0_0.distcp", "step_1/__1_0.distcp"} <= keys
    assert "step_2/__0_0.distcp" in keys  # (A's shard: published as usual)
    assert "step_2/.metadata" not in keys and "step_2/__1_0.distcp" not in keys
    assert restart_step(cluster) == "step_1"
    # sync still bounds its wait, and says what is missing and where
    done = ckptfs("sync", str(a.path), "--timeout", "2", check=False)
    assert done.returncode != 0 and "step_2/.metadata waits for" in done.stderr and b_id in done.stderr

    replace_and_save_again(cluster, a, "dcp", 2, tmp_path)
    keys = store.keys()
    assert {"step_2/.metadata", "step_2/__0_0.distcp", "step_2/__1_0.distcp"} <= keys
    assert restart_step(cluster) == "step_2"
    dropped = a.status()["markers_dropped"]
    assert [d["marker"] for d in dropped] == ["step_2/.metadata"], dropped


def test_tracker_and_latest_from_another_node(cluster, tmp_path):
    store = cluster.store
    a, _ = lose_b_in_a_save(cluster, "latest", "latest", 2, tmp_path)
    assert store.read("latest").strip() == b"step_1"  # the pointer of the step before, never step_2
    assert "step_2/model.pt" not in store.keys()
    assert restart_step(cluster) == "step_1"
    c = replace_and_save_again(cluster, a, "latest", 2, tmp_path)
    assert store.read("latest").strip() == b"step_2" and "step_2/model.pt" in store.keys()

    # Megatron: every rank's iteration directory, then rank 0's tracker
    save("megatron", [a, c], 3, tmp_path / "logs")
    a.sync(timeout=120)  # (the tracker naming 3 lands once C's shard has: before step 4 replaces it)
    c.sync(timeout=120)
    assert store.read("latest_checkpointed_iteration.txt") == b"3"
    c.hold_uploads(except_prefixes=PASS)
    save("megatron", [a, c], 4, tmp_path / "logs")
    held = wait_for(lambda: waiting_markers(a), 60, "A holds the tracker back")
    assert [w["marker"] for w in held] == ["latest_checkpointed_iteration.txt"]
    c.lose()
    assert store.read("latest_checkpointed_iteration.txt") == b"3"
    assert "iter_0000004/mp_rank_01/model_optim_rng.pt" not in store.keys()
    assert restart_step(cluster) == "iter_0000003"
    a.lose()  # (its tracker would wait for ever: a clean umount would too)


def test_sharded_save_pretrained_index_from_another_node(cluster, tmp_path):
    store = cluster.store
    a, _ = lose_b_in_a_save(cluster, "pretrained", "step_2/model.safetensors.index.json", 2, tmp_path)
    keys = store.keys()
    assert "step_1/model.safetensors.index.json" in keys
    assert "step_2/model.safetensors.index.json" not in keys
    assert not any(k.startswith("step_2/model-") for k in keys)
    assert restart_step(cluster) == "step_1"
    replace_and_save_again(cluster, a, "pretrained", 2, tmp_path)
    index = json.loads(store.read("step_2/model.safetensors.index.json"))
    assert {f"step_2/{s}" for s in index["weight_map"].values()} <= store.keys()


def test_hf_trainer_two_processes_on_two_nodes(cluster, tmp_path):
    store = cluster.store
    a = cluster.node("a", extra=NODE)
    b = cluster.node("b", extra=NODE)
    with Job("trainer", [a.path, b.path], 0, tmp_path / "logs") as job:
        job.wait_saved(2)
        a.sync()
        b.sync()
        assert {"run/checkpoint-2/trainer_state.json", "run/checkpoint-2/rng_state_1.pth"} <= store.keys()
        b.hold_uploads(except_prefixes=PASS)
        job.tell("next")
        job.wait_saved(4)
        job.end()
    held = wait_for(lambda: waiting_markers(a), 60, "A holds trainer_state.json back")
    assert [w["marker"] for w in held] == ["run/checkpoint-4/trainer_state.json"]
    b.lose()
    keys = store.keys()
    assert (
        "run/checkpoint-4/trainer_state.json" not in keys and "run/checkpoint-4/rng_state_1.pth" not in keys
    )
    assert "run/checkpoint-4/model.safetensors" in keys  # (published as usual: the step is incomplete)
    assert restart_step(cluster) == "run/checkpoint-2"

    time.sleep(LOST_AFTER + 1)
    c = cluster.node("c", extra=NODE)
    with Job("trainer", [a.path, c.path], 0, tmp_path / "logs") as job:  # trains again over the same steps
        job.wait_saved(2)
        job.tell("next")
        job.wait_saved(4)
        job.end()
    a.sync(timeout=120)
    c.sync(timeout=120)
    assert {"run/checkpoint-4/trainer_state.json", "run/checkpoint-4/rng_state_1.pth"} <= store.keys()
    assert restart_step(cluster) == "run/checkpoint-4"


def test_no_marker_publishes_a_pointer_at_once(cluster, tmp_path):
    a = cluster.node("a", extra=("--no-marker", "latest"))
    b = cluster.node("b")
    b.hold_uploads(except_prefixes=PASS)
    save("latest", [a, b], 1, tmp_path / "logs")
    a.sync(timeout=60)  # published as a plain file: nothing held
    assert cluster.store.read("latest").strip() == b"step_1" and "step_1/model.pt" not in cluster.store.keys()
    b.release_uploads()
    b.sync(timeout=60)


# -- a node cut off from the store -----------------------------------------------------------------
RECORD_TIMEOUT = 3.0  # --record-timeout: how long a close of a cut-off node waits for its record


def two_nodes(cluster, peers: bool, kind: str, tmp_path: Path):
    """Nodes A and B (``peers``: with --cluster, each seeing the other live) that saved step 1
    of ``kind`` whole, in the store."""
    extra = (*NODE, "--record-timeout", str(RECORD_TIMEOUT), *(("--cluster",) if peers else ()))
    a, b = cluster.node("a", extra=extra), cluster.node("b", extra=extra)
    if peers:
        for node in (a, b):
            wait_for(lambda n=node: n.status()["peers"]["live"], 30, f"{node.name} sees its peer")
    save(kind, [a, b], 1, tmp_path / "logs")
    a.sync()
    b.sync()
    return a, b, extra


def still_held(a, marker: str, rounds: int = 3) -> dict:
    """A keeps ``marker`` back for ``rounds`` more checks (and past --record-timeout)."""
    start = time.monotonic()
    first = waiting_markers(a)[0]["checks"]
    wait_for(
        lambda: (
            time.monotonic() - start > RECORD_TIMEOUT + 1
            and waiting_markers(a)[0]["checks"] >= first + rounds
        ),
        120,
        f"A checks {marker} {rounds} more times",
    )
    held = waiting_markers(a)
    assert [w["marker"] for w in held] == [marker], held
    return held[0]


@pytest.mark.parametrize("peers", [False, True], ids=["store", "cluster"])
def test_dcp_with_a_node_cut_off_from_the_store_then_lost(cluster, tmp_path, peers):
    """Node B cut off from the store (every request of its that would change the store hangs,
    its writer records and heartbeats too) before a DCP save, then lost: A's `.metadata` never
    reaches the store, however long it waits, with and without --cluster; a replacement's next
    save lands whole."""
    if not LONG and (cluster.kind == "s3") != peers:  # (the suite's time: the other two in long mode)
        pytest.skip("long mode (scripts/test --long): the default suite runs local-store and s3-cluster")
    store = cluster.store
    a, b, extra = two_nodes(cluster, peers, "dcp", tmp_path)
    b_id, written = b.status()["writer_records"]["node"], b.status()["writer_records"]["written"]
    b.hold_uploads(except_prefixes=())  # cut off: nothing of B's reaches the store
    save("dcp", [a, b], 2, tmp_path / "logs")
    assert b.status()["writer_records"]["written"] == written  # (B's record of step_2/ never landed)
    wait_for(lambda: waiting_markers(a), 60, "A holds step_2/.metadata back")
    if peers:  # B told A what it holds, over the peer channel
        held = still_held(a, "step_2/.metadata")
        assert b_id in held["other_nodes"], held
        assert a.status()["writer_records"]["told_to_peers"]["held_for_peers"] == {b_id: ["step_2/"]}
    else:  # the .metadata names B's shard, which no store and no node A knows of holds
        shown = b.status()["writer_records"]
        assert shown["unrecorded"] >= 1 and shown["unrecorded_dirs"] == ["step_2/"], shown
        text = ckptfs("status", str(b.path)).stdout
        assert "without this node's writer record" in text and "step_2/" in text, text
        held = still_held(a, "step_2/.metadata")
        assert held["missing"] == ["step_2/__1_0.distcp"] and held["missing_since"], held
        assert "in no store and on no node we know of, since" in held["waits_for"], held
    b.lose()
    still_held(a, "step_2/.metadata")
    keys = store.keys()
    assert "step_2/.metadata" not in keys and "step_2/__1_0.distcp" not in keys
    assert "step_2/__0_0.distcp" in keys  # (A's shard: published as usual)
    assert restart_step(cluster) == "step_1"

    replace_and_save_again(cluster, a, "dcp", 2, tmp_path, extra)
    assert {"step_2/.metadata", "step_2/__0_0.distcp", "step_2/__1_0.distcp"} <= store.keys()
    assert restart_step(cluster) == "step_2"


def test_dcp_with_a_slow_node_lost_mid_upload(cluster, tmp_path):
    """B's link only slow (its records land, its shard crawls): B lost mid-upload leaves no
    `.metadata` in the store."""
    if cluster.kind != "s3":
        pytest.skip("a slow link needs the S3 store (a local store's link is no network)")
    store = cluster.store
    a, b, _ = two_nodes(cluster, False, "dcp", tmp_path)
    written = b.status()["writer_records"]["written"]
    b.proxy.rate = 4 << 10  # 4 KiB/s: B's 32 KiB shard takes seconds, its records land
    save("dcp", [a, b], 2, tmp_path / "logs")
    wait_for(lambda: b.status()["writer_records"]["written"] > written, 60, "B's record of step_2/ lands")
    held = wait_for(lambda: waiting_markers(a), 60, "A holds step_2/.metadata back")
    assert b.status()["writer_records"]["node"] in held[0]["other_nodes"], held
    assert "step_2/__1_0.distcp" not in store.keys(), "the link was not slow enough to catch B mid-upload"
    b.lose()
    still_held(a, "step_2/.metadata")
    assert "step_2/.metadata" not in store.keys() and "step_2/__1_0.distcp" not in store.keys()
    assert restart_step(cluster) == "step_1"
    a.lose()  # (its .metadata would wait for ever: a clean umount would too)


def test_a_pointer_to_a_cut_off_nodes_step_waits_with_cluster(cluster, tmp_path):
    """A `latest` written by A naming a step of per-rank `torch.save` files that only B wrote,
    B cut off from the store and then lost: with --cluster, B's pushed record holds `latest`
    back (nothing in the pointer names B's files: the record is all A has)."""
    if not LONG and cluster.kind == "s3":
        pytest.skip("long mode (scripts/test --long): the default suite runs it on the local store")
    store = cluster.store
    a, b, extra = two_nodes(cluster, True, "latest", tmp_path)
    assert store.read("latest").strip() == b"step_1"
    b_id = b.status()["writer_records"]["node"]
    b.hold_uploads(except_prefixes=())
    save("latest", [a, b], 2, tmp_path / "logs")
    wait_for(lambda: waiting_markers(a), 60, "A holds latest back")
    b.lose()
    held = still_held(a, "latest")
    assert b_id in held["other_nodes"], held
    assert store.read("latest").strip() == b"step_1" and "step_2/model.pt" not in store.keys()
    assert restart_step(cluster) == "step_1"
    c = replace_and_save_again(cluster, a, "latest", 2, tmp_path, extra)
    assert store.read("latest").strip() == b"step_2" and "step_2/model.pt" in store.keys()
    assert not c.status()["writer_records"]["unrecorded"]


# -- the torture (long mode) ------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def see_each_other(nodes) -> None:
    """Every node (with --cluster) sees every other one live: their records reach each other."""
    for node in nodes:
        wait_for(
            lambda n=node: len(n.status()["peers"]["live"]) == len(nodes) - 1,
            60,
            f"{node.name} sees its peers",
        )


def _torn(store, expected: dict[int, set[str]]) -> list[str]:
    """Markers in the store that name what it lacks: an index naming a missing shard, a `latest`
    naming a step without all its files."""
    keys = store.keys()
    problems = []
    for key in keys:
        if key.endswith("model.safetensors.index.json"):
            directory = key.rsplit("/", 1)[0]
            names = json.loads(store.read(key))["weight_map"].values()
            problems += [f"{key} names {directory}/{n}" for n in names if f"{directory}/{n}" not in keys]
    if "latest" in keys:
        step = int(store.read("latest").strip().rsplit(b"_", 1)[-1])
        problems += [f"latest names step {step} without {k}" for k in sorted(expected[step] - keys)]
    return problems


@pytest.mark.skipif(not os.environ.get("CKPTFS_LONG"), reason="long mode (scripts/test --long)")
@pytest.mark.timeout(5400)
def test_lost_node_torture(cluster, tmp_path):
    """Three nodes (with --cluster) save steps (each node a few shards, one of them over a part; a
    random node writes the index and, after a barrier, rank 0's node `latest`); at a random
    moment of a random save a random node is lost: cut off from the store first (a partition:
    nothing it sends that changes the store gets through, its records and heartbeats neither),
    or its uploads held (its records pass), or neither. After every loss the store is checked
    (`_torn`), the node replaced, and the job resumes from the step `latest` names."""
    losses_wanted = int(os.environ.get("CKPTFS_NODE_LOSSES", "100"))
    rng = random.Random(int(os.environ.get("CKPTFS_TORTURE_SEED", "29")))
    extra = (*NODE, "--cluster")
    nodes = [cluster.node(f"n{i}", extra=extra) for i in range(3)]
    see_each_other(nodes)
    expected: dict[int, set[str]] = {}
    step, losses, made, partitions = 1, 0, 3, 0
    while losses < losses_wanted:
        victim = rng.randrange(3) if rng.random() < 0.5 else None
        moment = rng.choice(["shards", "index", "latest", "after"])
        cut = rng.random() if victim is not None else 1.0
        if cut < 0.35:  # a partition, then the loss
            nodes[victim].hold_uploads(except_prefixes=())
            partitions += 1
        elif cut < 0.8:
            nodes[victim].hold_uploads(except_prefixes=PASS)
        files, lost = set(), False
        for i, node in enumerate(nodes):
            for j in range(2):
                name = f"step_{step}/model-{i * 2 + j + 1:05d}-of-00006.safetensors"
                _write(node.path / name, os.urandom(rng.choice([1000, 9 << 20])))
                files.add(name)
            if victim == i and moment == "shards":
                lost = True
                break
        if not lost:
            writer = nodes[rng.randrange(3)]
            index = {"weight_map": {f"w{k}": f"model-{k + 1:05d}-of-00006.safetensors" for k in range(6)}}
            _write(writer.path / f"step_{step}/model.safetensors.index.json", json.dumps(index).encode())
            files.add(f"step_{step}/model.safetensors.index.json")
            expected[step] = files
            if moment == "index" and victim is not None:
                lost = True
            else:
                _write(nodes[0].path / "latest", f"step_{step}\n".encode())  # (rank 0's node)
                lost = victim is not None and moment in ("latest", "after")
        if lost:
            assert victim is not None
            if moment == "after":
                time.sleep(rng.random() * 2)
            nodes[victim].lose()
            losses += 1
            problems = _torn(cluster.store, expected)
            assert not problems, f"after loss {losses} (step {step}, {moment}): {problems}"
            time.sleep(LOST_AFTER + 1)
            nodes[victim] = cluster.node(f"n{made}", extra=extra)
            made += 1
            see_each_other(nodes)
            resumed = cluster.store.read("latest").strip() if "latest" in cluster.store.keys() else b""
            step = int(resumed.rsplit(b"_", 1)[-1]) + 1 if resumed else 1
        else:
            step += 1
    # A last save per node, each writing the index and `latest`: a marker a node still holds
    # from a torn step is dropped once a newer step of its series is whole on that node.
    for writer in nodes:
        files = set()
        for i, node in enumerate(nodes):
            name = f"step_{step}/model-{i + 1:05d}-of-00003.safetensors"
            _write(node.path / name, os.urandom(1000))
            files.add(name)
        index = {"weight_map": {f"w{k}": f"model-{k + 1:05d}-of-00003.safetensors" for k in range(3)}}
        _write(writer.path / f"step_{step}/model.safetensors.index.json", json.dumps(index).encode())
        expected[step] = files | {f"step_{step}/model.safetensors.index.json"}
        _write(nodes[0].path / "latest", f"step_{step}\n".encode())
        step += 1
    for node in nodes:
        node.release_uploads()
        node.sync(timeout=300)
    assert not _torn(cluster.store, expected)
    assert cluster.store.read("latest").strip() == f"step_{step - 1}".encode()
    print(
        f"lost-node torture: {losses} losses ({partitions} after a partition) over {made - 3} "
        f"replacements, step {step}, no torn checkpoint"
    )
