"""The loop every Ray Train worker runs: LoRA epochs with the project's SFT/DPO steps, a checkpoint each epoch.

Each worker holds the whole base model with the same fresh LoRA (one seed), runs ``sft_step`` /
``dpo_step`` (``actors/learning/lora/steps.py``) on its share of each global batch, and the LoRA
gradients are averaged over the workers with one all-reduce on the process group Ray Train's
``TorchTrainer`` set up (gloo on CPU) before ``optimizer_step``. Not DDP: ``dpo_step`` computes its
reference with ``model.disable_adapter()``, a method of the ``PeftModel`` that a DDP wrapper hides,
and only the few LoRA tensors need averaging (flattened into one buffer: one collective per step).

A checkpoint (rank 0 writes it; every rank reports) holds the PEFT adapter files, ``optimizer.pt``
and ``state.json`` (the epoch just finished, its loss, the history). A worker group that starts
with ``ray.train.get_checkpoint()`` set loads all three and goes on with the next epoch.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
# Test-only, read by the driver (app/finetune.py) and handed to the workers in their config:
# "<epoch>:<marker file>": the last rank exits hard once during that epoch, after its first step,
# unless the marker file exists (it makes the file first), to show a restart from the last checkpoint.
CRASH_ONCE_ENV = "COSERVE_FINETUNE_CRASH_ONCE"


def _say(text: str) -> None:
    """One line to the worker's stdout (Ray forwards it to the driver). Not ``print``: Ray Train patches print
    in its workers to log *and* echo every line, so the driver would show each one twice."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _Lines:
    """A file for tqdm that ends each redraw with a newline: Ray forwards worker output by lines, not ``\\r``."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stdout.write(text + "\n")

    def flush(self) -> None:
        sys.stdout.flush()


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the job's ``TorchTrainer``; ``config``: the job (a dict), ``model_dir``, ``crash_once``."""
    import ray.train
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from actors.learning.finetune.data import as_item, item_dict, read_items
    from actors.learning.finetune.job import FinetuneJob
    from actors.learning.lora.steps import (
        OPTIMIZER_FILE,
        dpo_step,
        load_lora_model,
        make_optimizer,
        optimizer_step,
        sft_step,
    )

    job = FinetuneJob.model_validate(config["job"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config.get("threads", 1))))

    state: dict[str, Any] = {"epoch": 0, "history": []}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt:
            state = json.loads((Path(ckpt) / STATE_FILE).read_text())
            model, tokenizer = load_lora_model(
                config["model_dir"], job.adapter.lora, adapter_dir=ckpt, seed=job.seed, device="cpu"
            )
            optimizer = make_optimizer(model, job.learning_rate, state_dir=ckpt)
        if rank == 0:
            _say(
                f"[finetune] resumed from the checkpoint of epoch {state['epoch']}: on with epoch "
                f"{state['epoch'] + 1}/{job.epochs}"
            )
    else:
        model, tokenizer = load_lora_model(config["model_dir"], job.adapter.lora, seed=job.seed, device="cpu")
        optimizer = make_optimizer(model, job.learning_rate)
    resumed_from = int(state["epoch"])
    params = [p for p in model.parameters() if p.requires_grad]

    file_items = None
    if job.data.loader == "file":
        file_items = read_items(job.data.path, job.adapter.name, job.adapter.method)[rank::world]

    crash = config.get("crash_once")
    for epoch in range(resumed_from + 1, job.epochs + 1):
        started = time.time()
        if file_items is not None:
            items = [item_dict(i) for i in file_items]
        else:
            shard = ray.train.get_dataset_shard("train")
            items = [item_dict(as_item(row, job.adapter.name, job.adapter.method)) for row in shard.iter_rows()]
        if job.data.shuffle:
            random.Random(job.seed * 100_003 + epoch * 1_009 + rank).shuffle(items)  # the same order on a resume
        batches = [items[i : i + job.batch_size] for i in range(0, len(items), job.batch_size)]
        # Every rank must take part in every all-reduce: all run as many steps as the rank with the fewest batches.
        steps = torch.tensor([len(batches)], dtype=torch.long)
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        steps = int(steps)
        totals = torch.zeros(3, dtype=torch.float64)  # Σ loss·samples, samples, tokens (this rank)
        bar = tqdm(
            total=steps,
            desc=f"epoch {epoch}/{job.epochs}",
            disable=rank != 0,
            file=_Lines(),
            ascii=True,
            mininterval=0,
            ncols=100,
            leave=False,
        )
        for step in range(steps):
            batch = batches[step]
            if job.adapter.method == "sft":
                stats = sft_step(model, tokenizer, batch, max_length=job.data.max_length)
            else:
                stats = dpo_step(model, tokenizer, batch, job.adapter.beta, max_length=job.data.max_length)
            _average_gradients(params, world)
            optimizer_step(model, optimizer, job.max_grad_norm)
            totals += torch.tensor([stats.loss * stats.samples, stats.samples, stats.tokens], dtype=torch.float64)
            bar.set_postfix(loss=f"{stats.loss:.4f}", refresh=False)
            bar.update(1)
            if crash and crash["epoch"] == epoch and rank == world - 1 and not os.path.exists(crash["marker"]):
                Path(crash["marker"]).write_text(f"rank {rank} exited during epoch {epoch}, step {step + 1}\n")
                _say(f"[finetune] test crash: rank {rank} exits during epoch {epoch} (step {step + 1}/{steps})")
                os._exit(1)  # a hard death, as a killed process: no exception, no cleanup
        bar.close()
        dist.all_reduce(totals)
        loss = float(totals[0] / totals[1]) if totals[1] else float("nan")
        skipped = len(items) - min(len(items), steps * job.batch_size)
        entry = {
            "epoch": epoch,
            "loss": loss,
            "samples": int(totals[1]),
            "tokens": int(totals[2]),
            "seconds": round(time.time() - started, 2),
            "resumed_from": resumed_from,
            "skipped": skipped,
        }
        state = {
            "epoch": epoch,
            "loss": loss,
            "adapter": job.adapter.name,
            "method": job.adapter.method,
            "base": job.base,
            "history": [*state["history"], entry],
        }
        metrics = dict(entry, world_size=world)
        if rank == 0:
            _say(
                f"[finetune] epoch {epoch}/{job.epochs}: loss {loss:.4f} over {entry['samples']} items "
                f"({world} workers, {entry['seconds']} s); checkpoint"
            )
        with tempfile.TemporaryDirectory(prefix="finetune-ckpt-") as tmp:
            ckpt = None
            if rank == 0:  # the adapter is the same on every rank: one copy is the checkpoint
                model.save_pretrained(tmp, safe_serialization=True)
                torch.save(optimizer.state_dict(), Path(tmp) / OPTIMIZER_FILE)
                (Path(tmp) / STATE_FILE).write_text(json.dumps(state, indent=1))
                ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"epoch-{epoch:04d}")
        # report() only queues the result in this worker; the controller collects it at its next poll
        # (every 2 s). A worker that dies before then takes the epoch's result with it, and the restart
        # would begin an epoch earlier. Wait until the checkpoint is committed: a failure in the next
        # epoch then always resumes from this one.
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def _average_gradients(params: list[Any], world: int) -> None:
    """Mean of each LoRA gradient over the workers, in place (one flat all-reduce)."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
