"""The multi-node harness itself (tests/support/cluster.py, the ``cluster`` fixture): nodes share
one store, each through a link of its own that can hold its changes to the store (S3: a proxy
each; local store: a seccomp filter each, tests/support/hold_syscalls.py) while the others'
flow and its per-node records pass; a lost node leaves nothing running and none of its held
changes ever lands; the cleanup leaves nothing; a node can live in a network namespace of its
own behind a rate-capped veth. Real mounts on both stores (the netns node: S3 only).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.harness import blob, proc_state, wait_until
from tests.support.mounting import is_mounted

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
LIST_TTL_S = 5  # ckptfs mount's default --list-ttl
HELD_WITHIN_S = 60  # a written file's upload reaches the node's link (a loaded 2-core machine)


def reads_soon(node, name: str) -> bytes:
    """The bytes of ``name`` on ``node``'s mount, once it shows there: a node that listed the
    directory (its own writes there list it) trusts that listing for --list-ttl."""
    wait_until(lambda: (node.path / name).exists(), LIST_TTL_S + 10, what=f"{name} on {node.name}")
    return (node.path / name).read_bytes()


def proxy_answers(node) -> bool:
    """Whether ``node``'s proxy (S3) still accepts a connection."""
    url = urlsplit(node.endpoint)
    try:
        socket.create_connection((url.hostname, url.port), timeout=2).close()
    except OSError:
        return False
    return True


def test_nodes_see_each_others_durable_files(cluster):
    a, b = cluster.node("a"), cluster.node("b")
    assert a.path != b.path and a.store_url == b.store_url == cluster.store.url
    assert a.endpoint != b.endpoint or a.endpoint is None  # S3: a proxy each
    model = blob(3 * MiB + 5, 1)
    (a.path / "ckpt" / "step-1").mkdir(parents=True)
    (a.path / "ckpt" / "step-1" / "model.pt").write_bytes(model)
    a.sync()
    assert cluster.store.read("ckpt/step-1/model.pt") == model
    assert (b.path / "ckpt" / "step-1" / "model.pt").read_bytes() == model  # through b's mount
    (b.path / "from-b.txt").write_bytes(b"written on b")
    b.sync()
    assert reads_soon(a, "from-b.txt") == b"written on b"
    assert {"ckpt/step-1/model.pt", "from-b.txt"} <= cluster.store.keys()

    found = cluster.checkpoints()  # on the store itself
    steps = [s for series in found["series"] for s in series["steps"]]
    assert [(s["step"], s["files"], s["bytes"], s["complete"]) for s in steps] == [(1, 1, len(model), True)]
    assert found["restart"] is not None and found["restart"].endswith("ckpt/step-1")


def test_a_held_node_changes_nothing_until_released(cluster):
    a, b = cluster.node("a"), cluster.node("b")
    b.hold_uploads()
    held = blob(9 * MiB + 7, 2)  # more than a part (8 MiB): a multipart upload
    (b.path / "held.bin").write_bytes(held)
    wait_until(lambda: b.held_count() > 0, HELD_WITHIN_S, what="b's upload held at its link")
    assert b.held(), "held_count() > 0 but nothing listed as held"
    assert "held.bin" not in cluster.store.keys()

    # The other node's files flow meanwhile.
    (a.path / "a.bin").write_bytes(b"from a")
    a.sync()
    assert cluster.store.read("a.bin") == b"from a"
    # A per-node record passes b's link while it holds.
    b.put_through_link(".ckptfs-writers/b", b"b is alive")
    assert cluster.store.read(".ckptfs-writers/b") == b"b is alive"
    assert "held.bin" not in cluster.store.keys()
    assert b.held_count() > 0

    syncing_done = threading.Event()
    errors: list[BaseException] = []

    def sync_b() -> None:
        try:
            b.sync(timeout=120)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            syncing_done.set()

    syncer = threading.Thread(target=sync_b, daemon=True)
    syncer.start()
    assert not syncing_done.wait(3), f"b's sync returned while its upload was held: {errors}"
    b.release_uploads()
    assert syncing_done.wait(120), "b's sync did not return after the release"
    assert not errors, errors
    assert b.held_count() == 0
    assert cluster.store.read("held.bin") == held
    assert reads_soon(a, "held.bin") == held


def test_a_lost_node_leaves_nothing_and_neither_does_the_cleanup(cluster):
    a, b = cluster.node("a"), cluster.node("b")
    b.hold_uploads()
    (b.path / "lost.bin").write_bytes(blob(2 * MiB, 3))
    wait_until(lambda: b.held_count() > 0, HELD_WITHIN_S, what="b's upload held at its link")
    pids = b.pids()  # its daemon, and (local store) its link's hold_syscalls server
    ram = b.mount.ram_dir()
    assert (
        len(pids) == (1 if b.proxy else 2) and ram is not None and ram.exists() and b.mount.cache_dir.exists()
    )

    b.lose()  # (its daemon may be blocked in the held call: it dies all the same)
    assert [pid for pid in pids if proc_state(pid) not in (None, "Z")] == []
    assert not is_mounted(b.path)
    assert not b.mount.cache_dir.exists() and not ram.exists() and not b.shm_dir.exists()
    # Its link is gone, so nothing can forward what it held, ever (local store: its hold_syscalls
    # server was among the pids, and failed what it held; S3: the proxy is closed, and what it
    # held was dropped, never answered by the server).
    if b.proxy is not None:
        assert not proxy_answers(b)
        dropped = [r for r in b.proxy.requests if r.action == "hold"]
        assert dropped and all(r.done.is_set() and r.status == 0 for r in dropped)
    with pytest.raises(AssertionError, match="lost"):
        b.sync()

    (a.path / "after.bin").write_bytes(b"after b was lost")
    a.sync()
    assert cluster.store.read("after.bin") == b"after b was lost"
    assert "lost.bin" not in cluster.store.keys()

    # The cleanup, with a's upload held (a test that failed mid-way): nothing is left.
    a.hold_uploads()
    (a.path / "pending.bin").write_bytes(b"pending")
    wait_until(lambda: a.held_count() > 0, HELD_WITHIN_S, what="a's upload held at its link")
    pids, ram, shm = a.pids(), a.mount.ram_dir(), a.shm_dir
    cluster.cleanup()
    assert [pid for pid in pids if proc_state(pid) not in (None, "Z")] == []
    assert not is_mounted(a.path) and (a.proxy is None or not proxy_answers(a))
    assert not shm.exists() and not ram.exists()
    assert "lost.bin" not in cluster.store.keys()


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_a_node_in_a_network_namespace_behind_a_capped_link(cluster):
    n = cluster.node("n", netns=True, rate="200mbit")
    net = os.readlink(f"/proc/{n.pid}/ns/net")
    assert net != os.readlink("/proc/self/ns/net")
    assert net == f"net:[{os.stat(n.netns.path).st_ino}]"
    assert urlsplit(n.endpoint).hostname == n.netns.host_ip  # its proxy, on the host end of its veth
    assert "rate 200Mbit" in n.netns.qdisc()

    data = blob(4 * MiB + 1, 4)
    (n.path / "n.bin").write_bytes(data)
    n.sync()
    assert cluster.store.read("n.bin") == data
    assert n.status()["pid"] == n.pid  # its control socket is a path: reached from here
    other = cluster.node("other")
    assert (other.path / "n.bin").read_bytes() == data

    ns_name, host_if = n.netns.name, n.netns.host_if
    cluster.cleanup()
    assert not Path(f"/run/netns/{ns_name}").exists()
    assert not Path(f"/sys/class/net/{host_if}").exists()
    assert not is_mounted(n.path) and not is_mounted(other.path)
