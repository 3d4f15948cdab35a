"""The fault-injecting proxy itself (tests/support/faultproxy.py), driven by boto3 against the real S3 server."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import botocore.exceptions as bex
import pytest

from tests.support.faultproxy import (
    Rule,
    blackhole,
    classify,
    corrupt_request_body,
    corrupt_response_body,
    delay,
    drop_response,
    hold,
    reset_mid_body,
    status,
)

pytestmark = pytest.mark.timeout(120)

NO_RETRIES = {"total_max_attempts": 1}


def _client(s3_server, proxy, **config):
    """A boto3 client of the S3 server that goes through the proxy."""
    from tests.support.swift import S3Endpoint

    config.setdefault("retries", NO_RETRIES)
    return S3Endpoint(proxy.url, s3_server.access_key, s3_server.secret_key, s3_server.region).client(
        **config
    )


def test_classify():
    assert classify("GET", "/b/k", "", {}) == "get"
    assert classify("GET", "/b", "list-type=2&prefix=x", {}) == "list"
    assert classify("GET", "/b/k", "uploadId=1", {}) == "list"
    assert classify("PUT", "/b/k", "", {}) == "put"
    assert classify("PUT", "/b/k", "partNumber=1&uploadId=x", {}) == "upload_part"
    assert classify("PUT", "/b/k", "", {"x-amz-copy-source": "/b/j"}) == "copy"
    assert classify("POST", "/b/k", "uploads", {}) == "create_multipart"
    assert classify("POST", "/b/k", "uploadId=x", {}) == "complete_multipart"
    assert classify("DELETE", "/b/k", "uploadId=x", {}) == "abort"
    assert classify("DELETE", "/b/k", "", {}) == "delete"
    assert classify("POST", "/b", "delete", {}) == "delete"
    assert classify("HEAD", "/b/k", "", {}) == "head"


def test_passes_requests_through_and_counts_them(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy)
    small = os.urandom(1000)
    client.put_object(Bucket=s3_bucket, Key="small", Body=small)
    assert client.get_object(Bucket=s3_bucket, Key="small")["Body"].read() == small
    assert client.head_object(Bucket=s3_bucket, Key="small")["ContentLength"] == 1000
    # multipart: two parts over one keep-alive connection pool
    parts_data = [os.urandom(5 << 20), os.urandom(1 << 20)]
    up = client.create_multipart_upload(Bucket=s3_bucket, Key="big")["UploadId"]
    parts = [
        {
            "PartNumber": n,
            "ETag": client.upload_part(Bucket=s3_bucket, Key="big", UploadId=up, PartNumber=n, Body=data)[
                "ETag"
            ],
        }
        for n, data in enumerate(parts_data, start=1)
    ]
    client.complete_multipart_upload(
        Bucket=s3_bucket, Key="big", UploadId=up, MultipartUpload={"Parts": parts}
    )
    got = client.get_object(Bucket=s3_bucket, Key="big", Range="bytes=100-5242979")["Body"].read()
    assert got == b"".join(parts_data)[100:5242980]
    assert sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]) == ["big", "small"]
    client.delete_object(Bucket=s3_bucket, Key="small")
    assert proxy.count(kind="get") == 2 and proxy.count("GET") == 3
    assert proxy.count("PUT", "put") == 1 and proxy.count(kind="upload_part") == 2
    assert proxy.count(kind="create_multipart") == 1 and proxy.count(kind="complete_multipart") == 1
    assert proxy.count(kind="head") == 1 and proxy.count(kind="list") == 1 and proxy.count(kind="delete") == 1
    assert all(r.action == "forward" for r in proxy.requests)


def test_chunked_request_body_passes(s3_server, s3_bucket, proxy):
    """A body framed by Transfer-Encoding: chunked (Swift's own API: botocore sends one only with
    trailing checksums over https), then a second request on the same keep-alive connection."""
    host, port = "127.0.0.1", int(proxy.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request(
        "GET", "/auth/v1.0", headers={"X-Auth-User": s3_server.access_key, "X-Auth-Key": s3_server.secret_key}
    )
    auth = conn.getresponse()
    auth.read()
    token, account = auth.getheader("X-Auth-Token"), urlsplit(auth.getheader("X-Storage-Url")).path
    data = os.urandom(700 << 10)
    pieces = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
    conn.request(
        "PUT",
        f"{account}/{s3_bucket}/chunked",
        body=pieces,
        encode_chunked=True,
        headers={"X-Auth-Token": token, "Transfer-Encoding": "chunked"},
    )
    put = conn.getresponse()
    put.read()
    assert put.status == 201
    conn.request("GET", f"{account}/{s3_bucket}/chunked", headers={"X-Auth-Token": token})
    assert conn.getresponse().read() == data
    conn.close()
    assert proxy.requests[1].headers["transfer-encoding"] == "chunked"
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="chunked")["Body"].read() == data


def test_status_rule_is_seen_by_boto3_and_counts_down(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy)
    rule = proxy.add_rule(Rule(status(503, "SlowDown"), method="PUT", path=r"/k1$", count=2))
    for _ in range(2):
        with pytest.raises(bex.ClientError) as info:
            client.put_object(Bucket=s3_bucket, Key="k1", Body=b"x")
        assert info.value.response["Error"]["Code"] == "SlowDown"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    client.put_object(Bucket=s3_bucket, Key="k1", Body=b"x")  # count exhausted: forwarded
    client.put_object(Bucket=s3_bucket, Key="k2", Body=b"y")  # path does not match
    assert rule.hits == 2
    assert [r.action for r in proxy.requests] == ["status", "status", "forward", "forward"]
    # a 503 on HEAD carries no body, and a kind/query match works too
    proxy.add_rule(Rule(status(500, "InternalError"), kind="head", count=1))
    with pytest.raises(bex.ClientError) as info:
        client.head_object(Bucket=s3_bucket, Key="k1")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert client.head_object(Bucket=s3_bucket, Key="k1")["ContentLength"] == 1


def test_delay(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy)
    proxy.add_rule(Rule(delay(1.5), kind="put", count=1))
    start = time.monotonic()
    client.put_object(Bucket=s3_bucket, Key="slow", Body=b"x")
    assert time.monotonic() - start >= 1.5
    start = time.monotonic()
    client.put_object(Bucket=s3_bucket, Key="fast", Body=b"x")
    assert time.monotonic() - start < 1.5


def test_rate_throttles_bodies_both_ways(s3_server, s3_bucket, proxy):
    """4 MiB up and down at 8 MiB/s: at least half a second each way (a generous lower bound:
    the proxy may only slow bodies down); unthrottled again once the rate is cleared."""
    client = _client(s3_server, proxy)
    body = os.urandom(4 << 20)
    proxy.rate = 8 << 20
    start = time.monotonic()
    client.put_object(Bucket=s3_bucket, Key="throttled", Body=body)
    assert time.monotonic() - start >= 0.45
    start = time.monotonic()
    assert client.get_object(Bucket=s3_bucket, Key="throttled")["Body"].read() == body
    assert time.monotonic() - start >= 0.45
    proxy.rate = None
    client.put_object(Bucket=s3_bucket, Key="free", Body=body)


def test_drop_response_after_put_leaves_the_object(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy)
    proxy.add_rule(Rule(drop_response(), kind="put", count=1))
    with pytest.raises((bex.ConnectionClosedError, bex.EndpointConnectionError, bex.ReadTimeoutError)):
        client.put_object(Bucket=s3_bucket, Key="dropped", Body=b"acted")
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="dropped")["Body"].read() == b"acted"


def test_hold_keeps_a_request_until_released(s3_server, s3_bucket, proxy):
    client, direct = _client(s3_server, proxy), s3_server.client()
    results: dict[str, object] = {}

    def put(key: str) -> None:
        try:
            results[key] = client.put_object(Bucket=s3_bucket, Key=key, Body=b"held")["ETag"]
        except Exception as exc:  # noqa: BLE001 - the dropped one fails
            results[key] = exc

    # forwarded on release: the server acts only then
    rule = proxy.add_rule(Rule(hold(), kind="put", count=1))
    thread = threading.Thread(target=put, args=("kept",))
    thread.start()
    held = rule.wait_held(30)
    assert held.path.endswith("/kept") and not held.done.is_set()
    assert direct.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0  # not sent upstream yet
    rule.release()
    assert held.done.wait(30) and held.status == 200
    thread.join(30)
    assert isinstance(results["kept"], str)
    assert direct.get_object(Bucket=s3_bucket, Key="kept")["Body"].read() == b"held"
    # dropped on release: the server never sees it
    rule = proxy.add_rule(Rule(hold(), kind="put", count=1))
    thread = threading.Thread(target=put, args=("dropped",))
    thread.start()
    held = rule.wait_held(30)
    rule.release(forward=False)
    assert held.done.wait(30) and held.status == 0
    thread.join(30)
    assert isinstance(results["dropped"], Exception)
    assert [o["Key"] for o in direct.list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["kept"]


def test_reset_mid_body(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy)
    data = os.urandom(2 << 20)
    client.put_object(Bucket=s3_bucket, Key="obj", Body=data)
    # a GET is cut halfway through the response body
    proxy.add_rule(Rule(reset_mid_body(), kind="get", count=1))
    with pytest.raises(Exception) as info:
        client.get_object(Bucket=s3_bucket, Key="obj")["Body"].read()
    assert not isinstance(info.value, AssertionError)
    # a PUT is cut halfway through the request body: the server never stores it
    proxy.add_rule(Rule(reset_mid_body(), kind="put", count=1))
    with pytest.raises((bex.ConnectionClosedError, bex.EndpointConnectionError)):
        client.put_object(Bucket=s3_bucket, Key="never", Body=data)
    assert client.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 1
    assert client.get_object(Bucket=s3_bucket, Key="obj")["Body"].read() == data


def test_corrupt_request_body_reaches_the_server(s3_server, s3_bucket, proxy):
    # Unsigned payload and no checksum: nothing but the bytes tells the server what was meant.
    client = _client(s3_server, proxy, s3={"addressing_style": "path", "payload_signing_enabled": False})
    data = os.urandom(1 << 20)
    proxy.add_rule(Rule(corrupt_request_body(), kind="put", count=1))
    client.put_object(Bucket=s3_bucket, Key="bent", Body=data)
    stored = s3_server.client().get_object(Bucket=s3_bucket, Key="bent")["Body"].read()
    assert len(stored) == len(data) and stored != data
    assert sum(a != b for a, b in zip(stored, data)) == 1


def test_blackhole_holds_until_removed(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy, read_timeout=30)
    rule = proxy.add_rule(Rule(blackhole(), kind="put"))
    outcome = {}

    def put():
        start = time.monotonic()
        try:
            client.put_object(Bucket=s3_bucket, Key="held", Body=b"x")
            outcome["result"] = "ok"
        except Exception as e:  # noqa: BLE001
            outcome["result"] = e
        outcome["seconds"] = time.monotonic() - start

    t = threading.Thread(target=put)
    t.start()
    time.sleep(2)
    assert t.is_alive()  # no answer
    proxy.remove_rule(rule)
    t.join(10)
    assert not t.is_alive() and outcome["seconds"] < 10
    assert isinstance(outcome["result"], bex.ConnectionClosedError)  # the connection is closed when lifted
    client.put_object(Bucket=s3_bucket, Key="held", Body=b"x")  # and the proxy serves again


def test_keep_alive_and_concurrent_connections(s3_server, s3_bucket, proxy):
    client = _client(s3_server, proxy, max_pool_connections=8)
    errors = []

    def work(i):
        try:
            for j in range(5):
                body = os.urandom(100_000)
                client.put_object(Bucket=s3_bucket, Key=f"c{i}/{j}", Body=body)
                assert client.get_object(Bucket=s3_bucket, Key=f"c{i}/{j}")["Body"].read() == body
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert proxy.count(kind="put") == 30 and proxy.count(kind="get") == 30
    # a raw keep-alive connection: two requests, one socket
    with (
        socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))) as s,
        s.makefile("rb") as f,
    ):
        for _ in range(2):
            s.sendall(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
            assert f.readline().startswith(b"HTTP/1.1 200")
            head = list(iter(f.readline, b"\r\n"))
            length = next(
                int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length:")
            )
            assert f.read(length) == b"OK"


def test_corrupt_signed_payload_is_refused_by_the_server(s3_server, s3_bucket, proxy):
    """A fact the store tests rely on: over plain http botocore signs the payload's SHA-256
    (x-amz-content-sha256), and Swift's s3api checks it, so a body bent on the wire is refused."""
    client = _client(s3_server, proxy)
    data = os.urandom(1 << 20)
    proxy.add_rule(Rule(corrupt_request_body(), kind="put", count=1))
    with pytest.raises(bex.ClientError) as info:
        client.put_object(Bucket=s3_bucket, Key="bent", Body=data)
    assert info.value.response["Error"]["Code"] in ("BadDigest", "XAmzContentSHA256Mismatch")
    assert proxy.requests[-1].headers["x-amz-content-sha256"] not in ("UNSIGNED-PAYLOAD", "")
    client.put_object(Bucket=s3_bucket, Key="bent", Body=data)
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="bent")["Body"].read() == data


def test_corrupt_response_body_flips_one_byte_unseen_by_the_client(s3_server, s3_bucket, proxy):
    """What tests/test_integrity.py relies on: a GET body bent on the wire reaches boto3 as
    a normal answer (same length, no error): only a checksum of the bytes can tell."""
    data = os.urandom(1 << 20)
    s3_server.client().put_object(Bucket=s3_bucket, Key="obj", Body=data)
    client = _client(s3_server, proxy)
    rule = proxy.add_rule(Rule(corrupt_response_body(), kind="get", count=1))
    got = client.get_object(Bucket=s3_bucket, Key="obj", Range="bytes=0-524287")["Body"].read()
    assert rule.hits == 1 and len(got) == 1 << 19
    diff = [i for i in range(len(got)) if got[i] != data[i]]
    assert diff == [1 << 18]  # the middle byte, flipped
    assert client.get_object(Bucket=s3_bucket, Key="obj")["Body"].read() == data  # count=1: then intact
