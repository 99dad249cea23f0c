"""PipelineStage: a Ray actor in bundle i of a node's placement group holding pipeline stage i of the full model.

The trainer (actors/pipeline/trainer.py) creates one per bundle with
``PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)``; they form one torch
process group as the LoRA trainer ranks do (actors/train_worker.py: rank 0 names a TCP address,
``dist.init_process_group``; gloo on CPU, NCCL on GPUs), which DeepSpeed then adopts. Rank i is
pipeline stage i (one pipeline, no data parallelism). Every call that runs the pipeline must be
made on all stages at once: each blocks in the schedule's send/receive until its neighbours run.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ray

from actors.pipeline.messages import TokenBatch, StageInfo, StageSetup

GROUP_TIMEOUT_S = 1800.0


class PipelineStage:
    """Thin holder of one DeepSpeed ``PipelineEngine`` stage; no decisions of its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.engine: Any = None
        self.loss: Any = None

    def address(self) -> tuple[str, int]:
        """Rank 0: where the other stages meet it (this node's IP, a free port)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, s: StageSetup) -> StageInfo:
        """Join the process group, build this stage's layers, load their weights, create the engine."""
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import
        import deepspeed
        import torch.distributed as dist
        from deepspeed.pipe import PipelineModule

        from actors.pipeline.losses import PipelineLoss
        from actors.pipeline.model import layer_specs, load_slice, read_config

        torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        # DeepSpeed's engine reads these for its device and logs; one pipeline, so LOCAL_RANK is the
        # actor's only visible device (Ray sets CUDA_VISIBLE_DEVICES per actor).
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(s.stages), LOCAL_RANK="0",
                          MASTER_ADDR=s.host, MASTER_PORT=str(s.port))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{s.host}:{s.port}", rank=self.rank,
                                    world_size=s.stages, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        deepspeed.init_distributed(dist_backend=backend)
        self.loss = PipelineLoss(beta=s.beta)
        # No grad while building: the module's constructor broadcasts the tied weights in place, which
        # must not enter the autograd graph (torch warns of an op without an autograd kernel at backward).
        with torch.no_grad():
            pipe = PipelineModule(layers=layer_specs(read_config(s.model_dir)), num_stages=s.stages,
                                  partition_method=s.partition_method, loss_fn=self.loss, dynamic_shape=True)
        load_slice(pipe, s.model_dir)
        optimizer = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], lr=s.learning_rate,
                                      weight_decay=0.0)
        ds_config = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": s.accumulation,
                     "gradient_clipping": s.max_grad_norm, "steps_per_print": 2**31 - 1,
                     "wall_clock_breakdown": False}
        self.engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=ds_config)
        self._resync_tied()
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        return StageInfo(rank=self.rank, stage_id=self.engine.stage_id, layer_start=int(pipe._local_start),
                         layer_stop=int(pipe._local_stop), bounds=[int(b) for b in pipe.parts],
                         params=sum(p.numel() for p in pipe.parameters()),
                         placement_group_id=None if pg is None else pg.id.hex(),
                         node_id=ctx.get_node_id(), actor_id=ctx.get_actor_id())

    def _resync_tied(self) -> None:
        # Both tied copies were loaded from the same file; broadcasting again keeps them equal bit for bit
        # should a checkpoint carry a stale lm_head copy. No grad: an in-place collective on a parameter
        # must not enter the autograd graph.
        import torch

        with torch.no_grad():
            self.engine.module._synchronize_tied_weights()

    def load(self, model_dir: str) -> None:
        """Restart from the weights in ``model_dir`` (rollback): new weights, fresh optimizer moments."""
        from collections import defaultdict

        from actors.pipeline.model import load_slice

        load_slice(self.engine.module, model_dir)
        self._resync_tied()
        self.engine.optimizer.state = defaultdict(dict)

    def train_batch(self, batches: list[TokenBatch] | None, mode: str) -> float:
        """One optimizer step over ``accumulation`` micro-batches (first and last stage get them); the mean loss."""
        self.loss.mode = mode
        loss = self.engine.train_batch(data_iter=None if batches is None else iter(_ds_batches(batches)))
        return float(loss)

    def logps(self, batches: list[TokenBatch] | None, count: int) -> list[float] | None:
        """No-grad pass: each row's completion log-prob (the last stage answers; the others return None)."""
        self.loss.mode, self.loss.rows = "logp", []
        self.engine.total_loss = None  # eval_batch adds onto what the last train_batch left
        self.engine.eval_batch(data_iter=None if batches is None else iter(_ds_batches(batches)),
                               compute_loss=True, reduce_output=None, bcast_loss=False, num_micro_batches=count)
        self.engine.module.train()
        if not self.engine.is_last_stage():
            return None
        return [float(x) for t in self.loss.rows for x in t]

    def state_slice(self) -> dict[str, Any]:
        """This stage's weights as HF-named CPU tensors (a tied embedding only from the stage that owns it)."""
        from actors.pipeline.model import state_slice

        return state_slice(self.engine.module)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _ds_batches(batches: list[TokenBatch]) -> list[tuple[Any, tuple[Any, ...]]]:
    """DeepSpeed's micro-batch shape: (first stage's inputs, last stage's labels)."""
    out = []
    for b in batches:
        labels = (b.targets, b.mask) if b.ref is None else (b.targets, b.mask, b.ref)
        out.append((b.ids, labels))
    return out
