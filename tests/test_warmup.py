"""`ckptfs warmup`: real mounts, both stores. Files written through one mount are warmed on a
second mount with an empty cache (as on another node); reading them afterwards must fetch
nothing from the store (the daemon's fetched_bytes counter stays put)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.mounting import CKPTFS, ckptfs

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


def write_files(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def fetched(m) -> int:
    return m.status()["fetched_bytes"]


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: ") and needle in lines[0], done.stderr


def test_warmup_directory_then_reads_fetch_nothing(store, mount_factory):
    files = {
        "step-2/model.pt": os.urandom(20 * MiB + 12345),  # multi-part: 3 blocks, the last short
        "step-2/optim/shard-0.pt": os.urandom(18 * MiB),
        "step-2/optim/shard-1.pt": os.urandom(100_000),
        "step-2/latest": b"2",
        "step-2/empty": b"",
        "step-1/model.pt": os.urandom(MiB),  # not asked for: stays cold
    }
    writer = mount_factory().start()
    write_files(writer.path, files)
    writer.stop()  # drains: everything is in the store

    m = mount_factory().start()  # another cache dir: nothing cached
    assert fetched(m) == 0
    done = ckptfs("warmup", str(m.path / "step-2"))
    warmed = sum(len(data) for name, data in files.items() if name.startswith("step-2/"))
    assert "warmed 5 files" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert fetched(m) == warmed

    for name, data in files.items():
        if name.startswith("step-2/"):
            assert (m.path / name).read_bytes() == data
    assert fetched(m) == warmed  # every read came from the cache

    # Again: everything is cached already, nothing is fetched.
    done = ckptfs("warmup", str(m.path / "step-2"), "--json")
    result = json.loads(done.stdout)
    assert (result["files"], result["total_bytes"], result["fetched_bytes"]) == (5, warmed, 0)
    assert result["seconds"] < 5
    assert fetched(m) == warmed
    m.stop()


def test_warmup_one_file_bad_paths_and_a_cache_too_small(store, mount_factory, tmp_path):
    files = {"ckpt/a.bin": os.urandom(20 * MiB), "ckpt/b.bin": os.urandom(20 * MiB)}
    writer = mount_factory().start()
    write_files(writer.path, files)
    writer.stop()

    m = mount_factory(ram_cache="16MiB", cache_size="16MiB").start()  # four 8 MiB blocks in all
    # A path relative to the cwd, inside the mount.
    done = subprocess.run([*CKPTFS, "warmup", "ckpt/a.bin"], cwd=m.path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "warmed 1 file," in done.stderr, done.stderr
    assert fetched(m) == 20 * MiB  # b.bin stays cold
    assert (m.path / "ckpt/a.bin").read_bytes() == files["ckpt/a.bin"]
    assert fetched(m) == 20 * MiB

    one_line_error(ckptfs("warmup", str(m.path / "ckpt/nope.bin"), check=False), "no such file")
    one_line_error(ckptfs("warmup", str(tmp_path), check=False), "is not on a ckptfs mount")
    # Both files need six blocks: the cache holds four. A clear error, not a hang.
    one_line_error(ckptfs("warmup", str(m.path / "ckpt"), check=False, timeout=60), "cache holds at most")
    assert (m.path / "ckpt/a.bin").read_bytes() == files["ckpt/a.bin"]  # the mount still serves
    assert fetched(m) == 20 * MiB
    m.stop()
