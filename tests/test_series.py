"""Unit tests of checkpoint series recognition and retention (ckptfs/series.py) and of reading
DCP .metadata without torch (ckptfs/cluster/dcpmeta.py): pure, on lists of files."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.admin.series import Entry, analyse, plan_gc
from ckptfs.cluster import dcpmeta

pytestmark = pytest.mark.unit


def files(*paths: str, state: str = "durable", size: int = 10, contents: dict | None = None):
    return [Entry(p, size, float(i), state) for i, p in enumerate(paths)]


def reader(contents: dict[str, bytes]):
    def read(path: str, limit: int) -> bytes:
        if path not in contents:
            raise FileNotFoundError(2, "No such file", path)
        return contents[path][:limit]

    return read


def one_series(entries, contents=None):
    found = analyse(entries, reader(contents or {}))
    assert len(found) == 1, [s.directory for s in found]
    return found[0]


def by_name(series):
    return {s.name: s for s in series.steps}


@pytest.fixture(scope="module")
def dcp_metadata(tmp_path_factory) -> tuple[bytes, set[str]]:
    """A real torch.distributed.checkpoint .metadata (single process, no process group)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    where = tmp_path_factory.mktemp("dcp")
    dcp.save({"w": torch.ones(4, 4), "step": 7, "opt": {"lr": 0.1}}, checkpoint_id=str(where))
    shards = {p.name for p in where.iterdir() if p.name.endswith(".distcp")}
    return (where / ".metadata").read_bytes(), shards


def test_step_directories_and_files_with_numbers_sort_numerically():
    s = one_series(files("step-9/a.pt", "step-10/a.pt", "step_11/a.pt", "step12.pt", "notes.txt"))
    assert [st.number for st in s.steps] == [9, 10, 11, 12]
    assert by_name(s)["step12.pt"].is_file and s.layout == "step"
    assert [st.name for st in s.steps if st.restart] == ["step12.pt"]
    assert all(st.complete for st in s.steps)


def test_hf_trainer_step_without_trainer_state_is_incomplete():
    s = one_series(
        files(
            "checkpoint-500/model.safetensors",
            "checkpoint-500/trainer_state.json",
            "checkpoint-1000/model.safetensors",
            "tmp-checkpoint-1500/model.safetensors",
        )
    )
    steps = by_name(s)
    assert set(steps) == {"checkpoint-500", "checkpoint-1000"}  # a tmp- directory is a save in progress
    assert steps["checkpoint-500"].complete and steps["checkpoint-500"].restart
    assert not steps["checkpoint-1000"].complete
    assert "trainer_state.json" in steps["checkpoint-1000"].reasons[0]
    assert s.layout == "hf-trainer"


ACCELERATE_FILES = (
    "model.safetensors",
    "optimizer.bin",
    "scheduler.bin",
    "random_states_0.pkl",
)  # its write order


def test_accelerate_save_state_cut_short_is_incomplete_and_gc_keeps_the_last_whole_one():
    """accelerate's save_state (automatic_checkpoint_naming, total_limit=2), the names
    tests/test_frameworks.py sees it write: it removes checkpoint_1 before writing checkpoint_3,
    and a job killed after optimizer.bin leaves checkpoint_3 with no RNG state. Every file is
    durable, but a restart from it fails: checkpoint_2 is the restart step and gc keeps it."""
    whole = [f"project/checkpoints/checkpoint_2/{f}" for f in ACCELERATE_FILES]
    cut = [f"project/checkpoints/checkpoint_3/{f}" for f in ACCELERATE_FILES[:2]]
    s = one_series(files(*whole, *cut))
    steps = by_name(s)
    assert steps["checkpoint_2"].complete and steps["checkpoint_2"].restart
    assert not steps["checkpoint_3"].complete and "random_states" in steps["checkpoint_3"].reasons[0]
    plan = _plan(files(*whole, *cut), keep_last=1)
    assert plan["checkpoint_2"] == (False, "newest complete step (the restart point)")
    assert plan["checkpoint_3"] == (False, "among the newest 1")
    whole3 = [f"project/checkpoints/checkpoint_3/{f}" for f in ACCELERATE_FILES]
    assert one_series(files(*whole, *whole3)).restart.name == "checkpoint_3"
    # Without accelerate's RNG state in any step, a step is whatever files it holds.
    assert one_series(files("checkpoint_2/model.pt", "checkpoint_3/model.pt")).restart.name == "checkpoint_3"


def test_megatron_tracker_names_the_step_and_newer_ones_are_incomplete():
    entries = files(
        "iter_0000100/mp_rank_00/model_optim_rng.pt",
        "iter_0000200/mp_rank_00/model_optim_rng.pt",
        "iter_0000300/mp_rank_00/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    )
    s = one_series(entries, {"latest_checkpointed_iteration.txt": b"200\n"})
    steps = by_name(s)
    assert steps["iter_0000200"].pointed and steps["iter_0000200"].restart
    assert steps["iter_0000100"].complete
    assert not steps["iter_0000300"].complete and "newer than" in steps["iter_0000300"].reasons[0]
    assert s.pointers[0].names == "iter_0000200"


def test_deepspeed_latest_names_a_tag():
    s = one_series(
        files(
            "global_step10/mp_rank_00_model_states.pt", "global_step20/mp_rank_00_model_states.pt", "latest"
        ),
        {"latest": b"global_step10"},
    )
    assert by_name(s)["global_step10"].pointed and s.restart.name == "global_step10"
    assert not by_name(s)["global_step20"].complete


def test_a_pointer_naming_nothing_names_nothing():
    s = one_series(files("step-1/a", "latest"), {"latest": b"step-99"})
    assert s.pointers[0].names is None and s.restart.name == "step-1"


def test_lightning_files_and_last_ckpt():
    entries = [
        Entry("epoch=0-step=100.ckpt", 5, 1.0),
        Entry("epoch=1-step=200.ckpt", 5, 2.0),
        Entry("epoch=1-step=200-v1.ckpt", 5, 2.5),
        Entry("last.ckpt", 5, 3.0),
    ]
    s = one_series(entries)
    assert [st.number for st in s.steps] == [100, 200, 200, None]
    assert s.layout == "lightning"
    assert s.restart.name == "last.ckpt"  # complete and newer than the newest numbered step
    entries[-1] = Entry("last.ckpt", 5, 0.5)
    assert one_series(entries).restart.name == "epoch=1-step=200-v1.ckpt"


def test_dcp_step_complete_and_with_a_missing_shard(dcp_metadata):
    raw, shards = dcp_metadata
    shard = sorted(shards)[0]
    entries = files("step-1/.metadata", f"step-1/{shard}", "step-2/.metadata")
    s = one_series(entries, {"step-1/.metadata": raw, "step-2/.metadata": raw})
    steps = by_name(s)
    assert steps["step-1"].complete
    assert (
        not steps["step-2"].complete
        and "missing file" in steps["step-2"].reasons[0]
        and shard in steps["step-2"].reasons[0]
    )
    assert s.restart.name == "step-1"


def test_dcp_shards_without_metadata_and_unreadable_metadata():
    s = one_series(
        files("step-1/__0_0.distcp", "step-2/.metadata", "step-2/__0_0.distcp"),
        {"step-2/.metadata": b"not a pickle"},
    )
    steps = by_name(s)
    assert "no DCP .metadata" in steps["step-1"].reasons[0]
    assert "not a readable DCP .metadata" in steps["step-2"].reasons[0]
    assert s.restart is None


def test_unnumbered_dcp_directory_and_nested_dcp_dirs_in_a_step(dcp_metadata):
    raw, shards = dcp_metadata
    shard = sorted(shards)[0]
    found = analyse(
        files(
            "ckpt/final/.metadata",
            f"ckpt/final/{shard}",
            "checkpoint-5/pytorch_model_fsdp_0/.metadata",
            "checkpoint-5/trainer_state.json",
        ),
        reader({"ckpt/final/.metadata": raw, "checkpoint-5/pytorch_model_fsdp_0/.metadata": raw}),
    )
    by_dir = {s.directory: s for s in found}
    final = by_dir["ckpt"].steps[0]
    assert final.layout == "dcp" and final.number is None and final.complete and final.restart
    hf = by_dir[""].steps[0]
    assert not hf.complete and "in pytorch_model_fsdp_0/" in hf.reasons[0]


def test_pending_files_make_a_step_pending_and_incomplete():
    entries = files("step-1/a", "step-1/b") + files("step-2/a", state="pending") + files("step-2/b")
    s = one_series(entries)
    step2 = by_name(s)["step-2"]
    assert step2.state == "pending" and not step2.complete and "1 file not yet durable" in step2.reasons
    assert s.restart.name == "step-1"


def test_shard_index_naming_a_missing_shard():
    index = json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    ).encode()
    s = one_series(
        files("checkpoint-1/model.safetensors.index.json", "checkpoint-1/model-00001-of-00002.safetensors"),
        {"checkpoint-1/model.safetensors.index.json": index},
    )
    assert "names 1 missing shard" in s.steps[0].reasons[0]


def test_shards_of_a_sharded_save_without_their_index_are_incomplete():
    # (a sharded save_pretrained writes the index last; a node lost before it leaves the shards)
    s = one_series(
        files(
            "step-1/model-00001-of-00002.safetensors",
            "step-1/model-00002-of-00002.safetensors",
            "step-1/model.safetensors.index.json",
            "step-2/model-00001-of-00002.safetensors",
            "step-2/model-00002-of-00002.safetensors",
        ),
        {
            "step-1/model.safetensors.index.json": json.dumps(
                {
                    "weight_map": {
                        "a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors",
                    }
                }
            ).encode()
        },
    )
    steps = by_name(s)
    assert steps["step-1"].complete
    assert not steps["step-2"].complete and "without their" in steps["step-2"].reasons[0]
    assert s.restart is steps["step-1"]


def test_series_per_directory_and_steps_nested_in_a_step_belong_to_it():
    found = analyse(
        files(
            "a/step-1/x", "a/step-2/x", "b/checkpoint-3/global_step3/x", "b/checkpoint-3/trainer_state.json"
        ),
        reader({}),
    )
    assert [(s.directory, [st.name for st in s.steps]) for s in found] == [
        ("a", ["step-1", "step-2"]),
        ("b", ["checkpoint-3"]),
    ]


def test_nothing_that_looks_like_a_step_is_no_series():
    assert analyse(files("model.pt", "data/shard-00001.bin", "stepper/x", "step-/x"), reader({})) == []


# --- retention ---------------------------------------------------------------------------------


def _plan(entries, contents=None, **kw):
    found = analyse(entries, reader(contents or {}))
    return {d.step.name: (d.delete, d.why) for d in plan_gc(found, **kw)}


def test_gc_keeps_the_newest_n_and_every_kth():
    plan = _plan(files(*(f"step-{n}/x" for n in (100, 200, 300, 400, 500, 600))), keep_last=2, keep_every=300)
    assert {n for n, (delete, _) in plan.items() if delete} == {"step-100", "step-200", "step-400"}
    assert "multiple of 300" in plan["step-300"][1] and plan["step-600"][1]


def test_gc_never_deletes_pending_pointed_or_the_restart_step():
    entries = (
        files("step-1/x", "step-2/x", "latest")
        + files("step-3/x")
        + files("step-4/x", state="pending")
        + files("step-5/x", state="writing")
    )
    plan = _plan(entries, {"latest": b"step-2"}, keep_last=0)
    assert plan["step-1"] == (True, "")
    assert plan["step-2"][1] == "named by a pointer file"
    assert plan["step-3"] == (True, "")  # newer than what the pointer names: incomplete, not protected
    assert plan["step-4"][1] == plan["step-5"][1] == "still pending upload"
    plan = _plan(files("step-1/x", "step-2/x") + files("step-3/x", state="pending"), keep_last=0)
    assert plan["step-2"][1].startswith("newest complete") and plan["step-1"][0]


def test_gc_pattern_limits_what_is_considered():
    entries = files("a/step-1/x", "a/step-2/x", "a/step-3/x", "b/step-1/x", "b/step-2/x")
    found = analyse(entries, reader({}))
    decisions = {d.step.path: d for d in plan_gc(found, keep_last=1, pattern="a/*")}
    assert [p for p, d in decisions.items() if d.delete] == ["a/step-1", "a/step-2"]
    assert decisions["b/step-1"].why == "not matched by --pattern"
    decisions = {d.step.path: d for d in plan_gc(found, keep_last=1, pattern="step-1")}  # a name glob
    assert [p for p, d in decisions.items() if d.delete] == []  # step-1 is the newest of the matched ones


def test_gc_never_collects_unnumbered_steps():
    plan = _plan(
        [
            Entry("epoch=0-step=1.ckpt", 1, 1.0),
            Entry("epoch=0-step=2.ckpt", 1, 2.0),
            Entry("last.ckpt", 1, 3.0),
        ],
        keep_last=0,
    )
    assert plan["last.ckpt"][0] is False and plan["epoch=0-step=1.ckpt"][0] and plan["epoch=0-step=2.ckpt"][0]


# --- DCP metadata, safely ------------------------------------------------------------------------


def test_dcp_metadata_names_its_shards(dcp_metadata, tmp_path):
    raw, shards = dcp_metadata
    assert dcpmeta.referenced_files(raw) == shards
    # Without importing torch: this process has it (the fixture made the metadata), so the
    # reader runs in a fresh interpreter, which must name the same shards with torch unloaded.
    (tmp_path / ".metadata").write_bytes(raw)
    code = (
        "import json, sys\n"
        "from ckptfs.cluster import dcpmeta\n"
        "names = dcpmeta.referenced_files(open(sys.argv[1], 'rb').read())\n"
        "print(json.dumps([sorted(names), sorted(m for m in sys.modules if m.split('.')[0] == 'torch')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / ".metadata")],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    names, torch_modules = json.loads(done.stdout)
    assert set(names) == shards and torch_modules == []


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ckptfs-dcpmeta-pwned",))


def test_a_hostile_metadata_runs_nothing(tmp_path):
    marker = Path("/tmp/ckptfs-dcpmeta-pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(dcpmeta.MetadataError):
        dcpmeta.referenced_files(pickle.dumps({"storage_data": _Evil()}))
    assert not marker.exists()
    with pytest.raises(dcpmeta.MetadataError):
        dcpmeta.referenced_files(b"\x80\x05garbage")


class _StorageInfo:
    def __init__(self):
        self.relative_path = "__0_0.distcp"


@pytest.mark.timeout(60)
def test_a_metadata_of_shared_references_is_read_in_linear_time():
    # Each level holds the one below twice: 2**60 paths through 60 objects. A walk that does
    # not remember what it has seen would never finish (gc and checkpoints would hang).
    node = [_StorageInfo()]
    for _ in range(60):
        node = [node, node]
    assert dcpmeta.referenced_files(pickle.dumps({"storage_data": node})) == {"__0_0.distcp"}


def test_a_metadata_whose_state_is_not_a_mapping_is_a_metadata_error():
    # BUILD with a (dict, slots) pair whose parts are lists: unreadable metadata, not a traceback.
    raw = (
        b"\x80\x04c__main__\nX\n)\x81"  # GLOBAL __main__.X, empty tuple, NEWOBJ
        b"]X\x01\x00\x00\x00a\x94a]X\x01\x00\x00\x00b\x94a\x86b."  # ([a], [b]) BUILD
    )
    with pytest.raises(dcpmeta.MetadataError):
        dcpmeta.referenced_files(raw)
