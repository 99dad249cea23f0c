"""Executing a plan against the true output lengths, with the §4.3 adjustment at each model finish (SamuLLM §4.3, §5)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planners.costs import CostModel
from planners.offline.devices import DeviceSet, ExecutionPlan, Plan, Stage, TensorParallelScaling, assign_devices
from planners.offline.job import JobGraph
from planners.offline.job_sim import JobSimulator
from planners.offline.search import adjust_stage, select_max


@dataclass(frozen=True)
class Replay:
    """A plan executed in simulation against the true output lengths: the time it took and what ran.

    ``stages`` has one entry per stretch between two model finishes, as actually run after the
    adjustments; ``fallbacks`` counts stretches where the adjusted set could not progress and the
    ready models ran one at a time on every device instead (what the runtime does then).
    """

    actual_s: float
    stages: tuple[Stage, ...]
    fallbacks: int = 0


def _progressing(sim: JobSimulator, run: Sequence[ExecutionPlan]) -> list[ExecutionPlan]:
    """The plans of ``run`` whose inputs are ready within the set, if one of them can finish; else []."""
    plans = {p.model: p for p in run if p.model in sim.unfinished()}
    while True:  # dropping a model can strand its downstream: repeat until stable
        ready = set(sim.ready(plans))
        kept = {m: p for m, p in plans.items() if m in ready}
        if len(kept) == len(plans):
            break
        plans = kept
    if not plans or not math.isfinite(sim.estimate(plans.values()).duration_s):
        return []
    return [plans[m] for m in sim.order if m in plans]


def replay_plan(
    plan: Plan,
    job: JobGraph,
    devices: DeviceSet,
    costs: Mapping[str, CostModel],
    tp_scaling: TensorParallelScaling = TensorParallelScaling(),
) -> Replay:
    """Run ``plan`` in simulation with the true output lengths (``ModelSpec.output_tokens``), no new search.

    This is the running phase of SamuLLM §4.3 with the simulator as the engines: whenever a model
    finishes, :func:`adjust_stage` decides what runs next from the plan, exactly as the Ray runtime
    does, and :meth:`JobSimulator.advance` runs that set (reloads, kept KV caches, pipelined inputs
    as in planning) until the next model finishes. A plan searched with sampled lengths thus meets
    the lengths it did not see; its ``actual_s`` is SamuLLM's inference time (§5), and for a plan
    searched with the true lengths (§5.5) it equals the prediction unless the adjustment deviates.
    """
    sim = JobSimulator(job, devices, costs, known_output_lengths=True, tp_scaling=tp_scaling)
    index, running, stages, fallbacks = -1, (), [], 0
    while not sim.done:
        finished = {m.name for m in job.models if m.name not in sim.unfinished()}
        adj = adjust_stage(plan, index, running, finished, job, devices)
        index, running = adj.stage_index, adj.run
        run = _progressing(sim, adj.run)
        if not run:  # nothing in the adjusted set can finish: the runtime's fallback (Max heuristic)
            fallbacks += 1
            run = list(select_max(sim))
            running = tuple(assign_devices(run, devices))
        stages.append(sim.advance(run))
    return Replay(sim.now_s, tuple(stages), fallbacks)
