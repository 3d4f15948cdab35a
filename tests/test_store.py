"""Contract tests of the object stores: the same suite runs on the local store (a tmp dir)
and on S3Store against the real S3 server of the test session (``s3_server``/``s3_bucket``)."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptfs.errors import NotFound, PartsLeftOut, StoreError
from ckptfs.store import open_store
from ckptfs.store.base import ObjectStore
from ckptfs.store.local import LocalStore
from ckptfs.store.local_tree import TMP_DIR
from tests.support.harness import blob

MiB = 1 << 20


@pytest.fixture
def s3_store(request):
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")  # created empty by the fixture

    def make(prefix: str = "pfx") -> ObjectStore:
        s = open_store(f"s3://{bucket}/{prefix}", endpoint_url=server.endpoint)
        s.check()
        stores.append(s)
        return s

    stores: list[ObjectStore] = []
    yield make
    for s in stores:
        s.close()


@pytest.fixture
def fake_credentials(monkeypatch):
    """Some credentials, for tests that never reach a server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.store)])
def object_store(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        s = open_store((tmp_path / "store").as_uri())
        s.check()
        return s
    return request.getfixturevalue("s3_store")()


def _keys(object_store: ObjectStore, prefix: str = "") -> list[str]:
    return [o.key for o in object_store.list(prefix)]


# -- basic verbs -----------------------------------------------------------------


def test_put_get_head_with_metadata(object_store):
    data = blob(100_000, seed=1)
    object_store.put("ckpt/step1/model.pt", data, {"xxh3": "0123456789abcdef", "state": "durable"})
    assert object_store.get_range("ckpt/step1/model.pt", 0, len(data)) == data
    assert object_store.get_range("ckpt/step1/model.pt", 10, 20) == data[10:30]
    assert object_store.get_range("ckpt/step1/model.pt", len(data) - 5, 100) == data[-5:]  # short at the end
    assert object_store.get_range("ckpt/step1/model.pt", len(data) + 10, 5) == b""  # past the end
    info = object_store.head("ckpt/step1/model.pt")
    assert info is not None
    assert info.key == "ckpt/step1/model.pt"
    assert info.size == len(data)
    assert abs(info.mtime - time.time()) < 300
    assert info.metadata == {"xxh3": "0123456789abcdef", "state": "durable"}


def test_put_overwrites_and_accepts_memoryview(object_store):
    object_store.put("f", b"old contents", {"v": "1"})
    buf = bytearray(b"xxNEWyy")
    object_store.put("f", memoryview(buf)[2:5], {"v": "2"})  # a slice: not the whole buffer
    assert object_store.get_range("f", 0, 100) == b"NEW"
    assert object_store.head("f").metadata == {"v": "2"}
    object_store.put("g", memoryview(b"whole bytes"))
    assert object_store.get_range("g", 0, 100) == b"whole bytes"


def test_empty_object_and_dir_marker(object_store):
    object_store.put("empty.bin", b"")
    assert object_store.head("empty.bin").size == 0
    assert object_store.get_range("empty.bin", 0, 10) == b""
    object_store.put("dir/", b"")
    marker = object_store.head("dir/")
    assert marker is not None and marker.size == 0
    assert object_store.get_range("dir/", 0, 10) == b""
    assert object_store.head("dir") is None  # "dir" and "dir/" are different keys


def test_missing_key(object_store):
    assert object_store.head("nope") is None
    with pytest.raises(NotFound) as exc:
        object_store.get_range("nope", 0, 10)
    assert exc.value.errno == errno.ENOENT and not exc.value.transient
    assert "nope" in str(exc.value)
    with pytest.raises(NotFound):
        object_store.get_range("nope/deeper", 0, 0)


def test_list_nested_keys_and_markers(object_store):
    keys = {
        "ckpt/": 0,
        "ckpt/step1/": 0,
        "ckpt/step1/model.pt": 3,
        "ckpt/step1/optim.pt": 5,
        "ckpt/step10/": 0,
        "ckpt/step10/model.pt": 7,
        "ckpt/latest": 2,
        "ckpt-old": 1,
        "empty/": 0,
        "top.txt": 4,
    }
    for key, size in keys.items():
        object_store.put(key, b"x" * size)
    listed = list(object_store.list())
    assert {o.key: o.size for o in listed} == keys
    # S3 order: UTF-8 byte order of the whole key ("ckpt-old" < "ckpt/", "step1/" < "step10/").
    assert [o.key for o in listed] == sorted(keys, key=str.encode)
    assert _keys(object_store, "ckpt/step1/") == ["ckpt/step1/", "ckpt/step1/model.pt", "ckpt/step1/optim.pt"]
    assert _keys(object_store, "ckpt/step1") == [
        "ckpt/step1/",
        "ckpt/step1/model.pt",
        "ckpt/step1/optim.pt",
        "ckpt/step10/",
        "ckpt/step10/model.pt",
    ]
    assert _keys(object_store, "ckpt/l") == ["ckpt/latest"]
    assert _keys(object_store, "ckpt") == sorted((k for k in keys if k.startswith("ckpt")), key=str.encode)
    assert _keys(object_store, "nothing/") == []
    assert _keys(object_store, "emp") == ["empty/"]


def test_list_dir_is_one_level(object_store):
    keys = {
        "ckpt/": 0,
        "ckpt/latest": 2,
        "ckpt/step1/": 0,
        "ckpt/step1/model.pt": 3,
        "ckpt/step10/model.pt": 7,
        "ckpt/a b/x": 1,
        "ckpt/deep/er/still/f": 1,
        "ckpt-old": 1,
        "empty/": 0,
        "top.txt": 4,
    }
    for key, size in keys.items():
        object_store.put(key, b"x" * size)
    top = object_store.list_dir("")
    assert top.exists
    assert [(o.key, o.size) for o in top.files] == [("ckpt-old", 1), ("top.txt", 4)]
    assert top.dirs == ["ckpt", "empty"]
    ckpt = object_store.list_dir("ckpt/")
    assert ckpt.exists
    assert [o.key for o in ckpt.files] == ["ckpt/latest"]  # not the directory's own marker
    assert ckpt.dirs == ["a b", "deep", "step1", "step10"]  # markers and implied directories
    assert abs(ckpt.files[0].mtime - time.time()) < 300
    listed = object_store.list_dir("ckpt/step1/")
    assert listed.exists and [o.key for o in listed.files] == ["ckpt/step1/model.pt"]
    empty = object_store.list_dir("empty/")
    assert empty.exists and empty.files == [] and empty.dirs == []
    missing = object_store.list_dir("nothing/")
    assert not missing.exists and missing.files == [] and missing.dirs == []
    assert not object_store.list_dir("top.txt/").exists
    # limit: is there a directory under this name at all (a marker, or keys under it)?
    assert object_store.list_dir("ckpt/deep/", limit=1).exists
    assert object_store.list_dir("empty/", limit=1).exists
    assert not object_store.list_dir("ckpt/latest/", limit=1).exists
    one = object_store.list_dir("ckpt/", limit=1)
    assert one.exists and len(one.files) + len(one.dirs) <= 1  # (S3 counts the marker as the one)
    with pytest.raises(ValueError):
        object_store.list_dir("ckpt")


def test_listing_and_head_agree_on_an_objects_identity(object_store):
    """A mount compares what list_dir says with what it saw earlier (from a listing or a HEAD)
    to notice objects another mount replaced: size, mtime and etag must agree between them."""
    object_store.put("d/small", b"abc")
    uid = object_store.create_multipart("d/big")
    parts = [object_store.upload_part("d/big", uid, n, blob(5 * MiB, seed=n)) for n in (1, 2)]
    object_store.complete_multipart("d/big", uid, parts)
    listed = {o.key: o for o in object_store.list_dir("d/").files}
    walked = {o.key: o for o in object_store.list("d/")}
    for key in ("d/small", "d/big"):
        head = object_store.head(key)
        assert listed[key].size == head.size == walked[key].size
        assert listed[key].etag == head.etag == walked[key].etag
        assert abs(listed[key].mtime - head.mtime) <= 1.0  # HTTP dates have whole seconds
    before = listed["d/small"]
    time.sleep(0.01)
    object_store.put("d/small", b"xyz")  # same size, new content
    after = object_store.list_dir("d/").files[-1]
    assert after.key == "d/small" and after.size == before.size
    assert (after.etag, after.mtime) != (before.etag, before.mtime)


def test_unicode_and_spaces(object_store):
    keys = ["my dir/file name.pt", "ünïcødé/模型 权重.bin", "emoji 🚀.txt", "a+b=c&d%20e.txt"]
    for i, key in enumerate(keys):
        object_store.put(key, key.encode() * 3, {"n": str(i)})
    for i, key in enumerate(keys):
        assert object_store.get_range(key, 0, 1000) == key.encode() * 3
        assert object_store.head(key).metadata == {"n": str(i)}
    files = [k for k in _keys(object_store) if not k.endswith("/")]
    assert sorted(files) == sorted(keys)
    assert "ünïcødé/模型 权重.bin" in _keys(object_store, "ünïcødé/")
    object_store.copy("ünïcødé/模型 权重.bin", "my dir/副本 copy.bin")
    assert object_store.get_range("my dir/副本 copy.bin", 0, 1000) == keys[1].encode() * 3
    for key in keys:
        object_store.delete(key)
        assert object_store.head(key) is None


def test_delete(object_store):
    object_store.put("d/sub/a.bin", b"a")
    object_store.put("d/sub/b.bin", b"b")
    object_store.delete("d/sub/a.bin")
    assert object_store.head("d/sub/a.bin") is None
    assert object_store.head("d/sub/b.bin").size == 1
    object_store.delete("d/sub/a.bin")  # absent: fine
    object_store.delete("never/was/there")
    object_store.delete("d/sub/")  # a marker over other keys: no error, the other keys stay
    assert object_store.head("d/sub/b.bin").size == 1
    object_store.put("m/", b"")
    object_store.delete("m/")
    assert object_store.head("m/") is None
    object_store.delete("m/")


def test_copy_preserves_metadata(object_store):
    data = blob(300_000, seed=2)
    object_store.put("src/a.pt", data, {"xxh3": "feedface", "compress": "none"})
    object_store.put("dst/b.pt", b"to be replaced")
    object_store.copy("src/a.pt", "dst/b.pt")
    assert object_store.get_range("dst/b.pt", 0, len(data)) == data
    info = object_store.head("dst/b.pt")
    assert info.size == len(data)
    assert info.metadata == {"xxh3": "feedface", "compress": "none"}
    assert object_store.get_range("src/a.pt", 0, len(data)) == data  # the source stays
    with pytest.raises(NotFound):
        object_store.copy("src/missing.pt", "dst/c.pt")
    assert object_store.head("dst/c.pt") is None


# -- multipart -----------------------------------------------------------------------


def test_multipart_out_of_order_and_reupload(object_store):
    p1, p2_old, p2, p3 = blob(5 * MiB, 1), blob(5 * MiB, 9), blob(5 * MiB, 2), blob(MiB + 3, 3)
    key = "ckpt/step2/shard 0.pt"
    uid = object_store.create_multipart(key, {"xxh3": "abc123", "parts": "3"})
    assert (key, uid) in object_store.list_multipart()
    i3 = object_store.upload_part(key, uid, 3, p3)
    i2_old = object_store.upload_part(key, uid, 2, p2_old)
    buf = bytearray(p1 + p2)  # parts as memoryview slices of one buffer, as the cache hands them
    i1 = object_store.upload_part(key, uid, 1, memoryview(buf)[: 5 * MiB])
    i2 = object_store.upload_part(key, uid, 2, memoryview(buf)[5 * MiB :])  # re-upload replaces part 2
    assert [i1.number, i2.number, i3.number] == [1, 2, 3]
    assert i2.token != i2_old.token
    assert object_store.head(key) is None  # nothing visible before completion
    assert key not in _keys(object_store)
    object_store.complete_multipart(key, uid, [i1, i2, i3])
    info = object_store.head(key)
    assert info.size == 10 * MiB + MiB + 3
    assert info.metadata == {"xxh3": "abc123", "parts": "3"}
    assert object_store.get_range(key, 0, info.size) == p1 + p2 + p3
    assert object_store.get_range(key, 5 * MiB - 2, 4) == p1[-2:] + p2[:2]
    assert (key, uid) not in object_store.list_multipart()


def test_multipart_stale_token_rejected(object_store):
    key = "stale.bin"
    uid = object_store.create_multipart(key)
    old = object_store.upload_part(key, uid, 1, blob(5 * MiB, 1))
    object_store.upload_part(key, uid, 1, blob(5 * MiB, 2))
    with pytest.raises(StoreError) as exc:
        object_store.complete_multipart(key, uid, [old])
    assert not exc.value.transient
    assert object_store.head(key) is None
    object_store.abort_multipart(key, uid)


def test_multipart_abort_and_list(object_store):
    ua = object_store.create_multipart("a/x.bin")
    ub = object_store.create_multipart("b/y.bin")
    object_store.upload_part("a/x.bin", ua, 1, b"part data")
    assert object_store.list_multipart("a/") == [("a/x.bin", ua)]
    assert sorted(object_store.list_multipart()) == sorted([("a/x.bin", ua), ("b/y.bin", ub)])
    object_store.abort_multipart("a/x.bin", ua)
    object_store.abort_multipart("a/x.bin", ua)  # unknown id now: fine
    assert object_store.list_multipart() == [("b/y.bin", ub)]
    assert object_store.head("a/x.bin") is None
    assert _keys(object_store) == []  # uploads in progress are invisible to list
    object_store.abort_multipart("b/y.bin", ub)
    assert object_store.list_multipart() == []
    with pytest.raises(NotFound):
        object_store.upload_part("a/x.bin", ua, 2, b"too late")


def test_multipart_reupload_then_stale_and_new_token(object_store):
    """A part uploaded again with other bytes: completing with the old token fails and leaves
    the upload as it was; completing with the new one gives the new bytes."""
    key = "reup.bin"
    p1, old2, new2, p3 = blob(5 * MiB, 1), blob(5 * MiB, 2), blob(5 * MiB, 3), blob(1000, 4)
    uid = object_store.create_multipart(key)
    i1 = object_store.upload_part(key, uid, 1, p1)
    i2_old = object_store.upload_part(key, uid, 2, old2)
    i3 = object_store.upload_part(key, uid, 3, p3)
    i2 = object_store.upload_part(key, uid, 2, new2)
    assert i2.token != i2_old.token
    with pytest.raises(StoreError) as exc:
        object_store.complete_multipart(key, uid, [i1, i2_old, i3])
    assert not exc.value.transient
    assert object_store.head(key) is None
    assert (key, uid) in object_store.list_multipart()
    assert object_store.upload_part(key, uid, 1, p1).token == i1.token  # the same bytes again: same token
    object_store.complete_multipart(key, uid, [i1, i2, i3])
    assert object_store.get_range(key, 0, 20 * MiB) == p1 + new2 + p3


def test_multipart_last_part_first(object_store):
    """Parts arrive in any order (parallel uploads): the short last part may come first."""
    key = "ckpt/last-first.pt"
    blobs = {1: blob(5 * MiB, 1), 2: blob(5 * MiB, 2), 3: blob(5 * MiB, 3), 4: blob(12345, 4)}
    uid = object_store.create_multipart(key, {"xxh3": "77"})
    infos = {n: object_store.upload_part(key, uid, n, blobs[n]) for n in (4, 2, 3, 1)}
    object_store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])
    info = object_store.head(key)
    assert info.size == 15 * MiB + 12345 and info.metadata == {"xxh3": "77"}
    assert object_store.get_range(key, 0, info.size) == b"".join(blobs[n] for n in sorted(blobs))


def test_multipart_odd_part_sizes(object_store):
    """Parts of different sizes (not ckptfs's layout, but the API allows it) still give their
    concatenation."""
    key = "odd.bin"
    blobs = {1: blob(5 * MiB + 1, 1), 2: blob(6 * MiB, 2), 3: blob(5 * MiB, 3), 4: blob(3, 4)}
    uid = object_store.create_multipart(key)
    infos = {n: object_store.upload_part(key, uid, n, blobs[n]) for n in (2, 4, 1, 3)}
    object_store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])
    whole = b"".join(blobs[n] for n in sorted(blobs))
    assert object_store.head(key).size == len(whole)
    assert object_store.get_range(key, 0, len(whole)) == whole


def _completes_leaving_parts_out(object_store, key: str, uid: str, parts) -> bool:
    """Complete with some of the uploaded parts. A server that refuses (Ceph RGW 16) raises
    PartsLeftOut, publishes nothing and keeps the upload (aborted here): False."""
    try:
        object_store.complete_multipart(key, uid, parts)
    except PartsLeftOut:
        assert object_store.head(key) is None
        assert (key, uid) in object_store.list_multipart()
        object_store.abort_multipart(key, uid)
        return False
    return True


def test_zero_parts_make_holes_and_may_replace_a_part(object_store):
    """A sparse file's holes: parts of zeros the store makes itself (a copy of its zeros object
    on S3, a punched hole locally), mixed with sent parts, re-sent over a part that held data,
    and made again after someone deleted the zeros object."""
    key = "sparse/model.pt"
    data, tail = blob(5 * MiB, 1), blob(1000, 2)
    uid = object_store.create_multipart(key)
    infos = {
        1: object_store.upload_zero_part(key, uid, 1, 5 * MiB),
        2: object_store.upload_part(key, uid, 2, data),
        3: object_store.upload_part(key, uid, 3, blob(5 * MiB, 3)),
        4: object_store.upload_zero_part(key, uid, 4, 1000),
    }
    infos[3] = object_store.upload_zero_part(key, uid, 3, 5 * MiB)  # the data there gives way to a hole
    assert object_store.upload_zero_part(key, uid, 1, 5 * MiB).token == infos[1].token  # (a retry)
    object_store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])
    whole = bytes(5 * MiB) + data + bytes(5 * MiB + 1000)
    assert object_store.head(key).size == len(whole)
    assert object_store.get_range(key, 0, len(whole)) == whole
    assert all(o.key.startswith(".ckptfs-") for o in object_store.list("") if not o.key.startswith("sparse/"))

    # A hole as the last part of a completion that leaves a part out (parts copied, not in place).
    uid = object_store.create_multipart("sparse/gap.pt")
    parts = [
        object_store.upload_part("sparse/gap.pt", uid, 1, data),
        object_store.upload_part("sparse/gap.pt", uid, 2, blob(5 * MiB, 4)),
        object_store.upload_zero_part("sparse/gap.pt", uid, 3, 1000),
    ]
    if _completes_leaving_parts_out(object_store, "sparse/gap.pt", uid, [parts[0], parts[2]]):
        assert object_store.get_range("sparse/gap.pt", 0, 6 * MiB) == data + bytes(1000)

    for reserved in [o.key for o in object_store.list(".ckptfs-zeros/")]:
        object_store.delete(reserved)
    uid = object_store.create_multipart("sparse/again.pt")
    parts = [
        object_store.upload_zero_part("sparse/again.pt", uid, 1, 5 * MiB),
        object_store.upload_part("sparse/again.pt", uid, 2, tail),
    ]
    object_store.complete_multipart("sparse/again.pt", uid, parts)
    assert object_store.get_range("sparse/again.pt", 0, 6 * MiB) == bytes(5 * MiB) + tail


def test_multipart_parts_left_out(object_store):
    """Completing with some of the uploaded parts: numbers with gaps, or fewer at the end."""
    blobs = {n: blob(5 * MiB, n) for n in (1, 2, 3, 4)}
    for key, chosen in (("gap.bin", [1, 3, 4]), ("short.bin", [1, 2])):
        uid = object_store.create_multipart(key)
        infos = {n: object_store.upload_part(key, uid, n, blobs[n]) for n in blobs}
        if not _completes_leaving_parts_out(object_store, key, uid, [infos[n] for n in chosen]):
            continue
        assert object_store.head(key).size == 5 * MiB * len(chosen)
        assert object_store.get_range(key, 0, 20 * MiB) == b"".join(blobs[n] for n in chosen)
        assert (key, uid) not in object_store.list_multipart()


def test_multipart_parts_from_threads(object_store):
    """ckptfs sends the parts of one upload from several threads at once, in no set order: a
    larger object of many parts is exactly their concatenation."""
    key = "big/model.pt"
    count = 8
    blobs = {n: blob(5 * MiB, n) for n in range(1, count + 1)}
    blobs[count + 1] = blob(MiB // 3, 99)
    uid = object_store.create_multipart(key, {"xxh3": "big"})
    order = list(blobs)
    random.Random(7).shuffle(order)
    with ThreadPoolExecutor(4) as pool:
        infos = dict(zip(order, pool.map(lambda n: object_store.upload_part(key, uid, n, blobs[n]), order)))
    object_store.complete_multipart(key, uid, [infos[n] for n in sorted(infos)])
    whole = b"".join(blobs[n] for n in sorted(blobs))
    assert object_store.head(key).size == len(whole)
    assert object_store.get_range(key, 0, len(whole)) == whole
    assert object_store.get_range(key, 5 * MiB - 3, 6) == blobs[1][-3:] + blobs[2][:3]


# -- local store -------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "../x",
        "/abs",
        "a//b",
        "a/../../b",
        "",
        ".",
        "./a",
        "a/./b",
        "..",
        "../",
        "a\0b",
        f"{TMP_DIR}/x",
        f"{TMP_DIR}/",
    ],
)
def test_local_rejects_escaping_keys(tmp_path, key):
    object_store = LocalStore.at(tmp_path / "store")
    object_store.check()
    for call in (
        lambda: object_store.put(key, b"x"),
        lambda: object_store.get_range(key, 0, 1),
        lambda: object_store.head(key),
        lambda: object_store.delete(key),
        lambda: object_store.create_multipart(key),
        lambda: object_store.copy("ok", key),
    ):
        with pytest.raises(ValueError):
            call()
    assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


def test_local_layout(tmp_path):
    root = tmp_path / "deep" / "store"
    object_store = LocalStore.at(root)
    object_store.check()  # creates the root, parents too
    assert object_store.url == f"file://{root}"
    object_store.put("a/b/c.bin", b"data", {"xxh3": "1234"})
    assert (root / "a" / "b" / "c.bin").read_bytes() == b"data"
    assert os.getxattr(root / "a" / "b" / "c.bin", "user.ckptfs.xxh3") == b"1234"
    # Implicit directories list as markers; the internal dir never shows.
    uid = object_store.create_multipart("pending.bin")
    object_store.upload_part("pending.bin", uid, 1, b"p")
    assert _keys(object_store) == ["a/", "a/b/", "a/b/c.bin"]
    assert _keys(object_store, ".ckptfs") == []
    assert os.listdir(root / TMP_DIR) == ["uploads"]  # no temp file left behind
    object_store.delete("a/b/c.bin")
    assert (root / "a" / "b").is_dir()  # parents stay
    object_store.delete("a/")  # not empty: stays, no error
    assert (root / "a").is_dir()
    object_store.delete("a/b/")
    object_store.delete("a/")
    assert not (root / "a").exists()
    object_store.abort_multipart("pending.bin", uid)
    assert os.listdir(root / TMP_DIR / "uploads") == []


def test_local_check_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        LocalStore.at(tmp_path / "file").check()
    with pytest.raises(StoreError, match="cannot create"):
        LocalStore.at(tmp_path / "file" / "sub").check()
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        try:
            with pytest.raises(StoreError, match="not writable") as exc:
                LocalStore.at(ro).check()
            assert exc.value.errno == errno.EACCES
        finally:
            ro.chmod(0o700)


def test_local_file_in_the_way(tmp_path):
    object_store = LocalStore.at(tmp_path)
    object_store.put("a", b"x")
    with pytest.raises(StoreError) as exc:
        object_store.put("a/b", b"y")  # a file where a directory must go: an errno, not a crash
    assert exc.value.errno == errno.ENOTDIR


# -- S3 specifics ------------------------------------------------------------------


def test_s3_prefix_isolation(s3_store):
    one, two, root, p = s3_store("jobs/one"), s3_store("jobs/two/"), s3_store(""), s3_store("jobs/on")
    assert one.url.endswith("/jobs/one") and two.url.endswith("/jobs/two") and "//" not in root.url[5:]
    root.put("jobs/one/", b"")  # a marker for the prefix itself: not a key inside the store
    one.put("k.bin", b"1")
    two.put("k.bin", b"2")
    assert _keys(one) == ["k.bin"] and _keys(two) == ["k.bin"]
    assert one.get_range("k.bin", 0, 9) == b"1" and two.get_range("k.bin", 0, 9) == b"2"
    assert _keys(p) == []  # "jobs/on" does not see "jobs/one/..."
    assert _keys(root) == ["jobs/one/", "jobs/one/k.bin", "jobs/two/k.bin"]
    uid = one.create_multipart("m.bin")
    assert two.list_multipart() == [] and one.list_multipart() == [("m.bin", uid)]
    assert ("jobs/one/m.bin", uid) in root.list_multipart()
    one.abort_multipart("m.bin", uid)
    two.delete("k.bin")
    assert one.head("k.bin").size == 1


def test_s3_copy_in_ranges(s3_store):
    """Objects over 5 GiB are copied with UploadPartCopy: run that path with small sizes."""
    object_store = s3_store()
    object_store.max_single_copy = 0
    object_store.copy_part_size = 5 * MiB
    data = blob(12 * MiB + 5, seed=4)
    object_store.put("big.bin", data, {"xxh3": "99"})
    object_store.copy("big.bin", "big copy.bin")
    info = object_store.head("big copy.bin")
    assert info.size == len(data) and info.metadata == {"xxh3": "99"}
    assert object_store.get_range("big copy.bin", 0, len(data)) == data
    assert object_store.list_multipart() == []


def test_s3_unreachable_is_transient_and_fast(fake_credentials):
    object_store = open_store("s3://bucket/p", endpoint_url="http://127.0.0.1:1")
    t = time.monotonic()
    with pytest.raises(StoreError) as exc:
        object_store.put("k", b"x")
    assert exc.value.transient
    assert "127.0.0.1:1" in str(exc.value) and "\n" not in str(exc.value)
    assert time.monotonic() - t < 10


# -- open_store --------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, words",
    [
        ("ftp://x", "unsupported store URL 'ftp://x'"),
        ("/plain/path", "unsupported store URL"),
        ("s3://", "bad bucket name"),
        ("s3:///prefix", "bad bucket name"),
        ("s3://bad bucket/x", "bad bucket name"),
        ("file://relative/path", "absolute path"),
        ("s3://AKIAXXX:sEcReT@bucket/p", "credentials"),
    ],
)
def test_open_store_bad_urls(url, words):
    with pytest.raises(StoreError) as exc:
        open_store(url)
    msg = str(exc.value)
    assert words in msg and "\n" not in msg and "sEcReT" not in msg
    assert exc.value.errno == errno.EINVAL


def test_open_store_local(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    object_store = open_store(None)
    assert isinstance(object_store, LocalStore) and object_store.root == tmp_path / "xdg" / "ckptfs" / "store"
    object_store.check()
    assert open_store("").root == object_store.root
    spaced = tmp_path / "with space"
    object_store = open_store(spaced.as_uri())
    assert isinstance(object_store, LocalStore) and object_store.root == spaced
    assert open_store(object_store.url).root == spaced  # url round-trips
    with pytest.raises(StoreError, match="endpoint"):
        open_store(spaced.as_uri(), endpoint_url="http://127.0.0.1:9000")


def _check_fails(url: str, endpoint: str) -> StoreError:
    object_store = open_store(url, endpoint_url=endpoint)
    t = time.monotonic()
    with pytest.raises(StoreError) as exc:
        object_store.check()
    assert time.monotonic() - t < 5, "check() must fail fast"
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 300
    return exc.value


def test_open_store_missing_bucket(s3_server):
    err = _check_fails("s3://no-such-bucket-ckptfs/p", s3_server.endpoint)
    assert str(err) == f"bucket 'no-such-bucket-ckptfs' does not exist at {s3_server.endpoint}"
    assert not err.transient


def test_open_store_wrong_credentials(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-42")
    err = _check_fails(f"s3://{s3_bucket}", s3_server.endpoint)
    assert str(err) == (
        f"access denied to bucket '{s3_bucket}' at {s3_server.endpoint}: check the AWS credentials"
    )
    assert err.errno == errno.EACCES and not err.transient and "wrong-secret-42" not in str(err)


def test_open_store_unreachable_endpoint(fake_credentials):
    err = _check_fails("s3://bucket", "http://127.0.0.1:1")
    assert str(err).startswith("cannot reach http://127.0.0.1:1: ")
    assert "refused" in str(err).lower()


def test_open_store_endpoint_that_drops_connections(fake_credentials):
    """A host that never answers SYNs (a listener whose accept queue is full): the
    connect timeout, not a retry storm, bounds check()."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        try:
            err = _check_fails("s3://bucket", f"http://127.0.0.1:{port}")
        finally:
            for s in fillers:
                s.close()
    assert str(err).startswith(f"cannot reach http://127.0.0.1:{port}: ") and err.transient


def test_open_store_no_credentials(monkeypatch, tmp_path):
    for var in list(os.environ):
        if var.startswith("AWS_") and var != "AWS_CA_BUNDLE":
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    err = _check_fails("s3://bucket", "http://127.0.0.1:1")
    assert "no AWS credentials" in str(err) and err.errno == errno.EACCES


def test_mount_refuses_a_missing_bucket_and_bad_credentials_in_one_line(s3_server, s3_bucket, tmp_path):
    """The three failures above through `ckptfs mount` itself: exit 1 (not bad usage: the store
    said no), one line on stderr naming the cause, no secret in it, nothing mounted."""
    from tests.support.harness import assert_one_line_error
    from tests.support.mounting import CKPTFS, is_mounted

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    without_aws = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    no_credentials = {
        **without_aws,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    cases = [  # (store URL, environment, what the line says)
        ("s3://no-such-bucket-ckptfs/p", os.environ, "bucket 'no-such-bucket-ckptfs' does not exist"),
        (f"s3://{s3_bucket}", {**os.environ, "AWS_SECRET_ACCESS_KEY": "wrong-secret-42"}, "access denied"),
        (f"s3://{s3_bucket}", no_credentials, "no AWS credentials"),
    ]
    for url, env, needle in cases:
        argv = [
            "mount",
            url,
            str(mnt),
            "--endpoint-url",
            s3_server.endpoint,
            "--cache-dir",
            str(tmp_path / "c"),
        ]
        done = subprocess.run([*CKPTFS, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert_one_line_error(done, 1, needle)
        assert "wrong-secret-42" not in done.stderr
        assert not is_mounted(mnt), url


def test_open_store_bad_endpoint():
    with pytest.raises(StoreError, match="bad endpoint URL"):
        open_store("s3://bucket", endpoint_url="127.0.0.1:9000")


def test_open_store_refuses_credentials_in_the_endpoint_url_and_never_prints_them():
    # The daemon's command line (/proc/PID/cmdline) is world-readable: a password must not get there.
    with pytest.raises(StoreError, match="credentials") as caught:
        open_store("s3://bucket", endpoint_url="http://user:se@cret@127.0.0.1:9000")
    assert caught.value.errno == errno.EINVAL and "cret" not in str(caught.value)


def test_redact_url_masks_a_password_holding_at_signs():
    from ckptfs.store.base import redact_url

    assert redact_url("http://user:p@ss@host:9000/a@b") == "http://***@host:9000/a@b"
    assert redact_url("s3://bucket/run@1/x") == "s3://bucket/run@1/x"


def test_s3_a_zeros_object_changed_by_hand_is_made_again(s3_store):
    """A zeros object someone overwrote with other bytes of the same size is not copied from:
    a new store checks its ETag and puts zeros there again."""
    from ckptfs.store.s3_multipart import ZEROS_PREFIX, zeros_size

    first = s3_store()
    first.put(f"{ZEROS_PREFIX}{zeros_size(5 * MiB)}", blob(zeros_size(5 * MiB), 7))
    store = s3_store()
    uid = store.create_multipart("z.bin")
    parts = [store.upload_zero_part("z.bin", uid, 1, 5 * MiB), store.upload_part("z.bin", uid, 2, b"end")]
    store.complete_multipart("z.bin", uid, parts)
    assert store.get_range("z.bin", 0, 6 * MiB) == bytes(5 * MiB) + b"end"
