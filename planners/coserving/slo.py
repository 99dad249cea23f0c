"""The SLOs a node's co-serving runs under, checked against the fitted cost profile (FlexLLM §6.2, MACE §4.1).

FlexLLM's token budget fits fine-tuning beside each inference iteration within the time-between-
tokens SLO: s = max{ s : t_iter(c) + ρ·t_ft(s) ≤ SLO }. An SLO below what the hardware can do does
not fail loudly there: every budget is 0 and nothing trains. SmolLM2-135M on a 2-core CPU decodes
in 43–88 ms an iteration, so the old fixed default of 0.1 s left a fine-tuning window almost
nothing. So the default is derived from the profile, and a configured SLO that cannot hold is
named at start-up (``/v1/status``, the log), not silently turned into zero budgets.

The progress bound under load (MACE §4.1 aging) is stated here too: a sample that waits outranks
the running decodes after (π_decode − π_ft)/(δ_ft − δ_decode) seconds, and from then on each grant
runs at least ``min_window_tokens`` of it, delaying the inference beside it by at most
ρ·max(Δ_F(1, m), Δ_B(1, m)) for m = ``min_window_tokens``: a window's worth, forward or backward,
since the trainer sweeps the backward in windows too (FlexLLM Alg. 2 lines 12–21,
``WindowedPass``). A backward grant runs whole (layer, window) units and may overrun its tokens by
less than one unit (a window's tokens times its largest level's share, the head's).
"""

from __future__ import annotations

from dataclasses import dataclass

from planners.coserving.budget import ft_latency
from planners.coserving.priorities import PriorityWeights
from planners.coserving.work import InferenceWork
from planners.costs import CostModel

TBT_ITERATIONS = 4.0
"""The derived TBT SLO, in decode iterations: a fine-tuning window may make a token wait up to three more."""
MIN_TBT_SLO_S = 0.1
"""The derived TBT SLO is never below this (a fast engine's iteration would leave no window at all)."""
REFERENCE_CONTEXT = 256
"""Context tokens of the one decoding sequence whose iteration time the derived SLO multiplies."""


@dataclass(frozen=True)
class SloCheck:
    """The SLOs in force on a node, how they were set, and what the profile says of them."""

    tbt_s: float
    """The TBT SLO the co-serving budget uses (FlexLLM §6.2's SLO)."""
    ttft_s: float
    tbt_derived: bool
    """True when ``training.slo_tbt_s`` was unset and ``tbt_s`` is TBT_ITERATIONS decode iterations."""
    decode_iteration_s: float
    """t_iter of one decoding sequence at REFERENCE_CONTEXT tokens, under the profile."""
    smallest_window_s: float
    """t_iter of that decode plus ρ·t_ft of one ``min_window_tokens`` window: the least a shared window takes."""
    promotion_after_s: float
    """A waiting sample outranks a running decode after this long (MACE §4.1), and is then granted."""
    promoted_delay_s: float
    """The most one promoted window delays the inference beside it: ρ·(a window's forward or backward)."""
    problems: tuple[str, ...] = ()

    @property
    def tbt_source(self) -> str:
        """Where the TBT SLO comes from, in words: the user's objective, or how the default was derived."""
        if not self.tbt_derived:
            return "training.slo_tbt_s (the configured objective)"
        return (
            f"derived: {TBT_ITERATIONS:g} decode iterations of the profile ({self.decode_iteration_s:.3f} s each, "
            f"one sequence at {REFERENCE_CONTEXT} tokens of context), at least {MIN_TBT_SLO_S:g} s; "
            f"set training.slo_tbt_s to make it an objective"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "tbt_s": round(self.tbt_s, 4),
            "ttft_s": self.ttft_s,
            "tbt_derived": self.tbt_derived,
            "tbt_source": self.tbt_source,
            "decode_iteration_s": round(self.decode_iteration_s, 4),
            "smallest_window_s": round(self.smallest_window_s, 4),
            "promotion_after_s": round(self.promotion_after_s, 2),
            "promoted_delay_s": round(self.promoted_delay_s, 4),
            "problems": list(self.problems),
        }


def decode_iteration(cost: CostModel) -> float:
    """t_iter of one sequence decoding at REFERENCE_CONTEXT tokens of context (SamuLLM Eq. 5)."""
    return InferenceWork().plus_decode(REFERENCE_CONTEXT).latency(cost)


def derived_tbt_slo(cost: CostModel) -> float:
    """The default TBT SLO: TBT_ITERATIONS decode iterations of the profile, at least MIN_TBT_SLO_S."""
    return max(MIN_TBT_SLO_S, TBT_ITERATIONS * decode_iteration(cost))


def check_slos(
    cost: CostModel,
    tbt_s: float | None,
    ttft_s: float,
    min_window_tokens: int = 16,
    weights: PriorityWeights | None = None,
) -> SloCheck:
    """The SLOs in force (``tbt_s`` None: derived) and the problems the profile shows with them."""
    w = weights or PriorityWeights()
    decode = decode_iteration(cost)
    tbt = derived_tbt_slo(cost) if tbt_s is None else float(tbt_s)
    rho = cost.ft_interference
    smallest = decode + rho * ft_latency(cost, 1, min_window_tokens)
    problems = []
    if decode > tbt:
        problems.append(
            f"training.slo_tbt_s={tbt:g} s is below one decode iteration ({decode:.3f} s under the "
            f"profile): inference alone breaks it, and fine-tuning runs only when aging promotes a sample"
        )
    elif smallest > tbt:
        problems.append(
            f"training.slo_tbt_s={tbt:g} s leaves no room for a {min_window_tokens}-token fine-tuning "
            f"window beside a decode iteration ({smallest:.3f} s together under the profile): under load "
            f"samples train only when aging promotes them; unset it to derive "
            f"{TBT_ITERATIONS:g} decode iterations ({derived_tbt_slo(cost):.3f} s)"
        )
    if ttft_s < decode:
        problems.append(f"training.slo_ttft_s={ttft_s:g} s is below one decode iteration ({decode:.3f} s)")
    promotion = (w.decode_base - w.ft_base) / max(w.ft_aging - w.decode_aging, 1e-12)
    promoted = (
        rho * max(cost.forward_latency(1, min_window_tokens), cost.backward_latency(1, min_window_tokens)) * cost.stages
    )
    return SloCheck(tbt, ttft_s, tbt_s is None, decode, smallest, promotion, promoted, tuple(problems))
