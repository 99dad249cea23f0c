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
    held-out items both were scored on. The reason says the numbers, so a user can tell why.
    """
    if method not in SCORE:
        raise ValueError(f"unknown training method {method!r}")
    label = _LABEL[SCORE[method]]
    drop = baseline - candidate
    # Rounding noise must not decide: a score equal to the baseline up to float error is not worse.
    passed = drop <= margin + 1e-9
    detail = (f"{label} {candidate:.4g} vs {baseline:.4g} of {baseline_name} on {items} {slice_name}")
    if passed:
        how = "not worse" if drop <= 1e-9 else f"{drop:.4g} worse, within the margin {margin:g}"
        return Verdict(True, f"{detail}: {how}")
    return Verdict(False, f"{detail}: {drop:.4g} worse, more than the margin {margin:g}")
