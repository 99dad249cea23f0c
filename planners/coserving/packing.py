"""MACE Alg. 1 (§4.2): best-fit packing of token windows into micro-batches by memory and latency."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planners.coserving.budget import EPS, ft_latency, ft_memory, window_run_time
from planners.coserving.work import MicroBatch, TokenWindow
from planners.costs import CostModel


def window_alone(cost: CostModel, window: TokenWindow) -> float:
    """A window's latency alone: its phases as the trainer runs them (FlexLLM Alg. 2), or, for a pass without
    phases, forward and backward of its tokens (LEMIX §IV-A's Δ_F + Δ_B)."""
    return window_run_time(cost, window) if window.forward_tokens is not None else ft_latency(cost, 1, window.tokens)


def bin_latency(cost: CostModel, windows: Sequence[TokenWindow]) -> float:
    """A micro-batch's latency: B windows padded to ℓ (LEMIX §IV-A), or, once any window has phases, the sum of
    its windows alone (the trainer runs a forward window and a backward window one after the other)."""
    if any(w.forward_tokens is not None for w in windows):
        return sum(window_alone(cost, w) for w in windows)
    return ft_latency(cost, len(windows), max(w.tokens for w in windows))


def _bin(cost: CostModel, windows: Sequence[TokenWindow]) -> MicroBatch:
    b, padded = len(windows), max(w.tokens for w in windows)
    return MicroBatch(tuple(windows), ft_memory(cost, b, padded), bin_latency(cost, windows))


def best_fit_pack(
    windows: Sequence[TokenWindow],
    cost: CostModel,
    memory_bytes: float,
    latency_cap_s: float = math.inf,
    lambdas: tuple[float, float] = (1.0, 1.0),
    first_bin_fill: float = 1.0,
    max_windows: int | None = None,
) -> list[MicroBatch]:
    """MACE Alg. 1: pack windows (in priority order) into micro-batches ("bins") by best fit.

    A window (m, ℓ) = (its activation bytes, its forward+backward latency) may join bin i if the
    padded bin still fits ``memory_bytes`` (P) and ``latency_cap_s``; among those it joins the bin
    of least f = λ1·|free_i − m|/P + λ2·|maxlat_i − ℓ|/L (MACE §4.2), where free_i is P minus the
    bin's memory, m the memory the window adds to it (padding included), maxlat_i the latency of
    the bin's longest window alone, and L the latency cap (or ℓ when uncapped): the two terms are
    normalised so λ1, λ2 are unitless. No bin fits → a new bin. Line 3 of Alg. 1: stop taking
    windows once bin 1 holds ``first_bin_fill``·P bytes (τ_mem) or ``max_windows`` (τ_task) windows were taken. A window that does
    not fit even alone is skipped. Returns the bins in creation order (bin 1 first).
    """
    lam1, lam2 = lambdas
    bins: list[list[TokenWindow]] = []
    mems: list[float] = []
    taken = 0
    for w in windows:
        if bins and (mems[0] >= first_bin_fill * memory_bytes or (max_windows is not None and taken >= max_windows)):
            break
        if w.tokens <= 0:
            continue
        taken += 1
        m_alone, lat_alone = ft_memory(cost, 1, w.tokens), window_alone(cost, w)
        if m_alone > memory_bytes + EPS or lat_alone > latency_cap_s + EPS:
            continue
        lat_ref = latency_cap_s if math.isfinite(latency_cap_s) and latency_cap_s > 0 else max(lat_alone, EPS)
        best, best_score = None, math.inf
        for i, members in enumerate(bins):
            b, padded = len(members) + 1, max(w.tokens, max(x.tokens for x in members))
            new_mem = ft_memory(cost, b, padded)
            if new_mem > memory_bytes + EPS or bin_latency(cost, [*members, w]) > latency_cap_s + EPS:
                continue
            free = memory_bytes - mems[i]
            maxlat = max(window_alone(cost, x) for x in members)
            score = (
                lam1 * abs(free - (new_mem - mems[i])) / max(memory_bytes, EPS)
                + lam2 * abs(maxlat - lat_alone) / lat_ref
            )
            if score < best_score - EPS:
                best, best_score = i, score
        if best is None:
            bins.append([w])
            mems.append(m_alone)
        else:
            bins[best].append(w)
            mems[best] = ft_memory(cost, len(bins[best]), max(x.tokens for x in bins[best]))
    return [_bin(cost, members) for members in bins]
