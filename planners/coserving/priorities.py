"""MACE §4.1 aging priorities of inference and fine-tune work, and MACE §4.2 CheckEnd for a finished pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planners.coserving.work import FineTuneSample, WorkKind

PRIORITY_SCALE = 1000.0
"""Resolution of ``vllm_priority``: scores closer than 1/1000 share a vLLM priority (arrival breaks the tie)."""


@dataclass(frozen=True)
class PriorityWeights:
    """π_w, δ_w and γ of MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr) (+ γ·L_DPO for fine-tune samples).

    MACE requires π_decode > π_prefill > π_ft (serve inference first, avoid preempting decodes)
    and δ_ft > δ_prefill > δ_decode (fine-tuning ages fastest, so it cannot starve); both are
    checked. Rates are per second. With the defaults a fresh fine-tune sample of zero loss
    outranks a prefill that arrived with it after (1 − 0)/(0.1 − 0.01) ≈ 11 s, a decode after ≈ 20 s.
    """

    pi_decode: float = 2.0
    pi_prefill: float = 1.0
    pi_ft: float = 0.0
    delta_decode: float = 0.001
    delta_prefill: float = 0.01
    delta_ft: float = 0.1
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not self.pi_decode > self.pi_prefill > self.pi_ft:
            raise ValueError("MACE §4.1 needs pi_decode > pi_prefill > pi_ft")
        if not self.delta_ft > self.delta_prefill > self.delta_decode >= 0:
            raise ValueError("MACE §4.1 needs delta_ft > delta_prefill > delta_decode >= 0")
        if self.gamma < 0:
            raise ValueError("gamma must be >= 0")

    def base(self, kind: WorkKind) -> float:
        return {"decode": self.pi_decode, "prefill": self.pi_prefill, "ft": self.pi_ft}[kind]

    def rate(self, kind: WorkKind) -> float:
        return {"decode": self.delta_decode, "prefill": self.delta_prefill, "ft": self.delta_ft}[kind]


def priority(kind: WorkKind, arrival: float, now: float, weights: PriorityWeights, dpo_loss: float = 0.0) -> float:
    """MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr), plus γ·L_DPO for a fine-tune sample (P_ft^total)."""
    p = weights.base(kind) + weights.rate(kind) * max(0.0, now - arrival)
    if kind == "ft":
        p += weights.gamma * max(0.0, dpo_loss)
    return p


def vllm_priority(score: float, scale: float = PRIORITY_SCALE) -> int:
    """vLLM's per-request ``priority`` for a MACE score: a higher score gives a lower number, which vLLM runs first."""
    return -round(score * scale)


def as_priority_weights(value: PriorityWeights | Mapping[str, float] | None) -> PriorityWeights:
    if value is None:
        return PriorityWeights()
    return value if isinstance(value, PriorityWeights) else PriorityWeights(**dict(value))


def check_end(sample: FineTuneSample, loss_threshold: float | None, max_passes: int) -> bool:
    """MACE §4.2 CheckEnd for a fine-tune sample whose pass just completed: True retires it.

    It stays (is requeued) while its DPO loss is above ``loss_threshold`` and it has run fewer than
    ``max_passes`` passes; ``loss_threshold=None`` means one pass per sample.
    """
    if loss_threshold is None or sample.passes >= max_passes:
        return True
    return sample.dpo_loss <= loss_threshold
