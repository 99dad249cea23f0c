"""Retraining policies: whether a trainer may run its next LoRA micro-step on a node now, and how much of it.

The trainer asks ``Planner.grant(node, adapter, mode, samples)`` for its next token windows. An
adapter in mode ``hybrid`` is granted by the node's co-serving scheduler (``planners/coserving/``,
``planner.iteration``); for the other modes, and for ``hybrid`` when ``planner.iteration`` is null,
the planner builds a :class:`RetrainingView` from its node state and cost model and calls the
adapter's policy (registry kind ``retraining``, chosen by the adapter's ``mode``), whose granted
samples become whole-pass windows:

- ``hybrid`` (with ``planner.iteration: null``): LEMIX §IV-C queue-level deprioritization (Eq. 4). A training step
  runs only if the predicted response time of the next inference request on the node, with the
  step added in front of it, stays within the SLO; a step that does not fit is shrunk (fewer
  samples) before it is refused, and a bounded wait keeps training from starving (the role of
  MACE §4.1's aging term δ_ft·(t − t_arr), which lifts fine-tuning priority over time).
- ``sync``: AdaInf-like FT-first (MACE §6.1 baseline): train as soon as there is feedback, even if
  inference waits.
- ``periodic``: Ekya-like (MACE §6.1 baseline, §3.1 "periodic retraining"): every T seconds, or
  as soon as K samples are queued, train on everything that arrived before the trigger, ignoring
  inference latency; nothing in between.
- ``off``: never train.

Pure: plain dataclasses in, a :class:`RetrainingDecision` out; no Ray, no torch, no I/O.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from planners.registry import create, register


@dataclass(frozen=True)
class RetrainingView:
    """What a retraining policy may know when a trainer asks to run a micro-step on one node."""

    now: float
    node_id: int
    in_flight: int
    """Inference requests running or queued on the node."""
    ttft_p50_s: float | None
    """Median TTFT over the node's recent execution traces (None: no traces yet)."""
    ttft_p99_s: float | None
    slo_ttft_s: float
    """τ_R of LEMIX Eq. 4: the TTFT an inference request must not exceed."""
    predicted_ttft_s: float
    """The planner's predicted TTFT of a new inference request on the node (cost model + its queue)."""
    queued: int
    """Unconsumed feedback items of this adapter (including items trained into an unpublished version)."""
    oldest_queued_age_s: float | None
    """Seconds since the oldest unconsumed item was accepted (None: queue empty)."""
    last_run_at: float | None
    """When this adapter was last granted a step (any node), None if never."""
    samples_wanted: int
    tokens_wanted: int
    step_cost_s: float
    """The cost model's estimated seconds for the wanted micro-step (all samples_wanted)."""


@dataclass(frozen=True)
class RetrainingDecision:
    """A policy's answer: run ``samples`` of the wanted samples (``tokens`` of the wanted tokens) now, or wait."""

    action: Literal["run", "wait"]
    samples: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    reason: str = ""
    """Why, in a few words, for the trainer's status and logs (not part of the planner's answer)."""


class RetrainingPolicy(Protocol):
    def decide(self, view: RetrainingView) -> RetrainingDecision: ...


def step_cost(view: RetrainingView, samples: int) -> float:
    """Estimated seconds of a micro-step with ``samples`` of the wanted samples.

    Linear in the batch size, as LEMIX's per-task cost η_F·C·ℓ² is linear in C (§IV-A).
    """
    if view.samples_wanted <= 0:
        return 0.0
    return max(0.0, view.step_cost_s) * samples / view.samples_wanted


def _run(view: RetrainingView, samples: int, reason: str) -> RetrainingDecision:
    samples = max(0, min(samples, view.samples_wanted))
    tokens = math.ceil(max(0, view.tokens_wanted) * samples / view.samples_wanted) if view.samples_wanted else 0
    return RetrainingDecision("run", samples=samples, tokens=tokens, reason=reason)


def _wait(seconds: float, reason: str) -> RetrainingDecision:
    return RetrainingDecision("wait", wait_s=max(0.0, seconds), reason=reason)


@register("retraining", "hybrid")
class Hybrid:
    """LEMIX Eq. 4 as a grant: run the largest part of the step that keeps the next request within the SLO.

    LEMIX defers a training task when ``max end of the node queue + η_F·C'·ℓ'² − a' > τ_R`` for
    the next inference task. Here the planner's ``predicted_ttft_s`` is that response time
    without the step, and the step's cost (``step_cost_s``, linear in the samples) is what the
    step would add in front of the next request. The grant is the largest ``n ≤ samples_wanted``
    with ``base + cost(n) ≤ slo_fraction·slo_ttft_s``; ``n = 0`` means wait ``recheck_s``.

    ``base`` is the prediction, raised to the node's observed median TTFT while requests are in
    flight (``use_observed``): the execution-trace calibration of LEMIX Alg. 2 (lines 13–17),
    so a cost model that is too optimistic under load does not let training in. An idle node
    is judged by the prediction alone (old traces say nothing about the next arrival).

    Starvation, in two steps after MACE §4.1, whose fine-tuning priority
    ``P_ft(t) = π_ft + δ_ft·(t − t_arr)`` grows with waiting so that retraining never starves:

    - aging: the budget grows by ``aging`` seconds of TTFT per second the oldest queued item has
      waited (``δ_ft``), so when inference alone already breaks the SLO (e.g. a machine shared
      with other work) training resumes after a wait proportional to the excess, in small steps;
      ``aging=0`` is LEMIX Eq. 4 to the letter;
    - bound: once the oldest item has waited ``max_wait_s``, a step that still does not fit runs
      with ``min_samples`` samples. Under sustained overload training thus proceeds at
      ``min_samples`` per step instead of stopping.

    Params: ``slo_fraction`` (1.0) share of the SLO the step may fill; ``aging`` (0.1 s per s);
    ``max_wait_s`` (30.0); ``min_samples`` (1); ``recheck_s`` (0.1) how long a refused trainer
    waits before asking again; ``use_observed`` (True).
    """

    def __init__(self, slo_fraction: float = 1.0, max_wait_s: float = 30.0, min_samples: int = 1,
                 recheck_s: float = 0.1, use_observed: bool = True, aging: float = 0.1) -> None:
        if not 0 < slo_fraction <= 10:
            raise ValueError("slo_fraction must be in (0, 10]")
        if max_wait_s < 0 or recheck_s <= 0 or min_samples < 1 or aging < 0:
            raise ValueError("need max_wait_s >= 0, recheck_s > 0, min_samples >= 1, aging >= 0")
        self.aging = aging
        self.slo_fraction = slo_fraction
        self.max_wait_s = max_wait_s
        self.min_samples = min_samples
        self.recheck_s = recheck_s
        self.use_observed = use_observed

    def base_ttft(self, view: RetrainingView) -> float:
        """The response time the next inference request would see without the step."""
        base = max(0.0, view.predicted_ttft_s)
        if self.use_observed and view.in_flight > 0 and view.ttft_p50_s is not None:
            base = max(base, view.ttft_p50_s)
        return base

    def allowance(self, view: RetrainingView) -> float:
        """Seconds of TTFT beyond the SLO that aging allows now (0 for a fresh queue)."""
        return self.aging * max(0.0, view.oldest_queued_age_s or 0.0)

    def starved(self, view: RetrainingView) -> bool:
        return view.oldest_queued_age_s is not None and view.oldest_queued_age_s >= self.max_wait_s

    def decide(self, view: RetrainingView) -> RetrainingDecision:
        if view.samples_wanted <= 0:
            return _wait(self.recheck_s, "nothing to train")
        budget = self.slo_fraction * view.slo_ttft_s + self.allowance(view) - self.base_ttft(view)
        per_sample = step_cost(view, 1)
        if budget < 0:
            fits = 0
        elif per_sample <= 0 or budget >= per_sample * view.samples_wanted:
            fits = view.samples_wanted
        else:
            fits = max(0, math.floor(budget / per_sample + 1e-9))
        if fits >= view.samples_wanted:
            return _run(view, fits, "fits the SLO")
        if fits > 0:
            return _run(view, fits, f"shrunk to {fits}/{view.samples_wanted} to fit the SLO")
        if self.starved(view):
            return _run(view, self.min_samples, f"starvation bound: oldest item waited {view.oldest_queued_age_s:.1f}s")
        # Ask again soon, but not later than the moment the starvation bound applies.
        left = self.max_wait_s - (view.oldest_queued_age_s or 0.0)
        return _wait(min(self.recheck_s, left) if left > 0 else self.recheck_s, "would break the TTFT SLO")


@register("retraining", "sync")
class Sync:
    """AdaInf-like FT-first (MACE §6.1 baseline): any queued feedback trains now, whole step, SLO ignored.

    Params: ``recheck_s`` (0.1) wait when there is nothing to train.
    """

    def __init__(self, recheck_s: float = 0.1) -> None:
        self.recheck_s = recheck_s

    def decide(self, view: RetrainingView) -> RetrainingDecision:
        if view.samples_wanted <= 0 or view.queued <= 0:
            return _wait(self.recheck_s, "nothing to train")
        return _run(view, view.samples_wanted, "FT-first")


@register("retraining", "periodic")
class Periodic:
    """Ekya-like periodic retraining (MACE §6.1 baseline): train in windows, ignoring inference latency.

    A window opens when ``every_seconds`` have passed since the previous window opened (the first
    one: since the oldest queued item arrived, or since ``last_run_at``), or as soon as
    ``every_samples`` items are queued. It then grants whole steps until every item that arrived
    before the window opened has been consumed (the oldest queued item is younger than the
    window); items arriving meanwhile wait for the next window. A trainer that holds items in an
    unpublished version may train up to one version's worth of newer items in the same window.

    Params: ``every_seconds`` (60.0, None: no timer), ``every_samples`` (None), ``recheck_s``
    (1.0) the longest wait between two questions while no window is open. The adapter's own
    ``periodic`` settings (AdapterSpec) override these when the planner passes them.
    """

    def __init__(self, every_seconds: float | None = 60.0, every_samples: int | None = None,
                 recheck_s: float = 1.0) -> None:
        if every_seconds is None and every_samples is None:
            raise ValueError("periodic needs every_seconds or every_samples")
        if (every_seconds is not None and every_seconds <= 0) or (every_samples is not None and every_samples < 1):
            raise ValueError("every_seconds must be > 0 and every_samples >= 1")
        self.every_seconds = every_seconds
        self.every_samples = every_samples
        self.recheck_s = recheck_s
        self.window_opened_at: float | None = None

    def _in_window(self, view: RetrainingView) -> bool:
        if self.window_opened_at is None or view.oldest_queued_age_s is None:
            return False
        return view.now - view.oldest_queued_age_s <= self.window_opened_at

    def _reference(self, view: RetrainingView) -> float:
        if self.window_opened_at is not None:
            return self.window_opened_at
        if view.last_run_at is not None:
            return view.last_run_at
        if view.oldest_queued_age_s is not None:
            return view.now - view.oldest_queued_age_s
        return view.now

    def decide(self, view: RetrainingView) -> RetrainingDecision:
        if view.samples_wanted <= 0 or view.queued <= 0:
            return _wait(self.recheck_s, "nothing to train")
        if self._in_window(view):
            return _run(view, view.samples_wanted, "periodic window open")
        if self.every_samples is not None and view.queued >= self.every_samples:
            self.window_opened_at = view.now
            return _run(view, view.samples_wanted, f"{view.queued} samples queued")
        if self.every_seconds is not None:
            due_in = self._reference(view) + self.every_seconds - view.now
            if due_in <= 0:
                self.window_opened_at = view.now
                return _run(view, view.samples_wanted, "period elapsed")
            return _wait(min(self.recheck_s, due_in), f"next window in {due_in:.1f}s")
        return _wait(self.recheck_s, f"{view.queued}/{self.every_samples} samples queued")


@register("retraining", "off")
class Off:
    """No retraining: feedback is stored and waits (MACE's no-retrain baseline). Params: ``recheck_s`` (1.0)."""

    def __init__(self, recheck_s: float = 1.0) -> None:
        self.recheck_s = recheck_s

    def decide(self, view: RetrainingView) -> RetrainingDecision:
        return _wait(self.recheck_s, "retraining is off")


def make_policy(mode: str, params: Mapping[str, Any] | None = None,
                adapter_params: Mapping[str, Any] | None = None) -> RetrainingPolicy:
    """Build the policy of ``mode`` from shared config params, keeping only the keywords it takes.

    ``params``: ``training.retraining_params``, one dict for all modes, so e.g. ``max_wait_s``
    (hybrid) and ``every_seconds`` (periodic) can sit side by side; ``adapter_params`` (e.g. an
    adapter's ``periodic`` settings, None included: "no timer") win over them. A keyword no policy takes is an error, so a
    typo does not pass silently.
    """
    merged = {**(params or {}), **(adapter_params or {})}
    known = set().union(*(inspect.signature(cls).parameters for cls in (Hybrid, Sync, Periodic, Off)))
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown retraining params {unknown}; known: {sorted(known)}")
    cls = {"hybrid": Hybrid, "sync": Sync, "periodic": Periodic, "off": Off}.get(mode)
    taken = inspect.signature(cls).parameters if cls is not None else {}
    return create("retraining", mode, **{k: v for k, v in merged.items() if k in taken})


def route_feedback(queued_by_node: Mapping[int, int], ready: list[int], count: int) -> list[int]:
    """Nodes for ``count`` new feedback items of one adapter under the ``per_node`` scope (LEMIX §V-B).

    Each node trains its own copy on its local share of the feedback, so items go where that
    adapter's queue is shortest (ties: the lower node id), one at a time: the nodes' backlogs,
    and with them their copies' freshness, stay even. ``queued_by_node``: unconsumed items per node.
    """
    if not ready:
        raise ValueError("no ready node to route feedback to")
    load = {n: queued_by_node.get(n, 0) for n in ready}
    out = []
    for _ in range(count):
        node = min(load, key=lambda n: (load[n], n))
        load[node] += 1
        out.append(node)
    return out
