"""The quality gate's verdict: may a candidate adapter version be served, given its and the served one's scores."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
          baseline_name: str, slice_name: str = "held-out items", item_changes: Sequence[float] = ()) -> Verdict:
    """Pass iff ``candidate`` is not worse than ``baseline`` by more than ``margin`` (both: higher is better).

    ``baseline_name`` is what was compared with ("v3", "the base model"); ``items`` how many
    held-out items both were scored on; ``item_changes`` (SFT) each item's change of its own mean
    token log-likelihood, candidate minus baseline. The reason says the numbers, so a user can
    tell why, and carries the verdict's own uncertainty: below the items the score needs to show
    a drop of ``margin`` (:func:`resolution`, :func:`needed_items`), a pass says "not enough
    held-out evidence", not "not worse".
    """
    if method not in SCORE:
        raise ValueError(f"unknown training method {method!r}")
    label = _LABEL[SCORE[method]]
    drop = baseline - candidate
    # Rounding noise must not decide: a score equal to the baseline up to float error is not worse.
    passed = drop <= margin + 1e-9
    detail = (f"{label} {candidate:.4g} vs {baseline:.4g} of {baseline_name} on {items} {slice_name}")
    spread = item_spread(item_changes)
    step = resolution(method, items, spread)
    if passed:
        if step > margin:
            # A DPO win rate on n items moves in steps of 1/n: with 6 items, 17 points; an SFT mean moves with its
            # items' noise. A drop of the margin cannot show, so "not worse" would claim what was not measured.
            why = (f"one item moves the {label} by {step:.3g}" if method == "dpo"
                   else f"the items' changes spread {spread:.3g}, so the mean's noise is {step:.3g}")
            return Verdict(True, f"{detail}: not enough held-out evidence to see a drop of {margin:g} ({why}; "
                                 f"{needed_items(method, margin, spread)} items would); no drop measured")
        how = "not worse" if drop <= 1e-9 else f"{drop:.4g} worse, within the margin {margin:g}"
        return Verdict(True, f"{detail}: {how}")
    return Verdict(False, f"{detail}: {drop:.4g} worse, more than the margin {margin:g}")


def item_spread(changes: Sequence[float]) -> float:
    """The sample standard deviation of the items' changes (0 with fewer than two)."""
    if len(changes) < 2:
        return 0.0
    mean = sum(changes) / len(changes)
    return math.sqrt(sum((c - mean) ** 2 for c in changes) / (len(changes) - 1))


def resolution(method: str, items: int, spread: float = 0.0) -> float:
    """The smallest change of the gated score that ``items`` held-out items can show: 1/n for a DPO win rate
    (each pair is won or lost); for an SFT log-likelihood, two standard errors of the mean change,
    2·s/√n with s the items' spread (a paired comparison; the token-weighted mean is taken as the
    mean of the items' means for this bound)."""
    if method == "dpo":
        return 1.0 / max(1, items)
    return 2.0 * spread / math.sqrt(max(1, items))


def needed_items(method: str, margin: float, spread: float = 0.0) -> int:
    """Held-out items before a drop of ``margin`` can show: 1/n ≤ margin for a DPO win rate, 2·s/√n ≤ margin for SFT."""
    if margin <= 0:
        return 0
    if method == "dpo":
        return math.ceil(1.0 / margin)
    return math.ceil((2.0 * spread / margin) ** 2)
