"""The one cost model every planner shares: stage, iteration, memory and output-length estimates.

Sources: LEMIX §IV-A (stage latency Δ = η·C·ℓ², memory threshold M_threshold = κ·M_peak) and
SamuLLM §2 / §4.1 (per-iteration latency as a linear function of the running batch, Eq. 5;
output lengths sampled from an empirical CDF). Fitting it from measured rows lives in
``planners.cost_fitting``; reading and writing profile files is the caller's job (``to_dict`` /
``from_dict`` only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

SCHEMA = "planner-cost-model/1"

# Feature names are part of the JSON schema: profiles written by one version must load in the next.
STAGE_TERMS = ("C*l^2", "C*l", "1")
ITERATION_TERMS = ("1", "prefill_tokens", "decode_seqs", "context_tokens")


@dataclass(frozen=True)
class FitQuality:
    """In-sample quality of one fitted term group: R², median relative error, rows, kept terms."""

    r2: float
    median_rel_err: float
    n: int
    terms: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"r2": self.r2, "median_rel_err": self.median_rel_err, "n": self.n, "terms": list(self.terms)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> FitQuality:
        return FitQuality(float(d["r2"]), float(d["median_rel_err"]), int(d["n"]), tuple(d["terms"]))


@dataclass(frozen=True)
class StageLatency:
    """Seconds for one stage to run a forward (or backward) pass: C·(η·ℓ² + β·ℓ) + γ (LEMIX §IV-A).

    LEMIX models Δ = η·C·ℓ²; the linear term β·C·ℓ and the per-call constant γ are kept because
    fused attention kernels and Python overhead make small-ℓ passes far from quadratic.
    """

    quad: float
    lin: float = 0.0
    const: float = 0.0
    fit: FitQuality | None = None

    def __call__(self, batch_size: float, tokens: float) -> float:
        return batch_size * (self.quad * tokens * tokens + self.lin * tokens) + self.const

    def scaled(self, factor: float) -> StageLatency:
        return replace(self, quad=self.quad * factor, lin=self.lin * factor, const=self.const * factor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "C*l^2": self.quad,
            "C*l": self.lin,
            "1": self.const,
            "fit": None if self.fit is None else self.fit.to_dict(),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StageLatency:
        fit = d.get("fit")
        return StageLatency(
            float(d["C*l^2"]),
            float(d.get("C*l", 0.0)),
            float(d.get("1", 0.0)),
            None if fit is None else FitQuality.from_dict(fit),
        )


@dataclass(frozen=True)
class IterationLatency:
    """Seconds for one engine iteration (SamuLLM §4.1, Eq. 5, with one shared set of constants).

    t_iter = base + per_prefill_token·(new prompt tokens) + per_decode_seq·(sequences decoding)
             + per_context_token·(context tokens those sequences attend over).
    SamuLLM fits separate constants per request count; one linear model is enough for the
    batch sizes a replica runs here, and the profiler reports how well it fits.
    """

    base: float
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float = 0.0
    fit: FitQuality | None = None

    def __call__(self, prefill_tokens: float, decode_seqs: float, context_tokens: float = 0.0) -> float:
        return (
            self.base
            + self.per_prefill_token * prefill_tokens
            + self.per_decode_seq * decode_seqs
            + self.per_context_token * context_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "1": self.base,
            "prefill_tokens": self.per_prefill_token,
            "decode_seqs": self.per_decode_seq,
            "context_tokens": self.per_context_token,
            "fit": None if self.fit is None else self.fit.to_dict(),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> IterationLatency:
        fit = d.get("fit")
        return IterationLatency(
            float(d["1"]),
            float(d["prefill_tokens"]),
            float(d["decode_seqs"]),
            float(d.get("context_tokens", 0.0)),
            None if fit is None else FitQuality.from_dict(fit),
        )


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per KV-cache token and per training-activation token, and M_threshold = κ·M_peak (LEMIX §IV-A)."""

    kv_bytes_per_token: float
    activation_bytes_per_token: float
    weight_bytes: float
    peak_bytes: float
    threshold_fraction: float = 0.8
    """κ: the share of the peak the guard lets a node use, M_threshold = κ·M_peak."""
    fit: FitQuality | None = None

    def threshold(self) -> float:
        return self.threshold_fraction * self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "activation_bytes_per_token": self.activation_bytes_per_token,
            "weight_bytes": self.weight_bytes,
            "peak_bytes": self.peak_bytes,
            "threshold_fraction": self.threshold_fraction,
            "fit": None if self.fit is None else self.fit.to_dict(),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MemoryModel:
        fit = d.get("fit")
        return MemoryModel(
            float(d["kv_bytes_per_token"]),
            float(d["activation_bytes_per_token"]),
            float(d["weight_bytes"]),
            float(d["peak_bytes"]),
            float(d.get("threshold_fraction", d.get("kappa", 0.8))),  # "kappa": older profiles
            None if fit is None else FitQuality.from_dict(fit),
        )


@dataclass(frozen=True)
class OutputLengthCDF:
    """Empirical CDF of output lengths and a seeded sampler from it (SamuLLM §2, §4.1).

    ``values`` are sorted distinct lengths and ``cdf[i] = P(L <= values[i])`` with ``cdf[-1] == 1``.
    An explicit limit m truncates a draw to min(L, m): the engine stops at m, it does not resample.
    """

    values: tuple[int, ...]
    cdf: tuple[float, ...]
    _mean_cache: dict[int | None, float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.cdf):
            raise ValueError("values and cdf must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.values, self.values[1:])):
            raise ValueError("values must be strictly increasing")
        if any(b < a for a, b in zip(self.cdf, self.cdf[1:])) or self.cdf[0] <= 0 or abs(self.cdf[-1] - 1) > 1e-9:
            raise ValueError("cdf must be non-decreasing, positive, and end at 1")
        if self.values[0] < 1:
            raise ValueError("output lengths must be >= 1")

    @staticmethod
    def from_samples(lengths: Sequence[int] | np.ndarray) -> OutputLengthCDF:
        arr = np.asarray(lengths, dtype=np.int64)
        if arr.size == 0:
            raise ValueError("need at least one output length")
        vals, counts = np.unique(np.maximum(arr, 1), return_counts=True)
        cdf = np.cumsum(counts) / arr.size
        cdf[-1] = 1.0
        return OutputLengthCDF(tuple(int(v) for v in vals), tuple(float(c) for c in cdf))

    def prob_le(self, length: float) -> float:
        i = int(np.searchsorted(np.asarray(self.values), length, side="right"))
        return 0.0 if i == 0 else self.cdf[i - 1]

    def sample(self, size: int, rng: np.random.Generator | int | None = 0, max_tokens: int | None = None) -> np.ndarray:
        """Draw ``size`` lengths by inverse-CDF sampling; an int ``rng`` is a seed."""
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        u = gen.random(size)
        idx = np.searchsorted(np.asarray(self.cdf), u, side="left")
        out = np.asarray(self.values, dtype=np.int64)[np.minimum(idx, len(self.values) - 1)]
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            out = np.minimum(out, max_tokens)
        return out

    def mean(self, max_tokens: int | None = None) -> float:
        """E[min(L, max_tokens)]: what the planner assumes for a request it cannot see the end of."""
        hit = self._mean_cache.get(max_tokens)
        if hit is not None:
            return hit
        vals = np.asarray(self.values, dtype=float)
        if max_tokens is not None:
            vals = np.minimum(vals, max_tokens)
        pmf = np.diff(np.concatenate(([0.0], np.asarray(self.cdf))))
        m = float(np.dot(vals, pmf))
        self._mean_cache[max_tokens] = m
        return m

    def to_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "cdf": list(self.cdf)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OutputLengthCDF:
        return OutputLengthCDF(tuple(int(v) for v in d["values"]), tuple(float(c) for c in d["cdf"]))


@dataclass(frozen=True)
class CostModel:
    """Everything the planners estimate for one model on one node type.

    ``forward`` / ``backward`` are per pipeline stage of a node with ``stages`` stages (LEMIX §IV-A);
    ``iteration`` is the whole inference engine (SamuLLM Eq. 5). ``ft_interference`` is ρ of the
    window cost f(c, s) = t_iter(c) + ρ·t_ft(s) (FlexLLM §6.2): the seconds an inference iteration
    is delayed per second of fine-tuning work run beside it. ρ = 1 when the two take turns on one
    device (FlexLLM's GPU case, the default); lower when they run side by side on separate cores
    and only contend (``app.profile`` measures it). ``metadata`` says what it was fitted on: at
    least ``model``, ``hardware``, ``fitted_at`` and ``source``.
    """

    forward: StageLatency
    backward: StageLatency
    iteration: IterationLatency
    memory: MemoryModel
    output_lengths: OutputLengthCDF
    stages: int = 1
    metadata: Mapping[str, Any] = field(default_factory=dict)
    ft_interference: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ft_interference <= 10.0:
            raise ValueError(f"ft_interference must be in [0, 10], got {self.ft_interference}")

    # LEMIX §IV-A: stage-level latencies.
    def forward_latency(self, batch_size: float, tokens: float) -> float:
        return self.forward(batch_size, tokens)

    def backward_latency(self, batch_size: float, tokens: float) -> float:
        return self.backward(batch_size, tokens)

    # SamuLLM §4.1, Eq. 5: engine iterations.
    def iteration_latency(self, n_prefill_tokens: float, n_decode_seqs: float, context_tokens: float = 0.0) -> float:
        return self.iteration(n_prefill_tokens, n_decode_seqs, context_tokens)

    def prefill_latency(self, tokens: float) -> float:
        """One iteration that only prefills ``tokens`` prompt tokens: the isolated time to first token."""
        return self.iteration(tokens, 0, 0)

    def decode_latency(self, prompt_tokens: float, output_tokens: float, batch: float = 1.0) -> float:
        """Seconds to decode ``output_tokens`` after the first, sharing iterations with ``batch`` sequences."""
        steps = max(output_tokens - 1, 0)
        # Context grows by one token per step: use its mean over the steps, per sequence in the batch.
        mean_ctx = prompt_tokens + (output_tokens + 1) / 2.0
        return steps * self.iteration(0, batch, batch * mean_ctx)

    def request_latency(self, prompt_tokens: float, output_tokens: float, batch: float = 1.0) -> float:
        """Isolated end-to-end latency of one inference request: prefill then decode."""
        return self.prefill_latency(prompt_tokens) + self.decode_latency(prompt_tokens, output_tokens, batch)

    # LEMIX §IV-A: memory.
    def kv_bytes(self, tokens: float) -> float:
        return self.memory.kv_bytes_per_token * tokens

    def activation_bytes(self, batch_size: float, tokens: float) -> float:
        return self.memory.activation_bytes_per_token * batch_size * tokens

    def memory_threshold(self) -> float:
        return self.memory.threshold()

    def with_stages(self, stages: int) -> CostModel:
        """The same model split over ``stages`` equal pipeline stages (layers divide evenly)."""
        if stages < 1:
            raise ValueError("stages must be >= 1")
        f = self.stages / stages
        return replace(self, forward=self.forward.scaled(f), backward=self.backward.scaled(f), stages=stages)

    def with_training_time(self, factor: float) -> CostModel:
        """The same model with the fine-tuning terms (forward and backward) ``factor`` times as long:
        a live refit from measured windows (``planners.coserving.calibration``)."""
        if factor <= 0:
            raise ValueError("factor must be > 0")
        return replace(self, forward=self.forward.scaled(factor), backward=self.backward.scaled(factor))

    def fit_table(self) -> list[dict[str, Any]]:
        """One row per fitted term group, for the profiler's printout and the docs."""
        rows = []
        for name, part in (
            ("forward", self.forward),
            ("backward", self.backward),
            ("iteration", self.iteration),
            ("memory", self.memory),
        ):
            d = part.to_dict()
            fit = d.pop("fit")
            rows.append(
                {
                    "term": name,
                    "coefficients": d,
                    "r2": None if fit is None else fit["r2"],
                    "median_rel_err": None if fit is None else fit["median_rel_err"],
                    "n": 0 if fit is None else fit["n"],
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "metadata": dict(self.metadata),
            "stages": self.stages,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict(),
            "iteration": self.iteration.to_dict(),
            "memory": self.memory.to_dict(),
            "output_lengths": self.output_lengths.to_dict(),
            "ft_interference": self.ft_interference,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CostModel:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a cost model profile: schema {d.get('schema')!r}, expected {SCHEMA!r}")
        missing = [k for k in ("forward", "backward", "iteration", "memory", "output_lengths") if k not in d]
        if missing:
            raise ValueError(f"cost model profile lacks {missing}")
        try:
            return CostModel(
                forward=StageLatency.from_dict(d["forward"]),
                backward=StageLatency.from_dict(d["backward"]),
                iteration=IterationLatency.from_dict(d["iteration"]),
                memory=MemoryModel.from_dict(d["memory"]),
                output_lengths=OutputLengthCDF.from_dict(d["output_lengths"]),
                stages=int(d.get("stages", 1)),
                metadata=dict(d.get("metadata", {})),
                ft_interference=float(d.get("ft_interference", 1.0)),
            )
        except KeyError as exc:
            raise ValueError(f"cost model profile lacks key {exc.args[0]!r}") from None


# --- The documented default -------------------------------------------------------------------

# Quantiles (0%, 5%, ..., 100%) of GeneratedTokens in the Azure LLM inference trace 2023, conv
# service, first 20 minutes (shared/data/traces/azure_conv_sample.csv, 6,054 requests). Embedded
# so the planner never needs the data folder.
_DEFAULT_OUTPUT_QUANTILES = (
    10,
    40,
    55,
    69,
    82,
    91,
    99,
    113,
    140,
    165,
    200,
    373,
    386,
    394,
    397,
    403,
    411,
    419,
    429,
    478,
    1000,
)


def _default_output_cdf() -> OutputLengthCDF:
    qs = _DEFAULT_OUTPUT_QUANTILES
    # Each of the 20 quantile intervals holds 5% of the mass: put it on the interval's upper end,
    # and split the first interval's mass between the minimum and the 5% quantile.
    vals = [qs[0]]
    cdf = [0.5 / (len(qs) - 1)]
    for i, v in enumerate(qs[1:], start=1):
        p = i / (len(qs) - 1)
        if v == vals[-1]:
            cdf[-1] = p
        else:
            vals.append(v)
            cdf.append(p)
    return OutputLengthCDF(tuple(vals), tuple(cdf))


def default_cost_model() -> CostModel:
    """Hand-set fallback for the embedded tiny Llama (h256, 4 layers) on a 2-core CPU, one stage.

    Used when no fitted profile matches the configured model and hardware. Derivation:
    - iteration (SamuLLM Eq. 5): 6 ms per iteration, 0.05 ms per prefill token, 0.2 ms per decoding
      sequence, 0.5 µs per context token. Against a plain-vLLM reference measured on a comparable CPU (TPOT 6.8 ms
      at 10 req/s, i.e. ~4 sequences of ~160 context tokens; 1,496 output tok/s saturated at 32
      sequences) it gives TPOT ≈ 7.1 ms and ≈ 1,800 tok/s once prefills take their 15% share:
      about right at low load, ~20% optimistic at saturation.
    - training stage (LEMIX §IV-A): forward 3 ms + C·(0.1 ms·ℓ + 0.2 µs·ℓ²) (eager PyTorch is slower per
      token than vLLM's prefill); backward twice the forward.
    - memory: KV 4 KiB/token (2 · 4 layers · 4 heads · 64 dims · 2 bytes), ~96 KiB of fp32
      activations per training token, 13 MB of weights, 1 GiB budget per node, κ = 0.8.
    - output lengths: the Azure conv trace quantiles above.
    """
    return CostModel(
        forward=StageLatency(quad=2e-7, lin=1e-4, const=3e-3),
        backward=StageLatency(quad=4e-7, lin=2e-4, const=5e-3),
        iteration=IterationLatency(base=6e-3, per_prefill_token=5e-5, per_decode_seq=2e-4, per_context_token=5e-7),
        memory=MemoryModel(
            kv_bytes_per_token=4096,
            activation_bytes_per_token=96 * 1024,
            weight_bytes=13e6,
            peak_bytes=float(1 << 30),
            threshold_fraction=0.8,
        ),
        output_lengths=_default_output_cdf(),
        stages=1,
        metadata={
            "model": "embedded-default",
            "hardware": "cpu-2core",
            "fitted_at": None,
            "source": "default: hand-set, not fitted (planners/costs.py default_cost_model)",
        },
    )


def as_cost_model(value: CostModel | Mapping[str, Any] | None) -> CostModel:
    """Accept a CostModel, a profile dict (from JSON/config), or None (the default)."""
    if value is None:
        return default_cost_model()
    if isinstance(value, CostModel):
        return value
    return CostModel.from_dict(value)
