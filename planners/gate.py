"""The quality gate's verdict: may a candidate adapter version be served, given its and the served one's scores."""

from __future__ import annotations

from dataclasses import dataclass

# The held-out score each training method is gated on: a dpo adapter's win rate on held-out
# preference pairs (MACE §3.1), an sft adapter's mean log-likelihood per held-out completion token.
SCORE = {"dpo": "win_rate", "sft": "token_logprob"}
_LABEL = {"win_rate": "win rate", "token_logprob": "token log-likelihood"}


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


def judge(method: str, candidate: float, baseline: float, margin: float, *, items: int,
          baseline_name: str, slice_name: str = "held-out items") -> Verdict:
    """Pass iff ``candidate`` is not worse than ``baseline`` by more than ``margin`` (both: higher is better).

    ``baseline_name`` is what was compared with ("v3", "the base model"); ``items`` how many
    held-out items both were scored on. The reason says the numbers, so a user can tell why, and
    carries the verdict's own uncertainty: below the items a win rate needs to show a drop of
    ``margin`` (:func:`resolution`), a pass says "not enough held-out evidence", not "not worse".
    """
    if method not in SCORE:
        raise ValueError(f"unknown training method {method!r}")
    label = _LABEL[SCORE[method]]
    drop = baseline - candidate
    # Rounding noise must not decide: a score equal to the baseline up to float error is not worse.
    passed = drop <= margin + 1e-9
    detail = (f"{label} {candidate:.4g} vs {baseline:.4g} of {baseline_name} on {items} {slice_name}")
    step = resolution(method, items)
    if passed:
        if step > margin:
            # A DPO win rate on n items moves in steps of 1/n: with 6 items, 17 points. A drop of the margin
            # cannot show, so "not worse" would claim what was not measured; the version is served unproven.
            return Verdict(True, f"{detail}: not enough held-out evidence to see a drop of {margin:g} (one item "
                                 f"moves the {label} by {step:.3g}; {needed_items(margin)} items would); no drop "
                                 f"measured")
        how = "not worse" if drop <= 1e-9 else f"{drop:.4g} worse, within the margin {margin:g}"
        return Verdict(True, f"{detail}: {how}")
    return Verdict(False, f"{detail}: {drop:.4g} worse, more than the margin {margin:g}")


def resolution(method: str, items: int) -> float:
    """The smallest change of the gated score that ``items`` held-out items can show: 1/n for a DPO win rate
    (each pair is won or lost); 0 for an SFT log-likelihood (a mean of continuous values)."""
    return 1.0 / max(1, items) if method == "dpo" else 0.0


def needed_items(margin: float) -> int:
    """Held-out pairs a DPO win rate needs before a drop of ``margin`` can show at all (1/n ≤ margin)."""
    import math

    return math.ceil(1.0 / margin) if margin > 0 else 0
