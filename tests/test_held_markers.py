"""Held checkpoint markers end to end, through real mounts (docs/semantics.md, "Across nodes"):
what `ckptfs.sync()` and `ckptfs umount` do while a marker waits for another node's file, how a
held marker is dropped (replaced, its step deleted through the mount; `ckptfs gc` on the mount
keeps its step) and how the drop shows in `ckptfs status --json`, the Prometheus endpoint and
the log, and `--no-marker`.

Two nodes of one local store (tests/support/cluster.py), small files: a sharded
`save_pretrained`-style step, each node writing one shard, node A the index (a marker that lists
its shards) and the pointers. Node B's uploads are held (its writer records and heartbeats
pass), so A's index waits for B's shard.
"""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import ckptfs
from tests.conftest import LocalStoreView
from tests.support.harness import wait_until
from tests.support.mounting import CKPTFS, is_mounted
from tests.support.mounting import ckptfs as run_ckptfs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PASS = (".ckptfs-writers/", ".ckptfs-nodes/")  # what a held link still lets through: records, heartbeats
SHARD_A = "model-00001-of-00002.safetensors"
SHARD_B = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def store(tmp_path):
    """The local store only: the gate is the same code on both stores (tests/test_nodes.py runs both)."""
    return LocalStoreView(tmp_path / "store")


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def index() -> bytes:
    return json.dumps({"metadata": {}, "weight_map": {"w.a": SHARD_A, "w.b": SHARD_B}}).encode()


def waiting(node) -> dict[str, dict]:
    """The markers the node holds back, by key (its status)."""
    return {w["marker"]: w for w in node.status()["markers_waiting"]}


def hold_b_shard(a, b, step: str) -> str:
    """B's uploads held, B's shard of ``step`` written (its close returned: its record is in the
    store), A's shard and the index naming both; returns B's node id once A holds the index back."""
    b_id = b.status()["writer_records"]["node"]
    b.hold_uploads(except_prefixes=PASS)
    write(b.path / step / SHARD_B, b"b" * 1000)
    write(a.path / step / SHARD_A, b"a" * 1000)
    write(a.path / step / INDEX, index())
    held = wait_until(lambda: waiting(a).get(f"{step}/{INDEX}"), 60, what="A holds the index back")
    assert held["other_nodes"] == {b_id: [f"{step}/"]}, held
    assert b.held_count() > 0  # (B's shard is held at its link: not in the store)
    return b_id


def save_whole(a, b, step: str) -> None:
    """``step`` saved by both nodes, index by A, and in the store."""
    write(b.path / step / SHARD_B, b"b" * 1000)
    write(a.path / step / SHARD_A, b"a" * 1000)
    b.sync(timeout=60)
    write(a.path / step / INDEX, index())
    a.sync(timeout=60)


# ---- sync and umount wait for a held marker (row "`ckptfs sync` (and `ckptfs.sync()`) ...") ----------


def test_sync_and_umount_wait_for_a_held_marker_and_name_it(cluster):
    b, a = cluster.node("b"), cluster.node("a")  # (B first: the cleanup releases and stops it first)
    b_id = hold_b_shard(a, b, "step_2")
    write(a.path / "step_3" / "extra.bin", b"c" * 1000)  # (later files of this node: not held)

    # ckptfs.sync() of the step: bounded by its timeout, names the marker, what and where
    started = time.monotonic()
    with pytest.raises(ckptfs.TimedOut) as raised:
        ckptfs.sync(a.path / "step_2", timeout=2)
    took = time.monotonic() - started
    message = str(raised.value)
    assert 2 <= took < 20, took
    assert f"step_2/{INDEX} waits for files under step_2/ on node {b_id}" in message, message
    # the whole mount waits for it too
    with pytest.raises(ckptfs.TimedOut, match=f"step_2/{INDEX} waits for"):
        ckptfs.sync(a.path, timeout=1)
    # a sync of another path waits only for what is under it: at once, durable
    started = time.monotonic()
    done = ckptfs.sync(a.path / "step_3", timeout=30)
    assert time.monotonic() - started < 10 and done.files == 1, done
    assert ckptfs.state(a.path / "step_3" / "extra.bin") == "durable"
    assert cluster.store.read("step_3/extra.bin") == b"c" * 1000
    assert f"step_2/{INDEX}" not in cluster.store.keys() and f"step_2/{SHARD_B}" not in cluster.store.keys()

    # umount waits for the held marker, bounded by its --timeout: exit 1, the mount stays
    started = time.monotonic()
    done = run_ckptfs("umount", str(a.path), "--timeout", "2", check=False, timeout=60)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert time.monotonic() - started >= 2
    assert f"step_2/{INDEX} waits for files under step_2/ on node {b_id}" in done.stderr, done.stderr
    assert "stays mounted" in done.stderr and "--no-wait" in done.stderr, done.stderr
    assert is_mounted(a.path) and waiting(a).keys() == {f"step_2/{INDEX}"}
    assert f"step_2/{INDEX}" not in cluster.store.keys()

    # a umount in flight while B is released: it returns once the index is in the store
    umount = subprocess.Popen(
        [*CKPTFS, "umount", str(a.path), "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # its first progress line (10 s into the drain, off a terminal): it waits, for one file
        ready, _, _ = select.select([umount.stderr], [], [], 60)
        line = umount.stderr.readline() if ready else ""
        assert line.startswith("ckptfs: drain:") and "1 file left" in line, (line, umount.poll())
        assert umount.poll() is None and f"step_2/{INDEX}" not in cluster.store.keys()
        b.release_uploads()
        _out, err = umount.communicate(timeout=120)
    finally:
        if umount.poll() is None:
            umount.kill()
            umount.wait()
    assert umount.returncode == 0, err
    a.mount.pid = None
    assert not is_mounted(a.path)
    keys = cluster.store.keys()
    assert {f"step_2/{INDEX}", f"step_2/{SHARD_A}", f"step_2/{SHARD_B}"} <= keys, keys
    b.sync(timeout=60)


# ---- a held marker dropped (row "A held marker holds back nothing else ...") --------------------


def scrape(node) -> dict[str, float]:
    """One scrape of the node's Prometheus endpoint over HTTP, parsed by Prometheus's parser:
    sample name -> value (unlabelled samples)."""
    url = node.status()["metrics_url"]
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def test_a_held_marker_is_dropped_when_replaced_or_its_step_deleted_and_says_so(cluster):
    b = cluster.node("b")  # (first: the cleanup releases and stops it first)
    a = cluster.node("a", extra=("--metrics-port", "0"))
    save_whole(a, b, "step_1")
    write(a.path / "latest", b"step_1\n")
    a.sync(timeout=60)
    assert cluster.store.read("latest") == b"step_1\n"

    hold_b_shard(a, b, "step_2")
    write(a.path / "latest", b"step_2\n")  # (these two wait for the index: A's own, still held)
    write(a.path / "latest.txt", b"step_2\n")
    markers = {f"step_2/{INDEX}", "latest", "latest.txt"}
    wait_until(lambda: waiting(a).keys() == markers, 60, what=f"A holds {markers} back")
    before = scrape(a)
    assert before["ckptfs_markers_waiting"] == 3 and before["ckptfs_markers_dropped_total"] == 0, before

    # `ckptfs gc` on the mount keeps a step whose marker is held (still pending upload): no drop
    done = run_ckptfs("gc", str(a.path), "--keep-last", "0", "--json", timeout=120)
    kept = {d["path"]: d for d in json.loads(done.stdout)["steps"]}
    assert kept["step_2"]["action"] == "keep" and kept["step_2"]["why"] == "still pending upload", kept
    assert waiting(a).keys() == markers and a.status()["markers_dropped"] == []

    # replaced: `latest` written again, naming the whole step_1: the held one is dropped, the new one lands
    write(a.path / "latest", b"step_1\n")
    wait_until(lambda: waiting(a).keys() == markers - {"latest"}, 60, what="the replaced latest dropped")
    # its step deleted through the mount (rotation: rm -r): the index, and latest.txt naming it
    shutil.rmtree(a.path / "step_2")
    wait_until(lambda: not waiting(a), 60, what="the markers of step_2 dropped")
    ckptfs.sync(a.path, timeout=30)  # (nothing left to wait for)

    status = json.loads(run_ckptfs("status", str(a.path), "--json", timeout=60).stdout)
    dropped = {d["marker"]: d["reason"] for d in status["markers_dropped"]}
    assert dropped == {
        "latest": "replaced",
        f"step_2/{INDEX}": "deleted",
        "latest.txt": "its step step_2/ is deleted",
    }, dropped
    after = scrape(a)
    assert after["ckptfs_markers_dropped_total"] == 3 and after["ckptfs_markers_waiting"] == 0, after
    log = (a.mount.cache_dir / "ckptfs.log").read_text()
    for marker in dropped:
        lines = [line for line in log.splitlines() if f"marker {marker} will not be published" in line]
        assert len(lines) == 1, (marker, lines)
    keys = cluster.store.keys()
    assert cluster.store.read("latest") == b"step_1\n"
    assert "latest.txt" not in keys and f"step_2/{INDEX}" not in keys and f"step_2/{SHARD_A}" not in keys

    b.release_uploads()  # (B's shard lands in step_2/ after all: B never saw the rm)
    b.sync(timeout=60)
    assert f"step_2/{INDEX}" not in cluster.store.keys() and not waiting(a)


# ---- --no-marker (row "`--no-marker GLOB` (repeatable, `*` for all) ...") ------------------------------


def test_no_marker_globs_repeat_and_star_publishes_every_marker_at_once(cluster):
    a = cluster.node("a", extra=("--no-marker", "latest", "--no-marker", "*.index.json"))
    b = cluster.node("b", extra=("--no-marker", "*"))

    # A, two globs: its index and `latest` name B's held shard and land at once; `latest.txt`,
    # matched by neither, is held
    b_id = b.status()["writer_records"]["node"]
    b.hold_uploads(except_prefixes=PASS)
    write(b.path / "step_1" / SHARD_B, b"b" * 1000)
    write(a.path / "step_1" / SHARD_A, b"a" * 1000)
    write(a.path / "step_1" / INDEX, index())
    write(a.path / "latest", b"step_1\n")
    write(a.path / "latest.txt", b"step_1\n")
    held = wait_until(lambda: waiting(a), 60, what="A holds latest.txt back")
    assert held.keys() == {"latest.txt"} and b_id in held["latest.txt"]["other_nodes"], held
    ckptfs.sync(a.path / "step_1", timeout=30)
    ckptfs.sync(a.path / "latest", timeout=30)
    keys = cluster.store.keys()
    assert {f"step_1/{INDEX}", "latest"} <= keys and "latest.txt" not in keys, keys
    assert f"step_1/{SHARD_B}" not in keys  # (published naming a shard the store lacks: as asked)
    b.release_uploads()
    b.sync(timeout=60)
    a.sync(timeout=60)  # latest.txt: B's shard is in the store now
    assert cluster.store.read("latest.txt") == b"step_1\n"

    # B, `*`: every marker a plain file: its index and pointers name A's held shard, land at once
    a.hold_uploads(except_prefixes=PASS)
    write(a.path / "step_2" / SHARD_A, b"a" * 1000)
    write(b.path / "step_2" / SHARD_B, b"b" * 1000)
    write(b.path / "step_2" / INDEX, index())
    write(b.path / "latest.txt", b"step_2\n")
    write(b.path / "LATEST", b"step_2\n")
    b.sync(timeout=30)
    assert not waiting(b)
    keys = cluster.store.keys()
    assert {f"step_2/{INDEX}", "LATEST"} <= keys and f"step_2/{SHARD_A}" not in keys, keys
    assert cluster.store.read("latest.txt") == b"step_2\n"
    a.release_uploads()
    a.sync(timeout=60)
