"""Memory guard before a training step: LEMIX Alg. 2 (§IV-D) as a pure decision object.

LEMIX checks memory before each stage's forward (Alg. 2, line 7: MemoryAvailable against
M_threshold = κ·M_peak, LEMIX §IV-A), waits in steps of Δ_t while it is short (lines 6–8), and after
T_max offloads state to host memory instead of risking an out-of-memory (lines 9–11); after the
run it calibrates its plan from the execution trace (lines 13–17). Here:

- ``decide(used_bytes, batch_size, tokens, waited_s)`` answers ``run``, ``wait`` (for
  ``wait_s``), ``shrink`` (run a smaller batch or a shorter token window), ``offload`` (move the
  optimizer state to host memory, then run) or ``defer`` (give the work back for T_max);
- the need is the cost model's prediction (the activation bytes of the training windows),
  multiplied by a calibration ratio: the largest actual/predicted ratio of the last
  ``calibration_window`` observations (``observe``), at least ``min_ratio``.

Only training is guarded. LEMIX also checks before an inference admission; here vLLM admits
every request itself and holds it in its own queue while its KV block allocator has no room (and
preempts under pressure), so a planner-side check would duplicate that at the cost of a round trip
per request (docs/coserving.md). The KV cache inference holds is counted in ``used_bytes``.

Live caller: the planner's grant path (``Planner._check_memory``). Each grant the node's iteration
scheduler plans (by latency, its bins packed within the cost model's own memory estimate, MACE's P)
is checked against the configured budget with the memory in use now (weights plus the KV cache
the engine holds): ``wait`` answers the trainer "ask
again in ``wait_s``" and the planner keeps the time the work has waited; ``shrink`` grants fewer or
shorter windows; ``offload`` grants them and tells the trainer to move its optimizer state to host
memory first (actors/learning/lora/device_memory.py; a CPU rank has none on a device, so it reports 0 bytes and the
guard never offloads there); ``defer`` gives the work back for T_max. Each grant request carries
what the previous grant's windows really added (GPU: allocator peak; CPU: resident set), which
``observe`` turns into the calibration ratio.

Pure: numbers in, a decision out; no Ray, no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from planners.costs import CostModel, as_cost_model

MemoryAction = Literal["run", "wait", "shrink", "offload", "defer"]


@dataclass(frozen=True)
class MemoryDecision:
    """The guard's answer; ``batch_size`` × ``tokens`` is what may run (the wanted size unless shrunk)."""

    action: MemoryAction
    batch_size: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    need_bytes: float = 0.0
    """Calibrated bytes the granted work needs (of the wanted work for wait / defer)."""
    threshold_bytes: float = 0.0
    reason: str = ""

    @property
    def runs(self) -> bool:
        return self.action in ("run", "shrink", "offload")


class MemoryGuard:
    """LEMIX Alg. 2 (EXECUTETASKMEMORYAWARE) for one node: run, wait up to T_max, then shrink, offload or defer.

    Params: ``cost_model`` (CostModel, profile dict or None: the default); ``threshold_fraction`` and
    ``peak_bytes`` override the model's κ and M_peak (e.g. the device's real size);
    ``t_max_s`` (1.0) T_max; ``check_interval_s`` (0.05) Δ_t; ``optimizer_bytes`` (0) what
    offloading the optimizer state frees (0: offloading is not available); ``min_batch`` (1) and
    ``min_tokens`` (16) the smallest shrunk step worth running; ``calibration_window`` (32)
    observations kept; ``min_ratio`` (0.5) the lowest calibration ratio.

    After T_max, for training: if offloading lets the whole step run, ``offload``; else the largest
    smaller step that fits as is, ``shrink`` (fewer samples first, then, at ``min_batch``, a shorter
    token window, which FlexLLM §6.1's token-level fine-tuning makes equivalent); else the largest
    that fits after offloading, ``offload``; else ``defer``.
    """

    def __init__(
        self,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        threshold_fraction: float | None = None,
        peak_bytes: float | None = None,
        t_max_s: float = 1.0,
        check_interval_s: float = 0.05,
        optimizer_bytes: float = 0.0,
        min_batch: int = 1,
        min_tokens: int = 16,
        calibration_window: int = 32,
        min_ratio: float = 0.5,
    ) -> None:
        self.cost = as_cost_model(cost_model)
        self.threshold_fraction = (
            self.cost.memory.threshold_fraction if threshold_fraction is None else float(threshold_fraction)
        )
        self.peak_bytes = self.cost.memory.peak_bytes if peak_bytes is None else float(peak_bytes)
        if not 0 < self.threshold_fraction <= 1 or self.peak_bytes <= 0:
            raise ValueError("need 0 < threshold_fraction (κ) <= 1 and peak_bytes > 0")
        if t_max_s < 0 or check_interval_s <= 0 or optimizer_bytes < 0:
            raise ValueError("need t_max_s >= 0, check_interval_s > 0, optimizer_bytes >= 0")
        if min_batch < 1 or min_tokens < 1 or calibration_window < 1 or min_ratio <= 0:
            raise ValueError("need min_batch, min_tokens, calibration_window >= 1 and min_ratio > 0")
        self.t_max_s = t_max_s
        self.check_interval_s = check_interval_s
        self.optimizer_bytes = float(optimizer_bytes)
        self.min_batch = min_batch
        self.min_tokens = min_tokens
        self.min_ratio = min_ratio
        self._ratios: deque[float] = deque(maxlen=calibration_window)

    # -- prediction and calibration (LEMIX Alg. 2, lines 13–17) -------------------------------------

    def threshold(self) -> float:
        """M_threshold = κ·M_peak (LEMIX §IV-A)."""
        return self.threshold_fraction * self.peak_bytes

    def raw_need(self, batch_size: int, tokens: int) -> float:
        """The cost model's bytes: activations of B×ℓ training tokens."""
        if batch_size <= 0 or tokens <= 0:
            return 0.0
        return self.cost.activation_bytes(batch_size, tokens)

    def ratio(self) -> float:
        """Calibration: max of actual/predicted over the recent window, at least ``min_ratio`` (1.0 before any)."""
        return max(self.min_ratio, max(self._ratios)) if self._ratios else 1.0

    def need(self, batch_size: int, tokens: int) -> float:
        """Calibrated bytes the work will add: raw need × ratio."""
        return self.raw_need(batch_size, tokens) * self.ratio()

    def observe(self, batch_size: int, tokens: int, actual_bytes: float) -> float:
        """Record what a run really added (peak during it minus before it); returns the new ratio."""
        predicted = self.raw_need(batch_size, tokens)
        if predicted > 0 and actual_bytes >= 0 and math.isfinite(actual_bytes):
            self._ratios.append(actual_bytes / predicted)
        return self.ratio()

    # -- the decision (LEMIX Alg. 2, lines 6–12) --------------------------------------------------

    def fits(self, used_bytes: float, batch_size: int, tokens: int) -> bool:
        """MemoryAvailable(n, s, M_threshold): reported use plus calibrated need stays under κ·M_peak."""
        return used_bytes + self.need(batch_size, tokens) <= self.threshold()

    def largest_fit(self, used_bytes: float, batch_size: int, tokens: int) -> tuple[int, int] | None:
        """The largest (B, ℓ) ≤ (batch_size, tokens) that fits: B first; ℓ only at the smallest B.

        None when not even the minimum fits.
        """
        min_b = min(self.min_batch, batch_size)
        b = batch_size
        while b >= min_b and not self.fits(used_bytes, b, tokens):
            b -= 1
        if b >= min_b:
            return b, tokens
        min_t = min(self.min_tokens, tokens)
        room = self.threshold() - used_bytes
        per_token = self.need(min_b, 1)
        t = tokens if per_token <= 0 else min(tokens, math.floor(room / per_token + 1e-9))
        while t >= min_t and not self.fits(used_bytes, min_b, t):
            t -= 1
        return (min_b, t) if t >= min_t else None

    def decide(
        self,
        used_bytes: float,
        batch_size: int,
        tokens: int,
        waited_s: float = 0.0,
        optimizer_on_device: bool = True,
        optimizer_bytes: float | None = None,
        releasable_bytes: float | None = None,
    ) -> MemoryDecision:
        """LEMIX Alg. 2 for one step: ``used_bytes`` reported now, ``waited_s`` since the work first asked;
        ``optimizer_bytes`` what offloading would free now (None: the guard's ``optimizer_bytes``);
        ``releasable_bytes`` the part of ``used_bytes`` that work in flight will give back (the KV cache inference
        holds; None: unknown, as if all of it might).

        Alg. 2 waits (lines 6–8) for memory that running work frees. When nothing in use is releasable (an idle
        engine holds no KV cache), no wait can change the answer, so the guard decides at once; otherwise every
        round of a step on an idle engine waited the whole T_max before its shrink (measured: docs/testing.md,
        "The ninth stop")."""
        if batch_size < 1 or tokens < 1:
            raise ValueError("batch_size and tokens must be >= 1")
        offloadable = self.optimizer_bytes if optimizer_bytes is None else max(0.0, float(optimizer_bytes))
        thr = self.threshold()
        need = self.need(batch_size, tokens)
        if used_bytes + need <= thr:
            return MemoryDecision("run", batch_size, tokens, 0.0, need, thr, "fits")
        if waited_s < self.t_max_s and (releasable_bytes is None or releasable_bytes > 0):
            wait = min(self.check_interval_s, self.t_max_s - waited_s)
            return MemoryDecision(
                "wait", batch_size, tokens, wait, need, thr, f"{used_bytes + need:.3g} B > threshold {thr:.3g} B"
            )
        can_offload = optimizer_on_device and offloadable > 0
        after = used_bytes - offloadable
        if can_offload and after + need <= thr:
            return MemoryDecision("offload", batch_size, tokens, 0.0, need, thr, "offloading the optimizer state fits")
        fit = self.largest_fit(used_bytes, batch_size, tokens)
        if fit is not None:
            b, t = fit
            return MemoryDecision("shrink", b, t, 0.0, self.need(b, t), thr, f"shrunk to {b}x{t}")
        if can_offload:
            fit = self.largest_fit(after, batch_size, tokens)
            if fit is not None:
                b, t = fit
                return MemoryDecision(
                    "offload", b, t, 0.0, self.need(b, t), thr, f"offloading the optimizer state fits {b}x{t}"
                )
        return MemoryDecision("defer", batch_size, tokens, 0.0, need, thr, f"nothing fits after {waited_s:.2f}s")
