"""The local store's multipart uploads beyond the contract (tests/test_store.py runs that on
both stores): each byte is written once, in place; races between threads; crashes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptfs.errors import NotFound, StoreError
from ckptfs.store import localfs
from ckptfs.store.base import PartInfo
from ckptfs.store.local import LocalStore
from ckptfs.store.local_multipart import LocalMultipart
from ckptfs.store.local_tree import TMP_DIR
from tests.support.harness import blob

pytestmark = pytest.mark.unit

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def object_store(tmp_path) -> LocalStore:
    s = LocalStore.at(tmp_path / "store")
    s.check()
    return s


@pytest.fixture
def copied(monkeypatch) -> list[int]:
    """[bytes the store copied from one file to another] (copy, or completing a multipart)."""
    total = [0]
    real = localfs.copy_range

    def counting(*args, **kwargs) -> int:
        n = real(*args, **kwargs)
        total[0] += n
        return n

    monkeypatch.setattr(localfs, "copy_range", counting)
    return total


def _upload_dir(object_store: LocalStore, uid: str) -> Path:
    return object_store.root / TMP_DIR / "uploads" / uid


def _upload(
    object_store: LocalStore, key: str, uid: str, blobs: dict[int, bytes], order, threads: int = 1
) -> dict:
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(order, pool.map(lambda n: object_store.upload_part(key, uid, n, blobs[n]), order)))


def _complete(object_store: LocalStore, key: str, uid: str, infos: dict) -> None:
    object_store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])


def test_parts_are_written_once_in_place(object_store, copied):
    """ckptfs's layout (equal parts, a shorter last one), sent from 8 threads: the upload's data
    file becomes the object; completing it copies nothing."""
    key = "ckpt/model.pt"
    blobs = {n: blob(256 * KiB, n) for n in range(1, 65)}
    blobs[65] = blob(1000, 65)
    uid = object_store.create_multipart(key, {"xxh3": "abc"})
    data = _upload_dir(object_store, uid) / "data"
    rest = list(range(2, 66))
    random.Random(1).shuffle(rest)
    infos = _upload(object_store, key, uid, blobs, [1], 1) | _upload(object_store, key, uid, blobs, rest, 8)
    assert not list(_upload_dir(object_store, uid).glob("*.part"))
    inode = data.stat().st_ino
    _complete(object_store, key, uid, infos)
    assert copied[0] == 0
    published = object_store.root / "ckpt" / "model.pt"
    assert published.stat().st_ino == inode
    assert published.read_bytes() == b"".join(blobs[n] for n in sorted(blobs))
    assert object_store.head(key).metadata == {"xxh3": "abc"}
    assert os.listdir(object_store.root / TMP_DIR / "uploads") == []


def test_parts_sent_before_the_part_size_is_known(object_store, copied):
    """The short last part arriving first cannot set the slot size: it waits in a file of its
    own and is the only copy at completion. The next part, below a recorded one, sets it."""
    key = "k.bin"
    blobs = {1: blob(MiB, 1), 2: blob(MiB, 2), 3: blob(MiB, 3), 4: blob(5000, 4)}
    uid = object_store.create_multipart(key)
    infos = _upload(object_store, key, uid, blobs, [4, 2, 3, 1])
    assert sorted(p.name for p in _upload_dir(object_store, uid).glob("*.part")) == ["4.part"]
    inode = (_upload_dir(object_store, uid) / "data").stat().st_ino
    _complete(object_store, key, uid, infos)
    assert copied[0] == 5000
    assert (object_store.root / key).stat().st_ino == inode
    assert object_store.get_range(key, 0, 4 * MiB) == b"".join(blobs[n] for n in sorted(blobs))


def test_a_part_bigger_than_the_slots_falls_back_to_a_copy(object_store, copied):
    """Parts of different sizes (not ckptfs's layout) do not fit the slots: completion
    concatenates them into a new file, which is still exactly the object."""
    key = "odd.bin"
    blobs = {1: blob(MiB, 1), 2: blob(3 * MiB, 2), 3: blob(MiB, 3), 4: blob(7, 4)}
    uid = object_store.create_multipart(key)
    infos = _upload(object_store, key, uid, blobs, [1, 2, 3, 4])
    assert sorted(p.name for p in _upload_dir(object_store, uid).glob("*.part")) == ["2.part"]
    inode = (_upload_dir(object_store, uid) / "data").stat().st_ino
    _complete(object_store, key, uid, infos)
    whole = b"".join(blobs[n] for n in sorted(blobs))
    assert copied[0] == len(whole)
    assert (object_store.root / key).stat().st_ino != inode
    assert object_store.get_range(key, 0, len(whole) + 1) == whole
    assert os.listdir(object_store.root / TMP_DIR) == ["uploads"]  # the new file's temp name is gone


def test_failed_completion_wipes_the_parts_it_left_out(object_store):
    """Completing with fewer parts cuts the data file: the parts left out lose their records
    first, so if the completion fails after that (here: a file in the way of the key) and is
    tried again with them, it fails cleanly instead of publishing zeros."""
    key = "x/obj.bin"
    blobs = {n: blob(MiB, n) for n in (1, 2, 3)}
    uid = object_store.create_multipart(key)
    infos = _upload(object_store, key, uid, blobs, [1, 2, 3])
    object_store.put("x", b"in the way")
    with pytest.raises(StoreError) as exc:
        object_store.complete_multipart(key, uid, [infos[1], infos[2]])
    assert exc.value.errno == errno.ENOTDIR
    object_store.delete("x")
    with pytest.raises(StoreError, match="part 3 .* was not uploaded"):
        _complete(object_store, key, uid, infos)
    infos[3] = object_store.upload_part(key, uid, 3, blobs[3])
    _complete(object_store, key, uid, infos)
    assert object_store.get_range(key, 0, 4 * MiB) == blobs[1] + blobs[2] + blobs[3]


def test_identical_retry_writes_nothing(object_store, monkeypatch):
    uid = object_store.create_multipart("r.bin")
    first = object_store.upload_part("r.bin", uid, 1, blob(MiB, 1))
    writes = []
    real = localfs.pwrite_all
    monkeypatch.setattr(localfs, "pwrite_all", lambda *a: writes.append(a[2]) or real(*a))
    assert object_store.upload_part("r.bin", uid, 1, blob(MiB, 1)) == first  # a retry after a timeout
    assert writes == []
    object_store.complete_multipart("r.bin", uid, [first])
    assert object_store.get_range("r.bin", 0, 2 * MiB) == blob(MiB, 1)


def test_same_part_raced_from_two_threads(object_store):
    """Two uploads of one part number at once: the part's record and its bytes always agree,
    so completing with the winner's token gives the winner's bytes, and the loser's fails."""
    key = "race.bin"
    p1 = blob(MiB, 1)
    for round_ in range(12):
        uid = object_store.create_multipart(key)
        i1 = object_store.upload_part(key, uid, 1, p1)
        contents = [blob(MiB, 100 + 2 * round_), blob(MiB, 101 + 2 * round_)]
        barrier = threading.Barrier(2)

        def send(data: bytes, uid=uid, barrier=barrier):
            barrier.wait()
            return object_store.upload_part(key, uid, 2, data)

        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(send, contents))
        try:
            object_store.complete_multipart(key, uid, [i1, infos[0]])
            won = contents[0]
        except StoreError:
            object_store.complete_multipart(key, uid, [i1, infos[1]])
            won = contents[1]
        assert object_store.get_range(key, 0, 3 * MiB) == p1 + won


def test_failed_reupload_leaves_no_record_over_changed_bytes(object_store, monkeypatch):
    """A re-upload that dies after overwriting some of the old bytes (a crash, EIO): the old
    token no longer completes (its bytes are gone), the new upload of the part then works."""
    key = "reup.bin"
    old, new, tail = blob(MiB, 1), blob(MiB, 2), blob(10, 3)
    uid = object_store.create_multipart(key)
    i1, i2 = object_store.upload_part(key, uid, 1, old), object_store.upload_part(key, uid, 2, tail)
    real = os.fdatasync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/data"):
            raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(StoreError) as exc:
        object_store.upload_part(key, uid, 1, new)
    assert exc.value.errno == errno.EIO and exc.value.transient
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(StoreError, match="part 1 .* was not uploaded"):
        object_store.complete_multipart(key, uid, [i1, i2])
    assert object_store.head(key) is None
    object_store.complete_multipart(key, uid, [object_store.upload_part(key, uid, 1, new), i2])
    assert object_store.get_range(key, 0, 3 * MiB) == new + tail


def test_torn_record_reads_as_not_uploaded(object_store):
    key = "torn.bin"
    uid = object_store.create_multipart(key)
    i1, i2 = (
        object_store.upload_part(key, uid, 1, blob(MiB, 1)),
        object_store.upload_part(key, uid, 2, b"end"),
    )
    with open(_upload_dir(object_store, uid) / "index", "r+b") as index:
        index.seek(2 * 64 + 9)
        index.write(b"\xff\x00")  # a record half written when the machine went down
    with pytest.raises(StoreError, match="part 2 .* was not uploaded"):
        object_store.complete_multipart(key, uid, [i1, i2])
    object_store.complete_multipart(key, uid, [i1, object_store.upload_part(key, uid, 2, b"end")])
    assert object_store.get_range(key, 0, 2 * MiB) == blob(MiB, 1) + b"end"


_WRITER = """
import random, sys
from ckptfs.store.local import LocalStore
store = LocalStore.at(sys.argv[1])
for n in range(1, 41):
    info = store.upload_part(sys.argv[2], sys.argv[3], n, random.Random(n).randbytes(1 << 20))
    print(n, info.token, flush=True)
"""


@pytest.mark.parametrize("kill_after", [1, 7, 23])
def test_killed_mid_upload_completes_later_or_aborts(tmp_path, kill_after):
    """A process killed while it sends parts (most likely in the middle of one): the parts it
    was told are stored complete the upload later, from another process; abort removes it all."""
    key = "ckpt/killed.pt"
    writer = LocalStore.at(tmp_path / "store")
    writer.check()
    uid = writer.create_multipart(key)
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(writer.root), key, uid],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
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
    later = LocalStore.at(tmp_path / "store")  # what the next daemon sees: only the disk
    assert later.list_multipart() == [(key, uid)]
    blobs = {n: random.Random(n).randbytes(MiB) for n in range(1, 41)}
    blobs[41] = b"tail"
    infos = {n: later.upload_part(key, uid, n, blobs[n]) for n in blobs if n not in stored}
    assert all(infos[n].token for n in infos)
    parts = sorted([*infos.values(), *(PartInfo(n, t) for n, t in stored.items())], key=lambda p: p.number)
    if kill_after == 7:
        later.abort_multipart(key, uid)
        assert later.list_multipart() == [] and os.listdir(later.root / TMP_DIR / "uploads") == []
        assert later.head(key) is None
        return
    later.complete_multipart(key, uid, parts)
    assert later.get_range(key, 0, 50 * MiB) == b"".join(blobs[n] for n in sorted(blobs))


def test_completed_but_not_cleaned_up(object_store, monkeypatch):
    """Killed after the data file was renamed into place, before the upload's directory went:
    completing again says the upload is gone (as S3 does), abort cleans up."""
    uid = object_store.create_multipart("c.bin")
    part = object_store.upload_part("c.bin", uid, 1, b"whole")
    with monkeypatch.context() as m:
        m.setattr(LocalMultipart, "_drop_upload", lambda *a: None)
        object_store.complete_multipart("c.bin", uid, [part])
    assert object_store.get_range("c.bin", 0, 10) == b"whole"
    assert object_store.list_multipart() == [("c.bin", uid)]
    with pytest.raises(NotFound):
        object_store.complete_multipart("c.bin", uid, [part])
    object_store.abort_multipart("c.bin", uid)
    assert object_store.list_multipart() == [] and object_store.get_range("c.bin", 0, 10) == b"whole"


def test_part_waiting_for_an_abort_finds_the_upload_gone(object_store):
    uid = object_store.create_multipart("w.bin")
    d = _upload_dir(object_store, uid)
    result = []
    index = os.open(d / "index", os.O_RDWR)
    try:
        fcntl.flock(index, fcntl.LOCK_EX)  # as abort holds it while it removes the upload
        thread = threading.Thread(target=lambda: result.append(_try_upload(object_store, uid)))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the lock
        object_store.multipart._drop_upload(uid)
    finally:
        os.close(index)
    thread.join(10)
    assert isinstance(result[0], NotFound)
    assert not d.exists()


def _try_upload(object_store: LocalStore, uid: str):
    try:
        return object_store.upload_part("w.bin", uid, 1, b"late")
    except StoreError as e:
        return e


def test_upload_without_an_index_is_gone(object_store):
    """An upload directory of the earlier layout (one file per part, no index): listed, so
    ckptfs can abort it; its parts cannot be used."""
    uid = "0" * 32
    d = object_store.root / TMP_DIR / "uploads" / uid
    d.mkdir()
    (d / "key").write_text("old.bin")
    (d / "00001-0123456789abcdef").write_bytes(b"old part")
    assert object_store.list_multipart() == [("old.bin", uid)]
    with pytest.raises(NotFound):
        object_store.upload_part("old.bin", uid, 1, b"x")
    with pytest.raises(NotFound):
        object_store.complete_multipart("old.bin", uid, [PartInfo(1, "0123456789abcdef")])
    object_store.abort_multipart("old.bin", uid)
    assert object_store.list_multipart() == [] and not d.exists()


# -- symbolic links planted in the store ---------------------------------------------------
#
# The daemon runs as root; users who can write into the store directory plant links there. No
# link below the root is ever followed: not for reads, writes, listings, deletes, copies or
# multipart uploads.


@pytest.fixture
def planted(tmp_path, object_store):
    """An ``outside`` directory next to the store, with a root-only ``secret.bin``; links to it
    in the store: ``secret.bin`` (to the file), ``outdir`` (to the directory), ``sub/parent``
    (to the directory, one level down)."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    (outside / "secret.bin").write_bytes(b"root only")
    (outside / "secret.bin").chmod(0o600)
    object_store.put("ok.bin", b"ok")
    object_store.put("sub/", b"")
    os.symlink(outside / "secret.bin", object_store.root / "secret.bin")
    os.symlink(outside, object_store.root / "outdir")
    os.symlink(outside, object_store.root / "sub" / "parent")
    return outside


def _outside_untouched(outside: Path) -> None:
    assert sorted(os.listdir(outside)) == ["secret.bin"]
    assert (outside / "secret.bin").read_bytes() == b"root only"


def test_reads_never_follow_a_link(object_store, planted):
    for key in ("secret.bin", "outdir/secret.bin", "sub/parent/secret.bin"):
        with pytest.raises(NotFound):
            object_store.get_range(key, 0, 100)
        assert object_store.head(key) is None
        with pytest.raises(NotFound):
            object_store.copy(key, "stolen.bin")
    for key in ("outdir/", "sub/parent/"):
        assert object_store.head(key) is None
        with pytest.raises(NotFound):
            object_store.get_range(key, 0, 1)
        assert object_store.list_dir(key).files == [] and not object_store.list_dir(key).exists
        assert list(object_store.list(key)) == []
    assert object_store.head("stolen.bin") is None
    assert object_store.get_range("ok.bin", 0, 10) == b"ok"


def test_listings_skip_links_with_one_warning_each(object_store, planted, caplog):
    caplog.set_level(logging.WARNING, logger="ckptfs.store.local")
    for _ in range(3):
        assert [o.key for o in object_store.list()] == ["ok.bin", "sub/"]
        top = object_store.list_dir("")
        assert ([f.key for f in top.files], top.dirs) == (["ok.bin"], ["sub"])
        assert object_store.list_dir("sub/").dirs == [] and object_store.list_dir("sub/").files == []
    warned = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    root = object_store.root
    assert sorted(warned) == sorted(
        f"local store {root}: {key!r} is a symbolic link: not shown, never followed"
        for key in ("secret.bin", "outdir", "sub/parent")
    )


def test_writes_never_land_outside(object_store, planted):
    for key in ("outdir/new.bin", "sub/parent/new.bin", "outdir/deeper/new.bin"):
        with pytest.raises(StoreError) as exc:
            object_store.put(key, b"mine")
        assert exc.value.errno == errno.ELOOP and "symbolic link" in str(exc.value)
        with pytest.raises(StoreError):
            object_store.copy("ok.bin", key)
        with pytest.raises(StoreError):
            object_store.put(key.rpartition("/")[0] + "/", b"")
        uid = object_store.create_multipart(key)
        part = object_store.upload_part(key, uid, 1, b"mine")
        with pytest.raises(StoreError) as exc:
            object_store.complete_multipart(key, uid, [part])
        assert exc.value.errno == errno.ELOOP
        object_store.abort_multipart(key, uid)
    for key in ("outdir/secret.bin", "sub/parent/secret.bin", "outdir/", "sub/parent/"):
        object_store.delete(key)  # nothing of ours there: a no-op
    _outside_untouched(planted)
    # A link where an object goes is replaced by the object; what it pointed to stays as it was.
    object_store.put("secret.bin", b"mine")
    assert not (object_store.root / "secret.bin").is_symlink()
    assert object_store.get_range("secret.bin", 0, 10) == b"mine"
    uid = object_store.create_multipart("secret2.bin")
    os.symlink(planted / "secret.bin", object_store.root / "secret2.bin")
    object_store.complete_multipart(
        "secret2.bin", uid, [object_store.upload_part("secret2.bin", uid, 1, b"mine too")]
    )
    assert object_store.get_range("secret2.bin", 0, 10) == b"mine too"
    _outside_untouched(planted)


def test_links_inside_a_multipart_upload_are_not_followed(object_store, planted):
    """Someone who can write into the store could plant links among an upload's own files."""
    uid = object_store.create_multipart("k.bin")
    d = _upload_dir(object_store, uid)
    (d / "data").unlink()
    os.symlink(planted / "secret.bin", d / "data")
    with pytest.raises(StoreError) as exc:
        object_store.upload_part("k.bin", uid, 1, b"x" * 100)
    assert exc.value.errno == errno.ELOOP
    os.symlink(planted / "secret.bin", d / "2.part")  # a part that goes to a file of its own
    with pytest.raises(StoreError):
        object_store.upload_part("k.bin", uid, 2, b"y" * 100)
    object_store.abort_multipart("k.bin", uid)
    assert not d.exists()
    _outside_untouched(planted)
    # The whole upload directory, or the uploads directory, swapped for a link.
    uid = object_store.create_multipart("k.bin")
    shutil.rmtree(_upload_dir(object_store, uid))
    os.symlink(planted, _upload_dir(object_store, uid))
    with pytest.raises(NotFound):
        object_store.upload_part("k.bin", uid, 1, b"x")
    assert object_store.list_multipart() == []
    object_store.abort_multipart("k.bin", uid)
    assert _upload_dir(object_store, uid).is_symlink()  # the link itself may stay; its target is untouched
    _outside_untouched(planted)


def test_a_linked_temp_dir_is_refused(object_store, planted):
    tmp = object_store.root / TMP_DIR
    shutil.rmtree(tmp)
    os.symlink(planted, tmp)
    fresh = LocalStore.at(object_store.root)
    with pytest.raises(StoreError, match="symbolic link") as exc:
        fresh.check()
    assert exc.value.errno == errno.ELOOP
    for call in (
        lambda: fresh.put("a.bin", b"x"),
        lambda: fresh.create_multipart("a.bin"),
        lambda: fresh.copy("ok.bin", "b.bin"),
    ):
        with pytest.raises(StoreError):
            call()
    assert fresh.list_multipart() == []
    _outside_untouched(planted)


def _exchange(a: Path, b: Path) -> None:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE): neither is ever missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")


def test_a_component_swapped_for_a_link_mid_operation(object_store, planted):
    """A user who can write into the store swaps a directory for a link to ``outside`` and back,
    as fast as it can, while objects under it are written and read: nothing lands outside and no
    read returns the outside bytes (a check-then-use walk would lose this race now and then)."""
    object_store.put("swap/in.bin", b"inside")
    (planted / "in.bin").write_bytes(b"root only")  # what a followed link would show
    (planted / "in.bin").chmod(0o600)
    link = object_store.root / "swap.link"
    os.symlink(planted, link)
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            _exchange(object_store.root / "swap", link)

    thread = threading.Thread(target=swapper)
    thread.start()
    seen, refused = [], 0
    try:
        for i in range(400):
            try:
                object_store.put(f"swap/new-{i}.bin", b"mine")
            except StoreError as e:
                assert e.errno in (errno.ELOOP, errno.ENOTDIR)  # ENOTDIR: swapped back between two looks
                refused += 1
            with contextlib.suppress(NotFound):
                seen.append(object_store.get_range("swap/in.bin", 0, 100))
    finally:
        stop.set()
        thread.join()
    assert set(seen) == {b"inside"} and 0 < refused < 400  # both states were met
    assert sorted(os.listdir(planted)) == ["in.bin", "secret.bin"]
    assert (planted / "in.bin").read_bytes() == b"root only"
