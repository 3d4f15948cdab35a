"""The command line: argument parsing, one-line errors, and the detached mount handshake."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from ckptfs.cli import common as cli_common
from ckptfs.cli import control as cli_control
from ckptfs.cli import main as cli_main
from ckptfs.cli import mount as cli_mount
from ckptfs.config import MiB, MountConfig, default_cache_dir, default_store_dir, parse_peer_addr
from ckptfs.errors import UsageError
from tests.support.harness import assert_one_line_error, run_cli

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mnt"
    d.mkdir()
    return d


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "required: COMMAND"),
        (["bogus"], "invalid choice"),
        (["mount"], "required: MOUNTPOINT"),
        (["mount", "/nonexistent/ckptfs-mnt"], "does not exist"),
        (["mount", "{empty}", "--ram-cache", "lots"], "'lots' is not a size"),
        (["mount", "{empty}", "--cache-size=-1G"], "is not a size"),
        (["mount", "s3://b", "{empty}", "--part-size", "1M"], "between 5 MiB and 5 GiB"),
        (["mount", "ftp://x", "{empty}"], "unsupported store URL 'ftp://x'"),
        (["mount", "file:///tmp/s", "{empty}", "--endpoint-url", "http://x"], "needs an s3:// store URL"),
        (["mount", "{empty}", "--upload-concurrency", "0"], "not a positive integer"),
        (["mount", "{empty}", "--list-ttl", "-1"], "not a number of seconds"),
        (["mount", "{empty}", "--log-level", "loud"], "invalid choice"),
        (["mount", "{empty}", "--umask", "0999"], "not an octal umask"),
        (["mount", "{file}"], "is not a directory"),
        (["mount", "{full}"], "is not empty"),
        (
            ["mount", "{empty}", "--peer-addr", "10.0.0.1"],
            "--peer-addr and --peer-connections need --cluster",
        ),
        (["mount", "{empty}", "--cluster", "--peer-addr", "h:99999"], "--peer-addr: bad port in 'h:99999'"),
        (["mount", "{empty}", "--cluster", "--peer-addr", "[::1]:x"], "--peer-addr: bad port"),
        (["mount", "{empty}", "--cluster", "--peer-connections", "0"], "not a positive integer"),
        (
            ["mount", "{empty}", "--cluster", "--peer-connections", "1000"],
            "--peer-connections 1000 is too many",
        ),
        (["mount", "{empty}", "--replicas", "1"], "--replicas, --failure-domain, --replica-timeout and"),
        (["mount", "{empty}", "--cluster", "--replicas", "9"], "give 0 to 8, not 9"),
        (["mount", "{empty}", "--cluster", "--replicas", "x"], "not a whole number"),
        (["mount", "{empty}", "--store-workers", "17"], "give 0 to 16, not 17"),
        (["mount", "{empty}", "--store-workers", "-1"], "give 0 to 16, not -1"),
        (["mount", "{empty}", "--cluster", "--takeover-after", "9"], "need --replicas"),
        (["mount", "{empty}", "--cluster", "--replicas", "1", "--takeover-after", "1"], "at least 4 s"),
        (
            ["mount", "{empty}", "--cluster", "--replicas", "1", "--failure-domain", "a b"],
            "--failure-domain:",
        ),
        (["sync", "{empty}", "/etc/passwd"], "is not inside the ckptfs mount"),
        (["sync", "{empty}", "--timeout", "soon"], "not a number of seconds"),
    ],
)
def test_usage_errors(args, needle, tmp_path, empty_dir):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    subst = {"{empty}": str(empty_dir), "{file}": str(tmp_path / "file"), "{full}": str(tmp_path / "full")}
    assert_one_line_error(run_cli(*[subst.get(a, a) for a in args]), 2, needle)


def test_unreachable_endpoint(empty_dir):
    done = run_cli(
        "mount",
        "s3://b",
        str(empty_dir),
        "--endpoint-url",
        "http://127.0.0.1:1",
        env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
    )
    assert_one_line_error(done, 1, "127.0.0.1:1")


@pytest.mark.parametrize("cmd", ["status", "sync", "umount"])
def test_no_mount(cmd, empty_dir):
    """A path that is not a ckptfs mount is bad input: exit 2, as a PATH outside the mount."""
    assert_one_line_error(run_cli(cmd, str(empty_dir)), 2, f"no ckptfs mount at {empty_dir}")
    assert_one_line_error(run_cli(cmd, str(empty_dir / "nope")), 2, f"no ckptfs mount at {empty_dir}/nope")


def test_options_between_positionals():
    args = cli_main.build_parser().parse_args(
        ["mount", "s3://b/p", "--part-size", "16M", "/mnt/x", "--ram-cache", "4GiB"]
    )
    assert (args.store_url, args.mountpoint, args.part_size, args.ram_cache) == (
        "s3://b/p",
        "/mnt/x",
        16 * MiB,
        4 << 30,
    )
    args = cli_main.build_parser().parse_args(["sync", "/mnt/x", "a", "--timeout", "2.5", "b"])
    assert (args.mountpoint, args.paths, args.timeout) == ("/mnt/x", ["a", "b"], 2.5)


def test_mount_config_defaults_and_round_trip(empty_dir):
    config = cli_mount.mount_config(cli_main.build_parser().parse_args(["mount", str(empty_dir)]))
    assert config.store_url == f"file://{default_store_dir()}"
    assert config.cache_dir == str(default_cache_dir(empty_dir))
    assert (config.ram_cache, config.part_size, config.log_level) == (
        MountConfig.ram_cache,
        MountConfig.part_size,
        "INFO",
    )

    config = cli_mount.mount_config(
        cli_main.build_parser().parse_args(
            [
                "mount",
                "s3://bucket/pre",
                str(empty_dir),
                "--cache-dir",
                "rel/cache",
                "--ram-cache",
                "512M",
                "--cache-size",
                "3GiB",
                "--endpoint-url",
                "http://h:9",
                "--part-size",
                "8MiB",
                "--upload-concurrency",
                "3",
                "--list-ttl",
                "0.5",
                "--write-timeout",
                "7.5",
                "--read-timeout",
                "9",
                "--log-level",
                "debug",
                "--allow-other",
                "--umask",
                "022",
                "--keep-ram-cache",
                "--metrics-port",
                "9400",
                "--metrics-addr",
                "10.0.0.5",
            ]
        )
    )
    assert config.cache_dir == os.path.abspath("rel/cache") and config.ram_cache == 512 * MiB
    assert (config.allow_other, config.umask, config.keep_ram_cache) == (True, 0o022, True)
    assert config.list_ttl == 0.5 and config.write_timeout == 7.5 and config.read_timeout == 9
    assert (config.metrics_port, config.metrics_addr) == (9400, "10.0.0.5")
    # The detached daemon must rebuild exactly this config from its command line.
    rebuilt = cli_mount.mount_config(
        cli_main.build_parser().parse_args(cli_mount.daemon_argv(config) + ["--ready-fd", "9"])
    )
    assert rebuilt == config


def test_cluster_options_round_trip(empty_dir):
    parse = cli_main.build_parser().parse_args
    config = cli_mount.mount_config(
        parse(
            ["mount", str(empty_dir), "--cluster", "--peer-addr", "10.1.2.3:7000", "--peer-connections", "5"]
        )
    )
    assert (config.cluster, config.peer_addr, config.peer_connections) == (True, "10.1.2.3:7000", 5)
    rebuilt = cli_mount.mount_config(parse(cli_mount.daemon_argv(config) + ["--ready-fd", "9"]))
    assert rebuilt == config
    plain = cli_mount.mount_config(parse(["mount", str(empty_dir)]))
    assert not plain.cluster and "--cluster" not in cli_mount.daemon_argv(plain)


def test_replica_options_round_trip(empty_dir):
    parse = cli_main.build_parser().parse_args
    argv = ["mount", str(empty_dir), "--cluster", "--replicas", "2", "--failure-domain", "rack-7"]
    config = cli_mount.mount_config(parse([*argv, "--replica-timeout", "2.5", "--takeover-after", "12"]))
    assert (config.replicas, config.failure_domain) == (2, "rack-7")
    assert (config.replica_timeout, config.takeover_after) == (2.5, 12.0)
    rebuilt = cli_mount.mount_config(parse(cli_mount.daemon_argv(config) + ["--ready-fd", "9"]))
    assert rebuilt == config
    plain = cli_mount.mount_config(parse(["mount", str(empty_dir), "--cluster"]))
    assert plain.replicas == 0 and "--replicas" not in cli_mount.daemon_argv(plain)


@pytest.mark.parametrize(
    "text, parsed",
    [("h", ("h", 0)), ("h:80", ("h", 80)), (":80", (None, 80)), ("[::1]:9", ("::1", 9)), ("", (None, 0))],
)
def test_peer_addr(text, parsed):
    assert parse_peer_addr(text) == parsed


def test_format_status_lists_the_cluster():
    text = cli_control.format_status(
        {
            "peers": {
                "node": "aaaa",
                "addr": "10.0.0.1:7000",
                "live": [{"node": "bbbb", "addr": "10.0.0.2:7000"}],
                "taken_bytes": 3 << 20,
                "served_bytes": 1 << 20,
                "store_bytes": 2 << 20,
                "mismatches": 2,
            }
        }
    )
    assert "cluster: node aaaa on 10.0.0.1:7000, 1 live peers; taken from peers 3 MiB" in text
    assert "peer bbbb at 10.0.0.2:7000" in text and "did not match (read from the store): 2" in text


def test_format_status_lists_the_replicas():
    peers = {"node": "aaaa", "addr": "h:1", "live": [], "replicas": 1, "holders": ["bbbb"]}
    peers |= {"replicated_bytes": 5 << 20, "held_for": ["cccc"], "replica_held_bytes": 8 << 20}
    text = cli_control.format_status({"peers": {**peers, "local_commits": 3, "takeovers": 1}})
    assert "replicas: 1 wanted, held by bbbb; replicated 5 MiB" in text
    assert "holding replicas of 1 node(s): 8 MiB" in text
    assert "commits that returned without their replicas: 3" in text
    assert "lost nodes taken over (their files published here): 1" in text


def test_sync_paths_are_relative(empty_dir):
    assert cli_common.relative_paths(str(empty_dir), [str(empty_dir / "a" / "b"), str(empty_dir / "c")]) == [
        "a/b",
        "c",
    ]
    assert (
        cli_common.relative_paths(str(empty_dir), [str(empty_dir / "a"), str(empty_dir)]) == []
    )  # the whole mount
    with pytest.raises(UsageError):
        cli_common.relative_paths(str(empty_dir), [str(empty_dir) + "-sibling"])


def test_read_ready():
    for written, expected in [
        (b"ok\n", "ok"),
        (b"error: no fuse\n", "error: no fuse"),
        (b"", ""),
        (b"partial", "partial"),
    ]:
        r, w = os.pipe()
        os.write(w, written)
        os.close(w)
        assert cli_mount.read_ready(r, 5) == expected
        os.close(r)
    r, w = os.pipe()
    assert cli_mount.read_ready(r, 0.2) is None  # nothing, writer still open: timeout
    os.close(r)
    os.close(w)


def test_umount_timeout_default_and_progress_lines_off_a_terminal(monkeypatch, capsys):
    assert cli_main.build_parser().parse_args(["umount", "/m"]).timeout == cli_control.UMOUNT_TIMEOUT_S
    assert cli_main.build_parser().parse_args(["umount", "/m", "--timeout", "2"]).timeout == 2
    monkeypatch.setattr(cli_common, "PROGRESS_LINE_S", 0)
    bar = cli_common.ProgressBar("drain")  # stderr is not a terminal here: lines instead of a bar
    bar(
        {
            "pending_files": 2,
            "pending_bytes": 3 * MiB,
            "total_bytes": 4 * MiB,
            "store": "unreachable since 12:00:01 (35 s): UploadPart a.bin: cannot reach http://h:9: read timeout",
        }
    )
    bar.close()
    err = capsys.readouterr().err
    assert (
        "drain: 1 MiB of 4 MiB, 2 files left; store unreachable since 12:00:01" in err
        and "read timeout" in err
    ), err


def test_format_status_tolerates_anything():
    full = {
        "mountpoint": "/mnt/c",
        "store": "s3://b/p",
        "cache_dir": "/c",
        "pid": 42,
        "uptime_s": 3725,
        "part_size": 8 * MiB,
        "ram": {"used": MiB, "budget": 1 << 30},
        "disk": {"used": 0, "budget": 16 << 30},
        "clean_bytes": 5,
        "pending": {"files": 2, "bytes": 3 * MiB},
        "uploading": {"parts_in_flight": 1, "bytes_in_flight": 8 * MiB},
        "uploaded_bytes": 10 * MiB,
        "durable_files": 7,
        "errors": [{"time": 0, "key": "a/b", "message": "503 Slow Down\nretrying"}],
        "store_health": {"state": "unreachable", "since": 0, "reason": "PutObject: cannot reach h: timeout"},
    }
    text = cli_control.format_status(full)
    for needle in [
        "store state:",
        "unreachable since",
        "PutObject: cannot reach h: timeout",
        "s3://b/p",
        "1 hour, 2 minutes and 5 seconds",
        "1 MiB of 1 GiB",
        "2 files, 3 MiB",
        "errors:",
        "a/b: 503 Slow Down retrying",
    ]:
        assert needle in text, text
    assert cli_control.format_status({}) == ""
    cli_control.format_status({"ram": None, "errors": ["x"], "pending": {}, "uptime_s": "?"})
    cli_control.format_status({"markers_waiting": [None, {"since": "?"}], "markers_dropped": ["x", {}]})


def test_format_status_prints_words_not_python_values():
    """A boolean is yes or no and a null is none, also in what a newer daemon adds: never
    Python's True, False or None."""
    text = cli_control.format_status(
        {"server_checksums": False, "a_new_flag": True, "a_new_figure": None, "durable_files": 3}
    )
    rows = dict((label, value.strip()) for label, value in (line.split(":", 1) for line in text.splitlines()))
    assert rows == {
        "server checksums": "no",
        "a new flag": "yes",
        "a new figure": "none",
        "durable files": "3",
    }


def test_format_status_says_which_markers_wait_and_which_were_dropped():
    text = cli_control.format_status(
        {
            "markers_waiting": [
                {
                    "marker": "step_2/.metadata",
                    "since": time.time() - 90,
                    "waits_for": "files under step_2/ on node 0123456789abcdef",
                }
            ],
            "markers_dropped": [
                {"marker": "step_1/.metadata", "reason": "step 2 of its series is in the store"}
            ],
        }
    )
    assert "markers waiting: 1" in text
    assert "step_2/.metadata: waits for files under step_2/ on node 0123456789abcdef; since 1 minute" in text
    assert "markers dropped: 1" in text and "step_1/.metadata: step 2 of its series is in the store" in text


# --- the detached-daemon handshake, with a stand-in for ckptfs.daemon.run ----------------------

FAKE_DAEMON = textwrap.dedent("""
    import os, sys, time, types
    mode = os.environ.get("CKPTFS_FAKE_DAEMON")
    if mode:
        def run(config, on_ready):
            from ckptfs.errors import MountError
            if mode == "ok":
                with open(os.environ["CKPTFS_FAKE_OUT"], "w") as f:
                    f.write(config.to_json())
                on_ready()
            elif mode == "fail":
                raise MountError("fuse: device not found")
            elif mode == "crash":
                os._exit(3)
            else:
                time.sleep(60)
        module = types.ModuleType("ckptfs.daemon.run")
        module.run = run
        sys.modules["ckptfs.daemon.run"] = module
""")


@pytest.fixture
def fake_daemon(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_DAEMON)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("CKPTFS_FAKE_OUT", str(tmp_path / "config.json"))

    def mount(mode: str, mountpoint: Path) -> int:
        monkeypatch.setenv("CKPTFS_FAKE_DAEMON", mode)
        return cli_main.main(
            [
                "mount",
                f"file://{tmp_path}/store",
                str(mountpoint),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--part-size",
                "16M",
            ]
        )

    return mount


def test_detached_mount_ready(fake_daemon, empty_dir, tmp_path, capsys):
    assert fake_daemon("ok", empty_dir) == 0
    config = MountConfig.from_json((tmp_path / "config.json").read_text())
    assert (config.mountpoint, config.part_size, config.foreground) == (str(empty_dir), 16 * MiB, False)
    assert config.store_url == f"file://{tmp_path}/store"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("fail", "ckptfs: fuse: device not found"),
        ("crash", "ckptfs: the daemon exited during start-up; see {log}"),
        ("hang", "ckptfs: the daemon did not finish mounting within 2 s (stopped it); see {log}"),
    ],
)
def test_detached_mount_failures(mode, needle, fake_daemon, empty_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_mount, "READY_TIMEOUT_S", 2.0)
    assert fake_daemon(mode, empty_dir) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [needle.format(log=tmp_path / "cache" / "ckptfs.log")]
