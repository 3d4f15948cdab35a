"""The replicated safety level (``--cluster --replicas 1``, ckptfs/cluster/replication.py and
replicas.py), with real mounts, real peers over mutual TLS and real losses: each node of
tests/support/cluster.py has its own mount, cache dir, RAM tier and link to the store. Both
stores (``cluster`` fixture).

Node B's uploads are never answered (its link holds every change to the store but its records
and heartbeats); B writes a 64 MiB file, a file written as ``x.tmp`` and renamed, and a
``latest`` pointer; then B is lost (kill -9, cache dir and RAM tier wiped, never back). Node A,
which holds B's replica, must publish all three, byte-identical, with no ``.tmp`` left and
``latest`` reaching the store only after the files it names. Variants: B lost mid-write (the
file it was writing is not published: its close never returned), right after the close, and
A killed and restarted in the middle of the takeover. A 2-rank DCP save with one rank per node
and B lost before its shard is uploaded: the checkpoint becomes whole in the store and loads.

A node that comes back with its cache dir does not publish an older state over what its
holder published meanwhile. Alone, a replicated mount's close does not wait for a peer.

The long mode adds a torture: three nodes save, one of them lost at a random moment (mid-write,
right after a close, a while after), its replacement joining once the store holds every file
whose close returned; 100 losses by default (``CKPTFS_REPLICA_LOSSES``).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
TAKEOVER_AFTER = 5.0
REPLICATED = ("--cluster", "--replicas", "1", "--takeover-after", str(TAKEOVER_AFTER))
# What a held link still lets through: writer records, their heartbeats, the cluster's records.
PASS = (".ckptfs-writers/", ".ckptfs-nodes/", ".ckptfs-cluster/")


def _pair(cluster, extra=()):
    a = cluster.node("a", extra=(*REPLICATED, *extra))
    b = cluster.node("b", extra=(*REPLICATED, *extra))
    for node in (a, b):
        wait_until(
            lambda node=node: len(node.status()["peers"]["live"]) == 1, 30, what=f"{node.name} sees its peer"
        )
    wait_until(lambda: b.status()["peers"].get("holders"), 30, what="b streams its replicas to a")
    return a, b


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _state(path: Path) -> str:
    return os.getxattr(path, "user.ckptfs.state").decode()


class _Arrivals:
    """When each key first showed in the store's listing (a listing every 20 ms, in a thread)."""

    def __init__(self, store):
        self.store = store
        self.first: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        tick = 0
        while not self.stop.is_set():
            try:
                keys = self.store.keys()
            except Exception:  # noqa: BLE001 - (the test ended and its store went)
                return
            for key in keys:
                self.first.setdefault(key, tick)
            tick += 1
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _save_on_b(b, rng: random.Random) -> dict[str, bytes]:
    """B's save: a 64 MiB file, ``extra.json`` written as ``extra.json.tmp`` then renamed, and
    ``latest``; each close (and the rename) returns once A holds the replica."""
    step = b.path / "step_1"
    step.mkdir()
    files = {"step_1/model.bin": rng.randbytes(64 * MiB), "step_1/extra.json": b'{"step": 1}'}
    _write(step / "model.bin", files["step_1/model.bin"])
    _write(step / "extra.json.tmp", files["step_1/extra.json"])
    os.rename(step / "extra.json.tmp", step / "extra.json")
    files["latest"] = b"step_1\n"
    _write(b.path / "latest", files["latest"])
    for key in files:
        assert _state(b.path / key) == "replicated", key
    assert b.status()["training_at_risk_s"] == 0  # (replicated: a lost node loses nothing)
    return files


def _published(cluster, arrivals: _Arrivals, files: dict[str, bytes], timeout: float = 120) -> None:
    store = cluster.store
    wait_until(lambda: set(files) <= set(arrivals.first), timeout, what=f"{sorted(files)} in the store")
    arrivals.close()
    for key, data in files.items():
        assert hashlib.sha256(store.read(key)).digest() == hashlib.sha256(data).digest(), key
    keys = store.keys()
    assert not [k for k in keys if k.endswith(".tmp")], keys
    assert "step_1/partial.bin" not in keys  # (its close never returned)
    first = arrivals.first
    assert first["latest"] >= max(first[k] for k in files if k != "latest"), first


@pytest.mark.parametrize("moment", ["after_close", "mid_write", "during_takeover"])
def test_a_node_lost_before_its_uploads_loses_nothing(cluster, moment):
    rng = random.Random(31)
    a, b = _pair(cluster)
    b.hold_uploads(except_prefixes=PASS)
    if moment == "during_takeover":
        a.hold_uploads(except_prefixes=PASS)  # (so that A is still publishing when it is killed)
    arrivals = _Arrivals(cluster.store)
    files = _save_on_b(b, rng)
    wait_until(lambda: b.held_count() > 0, 60, what="B's uploads held")
    assert a.status()["peers"]["replica_held_bytes"] >= 64 * MiB
    writer = None
    if moment == "mid_write":  # a file still open for writing when B goes
        writer = open(b.path / "step_1" / "partial.bin", "wb")  # noqa: SIM115 - closed by the loss
        writer.write(rng.randbytes(9 * MiB))
        writer.flush()
    b.lose()
    if writer is not None:
        try:
            writer.close()
        except OSError:
            pass  # (its mount is gone)
    if moment == "during_takeover":
        wait_until(lambda: a.status()["peers"]["takeovers"] == 1, 60, what="A takes B's replica over")
        wait_until(lambda: a.held_count() > 0, 60, what="A's publication of B's files held")
        a.crash()  # kill -9 mid-takeover, restarted with its cache dir: its journal resumes it
    _published(cluster, arrivals, files)
    a.sync(timeout=120)
    assert set(files) <= {k for k in cluster.store.keys()}


def test_dcp_across_two_nodes_with_replicas_survives_a_lost_node(cluster, tmp_path):
    from tests.test_nodes import save

    a, b = _pair(cluster)
    b.hold_uploads(except_prefixes=PASS)
    save("dcp", [a, b], 1, tmp_path / "logs")  # (rank 1 on B: its shard only in B's cache, and A's)
    wait_until(lambda: b.held_count() > 0, 60, what="B's upload held")
    b.lose()
    keys = {"step_1/.metadata", "step_1/__0_0.distcp", "step_1/__1_0.distcp"}
    wait_until(lambda: keys <= cluster.store.keys(), 120, what="the checkpoint whole in the store")
    a.sync(timeout=120)
    a.release_uploads()
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.cluster_jobs", "dcp-load", str(a.path), "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_node_back_with_its_cache_does_not_publish_what_was_taken_over(cluster):
    """B is killed with its cache dir kept; A takes its replica over; the file is then written
    anew through A. B's restart finds its old version still pending in its journal: it drops it
    (the lease says A published it) instead of putting the older bytes over the newer ones, and
    A holds B's replicas again afterwards."""
    a, b = _pair(cluster)
    b.hold_uploads(except_prefixes=PASS)
    _write(b.path / "ckpt.bin", b"old" * MiB)
    assert _state(b.path / "ckpt.bin") == "replicated"
    wait_until(lambda: b.held_count() > 0, 60, what="B's upload held")
    b.crash(restart=False)
    wait_until(lambda: cluster.store.keys() >= {"ckpt.bin"}, 120, what="A publishes B's file")
    assert cluster.store.read("ckpt.bin") == b"old" * MiB
    _write(a.path / "ckpt.bin", b"new" * MiB)
    a.sync()
    b.start()
    wait_until(lambda: len(b.status()["peers"]["live"]) == 1, 30, what="B back in the cluster")
    b.sync(timeout=120)
    assert cluster.store.read("ckpt.bin") == b"new" * MiB
    lease = f".ckptfs-cluster/takeover/{b.status()['peers']['node']}.json"
    with pytest.raises((OSError, ClientError)):  # (B dropped the lease with what it covered)
        cluster.store.read(lease)
    wait_until(lambda: b.status()["peers"].get("holders"), 30, what="A holds B's replicas again")
    b.hold_uploads(except_prefixes=PASS)
    _write(b.path / "after.bin", b"a" * MiB)
    assert _state(b.path / "after.bin") == "replicated"
    b.release_uploads()
    b.sync()


def test_no_live_peer_commits_at_the_local_level(cluster):
    """Alone, a replicated mount's close does not wait for a peer that is not there: it returns
    with the file on this node only, counted once."""
    a = cluster.node("a", extra=(*REPLICATED, "--replica-timeout", "30"))
    a.hold_uploads(except_prefixes=PASS)
    started = time.monotonic()
    _write(a.path / "alone.bin", b"x" * MiB)
    assert time.monotonic() - started < 20
    assert _state(a.path / "alone.bin") == "pending"
    status = a.status()
    assert status["peers"]["local_commits"] >= 1
    # on this node only: at risk (status gives tenths of a second: it shows once that old)
    wait_until(lambda: a.status()["training_at_risk_s"] > 0, 10, what="the close counted at risk")
    a.release_uploads()
    a.sync()
    assert _state(a.path / "alone.bin") == "durable"


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_a_silent_holder_commits_at_the_local_level_after_the_replica_timeout(cluster):
    """The holder a live member that stops answering (its daemon stopped, SIGSTOP): a close on
    its origin returns at the committed level after --replica-timeout (the default, 5 s), not
    before and not much after; one warning in the log for two such closes within the minute,
    both counted by ``ckptfs_replica_local_commits_total`` on the metrics endpoint."""
    a, b = _pair(cluster, extra=("--metrics-port", "0"))
    assert b.status()["peers"]["holders"] == [a.status()["peers"]["node"]]
    b.hold_uploads(except_prefixes=PASS)  # (a file in the store needs no replica: kept pending)
    log = Path(b.mount.cache_dir) / "ckptfs.log"
    os.kill(a.pid, signal.SIGSTOP)
    try:
        took = []
        for name in ("first.bin", "second.bin"):
            started = time.monotonic()
            _write(b.path / name, b"x" * MiB)
            took.append(time.monotonic() - started)
            assert _state(b.path / name) == "pending"
    finally:
        os.kill(a.pid, signal.SIGCONT)
    # the first close waited for its silent holder, still a live member (the warning says so),
    # for the timeout
    assert 5.0 <= took[0] < 15, took
    warnings = [line for line in log.read_text().splitlines() if "on this node only until" in line]
    assert len(warnings) == 1 and "no reply from the holders in 5 s" in warnings[0], warnings
    assert b.status()["peers"]["local_commits"] == 2
    url = b.status()["metrics_url"]
    with urllib.request.urlopen(url, timeout=30) as answer:
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(answer.read().decode())
            for s in family.samples
        }
    assert samples["ckptfs_replica_local_commits_total"] == 2
    b.release_uploads()
    b.sync()
    assert _state(b.path / "first.bin") == "durable"


@pytest.mark.skipif(not os.environ.get("CKPTFS_LONG"), reason="long mode (scripts/test --long)")
@pytest.mark.timeout(7200)
def test_replica_loss_torture(cluster):
    """Three nodes with --replicas 1 save a round each (a few files of random sizes, one written
    as .tmp and renamed, and the node's own ``latest``), the victim's uploads usually held; the
    victim is lost mid-write, right after its last close, or a while after. The store must
    then hold every file whose close returned, with its last bytes, and no .tmp; then a
    replacement joins."""
    losses_wanted = int(os.environ.get("CKPTFS_REPLICA_LOSSES", "100"))
    rng = random.Random(int(os.environ.get("CKPTFS_TORTURE_SEED", "31")))
    made = 0

    def join():
        nonlocal made
        node = cluster.node(f"n{made}", extra=REPLICATED)
        made += 1
        return node

    nodes = [join() for _ in range(3)]
    for node in nodes:
        wait_until(lambda node=node: len(node.status()["peers"]["live"]) == 2, 60, what="3 live members")
    expected: dict[str, bytes] = {}
    losses = rounds = 0
    while losses < losses_wanted:
        rounds += 1
        victim = rng.randrange(3)
        victim_node = nodes[victim]
        wait_until(
            lambda v=victim_node: v.status()["peers"].get("holders"), 60, what="the victim has a holder"
        )
        if rng.random() < 0.7:
            nodes[victim].hold_uploads(except_prefixes=PASS)
        moment = rng.choice(["mid_write", "after_close", "later"])
        for i, node in enumerate(nodes):
            prefix = f"slot{i}/r{rounds}"
            (node.path / prefix).mkdir(parents=True)
            for j in range(rng.randrange(1, 4)):
                data = rng.randbytes(rng.choice([1000, 3 * MiB, 9 * MiB + 17]))
                _write(node.path / prefix / f"f{j}.bin.tmp", data)
                os.rename(node.path / prefix / f"f{j}.bin.tmp", node.path / prefix / f"f{j}.bin")
                expected[f"{prefix}/f{j}.bin"] = data
            latest = f"{prefix}\n".encode()
            _write(node.path / f"slot{i}" / "latest", latest)
            expected[f"slot{i}/latest"] = latest
        writer = None
        if moment == "mid_write":
            writer = open(victim_node.path / f"slot{victim}" / "partial.bin", "wb")  # noqa: SIM115
            writer.write(rng.randbytes(5 * MiB))
            writer.flush()
        elif moment == "later":
            time.sleep(rng.random() * 3)
        victim_node.lose()
        losses += 1
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass
        for node in nodes:
            if node is not victim_node:
                node.release_uploads()

        def missing() -> list[str]:
            keys = cluster.store.keys()
            return [k for k, v in expected.items() if k not in keys or cluster.store.read(k) != v]

        deadline = time.monotonic() + 180
        while (gone := missing()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not gone, f"loss {losses} (round {rounds}, {moment}): lost {gone[:5]}"
        keys = cluster.store.keys()
        assert not [k for k in keys if k.endswith(".tmp") or k.endswith("partial.bin")], keys
        nodes[victim] = join()
        for node in nodes:
            wait_until(lambda node=node: len(node.status()["peers"]["live"]) == 2, 60, what="3 live members")
    for node in nodes:
        node.sync(timeout=300)
    print(
        f"replica-loss torture: {losses} losses over {rounds} rounds, no file whose close returned was lost"
    )
