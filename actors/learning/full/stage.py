"""PipelineStage: a Ray actor in bundle i of a node's placement group holding pipeline stage i of the full model.

The trainer (actors/learning/full/trainer.py) creates one per bundle with
``PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)``; they form one torch
process group as the LoRA trainer ranks do (actors/learning/lora/rank.py: rank 0 names a TCP address,
``dist.init_process_group``; gloo on CPU, NCCL on GPUs), which DeepSpeed then adopts. Rank i is
pipeline stage i (one pipeline, no data parallelism). Every call that runs the pipeline must be
made on all stages at once: each blocks in the schedule's send/receive until its neighbours run.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import ray

from actors.learning.full.messages import StageInfo, StageSetup, TokenBatch
from compat import (
    pipeline_layer_specs,
    pipeline_local_bounds,
    skip_deepspeed_shm_all_reduce,
    synchronize_tied_weights,
)
from planners.pipeline import OpDone, StageOp

GROUP_TIMEOUT_S = 1800.0


class PipelineStage:
    """Thin holder of one DeepSpeed ``PipelineEngine`` stage; no decisions of its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.engine: Any = None  # DeepSpeed's engine (schedule "deepspeed")
        self.pipe: Any = None  # this stage's PipelineModule
        self.optimizer: Any = None
        self.loss: Any = None
        self.setup_msg: StageSetup | None = None
        self.first = self.last = False
        self.chunks: list[tuple[int, int]] = []  # [start, stop) into the stage's forward functions, per chunk
        self._saved: dict[tuple[str, int], tuple[Any, Any, float]] = {}  # (task, position) -> (input, output, bytes)
        self.weight_pointers: set[int] = set()  # storage of every weight, to tell saved weights from activations

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

        from actors.learning.full.losses import PipelineLoss
        from actors.learning.full.model import chunk_bounds, load_slice, pipeline_module, read_config

        torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        # DeepSpeed's engine reads these for its device and logs; one pipeline, so LOCAL_RANK is the
        # actor's only visible device (Ray sets CUDA_VISIBLE_DEVICES per actor).
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(s.stages), LOCAL_RANK="0", MASTER_ADDR=s.host, MASTER_PORT=str(s.port)
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                init_method=f"tcp://{s.host}:{s.port}",
                rank=self.rank,
                world_size=s.stages,
                timeout=timedelta(seconds=GROUP_TIMEOUT_S),
            )
        skip_deepspeed_shm_all_reduce()
        deepspeed.init_distributed(dist_backend=backend)
        self.loss = PipelineLoss(beta=s.beta)
        # No grad while building: the module's constructor broadcasts the tied weights in place, which
        # must not enter the autograd graph (torch warns of an op without an autograd kernel at backward).
        with torch.no_grad():
            pipe = pipeline_module(
                read_config(s.model_dir), s.stages, s.partition_method, self.loss, dynamic_shape=True
            )
        load_slice(pipe, s.model_dir)
        params = [p for p in pipe.parameters() if p.requires_grad]
        # The fused kernel (CPU too, torch >= 2.4) is 3x the default's speed on a 100M-parameter stage; the
        # DeepSpeed engine wraps the plain one.
        fused = s.schedule == "planner"
        optimizer = torch.optim.AdamW(params, lr=s.learning_rate, weight_decay=0.0, fused=fused or None)
        self.pipe, self.optimizer, self.setup_msg = pipe, optimizer, s
        start, stop = pipeline_local_bounds(pipe)
        self.first, self.last = start == 0, stop == len(pipeline_layer_specs(pipe))
        self.chunks = chunk_bounds(read_config(s.model_dir), start, stop, s.chunks)
        self.weight_pointers = {p.data_ptr() for p in pipe.parameters()}
        if s.schedule == "deepspeed":
            ds_config = {
                "train_micro_batch_size_per_gpu": s.micro_batch,
                "gradient_accumulation_steps": s.accumulation,
                "gradient_clipping": s.max_grad_norm,
                "steps_per_print": 2**31 - 1,
                "wall_clock_breakdown": False,
            }
            self.engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=ds_config)
            self.optimizer = self.engine.optimizer
        self._resync_tied()
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        return StageInfo(
            rank=self.rank,
            stage_id=pipe.stage_id,
            layer_start=start,
            layer_stop=stop,
            bounds=[int(b) for b in pipe.parts],
            params=sum(p.numel() for p in pipe.parameters()),
            placement_group_id=None if pg is None else pg.id.hex(),
            node_id=ctx.get_node_id(),
            actor_id=ctx.get_actor_id(),
        )

    def _resync_tied(self) -> None:
        # Both tied copies were loaded from the same file; broadcasting again keeps them equal bit for bit
        # should a checkpoint carry a stale lm_head copy. No grad: an in-place collective on a parameter
        # must not enter the autograd graph.
        import torch

        with torch.no_grad():
            synchronize_tied_weights(self.pipe)

    def load(self, model_dir: str) -> None:
        """Restart from the weights in ``model_dir`` (rollback): new weights, fresh optimizer moments."""
        from collections import defaultdict

        from actors.learning.full.model import load_slice

        load_slice(self.pipe, model_dir)
        self._resync_tied()
        self.optimizer.state = defaultdict(dict)

    def train_batch(self, batches: list[TokenBatch] | None, mode: str) -> float:
        """One optimizer step over ``accumulation`` micro-batches (first and last stage get them); the mean loss."""
        self.loss.mode = mode
        loss = self.engine.train_batch(data_iter=None if batches is None else iter(_ds_batches(batches)))
        return float(loss)

    def logps(self, batches: list[TokenBatch] | None, count: int) -> list[float] | None:
        """No-grad pass: each row's completion log-prob (the last stage answers; the others return None)."""
        self.loss.mode, self.loss.rows = "logp", []
        self.engine.total_loss = None  # eval_batch adds onto what the last train_batch left
        self.engine.eval_batch(
            data_iter=None if batches is None else iter(_ds_batches(batches)),
            compute_loss=True,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=count,
        )
        self.engine.module.train()
        if not self.engine.is_last_stage():
            return None
        return [float(x) for t in self.loss.rows for x in t]

    def state_slice(self) -> dict[str, Any]:
        """This stage's weights as HF-named CPU tensors (a tied embedding only from the stage that owns it)."""
        from actors.learning.full.model import state_slice

        return state_slice(self.pipe)

    # -------------------------------------------------------------- single ops (schedule "planner")
    # The stage scheduler (planners/pipeline) picks each op; tensors travel between stages as Ray
    # objects: a forward's output is the next stage's input, a backward's input gradient the previous
    # stage's output gradient. Times are this process's wall clock (one host: comparable across stages).

    def forward_op(self, op: StageOp, x: Any, labels: TokenBatch | None = None) -> tuple[Any, OpDone]:
        """One forward of ``op`` over this stage's chunk ``op.position`` (of ``chunks``; an inference pass
        runs from that chunk to the end of the stage).

        Inference: no graph; the model's last chunk applies the head to the last position only and
        returns the greedy next token of each row (with ``labels``: each row's summed log-prob of its
        masked targets, a scoring pass). Training: the graph is kept for ``backward_op`` (its
        saved activation bytes counted); the model's last chunk returns the micro-batch's loss (the
        gradient is of loss / accumulation).
        """
        import torch

        start = time.time()
        funcs, first, last = self._chunk(op.position, to_stage_end=op.kind == "inference")
        if op.kind == "inference":
            with torch.no_grad():
                if labels is not None and last:  # a scoring pass: each row's completion log-prob
                    from actors.learning.full.losses import sequence_logps

                    for f in funcs:
                        x = f(x)
                    out = sequence_logps(x, labels.targets, labels.mask.float()).tolist()
                else:
                    out = self._run(funcs, x, last)
            return out, OpDone(op, start, time.time(), self._held())
        inp = x if first else x.detach().requires_grad_(True)
        counted = [0.0]
        weights = self.weight_pointers

        def pack(t: Any) -> Any:
            if t.data_ptr() not in weights:  # autograd saves the weights too: they are not activations
                counted[0] += t.numel() * t.element_size()
            return t

        self.loss.mode = "sft" if labels is None or labels.ref is None else "dpo"
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = inp
            for f in funcs:
                out = f(out)
            if last:
                assert labels is not None, "the model's last chunk needs the micro-batch's labels"
                parts = (
                    (labels.targets, labels.mask) if labels.ref is None else (labels.targets, labels.mask, labels.ref)
                )
                out = self.loss(out, parts) / self.setup_msg.accumulation
        self._saved[(op.task_id, op.position)] = (inp, out, counted[0])
        result = float(out.detach()) * self.setup_msg.accumulation if last else out.detach()
        return result, OpDone(op, start, time.time(), self._held())

    def backward_op(self, op: StageOp, grad: Any = None) -> tuple[Any, OpDone]:
        """The backward of ``op``'s micro-batch through chunk ``op.position``; returns the gradient of its
        input (None for the model's first chunk), which the chunk before needs."""
        start = time.time()
        _, first, last = self._chunk(op.position)
        inp, out, _ = self._saved.pop((op.task_id, op.position))
        if last:
            out.backward()
        else:
            out.backward(grad)
        g = None if first else inp.grad
        return g, OpDone(op, start, time.time(), self._held())

    def _chunk(self, position: int, to_stage_end: bool = False) -> tuple[list[Any], bool, bool]:
        """This position's forward functions (``to_stage_end``: the rest of the stage's, as an inference
        pass runs them), and whether they start and end the whole model."""
        k = position % len(self.chunks)  # a stage's chunks are consecutive positions of its lane
        a, b = self.chunks[k]
        if to_stage_end:
            b, end = self.chunks[-1][1], True
        else:
            end = k == len(self.chunks) - 1
        return list(self.pipe.forward_funcs[a:b]), self.first and k == 0, self.last and end

    @staticmethod
    def _run(funcs: list[Any], x: Any, last: bool) -> Any:
        """Inference through ``funcs``; the model's head (``last``) only on the last position, greedy."""
        head = funcs[-1] if last else None
        for f in funcs[:-1] if last else funcs:
            x = f(x)
        return x if head is None else head(x[:, -1:, :])[:, -1].argmax(-1)

    def step_op(self, op: StageOp) -> OpDone:
        """The optimizer step closing a mini-batch; a collective, so every stage of the pipeline runs it
        at once: tied gradients are summed between the first and the last stage and the gradient norm
        is clipped over the whole model (its squares summed over the stages)."""
        import torch
        import torch.distributed as dist

        start = time.time()
        params = [p for p in self.pipe.parameters() if p.grad is not None]
        if dist.get_world_size() > 1:
            self.pipe.allreduce_tied_weight_gradients()
        square = torch.zeros(1)
        for p in params:
            square += p.grad.detach().float().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(square)
        norm = float(square.sqrt())
        limit = self.setup_msg.max_grad_norm
        if limit and norm > limit:
            for p in params:
                p.grad.mul_(limit / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return OpDone(op, start, time.time(), self._held())

    def export_op(self, op: StageOp) -> tuple[dict[str, Any], OpDone]:
        """Weight sync, the training side: this stage's HF-named weights, as numpy arrays: Ray keeps those
        in its shared-memory object store without pickling, and a reader on the same host maps them
        (a torch tensor would be pickled on the way in and out, seconds for a 135M model)."""
        start = time.time()
        arrays = {k: v.numpy() for k, v in self.state_slice().items()}
        return arrays, OpDone(op, start, time.time(), self._held())

    def import_op(self, op: StageOp, *parts: dict[str, Any]) -> OpDone:
        """Weight sync, the serving side: copy the trained weights (every training stage's slice) in."""
        from actors.learning.full.model import load_tensors

        start = time.time()
        import warnings

        import torch

        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only shared-memory arrays: copy_ only reads them
            load_tensors(self.pipe, {k: torch.from_numpy(v) for k, v in merged.items()})
        return OpDone(op, start, time.time(), self._held())

    def profile_op(self, kind: str, batch: int, tokens: int, repeats: int = 1) -> dict[str, float]:
        """Time a forward (and for training a backward) on synthetic input, changing no weights: a row of the
        stage cost model (LEMIX §IV-A's offline profiling). Of ``repeats`` timings each phase keeps its fastest:
        on a shared host a single timing carries whatever preempted it (a loaded run once fitted no slope from
        single timings of a few milliseconds each)."""
        import torch

        h = self.pipe
        best: dict[str, float] = {}
        for _ in range(max(1, repeats)):
            x: Any = (
                torch.randint(0, 100, (batch, tokens))
                if self.first
                else torch.randn(batch, tokens, self._hidden_size(), requires_grad=kind == "training")
            )
            start = time.perf_counter()
            if kind == "inference":
                with torch.no_grad():
                    self._run(list(h.forward_funcs), x, self.last)
                took = {"forward": time.perf_counter() - start}
            else:
                out = h(x)
                mid = time.perf_counter()
                (out.float().mean() if self.last else out.float().pow(2).mean()).backward()
                end = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                took = {"forward": mid - start, "backward": end - mid}
            best = {k: min(v, best.get(k, v)) for k, v in took.items()}
        return best

    def _hidden_size(self) -> int:
        from actors.learning.full.model import read_config

        return int(read_config(self.setup_msg.model_dir)["hidden_size"])

    def _held(self) -> float:
        return float(sum(b for _, _, b in self._saved.values()))

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
