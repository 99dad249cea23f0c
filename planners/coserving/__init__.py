"""Co-serving on one node: iteration scheduling of prefill, decode and fine-tune work (MACE §4.1–§4.2, FlexLLM §6, §8.2).

One scheduler object per node, in the manner of nano-vllm's scheduler: inference requests and
fine-tune samples enter queues, and ``schedule(now)`` returns a :class:`WindowPlan` for the next
iteration window: which waiting inference requests the replica submits now and with which vLLM
priority, and which fine-tune micro-batches the trainer runs, each a list of token windows.

Protocol (the planner actor owns one scheduler per node). In the running app (``actors/planner.py``)
the replica, not the scheduler, submits inference requests (vLLM admits them as they arrive), and
the trainer owns its samples' progress, so each grant replaces the queues with what was observed:
``observe(EngineFacts)`` from the replica's latest report and ``set_samples(...)`` from the trainer's
request, then ``schedule(now, free_bytes)``; the granted windows go back to the trainer. The
trainer's samples carry their last reported loss (the γ·L_DPO term of MACE §4.1) and their t_arr;
after each micro-step the trainer reports every finished pass with ``report_pass`` (CheckEnd,
MACE Alg. 1 lines 17–21) and trains a requeued sample again in a later micro-step. The
step-by-step protocol below is the one the simulator and the tests drive:

- replica → ``add_request(InferenceRequest)`` on arrival, ``update_request(id, output_tokens)``
  after iterations (returns True once ``max_tokens`` is reached: MACE's CheckEnd for inference),
  ``finish(id)`` on EOS / abort;
- feedback → ``add_sample(FineTuneSample)`` with the sample's tokens and, once known, its last
  DPO loss;
- each window → ``plan = schedule(now, free_bytes)``; the replica submits ``plan.admitted`` in order
  with ``Admission.priority`` as vLLM's per-request ``priority`` (engine built with
  ``scheduling_policy="priority"``); the trainer runs ``plan.micro_batches`` one after another
  (gradient accumulation; ``TokenWindow.start/end`` slice the sample's sequence) unless
  ``plan.inference_paused`` says the engine idles this window (temporal sharing);
- trainer → ``report_sample(id, now, tokens_done, dpo_loss)`` for every granted window (CheckEnd:
  retire, or requeue while the DPO loss stays above ``loss_threshold``), ``release(id)`` for a
  window it did not run (e.g. the memory guard of ``planners/memory.py`` said "defer").

vLLM priority mapping. MACE's priority P is "higher runs first"; vLLM's ``priority`` is "lower runs
first" (ties by arrival). ``vllm_priority(P) = -round(P · 1000)`` maps one to the other at the
moment of submission; vLLM keeps that number, so aging after submission is not seen by the engine
(vLLM #19057: it reorders only its waiting queue and preempts only under KV pressure). Admission
control, and with it aging, therefore stays here: the scheduler submits only what should run now.

Cost of a window (FlexLLM §6.2, with the shared cost model of ``planners/costs.py``):
f(c, s) = t_iter(c) + t_ft(s), where t_iter is SamuLLM Eq. 5 for the window's inference work c
(0 when there is none) and t_ft(s) = S·(Δ_F(1, s) + Δ_B(1, s)) is one forward and backward pass
over a window of s fine-tune tokens on the node's S stages (LEMIX §IV-A). The two add: the trainer
and the engine share the devices, so fine-tune work lengthens the window the inference tokens
wait in. A micro-batch of B windows is padded to its longest window ℓ: its memory is the
activation bytes of B·ℓ tokens and its latency S·(Δ_F(B, ℓ) + Δ_B(B, ℓ)).

Policies (registry kind ``iteration``): ``hybrid`` (ours), ``fcfs``, ``temporal``, ``ft_first``,
``periodic``, ``separate``; all share the queues and the protocol above.

Modules, each one concept (pure: plain dataclasses in, a plan out; no Ray, no torch, no I/O):

- ``work``: the items (inference requests, fine-tune samples, token windows, the engine's facts);
- ``priorities``: MACE's aging priorities and CheckEnd;
- ``budget``: the cost of a window and FlexLLM's token budget;
- ``packing``: MACE's best-fit packing into micro-batches;
- ``scheduler``: the queues and protocol every policy shares, and the plan it returns;
- ``policies``: the six registered policies;
- ``calibration``: the live refit of the fine-tuning window cost from measured windows.
"""

from __future__ import annotations

from planners.coserving.budget import (ft_delay, ft_latency, ft_memory, ft_room, ft_tokens_within, token_budget,
                                       window_latency)
from planners.coserving.calibration import WindowCostCalibration, WindowCostSample
from planners.coserving.packing import best_fit_pack
from planners.coserving.priorities import PRIORITY_SCALE, PriorityWeights, check_end, priority, vllm_priority
from planners.coserving.scheduler import Admission, IterationScheduler, WindowPlan
from planners.coserving.work import (EngineFacts, FineTuneSample, InferenceRequest, InferenceWork, LiveRequest,
                                     MicroBatch, SampleOutcome, TokenWindow, WorkKind, token_windows, whole_windows)

__all__ = [
    "Admission",
    "EngineFacts",
    "FineTuneSample",
    "InferenceRequest",
    "InferenceWork",
    "IterationScheduler",
    "LiveRequest",
    "MicroBatch",
    "PRIORITY_SCALE",
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
    "ft_memory",
    "ft_room",
    "ft_tokens_within",
    "priority",
    "token_budget",
    "token_windows",
    "vllm_priority",
    "whole_windows",
    "window_latency",
]
