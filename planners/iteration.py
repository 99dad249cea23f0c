"""Node-level iteration scheduling of prefill, decode and fine-tune work (MACE §4.1–§4.2, FlexLLM §6, §8.2).

One scheduler object per node, in the manner of nano-vllm's scheduler: inference requests and
fine-tune samples enter queues, and ``schedule(now)`` returns a :class:`WindowPlan` for the next
iteration window: which waiting inference requests the replica submits now and with which vLLM
priority, and which fine-tune micro-batches the trainer runs, each a list of token windows.

Protocol (the planner actor owns one scheduler per node). In the running app (``actors/planner.py``)
the replica, not the scheduler, submits inference requests (vLLM admits them as they arrive), and
the trainer owns its samples' progress, so each grant replaces the queues with what was observed:
``observe(EngineFacts)`` from the replica's latest report and ``set_samples(...)`` from the trainer's
request, then ``schedule(now, free_bytes)``; the granted windows go back to the trainer. The
trainer's samples carry their last reported loss (the γ·L_DPO term of MACE §4.1) and their t_arr;
after each micro-step the trainer reports every finished pass with ``report_pass`` (CheckEnd,
MACE Alg. 1 lines 17–21) and trains a requeued sample again in a later micro-step. The
step-by-step protocol below is the one the simulator and the tests drive:

- replica → ``add_request(InferenceRequest)`` on arrival, ``update_request(id, output_tokens)``
  after iterations (returns True once ``max_tokens`` is reached: MACE's CheckEnd for inference),
  ``finish(id)`` on EOS / abort;
- feedback → ``add_sample(FineTuneSample)`` with the sample's tokens and, once known, its last
  DPO loss;
- each window → ``plan = schedule(now, free_bytes)``; the replica submits ``plan.admitted`` in order
  with ``Admission.priority`` as vLLM's per-request ``priority`` (engine built with
  ``scheduling_policy="priority"``); the trainer runs ``plan.micro_batches`` one after another
  (gradient accumulation; ``TokenWindow.start/end`` slice the sample's sequence) unless
  ``plan.inference_paused`` says the engine idles this window (temporal sharing);
- trainer → ``report_sample(id, now, tokens_done, dpo_loss)`` for every granted window (CheckEnd:
  retire, or requeue while the DPO loss stays above ``loss_threshold``), ``release(id)`` for a
  window it did not run (e.g. the memory guard of ``planners/memory.py`` said "defer").

vLLM priority mapping. MACE's priority P is "higher runs first"; vLLM's ``priority`` is "lower runs
first" (ties by arrival). ``vllm_priority(P) = -round(P · 1000)`` maps one to the other at the
moment of submission; vLLM keeps that number, so aging after submission is not seen by the engine
(vLLM #19057: it reorders only its waiting queue and preempts only under KV pressure). Admission
control, and with it aging, therefore stays here: the scheduler submits only what should run now.

Cost of a window (FlexLLM §6.2, with the shared cost model of ``planners/costs.py``):
f(c, s) = t_iter(c) + t_ft(s), where t_iter is SamuLLM Eq. 5 for the window's inference work c
(0 when there is none) and t_ft(s) = S·(Δ_F(1, s) + Δ_B(1, s)) is one forward and backward pass
over a window of s fine-tune tokens on the node's S stages (LEMIX §IV-A). The two add: the trainer
and the engine share the devices, so fine-tune work lengthens the window the inference tokens
wait in. A micro-batch of B windows is padded to its longest window ℓ: its memory is the
activation bytes of B·ℓ tokens and its latency S·(Δ_F(B, ℓ) + Δ_B(B, ℓ)).

Policies (registry kind ``iteration``): ``hybrid`` (ours), ``fcfs``, ``temporal``, ``ft_first``,
``periodic``, ``separate``; all share the queues and the protocol above.

Pure: plain dataclasses in, a plan out; no Ray, no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from planners.costs import CostModel, as_cost_model
from planners.registry import register
from planners.retraining import Periodic as _PeriodicTimer
from planners.retraining import RetrainingView

WorkKind = Literal["prefill", "decode", "ft"]
SampleOutcome = Literal["partial", "requeued", "retired", "released"]

PRIORITY_SCALE = 1000.0
"""Resolution of ``vllm_priority``: scores closer than 1/1000 share a vLLM priority (arrival breaks the tie)."""

_EPS = 1e-12


# --- Priorities (MACE §4.1) -------------------------------------------------------------------


@dataclass(frozen=True)
class PriorityWeights:
    """π_w, δ_w and γ of MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr) (+ γ·L_DPO for fine-tune samples).

    MACE requires π_decode > π_prefill > π_ft (serve inference first, avoid preempting decodes)
    and δ_ft > δ_prefill > δ_decode (fine-tuning ages fastest, so it cannot starve); both are
    checked. Rates are per second. With the defaults a fresh fine-tune sample of zero loss
    outranks a prefill that arrived with it after (1 − 0)/(0.1 − 0.01) ≈ 11 s, a decode after ≈ 20 s.
    """

    pi_decode: float = 2.0
    pi_prefill: float = 1.0
    pi_ft: float = 0.0
    delta_decode: float = 0.001
    delta_prefill: float = 0.01
    delta_ft: float = 0.1
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not self.pi_decode > self.pi_prefill > self.pi_ft:
            raise ValueError("MACE §4.1 needs pi_decode > pi_prefill > pi_ft")
        if not self.delta_ft > self.delta_prefill > self.delta_decode >= 0:
            raise ValueError("MACE §4.1 needs delta_ft > delta_prefill > delta_decode >= 0")
        if self.gamma < 0:
            raise ValueError("gamma must be >= 0")

    def base(self, kind: WorkKind) -> float:
        return {"decode": self.pi_decode, "prefill": self.pi_prefill, "ft": self.pi_ft}[kind]

    def rate(self, kind: WorkKind) -> float:
        return {"decode": self.delta_decode, "prefill": self.delta_prefill, "ft": self.delta_ft}[kind]


def priority(kind: WorkKind, arrival: float, now: float, weights: PriorityWeights, dpo_loss: float = 0.0) -> float:
    """MACE §4.1: P_w(t) = π_w + δ_w·(t − t_arr), plus γ·L_DPO for a fine-tune sample (P_ft^total)."""
    p = weights.base(kind) + weights.rate(kind) * max(0.0, now - arrival)
    if kind == "ft":
        p += weights.gamma * max(0.0, dpo_loss)
    return p


def vllm_priority(score: float, scale: float = PRIORITY_SCALE) -> int:
    """vLLM's per-request ``priority`` for a MACE score: a higher score gives a lower number, which vLLM runs first."""
    return -round(score * scale)


def _weights(value: PriorityWeights | Mapping[str, float] | None) -> PriorityWeights:
    if value is None:
        return PriorityWeights()
    return value if isinstance(value, PriorityWeights) else PriorityWeights(**dict(value))


# --- Work items -------------------------------------------------------------------------------


@dataclass
class InferenceRequest:
    """One inference request on the node: waiting (its prefill is due) until admitted, then decoding."""

    request_id: str
    prompt_tokens: int
    arrival: float
    max_tokens: int = 256
    output_tokens: int = 0
    """Tokens generated so far, as the replica reports them (``update_request``)."""

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class FineTuneSample:
    """One fine-tune sample: ``tokens`` = L, the tokens one training pass over it processes.

    ``arrival`` is MACE's t_arr (reset when CheckEnd requeues the sample); ``dpo_loss`` its last
    DPO loss (0 until the trainer reports one; for an SFT sample its mean token NLL, which takes
    L_DPO's place in MACE §4.1's γ·L_DPO term); ``done`` the tokens of the current pass already
    processed in earlier windows (FlexLLM §6.1); ``passes`` completed passes.
    """

    sample_id: str
    tokens: int
    arrival: float
    dpo_loss: float = 0.0
    done: int = 0
    passes: int = 0

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


@dataclass(frozen=True)
class LiveRequest:
    """One inference request in flight on a replica, as the replica reports it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    max_tokens: int


@dataclass(frozen=True)
class EngineFacts:
    """What a replica reports of its engine: the requests in flight, iterations so far, KV cache in use.

    A request with no output token yet is waiting for (or in) its prefill; the others decode.
    ``iterations`` counts engine steps since the engine started (monotonic), ``kv_cache_usage``
    is vLLM's fraction of KV blocks in use, ``kv_cache_bytes`` the KV cache's size.
    """

    at: float
    requests: tuple[LiveRequest, ...] = ()
    iterations: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_bytes: float = 0.0

    @property
    def kv_used_bytes(self) -> float:
        return self.kv_cache_usage * self.kv_cache_bytes


@dataclass(frozen=True)
class InferenceWork:
    """c of FlexLLM §6.2: the inference work of one window, in the terms of SamuLLM Eq. 5."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0

    def plus_prefill(self, tokens: int) -> InferenceWork:
        return InferenceWork(self.prefill_tokens + tokens, self.decode_seqs, self.context_tokens)

    def plus_decode(self, context_tokens: int) -> InferenceWork:
        return InferenceWork(self.prefill_tokens, self.decode_seqs + 1, self.context_tokens + context_tokens)

    def latency(self, cost: CostModel) -> float:
        """t_iter(c): one engine iteration over this work; 0 when there is none (the engine idles)."""
        if self.empty:
            return 0.0
        return cost.iteration_latency(self.prefill_tokens, self.decode_seqs, self.context_tokens)


# --- Cost of fine-tune work and the token budget (FlexLLM §6.2) --------------------------------


def ft_latency(cost: CostModel, batch: int, tokens: int) -> float:
    """S·(Δ_F(B, ℓ) + Δ_B(B, ℓ)): forward and backward of B windows padded to ℓ tokens (LEMIX §IV-A)."""
    if batch <= 0 or tokens <= 0:
        return 0.0
    return cost.stages * (cost.forward_latency(batch, tokens) + cost.backward_latency(batch, tokens))


def ft_memory(cost: CostModel, batch: int, tokens: int) -> float:
    """Activation bytes of B windows padded to ℓ tokens (LEMIX §IV-A memory term)."""
    if batch <= 0 or tokens <= 0:
        return 0.0
    return cost.activation_bytes(batch, tokens)


def window_latency(cost: CostModel, work: InferenceWork, ft_tokens: int) -> float:
    """f(c, s) of FlexLLM §6.2: t_iter(c) + ρ·t_ft(s), with the s fine-tune tokens as one window.

    ρ is ``cost.ft_interference`` (1: the two take turns on the device, as in FlexLLM).
    """
    return work.latency(cost) + cost.ft_interference * ft_latency(cost, 1, ft_tokens)


def ft_tokens_within(cost: CostModel, seconds: float) -> int:
    """The largest s with t_ft(s) ≤ ``seconds``: fine-tuning tokens one window of that length holds."""
    return token_budget(replace(cost, ft_interference=1.0), InferenceWork(), seconds)


def ft_room(cost: CostModel, room_s: float) -> float:
    """Seconds of fine-tuning work (alone) that delay inference by ``room_s``: room/ρ (∞ when ρ = 0)."""
    rho = cost.ft_interference
    return math.inf if rho <= 0 else max(0.0, room_s) / rho


def ft_delay(cost: CostModel, bins: Iterable[MicroBatch]) -> float:
    """Seconds the fine-tuning of ``bins`` delays the inference beside it: ρ·Σ t_ft (FlexLLM §6.2)."""
    return cost.ft_interference * sum(mb.latency_s for mb in bins)


def token_budget(cost: CostModel, work: InferenceWork, slo_s: float, cap: int = 1 << 24) -> int:
    """FlexLLM §6.2: s = max{ s ∈ [0, cap] : f(c, s) ≤ SLO }, 0 when not even one token fits.

    Solved exactly: t_ft(s) = a·s² + b·s + k for s ≥ 1 (a, b, k summed over forward and backward,
    times the stage count), so s is the floor of the positive root of a·s² + b·s + k = SLO − t_iter(c),
    then nudged by ±1 against float rounding. Needs non-negative coefficients (``fit_linear``
    guarantees them), which make f monotone in s.
    """
    fw, bw = cost.forward, cost.backward
    if min(fw.quad, fw.lin, fw.const, bw.quad, bw.lin, bw.const) < 0:
        raise ValueError("token_budget needs non-negative stage latency coefficients")
    left = slo_s - work.latency(cost)
    room = ft_room(cost, left) if left >= 0 else -1.0
    if cap < 1 or room < ft_latency(cost, 1, 1):
        return 0
    if math.isinf(room):
        return cap
    a = cost.stages * (fw.quad + bw.quad)
    b = cost.stages * (fw.lin + bw.lin)
    k = cost.stages * (fw.const + bw.const)
    if a > 0:
        s = (-b + math.sqrt(b * b + 4 * a * (room - k))) / (2 * a)
    elif b > 0:
        s = (room - k) / b
    else:
        s = float(cap)
    s_int = max(1, min(cap, math.floor(s)))
    while s_int > 1 and window_latency(cost, work, s_int) > slo_s:
        s_int -= 1
    while s_int < cap and window_latency(cost, work, s_int + 1) <= slo_s:
        s_int += 1
    return s_int


# --- Token-level windows (FlexLLM §6.1) ---------------------------------------------------------


@dataclass(frozen=True)
class TokenWindow:
    """Tokens [start, end) of a sample of ``length`` tokens, run as one slice (FlexLLM §6.1, Alg. 2)."""

    sample_id: str
    start: int
    end: int
    length: int

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_pass(self) -> bool:
        """The last window of the sequence: after it the accumulated gradient equals the full-sequence one."""
        return self.end >= self.length


def token_windows(length: int, grants: Iterable[int], start: int = 0) -> list[tuple[int, int]]:
    """FlexLLM §6.1: split tokens [start, length) into consecutive windows of the granted sizes.

    Grants are used in order (a grant ≤ 0 gives no window); the last window is clipped at
    ``length``; stops once the sequence is covered. The windows tile [start, covered) with no gap
    or overlap; the torch side accumulates gradients over them (KV and KV-gradient caches).
    """
    if length < 0 or not 0 <= start <= length:
        raise ValueError("need 0 <= start <= length")
    out, pos = [], start
    for g in grants:
        if pos >= length:
            break
        if g <= 0:
            continue
        end = min(length, pos + int(g))
        out.append((pos, end))
        pos = end
    return out


def whole_windows(samples: Sequence[FineTuneSample], count: int) -> tuple[TokenWindow, ...]:
    """The rest of the current pass of the first ``count`` samples, one window each.

    How a grant of whole samples (the retraining policies of ``planners/retraining.py``) is handed
    to a trainer that runs token windows.
    """
    return tuple(TokenWindow(s.sample_id, s.done, s.tokens, s.tokens) for s in samples[:max(0, count)]
                 if s.remaining > 0)


# --- Best-fit packing (MACE Alg. 1, §4.2) -------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """Windows the trainer runs as one padded batch: B = ``batch_size`` rows of ``padded_tokens``."""

    windows: tuple[TokenWindow, ...]
    memory_bytes: float
    latency_s: float

    @property
    def batch_size(self) -> int:
        return len(self.windows)

    @property
    def padded_tokens(self) -> int:
        return max((w.tokens for w in self.windows), default=0)

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.windows)


def _bin(cost: CostModel, windows: Sequence[TokenWindow]) -> MicroBatch:
    b, ell = len(windows), max(w.tokens for w in windows)
    return MicroBatch(tuple(windows), ft_memory(cost, b, ell), ft_latency(cost, b, ell))


def best_fit_pack(windows: Sequence[TokenWindow], cost: CostModel, memory_bytes: float,
                  latency_cap_s: float = math.inf, lambdas: tuple[float, float] = (1.0, 1.0),
                  tau_mem: float = 1.0, tau_task: int | None = None) -> list[MicroBatch]:
    """MACE Alg. 1: pack windows (in priority order) into micro-batches ("bins") by best fit.

    A window (m, ℓ) = (its activation bytes, its forward+backward latency) may join bin i if the
    padded bin still fits ``memory_bytes`` (P) and ``latency_cap_s``; among those it joins the bin
    of least f = λ1·|free_i − m|/P + λ2·|maxlat_i − ℓ|/L (MACE §4.2), where free_i is P minus the
    bin's memory, m the memory the window adds to it (padding included), maxlat_i the latency of
    the bin's longest window alone, and L the latency cap (or ℓ when uncapped): the two terms are
    normalised so λ1, λ2 are unitless. No bin fits → a new bin. Line 3 of Alg. 1: stop taking
    windows once bin 1 holds τ_mem·P bytes or ``tau_task`` windows were taken. A window that does
    not fit even alone is skipped. Returns the bins in creation order (bin 1 first).
    """
    lam1, lam2 = lambdas
    bins: list[list[TokenWindow]] = []
    mems: list[float] = []
    taken = 0
    for w in windows:
        if bins and (mems[0] >= tau_mem * memory_bytes or (tau_task is not None and taken >= tau_task)):
            break
        if w.tokens <= 0:
            continue
        taken += 1
        m_alone, lat_alone = ft_memory(cost, 1, w.tokens), ft_latency(cost, 1, w.tokens)
        if m_alone > memory_bytes + _EPS or lat_alone > latency_cap_s + _EPS:
            continue
        lat_ref = latency_cap_s if math.isfinite(latency_cap_s) and latency_cap_s > 0 else max(lat_alone, _EPS)
        best, best_score = None, math.inf
        for i, members in enumerate(bins):
            b, ell = len(members) + 1, max(w.tokens, max(x.tokens for x in members))
            new_mem = ft_memory(cost, b, ell)
            if new_mem > memory_bytes + _EPS or ft_latency(cost, b, ell) > latency_cap_s + _EPS:
                continue
            free = memory_bytes - mems[i]
            maxlat = ft_latency(cost, 1, max(x.tokens for x in members))
            score = (lam1 * abs(free - (new_mem - mems[i])) / max(memory_bytes, _EPS)
                     + lam2 * abs(maxlat - lat_alone) / lat_ref)
            if score < best_score - _EPS:
                best, best_score = i, score
        if best is None:
            bins.append([w])
            mems.append(m_alone)
        else:
            bins[best].append(w)
            mems[best] = ft_memory(cost, len(bins[best]), max(x.tokens for x in bins[best]))
    return [_bin(cost, members) for members in bins]


def check_end(sample: FineTuneSample, loss_threshold: float | None, max_passes: int) -> bool:
    """MACE §4.2 CheckEnd for a fine-tune sample whose pass just completed: True retires it.

    It stays (is requeued) while its DPO loss is above ``loss_threshold`` and it has run fewer than
    ``max_passes`` passes; ``loss_threshold=None`` means one pass per sample.
    """
    if loss_threshold is None or sample.passes >= max_passes:
        return True
    return sample.dpo_loss <= loss_threshold


# --- The plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """A waiting request the replica submits now: ``priority`` goes to vLLM (lower runs first)."""

    request_id: str
    priority: int
    score: float
    """MACE's P at the window (higher runs first); 0 for policies without priorities."""


@dataclass(frozen=True)
class WindowPlan:
    """What runs in the next window on one node.

    ``admitted`` in the order vLLM should start them; ``deferred`` waiting requests not admitted;
    ``micro_batches`` the fine-tune work, run one after another; ``ft_token_budget`` the
    fine-tune tokens the policy allows this window (FlexLLM's s for ``hybrid``); ``work`` the
    inference work c the plan assumes; ``predicted_latency_s`` the window's latency under the
    cost model; ``inference_paused`` asks the replica not to step its engine (temporal sharing).
    """

    now: float
    policy: str
    admitted: tuple[Admission, ...] = ()
    deferred: tuple[str, ...] = ()
    micro_batches: tuple[MicroBatch, ...] = ()
    ft_token_budget: int = 0
    work: InferenceWork = InferenceWork()
    predicted_latency_s: float = 0.0
    inference_paused: bool = False
    reason: str = ""

    @property
    def ft_tokens(self) -> int:
        return sum(mb.tokens for mb in self.micro_batches)

    @property
    def ft_latency_s(self) -> float:
        return sum(mb.latency_s for mb in self.micro_batches)

    @property
    def windows(self) -> tuple[TokenWindow, ...]:
        return tuple(w for mb in self.micro_batches for w in mb.windows)


# --- The scheduler: queues shared by every policy ----------------------------------------------



def _within(bins: Sequence[MicroBatch], room_s: float) -> tuple[list[MicroBatch], float]:
    """The micro-batches, in packing order, that run one after another within ``room_s``; and their total time."""
    chosen, total = [], 0.0
    for mb in bins:
        if total + mb.latency_s <= room_s + _EPS:
            chosen.append(mb)
            total += mb.latency_s
    return chosen, total

class IterationScheduler:
    """Queues of one node and the protocol every iteration policy shares; ``schedule`` is per policy.

    Common params: ``cost_model`` (CostModel, profile dict or None: the default); ``slo_s`` (0.05)
    the latency bound of one window, i.e. the time-between-tokens SLO; ``max_num_seqs`` (32) and
    ``max_batched_tokens`` (2048) the engine's limits per iteration (decodes count one token
    each); ``max_ft_samples`` (8) τ_task, fine-tune windows per plan; ``min_window_tokens`` (16)
    the smallest window cut from a longer sample; ``max_window_tokens`` (None) the largest;
    ``loss_threshold`` (None) and ``max_passes`` (1) for CheckEnd; ``lambdas`` ((1, 1)) and
    ``tau_mem`` (1.0) for best-fit packing; ``admission_control`` (True): the plan decides which
    waiting requests start now. False is the live app's case, where vLLM starts every request as
    it arrives: then every waiting request the engine's per-iteration limits allow counts in c, and
    the SLO can only shrink the fine-tuning, never defer inference (a plan that deferred a prefill
    the engine runs anyway would grant fine-tuning into time the prefill takes).
    """

    name = "base"

    def __init__(self, cost_model: CostModel | Mapping[str, Any] | None = None, slo_s: float = 0.05,
                 max_num_seqs: int = 32, max_batched_tokens: int | None = 2048, max_ft_samples: int = 8,
                 min_window_tokens: int = 16, max_window_tokens: int | None = None,
                 loss_threshold: float | None = None, max_passes: int = 1,
                 lambdas: tuple[float, float] = (1.0, 1.0), tau_mem: float = 1.0,
                 admission_control: bool = True) -> None:
        if slo_s <= 0 or max_num_seqs < 1 or max_ft_samples < 1 or min_window_tokens < 1 or max_passes < 1:
            raise ValueError("need slo_s > 0, max_num_seqs >= 1, max_ft_samples >= 1, "
                             "min_window_tokens >= 1, max_passes >= 1")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1 or None")
        if max_window_tokens is not None and max_window_tokens < min_window_tokens:
            raise ValueError("max_window_tokens must be >= min_window_tokens")
        self.cost = as_cost_model(cost_model)
        self.slo_s = slo_s
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_ft_samples = max_ft_samples
        self.min_window_tokens = min_window_tokens
        self.max_window_tokens = max_window_tokens
        self.loss_threshold = loss_threshold
        self.max_passes = max_passes
        self.lambdas = (float(lambdas[0]), float(lambdas[1]))
        self.tau_mem = tau_mem
        self.admission_control = admission_control
        self.waiting: dict[str, InferenceRequest] = {}
        self.running: dict[str, InferenceRequest] = {}
        self.samples: dict[str, FineTuneSample] = {}
        self.in_flight: dict[str, tuple[FineTuneSample, TokenWindow]] = {}
        self._iterations_seen: int | None = None

    # -- queue API ----------------------------------------------------------------------------

    def add_request(self, request: InferenceRequest) -> None:
        """An inference request arrived on the node: it waits for admission (its prefill)."""
        rid = request.request_id
        if rid in self.waiting or rid in self.running:
            raise ValueError(f"request {rid!r} already queued")
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        self.waiting[rid] = request

    def update_request(self, request_id: str, output_tokens: int) -> bool:
        """The replica reports tokens generated so far; True (and the request leaves) at ``max_tokens``."""
        req = self.running.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running")
        req.output_tokens = max(req.output_tokens, int(output_tokens))
        if req.output_tokens >= req.max_tokens:
            del self.running[request_id]
            return True
        return False

    def finish(self, request_id: str) -> None:
        """An inference request ended (EOS, max tokens, abort): it leaves whichever queue holds it."""
        if self.running.pop(request_id, None) is None and self.waiting.pop(request_id, None) is None:
            raise KeyError(f"unknown request {request_id!r}")

    def add_sample(self, sample: FineTuneSample) -> None:
        """A fine-tune sample is ready to train on this node."""
        sid = sample.sample_id
        if sid in self.samples or sid in self.in_flight:
            raise ValueError(f"sample {sid!r} already queued")
        if sample.tokens < 1 or not 0 <= sample.done < sample.tokens:
            raise ValueError("need tokens >= 1 and 0 <= done < tokens")
        self.samples[sid] = sample

    def report_sample(self, sample_id: str, now: float, tokens_done: int | None = None,
                      dpo_loss: float | None = None) -> SampleOutcome:
        """The trainer ran (part of) a granted window: advance the sample; at the end of a pass, CheckEnd.

        ``tokens_done`` defaults to the whole window (fewer: the memory guard shrank it). Returns
        ``"partial"`` (more windows of this pass to come), ``"requeued"`` (pass done, DPO loss still
        above ``loss_threshold``: a new pass with t_arr = now, MACE Alg. 1 line 21) or ``"retired"``.
        """
        if sample_id not in self.in_flight:
            raise KeyError(f"sample {sample_id!r} has no window in flight")
        sample, window = self.in_flight.pop(sample_id)
        done = window.tokens if tokens_done is None else max(0, min(int(tokens_done), window.tokens))
        if dpo_loss is not None:
            sample.dpo_loss = float(dpo_loss)
        sample.done = window.start + done
        if sample.done < sample.tokens:
            self.samples[sample_id] = sample
            return "partial" if done > 0 else "released"
        return self._end_pass(sample, now)

    def report_pass(self, sample: FineTuneSample, now: float) -> SampleOutcome:
        """The live app's CheckEnd: the trainer finished a pass over ``sample`` (MACE Alg. 1 lines 17–21).

        ``sample`` carries what the trainer knows: ``dpo_loss`` the pass's per-sample loss (L_DPO of
        MACE §4.1; an SFT adapter's mean token NLL), ``passes`` the passes before this one,
        ``arrival`` this pass's t_arr. In the live protocol every grant replaces the queues
        (``set_samples``), so the sample's window may no longer be in flight here (another grant on
        the node, a switched policy, a restarted planner): the report is self-contained instead of
        relying on it, and any window of the sample still in flight is dropped. Returns
        ``"requeued"`` (a new pass with t_arr = ``now``) or ``"retired"``, as :meth:`report_sample`.
        """
        if sample.tokens < 1:
            raise ValueError("need tokens >= 1")
        self.in_flight.pop(sample.sample_id, None)
        self.samples.pop(sample.sample_id, None)
        sample.done = sample.tokens
        return self._end_pass(sample, now)

    def _end_pass(self, sample: FineTuneSample, now: float) -> SampleOutcome:
        """CheckEnd after a completed pass: retire the sample, or requeue it with t_arr = now (MACE Alg. 1 line 21)."""
        sample.passes += 1
        if check_end(sample, self.loss_threshold, self.max_passes):
            return "retired"
        sample.done, sample.arrival = 0, now
        self.samples[sample.sample_id] = sample
        return "requeued"

    def release(self, sample_id: str) -> None:
        """A granted window was not run: the sample goes back to its queue unchanged."""
        self.report_sample(sample_id, now=0.0, tokens_done=0)

    def observe(self, facts: EngineFacts) -> None:
        """Replace the inference queues with the engine's reported requests (the live app's protocol).

        A request with no output token yet waits for its prefill; the others decode. The engine
        iterations since the previous report go to :meth:`observe_iterations`.
        """
        self.waiting, self.running = {}, {}
        for r in facts.requests:
            req = InferenceRequest(r.request_id, max(1, r.prompt_tokens), r.arrival, max(1, r.max_tokens),
                                   r.output_tokens)
            (self.running if r.output_tokens > 0 else self.waiting)[r.request_id] = req
        if self._iterations_seen is not None and facts.iterations >= self._iterations_seen:
            self.observe_iterations(facts.iterations - self._iterations_seen)
        self._iterations_seen = facts.iterations

    def observe_iterations(self, count: int) -> None:
        """``count`` engine iterations ran since the last report; policies that count them override this."""

    def observe_ft_run(self, seconds: float, now: float) -> None:
        """The trainer took ``seconds`` (wall time, ending about ``now``) to run the windows of its previous
        grant; policies that budget fine-tuning by real time override this."""

    def set_samples(self, samples: Iterable[FineTuneSample]) -> None:
        """Replace the fine-tune queue with the trainer's samples (it owns their progress, ``done``)."""
        self.samples = {}
        self.in_flight = {}
        for sample in samples:
            self.add_sample(sample)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.samples or self.in_flight)

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        """The plan of the next window; ``free_bytes``: memory the fine-tune work may use (None: cost model)."""
        raise NotImplementedError

    # -- helpers for the policies ---------------------------------------------------------------

    def _decode_work(self) -> InferenceWork:
        work = InferenceWork()
        for req in self.running.values():
            work = work.plus_decode(req.context_tokens)
        return work

    def _capacity(self, work: InferenceWork, free_bytes: float | None) -> float:
        """Bytes for fine-tune activations in this window.

        Given ``free_bytes`` (what the node reports free): that, less the
        KV cache of the prompts admitted now (not allocated yet). Otherwise the cost model's guess:
        M_threshold − weights − KV of every sequence in the window (LEMIX §IV-A).
        """
        if free_bytes is not None:
            return max(0.0, free_bytes - self.cost.kv_bytes(work.prefill_tokens))
        return max(0.0, self.cost.memory_threshold() - self.cost.memory.weight_bytes
                   - self.cost.kv_bytes(work.context_tokens + work.prefill_tokens))

    def _engine_fits(self, seqs: int, batched: int, prompt: int, first: bool,
                     max_seqs: int | None = None, max_tokens: int | None = None) -> bool:
        max_seqs = self.max_num_seqs if max_seqs is None else max_seqs
        max_tokens = self.max_batched_tokens if max_tokens is None else max_tokens
        if seqs >= max_seqs:
            return False
        # A prompt longer than the token limit still goes in alone (vLLM would chunk it).
        return max_tokens is None or batched + prompt <= max_tokens or (first and batched < max_tokens)

    def _admit(self, now: float, order: Iterable[tuple[InferenceRequest, float | None]], work: InferenceWork,
               fits_slo: Callable[[InferenceRequest, InferenceWork], bool] | None = None,
               max_seqs: int | None = None,
               max_tokens: int | None = None) -> tuple[list[Admission], list[str], InferenceWork]:
        """Admit waiting requests in ``order`` while the engine's limits and ``fits_slo(request, work)`` allow.

        A score of None (policies without priorities) gives vLLM priority 0: arrival decides.
        """
        admitted, deferred = [], []
        seqs, batched = len(self.running), len(self.running)
        for req, score in order:
            trial = work.plus_prefill(req.prompt_tokens)
            if not self._engine_fits(seqs, batched, req.prompt_tokens, not admitted, max_seqs, max_tokens) or (
                    fits_slo is not None and self.admission_control and not fits_slo(req, trial)):
                deferred.append(req.request_id)
                continue
            admitted.append(Admission(req.request_id, 0 if score is None else vllm_priority(score),
                                      0.0 if score is None else score))
            work, seqs, batched = trial, seqs + 1, batched + req.prompt_tokens
        for a in admitted:
            self.running[a.request_id] = self.waiting.pop(a.request_id)
        return admitted, deferred, work

    def _windows(self, samples: Iterable[FineTuneSample], tokens: float, capacity: float,
                 reserve: Mapping[str, int] | None = None) -> list[TokenWindow]:
        """Cut one window per sample, in order, from a budget of ``tokens`` (math.inf: whole passes).

        Each window is capped by the remaining pass, ``max_window_tokens`` and what fits
        ``capacity`` alone; a window shorter than ``min_window_tokens`` is cut only when it ends
        the pass; ``reserve`` gives promoted samples at least that many tokens.
        """
        per_token = ft_memory(self.cost, 1, 1)
        by_mem = math.floor(capacity / per_token + 1e-9) if per_token > 0 else math.inf
        cap = math.inf if self.max_window_tokens is None else self.max_window_tokens
        out: list[TokenWindow] = []
        for s in samples:
            if len(out) >= self.max_ft_samples:
                break
            w = min(s.remaining, tokens, cap)
            if reserve and s.sample_id in reserve:
                w = min(max(w, reserve[s.sample_id]), s.remaining)
            w = min(w, by_mem)
            if w <= 0 or (w < self.min_window_tokens and w < s.remaining):
                continue
            w = int(w)
            out.append(TokenWindow(s.sample_id, s.done, s.done + w, s.tokens))
            tokens = max(0.0, tokens - w)
        return out

    def _grant(self, bins: Iterable[MicroBatch]) -> tuple[MicroBatch, ...]:
        chosen = tuple(bins)
        for mb in chosen:
            for w in mb.windows:
                self.in_flight[w.sample_id] = (self.samples.pop(w.sample_id), w)
        return chosen

    def _by_arrival(self) -> list[FineTuneSample]:
        return sorted(self.samples.values(), key=lambda s: (s.arrival, s.sample_id))

    def _waiting_by_arrival(self) -> list[tuple[InferenceRequest, float | None]]:
        return [(r, None) for r in sorted(self.waiting.values(), key=lambda r: (r.arrival, r.request_id))]

    def _whole_passes(self, samples: Iterable[FineTuneSample], capacity: float) -> tuple[MicroBatch, ...]:
        """Baselines without a budget: whole remaining passes, packed by memory only, all run."""
        windows = self._windows(samples, math.inf, capacity)
        return self._grant(best_fit_pack(windows, self.cost, capacity, math.inf, self.lambdas, self.tau_mem))


# --- Policies ---------------------------------------------------------------------------------


@register("iteration", "hybrid")
class Hybrid(IterationScheduler):
    """Ours: MACE §4.1 aging priorities, FlexLLM §6.2 token budget, MACE Alg. 1 best-fit packing.

    Each window:

    1. Every item gets its MACE priority P (``PriorityWeights``): running decodes, waiting
       prefills, queued fine-tune samples (with γ·L_DPO). Items are walked in descending P.
    2. Inference first (FlexLLM §6.2): waiting prefills are admitted in that order within the
       engine's limits, each with ``vllm_priority(P)``. Running decodes always stay.
    3. Aging against inference (MACE Fig. 7, iteration 9): if the top fine-tune sample outranks
       some inference item (a running decode or a waiting prefill) it is *promoted*: it reserves
       ``min_window_tokens``, and a prefill ranked below it is admitted only if f(c, reserve) ≤ SLO, else deferred. The
       reserve runs even when inference alone breaks the SLO: that is the starvation bound under
       overload. Without promotion the plan never exceeds the SLO under the cost model.
    4. Budget: s = max{ s : f(c, s) ≤ SLO } (``token_budget``), at least the reserve. Fine-tune
       samples in priority order each get one window of
       min(remaining pass, tokens left, ``max_window_tokens``, memory) tokens.
    5. The windows are packed by ``best_fit_pack`` into micro-batches with the memory capacity
       and the latency room SLO − t_iter(c); bins run in creation order while their summed
       latency fits that room (MACE runs bin 1; later bins that still fit run too). Windows not
       chosen stay queued and keep aging (Alg. 1, lines 17–21); finished passes go through
       CheckEnd in ``report_sample`` (live: ``report_pass``).

    No starvation: among fine-tune samples the order is by t_arr − γ·L_DPO/δ_ft, fixed in time,
    so a sample is overtaken only by samples enqueued less than γ·max L_DPO/δ_ft after it; when the
    load leaves slack (f(c, ``min_window_tokens``) ≤ SLO and that window fits memory) every window
    grants the top sample at least ``min_window_tokens``, so its wait is bounded.

    Params (besides the common ones): ``weights`` (PriorityWeights or a dict of its fields).
    """

    name = "hybrid"

    def __init__(self, weights: PriorityWeights | Mapping[str, float] | None = None,
                 cost_model: CostModel | Mapping[str, Any] | None = None, **common: Any) -> None:
        super().__init__(cost_model, **common)
        self.weights = _weights(weights)

    def scores(self, now: float) -> list[tuple[float, WorkKind, InferenceRequest | FineTuneSample]]:
        """(P, kind, item) of every queued item, in descending P (ties: earlier arrival, then id)."""
        w = self.weights
        items: list[tuple[float, float, str, WorkKind, Any]] = []
        for r in self.running.values():
            items.append((priority("decode", r.arrival, now, w), r.arrival, r.request_id, "decode", r))
        for r in self.waiting.values():
            items.append((priority("prefill", r.arrival, now, w), r.arrival, r.request_id, "prefill", r))
        for s in self.samples.values():
            items.append((priority("ft", s.arrival, now, w, s.dpo_loss), s.arrival, s.sample_id, "ft", s))
        items.sort(key=lambda x: (-x[0], x[1], x[2]))
        return [(p, kind, obj) for p, _, _, kind, obj in items]

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        cost, slo = self.cost, self.slo_s
        ranked = self.scores(now)
        last_inference = max((i for i, (_, kind, _) in enumerate(ranked) if kind != "ft"), default=-1)
        promoted: FineTuneSample | None = None
        reserve = 0
        order: list[tuple[InferenceRequest, float | None]] = []
        gate: dict[str, int] = {}  # the reserve in force when each prefill is reached
        ft_order: list[FineTuneSample] = []
        for i, (p, kind, obj) in enumerate(ranked):
            if kind == "ft":
                ft_order.append(obj)
                if promoted is None and i < last_inference:
                    promoted, reserve = obj, min(self.min_window_tokens, obj.remaining)
            elif kind == "prefill":
                order.append((obj, p))
                gate[obj.request_id] = reserve
        # Admit in priority order; a prefill ranked below the promoted sample must fit beside its reserve.
        admitted, deferred, work = self._admit(
            now, order, self._decode_work(),
            fits_slo=lambda req, trial: gate[req.request_id] == 0
            or window_latency(cost, trial, gate[req.request_id]) <= slo)
        # A grant covers one window: at most SLO seconds of fine-tuning even when ρ < 1 would allow
        # more, so that inference arriving meanwhile is seen at the next grant.
        budget = max(min(token_budget(cost, work, slo), ft_tokens_within(cost, slo)), reserve)
        # Fine-tuning seconds (alone) the window has room for, at least the promoted reserve.
        room = max(min(ft_room(cost, slo - work.latency(cost)), slo), ft_latency(cost, 1, reserve))
        capacity = self._capacity(work, free_bytes)
        # ft_order is in descending P, so a promoted sample (the top one) is cut first.
        windows = self._windows(ft_order, budget, capacity, {promoted.sample_id: reserve} if promoted else None)
        bins = best_fit_pack(windows, cost, capacity, room, self.lambdas, self.tau_mem, self.max_ft_samples)
        chosen, _ = _within(bins, room)
        granted = self._grant(chosen)
        reason = f"promoted {promoted.sample_id}" if promoted is not None and any(
            w.sample_id == promoted.sample_id for mb in granted for w in mb.windows) else "budget"
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), granted, budget, work,
                          work.latency(cost) + ft_delay(cost, chosen), reason=reason)


@register("iteration", "fcfs")
class Fcfs(IterationScheduler):
    """Naive mix (LEMIX's NaiveMix, FlexLLM without the budget): everything runs in arrival order.

    Waiting requests are admitted in arrival order within the engine's limits (vLLM priority 0:
    arrival decides); every queued fine-tune sample (up to τ_task) runs its whole remaining pass,
    packed by memory only. The SLO is never consulted.
    """

    name = "fcfs"

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        admitted, deferred, work = self._admit(now, self._waiting_by_arrival(), self._decode_work())
        granted = self._whole_passes(self._by_arrival(), self._capacity(work, free_bytes))
        ft = sum(mb.tokens for mb in granted)
        lat = work.latency(self.cost) + ft_delay(self.cost, granted)
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), granted, ft, work, lat, reason="fcfs")


@register("iteration", "temporal")
class Temporal(IterationScheduler):
    """Temporal sharing (FlexLLM §8.2): n inference windows, then one fine-tuning window, and again.

    An inference window admits in arrival order and runs no fine-tuning. Once ``n`` inference
    windows have passed and samples are queued, the next window is a fine-tuning iteration: up to
    τ_task whole passes, no admission, and ``inference_paused`` so the engine does not step. An
    idle engine (no request waiting or running) leaves nothing to alternate with: fine-tuning runs.
    In the live app the engine steps on its own and reports its iterations (``observe_iterations``),
    which then count as the inference windows; vLLM is not paused there, so the fine-tuning step
    runs beside whatever the engine does at that moment.
    Params: ``n`` (64, FlexLLM's lowest inference frequency).
    """

    name = "temporal"

    def __init__(self, n: int = 64, cost_model: CostModel | Mapping[str, Any] | None = None, **common: Any) -> None:
        super().__init__(cost_model, **common)
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = n
        self.since_ft = 0
        self._counted = False

    def observe_iterations(self, count: int) -> None:
        # In the live app the engine steps on its own: its reported iterations are the inference windows.
        self.since_ft += count
        self._counted = True

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        if self.samples and (self.since_ft >= self.n or not (self.waiting or self.running)):
            self.since_ft = 0
            granted = self._whole_passes(self._by_arrival(), self._capacity(InferenceWork(), free_bytes))
            ft = sum(mb.tokens for mb in granted)
            return WindowPlan(now, self.name, (), tuple(self.waiting), granted, ft, InferenceWork(),
                              sum(mb.latency_s for mb in granted), inference_paused=True, reason="fine-tuning window")
        if not self._counted:  # driven window by window (simulator, tests): each schedule() is one
            self.since_ft += 1
        admitted, deferred, work = self._admit(now, self._waiting_by_arrival(), self._decode_work())
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), (), 0, work, work.latency(self.cost),
                          reason=f"inference window {self.since_ft}/{self.n}")


@register("iteration", "ft_first")
class FtFirst(IterationScheduler):
    """AdaInf-like FT-first (MACE §6.1 baseline): fine-tuning takes the window first, inference the rest.

    Every queued sample (up to τ_task) runs its whole remaining pass, whatever the load; then
    waiting requests are admitted in arrival order only while f(c, fine-tuning) ≤ SLO (all of
    them, within the engine's limits, when no fine-tuning runs). Running decodes stay.
    """

    name = "ft_first"

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        decodes = self._decode_work()
        granted = self._whole_passes(self._by_arrival(), self._capacity(decodes, free_bytes))
        ft_lat = ft_delay(self.cost, granted)
        fits = None if not granted else (lambda _req, trial: trial.latency(self.cost) + ft_lat <= self.slo_s)
        admitted, deferred, work = self._admit(now, self._waiting_by_arrival(), decodes, fits)
        ft = sum(mb.tokens for mb in granted)
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), granted, ft, work,
                          work.latency(self.cost) + ft_lat, reason="ft first")


@register("iteration", "periodic")
class Periodic(IterationScheduler):
    """Ekya-like periodic retraining (MACE §6.1 baseline): train every T seconds, ignoring latency.

    The timing is the ``periodic`` retraining policy's (``planners/retraining.py``): a training
    window opens ``every_seconds`` after the previous one (or once ``every_samples`` are queued),
    and while it is open the samples enqueued before it opened run as whole passes (τ_task per
    plan); samples arriving later wait for the next window. Inference is admitted in arrival
    order throughout. Params: ``every_seconds`` (60.0), ``every_samples`` (None).
    """

    name = "periodic"

    def __init__(self, every_seconds: float | None = 60.0, every_samples: int | None = None,
                 cost_model: CostModel | Mapping[str, Any] | None = None, **common: Any) -> None:
        super().__init__(cost_model, **common)
        self.timer = _PeriodicTimer(every_seconds=every_seconds, every_samples=every_samples)
        self.last_run_at: float | None = None

    def _view(self, now: float) -> RetrainingView:
        oldest = min((s.arrival for s in self.samples.values()), default=None)
        return RetrainingView(
            now=now, node_id=0, in_flight=len(self.running) + len(self.waiting), ttft_p50_s=None, ttft_p99_s=None,
            slo_ttft_s=self.slo_s, predicted_ttft_s=0.0, queued=len(self.samples) + len(self.in_flight),
            oldest_queued_age_s=None if oldest is None else now - oldest, last_run_at=self.last_run_at,
            samples_wanted=len(self.samples), tokens_wanted=sum(s.remaining for s in self.samples.values()),
            step_cost_s=0.0)

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        admitted, deferred, work = self._admit(now, self._waiting_by_arrival(), self._decode_work())
        granted: tuple[MicroBatch, ...] = ()
        reason = "between windows"
        if self.samples and self.timer.decide(self._view(now)).action == "run":
            opened = self.timer.window_opened_at
            due = [s for s in self._by_arrival() if opened is None or s.arrival <= opened]
            granted = self._whole_passes(due, self._capacity(work, free_bytes))
            if granted:
                self.last_run_at = now
            reason = "periodic window"
        ft = sum(mb.tokens for mb in granted)
        lat = work.latency(self.cost) + ft_delay(self.cost, granted)
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), granted, ft, work, lat, reason=reason)


@register("iteration", "separate")
class Separate(IterationScheduler):
    """Static split (LEMIX's SEPARATE and FlexLLM §8.1's separate clusters, within one node).

    A fixed fraction φ = ``train_fraction`` of the node trains and 1 − φ serves, never shared. On
    one node the split is in time: fine-tuning runs a duty cycle of φ, whatever the inference
    load. A grant of fine-tuning work that takes t is followed, once that work is done, by
    t·(1 − φ)/φ in which nothing more is granted; t is the cost model's time until the trainer
    reports the time the work really took (``observe_ft_run``), and then the longer of the two. Each
    grant is one window's worth, s = max{ s : t_ft(s) ≤ SLO } tokens of φ·(M_threshold − weights)
    memory, in arrival order. Inference is
    admitted in arrival order within (1 − φ) of the engine's limits and its iterations take
    t_iter(c)/(1 − φ) on its share. (A split of each window's time instead, t_ft(s) ≤ φ·SLO, would
    leave a CPU node nothing: one forward and backward pass costs more than φ·SLO in fixed costs.)
    Params: ``train_fraction`` (0.25).
    """

    name = "separate"

    def __init__(self, train_fraction: float = 0.25, cost_model: CostModel | Mapping[str, Any] | None = None,
                 **common: Any) -> None:
        super().__init__(cost_model, **common)
        if not 0.0 < train_fraction < 1.0:
            raise ValueError("train_fraction must be in (0, 1)")
        self.train_fraction = train_fraction
        self.next_grant_at = -math.inf

    def observe_ft_run(self, seconds: float, now: float) -> None:
        # Real work outlasting the model (grant round trips, a slow core) must not buy more than φ.
        if seconds > 0:
            phi = self.train_fraction
            self.next_grant_at = max(self.next_grant_at, now + seconds * (1.0 - phi) / phi)

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        phi, cost = self.train_fraction, self.cost
        serve = 1.0 - phi
        max_tokens = None if self.max_batched_tokens is None else max(1, math.floor(self.max_batched_tokens * serve))
        admitted, deferred, work = self._admit(now, self._waiting_by_arrival(), self._decode_work(),
                                               max_seqs=max(1, math.floor(self.max_num_seqs * serve)),
                                               max_tokens=max_tokens)
        budget = ft_tokens_within(cost, self.slo_s)  # its own share: no inference beside it to delay
        granted: tuple[MicroBatch, ...] = ()
        total = 0.0
        reason = f"static split: {phi:.0%} training"
        if now >= self.next_grant_at:
            share = phi * (cost.memory_threshold() - cost.memory.weight_bytes)
            capacity = max(0.0, share if free_bytes is None else min(share, free_bytes))
            windows = self._windows(self._by_arrival(), budget, capacity)
            bins = best_fit_pack(windows, cost, capacity, self.slo_s, self.lambdas, self.tau_mem, self.max_ft_samples)
            chosen, total = _within(bins, self.slo_s)
            granted = self._grant(chosen)
            if granted:
                self.next_grant_at = now + total / phi  # t of work, then t·(1 − φ)/φ of none
        else:
            reason += f", next grant in {self.next_grant_at - now:.3f} s"
        return WindowPlan(now, self.name, tuple(admitted), tuple(deferred), granted, budget, work,
                          work.latency(cost) / serve + total, reason=reason)
