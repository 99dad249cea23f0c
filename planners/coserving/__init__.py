"""Co-serving on one node: how much fine-tuning runs beside the engine's inference, window by window
(MACE §4.1–§4.2, FlexLLM §6, §8.2).

One scheduler object per node, in the manner of nano-vllm's scheduler: it holds the node's
inference requests and fine-tune samples, and ``schedule(now)`` returns a :class:`WindowPlan` for
the next iteration window: the inference work c it assumes the engine runs, and the fine-tune
micro-batches the trainer may run beside it, each a list of token windows.

Protocol (the planner actor, ``actors/control/planner.py``, owns one scheduler per node). vLLM starts
every inference request as it arrives, and the trainer owns its samples' progress, so each grant
replaces the queues with what was observed: ``observe(EngineFacts)`` from the replica's latest
report (requests in flight, engine iterations) and ``set_samples(...)`` from the trainer's request;
``observe_ft_run`` with the seconds the previous grant's windows took; then
``schedule(now, free_bytes)``, whose windows go back to the trainer (after the memory guard of
``planners/memory.py``). The trainer's samples carry their last reported loss (the γ·L_DPO term
of MACE §4.1) and their t_arr; after each micro-step the trainer reports every finished pass with
``report_pass`` (CheckEnd, MACE Alg. 1 lines 17–21) and trains a requeued sample again later.

Inference order is vLLM's. MACE §4.1 also orders prefills by priority; here the planner never
holds a request back and vLLM's ``priority`` is not fed: a prefill's priority at submission is
the same for every request, vLLM never re-reads it (aging is invisible to it), and vLLM's queue
is empty almost always (docs/coserving.md, "Admission by priority: measured, then removed"). The
priorities still rank fine-tune samples, and an aged sample against the inference beside it.

Cost of a window (FlexLLM §6.2, with the shared cost model of ``planners/costs.py``):
f(c, s) = t_iter(c) + ρ·t_ft(s), where t_iter is SamuLLM Eq. 5 for the window's inference work c
(0 when there is none) and t_ft(s) = S·(Δ_F(1, s) + Δ_B(1, s)) is one forward and backward pass
over a window of s fine-tune tokens on the node's S stages (LEMIX §IV-A). The two add: the trainer
and the engine share the devices, so fine-tune work lengthens the window the inference tokens
wait in, by ρ (the profile's ``ft_interference``) engine seconds per second of fine-tuning. A
micro-batch of B windows is padded to its longest window ℓ: its memory is the activation bytes
of B·ℓ tokens and its latency S·(Δ_F(B, ℓ) + Δ_B(B, ℓ)).

Policies (registry kind ``iteration``): ``hybrid`` (ours), ``fcfs``, ``temporal``, ``ft_first``,
``periodic``, ``separate``; all share the queues and the protocol above.

Modules, each one concept (pure: plain dataclasses in, a plan out; no Ray, no torch, no I/O):

- ``work``: the items (inference requests, fine-tune samples, token windows, the engine's facts);
- ``priorities``: MACE's aging priorities and CheckEnd;
- ``budget``: the cost of a window and FlexLLM's token budget;
- ``packing``: MACE's best-fit packing into micro-batches;
- ``scheduler``: the queues and protocol every policy shares, and the plan it returns;
- ``policies``: the six registered policies;
- ``calibration``: the live refits of the window cost (t_ft per phase, t_iter, ρ) from what ran;
- ``measurement``: each grant measured against its prediction, and the SLO attainment beside it.
"""

from __future__ import annotations

from planners.coserving.budget import (
    ft_delay,
    ft_latency,
    ft_memory,
    ft_room,
    ft_tokens_within,
    grant_phase_times,
    grant_run_time,
    token_budget,
    window_latency,
)
from planners.coserving.calibration import InterferenceCalibration, WindowCostCalibration, WindowCostSample, calibrated
from planners.coserving.measurement import (
    SloAttainment,
    TrainingTimeline,
    WindowMeasurement,
    WindowPrediction,
    WindowRun,
    measure_window,
)
from planners.coserving.packing import best_fit_pack
from planners.coserving.priorities import PriorityWeights, check_end, priority
from planners.coserving.scheduler import IterationScheduler, WindowPlan
from planners.coserving.work import (
    EngineFacts,
    EngineIteration,
    FineTuneSample,
    InferenceWork,
    LiveRequest,
    MicroBatch,
    SampleOutcome,
    TokenWindow,
    WorkKind,
    token_windows,
    whole_windows,
)

__all__ = [
    "EngineFacts",
    "EngineIteration",
    "InterferenceCalibration",
    "SloAttainment",
    "TrainingTimeline",
    "WindowMeasurement",
    "WindowPrediction",
    "WindowRun",
    "calibrated",
    "grant_phase_times",
    "measure_window",
    "FineTuneSample",
    "InferenceWork",
    "IterationScheduler",
    "LiveRequest",
    "MicroBatch",
    "PriorityWeights",
    "SampleOutcome",
    "TokenWindow",
    "WindowCostCalibration",
    "WindowCostSample",
    "WindowPlan",
    "WorkKind",
    "best_fit_pack",
    "check_end",
    "ft_delay",
    "ft_latency",
    "grant_run_time",
    "ft_memory",
    "ft_room",
    "ft_tokens_within",
    "priority",
    "token_budget",
    "token_windows",
    "whole_windows",
    "window_latency",
]
