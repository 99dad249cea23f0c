"""The queues and protocol every co-serving policy shares, and the plan of one window it returns."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planners.coserving.budget import EPS, ft_memory, tokens_within_seconds, window_run_time
from planners.coserving.packing import best_fit_pack
from planners.coserving.priorities import check_end
from planners.coserving.work import (
    EngineFacts,
    FineTuneSample,
    InferenceWork,
    LiveRequest,
    MicroBatch,
    SampleOutcome,
    TokenWindow,
)
from planners.costs import CostModel, as_cost_model


@dataclass(frozen=True)
class WindowPlan:
    """What runs in the next window on one node.

    ``micro_batches`` the fine-tune work, run one after another; ``ft_token_budget`` the
    fine-tune tokens the policy allows this window (FlexLLM's s for ``hybrid``); ``work`` the
    inference work c the plan assumes the engine runs beside it; ``predicted_latency_s`` the
    window's latency under the cost model; ``inference_paused`` marks a window the policy plans
    without inference (temporal sharing's fine-tuning window; the live engine is not paused).
    """

    now: float
    policy: str
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


def within_room(bins: Sequence[MicroBatch], room_s: float) -> tuple[list[MicroBatch], float]:
    """The micro-batches, in packing order, that run one after another within ``room_s``; and their total time."""
    chosen, total = [], 0.0
    for mb in bins:
        if total + mb.latency_s <= room_s + EPS:
            chosen.append(mb)
            total += mb.latency_s
    return chosen, total


# --- The scheduler: queues shared by every policy ----------------------------------------------


class IterationScheduler:
    """The queues of one node, as last observed, and what every iteration policy shares; ``schedule`` is per policy.

    The live protocol (``actors/control/planner.py``): each grant replaces the queues with what was observed,
    ``observe(EngineFacts)`` for the engine's requests (vLLM starts every request as it arrives;
    the planner never holds one back) and ``set_samples(...)`` for the trainer's samples (it owns
    their progress), then ``schedule(now)``; after a micro-step, ``report_pass`` for each finished
    pass (CheckEnd). ``observe_ft_run`` tells the policies that budget by real time what the last
    grant's windows took.

    Common params: ``cost_model`` (CostModel, profile dict or None: the default); ``slo_s`` (0.05)
    the latency bound of one window, i.e. the time-between-tokens SLO; ``max_num_seqs`` (32) and
    ``max_batched_tokens`` (2048) the engine's limits per iteration (decodes count one token
    each), which bound the inference work c a plan counts; ``max_ft_samples`` (8) τ_task,
    fine-tune windows per plan; ``min_window_tokens`` (16) the smallest window cut from a longer
    sample; ``max_window_tokens`` (None) the largest; ``loss_threshold`` (None) and ``max_passes``
    (1) for CheckEnd; ``lambdas`` ((1, 1)) and ``first_bin_fill`` (1.0) for best-fit packing.
    """

    name = "base"

    def __init__(
        self,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        slo_s: float = 0.05,
        max_num_seqs: int = 32,
        max_batched_tokens: int | None = 2048,
        max_ft_samples: int = 8,
        min_window_tokens: int = 16,
        max_window_tokens: int | None = None,
        loss_threshold: float | None = None,
        max_passes: int = 1,
        lambdas: tuple[float, float] = (1.0, 1.0),
        first_bin_fill: float = 1.0,
    ) -> None:
        if slo_s <= 0 or max_num_seqs < 1 or max_ft_samples < 1 or min_window_tokens < 1 or max_passes < 1:
            raise ValueError(
                "need slo_s > 0, max_num_seqs >= 1, max_ft_samples >= 1, min_window_tokens >= 1, max_passes >= 1"
            )
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
        self.waiting: dict[str, LiveRequest] = {}
        self.running: dict[str, LiveRequest] = {}
        self.samples: dict[str, FineTuneSample] = {}
        self._iterations_seen: int | None = None
        # ρ counting what a run costs the tenants afterwards too (its version published and loaded), as the node
        # measured it; None: the cost model's ρ. The policies that bound the tenants' throughput use it.
        self.throughput_interference: float | None = None

    # -- what was observed --------------------------------------------------------------------

    def observe(self, facts: EngineFacts) -> None:
        """Replace the inference queues with the engine's reported requests.

        A request with no output token yet waits for its prefill; the others decode. The engine
        iterations since the previous report go to :meth:`observe_iterations`.
        """
        self.waiting, self.running = {}, {}
        for r in facts.requests:
            req = LiveRequest(r.request_id, max(1, r.prompt_tokens), r.output_tokens, r.arrival, max(1, r.max_tokens))
            (self.running if r.output_tokens > 0 else self.waiting)[r.request_id] = req
        if self._iterations_seen is not None and facts.iterations >= self._iterations_seen:
            self.observe_iterations(facts.iterations - self._iterations_seen)
        self._iterations_seen = facts.iterations

    def observe_iterations(self, count: int) -> None:
        """``count`` engine iterations ran since the last report; policies that count them override this."""

    def observe_ft_run(self, seconds: float, now: float) -> None:
        """The trainer took ``seconds`` (wall time, ending about ``now``) to run the windows of its previous
        grant; policies that budget fine-tuning by real time override this."""

    def add_sample(self, sample: FineTuneSample) -> None:
        """A fine-tune sample is ready to train on this node."""
        sid = sample.sample_id
        if sid in self.samples:
            raise ValueError(f"sample {sid!r} already queued")
        if sample.tokens < 1 or not 0 <= sample.done < sample.tokens:
            raise ValueError("need tokens >= 1 and 0 <= done < tokens")
        self.samples[sid] = sample

    def set_samples(self, samples: Iterable[FineTuneSample]) -> None:
        """Replace the fine-tune queue with the trainer's samples (it owns their progress, ``done``)."""
        self.samples = {}
        for sample in samples:
            self.add_sample(sample)

    def report_pass(self, sample: FineTuneSample, now: float) -> SampleOutcome:
        """CheckEnd: the trainer finished a pass over ``sample`` (MACE Alg. 1 lines 17–21).

        ``sample`` carries what the trainer knows: ``dpo_loss`` the pass's per-sample loss (L_DPO of
        MACE §4.1; an SFT adapter's mean token NLL), ``passes`` the passes before this one,
        ``arrival`` this pass's t_arr. Every grant replaces the queue (``set_samples``), so the
        report is self-contained rather than tied to a granted window (another grant on the node, a
        switched policy or a restarted planner may come between). Returns ``"requeued"`` (the loss
        is still above ``loss_threshold`` and fewer than ``max_passes`` passes ran: a new pass with
        t_arr = ``now``, MACE Alg. 1 line 21, queued here until the next ``set_samples``) or
        ``"retired"``.
        """
        if sample.tokens < 1:
            raise ValueError("need tokens >= 1")
        self.samples.pop(sample.sample_id, None)
        sample.passes += 1
        if check_end(sample, self.loss_threshold, self.max_passes):
            return "retired"
        sample.done, sample.arrival = 0, now
        self.samples[sample.sample_id] = sample
        return "requeued"

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        """The plan of the next window; ``free_bytes``: memory the fine-tune work may use (None: cost model)."""
        raise NotImplementedError

    # -- helpers for the policies ---------------------------------------------------------------

    def _decode_work(self) -> InferenceWork:
        work = InferenceWork()
        for req in self.running.values():
            work = work.plus_decode(req.context_tokens)
        return work

    def _inference_work(self, max_seqs: int | None = None, max_tokens: int | None = None) -> InferenceWork:
        """c: the running decodes, plus the waiting prefills that fit the engine's per-iteration limits.

        vLLM starts waiting requests in arrival order (its FCFS) while ``max_num_seqs`` and
        ``max_batched_tokens`` allow (``max_seqs`` / ``max_tokens`` override them); the planner
        does not hold any back, so every such prefill is in the window, whatever the policy.
        """
        work = self._decode_work()
        seqs = batched = len(self.running)
        first = True
        for req in sorted(self.waiting.values(), key=lambda r: (r.arrival, r.request_id)):
            if self._engine_fits(seqs, batched, req.prompt_tokens, first, max_seqs, max_tokens):
                work, first = work.plus_prefill(req.prompt_tokens), False
                seqs, batched = seqs + 1, batched + req.prompt_tokens
        return work

    def _capacity(self, work: InferenceWork, free_bytes: float | None) -> float:
        """Bytes for fine-tune activations in this window.

        Given ``free_bytes`` (what the node reports free): that, less the KV cache of the window's
        prompts (not allocated yet). Otherwise the cost model's guess: M_threshold − weights − KV
        of every sequence in the window (LEMIX §IV-A).
        """
        if free_bytes is not None:
            return max(0.0, free_bytes - self.cost.kv_bytes(work.prefill_tokens))
        return max(
            0.0,
            self.cost.memory_threshold()
            - self.cost.memory.weight_bytes
            - self.cost.kv_bytes(work.context_tokens + work.prefill_tokens),
        )

    def _engine_fits(
        self,
        seqs: int,
        batched: int,
        prompt: int,
        first: bool,
        max_seqs: int | None = None,
        max_tokens: int | None = None,
    ) -> bool:
        max_seqs = self.max_num_seqs if max_seqs is None else max_seqs
        max_tokens = self.max_batched_tokens if max_tokens is None else max_tokens
        if seqs >= max_seqs:
            return False
        # A prompt longer than the token limit still goes in alone (vLLM would chunk it).
        return max_tokens is None or batched + prompt <= max_tokens or (first and batched < max_tokens)

    def _windows(
        self,
        samples: Iterable[FineTuneSample],
        tokens: float,
        capacity: float,
        reserve: Mapping[str, int] | None = None,
        room_s: float | None = None,
    ) -> list[TokenWindow]:
        """Cut one window per sample, in order, from a budget of ``tokens`` (math.inf: whole passes).

        Each window is capped by the remaining pass, ``max_window_tokens`` and what fits
        ``capacity`` alone; a window shorter than ``min_window_tokens`` is cut only when it ends
        the pass; ``reserve`` gives promoted samples at least that many tokens. A sample whose pass
        has phases (forward, then backward: FlexLLM Alg. 2) is cut by time instead when ``room_s``
        is given: the longest window whose phases run within the fine-tuning seconds left (a
        backward token-equivalent costs Δ_B, a forward token Δ_F, so a token budget priced at
        Δ_F + Δ_B would grant each phase about half of what fits).
        """
        per_token = ft_memory(self.cost, 1, 1)
        by_mem = math.floor(capacity / per_token + 1e-9) if per_token > 0 else math.inf
        cap = math.inf if self.max_window_tokens is None else self.max_window_tokens
        room_left = room_s
        out: list[TokenWindow] = []
        for s in samples:
            if len(out) >= self.max_ft_samples:
                break
            timed = room_left is not None and s.forward_tokens is not None and math.isfinite(tokens)
            w = min(s.remaining, cap) if timed else min(s.remaining, tokens, cap)
            if timed:
                longest = TokenWindow(s.sample_id, s.done, s.done + int(min(w, by_mem)), s.tokens, s.forward_tokens)
                w = tokens_within_seconds(self.cost, longest, room_left)
            if reserve and s.sample_id in reserve:
                w = min(max(w, reserve[s.sample_id]), s.remaining)
            w = min(w, by_mem)
            if w <= 0 or (w < self.min_window_tokens and w < s.remaining):
                continue
            w = int(w)
            window = TokenWindow(s.sample_id, s.done, s.done + w, s.tokens, s.forward_tokens)
            out.append(window)
            if timed:
                room_left = max(0.0, room_left - window_run_time(self.cost, window))
            else:
                tokens = max(0.0, tokens - w)
        return out

    def _by_arrival(self) -> list[FineTuneSample]:
        return sorted(self.samples.values(), key=lambda s: (s.arrival, s.sample_id))

    def _whole_passes(self, samples: Iterable[FineTuneSample], capacity: float) -> tuple[MicroBatch, ...]:
        """Baselines without a budget: whole remaining passes, packed by memory only, all run."""
        windows = self._windows(samples, math.inf, capacity)
        return tuple(best_fit_pack(windows, self.cost, capacity, math.inf, self.lambdas, self.first_bin_fill))
