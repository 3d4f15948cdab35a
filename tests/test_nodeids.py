"""fuse/nodeids.py: the kernel's node ids for the namespace's inodes, and the passthrough rules.

A node id bound to a backing file (passthrough opens) takes no other open: a writer, a cached
reader or a reader of another file gets a refusal (the glue answers ESTALE) and the node id is
retired, so the kernel's fresh lookup gets an alias of the same inode. Aliases are counted like
lookups and forgotten with them; only the current node id takes opens through the page cache.
"""

from __future__ import annotations

import os

import pytest

from ckptfs.fuse.nodeids import ALIAS_BASE, NodeIds

pytestmark = pytest.mark.unit


@pytest.fixture
def two_files(tmp_path):
    fds = [os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o600) for name in ("v1", "v2")]
    yield fds
    for fd in fds:
        os.close(fd)


def test_a_node_id_is_its_inode_until_retired():
    ids = NodeIds()
    assert ids.for_ino(7) == 7 and ids.ino(7) == 7
    ids.retire(7)
    alias = ids.for_ino(7)
    assert alias >= ALIAS_BASE and ids.ino(alias) == 7
    ids.retire(7)  # (7 is no longer current: nothing changes)
    assert ids.for_ino(7) == alias


def test_a_bound_node_id_refuses_every_other_open(two_files):
    v1, v2 = two_files
    ids = NodeIds()
    assert ids.may_bind(5)
    ids.opened_with(10, 5, "passthrough", v1)
    assert not ids.open_refused(5, passthrough_fd=v1)  # the same file: shared
    assert ids.open_refused(5, passthrough_fd=v2)  # a newer version's file
    assert ids.open_refused(5, passthrough_fd=None)  # through the page cache
    assert ids.open_refused(5, passthrough_fd=None)  # a writer
    ids.released(10)
    assert not ids.open_refused(5, passthrough_fd=None)


def test_a_retired_node_id_takes_only_passthrough_opens(two_files):
    v1, _ = two_files
    ids = NodeIds()
    ids.opened_with(10, 5, "passthrough", v1)
    ids.retire(5)
    ids.released(10)
    assert ids.open_refused(5, passthrough_fd=None)  # its page cache may be stale
    assert not ids.open_refused(5, passthrough_fd=v1)
    assert not ids.open_refused(ids.for_ino(5), passthrough_fd=None)


def test_cached_opens_forbid_binding_until_released():
    ids = NodeIds()
    ids.opened_with(11, 5, "cached")
    assert not ids.may_bind(5)
    ids.opened_with(12, 5, "direct")  # (direct I/O opens do not use the page cache)
    ids.released(11)
    assert ids.may_bind(5)


def test_aliases_are_counted_and_forgotten_like_lookups():
    ids = NodeIds()
    ids.retire(5)
    first = ids.for_ino(5)
    ids.handed_out(first)
    ids.handed_out(first)
    ids.retire(first)
    second = ids.for_ino(5)
    assert second != first and ids.ino(first) == 5
    assert ids.forgot(first, 1) == 5 and ids.ino(first) == 5  # one lookup still held
    assert ids.forgot(first, 1) == 5
    assert first not in ids.alias_ino  # fully forgotten and not current: gone
    assert ids.forgot(5, 3) == 5  # the inode's own node id needs no bookkeeping
    ids.handed_out(second)
    assert ids.forgot(second, 1) == 5 and ids.for_ino(5) == second  # current: kept


def test_a_refused_passthrough_open_counts_as_a_cached_one(two_files):
    v1, _ = two_files
    ids = NodeIds()
    ids.opened_with(10, 5, "passthrough", v1)
    ids.passthrough_refused(10)
    assert 5 not in ids.bound and not ids.may_bind(5)
    ids.released(10)
    assert ids.may_bind(5)


def test_a_retired_node_id_shows_the_size_of_the_file_its_readers_keep(two_files):
    v1, v2 = two_files
    os.pwrite(v1, b"x" * 100, 0)
    ids = NodeIds()
    ids.opened_with(10, 5, "passthrough", v1)
    assert ids.kept_size(5) is None  # current: the namespace's size
    ids.retire(5)
    assert ids.kept_size(5) == 100
    os.pwrite(v1, b"y", 100)  # (the file as it is: a working file may still grow)
    assert ids.kept_size(5) == 101
    ids.released(10)
    assert ids.kept_size(5) is None
