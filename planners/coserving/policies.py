"""The registered co-serving policies (registry kind ``iteration``): ours, ``hybrid``, and five baselines."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from planners.coserving.budget import ft_delay, ft_latency, ft_room, ft_tokens_within, token_budget
from planners.coserving.packing import best_fit_pack
from planners.coserving.priorities import PriorityWeights, as_priority_weights, priority
from planners.coserving.scheduler import IterationScheduler, WindowPlan, within_room
from planners.coserving.work import EngineFacts, FineTuneSample, InferenceWork, LiveRequest, MicroBatch, WorkKind
from planners.costs import CostModel
from planners.registry import register
from planners.retraining import Periodic as _PeriodicTimer
from planners.retraining import RetrainingView


@register("iteration", "hybrid")
class HybridScheduler(IterationScheduler):
    """Ours: MACE §4.1 aging priorities, FlexLLM §6.2 token budget, MACE Alg. 1 best-fit packing.

    Each window:

    1. Every item gets its MACE priority P (``PriorityWeights``): running decodes, waiting
       prefills, queued fine-tune samples (with γ·L_DPO). Items are walked in descending P.
    2. Inference first (FlexLLM §6.2): c is every running decode and every waiting prefill the
       engine's per-iteration limits let in. vLLM starts requests as they arrive and the planner
       holds none back: among prefills P's order is their arrival order anyway, and vLLM never
       sees P (docs/coserving.md, "Admission by priority: measured, then removed").
    3. Aging against inference (MACE Fig. 7, iteration 9): if the top fine-tune sample outranks
       some inference item (a running decode or a waiting prefill), or there is no inference at
       all, it is *promoted*: it reserves ``min_window_tokens``, even when inference alone breaks
       the SLO: that is the starvation bound under overload (``planners/coserving/slo.py`` states
       it: promoted after (π_decode − π_ft)/(δ_ft − δ_decode) s, then one window a grant). Without
       promotion the plan never exceeds the SLO under the cost model.
    4. Budget: s = max{ s : f(c, s) ≤ SLO } (``token_budget``), at least the reserve. Fine-tune
       samples in priority order each get one window of
       min(remaining pass, tokens left, ``max_window_tokens``, memory) tokens.
    5. The windows are packed by ``best_fit_pack`` into micro-batches with the memory capacity
       and the latency room SLO − t_iter(c); bins run in creation order while their summed
       latency fits that room (MACE runs bin 1; later bins that still fit run too). Windows not
       chosen stay with the trainer and keep aging (Alg. 1, lines 17–21); finished passes go
       through CheckEnd in ``report_pass``.

    No starvation: among fine-tune samples the order is by t_arr − γ·L_DPO/δ_ft, fixed in time,
    so a sample is overtaken only by samples enqueued less than γ·max L_DPO/δ_ft after it; when the
    load leaves slack (f(c, ``min_window_tokens``) ≤ SLO and that window fits memory) every window
    grants the top sample at least ``min_window_tokens``, so its wait is bounded.

    An idle engine (nothing running or waiting) has no time between tokens to protect, only the
    TTFT of a request that arrives during the grant: with ``ttft_slo_s`` set, the grant may then
    delay that request's prefill (of the mean prompt seen so far) up to the TTFT SLO, not the TBT SLO.

    The tenants' throughput. FlexLLM fuses the fine-tuning tokens into each iteration, and the SLO
    bounds that iteration; grants back to back let every iteration run at the SLO, so the clients'
    throughput may fall to t_iter/SLO of what they get alone (a quarter with the derived SLO of 4
    decode iterations). Where the two run side by side on separate cores (a CPU host, ρ < 1) every
    step beside fine-tuning slows by about ρ, whatever the window's size. ``max_slowdown`` = σ
    bounds what the tenants lose instead: while inference runs, fine-tuning takes at most a share d
    of the node's time with ρ·d ≤ σ, so after windows that ran t seconds the next grant waits
    t·(ρ/σ − 1) (none when ρ ≤ σ). ρ here is ``throughput_interference`` when the node measured it:
    the inference seconds lost per second of fine-tuning counting each run's aftermath (its version
    saved, published and loaded), else the cost model's. Promoted samples wait too; d > 0 still
    bounds every sample's wait. An idle engine has no throughput to lose.

    Params (besides the common ones): ``weights`` (PriorityWeights or a dict of its fields);
    ``max_grant_s`` (1.0): the most fine-tuning seconds one grant holds, whatever ρ allows;
    ``ttft_slo_s`` (None: the idle engine gets the TBT bound too); ``max_slowdown`` (None: no bound
    but the SLO's).
    """

    name = "hybrid"

    def __init__(
        self,
        weights: PriorityWeights | Mapping[str, float] | None = None,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        max_grant_s: float = 1.0,
        ttft_slo_s: float | None = None,
        max_slowdown: float | None = None,
        **common: Any,
    ) -> None:
        super().__init__(cost_model, **common)
        if max_grant_s <= 0 or (ttft_slo_s is not None and ttft_slo_s <= 0):
            raise ValueError("max_grant_s and ttft_slo_s must be > 0")
        if max_slowdown is not None and not 0 < max_slowdown < 1:
            raise ValueError("max_slowdown must be in (0, 1)")
        self.weights = as_priority_weights(weights)
        self.max_grant_s = float(max_grant_s)
        self.ttft_slo_s = ttft_slo_s
        self.max_slowdown = max_slowdown
        self.next_grant_at = -math.inf  # the tenants' throughput bound (max_slowdown): no grant before this
        self.prompts_seen, self.prompt_tokens_seen = 0, 0
        self._counted: set[str] = set()

    def observe(self, facts: EngineFacts) -> None:
        super().observe(facts)
        for r in facts.requests:  # the mean prompt, for the prefill a grant on an idle engine may delay
            if r.request_id not in self._counted:
                self._counted.add(r.request_id)
                self.prompts_seen += 1
                self.prompt_tokens_seen += max(1, r.prompt_tokens)
        self._counted &= {r.request_id for r in facts.requests}

    def observe_ft_run(self, seconds: float, now: float) -> None:
        """Windows of ``seconds`` ran, ending about ``now``: with ``max_slowdown``, the next grant waits
        t·(ρ/σ − 1), so fine-tuning takes a share d of the node's time with ρ·d ≤ σ."""
        rho = self.cost.ft_interference if self.throughput_interference is None else self.throughput_interference
        sigma = self.max_slowdown
        if sigma is None or seconds <= 0 or rho <= sigma:
            return
        self.next_grant_at = max(self.next_grant_at, now + seconds * (rho / sigma - 1.0))

    def _delay_bound(self, work: InferenceWork) -> float:
        """The most a grant may delay the inference beside it: SLO − t_iter(c), or, on an idle engine
        with ``ttft_slo_s``, the TTFT SLO less the prefill of the mean prompt (if that is larger)."""
        bound = self.slo_s - work.latency(self.cost)
        if self.ttft_slo_s is not None and not self.running and not self.waiting:
            # No prompt seen yet: the TTFT SLO itself (a request's own prefill is not the grant's doing).
            mean = round(self.prompt_tokens_seen / self.prompts_seen) if self.prompts_seen else 0
            prefill = InferenceWork().plus_prefill(mean) if mean else InferenceWork()
            bound = max(bound, self.ttft_slo_s - prefill.latency(self.cost))
        return bound

    def scores(self, now: float) -> list[tuple[float, WorkKind, LiveRequest | FineTuneSample]]:
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
        cost = self.cost
        if now < self.next_grant_at and (self.running or self.waiting):
            work = self._inference_work()
            rho = cost.ft_interference if self.throughput_interference is None else self.throughput_interference
            return WindowPlan(
                now,
                self.name,
                (),
                0,
                work,
                work.latency(cost),
                reason=f"throughput bound (max_slowdown {self.max_slowdown:g} at rho {rho:.2f}): "
                f"next grant in {self.next_grant_at - now:.3f} s",
            )
        ranked = self.scores(now)
        last_inference = max((i for i, (_, kind, _) in enumerate(ranked) if kind != "ft"), default=-1)
        promoted: FineTuneSample | None = None
        reserve = 0
        ft_order: list[FineTuneSample] = []
        for i, (_, kind, obj) in enumerate(ranked):
            if kind == "ft":
                ft_order.append(obj)
                # An idle engine (no inference at all) has nothing the top sample must outrank: it runs,
                # even when the bound leaves less than one window (a slow backward on a CPU).
                if promoted is None and (i < last_inference or last_inference < 0):
                    promoted, reserve = obj, min(self.min_window_tokens, obj.remaining)
        work = self._inference_work()
        # The grant's fine-tuning delays the inference beside it by ρ·t_ft ≤ SLO − t_iter(c): with
        # ρ < 1 (separate cores) that is more than SLO seconds of fine-tuning, and one grant takes it
        # all rather than paying a round trip per SLO-long slice. ``max_grant_s`` still bounds it
        # (ρ = 0 would allow any), so inference arriving meanwhile is seen at a later grant.
        delay = self._delay_bound(work)
        budget = max(
            token_budget(cost, work, work.latency(cost) + delay, cap=ft_tokens_within(cost, self.max_grant_s)), reserve
        )
        # Fine-tuning seconds (alone) the window has room for, at least the promoted reserve.
        room = max(min(ft_room(cost, delay), self.max_grant_s), ft_latency(cost, 1, reserve))
        capacity = self._capacity(work, free_bytes)
        # ft_order is in descending P, so a promoted sample (the top one) is cut first.
        windows = self._windows(ft_order, budget, capacity, {promoted.sample_id: reserve} if promoted else None, room)
        bins = best_fit_pack(windows, cost, capacity, room, self.lambdas, self.first_bin_fill, self.max_ft_samples)
        chosen, _ = within_room(bins, room)
        reason = (
            f"promoted {promoted.sample_id}"
            if promoted is not None and any(w.sample_id == promoted.sample_id for mb in chosen for w in mb.windows)
            else "budget"
        )
        return WindowPlan(
            now, self.name, tuple(chosen), budget, work, work.latency(cost) + ft_delay(cost, chosen), reason=reason
        )


@register("iteration", "fcfs")
class FcfsScheduler(IterationScheduler):
    """Naive mix (LEMIX's NaiveMix, FlexLLM without the budget): everything runs in arrival order.

    Inference runs as vLLM starts it, in arrival order within the engine's limits; every queued
    fine-tune sample (up to τ_task) runs its whole remaining pass, packed by memory only. The SLO
    is never consulted.
    """

    name = "fcfs"

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        work = self._inference_work()
        granted = self._whole_passes(self._by_arrival(), self._capacity(work, free_bytes))
        ft = sum(mb.tokens for mb in granted)
        lat = work.latency(self.cost) + ft_delay(self.cost, granted)
        return WindowPlan(now, self.name, granted, ft, work, lat, reason="fcfs")


@register("iteration", "temporal")
class TemporalScheduler(IterationScheduler):
    """Temporal sharing (FlexLLM §8.2): n inference windows, then one fine-tuning window, and again.

    The engine's reported iterations (``observe_iterations``) are the inference windows, which run
    no fine-tuning. Once ``n`` of them have passed since the last fine-tuning window and samples
    are queued, the next grant is a fine-tuning window: up to τ_task whole passes, planned without
    inference (``inference_paused``). vLLM is not paused for it, so the fine-tuning step runs
    beside whatever the engine does at that moment. An idle engine (no request waiting or running)
    leaves nothing to alternate with: fine-tuning runs.
    Params: ``n`` (64, FlexLLM's lowest inference frequency).
    """

    name = "temporal"

    def __init__(self, n: int = 64, cost_model: CostModel | Mapping[str, Any] | None = None, **common: Any) -> None:
        super().__init__(cost_model, **common)
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = n
        self.since_ft = 0

    def observe_iterations(self, count: int) -> None:
        self.since_ft += count

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        if self.samples and (self.since_ft >= self.n or not (self.waiting or self.running)):
            self.since_ft = 0
            granted = self._whole_passes(self._by_arrival(), self._capacity(InferenceWork(), free_bytes))
            ft = sum(mb.tokens for mb in granted)
            return WindowPlan(
                now,
                self.name,
                granted,
                ft,
                InferenceWork(),
                sum(mb.latency_s for mb in granted),
                inference_paused=True,
                reason="fine-tuning window",
            )
        work = self._inference_work()
        return WindowPlan(
            now, self.name, (), 0, work, work.latency(self.cost), reason=f"inference window {self.since_ft}/{self.n}"
        )


@register("iteration", "ft_first")
class FtFirstScheduler(IterationScheduler):
    """AdaInf-like FT-first (MACE §6.1 baseline): fine-tuning takes the window first, inference the rest.

    Every queued sample (up to τ_task) runs its whole remaining pass, whatever the load, in the
    memory the running decodes leave (waiting prompts' KV cache is not set aside for them).
    AdaInf would then start waiting requests only in the time left; vLLM starts them as they
    arrive, so here they run beside the fine-tuning and the plan's latency counts both.
    """

    name = "ft_first"

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        granted = self._whole_passes(self._by_arrival(), self._capacity(self._decode_work(), free_bytes))
        work = self._inference_work()
        ft = sum(mb.tokens for mb in granted)
        return WindowPlan(
            now, self.name, granted, ft, work, work.latency(self.cost) + ft_delay(self.cost, granted), reason="ft first"
        )


@register("iteration", "periodic")
class PeriodicScheduler(IterationScheduler):
    """Ekya-like periodic retraining (MACE §6.1 baseline): train every T seconds, ignoring latency.

    The timing is the ``periodic`` retraining policy's (``planners/retraining.py``): a training
    window opens ``every_seconds`` after the previous one (or once ``every_samples`` are queued),
    and while it is open the samples enqueued before it opened run as whole passes (τ_task per
    plan); samples arriving later wait for the next window. Inference runs as vLLM starts it
    throughout. Params: ``every_seconds`` (60.0), ``every_samples`` (None).
    """

    name = "periodic"

    def __init__(
        self,
        every_seconds: float | None = 60.0,
        every_samples: int | None = None,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        **common: Any,
    ) -> None:
        super().__init__(cost_model, **common)
        self.timer = _PeriodicTimer(every_seconds=every_seconds, every_samples=every_samples)
        self.last_run_at: float | None = None

    def _view(self, now: float) -> RetrainingView:
        oldest = min((s.arrival for s in self.samples.values()), default=None)
        return RetrainingView(
            now=now,
            node_id=0,
            queued=len(self.samples),
            oldest_queued_age_s=None if oldest is None else now - oldest,
            last_run_at=self.last_run_at,
            samples_wanted=len(self.samples),
            tokens_wanted=sum(s.remaining for s in self.samples.values()),
        )

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        work = self._inference_work()
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
        return WindowPlan(now, self.name, granted, ft, work, lat, reason=reason)


@register("iteration", "separate")
class SeparateScheduler(IterationScheduler):
    """Static split (LEMIX's SEPARATE and FlexLLM §8.1's separate clusters, within one node).

    A fixed fraction φ = ``train_fraction`` of the node trains and 1 − φ serves, never shared. On
    one node the split is in time: fine-tuning runs a duty cycle of φ, whatever the inference
    load. A grant of fine-tuning work that takes t is followed, once that work is done, by
    t·(1 − φ)/φ in which nothing more is granted; t is the cost model's time until the trainer
    reports the time the work really took (``observe_ft_run``), and then the longer of the two. Each
    grant is one window's worth, s = max{ s : t_ft(s) ≤ SLO } tokens of φ·(M_threshold − weights)
    memory, in arrival order. The plan's inference work c is what fits (1 − φ) of the engine's
    limits, and its iterations take t_iter(c)/(1 − φ) on that share. (A split of each window's time instead, t_ft(s) ≤ φ·SLO, would
    leave a CPU node nothing: one forward and backward pass costs more than φ·SLO in fixed costs.)
    Params: ``train_fraction`` (0.25).
    """

    name = "separate"

    def __init__(
        self, train_fraction: float = 0.25, cost_model: CostModel | Mapping[str, Any] | None = None, **common: Any
    ) -> None:
        super().__init__(cost_model, **common)
        if not 0.0 < train_fraction < 1.0:
            raise ValueError("train_fraction must be in (0, 1)")
        self.train_fraction = train_fraction
        self.next_grant_at = -math.inf

    def observe_ft_run(self, seconds: float, now: float) -> None:
        # Real work outlasting the model (grant round trips, a slow core) must not buy more than φ.
        if seconds > 0:
            fraction = self.train_fraction
            self.next_grant_at = max(self.next_grant_at, now + seconds * (1.0 - fraction) / fraction)

    def schedule(self, now: float, free_bytes: float | None = None) -> WindowPlan:
        fraction, cost = self.train_fraction, self.cost
        serve = 1.0 - fraction
        max_tokens = None if self.max_batched_tokens is None else max(1, math.floor(self.max_batched_tokens * serve))
        work = self._inference_work(max_seqs=max(1, math.floor(self.max_num_seqs * serve)), max_tokens=max_tokens)
        budget = ft_tokens_within(cost, self.slo_s)  # its own share: no inference beside it to delay
        granted: tuple[MicroBatch, ...] = ()
        total = 0.0
        reason = f"static split: {fraction:.0%} training"
        if now >= self.next_grant_at:
            share = fraction * (cost.memory_threshold() - cost.memory.weight_bytes)
            capacity = max(0.0, share if free_bytes is None else min(share, free_bytes))
            windows = self._windows(self._by_arrival(), budget, capacity, room_s=self.slo_s)
            bins = best_fit_pack(
                windows, cost, capacity, self.slo_s, self.lambdas, self.first_bin_fill, self.max_ft_samples
            )
            chosen, total = within_room(bins, self.slo_s)
            granted = tuple(chosen)
            if granted:
                self.next_grant_at = now + total / fraction  # t of work, then t·(1 − φ)/φ of none
        else:
            reason += f", next grant in {self.next_grant_at - now:.3f} s"
        return WindowPlan(now, self.name, granted, budget, work, work.latency(cost) / serve + total, reason=reason)
