"""The local store's multipart uploads beyond the contract (tests/test_store.py runs that on
both stores): each byte is written once, in place; races between threads; crashes."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptfs.store import NotFound, PartInfo, StoreError
from ckptfs.store import local as local_module
from ckptfs.store.local import TMP_DIR, LocalStore

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parent.parent


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    s = LocalStore(tmp_path / "store")
    s.check()
    return s


@pytest.fixture
def copied(monkeypatch) -> list[int]:
    """[bytes the store copied from one file to another] (copy, or completing a multipart)."""
    total = [0]
    real = local_module._copy_range

    def counting(*args, **kwargs) -> int:
        n = real(*args, **kwargs)
        total[0] += n
        return n

    monkeypatch.setattr(local_module, "_copy_range", counting)
    return total


def _upload_dir(store: LocalStore, uid: str) -> Path:
    return store.root / TMP_DIR / "uploads" / uid


def _upload(store: LocalStore, key: str, uid: str, blobs: dict[int, bytes], order, threads: int = 1) -> dict:
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(order, pool.map(lambda n: store.upload_part(key, uid, n, blobs[n]), order)))


def _complete(store: LocalStore, key: str, uid: str, infos: dict) -> None:
    store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])


def test_parts_are_written_once_in_place(store, copied):
    """ckptfs's layout (equal parts, a shorter last one), sent from 8 threads: the upload's data
    file becomes the object; completing it copies nothing."""
    key = "ckpt/model.pt"
    blobs = {n: _blob(256 * KiB, n) for n in range(1, 65)}
    blobs[65] = _blob(1000, 65)
    uid = store.create_multipart(key, {"xxh3": "abc"})
    data = _upload_dir(store, uid) / "data"
    rest = list(range(2, 66))
    random.Random(1).shuffle(rest)
    infos = _upload(store, key, uid, blobs, [1], 1) | _upload(store, key, uid, blobs, rest, 8)
    assert not list(_upload_dir(store, uid).glob("*.part"))
    inode = data.stat().st_ino
    _complete(store, key, uid, infos)
    assert copied[0] == 0
    published = store.root / "ckpt" / "model.pt"
    assert published.stat().st_ino == inode
    assert published.read_bytes() == b"".join(blobs[n] for n in sorted(blobs))
    assert store.head(key).metadata == {"xxh3": "abc"}
    assert os.listdir(store.root / TMP_DIR / "uploads") == []


def test_parts_sent_before_the_part_size_is_known(store, copied):
    """The short last part arriving first cannot set the slot size: it waits in a file of its
    own and is the only copy at completion. The next part, below a recorded one, sets it."""
    key = "k.bin"
    blobs = {1: _blob(MiB, 1), 2: _blob(MiB, 2), 3: _blob(MiB, 3), 4: _blob(5000, 4)}
    uid = store.create_multipart(key)
    infos = _upload(store, key, uid, blobs, [4, 2, 3, 1])
    assert sorted(p.name for p in _upload_dir(store, uid).glob("*.part")) == ["4.part"]
    inode = (_upload_dir(store, uid) / "data").stat().st_ino
    _complete(store, key, uid, infos)
    assert copied[0] == 5000
    assert (store.root / key).stat().st_ino == inode
    assert store.get_range(key, 0, 4 * MiB) == b"".join(blobs[n] for n in sorted(blobs))


def test_a_part_bigger_than_the_slots_falls_back_to_a_copy(store, copied):
    """Parts of different sizes (not ckptfs's layout) do not fit the slots: completion
    concatenates them into a new file, which is still exactly the object."""
    key = "odd.bin"
    blobs = {1: _blob(MiB, 1), 2: _blob(3 * MiB, 2), 3: _blob(MiB, 3), 4: _blob(7, 4)}
    uid = store.create_multipart(key)
    infos = _upload(store, key, uid, blobs, [1, 2, 3, 4])
    assert sorted(p.name for p in _upload_dir(store, uid).glob("*.part")) == ["2.part"]
    inode = (_upload_dir(store, uid) / "data").stat().st_ino
    _complete(store, key, uid, infos)
    whole = b"".join(blobs[n] for n in sorted(blobs))
    assert copied[0] == len(whole)
    assert (store.root / key).stat().st_ino != inode
    assert store.get_range(key, 0, len(whole) + 1) == whole
    assert os.listdir(store.root / TMP_DIR) == ["uploads"]  # the new file's temp name is gone


def test_failed_completion_wipes_the_parts_it_left_out(store):
    """Completing with fewer parts cuts the data file: the parts left out lose their records
    first, so if the completion fails after that (here: a file in the way of the key) and is
    tried again with them, it fails cleanly instead of publishing zeros."""
    key = "x/obj.bin"
    blobs = {n: _blob(MiB, n) for n in (1, 2, 3)}
    uid = store.create_multipart(key)
    infos = _upload(store, key, uid, blobs, [1, 2, 3])
    store.put("x", b"in the way")
    with pytest.raises(StoreError) as exc:
        store.complete_multipart(key, uid, [infos[1], infos[2]])
    assert exc.value.errno == errno.ENOTDIR
    store.delete("x")
    with pytest.raises(StoreError, match="part 3 .* was not uploaded"):
        _complete(store, key, uid, infos)
    infos[3] = store.upload_part(key, uid, 3, blobs[3])
    _complete(store, key, uid, infos)
    assert store.get_range(key, 0, 4 * MiB) == blobs[1] + blobs[2] + blobs[3]

def test_identical_retry_writes_nothing(store, monkeypatch):
    uid = store.create_multipart("r.bin")
    first = store.upload_part("r.bin", uid, 1, _blob(MiB, 1))
    writes = []
    real = local_module._pwrite_all
    monkeypatch.setattr(local_module, "_pwrite_all", lambda *a: writes.append(a[2]) or real(*a))
    assert store.upload_part("r.bin", uid, 1, _blob(MiB, 1)) == first  # a retry after a timeout
    assert writes == []
    store.complete_multipart("r.bin", uid, [first])
    assert store.get_range("r.bin", 0, 2 * MiB) == _blob(MiB, 1)


def test_same_part_raced_from_two_threads(store):
    """Two uploads of one part number at once: the part's record and its bytes always agree,
    so completing with the winner's token gives the winner's bytes, and the loser's fails."""
    key = "race.bin"
    p1 = _blob(MiB, 1)
    for round_ in range(12):
        uid = store.create_multipart(key)
        i1 = store.upload_part(key, uid, 1, p1)
        contents = [_blob(MiB, 100 + 2 * round_), _blob(MiB, 101 + 2 * round_)]
        barrier = threading.Barrier(2)

        def send(data: bytes, uid=uid, barrier=barrier):
            barrier.wait()
            return store.upload_part(key, uid, 2, data)

        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(send, contents))
        try:
            store.complete_multipart(key, uid, [i1, infos[0]])
            won = contents[0]
        except StoreError:
            store.complete_multipart(key, uid, [i1, infos[1]])
            won = contents[1]
        assert store.get_range(key, 0, 3 * MiB) == p1 + won


def test_failed_reupload_leaves_no_record_over_changed_bytes(store, monkeypatch):
    """A re-upload that dies after overwriting some of the old bytes (a crash, EIO): the old
    token no longer completes (its bytes are gone), the new upload of the part then works."""
    key = "reup.bin"
    old, new, tail = _blob(MiB, 1), _blob(MiB, 2), _blob(10, 3)
    uid = store.create_multipart(key)
    i1, i2 = store.upload_part(key, uid, 1, old), store.upload_part(key, uid, 2, tail)
    real = os.fdatasync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/data"):
            raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(StoreError) as exc:
        store.upload_part(key, uid, 1, new)
    assert exc.value.errno == errno.EIO and exc.value.transient
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(StoreError, match="part 1 .* was not uploaded"):
        store.complete_multipart(key, uid, [i1, i2])
    assert store.head(key) is None
    store.complete_multipart(key, uid, [store.upload_part(key, uid, 1, new), i2])
    assert store.get_range(key, 0, 3 * MiB) == new + tail


def test_torn_record_reads_as_not_uploaded(store):
    key = "torn.bin"
    uid = store.create_multipart(key)
    i1, i2 = store.upload_part(key, uid, 1, _blob(MiB, 1)), store.upload_part(key, uid, 2, b"end")
    with open(_upload_dir(store, uid) / "index", "r+b") as index:
        index.seek(2 * 64 + 9)
        index.write(b"\xff\x00")  # a record half written when the machine went down
    with pytest.raises(StoreError, match="part 2 .* was not uploaded"):
        store.complete_multipart(key, uid, [i1, i2])
    store.complete_multipart(key, uid, [i1, store.upload_part(key, uid, 2, b"end")])
    assert store.get_range(key, 0, 2 * MiB) == _blob(MiB, 1) + b"end"


_WRITER = """
import random, sys
from ckptfs.store.local import LocalStore
store = LocalStore(sys.argv[1])
for n in range(1, 41):
    info = store.upload_part(sys.argv[2], sys.argv[3], n, random.Random(n).randbytes(1 << 20))
    print(n, info.token, flush=True)
"""


@pytest.mark.parametrize("kill_after", [1, 7, 23])
def test_killed_mid_upload_completes_later_or_aborts(tmp_path, kill_after):
    """A process killed while it sends parts (most likely in the middle of one): the parts it
    was told are stored complete the upload later, from another process; abort removes it all."""
    key = "ckpt/killed.pt"
    writer = LocalStore(tmp_path / "store")
    writer.check()
    uid = writer.create_multipart(key)
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(writer.root), key, uid],
                             stdout=subprocess.PIPE, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    stored = {}
    try:
        for line in child.stdout:
            number, token = line.split()
            stored[int(number)] = token
            if len(stored) == kill_after:
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait()
    assert len(stored) == kill_after
    later = LocalStore(tmp_path / "store")  # what the next daemon sees: only the disk
    assert later.list_multipart() == [(key, uid)]
    blobs = {n: random.Random(n).randbytes(MiB) for n in range(1, 41)}
    blobs[41] = b"tail"
    infos = {n: later.upload_part(key, uid, n, blobs[n]) for n in blobs if n not in stored}
    assert all(infos[n].token for n in infos)
    parts = sorted([*infos.values(), *(PartInfo(n, t) for n, t in stored.items())],
                   key=lambda p: p.number)
    if kill_after == 7:
        later.abort_multipart(key, uid)
        assert later.list_multipart() == [] and os.listdir(later.root / TMP_DIR / "uploads") == []
        assert later.head(key) is None
        return
    later.complete_multipart(key, uid, parts)
    assert later.get_range(key, 0, 50 * MiB) == b"".join(blobs[n] for n in sorted(blobs))


def test_completed_but_not_cleaned_up(store, monkeypatch):
    """Killed after the data file was renamed into place, before the upload's directory went:
    completing again says the upload is gone (as S3 does), abort cleans up."""
    uid = store.create_multipart("c.bin")
    part = store.upload_part("c.bin", uid, 1, b"whole")
    with monkeypatch.context() as m:
        m.setattr(LocalStore, "_drop_upload", lambda *a: None)
        store.complete_multipart("c.bin", uid, [part])
    assert store.get_range("c.bin", 0, 10) == b"whole"
    assert store.list_multipart() == [("c.bin", uid)]
    with pytest.raises(NotFound):
        store.complete_multipart("c.bin", uid, [part])
    store.abort_multipart("c.bin", uid)
    assert store.list_multipart() == [] and store.get_range("c.bin", 0, 10) == b"whole"


def test_part_waiting_for_an_abort_finds_the_upload_gone(store):
    uid = store.create_multipart("w.bin")
    d = _upload_dir(store, uid)
    result = []
    index = os.open(d / "index", os.O_RDWR)
    try:
        fcntl.flock(index, fcntl.LOCK_EX)  # as abort holds it while it removes the upload
        thread = threading.Thread(target=lambda: result.append(_try_upload(store, uid)))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the lock
        store._drop_upload(uid)
    finally:
        os.close(index)
    thread.join(10)
    assert isinstance(result[0], NotFound)
    assert not d.exists()


def _try_upload(store: LocalStore, uid: str):
    try:
        return store.upload_part("w.bin", uid, 1, b"late")
    except StoreError as e:
        return e


def test_upload_without_an_index_is_gone(store):
    """An upload directory of the earlier layout (one file per part, no index): listed, so
    ckptfs can abort it; its parts cannot be used."""
    uid = "0" * 32
    d = store.root / TMP_DIR / "uploads" / uid
    d.mkdir()
    (d / "key").write_text("old.bin")
    (d / "00001-0123456789abcdef").write_bytes(b"old part")
    assert store.list_multipart() == [("old.bin", uid)]
    with pytest.raises(NotFound):
        store.upload_part("old.bin", uid, 1, b"x")
    with pytest.raises(NotFound):
        store.complete_multipart("old.bin", uid, [PartInfo(1, "0123456789abcdef")])
    store.abort_multipart("old.bin", uid)
    assert store.list_multipart() == [] and not d.exists()
