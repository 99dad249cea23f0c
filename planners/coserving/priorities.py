"""MACE §4.1 aging priorities of inference and fine-tune work, and MACE §4.2 CheckEnd for a finished pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planners.coserving.work import FineTuneSample, WorkKind


@dataclass(frozen=True)
class PriorityWeights:
    """π_w, δ_w and γ of MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr) (+ γ·L_DPO for fine-tune samples).

    MACE requires π_decode > π_prefill > π_ft (serve inference first, avoid preempting decodes)
    and δ_ft > δ_prefill > δ_decode (fine-tuning ages fastest, so it cannot starve); both are
    checked. Rates are per second. With the defaults a fresh fine-tune sample of zero loss
    outranks a prefill that arrived with it after (1 − 0)/(0.5 − 0.01) ≈ 2 s, a decode after ≈ 4 s:
    the promotion that bounds a sample's wait under load (``planners/coserving/slo.py``). (An
    earlier δ_ft of 0.1 meant 11 s and 20 s: measured with SmolLM2 beside two closed-loop clients
    on a 2-core CPU, where the budget is mostly 0, items then waited 11 s at the median.)

    Fields: ``*_base`` are π_decode, π_prefill, π_ft; ``*_aging`` are δ_decode, δ_prefill, δ_ft;
    ``loss_weight`` is γ, the weight of the sample's last loss.
    """

    decode_base: float = 2.0
    prefill_base: float = 1.0
    ft_base: float = 0.0
    decode_aging: float = 0.001
    prefill_aging: float = 0.01
    ft_aging: float = 0.5
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.decode_base > self.prefill_base > self.ft_base:
            raise ValueError("MACE §4.1 needs decode_base > prefill_base > ft_base")
        if not self.ft_aging > self.prefill_aging > self.decode_aging >= 0:
            raise ValueError("MACE §4.1 needs ft_aging > prefill_aging > decode_aging >= 0")
        if self.loss_weight < 0:
            raise ValueError("loss_weight must be >= 0")

    def base(self, kind: WorkKind) -> float:
        return {"decode": self.decode_base, "prefill": self.prefill_base, "ft": self.ft_base}[kind]

    def rate(self, kind: WorkKind) -> float:
        return {"decode": self.decode_aging, "prefill": self.prefill_aging, "ft": self.ft_aging}[kind]


def priority(kind: WorkKind, arrival: float, now: float, weights: PriorityWeights, dpo_loss: float = 0.0) -> float:
    """MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr), plus γ·L_DPO for a fine-tune sample (P_ft^total)."""
    p = weights.base(kind) + weights.rate(kind) * max(0.0, now - arrival)
    if kind == "ft":
        p += weights.loss_weight * max(0.0, dpo_loss)
    return p


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
