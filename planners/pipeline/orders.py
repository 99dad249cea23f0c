"""Order policies of the stage scheduler: what a free pipeline stage runs next (LEMIX and its baselines, §VI-A).

LEMIX places tasks across nodes and orders them inside a node; on one node the placement choice
is gone and what remains is the order on each stage. Each baseline keeps its own idea there:

- ``lemix``: inference first on every stage (it fills the training pipeline's bubbles, §IV-B);
  a training op waits when it would push the next expected inference request past τ_R (Eq. 4 at
  op grain), and a training forward waits while its stage's memory is short (Alg. 2);
- ``round_robin`` (MIX-RR, NaiveMix): a stage alternates between inference and training ops;
- ``least_utilized`` (MIX-LUF): a stage runs the kind of work that has had the least of its time;
- ``separate`` (SEPARATE): device 0 serves the whole model, the other devices train a pipeline of
  it, and the trained weights are copied to the serving device every ``sync_every`` steps (§V-B).

The mixing baselines admit training whenever the pipeline has room and check no memory; all four
run micro-batches one-forward-one-backward (backward before a new forward).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from planners.pipeline.scheduler import StageScheduler
from planners.pipeline.work import StageOp
from planners.registry import register


def training_order(ops: Sequence[StageOp]) -> list[StageOp]:
    """1F1B on a stage: backward passes first (they free memory and unblock the stage before), then
    forwards of admitted micro-batches, then a new micro-batch; oldest first within each."""
    return sorted((o for o in ops if o.kind == "training"), key=lambda o: (o.phase != "backward", o.arrival))


def first_inference(ops: Sequence[StageOp]) -> StageOp | None:
    inference = [o for o in ops if o.kind == "inference"]
    return min(inference, key=lambda o: o.arrival) if inference else None


@register("stage_order", "lemix")
class LemixStageOrder:
    """LEMIX on one node's stages: serving first, Eq. 4 holds training back, Alg. 2 guards memory.

    ``response_slo_s`` is τ_R (None: ``slo_factor`` × the isolated forward of a mean-length request
    through every stage, LEMIX §VI-A's "5× inference latency"); ``max_defer_s`` bounds how long Eq. 4
    and the memory guard may hold one micro-batch back, so training is slowed under load, never starved.
    """

    layout = "shared"
    sync_every = 0

    def __init__(self, response_slo_s: float | None = None, slo_factor: float = 5.0, max_defer_s: float = 5.0) -> None:
        self.response_slo_s = response_slo_s
        self.slo_factor = slo_factor
        self.max_defer_s = max_defer_s

    def slo(self, node: StageScheduler) -> float:
        """τ_R in seconds."""
        if self.response_slo_s is not None:
            return self.response_slo_s
        return self.slo_factor * node.inference_seconds(node.stream.tokens or 1.0)

    def delays_next_inference(self, op: StageOp, node: StageScheduler, now: float) -> bool:
        """Eq. 4 at op grain: would running ``op`` now push the next expected request past τ_R?

        The request (task_next, a' one mean gap ahead, ℓ' the recent mean prompt) reaches this stage
        after the stages before it; if ``op`` still holds the stage then, its response time is the op's
        end plus its forward through the remaining stages, minus a'.
        """
        arrival = node.stream.next_arrival(now)
        if arrival is None:
            return False
        positions = node.lanes[node.lane_of[op.device]].positions
        per_position = node.inference_seconds(node.stream.tokens or 1.0) / positions
        reaches = arrival + op.position * per_position
        end = now + node.seconds(op)
        if end <= reaches:
            return False
        response = end + (positions - op.position) * per_position - arrival
        return response > self.slo(node)

    def memory_short(self, op: StageOp, node: StageScheduler, now: float) -> bool:
        """Alg. 2 lines 6–8 before a training forward: wait while the stage's held activations plus the
        op's would pass M_threshold; a stage that holds nothing always runs (nothing would free)."""
        guard = node.memory
        if guard is None or op.phase != "forward" or node.held_bytes[op.device] <= 0:
            return False
        waited = now - node.held_since.get(op.task_id, now)
        return guard.decide(node.held_bytes[op.device], op.batch, op.tokens, waited).action != "run"

    def pick(self, device: int, candidates: Sequence[StageOp], node: StageScheduler, now: float) -> StageOp | None:
        inference = first_inference(candidates)
        if inference is not None:
            return inference
        for op in training_order(candidates):
            overdue = now - node.held_since.get(op.task_id, now) >= self.max_defer_s
            if not overdue and (self.delays_next_inference(op, node, now) or self.memory_short(op, node, now)):
                continue
            return op
        return None


class MixedStageOrder(ABC):
    """A plain mix: when a stage has both kinds of op ready, ``serves_first`` decides; otherwise what is there."""

    layout = "shared"
    sync_every = 0

    @abstractmethod
    def serves_first(self, device: int, node: StageScheduler) -> bool:
        """Whether the stage runs the waiting inference op before the training one."""

    def pick(self, device: int, candidates: Sequence[StageOp], node: StageScheduler, now: float) -> StageOp | None:
        inference, training = first_inference(candidates), training_order(candidates)
        if inference is None or not training:
            return inference or (training[0] if training else None)
        return inference if self.serves_first(device, node) else training[0]


@register("stage_order", "round_robin")
class RoundRobinStageOrder(MixedStageOrder):
    """MIX-RR (NaiveMix, LEMIX §III-A) on one node: each stage alternates inference and training ops."""

    def serves_first(self, device: int, node: StageScheduler) -> bool:
        return node.last_kind[device] != "inference"


@register("stage_order", "least_utilized")
class LeastUtilizedStageOrder(MixedStageOrder):
    """MIX-LUF (LEMIX §VI-A) on one node: each stage runs the kind of work that has used it least so far."""

    def serves_first(self, device: int, node: StageScheduler) -> bool:
        used = node.busy_seconds[device]
        return used["inference"] <= used["training"]


@register("stage_order", "separate")
class SeparateStageOrder:
    """SEPARATE (LEMIX §II, §VI-A) on one node: device 0 serves, the rest train; weights sync every
    ``sync_every`` optimizer steps (LEMIX §V-B), a collective that stalls the serving device."""

    layout = "split"

    def __init__(self, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.sync_every = sync_every

    def pick(self, device: int, candidates: Sequence[StageOp], node: StageScheduler, now: float) -> StageOp | None:
        inference = first_inference(candidates)
        if inference is not None:
            return inference
        training = training_order(candidates)
        return training[0] if training else None
