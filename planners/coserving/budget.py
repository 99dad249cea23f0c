"""The cost of one iteration window and the fine-tune token budget that fits the SLO (FlexLLM §6.2, LEMIX §IV-A)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from planners.coserving.work import InferenceWork, MicroBatch, TokenWindow
from planners.costs import CostModel

EPS = 1e-12
"""Slack in the floating-point comparisons of budgets and room."""


def ft_latency(cost: CostModel, batch: int, tokens: int) -> float:
    """S·(Δ_F(B, ℓ) + Δ_B(B, ℓ)): forward and backward of B windows padded to ℓ tokens (LEMIX §IV-A)."""
    if batch <= 0 or tokens <= 0:
        return 0.0
    return cost.stages * (cost.forward_latency(batch, tokens) + cost.backward_latency(batch, tokens))


def window_phase_times(cost: CostModel, window: TokenWindow) -> tuple[float, float]:
    """(forward, backward) seconds the trainer takes to run ``window`` alone, as it really runs it.

    A window of a pass with phases (``forward_tokens`` set: FlexLLM Alg. 2's forward windows, then
    its backward windows) pays Δ_F of its forward tokens and Δ_B of its backward token-equivalents.
    A window of a pass without phases pays its forward, and, when it completes the sample, the
    backward of the whole sample: the trainer's earlier pass swept it at once once the loss was
    known. :func:`ft_latency` prices forward and backward per window, right over a whole pass but
    not for any one grant (LEMIX Alg. 2 calibrates against this).
    """
    forward, backward = window.phases
    return (
        cost.stages * cost.forward_latency(1, forward) if forward > 0 else 0.0,
        cost.stages * cost.backward_latency(1, backward) if backward > 0 else 0.0,
    )


def window_run_time(cost: CostModel, window: TokenWindow) -> float:
    """Seconds the trainer takes to run ``window`` alone (:func:`window_phase_times`, both phases)."""
    forward, backward = window_phase_times(cost, window)
    return forward + backward


def grant_phase_times(cost: CostModel, windows: Iterable[TokenWindow]) -> tuple[float, float]:
    """(forward, backward) seconds the trainer takes to run ``windows`` one after another."""
    forward = backward = 0.0
    for w in windows:
        f, b = window_phase_times(cost, w)
        forward, backward = forward + f, backward + b
    return forward, backward


def tokens_within_seconds(cost: CostModel, window: TokenWindow, seconds: float) -> int:
    """The most tokens t ≤ ``window.tokens`` with ``window`` cut to [start, start + t) running within ``seconds``."""
    lo, hi = 0, window.tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if window_run_time(cost, replace(window, end=window.start + mid)) <= seconds + EPS:
            lo = mid
        else:
            hi = mid - 1
    return lo


def grant_run_time(cost: CostModel, windows: Iterable[TokenWindow]) -> float:
    """Seconds the trainer takes to run ``windows`` (:func:`grant_phase_times`, both phases)."""
    forward, backward = grant_phase_times(cost, windows)
    return forward + backward


def ft_memory(cost: CostModel, batch: int, tokens: int) -> float:
    """Activation bytes of B windows padded to ℓ tokens (LEMIX §IV-A memory term)."""
    if batch <= 0 or tokens <= 0:
        return 0.0
    return cost.activation_bytes(batch, tokens)


def window_latency(cost: CostModel, work: InferenceWork, ft_tokens: int) -> float:
    """f(c, s) of FlexLLM §6.2: t_iter(c) + ρ·t_ft(s), with the s fine-tune tokens as one window.

    ρ is ``cost.ft_interference`` (1: the two take turns on the device, as in FlexLLM).
    """
    return work.latency(cost) + cost.ft_interference * ft_latency(cost, 1, ft_tokens)


def ft_tokens_within(cost: CostModel, seconds: float) -> int:
    """The largest s with t_ft(s) ≤ ``seconds``: fine-tuning tokens one window of that length holds."""
    return token_budget(replace(cost, ft_interference=1.0), InferenceWork(), seconds)


def ft_room(cost: CostModel, room_s: float) -> float:
    """Seconds of fine-tuning work (alone) that delay inference by ``room_s``: room/ρ (∞ when ρ = 0)."""
    interference = cost.ft_interference
    return math.inf if interference <= 0 else max(0.0, room_s) / interference


def ft_delay(cost: CostModel, bins: Iterable[MicroBatch]) -> float:
    """Seconds the fine-tuning of ``bins`` delays the inference beside it: ρ·Σ t_ft (FlexLLM §6.2)."""
    return cost.ft_interference * sum(mb.latency_s for mb in bins)


def token_budget(cost: CostModel, work: InferenceWork, slo_s: float, cap: int = 1 << 24) -> int:
    """FlexLLM §6.2: s = max{ s ∈ [0, cap] : f(c, s) ≤ SLO }, 0 when not even one token fits.

    Solved exactly: t_ft(s) = a·s² + b·s + k for s ≥ 1 (a, b, k summed over forward and backward,
    times the stage count), so s is the floor of the positive root of a·s² + b·s + k = SLO − t_iter(c),
    then nudged by ±1 against float rounding. Needs non-negative coefficients (``fit_linear``
    guarantees them), which make f monotone in s.
    """
    fw, bw = cost.forward, cost.backward
    if min(fw.quad, fw.lin, fw.const, bw.quad, bw.lin, bw.const) < 0:
        raise ValueError("token_budget needs non-negative stage latency coefficients")
    left = slo_s - work.latency(cost)
    room = ft_room(cost, left) if left >= 0 else -1.0
    if cap < 1 or room < ft_latency(cost, 1, 1):
        return 0
    if math.isinf(room):
        return cap
    a = cost.stages * (fw.quad + bw.quad)
    b = cost.stages * (fw.lin + bw.lin)
    k = cost.stages * (fw.const + bw.const)
    if a > 0:
        s = (-b + math.sqrt(b * b + 4 * a * (room - k))) / (2 * a)
    elif b > 0:
        s = (room - k) / b
    else:
        s = float(cap)
    s_int = max(1, min(cap, math.floor(s)))
    while s_int > 1 and window_latency(cost, work, s_int) > slo_s:
        s_int -= 1
    while s_int < cap and window_latency(cost, work, s_int + 1) <= slo_s:
        s_int += 1
    return s_int
