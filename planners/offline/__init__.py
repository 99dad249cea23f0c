"""Execution stages for offline multi-LLM jobs: which models run together, with which (dp, tp), on which devices.

Source: SamuLLM. The pieces, each citing its section, one module each:

- output-length sampling from a per-model eCDF, truncated at the output limit (§2, §4.1):
  :func:`sample_output_lengths`, :func:`output_cdf_from_pairs`;
- the request-scheduling simulator of one engine (§2 "The inference process can be simulated",
  §4.1) with per-iteration latency from the shared cost model (Eq. 5): :func:`simulate_engine`,
  and of one model with ``dp`` replicas plus its load time: :func:`simulate_model`;
- execution plans (Eq. 3, valid under device memory) and stages (Eq. 4): :class:`ExecutionPlan`,
  :class:`Stage`, :func:`valid_plans`; the stage-level simulator over the application DAG (§3, §4.1
  "topological order", self-loop fusion of §4.2): :class:`JobSimulator`;
- the greedy stage search with preemption (§4.2, Algorithm 1) and the baselines of §5
  (Max-heuristic, Min-heuristic, no-preemption and known-output-length variants of §5.5):
  registry kind ``stages``, names ``greedy``, ``max``, ``min``;
- our planner, not in SamuLLM: a portfolio of base policies (keep running plans; list schedules of
  per-model targets from the moldable bound), the pilot method on the best one, and the baselines'
  whole plans as candidates, so it is never predicted slower than any of them: name ``search``
  (:class:`SearchStages`, :func:`moldable_bound`);
- link-aware device choice minimising reloads and the dynamic re-adjustment of the running phase
  (§4.3): :func:`assign_devices`, :func:`adjust_stage`.

Pure: plain data in and out, numpy only; no Ray, torch, vLLM or I/O (docs/architecture.md). The only clock
read is ``time.perf_counter`` for :attr:`Plan.search_time_s`, which is reported, never decided on.

Assumptions worth knowing (each repeated where it is used):

- Work is measured as ``weight_bytes × tokens processed``: proportional to the FLOPs of §3's stage
  throughput (2·params FLOPs per token) without needing a FLOP count per model.
- Tensor parallelism scales the per-token and per-sequence terms of Eq. 5 by a speedup
  ``tp·efficiency^log2(tp)`` and leaves the per-iteration constant alone (:class:`TensorParallelScaling`),
  unless the caller supplies a profiled cost model for that degree under the key ``"<model>@tp<k>"``.
- A request preempted at a stage boundary keeps the tokens it generated: it restarts with them
  appended to its prompt (re-prefill), unless its model keeps the same plan, in which case it keeps
  decoding with its KV cache. A change of tp reloads every replica (load time from the table); a
  change of dp alone keeps the common replicas running and loads only the added ones.
"""

from __future__ import annotations

from planners.offline.devices import (
    DeviceSet,
    ExecutionPlan,
    Plan,
    Stage,
    StageEstimate,
    TensorParallelScaling,
    assign_devices,
    iteration_cost,
    pack_devices,
    place_stages,
    valid_plans,
)
from planners.offline.engine_sim import (
    EPS,
    EngineLimits,
    EngineRun,
    IterationSegment,
    ModelRun,
    replica_of,
    simulate_engine,
    simulate_model,
)
from planners.offline.job import Edge, JobGraph, ModelSpec, chain_maps, fuse_self_loops
from planners.offline.job_sim import JobSimulator
from planners.offline.lengths import output_cdf_from_pairs, sample_output_lengths
from planners.offline.plan_search import MoldableBound, SearchStages, moldable_bound, select_keep, shaped_policy
from planners.offline.replay import Replay, replay_plan
from planners.offline.search import (
    Adjustment,
    GreedyStages,
    MaxStages,
    MinStages,
    Selector,
    StagePlanner,
    adjust_stage,
    select_greedy,
    select_max,
    select_min,
)

__all__ = [
    "Adjustment",
    "DeviceSet",
    "EPS",
    "Edge",
    "EngineLimits",
    "EngineRun",
    "ExecutionPlan",
    "GreedyStages",
    "IterationSegment",
    "JobGraph",
    "JobSimulator",
    "MoldableBound",
    "MaxStages",
    "MinStages",
    "ModelRun",
    "ModelSpec",
    "Plan",
    "Replay",
    "SearchStages",
    "Selector",
    "Stage",
    "StageEstimate",
    "StagePlanner",
    "TensorParallelScaling",
    "adjust_stage",
    "assign_devices",
    "chain_maps",
    "fuse_self_loops",
    "iteration_cost",
    "moldable_bound",
    "output_cdf_from_pairs",
    "pack_devices",
    "place_stages",
    "replay_plan",
    "replica_of",
    "sample_output_lengths",
    "select_keep",
    "shaped_policy",
    "select_greedy",
    "select_max",
    "select_min",
    "simulate_engine",
    "simulate_model",
    "valid_plans",
]
