"""Shared-node hardening, on real mounts: the local store never follows a link planted in its
directory, and the daemon's log (a 0600 file) never holds credentials, signatures or data, at
any --log-level, against the real S3 server."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import stat

import pytest

from ckptfs.daemon import logs
from tests.conftest import S3StoreView
from tests.support.mounting import Mount, ckptfs

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
CANARY = b"CKPTFS-LOG-CANARY-0123456789-"  # the bytes of every file written below


def _canary_bytes(n: int) -> bytes:
    return (CANARY * (n // len(CANARY) + 1))[:n]


def _log(m: Mount) -> bytes:
    return (m.cache_dir / "ckptfs.log").read_bytes()


# -- the local store and links planted in it ------------------------------------------------


def test_links_planted_in_the_local_store_are_never_followed(tmp_path):
    """Links to a root-only file, to a directory outside, as a parent component and as the
    target of a write: through the mount none is shown or read, no write lands outside, and each
    is warned about once however often the mount lists."""
    store = tmp_path / "store"
    store.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    secret = outside / "secret.bin"
    secret.write_bytes(b"root only " * 100)
    secret.chmod(0o600)
    victim = outside / "victim.bin"
    victim.write_bytes(b"victim")
    (store / "ok.bin").write_bytes(b"ok")
    (store / "sub").mkdir()
    os.symlink(secret, store / "secret.bin")
    os.symlink(outside, store / "outdir")
    os.symlink(outside, store / "sub" / "parent")
    os.symlink(victim, store / "victim.bin")
    m = Mount(f"file://{store}", tmp_path / "m", extra=("--list-ttl", "0"))
    try:
        m.start()
        os.symlink(secret, store / "late.bin")  # planted while mounted
        for _ in range(3):
            assert sorted(os.listdir(m.path)) == ["ok.bin", "sub"]
            assert os.listdir(m.path / "sub") == []
        for name in ("secret.bin", "late.bin", "outdir/secret.bin", "sub/parent/secret.bin", "victim.bin"):
            with pytest.raises(FileNotFoundError):
                (m.path / name).read_bytes()
        log = _log(m).decode()
        for key in ("secret.bin", "late.bin", "outdir", "sub/parent", "victim.bin"):
            assert log.count(f"{key!r} is a symbolic link: not shown, never followed") == 1, key

        # A file written over a link's name replaces the link, never what it points to.
        (m.path / "victim.bin").write_bytes(b"mine")
        m.sync()
        assert not (store / "victim.bin").is_symlink() and (store / "victim.bin").read_bytes() == b"mine"
        assert victim.read_bytes() == b"victim"

        # Under a link to a directory: the store refuses (and says why); nothing lands outside.
        (m.path / "outdir").mkdir()
        (m.path / "outdir" / "new.bin").write_bytes(b"mine too")
        assert ckptfs("sync", str(m.path), "--timeout", "3", check=False).returncode != 0
        assert sorted(os.listdir(outside)) == ["secret.bin", "victim.bin"]
        errors = json.loads(ckptfs("status", str(m.path), "--json").stdout)["errors"]
        assert any("symbolic link" in e["message"] for e in errors), errors
        # Once a real directory is there, the upload goes through, into the store.
        (store / "outdir").unlink()
        (store / "outdir").mkdir()
        m.sync(timeout=120)
        assert (store / "outdir" / "new.bin").read_bytes() == b"mine too"
        assert sorted(os.listdir(outside)) == ["secret.bin", "victim.bin"]
        assert secret.read_bytes() == b"root only " * 100 and victim.read_bytes() == b"victim"
        m.stop()
    finally:
        m.cleanup()


# -- the daemon's log -----------------------------------------------------------------------

_AUTH_VALUE = re.compile(rb"(?i)authorization['\"]?\s*[:=]\s*(?!\*\*\*)\S")
_SIGNATURE_VALUE = re.compile(rb"(?i)signature=(?!\*\*\*)[0-9a-f]")
_SIGNATURE_LINE = re.compile(rb"(?i)signature:\s*[0-9a-f]{16}")


def _assert_clean(text: bytes, server) -> None:
    assert CANARY not in text and CANARY.hex().encode() not in text
    assert server.secret_key.encode() not in text
    assert server.access_key.encode() not in text  # it sits in every Authorization header
    assert not _AUTH_VALUE.search(text)
    assert not _SIGNATURE_VALUE.search(text) and not _SIGNATURE_LINE.search(text)


@pytest.mark.parametrize("level", ["debug", "trace"])
def test_s3_log_holds_no_credentials_signatures_or_data(level, s3_server, s3_bucket, tmp_path):
    """A 20 MiB file (multipart) and a small one (one PUT) written, then read back cold through a
    second mount (ranged GETs): the logs of both daemons are 0600 and hold neither the secret
    key, the access key, an Authorization or signature value, nor any of the file's bytes."""
    view = S3StoreView(s3_server, s3_bucket)
    big, small = _canary_bytes(20 * MiB), _canary_bytes(1000)
    writer = Mount(view.url, tmp_path / "w", endpoint_url=view.endpoint, extra=("--log-level", level))
    reader = Mount(view.url, tmp_path / "r", endpoint_url=view.endpoint, extra=("--log-level", level))
    try:
        writer.start()
        (writer.path / "big.bin").write_bytes(big)
        (writer.path / "small.bin").write_bytes(small)
        writer.sync()
        writer.stop()
        reader.start()
        assert (reader.path / "big.bin").read_bytes() == big
        assert (reader.path / "small.bin").read_bytes() == small
        reader.stop()
    finally:
        writer.cleanup()
        reader.cleanup()
    for m in (writer, reader):
        assert stat.S_IMODE((m.cache_dir / "ckptfs.log").stat().st_mode) == 0o600
        text = _log(m)
        _assert_clean(text, s3_server)
        library_lines = re.findall(rb"(?m)^\S+ \S+ \w+ (?:botocore|boto3|urllib3|s3transfer)[.\w]*: ", text)
        if level == "trace":  # the libraries did log their requests: the redaction was put to work
            assert library_lines and b"Authorization': ***" in text
        else:
            assert library_lines == []
    assert len(_log(writer)) < 5 * MiB  # not the 120 MB a 20 MiB file used to leave


def test_log_file_is_refused_when_not_our_own_regular_file(tmp_path):
    """An existing CACHE_DIR/ckptfs.log that is a link, a fifo or someone else's file: `mount`
    fails with one line and writes nothing through it; an old 0644 log of ours becomes 0600."""
    store = f"file://{tmp_path / 'store'}"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"untouched")
    for i, plant in enumerate(
        [
            lambda p: os.symlink(elsewhere, p),
            lambda p: os.mkfifo(p, 0o600),
            lambda p: (p.write_bytes(b""), os.chown(p, 12345, 12345)),
            lambda p: os.link(elsewhere, p),
        ]
    ):
        m = Mount(store, tmp_path / f"m{i}")
        m.cache_dir.mkdir(mode=0o700)
        plant(m.cache_dir / "ckptfs.log")
        try:
            done = ckptfs("mount", *m.args(), check=False, timeout=60)
        finally:
            m.cleanup()
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("ckptfs: refusing the log file"), (
            done.stderr
        )
        assert elsewhere.read_bytes() == b"untouched"
    m = Mount(store, tmp_path / "old")
    m.cache_dir.mkdir(mode=0o700)
    (m.cache_dir / "ckptfs.log").write_bytes(b"an old log\n")
    (m.cache_dir / "ckptfs.log").chmod(0o644)
    try:
        m.start()
        m.stop()
    finally:
        m.cleanup()
    assert stat.S_IMODE((m.cache_dir / "ckptfs.log").stat().st_mode) == 0o600
    assert _log(m).startswith(b"an old log\n")


# -- the redaction itself -------------------------------------------------------------------


def _logged(level: str, emit, monkeypatch) -> str:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level for n in logs.LIBRARIES}
    stream = io.StringIO()
    try:
        logs.setup(level, stream)
        emit()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, lvl in saved[2].items():
            logging.getLogger(name).setLevel(lvl)
    return stream.getvalue()


def test_redaction_of_what_libraries_log(monkeypatch):
    def emit() -> None:
        lib = logging.getLogger("botocore.endpoint")
        lib.debug(
            "Sending http request: %s",
            "<AWSPreparedRequest url=https://h/b/k?X-Amz-Credential=AKID%2F1"
            "&X-Amz-Signature=0123abcd&X-Amz-Security-Token=tok, headers={'Authorization': "
            "b'AWS4-HMAC-SHA256 Credential=AKID/1/us-east-1/s3/aws4_request, SignedHeaders=host, "
            "Signature=0123456789abcdef', 'X-Amz-Security-Token': b'FwoGZXIvYXdzE'}>",
        )
        lib.debug(
            "Making request with params: %s", {"body": b"CKPTFS-LOG-CANARY" * 1000, "url": "https://h/k"}
        )
        logging.getLogger("botocore.parsers").debug("Response body:\n%r", b"CKPTFS-LOG-CANARY")
        logging.getLogger("botocore.auth").debug("Signature:\n%s", "0123456789abcdef0123456789abcdef")
        logging.getLogger("ckptfs.x").info(
            "secret in passing: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY, "
            "endpoint http://user:pw@127.0.0.1:9000"
        )
        lib.debug("%s", "x" * (logs.MAX_MESSAGE + 100))

    text = _logged("trace", emit, monkeypatch)
    for leak in (
        "AKID",
        "0123abcd",
        "Token=tok",
        "0123456789abcdef",
        "FwoGZXIvYXdzE",
        "CKPTFS-LOG-CANARY",
        "wJalrXUtnFEMI",
        "user:pw",
        "x" * (logs.MAX_MESSAGE + 1),
    ):
        assert leak not in text, leak
    for kept in (
        "X-Amz-Signature=***",
        "'Authorization': ***",
        "<17000 bytes>",
        "<17 bytes>",
        "http://***@127.0.0.1:9000",
        "100 more characters not logged",
    ):
        assert kept in text, kept


def test_debug_keeps_only_our_own_lines(monkeypatch):
    def emit() -> None:
        assert logging.getLogger("botocore").level == logging.WARNING  # not even built
        logging.getLogger("botocore.endpoint").debug("Making request")
        logging.getLogger("urllib3.connectionpool").info("Starting new HTTP connection")
        logging.getLogger("botocore.credentials").warning("a library's warning stays")
        logging.getLogger("ckptfs.transfer.uploader").debug("our own debug line")

    text = _logged("debug", emit, monkeypatch)
    assert "Making request" not in text and "Starting new" not in text
    assert "a library's warning stays" in text and "our own debug line" in text


def test_trace_is_a_log_level_of_the_cli():
    from ckptfs.cli import main

    args = main.build_parser().parse_args(["mount", "/tmp/x", "/tmp/y", "--log-level", "trace"])
    assert args.log_level == "TRACE" and logs.level_number(args.log_level) < logging.DEBUG


def test_an_endpoint_password_is_never_printed(monkeypatch):
    """Credentials in --endpoint-url are refused (S3 signs requests, and the detached daemon's
    command line is readable by every user on the node); the refusal itself never prints them."""
    from ckptfs.errors import StoreError
    from ckptfs.store import open_store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    with pytest.raises(StoreError) as exc:
        open_store("s3://bucket/p", endpoint_url="http://user:hunter22@127.0.0.1:9")
    assert "hunter22" not in str(exc.value) and "http://***@127.0.0.1:9" in str(exc.value)


def test_bytes_inside_containers_are_replaced_and_lines_survive(monkeypatch):
    from collections import namedtuple

    Pair = namedtuple("Pair", "name body")

    def emit() -> None:
        log = logging.getLogger("ckptfs.x")
        log.info(
            "parts: %s %s", [b"CKPTFS-LOG-CANARY", (b"CKPTFS-LOG-CANARY", 1)], Pair("p", b"CKPTFS-LOG-CANARY")
        )
        log.info("%(body)s", {"body": bytearray(b"CKPTFS-LOG-CANARY")})
        log.info("%s %s", "one argument too few")

    text = _logged("info", emit, monkeypatch)
    assert "CKPTFS-LOG-CANARY" not in text
    assert "parts: ['<17 bytes>', ('<17 bytes>', 1)] ('p', '<17 bytes>')" in text
    assert "INFO ckptfs.x: <17 bytes>" in text
    assert "could not be formatted" in text and "one argument too few" not in text
