"""Writer records pushed over the peer channel (cluster/peer_records.py), in process: what a
node keeps of what its peers told it, what it refuses, and that it keeps it across its own
restart. The push over real TLS between real mounts is tests/test_nodes.py's (a node cut off
from the store, then lost)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import trio

from ckptfs.cluster.members import Member
from ckptfs.cluster.peer_records import FILE, PUSH_MAX, PeerRecords
from ckptfs.cluster.records import DATA, MARKS
from tests.support.harness import trio_test, wait_until_async

pytestmark = pytest.mark.unit

ME, B, C = "a" * 16, "b" * 16, "c" * 16


def relay(tmp_path, target=dict, live=list, push=None) -> PeerRecords:
    async def no_push(member, request) -> bool:
        return False

    return PeerRecords(ME, target, live, push or no_push, lambda: None, tmp_path / FILE)


def member(node: str) -> Member:
    return Member(node, "127.0.0.1", 1, b"", node)


def test_a_peers_set_stands_beside_the_store_records_and_is_refused_when_malformed(tmp_path):
    r = relay(tmp_path)
    assert r.receive(B, {"node": B, "dirs": {"step_2/": DATA, "step_1/": MARKS}}) == ""
    assert {(x.node, x.directory, x.state) for x in r.others("step_2/")} == {(B, "step_2/", DATA)}
    assert len(r.others("")) == 2 and B in r.heard()
    # another node's name, a directory without its slash, an unknown state: refused, nothing kept
    assert r.receive(C, {"node": B, "dirs": {"x/": DATA}}) == "bad records"
    assert r.receive(C, {"node": C, "dirs": {"x": DATA}}) == "bad records"
    assert r.receive(C, {"node": C, "dirs": {"x/": "gone"}}) == "bad records"
    assert C not in r.heard()
    # an empty set: B holds nothing now
    assert r.receive(B, {"node": B, "dirs": {}}) == ""
    assert r.others("") == []


def test_a_takeover_makes_the_peers_forget_the_lost_node(tmp_path):
    r = relay(tmp_path)
    r.receive(B, {"node": B, "dirs": {"step_2/": DATA}})
    r.receive(C, {"node": C, "dirs": {"step_2/": DATA}, "forget": [B]})  # C took B's replicas over
    assert {x.node for x in r.others("")} == {C}
    r.forget(C)  # this node took C over: its peers hear of it in every push
    assert r.others("") == [] and C in r.forgotten


@trio_test
async def test_the_sets_survive_this_nodes_restart_in_a_private_file(tmp_path):
    r = relay(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.run)
        r.receive(B, {"node": B, "dirs": {"step_2/": DATA}})
        path = tmp_path / FILE
        await wait_until_async(lambda: path.exists() and B in path.read_text(), 10, "the sets kept")
        nursery.cancel_scope.cancel()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = relay(tmp_path)
    assert [(x.node, x.directory, x.state) for x in again.others("")] == [(B, "step_2/", DATA)]
    assert again.heard()[B] == pytest.approx(r.heard()[B])
    path.write_text(json.dumps({B: {"dirs": {"s/": "nonsense"}, "heard": 1}, "short": {}}))
    assert relay(tmp_path).others("") == []  # (a damaged file is ignored, not trusted)


@trio_test
async def test_a_close_counts_as_recorded_once_every_live_peer_took_the_set(tmp_path):
    target = {"step_2/": DATA}
    answers = {B: True, C: False}
    sent: list[dict] = []

    async def push(m: Member, request: dict) -> bool:
        sent.append(request)
        return answers[m.node]

    live = [member(B), member(C)]
    r = relay(tmp_path, lambda: dict(target), lambda: live, push)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.run)
        r.poke()
        await wait_until_async(lambda: r.acked.get(B) == target, 10, "B took the set")
        assert not r.covers("step_2/")  # C has not taken it
        answers[C] = True
        r.poke()
        await wait_until_async(lambda: r.covers("step_2/"), 10, "every live peer took the set")
        live.clear()
        assert not r.covers("step_2/")  # (no live peer: the store must take it)
        nursery.cancel_scope.cancel()
    assert sent[0]["dirs"] == target and sent[0]["node"] == ME


def test_a_set_is_bounded(tmp_path):
    big = {f"{'d' * 200}{i:05d}/": DATA for i in range(200)}
    r = relay(tmp_path)
    sent = r._bounded(big)
    assert 0 < len(sent) < len(big) and len(json.dumps(sent)) <= PUSH_MAX + 1024
