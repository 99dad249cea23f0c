"""The toy cost model and task builders that the placement unit tests work by hand.

Every number is exact: a training task of ℓ = 100 (C = 1) runs a 1 s forward and a 2 s backward
per stage; an inference prompt of 100 tokens is a 2 s engine iteration, 1 s per stage; answers
are one token long, so nothing decodes.
"""

from __future__ import annotations

from planners import registry
from planners.costs import CostModel, IterationLatency, MemoryModel, OutputLengthCDF, StageLatency
from planners.placement import LemixPlacement, NodeEstimate
from planners.types import NodeView, Task

TOY = CostModel(
    forward=StageLatency(quad=0.0, lin=0.01),
    backward=StageLatency(quad=0.0, lin=0.02),
    iteration=IterationLatency(base=0.0, per_prefill_token=0.02, per_decode_seq=0.0),
    memory=MemoryModel(1, 1, 0, 1e9),
    output_lengths=OutputLengthCDF((1,), (1.0,)),
    stages=2,
)
TWO = [NodeView(0, True), NodeView(1, True)]


def lemix(**kw: object) -> LemixPlacement:
    """LEMIX on the toy, with the knobs that keep hand-computed numbers simple; ``kw`` overrides them."""
    params = dict(
        cost_model=TOY,
        stages=2,
        response_weight=1.0,
        affinity_weight=0.0,
        idle_horizon=10.0,
        deprioritize=False,
        calibration_rate=0.0,
    )
    params.update(kw)
    return registry.create("placement", "lemix", **params)


def train(tid: str, a: float) -> Task:
    """A training task of ℓ = 100 arriving at ``a``."""
    return Task(tid, "training", "m", 50, 50, a, batch_size=1)


def infer(tid: str, a: float, prompt: int = 100) -> Task:
    """A one-token inference request arriving at ``a``."""
    return Task(tid, "inference", "m", prompt, 1, a)


def by_node(estimates: list[NodeEstimate]) -> dict[int, NodeEstimate]:
    return {e.node_id: e for e in estimates}
