"""The opt-in CRT transport for S3 bodies (``CKPTFS_S3_CLIENT=crt``, store/s3_crt.py; issue 32):
part uploads and puts through awscrt's S3 client, against the real Swift server through the fault
proxy. The same store verbs as botocore's path, with the same errors: keys that need encoding,
user metadata, signed payloads (a body damaged on the way is refused), the 5xx answers the CRT
reports only by name, a refused connection, wrong credentials, a vanished upload."""

from __future__ import annotations

import os

import pytest

from ckptfs.errors import NotFound, StoreError
from ckptfs.store.health import StoreHealth
from ckptfs.store.s3 import S3Store
from tests.support.faultproxy import Rule, corrupt_request_body, status

pytestmark = [pytest.mark.store, pytest.mark.timeout(240)]

MiB = 1 << 20
KEYS = ["plain", "dir/a b+c%d&e=f?g#h", "uni/Ünïcødé~x", "x/.hidden", "sp  ace/ "]


@pytest.fixture
def crt_store(monkeypatch, s3_server, s3_bucket, proxy):
    monkeypatch.setenv("CKPTFS_S3_CLIENT", "crt")
    store = S3Store.connect(s3_bucket, "pre fix", endpoint_url=proxy.url)
    assert store.client._crt() is not None  # (awscrt is a dependency: the transport is really used)
    yield store
    store.close()


def test_puts_and_parts_go_through_the_crt_with_their_keys_and_metadata(crt_store, proxy):
    for key in KEYS:
        data = os.urandom(100_000)
        crt_store.put(key, data, {"ckptfs-x": "1", "other": "v w"})
        got, meta = crt_store.get_range_meta(key, 10, 1000)
        assert bytes(got) == data[10:1010], key
        assert meta == {"ckptfs-x": "1", "other": "v w"}, key
    parts = [os.urandom(5 * MiB + 7 * i) for i in range(3)]
    upload = crt_store.create_multipart("mp/ob j", {"a": "b"})
    infos = [crt_store.upload_part("mp/ob j", upload, i + 1, memoryview(p)) for i, p in enumerate(parts)]
    crt_store.complete_multipart("mp/ob j", upload, infos)
    assert bytes(crt_store.get_range("mp/ob j", 0, 20 * MiB)) == b"".join(parts)
    # Every body went out signed: the header carries the SHA-256 of the body, not UNSIGNED-PAYLOAD.
    bodies = [r for r in proxy.requests if r.kind in ("upload_part", "put")]
    assert len(bodies) == len(KEYS) + len(parts)
    assert all(len(r.headers.get("x-amz-content-sha256", "")) == 64 for r in bodies)


def test_a_body_damaged_on_the_way_is_refused(crt_store, proxy):
    proxy.add_rule(Rule(corrupt_request_body(), kind="upload_part", count=1))
    upload = crt_store.create_multipart("damaged")
    with pytest.raises(StoreError) as caught:
        crt_store.upload_part("damaged", upload, 1, os.urandom(6 * MiB))
    assert "XAmzContentSHA256Mismatch" in str(caught.value) or "BadDigest" in str(caught.value), caught.value
    info = crt_store.upload_part("damaged", upload, 1, data := os.urandom(6 * MiB))
    crt_store.complete_multipart("damaged", upload, [info])
    assert bytes(crt_store.get_range("damaged", 0, 6 * MiB)) == data


@pytest.mark.parametrize(
    ("code", "s3_code"), [(503, "SlowDown"), (500, "InternalError"), (502, "BadGateway")]
)
def test_server_errors_are_transient_and_reported(crt_store, proxy, code, s3_code):
    health = StoreHealth()
    crt_store.report_to(health)
    proxy.add_rule(Rule(status(code, s3_code), kind="put", count=1))
    with pytest.raises(StoreError) as caught:
        crt_store.put("k", b"x" * 1000)
    assert caught.value.transient, caught.value
    assert health.failing_since is not None
    crt_store.put("k", b"x" * 1000)  # the next attempt goes through, and the store is well again
    assert health.failing_since is None


def test_no_upload_no_server_and_wrong_keys_read_as_botocore_errors(crt_store, monkeypatch, s3_bucket):
    with pytest.raises(NotFound):
        crt_store.upload_part("mp/x", "no-such-upload", 1, b"x" * 100)
    nobody = S3Store.connect(s3_bucket, endpoint_url="http://127.0.0.1:1")
    with pytest.raises(StoreError, match="Connection refused") as caught:
        nobody.put("k", b"x")
    assert caught.value.transient
    nobody.close()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    denied = S3Store.connect(s3_bucket, endpoint_url=crt_store.client.endpoint_url)
    with pytest.raises(StoreError, match="access denied"):
        denied.put("k", b"x")
    denied.close()
