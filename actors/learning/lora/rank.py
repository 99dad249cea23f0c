"""TrainRank: one LoRA trainer rank, a Ray actor in bundle 0 of its node's placement group, that computes what the driver says.

The Trainer (actors/learning/trainer.py) starts one rank per logical node that trains (or
``training.workers``), each with ``training.resources_per_worker`` out of the bundle that also
holds the node's replica, and joins the synced ranks into a torch process group (gloo on CPU,
NCCL on GPU). The rank holds the node's model (an ``AdapterBank``: the base weights once, every
adapter it trains switched in place) and does what the driver (``actors/learning/lora/driver.py``)
asks, one typed message per phase: begin a micro-step on its share of the items
(:class:`StepPlan`), run the token windows the planner granted on its node (:class:`RoundPlan`,
FlexLLM §6.1), end the micro-step (the optimizer step all-reduces the synced ranks' gradients),
save a version, score one for the gate.

A rank never reads the feedback store's records or asks the planner: the driver decides and
gathers. (It does reach the store actor through ``AdapterFiles``, the version files' transport
between nodes, when its node is not the store's.) An adapter's own fault while beginning a step or
running its windows comes back in the answer (``fault``), so the driver pauses that adapter
alone; a failed collective raises :class:`GroupFailed`, the group's fault, and the Trainer starts
the ranks again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from actors.learning.lora.device_memory import memory_added, memory_mark, move_optimizer_state, offloadable_bytes
from actors.learning.lora.messages import (
    ItemLoss,
    RankStarted,
    RetentionScoreRequest,
    RetentionSetRequest,
    RoundDone,
    RoundPlan,
    SaveVersion,
    ScoreRequest,
    StepBegun,
    StepPlan,
)
from actors.learning.messages import MemoryUse
from settings import AppConfig

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 1800.0  # a collective that waits longer than this fails the group (the Trainer restarts it)
PLACE_EVERY_S = 30.0  # a rank sets its CPU placement again at a micro-step at most this often


class GroupFailed(RuntimeError):
    """A collective of the ranks' process group failed (another rank died): the group's fault, not an adapter's."""


@contextmanager
def _group_call() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise GroupFailed(f"{type(exc).__name__}: {exc}") from exc


def share_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) shares of n items; the first shares get the extras."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _fault(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:1000]


class TrainRank:
    """Created by the Trainer with ``ray.remote(TrainRank).options(scheduling_strategy=<node's group, bundle 0>,
    num_cpus/num_gpus=<its share>)``; then ``address`` (rank 0) and ``join`` (synced, world > 1), then ``start``."""

    def __init__(self, rank: int, world: int, node_id: int, config: AppConfig, namespace: str) -> None:
        self.rank, self.world, self.node_id = rank, world, node_id
        self.cfg, self.t, self.namespace = config, config.training, namespace
        # per_node (LEMIX §V-B): each rank trains its node's copy alone and never joins a collective.
        self.group_rank, self.group_world = self.t.scope_rules.group(rank, world)
        self.bank: Any = None
        self.model: Any = None
        self.opt: Any = None
        self.loaded: tuple[str, int | None] | None = None  # (adapter, version its weights started from)
        self.passes: dict[int, Any] = {}  # the micro-step's WindowedPasses of this rank's share
        self.weights: dict[int, float] = {}
        self.micro_done = 0  # micro-steps whose gradients are accumulated but not applied
        self.offloaded_bytes = 0  # optimizer state moved to host memory by an offload grant
        self.placement: dict[str, object] | None = None  # where its threads run (training.cpu_placement)
        self._placed_at = float("-inf")
        self.retention: Any = None  # RetentionSets: the gate's retention sets (issue 37), built on first use

    # ---- the group -------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        """Rank 0: where the others meet it to form the process group (this node's IP, a free port)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int) -> None:
        """Join the torch process group of the synced ranks (returns when all have joined)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        # Gradients live on the device (NCCL on GPUs); nothing else crosses the group.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )

    def watch(self) -> None:
        """Never returns: the Trainer holds this call open and learns at once when the rank dies."""
        import threading

        threading.Event().wait()

    def start(self) -> RankStarted:
        """Load the node's base model (built or fetched on this host); say where this rank runs."""
        import torch

        from actors.learning.lora.bank import AdapterBank
        from actors.learning.versions.files import AdapterFiles
        from actors.models.default_model import model_dir

        # Share the node's cores with its inference engine: as many threads as CPUs granted (at least 1), where
        # training.cpu_placement says (placed again before each micro-step: engines start and restart).
        torch.set_num_threads(self.t.torch_threads or max(1, int(self.t.resources_per_worker.get("CPU", 1))))
        self.files = AdapterFiles(self.cfg, self.namespace)
        self.bank = AdapterBank(model_dir(self.cfg), dtype=self.t.dtype, seed=0)
        self.placement = self._place()
        ctx = ray.get_runtime_context()
        return RankStarted(
            rank=self.rank,
            node_id=self.node_id,
            pid=os.getpid(),
            ray_node_id=ctx.get_node_id(),
            placement_group_id=ctx.get_placement_group_id(),
            device=self.bank.device,
            dtype=self.bank.dtype_name,
        )

    # ---- one micro-step ----------------------------------------------------------------------------

    def _place(self) -> dict[str, object] | None:
        """Keep this rank's threads where ``training.cpu_placement`` says, on a CPU host (cpu_placement.py)."""
        if self.bank is not None and self.bank.device != "cpu":
            return None
        from actors.learning.lora import cpu_placement

        now = time.monotonic()
        if now - self._placed_at < PLACE_EVERY_S:
            return self.placement
        self._placed_at = now
        try:
            done = cpu_placement.place_trainer(self.t.cpu_placement, priority=self.t.cpu_priority)
        except Exception as exc:  # a convenience for speed; never a reason to stop training
            logger.warning("rank %d: CPU placement failed: %s", self.rank, exc)
            return None
        if done != self.placement:
            logger.info("rank %d: CPU placement %s", self.rank, done)
        return done

    def begin_step(self, plan: StepPlan) -> StepBegun:
        """Make the adapter's slot compute from ``plan.target`` and open one windowed pass per item of this share."""
        from actors.learning.lora.windowed_pass import WindowedPass, batch_scales

        self.placement = self._place()
        try:
            self._ensure_model(plan)
            items = plan.items
            lo, hi = share_bounds(len(items), self.group_world)[self.group_rank]
            # Scales that make the accumulated gradient the mean over the whole micro-step (all ranks'
            # items), over `accumulation` micro-steps; the sum over ranks is then the batch mean.
            scales = batch_scales(
                self.bank.tokenizer,
                items,
                plan.spec.method,
                scale=1.0 / self.t.accumulation,
                max_length=self.t.max_length,
            )[lo:hi]
            self.passes = {
                it.id: WindowedPass(
                    self.model,
                    self.bank.tokenizer,
                    it,
                    plan.spec.method,
                    beta=plan.spec.beta,
                    max_length=self.t.max_length,
                    scale=sc,
                )
                for it, sc in zip(items[lo:hi], scales)
            }
            self.weights = {
                sid: float(p.loss_tokens if plan.spec.method == "sft" else 1) for sid, p in self.passes.items()
            }
        except Exception as exc:  # this adapter's version or items: its fault alone
            self.passes = {}
            return StepBegun({}, fault=_fault(exc))
        return StepBegun(
            {sid: p.work for sid, p in self.passes.items()},
            offloadable_bytes(self.opt),
            forward_lengths={sid: p.length for sid, p in self.passes.items()},
        )

    def run_windows(self, plan: RoundPlan) -> RoundDone:
        """Run the granted windows in order, forward and backward work (FlexLLM Alg. 2); a stale one (the planner
        saw an older state) is skipped. A backward window runs whole (layer, window) units, so an item may end
        the round a little short of or past the window's end: its ``done`` says where."""
        if plan.offload_optimizer and self.opt is not None:
            # LEMIX Alg. 2 lines 9–11: free the device for this grant; the state comes back for the optimizer step.
            self.offloaded_bytes += move_optimizer_state(self.opt, "cpu")
        finished: dict[int, ItemLoss] = {}
        fault = None
        mark = memory_mark(self.bank.device)
        t0 = time.time()
        ran = 0
        forward_s = 0.0
        try:
            for w in plan.windows:
                p = self.passes.get(w.sample_id)
                if p is None or w.start != p.done or w.end > p.work:
                    continue
                if p.done < p.length:
                    f0 = time.perf_counter()
                    p.forward(min(w.end, p.length))
                    forward_s += time.perf_counter() - f0
                if w.end > p.length:
                    p.backward(w.end)
                ran += 1
                if p.complete:
                    stats = p.stats  # DPO: −log σ(β·(Δ⁺ − Δ⁻)); KTO: λ − v; SFT: mean token NLL
                    finished[w.sample_id] = ItemLoss(stats.loss, self.weights[w.sample_id])
        except Exception as exc:
            fault = _fault(exc)
        elapsed = time.time() - t0
        memory = (
            MemoryUse(ran, max(w.end - w.start for w in plan.windows), memory_added(self.bank.device, mark))
            if ran
            else None
        )
        return RoundDone(
            {sid: p.done for sid, p in self.passes.items()},
            finished,
            ran,
            elapsed if ran else 0.0,
            memory,
            offloadable_bytes(self.opt),
            fault,
            ran_at=t0,
            forward_s=forward_s if ran else 0.0,
        )

    def abandon_step(self) -> None:
        """Drop the micro-step's passes and every gradient not yet applied; the driver keeps the items queued."""
        for p in self.passes.values():
            p.abandon()
        self.passes = {}
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        self.micro_done = 0

    def end_step(self, apply: bool) -> None:
        """The micro-step's passes are finished; with ``apply``, the optimizer step (all synced ranks together)."""
        self.passes = {}
        self.micro_done += 1
        if apply:
            self.apply_gradients()

    def apply_gradients(self) -> None:
        """Average the accumulated gradients over the synced ranks and step the optimizer (a no-op with none)."""
        from actors.learning.lora.steps import optimizer_step

        if self.micro_done == 0 or self.model is None:
            return
        if self.micro_done < self.t.accumulation:
            # A partial accumulation (the queue ran dry): rescale to the mean over the steps taken.
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.t.accumulation / self.micro_done)
        self._allreduce_grads()
        if self.offloaded_bytes:
            move_optimizer_state(self.opt, self.bank.device)  # back from host memory (an offload grant)
            self.offloaded_bytes = 0
        optimizer_step(self.model, self.opt)
        self.micro_done = 0

    def _allreduce_grads(self) -> None:
        import torch
        import torch.distributed as dist

        if self.group_world == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        with _group_call():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # shares were pre-scaled: sum = batch mean
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _ensure_model(self, plan: StepPlan) -> None:
        """Make the adapter's slot compute, from its current version (or a fresh LoRA) unless the slot already
        holds that version's line; the base model is never reloaded."""
        adapter, (version, location) = plan.adapter, plan.target
        path = self.files.local_path(adapter, version, location) if location else None
        self.model, self.opt = self.bank.train(
            adapter, plan.spec.lora, version, path, plan.spec.learning_rate, plan.spec.warmup_steps
        )
        if self.loaded != (adapter, version):
            self.loaded = (adapter, version)
            self.micro_done = 0
            self.opt.zero_grad(set_to_none=True)

    # ---- versions ---------------------------------------------------------------------------------------

    def save(self, request: SaveVersion) -> str:
        """Write the adapter in training as ``request.version`` (atomic), publish its files, and take it as the slot's
        version; returns where the files are."""
        from dataclasses import asdict

        from actors.learning.lora.steps import save_adapter_version

        adapter, version = request.adapter, request.version
        if self.loaded is None or self.loaded[0] != adapter:
            raise RuntimeError(f"rank {self.rank} holds {self.loaded}, not {adapter!r}: nothing to save")
        saved = save_adapter_version(
            self.model,
            self.opt,
            self.files.save_root(adapter, version),
            adapter,
            version,
            asdict(request.meta),
            peft_name=self.bank.peft_name(adapter),
        )
        location = self.files.publish(adapter, version, saved)
        self.advance(adapter, version)  # the driver says forget() if the store does not take the version
        return location

    def advance(self, adapter: str, version: int) -> None:
        """The slot's weights are ``version`` now (just published): no reload when it is the current one."""
        self.bank.advance(adapter, version)
        self.loaded = (adapter, version)

    def forget(self, adapter: str) -> None:
        """Drop the adapter's slot and unpublished work; the next step loads its current version afresh."""
        for p in self.passes.values():
            p.abandon()
        self.passes = {}
        try:
            self.bank.forget(adapter)
        except Exception as exc:  # a half-loaded slot: the bank drops what it can
            logger.warning("rank %d: forgetting %s: %s", self.rank, adapter, exc)
        if self.loaded is not None and self.loaded[0] == adapter:
            self.loaded, self.model, self.opt, self.micro_done = None, None, None, 0

    def score(self, request: ScoreRequest) -> list[Any]:
        """Each item's own score under the version: a pair's log π(y⁺|x) − log π(y⁻|x) (DPO), else a completion's
        (log-likelihood sum, tokens). Scored on this rank's model, the base weights shared (actors/learning/lora/bank.py)."""
        from actors.learning.lora.alignment import evaluate_completions, evaluate_preferences

        local = (
            self.files.local_path(request.adapter, request.version, request.path) if request.path else None
        )  # None: the base model
        tok = self.bank.tokenizer
        items = list(request.items)
        with self.bank.scoring(request.lora, local) as model:
            if request.method == "dpo":
                return list(evaluate_preferences(model, tok, items, max_length=self.t.max_length).diffs)
            return list(
                evaluate_completions(
                    model, tok, items, field=request.answer_field, max_length=self.t.max_length
                ).per_item
            )

    def retention_set(self, request: RetentionSetRequest) -> Any:
        """The gate's retention set of ``request.file``: the base model's greedy answers and its scores of them,
        built on this rank's base weights once and cached beside the model (actors/learning/lora/retention.py)."""
        from actors.learning.lora.retention import RetentionSets
        from actors.models.default_model import model_dir

        if self.retention is None:
            self.retention = RetentionSets(model_dir(self.cfg), self.cfg.data_path, self.bank.dtype_name)
        return self.retention.get(
            request.file, request.name, lambda: self.bank.scoring(None, None), self.bank.tokenizer
        )

    def score_retention(self, request: RetentionScoreRequest) -> list[tuple[float, int]]:
        """Each retention item's (log-likelihood sum, tokens) of the base's answer under the version."""
        from actors.learning.lora.retention import score_answers

        local = self.files.local_path(request.adapter, request.version, request.path) if request.path else None
        with self.bank.scoring(request.lora, local) as model:
            return score_answers(model, self.bank.tokenizer, request.items, max_length=self.t.max_length)
