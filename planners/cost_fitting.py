"""Fitting the cost model from measured rows: robust least squares with a BIC choice of terms.

Sources: LEMIX §IV-A (stage latency Δ = η·C·ℓ², fitted from forward/backward timings and memory
rows) and SamuLLM §4.1 (per-iteration latency, Eq. 5, fitted from engine iterations). Rows are plain
mappings that ``app.profile`` and the live calibrators measure; the fitted terms are the dataclasses
of ``planners.costs``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planners.costs import (
    CostModel,
    FitQuality,
    IterationLatency,
    MemoryModel,
    OutputLengthCDF,
    StageLatency,
    default_cost_model,
)


def _quality(y: np.ndarray, pred: np.ndarray, terms: Sequence[str]) -> FitQuality:
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    nz = np.abs(y) > 0
    rel = np.abs(pred[nz] - y[nz]) / np.abs(y[nz]) if nz.any() else np.zeros(1)
    return FitQuality(r2=r2, median_rel_err=float(np.median(rel)), n=int(y.size), terms=tuple(terms))


OUTLIER_REL = 1.0
"""A row measured more than (1 + this) times, or less than 1/(1 + this) of, what the fit predicts is an outlier."""


def _best_subset(
    X_all: Mapping[str, np.ndarray], y: np.ndarray, required: Sequence[str], relative: bool
) -> tuple[dict[str, float], np.ndarray, tuple[str, ...]]:
    """Least squares over every subset of the features; the best BIC among non-negative fits.

    ``relative``: of the relative error, so a row's residual counts as a fraction of its own time,
    rows of a few milliseconds weigh as much as rows of seconds, and one slowed row cannot own the fit.
    """
    names = list(X_all)
    n = y.size
    weight = 1.0 / np.maximum(np.abs(y), 1e-12) if relative else np.ones_like(y)
    best: tuple[float, dict[str, float], tuple[str, ...]] | None = None
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            if any(q not in subset for q in required):
                continue
            X = np.column_stack([X_all[k] for k in subset])
            if np.linalg.matrix_rank(X) < len(subset):
                continue
            coef, *_ = np.linalg.lstsq(X * weight[:, None], y * weight, rcond=None)
            if np.any(coef < -1e-15 * max(1.0, float(np.abs(coef).max()))):
                continue
            rss = float(np.sum(((y - X @ coef) * weight) ** 2))
            bic = n * math.log(max(rss / n, 1e-300)) + len(subset) * math.log(n)
            if best is None or bic < best[0] - 1e-9:
                best = (bic, {k: max(float(c), 0.0) for k, c in zip(subset, coef)}, subset)
    if best is None:
        raise ValueError("no non-negative least-squares fit exists for these rows")
    _, coefs, subset = best
    full = {k: coefs.get(k, 0.0) for k in names}
    return full, sum(full[k] * X_all[k] for k in names), subset


def _inliers(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """Rows within a factor (1 + OUTLIER_REL) of the prediction, on a log scale (time cannot be negative)."""
    ratio = np.maximum(y, 1e-12) / np.maximum(pred, 1e-12)
    return np.abs(np.log(ratio)) <= math.log1p(OUTLIER_REL)


def fit_linear(
    features: Mapping[str, np.ndarray], y: np.ndarray, required: Sequence[str] = (), robust: bool = False
) -> tuple[dict[str, float], FitQuality]:
    """Least squares over every subset of ``features``; keep the subset with the best BIC among
    those with non-negative coefficients ("fit both terms and keep what fits"), then refit
    without outlier rows.

    Latencies cannot fall as work grows, so a negative coefficient marks a term the data do not
    support; BIC stops a noise term from being kept for a negligible gain in residual.

    ``robust``: a profile measured on a shared machine has rows that another process slowed by
    10x or more (seen here: a LoRA backward of 4 x 64 tokens at 11 s beside 0.17 s for 1 x 64),
    and plain least squares lets a few of them set every coefficient (that fit priced a one-token
    backward at 2 s). A robust fit weighs each row's relative error, then drops rows off the fit
    by more than a factor (1 + OUTLIER_REL) and fits again (a trimmed fit) while at least half
    the rows, and one more row than terms, remain. ``FitQuality`` is over the rows kept; ``n``
    says how many. (The engine's iteration rows mix decode rows of ~20 ms with prefill rows of
    seconds whose terms differ, so they keep the plain fit.)
    """
    y = np.asarray(y, dtype=float)
    X_all = {k: np.asarray(v, dtype=float) for k, v in features.items()}
    if y.size == 0:
        raise ValueError("no measurement rows to fit")
    keep = np.ones(y.size, dtype=bool)
    full, pred, subset = _best_subset(X_all, y, required, robust)
    for _ in range(5 if robust else 0):
        inside = _inliers(y, pred)
        if inside.sum() < max(len(X_all) + 1, (y.size + 1) // 2) or np.array_equal(inside, keep):
            break
        keep = inside
        full, _, subset = _best_subset({k: v[keep] for k, v in X_all.items()}, y[keep], required, robust)
        pred = sum(full[k] * X_all[k] for k in X_all)
    return full, _quality(y[keep], pred[keep], subset)


def _rows(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, np.ndarray]:
    if not rows:
        raise ValueError("no measurement rows to fit")
    try:
        return {k: np.array([float(r[k]) for r in rows]) for k in keys}
    except KeyError as exc:
        raise ValueError(f"measurement row lacks {exc.args[0]!r}; rows need {list(keys)}") from None


def fit_stage_latency(rows: Sequence[Mapping[str, Any]]) -> StageLatency:
    """Fit Δ = C·(η·ℓ² + β·ℓ) + γ from rows ``{"batch_size", "tokens", "seconds"}`` (LEMIX §IV-A), robustly
    (training steps measured beside a running engine have slowed outliers: ``fit_linear``)."""
    r = _rows(rows, ("batch_size", "tokens", "seconds"))
    c, length = r["batch_size"], r["tokens"]
    coefs, q = fit_linear(
        {"C*l^2": c * length * length, "C*l": c * length, "1": np.ones_like(length)}, r["seconds"], robust=True
    )
    return StageLatency(coefs["C*l^2"], coefs["C*l"], coefs["1"], q)


def fit_iteration_latency(rows: Sequence[Mapping[str, Any]]) -> IterationLatency:
    """Fit Eq. 5 from rows ``{"prefill_tokens", "decode_seqs", "context_tokens", "seconds"}`` (SamuLLM §4.1).

    The constant term is always kept: every engine iteration pays a fixed cost (scheduling, the forward pass's
    launch, sampling). Left to BIC, a profile whose few long prefill rows own the absolute residual once dropped it,
    pricing a decode-only iteration at 0 s when its rows measured ~2 ms (a fresh profile of the tiny model on a
    loaded machine). The constant alone is a non-negative fit of any rows, so requiring it never leaves no fit."""
    r = _rows(rows, ("prefill_tokens", "decode_seqs", "context_tokens", "seconds"))
    coefs, q = fit_linear(
        {
            "1": np.ones_like(r["seconds"]),
            "prefill_tokens": r["prefill_tokens"],
            "decode_seqs": r["decode_seqs"],
            "context_tokens": r["context_tokens"],
        },
        r["seconds"],
        required=("1",),
    )
    return IterationLatency(coefs["1"], coefs["prefill_tokens"], coefs["decode_seqs"], coefs["context_tokens"], q)


def fit_memory(
    kv_rows: Sequence[Mapping[str, Any]],
    train_rows: Sequence[Mapping[str, Any]],
    threshold_fraction: float = 0.8,
    peak_bytes: float | None = None,
) -> MemoryModel:
    """Bytes per KV token from ``{"tokens", "bytes"}`` and per activation token from
    ``{"batch_size", "tokens", "bytes"}`` (intercept = weights); M_peak defaults to the largest row."""
    if not 0 < threshold_fraction <= 1:
        raise ValueError("threshold_fraction (κ) must be in (0, 1]")
    kv = _rows(kv_rows, ("tokens", "bytes"))
    tr = _rows(train_rows, ("batch_size", "tokens", "bytes"))
    kv_coef, _ = fit_linear(
        {"tokens": kv["tokens"], "1": np.ones_like(kv["tokens"])}, kv["bytes"], required=("tokens",)
    )
    ct = tr["batch_size"] * tr["tokens"]
    tr_coef, q = fit_linear({"C*l": ct, "1": np.ones_like(ct)}, tr["bytes"], required=("C*l",))
    peak = float(max(kv["bytes"].max(), tr["bytes"].max())) if peak_bytes is None else float(peak_bytes)
    return MemoryModel(kv_coef["tokens"], tr_coef["C*l"], tr_coef["1"], peak, threshold_fraction, q)


def fit_cost_model(
    forward_rows: Sequence[Mapping[str, Any]],
    backward_rows: Sequence[Mapping[str, Any]],
    iteration_rows: Sequence[Mapping[str, Any]],
    output_lengths: Sequence[int] | None = None,
    memory: MemoryModel | None = None,
    stages: int = 1,
    metadata: Mapping[str, Any] | None = None,
    now: Callable[[], str] | None = None,
) -> CostModel:
    """Fit every term from measurement rows; terms without rows fall back to the default model.

    ``now`` supplies ``fitted_at`` (an ISO string) when metadata lacks it; planners never read the clock.
    """
    base = default_cost_model()
    meta = dict(metadata or {})
    if "fitted_at" not in meta and now is not None:
        meta["fitted_at"] = now()
    meta.setdefault("source", "fitted")
    return CostModel(
        forward=fit_stage_latency(forward_rows) if forward_rows else base.forward,
        backward=fit_stage_latency(backward_rows) if backward_rows else base.backward,
        iteration=fit_iteration_latency(iteration_rows) if iteration_rows else base.iteration,
        memory=memory if memory is not None else base.memory,
        output_lengths=(
            OutputLengthCDF.from_samples(output_lengths)
            if output_lengths is not None and len(output_lengths)
            else base.output_lengths
        ),
        stages=stages,
        metadata=meta,
    )
