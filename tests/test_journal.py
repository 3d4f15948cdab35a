"""The journal: append, replay (retarget, cancel, done), multipart records, torn last line,
compaction with sequence numbers that keep increasing, and the RAM arena id check."""

from __future__ import annotations

import json

import pytest

from ckptfs.cache.arena import DISK, RAM
from ckptfs.cache.journal import DELETE, MKDIR, MOVE, PUT, Journal, Op

pytestmark = pytest.mark.unit

ARENA = "arena-1"


def fresh(path, arena=ARENA) -> Journal:
    """A journal as the daemon opens it: replay, then compact to what is pending."""
    j = Journal(path, arena)
    pending, uploads = j.replay()
    j.open(pending, uploads)
    return j


def replay(path, arena=ARENA):
    return Journal(path, arena).replay()


def put(key, size=10, blocks=((DISK, 0),)) -> Op:
    return Op(PUT, key, size=size, blocks=list(blocks))


@pytest.fixture
def path(tmp_path):
    return tmp_path / "journal"


def test_append_assigns_increasing_seqs_and_replay_keeps_order(path):
    j = fresh(path)
    ops = [
        j.append(put("a.bin", 100, [(RAM, 3), None, (DISK, 7)])),
        j.append(Op(MKDIR, "d/")),
        j.append(Op(MOVE, "b.bin", src="a.bin")),
        j.append(Op(DELETE, "old.bin")),
    ]
    assert [op.seq for op in ops] == [1, 2, 3, 4]
    j.close()
    pending, uploads = replay(path)
    assert uploads == []
    assert pending == ops  # same kinds, keys, sizes, blocks (as tuples), seqs, in order
    assert pending[0].blocks == [(RAM, 3), None, (DISK, 7)]
    assert pending[2].src == "a.bin"


def test_retarget_cancel_and_done(path):
    j = fresh(path)
    a = j.append(put("a"))
    b = j.append(put("b"))
    c = j.append(put("c"))
    d = j.append(Op(DELETE, "x"))
    e = j.append(put("e"))
    j.retarget(a.seq, "a2")
    j.retarget(a.seq, "a3")  # the last retarget wins
    j.cancel(b.seq)
    j.done(d.seq)
    j.retarget(e.seq, "e2")
    j.done(e.seq)  # retargeted, then published: gone
    j.retarget(99, "nowhere")  # an unknown seq is ignored
    j.close()
    pending, _ = replay(path)
    assert [(op.seq, op.key) for op in pending] == [(a.seq, "a3"), (c.seq, "c")]


def test_replay_orders_by_seq_not_by_line(path):
    # Records from a compacted log followed by appends: replay sorts by seq anyway.
    lines = [
        {"t": "arena", "ram": ARENA, "seq": 5},
        {"t": "op", "seq": 7, "kind": "delete", "key": "z"},
        {"t": "op", "seq": 3, "kind": "mkdir", "key": "d/"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    j = Journal(path, ARENA)
    pending, _ = j.replay()
    assert [op.seq for op in pending] == [3, 7]
    assert j.next_seq == 8


def test_multipart_started_and_ended(path):
    j = fresh(path)
    j.multipart_started("1.1", "big.bin", "upload-a")
    j.multipart_started("2.1", "other.bin", "upload-b")
    j.multipart_started("1.2", "big.bin", "upload-c")  # the same op, a second upload
    j.multipart_ended("1.1")
    j.close()
    _, uploads = replay(path)
    assert sorted(uploads) == [("1.2", "big.bin", "upload-c"), ("2.1", "other.bin", "upload-b")]


def test_torn_last_line_is_ignored(path):
    j = fresh(path)
    a = j.append(put("a"))
    j.append(put("b"))
    j.close()
    with open(path, "ab") as f:  # a crash in the middle of an append
        f.write(b'{"t":"done","seq":')
    pending, _ = replay(path)
    assert [op.key for op in pending] == ["a", "b"]

    # The next start compacts it away; new records go on normally.
    j = fresh(path)
    j.done(a.seq)
    j.close()
    assert [op.key for op in replay(path)[0]] == ["b"]


def test_torn_utf8_last_line_is_ignored(path):
    j = fresh(path)
    j.append(put("ü"))
    j.close()
    record = json.dumps({"t": "op", "seq": 2, "kind": "put", "key": "é"}, ensure_ascii=False).encode()
    with open(path, "ab") as f:
        f.write(record[: record.index("é".encode()) + 1])  # cut inside a multi-byte character
    assert [op.key for op in replay(path)[0]] == ["ü"]


def test_corrupt_line_in_the_middle_is_an_error(path):
    j = fresh(path)
    j.append(put("a"))
    j.close()
    with open(path, "ab") as f:  # not a torn append: records follow it
        f.write(b"garbage\n")
        f.write(b'{"t":"op","seq":9,"kind":"delete","key":"x"}\n')
    with pytest.raises(ValueError):
        replay(path)


def test_compaction_keeps_exactly_the_pending_state(path):
    j = fresh(path)
    ops = [j.append(put(f"f{i}")) for i in range(6)]
    for op in ops[:4]:
        j.done(op.seq)
    j.retarget(ops[5].seq, "renamed")
    j.multipart_started("5.1", "f4", "u1")
    j.multipart_started("6.1", "f5", "u2")
    j.multipart_ended("5.1")
    j.close()
    before = replay(path)

    j = Journal(path, ARENA)
    pending, uploads = j.replay()
    j.open(pending, uploads)
    j.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["t"] for r in records] == ["arena", "op", "op", "mpu"]  # nothing else survives
    assert replay(path) == before
    assert [(op.seq, op.key) for op in before[0]] == [(5, "f4"), (6, "renamed")]
    assert before[1] == [("6.1", "f5", "u2")]

    # Runtime compaction (what the uploader does) gives the same.
    j = fresh(path)
    j.compact(pending, uploads)
    j.close()
    assert replay(path) == before


def test_seqs_keep_increasing_across_reopen_and_compaction(path):
    j = fresh(path)
    ops = [j.append(Op(MKDIR, f"d{i}/")) for i in range(5)]
    for op in ops:
        j.done(op.seq)
    j.close()

    j = fresh(path)  # nothing pending: the compacted log holds only the arena record
    assert replay(path) == ([], [])
    assert j.append(put("next")).seq == 6
    j.close()

    j = fresh(path)
    j.compact([], [])  # even an empty compaction keeps the counter
    j.close()
    j = fresh(path)
    assert j.append(put("later")).seq == 7
    j.close()


def test_a_new_ram_arena_drops_puts_that_need_ram_blocks(path):
    j = fresh(path, arena="boot-1")
    in_ram = j.append(put("ram.bin", 3 << 20, [(DISK, 0), (RAM, 1)]))
    on_disk = j.append(put("disk.bin", 2 << 20, [(DISK, 4), None]))  # fsync'd shadow: disk only
    holes = j.append(put("sparse.bin", 1 << 20, [None]))
    other = j.append(Op(DELETE, "gone.bin"))
    j.close()

    same = replay(path, arena="boot-1")[0]
    assert [op.seq for op in same] == [in_ram.seq, on_disk.seq, holes.seq, other.seq]

    rebooted = replay(path, arena="boot-2")[0]
    assert [op.key for op in rebooted] == ["disk.bin", "sparse.bin", "gone.bin"]


def test_arena_check_uses_the_compacted_id(path):
    j = fresh(path, arena="boot-1")
    j.append(put("ram.bin", 1, [(RAM, 0)]))
    j.close()
    # Restarted on the same boot: compaction rewrites the arena record with the same id.
    j = fresh(path, arena="boot-1")
    j.close()
    assert [op.key for op in replay(path, arena="boot-1")[0]] == ["ram.bin"]
    assert replay(path, arena="boot-2")[0] == []


def test_a_closed_journal_refuses_writes(path):
    """At shutdown the journal is closed while abandoned store calls may still finish: nothing
    after the close may change the record of what is pending."""
    j = fresh(path)
    j.append(put("a.bin"))
    j.close()
    with pytest.raises(OSError, match="is closed"):
        j.done(1)
    with pytest.raises(OSError, match="is closed"):
        j.multipart_ended("1.1")
    pending, _ = replay(path)
    assert [op.key for op in pending] == ["a.bin"]


def test_evicted_parts_keep_their_checksums_and_deletes_their_hint(path):
    """A put whose parts live only in the store names their tokens and xxh3 (the manifest written
    when a restart completes that upload needs them); a delete says whether a HEAD is needed."""
    j = fresh(path)
    op = put("big.bin", 30, [None, (DISK, 1)])
    op.upload, op.parts, op.hashes = ["big.bin", "up-1", "j-1"], {0: "etag0"}, {0: "0123456789abcdef"}
    ops = [j.append(op), j.append(Op(DELETE, "small.bin", small=True)), j.append(Op(DELETE, "any.bin"))]
    j.close()
    pending, _ = replay(path)
    assert pending == ops
    assert pending[0].hashes == {0: "0123456789abcdef"} and [p.small for p in pending[1:]] == [True, False]
    fresh(path).close()  # compaction keeps them too
    assert replay(path)[0] == ops
