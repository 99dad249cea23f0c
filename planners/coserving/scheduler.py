"""The queues and protocol every co-serving policy shares, and the plan of one window it returns."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planners.costs import CostModel, as_cost_model
from planners.coserving.budget import EPS, ft_memory
from planners.coserving.packing import best_fit_pack
from planners.coserving.priorities import check_end, vllm_priority
from planners.coserving.work import (EngineFacts, FineTuneSample, InferenceRequest, InferenceWork, MicroBatch,
                                     SampleOutcome, TokenWindow)

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



def within_room(bins: Sequence[MicroBatch], room_s: float) -> tuple[list[MicroBatch], float]:
    """The micro-batches, in packing order, that run one after another within ``room_s``; and their total time."""
    chosen, total = [], 0.0
    for mb in bins:
        if total + mb.latency_s <= room_s + EPS:
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
    ``first_bin_fill`` (1.0) for best-fit packing; ``admission_control`` (True): the plan decides which
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
                 lambdas: tuple[float, float] = (1.0, 1.0), first_bin_fill: float = 1.0,
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
        self.first_bin_fill = first_bin_fill
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
        return self._grant(best_fit_pack(windows, self.cost, capacity, math.inf, self.lambdas, self.first_bin_fill))
