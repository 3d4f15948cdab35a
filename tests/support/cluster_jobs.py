"""One rank of a multi-node checkpoint job, for tests/test_nodes.py: each rank runs on its own
node and writes through that node's mount (ROOT), as a job spread over several machines does.

    python -m tests.support.cluster_jobs JOB ROOT STEP

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment, as torchrun sets them
(LOCAL_RANK 0: one rank per node). Each job prints "saved STEP" once its save returned on every
rank (after the framework's own barrier), then waits for a line on stdin: "next STEP" saves
again, anything else ends it. Jobs:

- ``dcp``: ``torch.distributed.checkpoint.save`` of a row-sharded DTensor into ROOT/step_STEP:
  each rank writes its ``__R_0.distcp``, rank 0 the ``.metadata`` (on its own node);
- ``megatron``: each rank ``torch.save``s ROOT/iter_STEP(7 digits)/mp_rank_0R/model_optim_rng.pt,
  a barrier, then rank 0 writes ROOT/latest_checkpointed_iteration.txt;
- ``latest``: rank 1 writes the step's files (ROOT/step_STEP/model.pt, optim.pt), a barrier,
  then rank 0, on another node, writes ROOT/latest naming it;
- ``pretrained``: rank 0 saves a tiny GPT-2 with ``save_pretrained`` (sharded) to a staging
  directory; rank 1 puts its shards and config into ROOT/step_STEP; a barrier; rank 0 puts the
  index there (a node other than the shards' writes the file that names them);
- ``trainer``: HF ``Trainer`` in DDP over gloo, ``save_steps=2``, output ROOT/run on each rank's
  node (rank 0 writes the model, optimizer and ``trainer_state.json``; rank 1 its
  ``rng_state_1.pth``); STEP is ignored, "next" trains two more steps;
- ``dcp-load`` (one process, no RANK): loads ROOT/step_STEP whole and checks its bytes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist


def state(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return {"weight": torch.randn(256, 64, generator=gen), "step": step, "rank": rank}


def dcp_save(root: str, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = state(step, 0)["weight"]
    dcp.save(
        {"model": {"weight": distribute_tensor(full, mesh, [Shard(0)])}, "step": step},
        checkpoint_id=os.path.join(root, f"step_{step}"),
    )


def megatron_save(root: str, step: int) -> None:
    rank = dist.get_rank()
    where = os.path.join(root, f"iter_{step:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(where, exist_ok=True)
    torch.save(state(step, rank), os.path.join(where, "model_optim_rng.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(step))


def latest_save(root: str, step: int) -> None:
    name = f"step_{step}"
    if dist.get_rank() == 1:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        torch.save(state(step, 1), os.path.join(root, name, "model.pt"))
        torch.save({"lr": 1e-3, "step": step}, os.path.join(root, name, "optim.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(name + "\n")


def pretrained_save(root: str, step: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    target = os.path.join(root, f"step_{step}")
    staging = os.path.join(tempfile.gettempdir(), f"ckptfs-pretrained-{os.environ['MASTER_PORT']}-{step}")
    if dist.get_rank() == 0:  # (save_pretrained writes on rank 0 only)
        torch.manual_seed(step)
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
        GPT2LMHeadModel(config).save_pretrained(staging, max_shard_size="10KB")
    dist.barrier()
    if dist.get_rank() == 1:  # the shards and config go in through node B's mount ...
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(staging)):
            if not name.endswith(".index.json"):
                shutil.copyfile(os.path.join(staging, name), os.path.join(target, name))
    dist.barrier()
    if dist.get_rank() == 0:  # ... and the index that names them through node A's
        os.makedirs(target, exist_ok=True)
        index = "model.safetensors.index.json"
        shutil.copyfile(os.path.join(staging, index), os.path.join(target, index))
        shutil.rmtree(staging, ignore_errors=True)


SAVES = {"dcp": dcp_save, "megatron": megatron_save, "latest": latest_save, "pretrained": pretrained_save}


def run_trainer(root: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Pause(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            dist.barrier()  # (the test's cue: every rank's files of this step are closed)
            print(f"saved {state.global_step}", flush=True)
            if state.global_step < state.max_steps and sys.stdin.readline().split()[:1] != ["next"]:
                control.should_training_stop = True

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 8), generator=gen)]
    args = TrainingArguments(
        output_dir=os.path.join(root, "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        seed=0,
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Pause]).train()


def dcp_load(root: str, step: int) -> None:
    """One process, no process group: the step's DCP checkpoint read whole and checked."""
    import torch.distributed.checkpoint as dcp

    expected = state(step, 0)["weight"]
    loaded = {"model": {"weight": torch.zeros_like(expected)}, "step": 0}
    dcp.load(loaded, checkpoint_id=os.path.join(root, f"step_{step}"), no_dist=True)
    assert torch.equal(loaded["model"]["weight"], expected), "the loaded weights differ"
    assert loaded["step"] == step, loaded["step"]
    print(f"loaded {step}", flush=True)


def main(job: str, root: str, step: int) -> int:
    warnings.filterwarnings("ignore")
    if job == "dcp-load":
        dcp_load(root, step)
        return 0
    if job == "trainer":
        run_trainer(root)  # (the Trainer makes and ends the process group)
        return 0
    dist.init_process_group("gloo")
    try:
        while True:
            SAVES[job](root, step)
            dist.barrier()
            print(f"saved {step}", flush=True)
            words = sys.stdin.readline().split()
            if len(words) != 2 or words[0] != "next":
                break
            step = int(words[1])
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (torch's C++ threads were seen to abort the interpreter's teardown)
