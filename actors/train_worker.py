"""TrainRank: one trainer rank, a Ray actor inside bundle 0 of its node's placement group, and its loop.

The Trainer (actors/trainer.py) starts one rank per logical node (or ``training.workers``), each
with ``training.resources_per_worker`` out of the bundle that also holds the node's replica, and
joins them into a torch process group (gloo on CPU, NCCL on GPU). Scope ``synced``: rank 0 (the
leader) reads the feedback queue and decides what to do; every rank trains a disjoint share of
each micro-batch; gradients are summed through the process group, so all ranks hold the same
weights and every published version is one model. Scope ``per_node``: every rank is its own
leader for its node's queue and versions (LEMIX §V-B).

Per micro-step: the leader takes up to ``micro_batch`` queued items of one adapter (round robin
over adapters with feedback, skipping mode ``off``); every rank takes its share and runs it in
token windows (FlexLLM §6.1, ``actors.windowed_pass.WindowedPass``): it asks ``Planner.grant`` for
its own node, which answers with the windows the node's iteration scheduler fits beside the
inference work there now (``planners/coserving/``), runs them, and asks again until its items
are done; a synced step's ranks go round by round (one small all-reduce per round) and apply
their gradients together. Then the leader reports each item's loss in the pass to the planner
(``Planner.report_passes``): CheckEnd (MACE Alg. 1 lines 17–21) retires it or requeues it, and a
requeued item stays unconsumed and is trained again in a later micro-step with its loss in its
priority (MACE §4.1). Every ``accumulation`` micro-steps an optimizer step; every
``steps_per_version`` optimizer steps, or as soon as the queue has nothing more for this
adapter, the leader publishes: ``reserve_version`` -> ``save_adapter_version`` (atomic) ->
``AdapterFiles.publish`` (where every node finds it) -> ``publish_version`` (marks the items
consumed) -> ``Planner.load_adapter``.

The rank's model is an ``AdapterBank``: the base weights once, in bf16 where the device has it,
with every adapter it trains as a ``peft`` adapter switched in place, and the versions the
quality gate scores loaded beside them for the time of scoring (actors/evaluator.py). The DPO
reference is the same model with its adapters disabled.

Why one module of about 600 lines: :class:`RankLoop` is one loop whose steps share one state (the
rank's model and optimizer, the items trained into the unpublished version, the version's
counters, the process group): taking items, running their windows, the optimizer step and
publishing are the phases of that loop, and splitting them apart would pass that state around.
The windowed pass itself is in ``actors/windowed_pass.py``, the gate in ``actors/evaluator.py``.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import ray

from actors.evaluator import VersionEvaluator
from actors.config import AppConfig
from actors.device_memory import memory_added, memory_mark, move_optimizer_state, offloadable_bytes
from actors.feedback_models import FULL_METHODS, FeedbackItem
from planners.turns import TrainingTurns
from planners.types import (
    Grant,
    GrantedWindow,
    GrantRequest,
    GrantWaited,
    MemoryUse,
    PassReport,
    PassVerdict,
    PublishOutcome,
    RankStarted,
    SampleProgress,
    StepAbandoned,
    StepDone,
    StepPlan,
    TrainerEvent,
    TrainingSpec,
    VersionPublished,
    WorkDropped,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # an idle leader waits on the store at most this long (new feedback wakes it at once)
SPEC_TTL_S = 2.0  # a PATCHed adapter (mode, learning rate) takes effect within this
MAX_GRANT_SLEEP_S = 1.0  # a refused step asks again at least this often
STOP_CHECK_S = 1.0
LOAD_TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 1800.0  # a collective that waits longer than this fails the group (the Trainer restarts it)


class TrainRank:
    """Created by the Trainer with ``ray.remote(TrainRank).options(scheduling_strategy=<node's group, bundle 0>,
    num_cpus/num_gpus=<its share>)``; then ``address`` (rank 0) and ``join`` (world > 1), then ``run``."""

    def __init__(self, rank: int, world: int, node_id: int, config: AppConfig, namespace: str, planner: Any,
                 eval_file: str | None) -> None:
        self.rank, self.world, self.node_id = rank, world, node_id
        self.cfg, self.namespace, self.planner, self.eval_file = config, namespace, planner, eval_file

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

        # Gradients live on the device (NCCL on GPUs); the small CPU tensors of the step protocol (losses,
        # counts, broadcast plans) go over gloo.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))

    def run(self) -> None:
        """The rank's loop; returns when the Trainer asks it to stop."""
        RankLoop(self.rank, self.world, self.node_id, self.cfg, self.namespace, self.planner, self.eval_file).run()


class GroupFailed(RuntimeError):
    """A collective of the ranks' process group failed (another rank died): the group's fault, not an adapter's."""


@contextmanager
def _group_call() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise GroupFailed(f"{type(exc).__name__}: {exc}") from exc


def _transient(exc: BaseException) -> bool:
    """An error of the store, planner, supervisor or process group being away, not of the adapter being trained."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    if isinstance(exc, GroupFailed):
        return True
    if isinstance(exc, RayTaskError):
        from actors.feedback_models import StoreError

        return not isinstance(getattr(exc, "cause", None), StoreError)
    return isinstance(exc, (RayActorError, GetTimeoutError, ConnectionError))


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) shares of n items; the first shares get the extras."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _arrival(plan: StepPlan, item: FeedbackItem) -> float:
    """t_arr of the item's pass in this micro-step (MACE §4.1): when CheckEnd requeued it, else its acceptance."""
    again = plan.requeued.get(item.id)
    return item.created_at if again is None else again.arrival


def _last_loss(plan: StepPlan, item: FeedbackItem) -> float:
    """L_DPO of MACE §4.1's γ·L_DPO priority term: the item's loss in its previous pass (0 before its first)."""
    again = plan.requeued.get(item.id)
    return 0.0 if again is None else again.loss


def _passes_before(plan: StepPlan, item: FeedbackItem) -> int:
    again = plan.requeued.get(item.id)
    return 0 if again is None else again.passes


class RankLoop:
    """One rank's state: its node's model (an AdapterBank) and, on the leader, the queue bookkeeping."""

    def __init__(self, rank: int, world: int, node_id: int, cfg: AppConfig, namespace: str, planner: Any,
                 eval_file: str | None) -> None:
        import torch
        import torch.distributed as dist

        from actors.adapter_files import AdapterFiles
        from actors.adapter_bank import AdapterBank
        from actors.default_model import model_dir

        self.torch, self.dist = torch, dist
        self.cfg = cfg
        self.t = self.cfg.training
        self.rank, self.world, self.node_id = rank, world, node_id
        # per_node (LEMIX §V-B): every rank trains its own node's copy on the feedback routed to that
        # node, alone: it plans and publishes for itself and never joins a collective. synced: rank 0
        # plans and publishes, and all ranks average gradients.
        self.per_node = self.t.scope == "per_node"
        self.line = self.node_id if self.per_node else None  # the store's queue/version partition
        self.leader = self.rank == 0 or self.per_node
        self.group_rank, self.group_world = (0, 1) if self.per_node else (self.rank, self.world)
        self.distributed = (not self.per_node and self.world > 1 and dist.is_available()
                            and dist.is_initialized())
        # Share the node's cores with its inference engine: as many threads as CPUs granted (at least 1).
        torch.set_num_threads(max(1, int(self.t.resources_per_worker.get("CPU", 1))))
        self.store = ray.get_actor(self.cfg.feedback_actor_name, namespace=namespace)
        self.planner = planner
        self.sup = ray.get_actor(self.cfg.trainer_actor_name, namespace=namespace)
        self.files = AdapterFiles(cfg, namespace, self.store)
        # The node's one base model, for training and for scoring (built or fetched on this host).
        self.bank = AdapterBank(model_dir(cfg), dtype=self.t.dtype, seed=0)
        self.tok = self.bank.tokenizer
        # The leader's quality gate and held-out scoring, run between steps on the same model.
        self.evaluator: VersionEvaluator | None = VersionEvaluator(self, eval_file) if self.leader else None
        self.model = self.opt = None  # the bank's model and the optimizer of the adapter in training
        self.loaded: tuple[str, int | None] | None = None  # (adapter, store version the weights are)
        self.micro_done = 0  # micro-steps whose gradients are accumulated but not applied
        self.opt_steps = 0  # optimizer steps since the last published version
        self.last_round_s = 0.0  # wall time of the last granted windows, told to the planner at the next ask
        self.last_memory: MemoryUse | None = None  # what those windows added to memory, told likewise
        self.offloaded_bytes = 0  # optimizer state moved to host memory by an offload grant
        # Leader-only bookkeeping.
        self.held: list[int] = []  # item ids trained into the unpublished weights
        self.held_created: list[float] = []
        self.pending_items: list[FeedbackItem] = []  # items of accumulated micro-steps not yet applied
        self.version_samples = 0
        self.version_losses: list[tuple[float, int]] = []
        # CheckEnd's last verdict for items it sent back (MACE Alg. 1 line 21): trained again, never held, until retired.
        self.requeued: dict[int, PassVerdict] = {}
        self.specs: dict[str, tuple[float, dict[str, Any]]] = {}
        self.store_changes = -1  # the store's change number as of the last idle wait (-1: look at once)
        self.turns = TrainingTurns()  # whose turn it is to train (leader)
        self.not_before: dict[str, float] = {}  # adapter -> when to ask for a grant again
        self._stop_checked, self._stop = 0.0, False
        if self.evaluator is not None:
            self._resume_gate()
        ctx = ray.get_runtime_context()
        ray.get(self.sup.worker_started.remote(RankStarted(
            rank=self.rank, node_id=self.node_id, pid=os.getpid(), ray_node_id=ctx.get_node_id(),
            placement_group_id=ctx.get_placement_group_id(), device=self.bank.device, dtype=self.bank.dtype_name)))

    # ---- collectives (no-ops with one rank) ---------------------------------------------------

    def bcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        with _group_call():
            self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.distributed:
            return values
        t = self.torch.tensor(values, dtype=self.torch.float64)
        with _group_call():
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM)
        return t.tolist()

    def allreduce_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.distributed:
            return
        flat = self.torch.cat([(p.grad if p.grad is not None else self.torch.zeros_like(p)).reshape(-1)
                               for p in params])
        with _group_call():
            self.dist.all_reduce(flat, op=self.dist.ReduceOp.SUM)  # shares were pre-scaled: sum = batch mean
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone()
            offset += n

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            if self.evaluator is not None and self.evaluator.pending():
                # Scoring shares the model, so it runs here, between steps (the other ranks wait in bcast).
                self.evaluator.work_one()
            plan = self.bcast(self._plan() if self.leader else None)
            op = plan.op
            if op == "stop":
                return
            if op == "idle":
                if plan.sleep:
                    time.sleep(plan.sleep)
            elif op == "step":
                if self._agreed_ok(plan.adapter, "load", lambda: self._ensure_model(plan)):
                    self._guarded(plan.adapter, "step", lambda: self._step(plan))
            elif op == "flush":
                self._guarded(plan.adapter, "publish", lambda: self._finish_version(plan, flush=True))

    # ---- faults stay with their adapter ----------------------------------------------------------

    def _guarded(self, adapter: str, where: str, work: Any) -> bool:
        """Run ``work``; an adapter's own fault (not the store or planner being away) pauses that adapter
        with the error as its reason, and the loop goes on with the others. Returns True if it ran."""
        try:
            work()
            return True
        except Exception as exc:
            if _transient(exc):
                raise  # the store or planner restarting: the Trainer restarts the ranks, nothing is the adapter's
            self._adapter_fault(adapter, where, exc)
            return False

    def _agreed_ok(self, adapter: str, where: str, work: Any) -> bool:
        """:meth:`_guarded`, then every synced rank learns whether any rank failed (they step together or not at all)."""
        ok = self._guarded(adapter, where, work)
        failed = self.allreduce([0.0 if ok else 1.0], op="max")[0]
        if failed and ok:
            self._drop_adapter(adapter)  # another rank could not load it: this rank's copy is dropped too
        return not failed

    def _adapter_fault(self, adapter: str, where: str, exc: BaseException | str) -> None:
        """Pause ``adapter`` (its ``paused_reason`` names the error) and forget this rank's work on it."""
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        reason = f"trainer {where} failed on rank {self.rank}: {message}"[:1000]
        logger.warning("adapter %s paused: %s", adapter, reason)
        self._warn(f"{where} {adapter}", message)
        self._drop_adapter(adapter)
        try:
            ray.get(self.store.pause_adapter.remote(adapter, reason), timeout=30)
        except Exception as again:  # the store away: the next fault pauses it; the loop goes on meanwhile
            self._warn("pause_adapter", again)
        self.not_before[adapter] = time.time() + SPEC_TTL_S  # not picked again before the pause is read back

    def _drop_adapter(self, adapter: str) -> None:
        """Forget the adapter's slot, gradients and unpublished work on this rank; its items stay queued."""
        self.specs.pop(adapter, None)
        try:
            self.bank.forget(adapter)
        except Exception as exc:  # a half-loaded slot: the bank drops what it can
            self._warn("forget", exc)
        if self.loaded is not None and self.loaded[0] == adapter:
            if self.opt is not None:
                self.opt.zero_grad(set_to_none=True)
            self.loaded, self.model, self.opt = None, None, None
            self._reset_version()

    def _stop_requested(self) -> bool:
        if time.time() - self._stop_checked >= STOP_CHECK_S:
            self._stop_checked = time.time()
            try:
                self._stop = bool(ray.get(self.sup.should_stop.remote(), timeout=10))
            except Exception:
                self._stop = False  # the supervisor is restarting; our fate follows it anyway
        return self._stop

    def _report(self, adapter: str, event: TrainerEvent) -> None:
        try:
            self.sup.record.remote(adapter, event)
        except Exception:
            pass

    def _warn(self, where: str, exc: BaseException | str) -> None:
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        logger.warning("trainer rank %d, %s: %s", self.rank, where, message)
        try:
            self.sup.worker_error.remote(f"rank {self.rank} {where}", message)
        except Exception:
            pass

    # ---- leader: what to do next ---------------------------------------------------------------

    def _spec(self, adapter: str) -> TrainingSpec:
        cached = self.specs.get(adapter)
        if cached is None or time.time() - cached[0] > SPEC_TTL_S:
            info = ray.get(self.store.get_adapter.remote(adapter))
            spec = TrainingSpec(info.name, info.method, info.beta, info.mode, info.learning_rate,
                                info.lora.model_dump(), info.paused_reason is not None, info.tenant)
            self.specs[adapter] = cached = (time.time(), spec)
        return cached[1]

    def _plan(self) -> StepPlan:
        try:
            return self._plan_unsafe()
        except Exception as exc:  # a store or planner hiccup: say so, look again in a moment
            self._warn("plan", exc)
            return StepPlan("idle", sleep=1.0)

    def _idle(self, wake_at: float | None = None) -> StepPlan:
        """Nothing to train now: wait until the store changes (new feedback, a changed adapter), at most
        until ``wake_at`` or IDLE_WAIT_S. A long poll, so an idle trainer costs nothing while the app
        serves, and new feedback is picked up at once."""
        timeout = IDLE_WAIT_S if wake_at is None else max(0.0, min(IDLE_WAIT_S, wake_at - time.time()))
        if self.evaluator is not None and self.evaluator.pending():
            timeout = 0.0  # scoring waits: come back to the loop at once
        self.store_changes = ray.get(self.store.wait_for_change.remote(self.store_changes, timeout),
                                     timeout=timeout + 30)
        return StepPlan("idle")

    def _plan_unsafe(self) -> StepPlan:
        if self._stop_requested():
            return StepPlan("stop")
        # adapter -> (unconsumed, oldest created_at), of this node's partition under per_node
        summary = ray.get(self.store.queue_summary.remote(self.line))
        current = self.loaded[0] if self.loaded else None
        pending = self.micro_done > 0 or self.opt_steps > 0

        now = time.time()

        taken = [it.id for it in self.pending_items] + self.held  # trained into unpublished weights

        def available(name: str) -> int:
            return summary.get(name, (0, None))[0] - (len(taken) if name == current else 0)

        def trainable(name: str) -> bool:
            # Not while the gate judges the adapter's candidate: the next version must start from
            # whatever is served after the verdict, never from weights the gate may reject.
            # A full unit (full_sft/full_dpo) is not a LoRA adapter: actors/full_training.py trains it.
            return (available(name) > 0 and self._spec(name).method not in FULL_METHODS
                    and self._spec(name).mode != "off" and not self._spec(name).paused
                    and not (self.evaluator is not None and self.evaluator.judging(name))
                    and self.not_before.get(name, 0) <= now)

        if pending:
            # One model per process: finish (publish) the adapter in training before switching; also
            # publish what is trained when its next step is refused (publishing needs no grant).
            if trainable(current):
                adapter = current
            else:
                return StepPlan("flush", current)
        else:
            names = sorted(n for n in summary if trainable(n))
            if not names:
                waiting = [self.not_before[n] for n in summary
                           if available(n) > 0 and self.not_before.get(n, 0) > now and self._spec(n).mode != "off"]
                return self._idle(min(waiting) if waiting else None)
            # Fair turns: across tenants first, then across the tenant's adapters (planners/turns.py).
            adapter = self.turns.next(names, {n: self._spec(n).tenant for n in names})
            self.turns.trained(adapter, self._spec(adapter).tenant)
        spec = self._spec(adapter)
        cur = ray.get(self.store.current_version.remote(adapter, self.line))
        target = (cur.version, cur.path) if cur is not None else (None, None)
        held = taken if adapter == current else []
        items = ray.get(self.store.take.remote(adapter, self.t.micro_batch, held, self.line))
        if not items:
            return self._idle()
        more = available(adapter) - len(items) > 0
        return StepPlan("step", adapter, spec, target, tuple(items), last_of_queue=not more,
                        requeued={i.id: self.requeued[i.id] for i in items if i.id in self.requeued})

    # ---- every rank: model, step, version --------------------------------------------------------

    def _ensure_model(self, plan: StepPlan) -> None:
        """Make the adapter's slot compute, from its current published version (or a fresh LoRA) unless the slot
        already holds that version's weights; the base model is never reloaded."""
        adapter, (version, location) = plan.adapter, plan.target
        if self.loaded is not None and self.loaded[0] == adapter and self.loaded[1] != version and (
                self.micro_done or self.opt_steps):
            # The current version moved under unpublished work (a rollback): drop it, train the items again.
            self._report(adapter, WorkDropped())
        path = self.files.local_path(adapter, version, location) if location else None
        spec = plan.spec
        self.model, self.opt = self.bank.train(adapter, spec.lora, version, path, spec.learning_rate)
        if self.loaded != (adapter, version):
            self.loaded = (adapter, version)
            self._reset_version()

    def _reset_version(self) -> None:
        self.micro_done = self.opt_steps = 0
        self.held, self.held_created, self.pending_items = [], [], []
        self.version_samples, self.version_losses = 0, []
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    def _ask_windows(self, plan: StepPlan, passes: dict[int, Any], todo: list[FeedbackItem]
                     ) -> tuple[tuple[GrantedWindow, ...], float]:
        """Ask the planner which windows of this rank's unfinished items may run now on its node."""
        if not todo:
            return (), 0.0
        samples = tuple(SampleProgress(it.id, passes[it.id].length, passes[it.id].done, _arrival(plan, it),
                                       _last_loss(plan, it)) for it in todo)
        ran_s, self.last_round_s = self.last_round_s, 0.0
        used, self.last_memory = self.last_memory, None
        request = GrantRequest(self.node_id, plan.adapter, plan.spec.mode, samples, ran_s, used,
                               offloadable_bytes(self.opt))
        try:
            grant: Grant = ray.get(self.planner.grant.remote(request), timeout=30)
        except Exception as exc:  # planner restarting: treat as "wait", never train unasked
            self._warn("grant", exc)
            return (), MAX_GRANT_SLEEP_S
        if grant.offload_optimizer and self.opt is not None:
            # LEMIX Alg. 2 lines 9–11: free the device for this grant; the state comes back for the optimizer step.
            self.offloaded_bytes += move_optimizer_state(self.opt, "cpu")
        return grant.windows, grant.wait_s

    def _abandon_requested(self, adapter: str) -> bool:
        """Stop, or the adapter's mode became ``off`` mid-step: its unfinished step is dropped."""
        if self._stop_requested():
            return True
        try:
            return self._spec(adapter).mode == "off"
        except Exception:
            return False

    def _step(self, plan: StepPlan) -> None:
        from actors.windowed_pass import WindowedPass, batch_scales

        adapter, spec, items = plan.adapter, plan.spec, plan.items
        bounds = _split(len(items), self.group_world)
        lo, hi = bounds[self.group_rank]
        mine = items[lo:hi]
        # Scales that make the accumulated gradient the mean over the whole micro-step (all ranks'
        # items), over `accumulation` micro-steps; the sum over ranks is then the batch mean.
        # A fault of this adapter's compute (a bad item, a broken slot) is agreed on with the other ranks
        # at the next round's collective, so every rank drops the step together, and the adapter pauses.
        fault: BaseException | None = None
        try:
            scales = batch_scales(self.tok, items, spec.method, scale=1.0 / self.t.accumulation,
                                  max_length=self.t.max_length)[lo:hi]
            passes = {it.id: WindowedPass(self.model, self.tok, it, spec.method, beta=spec.beta,
                                          max_length=self.t.max_length, scale=sc) for it, sc in zip(mine, scales)}
            weight = {it.id: (passes[it.id].loss_tokens if spec.method == "sft" else 1) for it in mine}
        except Exception as exc:
            if _transient(exc):
                raise
            fault, passes, weight = exc, {}, {}
        t_start = time.time()
        run_s, waited_s, windows, loss_sum, weight_sum = 0.0, 0.0, 0, 0.0, 0.0
        item_loss: dict[int, float] = {}  # each item's own loss in this pass, for CheckEnd and its next priority
        while True:
            todo = [it for it in mine if it.id in passes and passes[it.id].done < passes[it.id].length]
            asked = time.time()
            granted, wait = self._ask_windows(plan, passes, todo)
            t0 = time.time()
            if todo and not granted:
                waited_s += t0 - asked  # a refused request waits in the planner for the node's next reports
            mark = memory_mark(self.bank.device) if granted else 0.0
            try:
                for w in granted:
                    sid, start, end = w.sample_id, w.start, w.end
                    p = passes.get(sid)
                    if p is None or start != p.done or end > p.length:
                        continue  # a stale grant (the planner saw an older state): ask again
                    p.forward(end)
                    windows += 1
                    if p.done == p.length:
                        st = p.finish()
                        item_loss[sid] = st.loss  # DPO: −log σ(β·(Δ⁺ − Δ⁻)); SFT: mean token NLL
                        loss_sum += st.loss * weight[sid]
                        weight_sum += weight[sid]
            except Exception as exc:
                if _transient(exc):
                    raise
                fault = exc
            ran = len(granted)
            elapsed = time.time() - t0
            run_s += elapsed
            if ran:
                self.last_round_s = elapsed
                self.last_memory = MemoryUse(ran, max(w.end - w.start for w in granted),
                                             memory_added(self.bank.device, mark))
            left = sum(p.done < p.length for p in passes.values())
            abandon = float(fault is None and self.leader and self._abandon_requested(adapter))
            left_all, ran_all, abandon, wait, failed = self.allreduce(
                [float(left), float(ran), abandon, wait, float(fault is not None)], op="max")
            if abandon or failed:
                for p in passes.values():
                    p.abandon()
                self._drop_micro_steps(adapter)
                if fault is not None:
                    self._adapter_fault(adapter, "step", fault)
                elif failed:
                    self._drop_adapter(adapter)  # another rank's fault: its rank pauses the adapter
                return
            if left_all == 0:
                break
            if ran_all == 0:
                pause = min(max(wait, 0.001), MAX_GRANT_SLEEP_S)
                time.sleep(pause)
                waited_s += pause
        # One collective for the sums and every item's loss and length (each item is in exactly one share).
        sums = self.allreduce([loss_sum, weight_sum, float(sum(p.length for p in passes.values())), float(windows)]
                              + [item_loss.get(it.id, 0.0) for it in items]
                              + [float(passes[it.id].length) if it.id in passes else 0.0 for it in items])
        loss_sum, weight_sum, tokens, windows = sums[:4]
        windows = int(windows)
        # CheckEnd before the optimizer step: a requeued item must not become held (marked consumed at publish).
        requeued = self._check_end(plan, sums[4:4 + len(items)], sums[4 + len(items):]) if self.leader else 0
        self.micro_done += 1
        self.pending_items += items
        loss = loss_sum / max(weight_sum, 1e-12)
        self.version_samples += len(items)
        self.version_losses.append((loss, len(items)))
        flush = plan.last_of_queue
        stepped = self.micro_done >= self.t.accumulation or flush
        if stepped:
            self._optimizer_step()
        if self.leader:
            self._report(adapter, StepDone(samples=len(items), loss=loss, tokens=int(tokens), seconds=run_s,
                                           grant_s=time.time() - t_start - run_s, windows=windows,
                                           shrunk=windows > len(items), optimizer_step=stepped, requeued=requeued))
            if waited_s:
                self._report(adapter, GrantWaited(waited_s))
        if self.opt_steps >= self.t.steps_per_version or (flush and self.opt_steps > 0):
            self._finish_version(plan, flush=False)

    def _check_end(self, plan: StepPlan, losses: list[float], tokens: list[float]) -> int:
        """Report each item's loss in this pass to the planner; its CheckEnd (MACE Alg. 1 lines 17–21) says
        which items to train again. Returns how many were requeued.

        A requeued item is never held, so no version marks it consumed: it stays in the store's queue
        (counted as queued, at-least-once across a crash) and ``take`` hands it out again once the
        optimizer step has applied this pass, with CheckEnd's t_arr and loss for the grants'
        priorities. Its last pass, retired, is held like any item and consumed by that version.
        """
        reports = [PassReport(it.id, int(n), float(loss), _arrival(plan, it), _passes_before(plan, it))
                   for it, loss, n in zip(plan.items, losses, tokens)]
        try:
            verdicts = ray.get(self.planner.report_passes.remote(self.node_id, plan.adapter, plan.spec.mode,
                                                                 reports), timeout=30)
        except Exception as exc:  # planner restarting: one pass per item, as without CheckEnd
            self._warn("report_passes", exc)
            verdicts = [PassVerdict(r.sample_id, "retired", r.passes_before + 1, r.loss, r.arrival) for r in reports]
        for v in verdicts:
            if v.outcome == "requeued":
                self.requeued[v.sample_id] = v
            else:
                self.requeued.pop(v.sample_id, None)
        return sum(v.outcome == "requeued" for v in verdicts)

    def _drop_micro_steps(self, adapter: str) -> None:
        """Forget the gradients not yet applied; their items stay queued (they were never held)."""
        self.opt.zero_grad(set_to_none=True)
        self.micro_done, self.pending_items = 0, []
        self._report(adapter, StepAbandoned())

    def _optimizer_step(self) -> None:
        from actors.lora_training import optimizer_step

        if self.micro_done < self.t.accumulation:
            # A partial accumulation (the queue ran dry): rescale to the mean over the steps taken.
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.t.accumulation / self.micro_done)
        self.allreduce_grads()
        if self.offloaded_bytes:
            move_optimizer_state(self.opt, self.bank.device)  # back from host memory (an offload grant)
            self.offloaded_bytes = 0
        optimizer_step(self.model, self.opt)
        self.micro_done = 0
        self.opt_steps += 1
        if self.leader:
            # Items CheckEnd requeued stay unheld (still queued in the store) until their last pass.
            done = [it for it in self.pending_items if it.id not in self.requeued]
            self.held += [it.id for it in done]
            self.held_created += [it.created_at for it in done]
        self.pending_items = []

    def _finish_version(self, plan: StepPlan, flush: bool) -> None:
        """Apply pending gradients if flushing, then publish on rank 0 and tell every rank how it went."""
        if self.model is None or (flush and self.loaded and self.loaded[0] != plan.adapter):
            return
        if flush and self.micro_done > 0:
            self._optimizer_step()
        if self.opt_steps == 0:
            return
        outcome: PublishOutcome = self.bcast(self._publish(plan.adapter) if self.leader else None)
        adapter = plan.adapter
        if outcome.version is None:
            self.loaded = None  # reload the store's current version before the next step
            self.bank.forget(adapter)
            self._reset_version()
            return
        self.bank.advance(adapter, outcome.version)
        self.loaded = (adapter, outcome.version)
        self._reset_version()
        if self.leader:
            self._evaluate(adapter, outcome)

    def _publish(self, adapter: str) -> PublishOutcome:
        from actors.feedback_models import VersionConflict
        from actors.lora_training import save_adapter_version

        t0 = time.time()
        samples = self.version_samples
        loss = sum(l * n for l, n in self.version_losses) / max(1, sum(n for _, n in self.version_losses))
        parent = self.loaded[1] if self.loaded else None
        marks = [t0]
        try:
            v = ray.get(self.store.reserve_version.remote(adapter, self.line))
            marks.append(time.time())
            saved = save_adapter_version(self.model, self.opt, self.files.save_root(adapter, v.version), adapter,
                                         v.version, {"parent": parent, "samples_trained": samples, "loss": loss,
                                                     "items": len(self.held), "scope": self.t.scope,
                                                     "world_size": self.world, "node": self.line},
                                         peft_name=self.bank.peft_name(adapter))
            path = self.files.publish(adapter, v.version, saved)  # where every node finds it
            marks.append(time.time())
            published = ray.get(self.store.publish_version.remote(adapter, v.version, path, self.held, samples,
                                                                  loss))
            marks.append(time.time())
        except VersionConflict as exc:
            # A rollback moved the current version: drop this work; the items are still queued.
            self._report(adapter, WorkDropped())
            self._warn("publish", exc)
            return PublishOutcome(None)
        except Exception as exc:
            self._warn("publish", exc)
            if not _transient(exc):  # e.g. the version's files could not be written: this adapter's fault
                self._adapter_fault(adapter, "save", exc)
            return PublishOutcome(None)
        created = list(self.held_created)
        if published.state == "candidate":
            # The gate is on: not served until the evaluator passes it (it loads it on the replicas then).
            now = time.time()
            breakdown = dict(zip(("reserve_s", "save_s", "publish_s"),
                                 (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
            self._report(adapter, VersionPublished(v.version, now, now - t0, breakdown, candidate=True))
            return PublishOutcome(v.version, path, True, tuple(created))
        try:
            nodes = [self.node_id] if self.per_node else None  # per_node: only this node serves its copy
            ray.get(self.planner.load_adapter.remote(adapter, v.version, path, nodes), timeout=LOAD_TIMEOUT_S)
        except Exception as exc:  # published in the store; the planner restores it on restart
            self._warn("load_adapter", exc)
        now = time.time()
        marks.append(now)
        breakdown = dict(zip(("reserve_s", "save_s", "publish_s", "load_s"),
                             (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
        self._report(adapter, VersionPublished(v.version, now, now - t0, breakdown,
                                               tuple(round(now - c, 3) for c in created)))
        return PublishOutcome(v.version, path, False, tuple(created))

    # ---- the quality gate and held-out scores --------------------------------------------------------

    def _evaluate(self, adapter: str, outcome: PublishOutcome) -> None:
        if self.evaluator is not None:
            self.evaluator.submit(adapter, outcome.version, outcome.path, candidate=outcome.candidate,
                                  created=list(outcome.created))

    def _resume_gate(self) -> None:
        """Candidates that a previous leader left undecided (it died while the gate judged them) are judged now."""
        try:
            left = ray.get(self.store.candidates.remote(self.line), timeout=60)
        except Exception as exc:
            self._warn("candidates", exc)
            return
        for v in left:
            self.evaluator.submit(v.adapter, v.version, v.path, candidate=True, created=[])


