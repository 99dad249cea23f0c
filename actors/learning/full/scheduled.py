"""ScheduledPipeline: a node's stage actors serve and train at once, each op picked by the stage scheduler.

The node's placement group has one bundle per device; stage actor i sits in bundle i. With a
``shared`` order policy (LEMIX, MIX-RR, MIX-LUF) the S actors form one pipeline (one process group,
a DeepSpeed ``PipelineModule`` slice each) that runs inference passes and training micro-batches;
with ``separate`` (SEPARATE) actor 0 holds the whole model and serves while the others form a
training pipeline, and the trained weights are copied to actor 0 every ``sync_every`` steps.

This object is the thin executor: ``planners.pipeline.StageScheduler`` decides, per free device,
which op runs (``schedule``); this sends the op to the device's actor, chaining the tensors from
stage to stage as Ray objects, and reports each finished op back (``complete``). Every op's start
and end on its device land in ``timeline`` (the Gantt of ``bench/pipeline.py``).

Usage::

    node = ScheduledPipeline(settings, placement_group, order="lemix")
    node.start(); node.profile()                       # fit the stage cost model on this hardware
    node.submit_training("mb-1", batch)                # a TokenBatch micro-batch
    node.submit_inference("req-1", prompt_ids, new_tokens=4)
    node.run()                                         # until both are done
    node.results["req-1"].tokens
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from actors.learning.full.messages import PipelineSettings, StageInfo, StageSetup, TokenBatch
from planners.cost_fitting import fit_stage_latency
from planners.costs import CostModel, default_cost_model
from planners.memory import MemoryGuard
from planners.pipeline import OpDone, PipelineTask, StageOp, StageScheduler, shared_lanes, split_lanes
from planners.registry import create

PLACE_TIMEOUT_S = 300.0
TICK_S = 0.02  # how long the loop waits for a finished op before it looks at arrivals again


@dataclass
class InferenceResult:
    """A served request: the tokens generated, when it arrived, its first token, and when it finished."""

    arrival: float
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None


class ScheduledPipeline:
    """One node's stage actors, driven op by op by the configured stage order policy."""

    def __init__(
        self,
        settings: PipelineSettings,
        placement_group: Any,
        order: str | None = None,
        order_params: dict[str, Any] | None = None,
        cost: CostModel | None = None,
        stage_memory_bytes: float | None = None,
    ) -> None:
        self.settings = settings
        self.pg = placement_group
        self.order_name = order or settings.stage_order
        params = settings.stage_order_params if order is None else (order_params or {})
        self.order = create("stage_order", self.order_name, **params)
        self.cost = cost or default_cost_model()
        self.stage_memory_bytes = stage_memory_bytes
        self.actors: list[Any] = []
        self.info: list[StageInfo] = []
        self.scheduler: StageScheduler | None = None
        self.timeline: list[OpDone] = []
        self.results: dict[str, InferenceResult] = {}
        self.losses: list[float] = []
        self.trained: list[str] = []  # micro-batch ids whose backward finished
        self.scores: dict[str, list[float]] = {}  # scoring task id -> each row's completion log-prob
        self._score_labels: dict[str, Any] = {}  # scoring task id -> ObjectRef of its TokenBatch
        self._batches: dict[str, Any] = {}  # micro-batch id -> ObjectRef of its TokenBatch
        self._ids: dict[str, Any] = {}  # micro-batch id -> ObjectRef of its token ids
        self._outputs: dict[tuple[str, str, int], Any] = {}  # (task, phase, position) -> ObjectRef
        self._inflight: dict[Any, tuple[StageOp, Any]] = {}  # done ref -> (op, output ref)

    # -------------------------------------------------------------------- actors

    @property
    def devices(self) -> int:
        return len(self.pg.bundle_specs)

    def start(self) -> list[StageInfo]:
        """Create stage actor i in bundle i and join them into their pipelines (one, or two when split)."""
        if self.actors:
            return self.info
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.learning.full.stage import PipelineStage

        ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        n = self.devices
        chunks = self.settings.chunks
        lanes = shared_lanes(n, chunks) if self.order.layout == "shared" else split_lanes(n, chunks)
        res = dict(self.settings.stage_resources)
        cpus, gpus = res.pop("CPU", 0.0), res.pop("GPU", 0.0)
        cls = ray.remote(PipelineStage)
        rank = {d: lane.stage_devices.index(d) for lane in lanes for d in lane.stage_devices}
        self.actors = [
            cls.options(
                num_cpus=cpus,
                num_gpus=gpus,
                resources=res or None,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=d),
            ).remote(rank[d])
            for d in range(n)
        ]
        s = self.settings
        setups = []
        for lane in lanes:
            host, port = ray.get(self.actors[lane.stage_devices[0]].address.remote(), timeout=PLACE_TIMEOUT_S)
            setup = StageSetup(
                host=host,
                port=port,
                stages=lane.stages,
                model_dir=s.model_dir,
                partition_method=s.partition_method,
                micro_batch=s.micro_batch,
                accumulation=s.accumulation,
                learning_rate=s.learning_rate,
                beta=s.beta,
                max_grad_norm=s.max_grad_norm,
                seed=s.seed,
                threads=s.threads,
                chunks=chunks,
                schedule="planner",
            )
            setups += [(d, setup) for d in lane.stage_devices]
        refs = {d: self.actors[d].setup.remote(setup) for d, setup in setups}
        self.info = [ray.get(refs[d], timeout=PLACE_TIMEOUT_S) for d in range(n)]
        self.scheduler = StageScheduler(
            n,
            lanes,
            self.order,
            self.cost,
            accumulation=s.accumulation,
            memory=self._memory_guard(),
            max_in_flight=s.max_in_flight,
        )
        return self.info

    def _memory_guard(self) -> MemoryGuard | None:
        """Alg. 2's per-stage guard: M_threshold is ``stage_memory_bytes``; one op (a chunk of a stage) holds
        1/(S·chunks) of the activations the cost model predicts for the node, calibrated from what the
        stages report after each forward."""
        if self.stage_memory_bytes is None:
            return None
        m = self.cost.memory
        share = m.activation_bytes_per_token / (self.devices * self.settings.chunks)
        per_op = replace(self.cost, memory=replace(m, activation_bytes_per_token=share))
        return MemoryGuard(per_op, peak_bytes=self.stage_memory_bytes, threshold_fraction=1.0)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors, self.info, self.scheduler = [], [], None

    def profile(self, lengths: Sequence[int] = (16, 48, 96, 160), batch: int = 1, repeats: int = 3) -> CostModel:
        """Fit the per-stage forward and backward latency (LEMIX §IV-A) from timed ops on every device.

        Each device times a training forward and backward at each length on synthetic input (no weight
        changes), the fastest of ``repeats``; a stage's cost is the mean over the devices, scaled to this
        node's stage count.
        """
        assert self.scheduler is not None, "start() first"
        ray.get([a.profile_op.remote("training", batch, 8) for a in self.actors])  # warm-up
        fwd, bwd = [], []
        lanes = self.scheduler.lanes
        for tokens in lengths:
            for c in (batch, 2 * batch):
                rows = ray.get([a.profile_op.remote("training", c, tokens, repeats) for a in self.actors])
                for d, r in enumerate(rows):
                    # A lane of k stages over an S-device node: scale its per-stage time to the node's S.
                    scale = lanes[self.scheduler.lane_of[d]].stages / self.devices
                    fwd.append({"batch_size": c, "tokens": tokens, "seconds": r["forward"] * scale})
                    bwd.append({"batch_size": c, "tokens": tokens, "seconds": r["backward"] * scale})
        self.cost = replace(
            default_cost_model(),
            forward=fit_stage_latency(fwd),
            backward=fit_stage_latency(bwd),
            stages=self.devices,
            metadata={"source": "ScheduledPipeline.profile"},
        )
        self.scheduler = StageScheduler(
            self.devices,
            lanes,
            self.order,
            self.cost,
            accumulation=self.settings.accumulation,
            memory=self._memory_guard(),
            max_in_flight=self.settings.max_in_flight,
        )
        return self.cost

    # -------------------------------------------------------------------- work in

    def submit_inference(
        self, task_id: str, prompt: Sequence[int], new_tokens: int = 1, arrival: float | None = None
    ) -> None:
        """Queue a greedy generation of ``new_tokens`` after ``prompt`` (each token a pass through every stage)."""
        assert self.scheduler is not None, "start() first"
        if not prompt or new_tokens < 1:
            raise ValueError("an inference task needs a prompt and at least one new token")
        t = time.time() if arrival is None else arrival
        self.results[task_id] = InferenceResult(arrival=t, prompt=list(prompt))
        self.scheduler.add(PipelineTask(task_id, "inference", len(prompt), 1, t, new_tokens))

    def submit_scoring(self, task_id: str, batch: TokenBatch, arrival: float | None = None) -> None:
        """Queue a no-grad pass over ``batch`` that scores it: each row's summed log-prob of its masked
        target tokens (DPO's reference log-probs), in ``scores[task_id]``. An inference task to the scheduler."""
        assert self.scheduler is not None, "start() first"
        rows, length = batch.ids.shape
        t = time.time() if arrival is None else arrival
        self._score_labels[task_id] = ray.put(batch)
        self._ids[task_id] = ray.put(batch.ids)
        self.scheduler.add(PipelineTask(task_id, "inference", int(length), int(rows), t, 1))

    def submit_training(self, task_id: str, batch: TokenBatch, arrival: float | None = None) -> None:
        """Queue one training micro-batch (its loss is the SFT loss, or DPO's when ``batch.ref`` is set)."""
        assert self.scheduler is not None, "start() first"
        self._batches[task_id] = ray.put(batch)
        self._ids[task_id] = ray.put(batch.ids)
        rows, length = batch.ids.shape
        self.scheduler.add(
            PipelineTask(task_id, "training", int(length), int(rows), time.time() if arrival is None else arrival)
        )

    # -------------------------------------------------------------------- the loop

    def run(self, until: float | None = None, feed: Callable[[float], None] | None = None, drain: bool = True) -> None:
        """Run ops until nothing is left (or the clock passes ``until``); ``feed(now)`` submits arrivals.

        With ``until``, training still queued then stays queued; ``drain`` waits for the ops in flight.
        """
        sched = self.scheduler
        assert sched is not None, "start() first"
        while True:
            now = time.time()
            if feed is not None:
                feed(now)
            if until is not None and now >= until:
                break
            # A sync's serving side takes the training stages' exports: dispatch those first.
            for op in sorted(sched.schedule(now), key=lambda o: o.phase == "sync" and o.device == 0):
                self._dispatch(op)
            if not self._inflight:
                if sched.idle and (until is None or feed is None):
                    break
                time.sleep(TICK_S)
                continue
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=TICK_S)
            for ref in ready:
                self._finish(ref)
        while drain and self._inflight:
            ready, _ = ray.wait(list(self._inflight), num_returns=1)
            for ref in ready:
                self._finish(ref)

    def _dispatch(self, op: StageOp) -> None:
        actor = self.actors[op.device]
        out: Any = None
        if op.phase == "forward":
            if op.position > 0 and op.kind == "inference":
                x = self._outputs.pop((op.task_id, "forward", -1))  # one op per device: the device before's
            elif op.position > 0:
                x = self._outputs.pop((op.task_id, "forward", op.position - 1))
            elif op.task_id in self.results:
                import torch

                r = self.results[op.task_id]
                x = torch.tensor([r.prompt + r.tokens])
            else:
                x = self._ids.pop(op.task_id)
            labels = None
            if self._ends_model(op):
                labels = (self._batches if op.kind == "training" else self._score_labels).get(op.task_id)
            out, done = actor.forward_op.options(num_returns=2).remote(op, x, labels)
        elif op.phase == "backward":
            grad = None if self._ends_model(op) else self._outputs.pop((op.task_id, "backward", op.position + 1))
            out, done = actor.backward_op.options(num_returns=2).remote(op, grad)
        elif op.phase == "step":
            done = actor.step_op.remote(op)
        elif op.device == 0:  # sync, the serving side: waits for every training stage's export
            exports = [self._outputs.pop((op.task_id, "sync", d)) for d in range(1, self.devices)]
            done = actor.import_op.remote(op, *exports)
        else:
            out, done = actor.export_op.options(num_returns=2).remote(op)
            self._outputs[(op.task_id, "sync", op.device)] = out
        self._inflight[done] = (op, out)

    def _positions(self, device: int) -> int:
        assert self.scheduler is not None
        return self.scheduler.lanes[self.scheduler.lane_of[device]].positions

    def _ends_model(self, op: StageOp) -> bool:
        """Whether ``op`` runs the model's last layers (an inference op runs to the end of its device)."""
        assert self.scheduler is not None
        return op.position + self.scheduler.span(op) == self._positions(op.device)

    def _finish(self, ref: Any) -> None:
        sched = self.scheduler
        assert sched is not None
        op, out = self._inflight.pop(ref)
        done: OpDone = ray.get(ref)
        self.timeline.append(done)
        last = self._ends_model(op)
        if op.phase in ("forward", "backward") and not (op.kind == "inference" and last):
            if op.phase == "forward" and op.kind == "training" and last:
                self.losses.append(float(ray.get(out)))
            elif op.kind == "inference":
                self._outputs[(op.task_id, "forward", -1)] = out
            elif not (op.phase == "backward" and op.position == 0):
                self._outputs[(op.task_id, op.phase, op.position)] = out
        if op.kind == "inference" and last and op.task_id in self._score_labels:
            self.scores[op.task_id] = [float(x) for x in ray.get(out)]
            del self._score_labels[op.task_id]
        elif op.kind == "inference" and last:
            r = self.results[op.task_id]
            r.tokens += [int(t) for t in ray.get(out).tolist()]
            if r.first_token_at is None:
                r.first_token_at = done.end
        for task_id in sched.complete(done):
            if task_id in self.results:
                self.results[task_id].finished_at = done.end
            elif task_id in self._batches:
                self.trained.append(task_id)
                del self._batches[task_id]
