"""NodeCoServing: the planner's per-node co-serving state and the grant decisions made from it.

One per logical node, held by the planner actor (``actors/control/planner.py``). It keeps the node's
iteration scheduler (``planner.iteration``, ``planners/coserving/``), its memory guard (LEMIX
Alg. 2, ``planners/memory.py``), the live refit of the fine-tuning window cost, and the grant and
CheckEnd counters and logs ``/v1/status`` shows. Plain Python, no Ray: the planner calls it on its
event loop, one grant at a time.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from settings import AppConfig
from planners import registry
from planners.coserving import EngineFacts, FineTuneSample, TokenWindow, WindowCostCalibration, grant_run_time
from planners.costs import CostModel
from planners.memory import MemoryGuard
from actors.learning.messages import GrantRequest, PassReport, PassVerdict

LOG_KEPT = 64  # recent grant answers and CheckEnd verdicts shown in /v1/status


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


class NodeCoServing:
    """What one node's fine-tuning may run beside its inference, window by window (FlexLLM §6.2, MACE §4)."""

    def __init__(self, cfg: AppConfig, cost_model: CostModel, slo_tbt_s: float) -> None:
        self.cfg = cfg  # the planner's config object: set_policies swaps its planner section in place
        self.cost_model = cost_model.with_stages(cfg.cluster.stages)
        self.slo_tbt_s = slo_tbt_s  # training.slo_tbt_s, or the one derived from the profile (planners/coserving/slo.py)
        self.window_cost = WindowCostCalibration()  # the live refit of t_ft
        self.scheduler: Any = None  # built on first use from planner.iteration
        self.guard: MemoryGuard | None = None
        self.granted_model_s = 0.0  # modelled seconds of the windows last granted, paired with the trainer's measurement
        self.memory_wait_since: float | None = None  # when the guard first held back the current work (Alg. 2's wait)
        self.grants: dict[str, Any] = {
            "asked": 0, "granted": 0, "refused": 0, "windows": 0, "tokens": 0, "last_budget": None,
            "last_reason": None, "passes": 0, "requeued": 0, "memory": {"wait": 0, "shrink": 0, "offload": 0, "defer": 0}}
        self.grant_log: deque = deque(maxlen=LOG_KEPT)  # recent answers, newest last
        self.pass_log: deque = deque(maxlen=LOG_KEPT)  # recent CheckEnd verdicts, newest last

    def reset(self) -> None:
        """The co-serving policy or the memory guard changed: build them afresh, forget the logs."""
        self.scheduler = self.guard = None
        self.memory_wait_since = None
        self.grant_log.clear()
        self.pass_log.clear()

    def iteration_scheduler(self) -> Any:
        """The node's iteration scheduler (``planner.iteration``), with its memory guard, built on first use."""
        if self.scheduler is None:
            planner, e = self.cfg.planner, self.cfg.engine
            # vLLM starts every request as it arrives: the plans count every one its limits let in.
            params = {"slo_s": self.slo_tbt_s, "max_num_seqs": e.max_num_seqs,
                      "max_batched_tokens": e.max_num_batched_tokens or 2048, **planner.iteration_params}
            if registry.accepts("iteration", planner.iteration, "ttft_slo_s"):
                params.setdefault("ttft_slo_s", self.cfg.training.slo_ttft_s)
            self.scheduler = registry.create("iteration", planner.iteration, cost_model=self.cost_model, **params)
            self.guard = MemoryGuard(self.cost_model, **planner.memory_params)
        return self.scheduler

    def iteration_windows(self, queue: list[FineTuneSample], facts: EngineFacts | None, now: float,
                          ran_s: float = 0.0) -> tuple[Any, str, int]:
        """The scheduler's plan for the next window: the token windows granted, why, and the token budget."""
        sched = self.iteration_scheduler()
        if ran_s > 0 and self.granted_model_s > 0:
            self.window_cost.observe(self.granted_model_s, ran_s)
        self.granted_model_s = 0.0
        # Refit t_ft live: the profile's fine-tuning terms times what the windows really took.
        sched.cost = self.cost_model.with_training_time(self.window_cost.factor)
        if facts is not None:
            sched.observe(facts)
        sched.set_samples(queue)
        sched.observe_ft_run(ran_s, now)
        # MACE's P (the bins' memory) is the cost model's own estimate; the configured budget and the
        # memory really in use are the memory guard's to weigh (check_memory), as LEMIX checks before
        # each forward. (Packing within the guard's room instead would cut every window to nothing under
        # pressure, and the guard would never get to wait, shrink or defer.)
        plan = sched.schedule(now)
        return plan.windows, plan.reason, plan.ft_token_budget

    def check_memory(self, request: GrantRequest, windows: Any, reason: str, facts: EngineFacts | None,
                     weight_bytes: float, now: float) -> tuple[Any, str, bool, float]:
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
        d = guard.decide(used, len(windows), max(w.tokens for w in windows), waited,
                         optimizer_bytes=request.optimizer_bytes)
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
            windows = tuple(TokenWindow(w.sample_id, w.start, min(w.end, w.start + d.tokens), w.length)
                            for w in windows[:d.batch_size])
        if d.action == "run":
            return windows, reason, False, 0.0
        return windows, f"{reason}; memory {d.action}: {d.reason}", d.action == "offload", 0.0

    def granted(self, windows: Any) -> None:
        """What the trainer will measure for these windows: their forwards, and the backward of every
        sample they complete (the refit compares it with the seconds it reports next)."""
        self.granted_model_s = grant_run_time(self.scheduler.cost, windows)

    def record_answer(self, adapter: str, mode: str, windows: Any, reason: str, budget: int,
                      facts: EngineFacts | None, now: float) -> None:
        """Count one grant answer and log it for ``/v1/status``."""
        g = self.grants
        g["asked"] += 1
        g["last_reason"], g["last_budget"] = reason, budget
        reqs = facts.requests if facts else ()
        self.grant_log.append({"at": round(now, 3), "adapter": adapter, "mode": mode, "budget": budget,
                               "tokens": sum(w.tokens for w in windows),
                               "samples": [int(w.sample_id) for w in windows],  # in the scheduler's order
                               "decoding": sum(r.output_tokens > 0 for r in reqs),
                               "prefilling": sum(r.output_tokens == 0 for r in reqs), "reason": reason,
                               "window_cost_factor": round(self.window_cost.factor, 4)})
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
            sample = FineTuneSample(str(r.sample_id), max(1, int(r.tokens)), float(r.arrival), float(r.loss),
                                    passes=int(r.passes_before))
            outcome = "retired" if sched is None else sched.report_pass(sample, now)
            verdicts.append(PassVerdict(r.sample_id, outcome, r.passes_before + 1, float(r.loss),
                                        now if outcome == "requeued" else float(r.arrival)))
        self.grants["passes"] += len(verdicts)
        self.grants["requeued"] += sum(v.outcome == "requeued" for v in verdicts)
        self.pass_log.extend({"at": round(now, 3), "adapter": adapter, "id": v.sample_id, "loss": round(v.loss, 6),
                              "passes": v.passes, "outcome": v.outcome} for v in verdicts)
        return verdicts

    def status(self) -> dict[str, Any]:
        """The node's part of ``/v1/status``: grants, the memory guard, the window-cost refit."""
        g, w = self.guard, self.window_cost
        return {
            "training_grants": dict(self.grants, recent=list(self.grant_log), passes_recent=list(self.pass_log)),
            # LEMIX Alg. 2's state: κ·M_peak and the calibration ratio (measured / modelled bytes).
            "memory_guard": None if g is None else {
                "threshold_bytes": g.threshold(), "ratio": round(g.ratio(), 4), "waiting_since": self.memory_wait_since},
            # The live refit of t_ft: the factor on the profile's fine-tuning terms, and how far the recent
            # grants' modelled time was from the measured one ((modelled − measured) / measured).
            "window_cost": {"factor": round(w.factor, 4), "grants_measured": len(w.samples),
                            "median_error": _rounded(w.median_error()),
                            "median_abs_error": _rounded(w.median_abs_error())},
        }
