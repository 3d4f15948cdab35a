"""`ckptfs status` figures, `status --watch`, `sync --json` and the Prometheus endpoint
(`mount --metrics-port`), end to end: real mounts of the real S3 server behind the fault proxy,
the CLI driven as a user would, the endpoint scraped over HTTP and parsed with Prometheus's own
text parser."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptfs.daemon.metrics import REQUEST_TIMEOUT_S
from tests.support.faultproxy import Rule, blackhole, status
from tests.support.harness import wait_until
from tests.support.mounting import CKPTFS, Mount, ckptfs, is_mounted

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(240)]

MiB = 1 << 20


METRICS = ("--metrics-port", "0")  # serve metrics on a free port


@pytest.fixture
def store(proxied_store):
    """s3://bucket/run through the fault proxy (mount_factory's mounts use it)."""
    return proxied_store


class Scrape:
    """One scrape of the endpoint, parsed: value(name, **labels) of a sample."""

    def __init__(self, url: str):
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
            self.text = answer.read().decode()
        self.samples = {}
        self.families = {}
        for family in text_string_to_metric_families(self.text):
            self.families[family.name] = family
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]


def metrics_url(m: Mount) -> str:
    url = m.status()["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url
    return url


def test_metrics_endpoint_counts_what_the_mount_did(mount_factory, proxy, store):
    m = mount_factory(extra=METRICS).start()
    url = metrics_url(m)
    files = {
        "step-100/model.pt": os.urandom(20 * MiB + 3),
        "step-100/optim.pt": os.urandom(9 * MiB),
        "latest": b"step-100\n",
    }
    (m.path / "step-100").mkdir()
    # The small file's PUT fails more often than botocore tries: the uploader retries it.
    slow_down = proxy.add_rule(Rule(status(503, "SlowDown"), kind="put", path=r"/latest$", count=5))
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    done = ckptfs("sync", str(m.path), "--json", timeout=120)
    result = json.loads(done.stdout)
    assert set(result) == {"files", "bytes", "seconds", "durable_up_to"}, result
    assert result["files"] <= 3 and result["bytes"] <= sum(map(len, files.values()))

    s = Scrape(url)
    total = sum(len(d) for d in files.values())
    assert s.value("ckptfs_written_bytes_total") == total
    assert s.value("ckptfs_committed_bytes_total") == total
    assert s.value("ckptfs_uploaded_bytes_total") >= total
    assert s.value("ckptfs_durable_files_total") == 3
    assert s.value("ckptfs_pending_files") == 0 and s.value("ckptfs_pending_bytes") == 0
    assert s.value("ckptfs_training_at_risk_seconds") == 0
    assert s.value("ckptfs_oldest_pending_seconds") == 0
    assert s.value("ckptfs_cache_budget_bytes", tier="ram") == 256 * MiB
    assert s.value("ckptfs_cache_budget_bytes", tier="disk") == 2048 * MiB
    # (the files were written by the kernel into files of the disk tier: passthrough writes)
    assert s.value("ckptfs_cache_used_bytes", tier="ram") <= 256 * MiB
    assert 0 < s.value("ckptfs_cache_used_bytes", tier="ram") + s.value(
        "ckptfs_cache_used_bytes", tier="disk"
    )
    assert s.value("ckptfs_save_stall_seconds_count") == 3  # one per file written, open to close
    assert s.value("ckptfs_save_stall_seconds_bucket", le="+Inf") == 3
    # 20 MiB in 8 MiB parts: create, 3 parts, manifest, complete; the 9 MiB file likewise; a put; retries
    assert s.value("ckptfs_upload_request_seconds_count") >= 10
    assert slow_down.hits == 5
    assert s.value("ckptfs_retries_total", op="upload") >= 1
    assert s.value("ckptfs_errors_total", kind="server") >= 3
    assert s.value("ckptfs_store_up") == 1
    assert s.families["ckptfs_upload_request_seconds"].type == "histogram"
    assert s.families["ckptfs_written_bytes"].type == "counter"
    for name, data in files.items():
        assert store.read(name) == data
    # Every series the Grafana dashboard queries is one the endpoint serves.
    dashboard = (Path(__file__).resolve().parent.parent / "docs" / "grafana-ckptfs.json").read_text()
    queried = set(re.findall(r"ckptfs_[a-z_]+", dashboard)) - {"ckptfs"}
    served = {name for name, _ in s.samples}
    assert queried and queried <= served, queried - served

    st = json.loads(
        ckptfs("status", str(m.path), "--json").stdout
    )  # the CLI's JSON: what Mount.status() reads
    assert st.keys() == m.status().keys()
    assert st["latest_checkpoint"] == "step-100/" and st["retries"]["upload"] >= 1
    assert any(e["key"] == "latest" and "503" in e["message"] for e in st["errors"]), st["errors"]
    text = ckptfs("status", str(m.path)).stdout
    print("\n" + text)
    for line in (
        "latest checkpoint:",
        "training at risk:",
        "oldest pending:",
        "upload rate:",
        "retries:",
        "metrics:",
        "SlowDown",
    ):
        assert line in text, line

    # Another mount with an empty cache reads it back: fetched bytes and GET latencies.
    reader = mount_factory("reader", extra=METRICS).start()
    assert (reader.path / "step-100" / "model.pt").read_bytes() == files["step-100/model.pt"]
    r = Scrape(metrics_url(reader))
    assert r.value("ckptfs_fetched_bytes_total") >= len(files["step-100/model.pt"])
    assert r.value("ckptfs_fetch_request_seconds_count") >= 3
    assert r.value("ckptfs_written_bytes_total") == 0


def test_training_at_risk_rises_while_uploads_are_blocked_and_falls_after(mount_factory, proxy, store):
    m = mount_factory(extra=METRICS).start()
    url = metrics_url(m)
    (m.path / "step-1").mkdir()
    (m.path / "step-1" / "model.pt").write_bytes(os.urandom(MiB))
    m.sync(timeout=60)
    assert Scrape(url).value("ckptfs_training_at_risk_seconds") == 0

    rule = proxy.add_rule(Rule(blackhole()))
    data = os.urandom(12 * MiB)
    (m.path / "step-2").mkdir()
    (m.path / "step-2" / "model.pt").write_bytes(data)
    first = Scrape(url)
    time.sleep(1.5)
    second = Scrape(url)
    risk1, risk2 = (s.value("ckptfs_training_at_risk_seconds") for s in (first, second))
    print(f"\ntraining at risk with uploads blackholed: {risk1:.2f} s, then {risk2:.2f} s")
    assert 0 < risk1 < risk2 and risk2 - risk1 >= 1.0
    assert second.value("ckptfs_pending_files") >= 1
    assert second.value("ckptfs_oldest_pending_seconds") > 0
    st = m.status()
    assert st["training_at_risk_s"] > 0 and st["oldest_pending_s"] > 0 and st["pending"]["files"] >= 1

    # A sync that times out: exit 1, one line, nothing on stdout, nothing lost.
    started = time.monotonic()
    done = ckptfs("sync", str(m.path), "--timeout", "2", "--json", check=False, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout)
    assert done.stderr.startswith("ckptfs: timed out after 2 s") and len(done.stderr.splitlines()) == 1, (
        done.stderr
    )
    assert "nothing is lost" in done.stderr and time.monotonic() - started < 20
    # The store stops answering: store_up falls to 0 once an attempt is unanswered for 10 s.
    assert wait_until(lambda: Scrape(url).value("ckptfs_store_up") == 0, 40), "store_up stayed 1"
    assert rule.hits >= 1

    # The sync starts while the upload is still held, so the file becomes durable during it.
    sync = subprocess.Popen([*CKPTFS, "sync", str(m.path), "--json"], stdout=subprocess.PIPE, text=True)
    assert wait_until(lambda: _has_socket(sync.pid), 30), "the sync never connected to the daemon"
    proxy.clear()
    result = json.loads(sync.communicate(timeout=180)[0])
    assert sync.returncode == 0
    assert result["files"] == 1 and result["bytes"] == len(data), result
    after = Scrape(url)
    assert after.value("ckptfs_training_at_risk_seconds") == 0 and after.value("ckptfs_pending_files") == 0
    assert store.read("step-2/model.pt") == data
    assert m.status()["training_at_risk_s"] == 0


def _ctrl_c_as_on_a_terminal() -> None:
    """A suite started in the background (`scripts/test &`) hands its children SIGINT ignored,
    and a command that starts so keeps ignoring it (Python then installs no KeyboardInterrupt):
    the child gets SIGINT as a terminal's Ctrl-C would deliver it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_redraws_in_place_on_a_terminal_and_streams_json_otherwise(mount_factory):
    m = mount_factory().start()
    (m.path / "a.bin").write_bytes(b"x" * 1000)
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [*CKPTFS, "status", str(m.path), "--watch", "0.3"],
        stdin=sub,
        stdout=sub,
        stderr=sub,
        close_fds=True,
        preexec_fn=_ctrl_c_as_on_a_terminal,
    )
    os.close(sub)
    out = b""
    deadline = time.monotonic() + 20
    while out.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
        if select.select([main], [], [], 0.5)[0]:
            try:
                out += os.read(main, 65536)
            except OSError:
                break
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0  # Ctrl-C ends it cleanly
    os.close(main)
    text = out.decode(errors="replace")
    assert text.count("\x1b[H\x1b[2J") >= 3, text[-2000:]  # cursor home + clear, each refresh
    assert "training at risk:" in text and "Ctrl-C to quit" in text and "Traceback" not in text

    # Not on a terminal, with --json: one object per line, no escape codes.
    proc = subprocess.Popen(
        [*CKPTFS, "status", str(m.path), "--json", "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_on_a_terminal,
    )
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0
    proc.stdout.close()
    proc.stderr.close()
    assert [json.loads(line)["pid"] for line in lines] == [m.pid] * 3
    assert not any("\x1b" in line for line in lines)


def test_a_metrics_port_taken_fails_the_mount_with_one_line(mount_factory):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        m = mount_factory(extra=("--metrics-port", str(port)))
        done = ckptfs("mount", *m.args(), check=False, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 1, done
    assert done.stderr.strip() == (
        f"ckptfs: cannot serve metrics on 127.0.0.1:{port} "
        "(--metrics-addr/--metrics-port): Address already in use"
    ), done.stderr
    assert not is_mounted(m.path)

    for args, message in (
        (("--metrics-port", "70000"), "is not a TCP port"),
        (("--metrics-addr", "0.0.0.0"), "--metrics-addr needs --metrics-port"),
    ):
        done = ckptfs("mount", "file:///nonexistent", str(m.path), *args, check=False)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, (
            done.stderr
        )


def test_a_silent_scraper_holds_the_endpoint_only_for_its_request_timeout(mount_factory):
    m = mount_factory(extra=METRICS).start()
    url = metrics_url(m)
    host, port = url[len("http://") :].split("/")[0].split(":")
    silent = socket.create_connection((host, int(port)))  # connects, never sends a request
    try:
        started = time.monotonic()
        Scrape(url)  # answered once the silent one times out (one server thread)
        took = time.monotonic() - started
    finally:
        silent.close()
    print(f"\na scrape behind a silent client: {took:.1f} s")
    # Held: the one server thread waited for the silent client's request until its timeout (5 s;
    # a server that did not block would answer at once); then released: the scrape's own answer
    # takes milliseconds, 3 s of margin for a loaded 2-core machine.
    assert REQUEST_TIMEOUT_S == 5.0
    assert REQUEST_TIMEOUT_S - 0.5 <= took < REQUEST_TIMEOUT_S + 3, f"the scrape took {took:.1f} s"


def _has_socket(pid: int) -> bool:
    """Whether process ``pid`` holds a socket (the CLI's connection to the daemon's control socket)."""
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False
