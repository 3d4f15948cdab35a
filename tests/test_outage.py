"""A store outage, end to end: a real mount whose S3 endpoint is the fault proxy (tests/support/faultproxy.py)
in front of the real Swift server. Stopping and the data path stay bounded while the store is down,
``ckptfs status`` shows the trouble at once, and nothing committed is lost: once the store is back,
a new mount with the same cache dir makes it durable."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest

from ckptfs.model.refresh import LOOKUP_WAIT_S
from ckptfs.store.health import STALL_S
from ckptfs.transfer.retry import ANSWER
from tests.support.faultproxy import Rule, blackhole, reset_mid_body, status
from tests.support.harness import proc_state, wait_until, write_files
from tests.support.mounting import Mount, ckptfs, is_mounted

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(240)]

MiB = 1 << 20


@pytest.fixture
def store(proxied_store):
    """s3://bucket/run through the fault proxy (mount_factory's mounts use it)."""
    return proxied_store


def gone(pid: int) -> bool:
    return proc_state(pid) in (None, "Z")  # an exited daemon nobody reaped yet counts as gone


def recover(m: Mount, files: dict[str, bytes], store) -> None:
    """Mount again with the store back: everything pending becomes durable, byte for byte."""
    m.start()
    m.sync(timeout=120)
    for name, data in files.items():
        assert store.read(name) == data, f"{name} differs in the store"
        assert (m.path / name).read_bytes() == data
    assert store.multipart_uploads() == []  # what the stopped daemon left open was swept


def test_umount_with_the_store_down_gives_up_after_its_timeout_and_loses_nothing(proxy, mount_factory, store):
    m = mount_factory().start()
    proxy.add_rule(Rule(blackhole()))
    files = {"model.bin": os.urandom(20 * MiB + 3), "latest": b"step-100\n"}
    write_files(m.path, files)
    started = time.monotonic()
    done = ckptfs("umount", str(m.path), "--timeout", "4", check=False, timeout=120)
    took = time.monotonic() - started
    assert done.returncode != 0
    assert took < 4 + 15, f"umount --timeout 4 took {took:.1f} s"
    message = done.stderr.strip()
    print(
        f"\numount --timeout 4 with the store blackholed: exit {done.returncode} after {took:.1f} s: {message}"
    )
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert "gave up after 4 s" in message and "2 files" in message, message
    assert "--no-wait" in message and "resume at the next mount" in message, message
    assert "store: not answering" in message or "store: unreachable" in message or "store: ok" in message, (
        message
    )
    assert is_mounted(m.path) and m.status()["pending"]["files"] == 2  # still serving: the caller decides

    started = time.monotonic()
    pid = m.pid
    done = ckptfs("umount", str(m.path), "--no-wait", timeout=60)
    took = time.monotonic() - started
    assert took < 15, f"umount --no-wait with the store down took {took:.1f} s"
    assert gone(pid) and not is_mounted(m.path)
    assert "2 pending uploads resume" in done.stderr
    m.pid = None

    proxy.clear()
    recover(m, files, store)


def test_sigterm_with_store_calls_hanging_stops_the_daemon_within_seconds(proxy, mount_factory, store):
    m = mount_factory().start()
    rule = proxy.add_rule(Rule(blackhole()))
    files = {"a.bin": os.urandom(24 * MiB), "b.bin": os.urandom(9 * MiB), "c.txt": b"small" * 100}
    write_files(m.path, files)
    assert wait_until(lambda: rule.hits >= 3, 20), "no store call reached the blackhole"
    pid = m.pid
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert wait_until(lambda: gone(pid) and not is_mounted(m.path), 30, step=0.05)
    took = time.monotonic() - started
    m.pid = None
    print(f"\nSIGTERM with {rule.hits} store calls blackholed: daemon gone in {took:.2f} s")
    # 0.3 s on a quiet machine; 5 s leaves a loaded 2-core one room for the interpreter's exit
    # and the unmount, and is far under the 60 s a blackholed call waits before its read timeout.
    assert took < 5, f"the daemon took {took:.1f} s to stop"
    log = (m.cache_dir / "ckptfs.log").read_text()
    assert "Traceback" not in log

    proxy.clear()
    recover(m, files, store)


def test_a_full_cache_with_the_store_down_gives_enospc_within_write_timeout(proxy, mount_factory, store):
    """Through the daemon's arenas (a writer the kernel serves itself is bounded at its open:
    test_a_full_cache_sends_a_new_writer_through_the_daemon_which_waits)."""
    m = mount_factory(
        ram_cache="16MiB", cache_size="32MiB", extra=("--write-timeout", "3", "--no-passthrough-writes")
    ).start()
    proxy.add_rule(Rule(blackhole()))
    committed = {"first.bin": os.urandom(16 * MiB)}
    write_files(m.path, committed)
    chunk = os.urandom(MiB)
    fd = os.open(m.path / "second.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written, blocked_at, failure = 0, None, None
    started = time.monotonic()
    try:
        while written < 256 * MiB:
            before = time.monotonic()
            try:
                os.write(fd, chunk)
            except OSError as exc:
                failure = exc
                blocked_at = before
                break
            written += len(chunk)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    took = time.monotonic() - started
    assert failure is not None and failure.errno == errno.ENOSPC, failure
    waited = time.monotonic() - blocked_at
    print(f"\nENOSPC after {written // MiB} MiB; the blocked write waited {waited:.1f} s (write timeout 3 s)")
    assert 2.5 < took and waited < 3 + 10, (took, waited)
    assert written <= 48 * MiB  # the cache's whole budget, no more

    # The store's trouble shows once a call has gone unanswered for STALL_S (or sooner, when a
    # refresh of a listing gives up): the upload's CreateMultipartUpload went out at the close.
    def trouble() -> bool:
        return m.status()["store_health"]["state"] != "ok"

    assert wait_until(trouble, STALL_S + 10, step=0.5), m.status()["store_health"]

    proxy.clear()
    m.sync(timeout=120)
    for name, data in committed.items():
        assert store.read(name) == data
        assert (m.path / name).read_bytes() == data


def test_a_full_cache_sends_a_new_writer_through_the_daemon_which_waits(proxy, mount_factory, store):
    """Passthrough writes: with the store down, files the kernel wrote fill the disk budget; the
    next writer's open finds no room for another, so its working copy is in the arenas, where a
    write waits for room and gets ENOSPC after --write-timeout. What was committed survives."""
    m = mount_factory(ram_cache="0", cache_size="32MiB", extra=("--write-timeout", "3")).start()
    if not m.status()["passthrough"]["writes"]:
        pytest.skip("no passthrough writes here: " + m.status()["passthrough"].get("off_because", ""))
    proxy.add_rule(Rule(blackhole()))
    committed = {"first.bin": os.urandom(12 * MiB), "second.bin": os.urandom(20 * MiB)}
    write_files(m.path, committed)
    assert m.status()["passthrough"]["working_files"] == 2
    started = time.monotonic()
    with pytest.raises(OSError) as failed:
        with open(m.path / "third.bin", "wb") as f:
            for _ in range(8):
                f.write(os.urandom(MiB))
                f.flush()
    assert failed.value.errno == errno.ENOSPC
    assert 2.5 < time.monotonic() - started < 3 + 10
    assert m.status()["passthrough"]["working_files"] == 2  # (the third went through the daemon)
    proxy.clear()
    m.sync(timeout=120)
    for name, data in committed.items():
        assert store.read(name) == data


def test_creating_a_file_during_an_outage_answers_from_what_the_mount_knows(proxy, mount_factory):
    m = mount_factory(extra=("--list-ttl", "1")).start()
    (m.path / "idle").mkdir()
    (m.path / "idle" / "old.txt").write_bytes(b"old")
    m.sync(timeout=60)
    time.sleep(1.5)  # the directory's listing is due again: the next lookup in it would ask the store
    proxy.add_rule(Rule(blackhole()))
    started = time.monotonic()
    (m.path / "idle" / "new.txt").write_bytes(b"new")
    took = time.monotonic() - started
    print(f"\ncreate in an idle directory with the store blackholed: {took:.2f} s")
    # The lookup waited for the store (the listing was due), at most LOOKUP_WAIT_S (1.5 s); the
    # create, write and close that follow take milliseconds, up to a second or so on a loaded
    # 2-core machine: 1.5 s of margin.
    assert LOOKUP_WAIT_S - 0.05 <= took < LOOKUP_WAIT_S + 1.5, f"the create took {took:.2f} s"
    # Once the store is known to fail, a lookup gives it only ANSWER.failing_s (0.25 s).
    time.sleep(1.1)  # the listing is due again
    started = time.monotonic()
    (m.path / "idle" / "newer.txt").write_bytes(b"newer")
    took = time.monotonic() - started
    print(f"the next create, the store known to fail: {took:.2f} s")
    assert ANSWER.failing_s == 0.25 and took < ANSWER.failing_s + 1.25, f"the create took {took:.2f} s"
    started = time.monotonic()
    assert sorted(os.listdir(m.path / "idle")) == ["new.txt", "newer.txt", "old.txt"]
    assert (m.path / "idle" / "old.txt").read_bytes() == b"old"
    assert time.monotonic() - started < 3


def test_status_shows_store_trouble_from_the_first_failed_call(proxy, mount_factory):
    m = mount_factory().start()
    # A connection reset on every PUT: botocore retries by itself; its first failed attempt shows.
    rule = proxy.add_rule(Rule(reset_mid_body(), kind="put"))
    started = time.monotonic()
    (m.path / "reset.txt").write_bytes(b"x" * 1000)
    assert wait_until(lambda: rule.hits >= 1, 10)
    shown = wait_until(lambda: [e for e in m.status()["errors"] if e["key"] == "reset.txt"], 5)
    took = time.monotonic() - started
    assert shown, "status never showed the failed attempt"
    assert took < 5, f"status showed it after {took:.1f} s"
    st = m.status()
    assert st["store_health"]["state"] == "unreachable", st["store_health"]
    assert "PutObject" in shown[0]["message"] or "put" in shown[0]["message"], shown
    text = ckptfs("status", str(m.path)).stdout
    assert "store state:" in text and "unreachable since" in text, text
    proxy.remove_rule(rule)
    m.sync(timeout=120)
    assert wait_until(lambda: m.status()["store_health"]["state"] == "ok", 10)

    # A blackhole: no call fails before the client's read timeout, but an unanswered one shows.
    rule = proxy.add_rule(Rule(blackhole()))
    (m.path / "hang.txt").write_bytes(b"y" * 1000)
    assert wait_until(lambda: rule.hits >= 1, 10)
    first = time.monotonic()
    state = wait_until(lambda: (s := m.status()["store_health"])["state"] != "ok" and s, 25)
    # "not answering": the upload's attempt has no answer for 10 s; "unreachable": the create's
    # lookup of hang.txt went to the store first (its listing had expired) and got no answer.
    assert state and state["state"] in ("not answering", "unreachable") and "hang.txt" in state["reason"], (
        state
    )
    print(f"\nblackholed call shown as {state['state']!r} after {time.monotonic() - first:.1f} s")
    proxy.remove_rule(rule)


def _cold_reader(mount_factory, *extra: str) -> tuple[Mount, bytes]:
    """A 3 MiB file written by one mount, and a second mount with an empty cache: every read of
    it goes to the store."""
    writer = mount_factory("w").start()
    data = os.urandom(3 * MiB)
    (writer.path / "ckpt.bin").write_bytes(data)
    writer.stop()
    return mount_factory("r", extra=extra).start(), data


def _failing_read(path: Path) -> tuple[OSError, float]:
    """The error a read of ``path`` fails with, and how long it took."""
    started = time.monotonic()
    with pytest.raises(OSError) as caught:
        path.read_bytes()
    return caught.value, time.monotonic() - started


def test_a_cold_read_that_fails_shows_in_status(proxy, mount_factory):
    reader, data = _cold_reader(mount_factory)
    rule = proxy.add_rule(Rule(status(503, "ServiceUnavailable", "down for maintenance"), kind="get"))
    error, took = _failing_read(reader.path / "ckpt.bin")
    print(f"\ncold read with every GET failing: EIO after {took:.1f} s ({rule.hits} GETs)")
    assert error.errno == errno.EIO
    errors = reader.status()["errors"]
    reads = [e for e in errors if e["key"] == "ckpt.bin" and e["message"].startswith("read: EIO")]
    assert reads, errors
    assert "ServiceUnavailable" in reads[-1]["message"]
    assert reader.status()["store_health"]["state"] == "failing"
    proxy.remove_rule(rule)
    assert (reader.path / "ckpt.bin").read_bytes() == data


def test_a_cold_read_with_the_store_down_fails_within_read_timeout(proxy, mount_factory):
    """A blackholed store: the read is given up with EIO once the store has not answered for
    --read-timeout (at least the 10 s after which an unanswered call counts as trouble), not after
    the client's retries of 60 s timeouts; once the store is back the same read works."""
    reader, data = _cold_reader(mount_factory, "--read-timeout", "2")
    rule = proxy.add_rule(Rule(blackhole(), kind="get"))
    error, took = _failing_read(reader.path / "ckpt.bin")
    print(f"\ncold read with the store blackholed: EIO after {took:.1f} s")
    assert error.errno == errno.EIO
    assert took < 30
    assert any("--read-timeout" in e["message"] for e in reader.status()["errors"])
    proxy.remove_rule(rule)
    assert (reader.path / "ckpt.bin").read_bytes() == data
