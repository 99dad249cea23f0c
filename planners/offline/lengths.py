"""Output lengths drawn from a per-model eCDF, truncated at the output limit (SamuLLM §2, §4.1)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from planners.costs import OutputLengthCDF


def output_cdf_from_pairs(pairs: Iterable[tuple[int, int]], max_output_tokens: int | None = None) -> OutputLengthCDF:
    """The eCDF of output lengths from ``(prompt_tokens, response_tokens)`` pairs (SamuLLM §2, §4.1).

    SamuLLM observes that output lengths hardly depend on the prompt, so only the responses enter
    the CDF; the prompts are checked but not used. A response longer than ``max_output_tokens`` is
    counted at the limit, as the engine that produced it under that limit would have stopped there.
    """
    resp = []
    for prompt, response in pairs:
        if prompt < 0 or response < 0:
            raise ValueError(f"token counts must be >= 0, got ({prompt}, {response})")
        resp.append(response)
    if not resp:
        raise ValueError("need at least one (prompt, response) pair")
    arr = np.asarray(resp, dtype=np.int64)
    if max_output_tokens is not None:
        if max_output_tokens < 1:
            raise ValueError("max_output_tokens must be >= 1")
        arr = np.minimum(arr, max_output_tokens)
    return OutputLengthCDF.from_samples(arr)


def sample_output_lengths(
    cdf: OutputLengthCDF,
    prompt_tokens: Sequence[int] | np.ndarray,
    max_output_tokens: int,
    max_seq_len: int | None = None,
    rng: np.random.Generator | int | None = 0,
) -> np.ndarray:
    """One output length per request: L ~ eCDF, truncated at min(m, M − prompt) (SamuLLM §4.1).

    ``m`` is the output limit of the sampling settings and ``M`` the model's maximum sequence length;
    the engine stops at the limit, so a longer draw becomes the limit rather than being redrawn.
    Every length is at least 1 (a request always produces one token).
    """
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    out = cdf.sample(prompts.size, rng, max_tokens=max_output_tokens)
    if max_seq_len is not None:
        out = np.minimum(out, np.maximum(max_seq_len - prompts, 1))
    return out.astype(np.int64)
