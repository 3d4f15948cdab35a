"""The Python API (ckptfs.sync / state / wait_durable) on a real mount of the real S3 server
behind the fault proxy: a training loop run as its own process, the store going down under a
sync with a timeout, and the errors a script can meet."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ckptfs
from tests.support.faultproxy import Rule, blackhole
from tests.support.mounting import ckptfs as ckptfs_cli

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20


@pytest.fixture
def store(proxied_store):
    return proxied_store


@pytest.fixture
def mount(mount_factory):
    """A started mount of s3://bucket/run through the fault proxy (cleaned up with the store back)."""
    return mount_factory("m").start()


TRAINING_LOOP = textwrap.dedent("""
    import os, sys
    import ckptfs

    root = sys.argv[1]
    for step in range(1, 4):
        step_dir = os.path.join(root, f"step-{step}")
        os.makedirs(step_dir)
        with open(os.path.join(step_dir, "model.pt"), "wb") as f:  # torch.save(state, ...)
            f.write(bytes([step]) * (9 << 20))
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(f"step-{step}\\n")
        print(step, ckptfs.state(os.path.join(step_dir, "model.pt")), flush=True)
        result = ckptfs.sync(step_dir, timeout=120)  # durable before the next step
        print(step, ckptfs.state(os.path.join(step_dir, "model.pt")), result.files, result.bytes, flush=True)
    ckptfs.wait_durable(os.path.join(root, "latest"), timeout=120)
    print("latest", ckptfs.state(os.path.join(root, "latest")), flush=True)
""")


def test_a_training_loop_waits_for_each_step_to_be_durable(mount, bucket_read):
    done = subprocess.run(
        [sys.executable, "-c", TRAINING_LOOP, str(mount.path)], capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    print("\n" + done.stdout)
    for step in range(1, 4):
        assert lines[2 * step - 2] in (f"{step} pending", f"{step} durable")
        # What the sync waited for: this step's shard unless already up, and (ordered publish) the
        # pointer file committed before it, if that was still pending
        _, state, files, size = lines[2 * step - 1].split()
        assert state == "durable" and int(files) <= 2 and int(size) <= 9 * MiB + len(f"step-{step}\n"), lines
        assert bucket_read(f"step-{step}/model.pt") == bytes([step]) * (9 * MiB)
    assert lines[-1] == "latest durable"
    assert bucket_read("latest") == b"step-3\n"
    # `import ckptfs` loads none of the daemon's libraries
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ckptfs; print(sorted(m for m in "
            "('boto3', 'botocore', 'trio', 'prometheus_client') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe


def test_sync_with_the_store_down_times_out_and_loses_nothing(mount, proxy, bucket_read):
    proxy.add_rule(Rule(blackhole()))
    data = os.urandom(10 * MiB + 1)
    path = mount.path / "step-7" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    assert ckptfs.state(path) == "pending"
    started = time.monotonic()
    with pytest.raises(ckptfs.TimedOut) as caught:
        ckptfs.sync(path.parent, timeout=2)
    took = time.monotonic() - started
    assert isinstance(caught.value, TimeoutError)
    assert "timed out after 2 s" in str(caught.value) and "nothing is lost" in str(caught.value)
    assert took < 15, took
    with pytest.raises(TimeoutError):
        ckptfs.wait_durable(path, timeout=1)
    assert ckptfs.state(path) == "pending" and path.read_bytes() == data

    proxy.clear()
    result = ckptfs.sync(mount.path, timeout=120)
    assert (result.files, result.bytes) == (1, len(data))
    assert ckptfs.state(path) == "durable" and ckptfs.state(path.parent) == "durable"
    assert bucket_read("step-7/model.pt") == data


def test_wait_durable_waits_for_a_file_still_being_written(mount, bucket_read):
    path = mount.path / "async.pt"
    f = open(path, "wb")
    f.write(b"a" * MiB)
    assert ckptfs.state(path) == "writing"

    def finish() -> None:  # an async save finishing in the background
        time.sleep(1.0)
        f.write(b"b" * MiB)
        f.close()

    writer = threading.Thread(target=finish)
    writer.start()
    started = time.monotonic()
    ckptfs.wait_durable(path, timeout=120)
    took = time.monotonic() - started
    writer.join()
    assert took >= 0.9 and ckptfs.state(path) == "durable"
    assert bucket_read("async.pt") == b"a" * MiB + b"b" * MiB


def test_api_errors_are_clear(mount, tmp_path):
    outside = tmp_path / "not-a-mount"
    outside.mkdir()
    (outside / "f").write_bytes(b"x")
    for call in (ckptfs.sync, ckptfs.state, ckptfs.wait_durable):
        with pytest.raises(ckptfs.NotACkptfsMount, match="is not on a ckptfs mount"):
            call(outside / "f")
        with pytest.raises(ValueError):  # (NotACkptfsMount is a ValueError too)
            call(outside)
    with pytest.raises(FileNotFoundError):
        ckptfs.sync(mount.path / "no-such-step")
    with pytest.raises(FileNotFoundError):
        ckptfs.state(mount.path / "no-such-step")
    with pytest.raises(ValueError, match="timeout"):
        ckptfs.sync(mount.path, timeout=-1)
    assert ckptfs.mount_of(mount.path / "x" / "y") == str(mount.path)

    # The same through the command, as a user would meet them: one line, exit != 0.
    for args, message in (
        ((str(outside),), f"no ckptfs mount at {outside}"),
        ((str(mount.path), str(outside / "f")), "is not inside the ckptfs mount"),
        ((str(mount.path), str(mount.path / "no-such-step")), "no such file on the mount"),
    ):
        done = ckptfs_cli("sync", *args, check=False)
        assert done.returncode != 0 and len(done.stderr.splitlines()) == 1, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_checkpoints_errors_are_ckptfs_errors(tmp_path):
    # What a training script catches: ckptfs.CkptfsError, whatever went wrong (a store that is not
    # there is no store-module exception the API never exports).
    (tmp_path / "plain").mkdir()
    for where in (str(tmp_path / "plain"), "s3://", f"file://{tmp_path / 'no-store'}"):
        with pytest.raises(ckptfs.CkptfsError):
            ckptfs.checkpoints(where)
