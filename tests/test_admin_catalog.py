"""`ckptfs ls`, `ckptfs checkpoints` and `ckptfs gc`, end to end: real mounts on the local store
and on the real S3 server, the commands run as a user runs them (``python -m ckptfs ...``) on the
mountpoint and on the store URL, errors included."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import xxhash

from ckptfs.objects.integrity import MANIFEST_PREFIX, SWEEP_STAMP
from tests.support.faultproxy import Rule, blackhole
from tests.support.harness import assert_one_line_error
from tests.support.mounting import Mount, ckptfs

BIG = 6 << 20  # over the 5 MiB part size the mounts use: a multipart object, with a manifest


def url_args(store) -> list[str]:
    return [store.url, *(["--endpoint-url", store.endpoint] if store.endpoint else [])]


def as_json(*args: str) -> dict:
    return json.loads(ckptfs(*args, "--json").stdout)


def write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def all_keys(store) -> set[str]:
    """Every key, the reserved prefix included (store.keys() hides it)."""
    if store.endpoint is None:
        return {str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file()}
    out = set()
    for page in store.client.get_paginator("list_objects_v2").paginate(
        Bucket=store.bucket, Prefix=store.prefix + "/"
    ):
        out |= {
            o["Key"][len(store.prefix) + 1 :] for o in page.get("Contents", []) if not o["Key"].endswith("/")
        }
    return out


def manifests(store) -> set[str]:
    return {k for k in all_keys(store) if k.startswith(MANIFEST_PREFIX)}


def put_foreign(store, key: str, data: bytes) -> None:
    """An object written by another tool: no ckptfs checksum."""
    if store.endpoint is None:
        (store.root / key).parent.mkdir(parents=True, exist_ok=True)
        (store.root / key).write_bytes(data)
    else:
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}", Body=data)


# --- ls ---------------------------------------------------------------------------------------------


def test_ls_shows_sizes_states_checksums_and_hides_the_reserved_prefix(store, mount_factory):
    m = mount_factory(extra=("--part-size", "5MiB")).start()
    small, big = os.urandom(1000), os.urandom(BIG)
    write(m.path, {"small.bin": small, "run/big.bin": big})
    m.sync()
    put_foreign(store, "foreign.bin", b"from another tool")
    assert manifests(store), "a multipart upload leaves a manifest under the reserved prefix"

    want = {
        "small.bin": (len(small), f"xxh3:{xxhash.xxh3_64_hexdigest(small)}"),
        "run/big.bin": (len(big), f"xxh3:{xxhash.xxh3_64_hexdigest(big)}"),
    }
    on_mount = {f["path"]: f for f in as_json("ls", str(m.path))["files"]}
    assert set(on_mount) == set(want)  # (the foreign object is not in this mount's tree yet: listed at mount)
    for path, (size, checksum) in want.items():
        assert (on_mount[path]["bytes"], on_mount[path]["state"], on_mount[path]["checksum"]) == (
            size,
            "durable",
            checksum,
        )

    in_store = {f["path"]: f for f in as_json("ls", *url_args(store))["files"]}
    assert set(in_store) == {*want, "foreign.bin"}
    assert not any(p.startswith(".ckptfs") for p in in_store)
    for path, (size, checksum) in want.items():
        assert (in_store[path]["bytes"], in_store[path]["state"], in_store[path]["checksum"]) == (
            size,
            "durable",
            checksum,
        )
    assert in_store["foreign.bin"]["checksum"] == "unverified"

    human = ckptfs("ls", str(m.path), "run").stdout
    assert (
        "run/big.bin" in human
        and "small.bin" not in human
        and "durable" in human
        and want["run/big.bin"][1] in human
    )
    assert ckptfs("ls", str(m.path / "run")).stdout == human  # a path on the mount names the same


def test_ls_of_a_file_and_of_a_prefix_on_the_store_url(store, mount_factory):
    m = mount_factory().start()
    write(m.path, {"a/one.pt": b"1", "a/two.pt": b"22", "b/three.pt": b"333"})
    m.sync()
    assert [f["path"] for f in as_json("ls", *url_args(store), "a")["files"]] == ["a/one.pt", "a/two.pt"]
    assert [f["bytes"] for f in as_json("ls", *url_args(store), "b/three.pt")["files"]] == [3]
    assert [f["path"] for f in as_json("ls", str(m.path), str(m.path / "a" / "two.pt"))["files"]] == [
        "a/two.pt"
    ]


# --- checkpoints ----------------------------------------------------------------------------------


def dcp_save(directory: Path, n: int) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.full((64, 64), float(n)), "step": n}, checkpoint_id=str(directory))


def test_checkpoints_recognises_each_layout_on_the_mount_and_the_url(store, mount_factory):
    m = mount_factory().start()
    root = m.path
    write(
        root,
        {
            "hf/checkpoint-10/model.safetensors": b"w" * 100,
            "hf/checkpoint-10/trainer_state.json": b"{}",
            "hf/checkpoint-20/model.safetensors": b"w" * 100,  # the Trainer died before trainer_state.json
            "megatron/iter_0000100/mp_rank_00/model_optim_rng.pt": b"m" * 100,
            "megatron/iter_0000200/mp_rank_00/model_optim_rng.pt": b"m" * 100,
            "megatron/latest_checkpointed_iteration.txt": b"200",
            "megatron/iter_0000300/mp_rank_00/model_optim_rng.pt": b"m"
            * 100,  # the tracker does not name it yet
            "plain/step_1.pt": b"p",
            "plain/step_2.pt": b"pp",
        },
    )
    dcp_save(root / "dcp" / "step-1", 1)
    dcp_save(root / "dcp" / "step-2", 2)
    m.sync()  # (a .metadata never reaches the store before the shards it names)
    shard = sorted((root / "dcp" / "step-2").glob("*.distcp"))[0]
    shard.unlink()  # a shard lost since: the .metadata names a missing file
    write(root, {"lightning/epoch=0-step=50.ckpt": b"l" * 10, "lightning/epoch=1-step=100.ckpt": b"l" * 10})
    write(root, {"lightning/last.ckpt": b"l" * 10})
    m.sync()

    for args in ([str(root)], url_args(store)):
        found = as_json("checkpoints", *args)
        series = {s["directory"]: s for s in found["series"]}
        assert set(series) == {"hf", "megatron", "dcp", "plain", "lightning"}
        complete = {
            s["directory"]: {st["name"]: st["complete"] for st in s["steps"]} for s in found["series"]
        }
        restart = {d: s["restart"] for d, s in series.items()}
        assert complete["hf"] == {"checkpoint-10": True, "checkpoint-20": False}
        assert complete["megatron"] == {"iter_0000100": True, "iter_0000200": True, "iter_0000300": False}
        assert complete["dcp"] == {"step-1": True, "step-2": False}
        assert complete["plain"] == {"step_1.pt": True, "step_2.pt": True}
        assert restart == {
            "hf": "hf/checkpoint-10",
            "megatron": "megatron/iter_0000200",
            "dcp": "dcp/step-1",
            "plain": "plain/step_2.pt",
            "lightning": "lightning/last.ckpt",
        }
        dcp2 = next(st for st in series["dcp"]["steps"] if st["name"] == "step-2")
        assert shard.name in " ".join(dcp2["reasons"])
        assert series["megatron"]["pointers"][0]["names"] == "megatron/iter_0000200"
        assert {st["layout"] for st in series["lightning"]["steps"]} == {"lightning"}

    human = ckptfs("checkpoints", str(root / "dcp")).stdout
    assert "restart from: " + str(root / "dcp" / "step-1") in human and "missing file" in human

    from ckptfs.admin.catalog import checkpoints  # the Python API

    found = checkpoints(str(root / "megatron"))
    assert found.restart.location == str(root / "megatron" / "iter_0000200")
    assert [s.number for s in found.series[0].steps] == [100, 200, 300]


def test_a_step_still_uploading_is_pending_incomplete_and_kept_by_gc(s3_bucket, proxy, tmp_path):
    m = Mount(f"s3://{s3_bucket}/run", tmp_path / "m", endpoint_url=proxy.url)
    rule = None
    try:
        m.start()
        write(m.path, {"ckpt/step-1/a.pt": b"1" * 1000})
        write(m.path, {"ckpt/step-2/a.pt": b"2" * 1000})
        m.sync()
        rule = proxy.add_rule(
            Rule(blackhole(), kind=("put", "upload_part", "create_multipart", "complete_multipart"))
        )
        write(m.path, {"ckpt/step-3/a.pt": b"3" * 1000, "ckpt/step-3/b.pt": b"3" * 1000})

        files = {f["path"]: f for f in as_json("ls", str(m.path))["files"]}
        assert (
            files["ckpt/step-3/a.pt"]["state"] == "pending" and files["ckpt/step-3/a.pt"]["checksum"] == "-"
        )
        assert files["ckpt/step-1/a.pt"]["state"] == "durable"
        series = as_json("checkpoints", str(m.path))["series"][0]
        step3 = series["steps"][-1]
        assert (step3["state"], step3["complete"]) == (
            "pending",
            False,
        ) and "2 files not yet durable" in step3["reasons"]
        assert series["restart"] == "ckpt/step-2"

        done = as_json("gc", str(m.path), "--keep-last", "0")
        actions = {s["path"]: (s["action"], s["why"]) for s in done["steps"]}
        assert actions == {
            "ckpt/step-1": ("delete", ""),
            "ckpt/step-2": ("keep", "newest complete step (the restart point)"),
            "ckpt/step-3": ("keep", "still pending upload"),
        }
        assert not (m.path / "ckpt" / "step-1").exists() and (m.path / "ckpt" / "step-3" / "a.pt").exists()

        proxy.remove_rule(rule)
        rule = None
        m.sync()
        series = as_json("checkpoints", str(m.path))["series"][0]
        assert [s["name"] for s in series["steps"]] == ["step-2", "step-3"] and series[
            "restart"
        ] == "ckpt/step-3"
        keys = {
            f["path"] for f in as_json("ls", f"s3://{s3_bucket}/run", "--endpoint-url", proxy.url)["files"]
        }
        assert keys == {"ckpt/step-2/a.pt", "ckpt/step-3/a.pt", "ckpt/step-3/b.pt"}
    finally:
        if rule is not None:
            proxy.remove_rule(rule)
        m.cleanup()


# --- gc ---------------------------------------------------------------------------------------------


def test_gc_on_the_mount_and_on_the_url_keeps_what_it_must(store, mount_factory):
    m = mount_factory(extra=("--part-size", "5MiB")).start()
    files = {f"run/step-{n}/model.pt": bytes([n // 100]) * 1000 for n in (100, 200, 300, 400, 500, 600)}
    files["run/step-100/optim.pt"] = os.urandom(BIG)  # multipart: a manifest that must go with it
    files["run/latest"] = b"step-200\n"
    write(m.path, files)
    m.sync()
    before, manifests_before = store.keys(), manifests(store)
    assert len(manifests_before) == 1

    dry = ckptfs("gc", str(m.path), "--keep-last", "3", "--dry-run")
    assert "would delete" in dry.stdout and "would free" in dry.stdout and "run/step-100" in dry.stdout
    assert store.keys() == before and {p.name for p in (m.path / "run").iterdir()} >= {"step-100", "step-300"}

    done = as_json("gc", str(m.path), "--keep-last", "3")
    assert sorted(s["path"] for s in done["steps"] if s["action"] == "delete") == [
        "run/step-100",
        "run/step-300",
    ]
    assert done["freed_bytes"] == 2000 + BIG and done["deleted_files"] == 3 and not done["failures"]
    why = {s["path"]: s["why"] for s in done["steps"]}
    assert why["run/step-200"] == "named by a pointer file"
    assert sorted(p.name for p in (m.path / "run").iterdir()) == [
        "latest",
        "step-200",
        "step-400",
        "step-500",
        "step-600",
    ]
    m.sync()
    assert store.keys() == before - {
        "run/step-100/model.pt",
        "run/step-100/optim.pt",
        "run/step-300/model.pt",
    }
    assert not manifests(store), "the deleted object's manifest is gone with it"

    # On the URL: the store API directly, no mount needed.
    human = ckptfs("gc", *url_args(store), "--keep-last", "1", "--keep-every", "400")
    assert "deleted" in human.stdout and "freed 1000 bytes (1 step, 1 files)" in human.stdout
    assert {k.split("/")[1] for k in store.keys() if k.startswith("run/step")} == {
        "step-200",
        "step-400",
        "step-600",
    }


def test_gc_on_the_url_deletes_manifests_and_markers(store, mount_factory):
    m = mount_factory(extra=("--part-size", "5MiB")).start()
    write(m.path, {"step-1/big.pt": os.urandom(BIG), "step-1/sub/x.pt": b"x", "step-2/x.pt": b"x"})
    (m.path / "step-1" / "empty").mkdir()
    m.sync()
    assert len(manifests(store)) == 1
    done = as_json("gc", *url_args(store), "--keep-last", "1")
    assert [s["path"] for s in done["steps"] if s["action"] == "delete"] == ["step-1"]
    left = {k for k in all_keys(store) if not k.startswith(".ckptfs-nodes/")}  # (heartbeat of a live mount)
    left = {k for k in left if not k.startswith(".ckptfs-writers/step-2/")}  # (its records of what it keeps)
    assert left - {SWEEP_STAMP} == {"step-2/x.pt"}  # (the mount's sweep stamp stays; step-1's records go)
    listed = ckptfs("ls", *url_args(store), "step-1", check=False)
    assert_one_line_error(listed, 1, "no such file or directory in the store")


def test_gc_of_a_1000_file_step_is_quick(tmp_path):
    from ckptfs.store.local import LocalStore

    store = LocalStore.at(tmp_path / "store")
    for n in range(1000):
        store.put(f"step-1/shard-{n:04d}.pt", b"s" * 100)
    store.put("step-2/x.pt", b"x")
    started = time.monotonic()
    done = as_json("gc", f"file://{tmp_path / 'store'}", "--keep-last", "1")
    elapsed = time.monotonic() - started
    assert done["deleted_files"] == 1000 and not done["failures"]
    assert not (tmp_path / "store" / "step-1").exists()
    print(f"\ngc of a 1,000-file step on a local store: {elapsed:.1f} s")
    # 0.6 s here, the command's start included; 20 s leaves a loaded 2-core machine room.
    assert elapsed < 20, f"gc of 1,000 files took {elapsed:.1f} s"


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_errors_are_one_line_and_a_non_zero_exit(store, mount_factory, tmp_path):
    m = mount_factory().start()
    plain = tmp_path / "plain"
    plain.mkdir()
    assert_one_line_error(ckptfs("ls", str(plain), check=False), 2, "is not on a ckptfs mount")
    assert_one_line_error(
        ckptfs("checkpoints", str(tmp_path / "nope"), check=False), 2, "no such file or directory"
    )
    assert_one_line_error(ckptfs("ls", str(m.path), "/etc", check=False), 2, "is not inside the ckptfs mount")
    assert_one_line_error(ckptfs("ls", str(m.path), "../..", check=False), 2, "is outside")
    assert_one_line_error(
        ckptfs("ls", str(m.path), "missing", check=False), 1, "no such file or directory on the mount"
    )
    assert_one_line_error(ckptfs("ls", "s3://", check=False), 2, "bad bucket name")
    assert_one_line_error(ckptfs("checkpoints", "ftp://host/x", check=False), 2, "unsupported store URL")
    assert_one_line_error(ckptfs("gc", str(m.path), check=False), 2, "--keep-last")
    assert_one_line_error(
        ckptfs("gc", str(m.path), "--keep-last", "-1", check=False), 2, "not a number of steps"
    )
    assert_one_line_error(
        ckptfs("ls", str(m.path), "--endpoint-url", "http://127.0.0.1:1", check=False),
        2,
        "--endpoint-url applies to a store URL",
    )


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_another_users_mount_is_permission_denied(store, mount_factory, other_user):
    m = mount_factory().start()
    write(m.path, {"step-1/x.pt": b"x"})
    for command in (["ls"], ["checkpoints"], ["gc", "--keep-last", "0"]):
        done = other_user.ckptfs(command[0], str(m.path), *command[1:])
        assert_one_line_error(done, 1, "permission denied")
    assert (m.path / "step-1" / "x.pt").exists()


def test_a_missing_bucket_is_one_line(s3_server):
    done = ckptfs(
        "checkpoints", "s3://no-such-bucket-ckptfs-catalog", "--endpoint-url", s3_server.endpoint, check=False
    )
    assert_one_line_error(done, 1, "no-such-bucket-ckptfs-catalog")


def test_help_of_each_command():
    for command in ("ls", "checkpoints", "gc"):
        done = ckptfs(command, "--help")
        assert "STORE_URL|MOUNTPOINT" in done.stdout and "--json" in done.stdout


def test_ls_shows_the_recorded_xxh3_of_a_one_put_file_too_large_to_check_per_read(tmp_path, monkeypatch):
    from ckptfs.admin import catalog
    from ckptfs.admin.target import resolve
    from ckptfs.objects import integrity
    from ckptfs.store.local import LocalStore

    data = b"w" * 1000
    LocalStore.at(tmp_path / "store").put(
        "big.pt", data, {integrity.XXH3_META: xxhash.xxh3_64_hexdigest(data)}
    )
    monkeypatch.setattr(
        integrity, "WHOLE_FILE_CHECK_MAX", 100
    )  # reads of it go unchecked: it is recorded all the same
    [listed] = catalog.ls(resolve(f"file://{tmp_path / 'store'}"))
    assert listed.checksum == f"xxh3:{xxhash.xxh3_64_hexdigest(data)}"


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_gc_on_a_mount_never_deletes_outside_it(store, mount_factory, tmp_path):
    # gc lists from the daemon's tree, then deletes through the kernel: whatever is mounted over a
    # step since (any user may FUSE-mount on a directory of theirs) must not lead root elsewhere.
    import subprocess

    m = mount_factory().start()
    write(m.path, {"step-1/sub/victim": b"x", "step-2/x.pt": b"x"})
    m.sync()
    outside = tmp_path / "outside"
    write(outside, {"victim": b"precious"})
    cover = tmp_path / "cover"
    cover.mkdir()
    (cover / "sub").symlink_to(outside)
    subprocess.run(["mount", "--bind", str(cover), str(m.path / "step-1")], check=True)
    try:
        done = ckptfs("gc", str(m.path), "--keep-last", "1", "--json", check=False)
    finally:
        subprocess.run(["umount", str(m.path / "step-1")], check=True)
    assert (outside / "victim").read_bytes() == b"precious"
    assert (m.path / "step-1" / "sub" / "victim").exists()  # not deleted either: gc said so
    assert done.returncode == 1 and json.loads(done.stdout)["failures"], done.stdout


def test_a_file_url_naming_no_directory_is_one_line_and_creates_nothing(tmp_path):
    # Like a missing bucket (and `ls /typo`): not an empty store; and these commands only read,
    # so none of them makes the directory (as root, anywhere the URL says).
    missing = tmp_path / "typo" / "store"
    (tmp_path / "plain").write_bytes(b"x")
    for command in (["ls"], ["checkpoints"], ["gc", "--keep-last", "1"], ["verify"]):
        assert_one_line_error(
            ckptfs(command[0], f"file://{missing}", *command[1:], check=False), 1, "no such directory"
        )
        assert_one_line_error(
            ckptfs(command[0], f"file://{tmp_path / 'plain'}", *command[1:], check=False),
            1,
            "not a directory",
        )
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_verify_paths_are_relative_to_the_target_as_for_ls(store, mount_factory):
    m = mount_factory().start()
    write(m.path, {"run/step-1/x.pt": b"x", "run/step-2/y.pt": b"y"})
    m.sync()
    # (the command runs in the worktree, not on the mount: a PATH is not taken from the cwd)
    for target in (str(m.path), *url_args(store)):
        done = ckptfs("verify", target, "run/step-1", "--json", check=False)
        assert done.returncode == 0, done.stderr
        assert [f["key"] for f in json.loads(done.stdout)["files"]] == ["run/step-1/x.pt"]
    done = ckptfs("verify", str(m.path / "run"), "step-2", "--json")
    assert [f["key"] for f in json.loads(done.stdout)["files"]] == ["run/step-2/y.pt"]
    assert_one_line_error(
        ckptfs("verify", *url_args(store), "../../etc/passwd", check=False), 2, "is outside"
    )
    assert_one_line_error(ckptfs("verify", str(m.path), "../..", check=False), 2, "is outside")


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    # `ckptfs ls URL | head -1`: the reader leaving is no error to report (as for ls(1)).
    import subprocess

    from ckptfs.store.local import LocalStore
    from tests.support.mounting import CKPTFS

    store = LocalStore.at(tmp_path / "store")
    for n in range(5000):
        store.put(f"step-1/shard-{n:05d}.pt", b"s")
    done = subprocess.run(
        f"{' '.join(CKPTFS)} ls file://{tmp_path / 'store'} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("STATE") and done.stderr == "", done.stderr
