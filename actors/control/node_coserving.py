"""NodeCoServing: the planner's per-node co-serving state and the grant decisions made from it.

One per logical node, held by the planner actor (``actors/control/planner.py``). It keeps the node's
iteration scheduler (``planner.iteration``, ``planners/coserving/``), its memory guard (LEMIX
Alg. 2, ``planners/memory.py``), the live refits of the window cost, and the grant and CheckEnd
counters and logs ``/v1/status`` shows. Plain Python, no Ray: the planner calls it on its event
loop, one grant at a time.

Every grant is measured against its prediction (``planners/coserving/measurement.py``): the
trainer says when its windows ran and how long each phase took (:meth:`NodeCoServing.windows_ran`),
the replica's reports carry the engine's steps (:meth:`NodeCoServing.observe_report`). From them
the node refits t_ft per phase, t_iter and ρ (``planners/coserving/calibration.py``), so the next
budget uses what was measured (LEMIX Alg. 2 lines 13–17), and counts the SLO attainment of its
inference with fine-tuning beside it and without.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any

from actors.learning.messages import GrantRequest, PassReport, PassVerdict, WindowsRan
from planners import registry
from planners.coserving import (
    EngineFacts,
    EngineIteration,
    FineTuneSample,
    InferenceWork,
    InterferenceCalibration,
    SloAttainment,
    TrainingTimeline,
    WindowCostCalibration,
    WindowPrediction,
    WindowRun,
    calibrated,
    grant_phase_times,
    measure_window,
)
from planners.coserving.measurement import median
from planners.costs import CostModel
from planners.memory import MemoryGuard
from planners.types import ExecutionTrace
from settings import AppConfig

LOG_KEPT = 64  # recent grant answers and CheckEnd verdicts shown in /v1/status
STEPS_KEPT_S = 30.0  # engine steps kept to match against the windows that ran beside them
SETTLE_S = 0.5  # a run is measured once the node reported steps this long past its end ...
SETTLE_MAX_S = 3.0  # ... or this long after it ended, whatever was reported
UNDECIDED_MAX_S = 15.0  # a step or first token still undecided this long after (no run report came) counts as training
AFTERMATH_S = 2.0  # a step this soon after a run counts as beside training (the version is published and loaded then)


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


class NodeCoServing:
    """What one node's fine-tuning may run beside its inference, window by window (FlexLLM §6.2, MACE §4)."""

    def __init__(self, cfg: AppConfig, cost_model: CostModel, slo_tbt_s: float) -> None:
        self.cfg = cfg  # the planner's config object: set_policies swaps its planner section in place
        self.cost_model = cost_model.with_stages(cfg.cluster.stages)
        self.slo_tbt_s = (
            slo_tbt_s  # training.slo_tbt_s, or the one derived from the profile (planners/coserving/slo.py)
        )
        self.forward_cost = WindowCostCalibration()  # the live refit of t_ft's forward terms
        self.backward_cost = WindowCostCalibration()  # ... and of its backward terms
        self.duration = WindowCostCalibration()  # only its samples: each grant's modelled vs measured seconds
        self.interference = InterferenceCalibration(self.cost_model.ft_interference)  # k and ρ, measured
        self.timeline = TrainingTimeline()
        self.attainment = SloAttainment(slo_tbt_s, cfg.training.slo_ttft_s)
        self.measured: deque = deque(maxlen=LOG_KEPT)  # WindowMeasurement of the recent grants, newest last
        self.scheduler: Any = None  # built on first use from planner.iteration
        self.guard: MemoryGuard | None = None
        self.prediction: WindowPrediction | None = None  # of the grant made last, until the trainer reports its run
        self._to_measure: list[tuple[WindowPrediction, WindowRun]] = []
        self._steps: deque[EngineIteration] = deque()  # recent engine steps, to match against runs
        self._undecided_steps: deque[EngineIteration] = deque()  # not yet counted against the TBT SLO
        self._undecided_first: deque[tuple[float, float]] = deque()  # (arrival, first token), not yet counted
        self._context_per_seq = 0.0  # mean context of the decodes last reported: prices the steps beside a run
        self.memory_wait_since: float | None = None  # when the guard first held back the current work (Alg. 2's wait)
        self.grants: dict[str, Any] = {
            "asked": 0,
            "granted": 0,
            "refused": 0,
            "windows": 0,
            "tokens": 0,
            "last_budget": None,
            "last_reason": None,
            "passes": 0,
            "requeued": 0,
            "memory": {"wait": 0, "shrink": 0, "offload": 0, "defer": 0},
        }
        self.grant_log: deque = deque(maxlen=LOG_KEPT)  # recent answers, newest last
        self.pass_log: deque = deque(maxlen=LOG_KEPT)  # recent CheckEnd verdicts, newest last

    def reset(self) -> None:
        """The co-serving policy or the memory guard changed: build them afresh, forget the logs."""
        self.scheduler = self.guard = None
        self.memory_wait_since = None
        self.grant_log.clear()
        self.pass_log.clear()
        self.attainment.tbt_s = self.slo_tbt_s  # the SLO may have been derived again

    def refit_cost(self) -> CostModel:
        """The cost model as measured on this node: t_ft's forward and backward terms, t_iter and ρ refit."""
        return calibrated(
            self.cost_model,
            self.forward_cost.factor,
            self.backward_cost.factor,
            self.interference.iteration_factor,
            self.interference.interference,
        )

    def iteration_scheduler(self) -> Any:
        """The node's iteration scheduler (``planner.iteration``), with its memory guard, built on first use."""
        if self.scheduler is None:
            planner, e = self.cfg.planner, self.cfg.engine
            # vLLM starts every request as it arrives: the plans count every one its limits let in.
            params = {
                "slo_s": self.slo_tbt_s,
                "max_num_seqs": e.max_num_seqs,
                "max_batched_tokens": e.max_num_batched_tokens or 2048,
                **planner.iteration_params,
            }
            if registry.accepts("iteration", planner.iteration, "ttft_slo_s"):
                params.setdefault("ttft_slo_s", self.cfg.training.slo_ttft_s)
            if registry.accepts("iteration", planner.iteration, "max_slowdown"):
                params.setdefault("max_slowdown", self.cfg.training.slo_slowdown)
            self.scheduler = registry.create("iteration", planner.iteration, cost_model=self.cost_model, **params)
            self.guard = MemoryGuard(self.cost_model, **planner.memory_params)
        return self.scheduler

    def iteration_windows(
        self, queue: list[FineTuneSample], facts: EngineFacts | None, now: float
    ) -> tuple[Any, str, int]:
        """The scheduler's plan for the next window: the token windows granted, why, and the token budget."""
        sched = self.iteration_scheduler()
        # What was measured on this node: t_ft per phase, t_iter and ρ (LEMIX Alg. 2 lines 13–17).
        sched.cost = self.refit_cost()
        sched.throughput_interference = self.interference.with_aftermath(now)
        if facts is not None:
            sched.observe(facts)
        sched.set_samples(queue)
        # MACE's P (the bins' memory) is the cost model's own estimate; the configured budget and the
        # memory really in use are the memory guard's to weigh (check_memory), as LEMIX checks before
        # each forward. (Packing within the guard's room instead would cut every window to nothing under
        # pressure, and the guard would never get to wait, shrink or defer.)
        plan = sched.schedule(now)
        return plan.windows, plan.reason, plan.ft_token_budget

    def check_memory(
        self,
        request: GrantRequest,
        windows: Any,
        reason: str,
        facts: EngineFacts | None,
        weight_bytes: float,
        now: float,
    ) -> tuple[Any, str, bool, float]:
        """LEMIX Alg. 2 on the planned windows: run them, wait (up to T_max), shrink, offload or defer.

        The guard is calibrated with what the previous grant's windows really added (``request.memory``);
        the memory in use is the weights plus the KV cache the node's engine holds now. Returns the
        windows to run, the reason, whether to offload the optimizer state first, and how long a
        refused trainer waits before asking again.
        """
        guard = self.guard
        recheck_s = self.cfg.planner.grant_recheck_s
        if request.memory is not None:
            m = request.memory
            guard.observe(max(1, m.batch_size), max(1, m.tokens), m.added_bytes)
        if not windows:
            return windows, reason, False, recheck_s
        used = weight_bytes + (facts.kv_used_bytes if facts else 0.0)
        waited = 0.0 if self.memory_wait_since is None else now - self.memory_wait_since
        d = guard.decide(
            used,
            len(windows),
            max(w.tokens for w in windows),
            waited,
            optimizer_bytes=request.optimizer_bytes,
            releasable_bytes=facts.kv_used_bytes if facts else None,
        )
        if d.action != "run":
            self.grants["memory"][d.action] += 1
        if d.action == "wait":
            if self.memory_wait_since is None:
                self.memory_wait_since = now
            return (), f"memory wait: {d.reason}", False, d.wait_s
        self.memory_wait_since = None
        if d.action == "defer":
            # Give the work back; it asks again after T_max (inference keeps the memory meanwhile).
            return (), f"memory defer: {d.reason}", False, max(guard.t_max_s, recheck_s)
        if d.batch_size < len(windows) or d.tokens < max(w.tokens for w in windows):
            windows = tuple(replace(w, end=min(w.end, w.start + d.tokens)) for w in windows[: d.batch_size])
        if d.action == "run":
            return windows, reason, False, 0.0
        return windows, f"{reason}; memory {d.action}: {d.reason}", d.action == "offload", 0.0

    def granted(self, windows: Any, facts: EngineFacts | None, now: float) -> None:
        """Predict what the trainer will measure for these windows (their forwards, and the backward of every
        sample they complete) and what the inference beside them will see (FlexLLM §6.2's f(c, s))."""
        cost = self.refit_cost()
        forward, backward = grant_phase_times(cost, windows)
        work = InferenceWork()
        for r in facts.requests if facts else ():
            work = (
                work.plus_decode(r.prompt_tokens + r.output_tokens)
                if r.output_tokens > 0
                else work.plus_prefill(max(1, r.prompt_tokens))
            )
        self.prediction = WindowPrediction(
            now,
            forward,
            backward,
            work.latency(cost),
            cost.ft_interference,
            work.context_tokens / work.decode_seqs if work.decode_seqs else 0.0,
        )
        self.timeline.granted(now, forward + backward)

    def windows_ran(self, run: WindowsRan, now: float) -> None:
        """The trainer ran the windows of the last grant: refit t_ft per phase, and measure the grant once the
        engine's steps beside it are in (:meth:`observe_report`)."""
        p, self.prediction = self.prediction, None
        r = WindowRun(run.ran_at, run.ran_s, run.forward_s, run.backward_s)
        self.timeline.ran(r.ran_at, r.end)
        self.interference.observe_run(r.end, r.ran_s)
        if self.scheduler is not None:  # the policies that budget by real time (separate, hybrid's max_slowdown)
            self.scheduler.throughput_interference = self.interference.with_aftermath(now)
            self.scheduler.observe_ft_run(r.ran_s, max(r.end, now))
        if p is None:
            return
        if p.forward_s > 0 and r.forward_s > 0:
            self.forward_cost.observe(p.forward_s, r.forward_s)
        if p.backward_s > 0 and r.backward_s > 0:
            self.backward_cost.observe(p.backward_s, r.backward_s)
        self.duration.observe(p.run_s, r.ran_s)
        self._to_measure.append((p, r))
        self._settle(now)

    def observe_report(self, facts: EngineFacts | None, traces: tuple[ExecutionTrace, ...], now: float) -> None:
        """A replica report: its engine steps and its finished requests' first tokens, for the measurements."""
        if facts is not None:
            decodes = [r for r in facts.requests if r.output_tokens > 0]
            if decodes:
                self._context_per_seq = sum(r.prompt_tokens + r.output_tokens for r in decodes) / len(decodes)
            self._steps.extend(facts.iteration_log)
            self._undecided_steps.extend(facts.iteration_log)
        for t in traces:
            if t.ok and t.first_token is not None:
                self._undecided_first.append((t.arrival, t.first_token))
        self._settle(now)

    def _modelled_step(self, cost: CostModel, context_per_seq: float) -> Any:
        def modelled(st: EngineIteration) -> float:
            return cost.iteration_latency(st.prefill_tokens, st.decode_seqs, st.decode_seqs * context_per_seq)

        return modelled

    def _settle(self, now: float) -> None:
        """Measure the runs whose steps are in; count the steps and first tokens whose training state is known."""
        while self._steps and self._steps[0].at < now - STEPS_KEPT_S:
            self._steps.popleft()
        last_step = self._steps[-1].at if self._steps else float("-inf")
        cost = calibrated(self.cost_model, iteration=self.interference.iteration_factor)
        waiting = []
        for p, r in self._to_measure:
            if last_step < r.end + SETTLE_S and now < r.end + SETTLE_MAX_S:
                waiting.append((p, r))
                continue
            ctx = p.context_per_seq or self._context_per_seq
            m = measure_window(p, r, self._steps, self._modelled_step(cost, ctx))
            self.measured.append(m)
            if m.steps:
                self.interference.observe_window(m.lost_s, r.ran_s)
        self._to_measure = waiting
        self.timeline.expire(now)
        modelled = self._modelled_step(calibrated(self.cost_model), self._context_per_seq)
        k = self.interference.iteration_factor
        while self._undecided_steps:
            st = self._undecided_steps[0]
            training = self._training(st.at - (st.gap_s or 0.0), st.at)
            if training is None:
                if now - st.at < UNDECIDED_MAX_S:
                    break
                training = True
            self._undecided_steps.popleft()
            if st.decode_seqs > 0 and st.gap_s:
                self.attainment.gap(st.gap_s, st.decode_seqs, training)
                if training:  # what the tenants lost to fine-tuning and the publishing of what it trained
                    self.interference.observe_active_step(st.at, st.gap_s - k * modelled(st))
                else:
                    self.interference.observe_step(modelled(st), st.gap_s)
        while self._undecided_first:
            arrival, first = self._undecided_first[0]
            training = self._training(arrival, first)
            if training is None:
                if now - first < UNDECIDED_MAX_S:
                    break
                training = True
            self._undecided_first.popleft()
            self.attainment.first_token(first - arrival, training)

    def _training(self, t0: float, t1: float) -> bool | None:
        """Did fine-tuning run during [t0, t1], or end less than AFTERMATH_S before it? (None: not known yet.)
        The aftermath counts: after a run the trainer steps its optimizer, saves, publishes, and the replica
        loads the version, all on the same host."""
        return self.timeline.training(t0 - AFTERMATH_S, t1)

    def record_answer(
        self, adapter: str, mode: str, windows: Any, reason: str, budget: int, facts: EngineFacts | None, now: float
    ) -> None:
        """Count one grant answer and log it for ``/v1/status``."""
        g = self.grants
        g["asked"] += 1
        g["last_reason"], g["last_budget"] = reason, budget
        reqs = facts.requests if facts else ()
        self.grant_log.append(
            {
                "at": round(now, 3),
                "adapter": adapter,
                "mode": mode,
                "budget": budget,
                "tokens": sum(w.tokens for w in windows),
                "samples": [int(w.sample_id) for w in windows],  # in the scheduler's order
                "decoding": sum(r.output_tokens > 0 for r in reqs),
                "prefilling": sum(r.output_tokens == 0 for r in reqs),
                "reason": reason,
                # Unrounded: a reader refits the budget from them, and rounding moves it a token.
                "forward_cost_factor": self.forward_cost.factor,
                "backward_cost_factor": self.backward_cost.factor,
                "iteration_factor": self.interference.iteration_factor,
                "interference": self.interference.interference,
            }
        )
        if not windows:
            g["refused"] += 1
            return
        g["granted"] += 1
        g["windows"] += len(windows)
        g["tokens"] += sum(w.tokens for w in windows)

    def check_end(self, adapter: str, reports: list[PassReport], scheduled: bool, now: float) -> list[PassVerdict]:
        """MACE §4.2 CheckEnd for finished passes: the scheduler's verdict when it granted them
        (``scheduled``), else ``retired`` (the baselines train each item once)."""
        sched = self.iteration_scheduler() if scheduled else None
        verdicts = []
        for r in reports:
            sample = FineTuneSample(
                str(r.sample_id), max(1, int(r.tokens)), float(r.arrival), float(r.loss), passes=int(r.passes_before)
            )
            outcome = "retired" if sched is None else sched.report_pass(sample, now)
            verdicts.append(
                PassVerdict(
                    r.sample_id,
                    outcome,
                    r.passes_before + 1,
                    float(r.loss),
                    now if outcome == "requeued" else float(r.arrival),
                )
            )
        self.grants["passes"] += len(verdicts)
        self.grants["requeued"] += sum(v.outcome == "requeued" for v in verdicts)
        self.pass_log.extend(
            {
                "at": round(now, 3),
                "adapter": adapter,
                "id": v.sample_id,
                "loss": round(v.loss, 6),
                "passes": v.passes,
                "outcome": v.outcome,
            }
            for v in verdicts
        )
        return verdicts

    def status(self) -> dict[str, Any]:
        """The node's part of ``/v1/status``: grants, the memory guard, the refits, the predictions' error, the SLO
        attainment."""
        g, w, i = self.guard, self.duration, self.interference
        measured = list(self.measured)
        return {
            "training_grants": dict(self.grants, recent=list(self.grant_log), passes_recent=list(self.pass_log)),
            # LEMIX Alg. 2's state: κ·M_peak and the calibration ratio (measured / modelled bytes).
            "memory_guard": None
            if g is None
            else {
                "threshold_bytes": g.threshold(),
                "ratio": round(g.ratio(), 4),
                "waiting_since": self.memory_wait_since,
            },
            # The live refit of t_ft: the factors on the profile's forward and backward terms, and how far the
            # recent grants' modelled time was from the measured one ((modelled − measured) / measured).
            "window_cost": {
                "forward_factor": self.forward_cost.factor,
                "backward_factor": self.backward_cost.factor,
                "grants_measured": len(w.samples),
                "median_error": _rounded(w.median_error()),
                "median_abs_error": _rounded(w.median_abs_error()),
            },
            # Each grant against FlexLLM §6.2's prediction: the worst time between tokens beside it against
            # t_iter(c) + ρ·t_ft, the inference seconds lost against ρ·t_ft; the ρ and t_iter factor measured.
            "window_prediction": {
                "grants_measured": len(measured),
                "grants_beside_decodes": sum(m.steps > 0 for m in measured),
                "duration_median_error": _rounded(median(m.duration_error for m in measured)),
                "worst_gap_median_error": _rounded(median(m.worst_gap_error for m in measured)),
                "delay_median_error_s": _rounded(median(m.delay_error_s for m in measured)),
                "worst_gap_over_slo": sum(
                    m.worst_gap_s is not None and m.worst_gap_s > self.slo_tbt_s for m in measured
                ),
                "interference": {
                    "profile": round(i.profile_interference, 4),
                    "in_force": round(i.interference, 4),
                    "windows_measured": i.windows_measured,
                    "with_aftermath": _rounded(i.with_aftermath(time.time())),
                },
                "iteration_factor": round(i.iteration_factor, 4),
                "steps_measured": i.steps_measured,
                "recent": [m.as_json() for m in measured[-8:]],
            },
            # Share of times between tokens within the TBT SLO and first tokens within the TTFT SLO, with
            # fine-tuning beside them and without.
            "slo_attainment": self.attainment.as_json(),
        }
