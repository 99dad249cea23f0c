"""The quality gate's verdict: may a candidate adapter version be served, given its held-out and retention scores.

Two questions, two scores (docs/learning.md §7):

- **Did it forget?** The candidate's retention score (:func:`judge_retention`): how well it keeps the
  base model's own greedy answers to general prompts no tenant taught (a shipped set, or the
  adapter's ``gate.retention_file``). A loss of more than ``retention_margin`` rejects it.
- **Did the taught behaviour improve?** Its score on the adapter's own held-out slice (:func:`judge`),
  against the version served now. A drop of more than ``margin`` rejects it.

:func:`decide` combines them. When the held-out slice is too small to see a drop of ``margin``
(one item has no spread at all), that verdict says "not enough held-out evidence", and the
adapter's ``thin_evidence`` policy decides: ``serve`` on retention alone, or ``wait`` (not served
until the slice can show the margin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The held-out score each training method is gated on: a dpo adapter's win rate on held-out
# preference pairs (MACE §3.1), an sft adapter's mean log-likelihood per held-out completion token.
# A kto adapter's: the mean over held-out labels of the answer's token log-likelihood, negated for a thumbs-down;
# like sft's it is a mean of per-item changes, so it takes sft's evidence rule (two standard errors).
SCORE = {"dpo": "win_rate", "sft": "token_logprob", "kto": "label_logprob"}
_LABEL = {
    "win_rate": "win rate",
    "token_logprob": "token log-likelihood",
    "label_logprob": "signed label log-likelihood",
}
THIN_EVIDENCE_POLICIES = ("serve", "wait")


@dataclass(frozen=True)
class Verdict:
    """One comparison's outcome; ``thin``: it passed only because its items could not show a drop of the margin."""

    passed: bool
    reason: str
    thin: bool = False
    counts: bool = True  # a rejection that counts toward pause_after_rejections (False: it waits for evidence)


def judge(
    method: str,
    candidate: float,
    baseline: float,
    margin: float,
    *,
    items: int,
    baseline_name: str,
    slice_name: str = "held-out items",
    item_changes: Sequence[float] = (),
) -> Verdict:
    """Pass iff ``candidate`` is not worse than ``baseline`` by more than ``margin`` (both: higher is better).

    ``baseline_name`` is what was compared with ("v3", "the base model"); ``items`` how many
    held-out items both were scored on; ``item_changes`` (SFT) each item's change of its own mean
    token log-likelihood, candidate minus baseline. The reason says the numbers, so a user can
    tell why, and carries the verdict's own uncertainty: below the items the score needs to show
    a drop of ``margin`` (:func:`resolution`, :func:`needed_items`), a pass is ``thin`` and says
    "not enough held-out evidence", never "not worse". An SFT slice of fewer than two items has no
    spread to measure its noise by, so it is always thin. A gain larger than the noise is a
    measured improvement, thin slice or not.
    """
    if method not in SCORE:
        raise ValueError(f"unknown training method {method!r}")
    label = _LABEL[SCORE[method]]
    drop = baseline - candidate
    # Rounding noise must not decide: a score equal to the baseline up to float error is not worse.
    passed = drop <= margin + 1e-9
    detail = f"{label} {candidate:.4g} vs {baseline:.4g} of {baseline_name} on {items} {slice_name}"
    if not passed:
        return Verdict(False, f"{detail}: {drop:.4g} worse, more than the margin {margin:g}")
    known = method == "dpo" or len(item_changes) >= 2
    spread = item_spread(item_changes)
    step = resolution(method, items, spread) if known else math.inf
    if step > margin:
        if known and -drop > step:
            return Verdict(True, f"{detail}: {-drop:.4g} better, more than the noise {step:.3g}")
        # A DPO win rate on n items moves in steps of 1/n: with 6 items, 17 points; an SFT mean moves with its
        # items' noise, unknown with one item. A drop of the margin cannot show, so "not worse" would claim
        # what was not measured.
        if method == "dpo":
            why = f"one item moves the {label} by {step:.3g}; {needed_items(method, margin)} items would"
        elif not known:
            why = "one item has no spread to tell its noise by"
        else:
            why = (
                f"the items' changes spread {spread:.3g}, so the mean's noise is {step:.3g}; "
                f"{needed_items(method, margin, spread)} items would"
            )
        return Verdict(True, f"{detail}: not enough held-out evidence to see a drop of {margin:g} ({why})", thin=True)
    how = "not worse" if drop <= 1e-9 else f"{drop:.4g} worse, within the margin {margin:g}"
    return Verdict(True, f"{detail}: {how}")


def judge_retention(candidate: float, base: float, margin: float, *, prompts: int, set_name: str) -> Verdict:
    """Pass iff the candidate keeps the base model's answers on the retention set within ``margin``.

    Both scores are the mean log-likelihood per token of the base model's greedy answers
    (``actors/learning/lora/retention.py``), so the base scores its own answers highest and a
    candidate that forgets scores lower. Compared with the base, not the served version: drift
    could otherwise add up over many versions, each within the margin of the last.
    """
    drop = base - candidate
    detail = (
        f"retention: token log-likelihood of the base model's answers {candidate:.4g} vs {base:.4g} of the "
        f"base model on {prompts} prompts of {set_name}"
    )
    if drop > margin + 1e-9:
        return Verdict(False, f"{detail}: {drop:.4g} lost, more than the retention margin {margin:g}")
    return Verdict(True, f"{detail}: kept within the retention margin {margin:g}")


def decide(held_out: Verdict | None, retention: Verdict | None, thin_evidence: str) -> Verdict:
    """The gate's verdict from the held-out comparison and the retention check (None: not measured).

    A failed retention check or a measured held-out drop rejects. A held-out slice that is missing
    or too thin to show the margin leaves the decision to ``thin_evidence``: ``serve`` passes on
    retention alone (when it was measured), ``wait`` holds the version back without counting it
    as a rejection (the adapter does not pause for want of evidence).
    """
    if thin_evidence not in THIN_EVIDENCE_POLICIES:
        raise ValueError(f"unknown thin_evidence policy {thin_evidence!r}")
    parts = [v.reason for v in (retention, held_out) if v is not None]
    if held_out is None:
        parts.append("no held-out feedback to judge the taught behaviour on yet")
    reason = "; ".join(parts)
    if retention is not None and not retention.passed:
        return Verdict(False, reason)
    if held_out is not None and not held_out.passed:
        return Verdict(False, reason)
    if held_out is None or held_out.thin:
        if thin_evidence == "wait":
            return Verdict(
                False,
                f"{reason}; waiting for more held-out evidence (gate.thin_evidence wait)",
                thin=True,
                counts=False,
            )
        if retention is not None:
            return Verdict(True, f"{reason}; served on retention alone", thin=True)
        return Verdict(True, f"{reason}; served unjudged: no retention set either", thin=True)
    return Verdict(True, reason)


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
