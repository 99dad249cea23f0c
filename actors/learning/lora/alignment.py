"""Alignment metrics of an adapter version (MACE §3.1): preference win rate and CLPD, completion log-likelihood."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.learning.lora.steps import (
    DEFAULT_MAX_LENGTH,
    completion_logprobs,
    encode,
    model_mode,
    prompted_text,
    sequence_logprobs,
)


@dataclass(frozen=True)
class PreferenceEval:
    """MACE §3.1 alignment metrics over a preference set."""

    win_rate: float
    clpd: float
    pairs: int
    diffs: tuple[float, ...] = ()  # log π(y⁺|x) − log π(y⁻|x) of each pair, in order


def evaluate_preferences(
    model: Any, tokenizer: Any, pairs: Sequence[Any], *, batch_size: int = 8, max_length: int = DEFAULT_MAX_LENGTH
) -> PreferenceEval:
    """Win rate and CLPD of the policy on preference pairs, as defined in MACE §3.1.

    Win rate = E[1[π_θ(y⁺|x) > π_θ(y⁻|x)]] (strict: ties lose); CLPD = E[log π_θ(y⁺|x) − log π_θ(y⁻|x)].
    π_θ(y|x) is the whole-sequence probability (sum of token log-probs, not length-normalised), as
    the paper's formulas state. ``pairs``: items with ``prompt``, ``chosen``, ``rejected``.
    """
    if not pairs:
        raise ValueError("evaluate_preferences needs at least one pair")

    def score(field: str) -> list[float]:
        texts = [prompted_text(tokenizer, p, field) for p in pairs]
        return sequence_logprobs(
            model,
            tokenizer,
            [t.prompt for t in texts],
            [t.answer for t in texts],
            batch_size=batch_size,
            max_length=max_length,
            templated=[t.templated for t in texts],
        )

    chosen, rejected = score("chosen"), score("rejected")
    return preference_eval([c - r for c, r in zip(chosen, rejected)])


@dataclass(frozen=True)
class CompletionEval:
    """How likely the policy finds held-out SFT completions: the quality gate's score of an sft adapter."""

    token_logprob: float  # Σ log π(completion tokens) / number of completion tokens, over all items
    items: int
    tokens: int
    per_item: tuple[tuple[float, int], ...] = ()  # (Σ log π over its completion tokens, their number), in order


def evaluate_completions(
    model: Any,
    tokenizer: Any,
    items: Sequence[Any],
    *,
    field: str = "completion",
    batch_size: int = 8,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> CompletionEval:
    """Mean per-token log-likelihood of each item's ``field`` given its context, in eval mode.

    The token mean over the whole set is the negative of the SFT loss (``sft_step``) on it, so a
    version that trains well on this distribution scores higher. ``field`` "chosen" scores the
    better answers of preference pairs.
    """
    if not items:
        raise ValueError("evaluate_completions needs at least one item")
    per_item: list[tuple[float, int]] = []
    with torch.no_grad(), model_mode(model, False):
        for i in range(0, len(items), batch_size):
            texts = [prompted_text(tokenizer, it, field) for it in items[i : i + batch_size]]
            enc = encode(
                tokenizer,
                [t.prompt for t in texts],
                [t.answer for t in texts],
                max_length=max_length,
                templated=[t.templated for t in texts],
            )
            sums = completion_logprobs(model, enc).tolist()
            counts = enc.completion_mask[:, 1:].sum(dim=1).tolist()
            per_item += [(float(s), int(n)) for s, n in zip(sums, counts)]
    return completion_eval(per_item)


def completion_eval(per_item: Sequence[tuple[float, int]]) -> CompletionEval:
    """The set's score from its items' (log-likelihood sum, token count): the token mean over all of them."""
    total, tokens = sum(s for s, _ in per_item), sum(n for _, n in per_item)
    return CompletionEval(
        token_logprob=total / max(tokens, 1), items=len(per_item), tokens=tokens, per_item=tuple(per_item)
    )


def preference_eval(diffs: Sequence[float]) -> PreferenceEval:
    """MACE §3.1's win rate and CLPD from each pair's log π(y⁺|x) − log π(y⁻|x)."""
    return PreferenceEval(
        win_rate=sum(d > 0 for d in diffs) / len(diffs),
        clpd=sum(diffs) / len(diffs),
        pairs=len(diffs),
        diffs=tuple(diffs),
    )


def read_preference_jsonl(
    path: str | Path, *, limit: int | None = None, max_text_bytes: int | None = None
) -> list[dict[str, str]]:
    """Load ``{prompt, chosen, rejected}`` pairs from a JSONL file (e.g. the HH-RLHF samples), optionally truncated.

    ``max_text_bytes`` cuts each text to that many UTF-8 bytes (on a character boundary): with the
    byte-level embedded tokenizer, bytes are tokens.
    """
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(pairs) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                pairs.append({k: _cut(row[k], max_text_bytes) for k in ("prompt", "chosen", "rejected")})
    return pairs


def _cut(text: str, max_bytes: int | None) -> str:
    if max_bytes is None:
        return text
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
