"""The frameworks people save checkpoints with, end to end on a real mount over the real S3 server.

Each test saves with the framework's own API onto a ckptfs mount, runs `ckptfs sync`, checks the
objects in the bucket (boto3 listing), then loads back through a fresh mount with an empty cache
dir (every byte from the store) and compares bit for bit. Before that restart, `ckptfs checkpoints`
and `ckptfs gc` run on what the framework wrote (`checkpoints_then_gc`), so the restart also
proves the job resumes from what gc left. Tiny models, few steps: the whole file
takes about 3 minutes of wall time on 2 cores at load 8 to 12 (Swift's start included), about one
minute of CPU. The frameworks' own logging and warnings are silenced inside each test only
(`quiet`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import S3StoreView
from tests.support.harness import free_port
from tests.support.mounting import Mount, ckptfs

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(s3_server, s3_bucket):
    """These tests run on the S3 server only (overrides the local/s3 pair of conftest)."""
    return S3StoreView(s3_server, s3_bucket)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub, no telemetry, no tokenizer threads: nothing leaves the machine. The environment
    is put back afterwards (Lightning and torch set variables of their own in os.environ)."""
    saved = dict(os.environ)
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "WANDB_MODE": "disabled",
    }.items():
        monkeypatch.setenv(name, value)
    yield
    for name in os.environ.keys() - saved.keys():
        del os.environ[name]


@contextlib.contextmanager
def quiet(*loggers: str):
    """The frameworks' INFO logs and warnings silenced for one test, put back afterwards."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    try:
        for name in loggers:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


@pytest.fixture
def restart(mount_factory, store, tmp_path):
    """restart(old): a fresh mount with an empty cache dir at ``old``'s mountpoint (``old`` stopped),
    as a job restarted on another node sees it: the same paths (Lightning reloads its checkpoint
    callback's state only for the same directory) and every byte from the store. Torn down before
    mount_factory's mounts, which would otherwise find this one on their mountpoint."""
    made: list[Mount] = []

    def make(old: Mount) -> Mount:
        assert old.pid is None, "stop the old mount first"
        fresh = Mount(store.url, tmp_path / f"restart{len(made)}", endpoint_url=store.endpoint)
        fresh.path = old.path
        made.append(fresh)
        return fresh.start()

    yield make
    for m in made:
        m.cleanup()


def ckptfs_json(*args: str) -> dict:
    return json.loads(ckptfs(*args, "--json").stdout)


def checkpoints_then_gc(
    m: Mount,
    store,
    directory: str,
    restart_step: str,
    older: set[str] = frozenset(),
    others: set[str] = frozenset(),
) -> None:
    """After a framework's save and `ckptfs sync`, the admin commands as a user runs them:
    `ckptfs checkpoints` on the mount finds the series in ``directory``: its steps are
    ``restart_step`` (the restart), ``older`` and ``others`` (unnumbered: last.ckpt, DCP
    directories), each complete; on the mount, `gc --keep-last 1 --dry-run` would delete exactly
    ``older`` and deletes nothing, and `gc --keep-last 1` deletes exactly ``older``; after a sync
    the bucket has lost exactly their objects, and `checkpoints` on the store URL lists what is
    left, complete, with the same restart step. The test then resumes from what is left. (gc on
    a store URL is tests/test_admin_catalog.py's: here the mount is live, and a subprocess on the
    URL costs twice one on the mount.)"""
    url = [store.url, "--endpoint-url", store.endpoint]

    def series(found: dict) -> set[str]:
        [one] = [s for s in found["series"] if s["directory"] == directory]
        assert one["restart"] == restart_step, one
        assert all(step["complete"] for step in one["steps"]), one
        return {step["path"] for step in one["steps"]}

    assert series(ckptfs_json("checkpoints", str(m.path))) == {restart_step, *older, *others}
    before = store.keys()
    dry = ckptfs_json("gc", str(m.path), "--keep-last", "1", "--dry-run")
    assert {s["path"] for s in dry["steps"] if s["action"] == "delete"} == older, dry
    assert store.keys() == before and all((m.path / step).exists() for step in older)
    done = ckptfs_json("gc", str(m.path), "--keep-last", "1")
    assert {s["path"] for s in done["steps"] if s["action"] == "delete"} == older and not done["failures"], (
        done
    )
    assert not any((m.path / step).exists() for step in older)
    m.sync()
    gone = {k for k in before if any(k == step or k.startswith(step + "/") for step in older)}
    assert bool(gone) == bool(older)
    assert store.keys() == before - gone
    assert series(ckptfs_json("checkpoints", *url)) == {restart_step, *others}


# =============================================================================================
# torch.distributed.checkpoint: 2 ranks (gloo, CPU), save + async_save, resharded loads
# =============================================================================================


class Ranks:
    """`world` processes of tests/support/frameworks_dcp.py, as torchrun would start them: they save, say
    "saved", and load when told to. A context manager: whatever happens, none is left running."""

    def __init__(self, root: Path, logs: Path, world: int = 2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        self.logs = [logs / f"rank{rank}.err" for rank in range(world)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "w") as err:  # a file, not a pipe: a chatty rank cannot block on it
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.support.frameworks_dcp", str(root)],
                        cwd=REPO,
                        text=True,
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                    )
                )

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def wait_saved(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(self.procs):
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(
                    f"dcp rank {rank} did not save within {timeout} s:\n{self.logs[rank].read_text()[-3000:]}"
                )
            if p.stdout.readline().strip() != "saved":  # "" if it died
                self.check_exits()

    def load(self) -> None:
        for p in self.procs:
            p.stdin.write("load\n")
            p.stdin.flush()
        self.check_exits()

    def check_exits(self) -> None:
        """Wait for every rank; AssertionError with its stderr unless each exited 0."""
        for rank, p in enumerate(self.procs):
            p.communicate(timeout=180)
            assert p.returncode == 0, (
                f"dcp rank {rank} exited {p.returncode}:\n{self.logs[rank].read_text()[-3000:]}"
            )


def test_torch_distributed_checkpoint_two_ranks_save_async_save_and_resharded_load(
    store, mount_factory, restart, tmp_path
):
    import torch.distributed.checkpoint as dcp

    from tests.support.frameworks_dcp import expected

    m = mount_factory().start()
    with Ranks(m.path, tmp_path) as ranks:
        ranks.wait_saved()  # dcp.save to dcp-sync, dcp.async_save to dcp-async; Shard(0) rows
        m.sync()
        layout = {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert store.keys() == {f"{name}/{f}" for name in ("dcp-sync", "dcp-async") for f in layout}
        for name in ("dcp-sync", "dcp-async"):
            for f in layout:
                assert store.read(f"{name}/{f}") == (m.path / name / f).read_bytes()
        # Two DCP directories with no step number: the newer is the restart, gc deletes neither.
        checkpoints_then_gc(m, store, "", "dcp-async", others={"dcp-sync"})
        m.stop()

        fresh = restart(m)
        ranks.load()  # the same 2 ranks load, sharded by columns (Shard(1)): each rank checks
    assert fresh.fetched_bytes() > 0
    with quiet("torch.distributed.checkpoint"):
        for seed, name in ((1, "dcp-sync"), (2, "dcp-async")):  # one process, no process group, full tensors
            want = expected(seed)
            state = {
                "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                "step": 0,
                "extra": {"lr": 0.0, "tags": []},
            }
            dcp.load(state, checkpoint_id=fresh.path / name, no_dist=True)
            assert_same_tensors(state["model"], want["model"])
            assert state["step"] == want["step"] and state["extra"] == want["extra"]
    fresh.stop()


# =============================================================================================
# safetensors
# =============================================================================================


def test_safetensors_save_file_load_file_and_safe_open(store, mount_factory, restart):
    from safetensors import safe_open
    from safetensors.torch import load, load_file, save_file

    gen = torch.Generator().manual_seed(5)
    tensors = {
        "embed.weight": torch.randn(1024, 2560, generator=gen),  # 10 MiB: spans two 8 MiB parts
        "layer.0.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.randn(64, generator=gen).to(torch.float16),
        "positions": torch.arange(100, dtype=torch.int64),
        "mask": torch.rand(33, generator=gen) > 0.5,
    }
    metadata = {"format": "pt", "step": "1000"}
    m = mount_factory().start()
    (m.path / "step-1000").mkdir()
    save_file(tensors, m.path / "step-1000" / "model.safetensors", metadata=metadata)
    assert_same_tensors(load_file(m.path / "step-1000" / "model.safetensors"), tensors)  # warm, same mount
    m.sync()
    saved = (m.path / "step-1000" / "model.safetensors").read_bytes()
    assert store.keys() == {"step-1000/model.safetensors"}
    assert store.read("step-1000/model.safetensors") == saved
    checkpoints_then_gc(m, store, "", "step-1000")
    m.stop()

    fresh = restart(m)
    path = fresh.path / "step-1000" / "model.safetensors"
    with safe_open(path, framework="pt") as f:  # mmap of the file: reads only the ranges asked for
        assert f.metadata() == metadata
        assert set(f.keys()) == set(tensors)
        rows = f.get_slice("embed.weight")[400:500]  # bytes 4.0-5.1 MiB of the tensor, cold
        assert torch.equal(rows, tensors["embed.weight"][400:500])
        assert torch.equal(f.get_tensor("layer.0.weight"), tensors["layer.0.weight"])
    assert_same_tensors(load_file(path), tensors)
    assert_same_tensors(load(path.read_bytes()), tensors)
    assert fresh.fetched_bytes() >= len(saved)
    fresh.stop()


# =============================================================================================
# Hugging Face transformers: save_pretrained sharded; Trainer checkpoints, rotation and resume
# =============================================================================================

HF_LOGGERS = ("transformers", "accelerate", "huggingface_hub", "safetensors")


@pytest.fixture
def hf_quiet(monkeypatch):
    import transformers

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with quiet(*HF_LOGGERS):
        yield
    transformers.utils.logging.enable_progress_bar()
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state (Trainer makes an Accelerator too): start and end clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no dropout: runs repeat exactly
    return GPT2LMHeadModel(config)


def test_transformers_save_pretrained_sharded_and_from_pretrained(store, mount_factory, restart, hf_quiet):
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2()
    m = mount_factory().start()
    model.save_pretrained(m.path / "tiny-gpt2", max_shard_size="10KB")
    m.sync()
    keys = {k for k in store.keys() if k.startswith("tiny-gpt2/")}
    shards = sorted(k for k in keys if k.endswith(".safetensors"))
    assert len(shards) > 1 and f"tiny-gpt2/model-00001-of-{len(shards):05d}.safetensors" in shards
    assert {"tiny-gpt2/config.json", "tiny-gpt2/model.safetensors.index.json"} <= keys
    for key in keys:
        assert store.read(key) == (m.path / key).read_bytes()
    # A model directory is not a checkpoint series: gc, even keeping none, leaves it alone.
    done = ckptfs_json("gc", str(m.path), "--keep-last", "0")
    assert done["steps"] == [] and {k for k in store.keys() if k.startswith("tiny-gpt2/")} == keys
    m.stop()

    fresh = restart(m)
    loaded = GPT2LMHeadModel.from_pretrained(fresh.path / "tiny-gpt2")
    assert_same_tensors(loaded.state_dict(), model.state_dict())
    assert loaded.config.n_layer == 2 and loaded.config.n_embd == 16
    assert fresh.fetched_bytes() > 0
    fresh.stop()


def _trainer(output_dir: Path, max_steps: int, save: bool = True):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            CountSteps.steps += 1

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 8), generator=gen)]
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        seed=0,
        save_strategy="steps" if save else "no",
        save_steps=2,
        save_total_limit=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    return Trainer(model=_tiny_gpt2(), args=args, train_dataset=data, callbacks=[CountSteps]), CountSteps


def _checkpoint_dirs(store, prefix: str) -> set[str]:
    """The checkpoint-N names under ``prefix`` in the bucket, directory markers included."""
    listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/{prefix}/")
    names = {
        o["Key"][len(store.prefix) + len(prefix) + 2 :].split("/")[0] for o in listed.get("Contents", [])
    }
    return names - {""}  # the marker of ``prefix`` itself


def test_transformers_trainer_save_steps_rotation_and_resume(
    store, mount_factory, restart, tmp_path, hf_quiet, fresh_accelerate_state
):
    reference, _ = _trainer(tmp_path / "reference", max_steps=8, save=False)  # 8 steps without a break
    reference.train()

    m = mount_factory().start()
    first, _ = _trainer(m.path / "run", max_steps=6)  # saves at 2, 4, 6; keeps the last 2
    first.train()
    assert sorted(os.listdir(m.path / "run")) == ["checkpoint-4", "checkpoint-6"]
    m.sync()
    assert _checkpoint_dirs(store, "run") == {
        "checkpoint-4",
        "checkpoint-6",
    }  # checkpoint-2 gone from the store
    saved = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    assert {f"run/checkpoint-6/{f}" for f in saved} <= store.keys()
    checkpoints_then_gc(m, store, "run", "run/checkpoint-6", older={"run/checkpoint-4"})
    m.stop()

    fresh = restart(m)
    resumed, steps = _trainer(fresh.path / "run", max_steps=8)
    resumed.train(resume_from_checkpoint=True)  # finds checkpoint-6 (all gc left) by listing the fresh mount
    assert steps.steps == 2 and resumed.state.global_step == 8  # resumed at 6, not from scratch
    # Model, optimizer moments, scheduler, RNG and data order all came back: bit-identical to the
    # run that never stopped.
    assert_same_tensors(resumed.model.state_dict(), reference.model.state_dict())
    assert sorted(os.listdir(fresh.path / "run")) == ["checkpoint-6", "checkpoint-8"]
    fresh.sync()
    assert _checkpoint_dirs(store, "run") == {"checkpoint-6", "checkpoint-8"}
    assert fresh.fetched_bytes() > 0
    fresh.stop()


# =============================================================================================
# PyTorch Lightning: ModelCheckpoint(save_top_k, save_last) and resume with ckpt_path
# =============================================================================================

PL_LOGGERS = ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric")


def _lightning_run(max_epochs: int, dirpath: Path | None, save_last, ckpt_path: Path | None = None):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, on_epoch=True, on_step=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    class Record(Callback):
        start_epoch, batches = None, 0

        def on_train_start(self, trainer, module):
            Record.start_epoch = trainer.current_epoch

        def on_train_batch_end(self, *args):
            Record.batches += 1

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    )
    callbacks, checkpoint = [Record()], None
    if dirpath is not None:  # every epoch; keep the 2 newest (monitor the step, highest best) and last.ckpt
        checkpoint = ModelCheckpoint(
            dirpath=dirpath,
            filename="{epoch}-{step}",
            monitor="step",
            mode="max",
            save_top_k=2,
            save_last=save_last,
        )
        callbacks.append(checkpoint)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=dirpath is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Tiny()
    trainer.fit(
        model,
        torch.utils.data.DataLoader(data, batch_size=4),
        ckpt_path=str(ckpt_path) if ckpt_path else None,
    )
    return model, trainer, checkpoint, Record


def test_lightning_model_checkpoint_top_k_last_and_resume(store, mount_factory, restart):
    with quiet(*PL_LOGGERS):
        reference, *_ = _lightning_run(6, None, True)  # 6 epochs without a break
        m = mount_factory().start()
        first, trainer, checkpoint, _ = _lightning_run(4, m.path / "ckpts", True)  # 4 batches an epoch
        kept = ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]  # epochs 0 and 1 rotated out
        assert sorted(os.listdir(m.path / "ckpts")) == kept
        assert {Path(p).name for p in checkpoint.best_k_models} == set(kept[:2])
        m.sync()
        assert store.keys() == {f"ckpts/{name}" for name in kept}
        assert store.read("ckpts/last.ckpt") == (m.path / "ckpts" / "last.ckpt").read_bytes()
        # last.ckpt, saved after the newest top-k file, is what Lightning resumes from; gc keeps it
        # (no step number) and the newest numbered file.
        checkpoints_then_gc(
            m,
            store,
            "ckpts",
            "ckpts/last.ckpt",
            older={"ckpts/epoch=2-step=12.ckpt"},
            others={"ckpts/epoch=3-step=16.ckpt"},
        )
        m.stop()

        fresh = restart(m)
        saved = torch.load(fresh.path / "ckpts" / "last.ckpt", weights_only=False)
        assert saved["global_step"] == 16 and saved["epoch"] == 3
        assert_same_tensors(saved["state_dict"], first.state_dict())
        resumed, trainer, _, record = _lightning_run(
            6, fresh.path / "ckpts", True, ckpt_path=fresh.path / "ckpts" / "last.ckpt"
        )
        assert record.start_epoch == 4 and record.batches == 8 and trainer.global_step == 24
        assert_same_tensors(resumed.state_dict(), reference.state_dict())  # as if it never stopped
        fresh.sync()  # the callback's state came back with the checkpoint: it rotates the old files out
        # (epoch=2-step=12.ckpt, which gc deleted, is forgotten without an error)
        assert store.keys() == {"ckpts/epoch=4-step=20.ckpt", "ckpts/epoch=5-step=24.ckpt", "ckpts/last.ckpt"}
        fresh.stop()


def test_lightning_save_last_link(store, mount_factory, restart):
    """save_last="link" makes last.ckpt a symlink to the newest top-k file: a real link on
    ckptfs (stored as a small object holding the target, so the bytes are uploaded once), which
    reads as the newest checkpoint through this mount and a fresh one. (Where symlink() fails,
    Lightning would copy the file instead.)"""
    with quiet(*PL_LOGGERS):
        m = mount_factory().start()
        first, *_ = _lightning_run(3, m.path / "ckpts", "link")
        kept = ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
        assert sorted(os.listdir(m.path / "ckpts")) == kept
        last = m.path / "ckpts" / "last.ckpt"
        assert last.is_symlink() and os.readlink(last) == kept[1]
        assert last.read_bytes() == (m.path / "ckpts" / kept[1]).read_bytes()
        m.sync()
        assert store.keys() == {f"ckpts/{name}" for name in kept}
        assert store.read("ckpts/last.ckpt") == kept[1].encode()  # the link, not a second copy
        m.stop()
        fresh = restart(m)
        assert os.readlink(fresh.path / "ckpts" / "last.ckpt") == kept[1]
        saved = torch.load(fresh.path / "ckpts" / "last.ckpt", weights_only=False)
        assert saved["global_step"] == 12
        assert_same_tensors(saved["state_dict"], first.state_dict())
        fresh.stop()


# =============================================================================================
# accelerate: save_state / load_state, automatic checkpoint naming with a total limit
# =============================================================================================


def _accelerate_job(project_dir: Path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def test_accelerate_save_state_and_load_state(store, mount_factory, restart, fresh_accelerate_state):
    from accelerate.state import AcceleratorState, GradientState

    with quiet("accelerate"):
        m = mount_factory().start()
        accelerator, model, optimizer, scheduler = _accelerate_job(m.path / "project")
        for _ in range(3):  # a step, then save_state: checkpoint_0, _1, _2; the oldest is removed
            accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            accelerator.save_state()
        rng = torch.get_rng_state()
        assert sorted(os.listdir(m.path / "project" / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
        m.sync()
        files = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
        assert store.keys() == {f"project/checkpoints/checkpoint_{n}/{f}" for n in (1, 2) for f in files}
        checkpoints_then_gc(
            m,
            store,
            "project/checkpoints",
            "project/checkpoints/checkpoint_2",
            older={"project/checkpoints/checkpoint_1"},
        )
        m.stop()

        AcceleratorState._reset_state(True)  # a new job
        GradientState._reset_state()
        fresh = restart(m)
        accelerator, model2, optimizer2, scheduler2 = _accelerate_job(fresh.path / "project")
        torch.manual_seed(123)
        accelerator.load_state()  # the newest of project/checkpoints (checkpoint_2, all gc left), found by listing
        assert_same_tensors(model2.state_dict(), model.state_dict())
        for param, state in optimizer.state_dict()["state"].items():
            assert_same_tensors(optimizer2.state_dict()["state"][param], state)
        assert scheduler2.state_dict() == scheduler.state_dict()
        assert torch.equal(torch.get_rng_state(), rng)
        assert fresh.fetched_bytes() > 0
        fresh.stop()
