"""Which peer a node asks for a part (cluster/peers.py), in process: every node computes the same
owner from the same member list, the parts spread over the members, a member leaving moves
only its own share, and a node that owns a part asks the member ranked second (only if it
holds it). And where a node listens by default. And which members hold a node's replicas
(cluster/replication.py): every node its own, other failure domains first."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from ckptfs.cluster.members import Member
from ckptfs.cluster.peers import PeerCache, default_host
from ckptfs.cluster.replication import Replicator

pytestmark = pytest.mark.unit

NODES = [f"{i:016x}" for i in range(1, 5)]
PARTS = [("step_100/model.pt", "upload-1", i * (8 << 20)) for i in range(400)]


def member(node: str) -> Member:
    return Member(node, "127.0.0.1", 1000 + int(node, 16), b"", node)


def view(me: str, nodes: list[str]):
    """What ``PeerCache.route`` reads: this node's id and its live peers."""
    others = [member(n) for n in nodes if n != me]
    return SimpleNamespace(members=SimpleNamespace(node=me, live=lambda: others))


def owner(me: str, nodes: list[str], part) -> str:
    route = PeerCache.route(view(me, nodes), *part)  # type: ignore[arg-type]
    assert route is not None
    peer, fetch = route
    return peer.node if fetch else me


def test_every_node_names_the_same_owner_and_the_parts_spread():
    owners = [owner(NODES[0], NODES, part) for part in PARTS]
    for me in NODES[1:]:
        assert [owner(me, NODES, part) for part in PARTS] == owners
    shares = Counter(owners)
    assert set(shares) == set(NODES) and min(shares.values()) >= len(PARTS) // len(NODES) // 2


def test_a_member_leaving_moves_only_its_own_share():
    before = [owner(NODES[0], NODES, part) for part in PARTS]
    after = [owner(NODES[0], NODES[:-1], part) for part in PARTS]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert moved and all(b == NODES[-1] for b, _ in moved)


def test_an_owner_asks_the_runner_up_only_if_it_holds_the_part():
    me = NODES[0]
    mine = [part for part in PARTS if owner(NODES[1], NODES, part) == me]
    for part in mine:
        peer, fetch = PeerCache.route(view(me, NODES), *part)  # type: ignore[arg-type]
        assert not fetch and peer.node != me
        # the runner-up is who owned it before this node joined
        assert peer.node == owner(NODES[1], NODES[1:], part)


def test_no_live_peer_means_the_store():
    assert PeerCache.route(view(NODES[0], [NODES[0]]), *PARTS[0]) is None  # type: ignore[arg-type]


def test_default_host():
    assert default_host("file:///srv/store", None) == "127.0.0.1"
    assert default_host("s3://b", "http://127.0.0.1:9000") == "127.0.0.1"
    assert default_host("s3://b", "http://localhost:9000") == "127.0.0.1"


def holders(me: str, nodes: list[str], k: int, domains: dict[str, str] | None = None) -> list[str]:
    domains = domains or {}
    others = [Member(n, "127.0.0.1", 1000, b"", n, domains.get(n, "")) for n in nodes if n != me]
    members = SimpleNamespace(node=me, domain=domains.get(me, ""), live=lambda: others)
    ranked = Replicator._ranked(SimpleNamespace(members=members))  # type: ignore[arg-type]
    return [m.node for m in ranked[:k]]


def test_each_node_has_its_own_holders_spread_over_the_cluster():
    nodes = [f"{i:016x}" for i in range(1, 17)]
    chosen = Counter(holders(me, nodes, 1)[0] for me in nodes)
    assert max(chosen.values()) <= 4, chosen  # (no node holds everyone's replica)
    assert all(holders(me, nodes, 1)[0] != me for me in nodes)


def test_holders_in_another_failure_domain_come_first():
    nodes = [f"{i:016x}" for i in range(1, 9)]
    domains = {n: ("rack-a" if i < 4 else "rack-b") for i, n in enumerate(nodes)}
    for me in nodes:
        picked = holders(me, nodes, 2, domains)
        assert all(domains[n] != domains[me] for n in picked), (me, picked)
    # (with one domain only, any others)
    assert len(holders(nodes[0], nodes[:3], 2, {n: "rack-a" for n in nodes})) == 2
