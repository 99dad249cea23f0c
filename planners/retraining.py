"""Retraining policies: whether a trainer may run its next LoRA micro-step on a node now, and how much of it.

The trainer asks ``Planner.grant(node, adapter, mode, samples)`` for its next token windows. An
adapter in mode ``hybrid`` is granted by the node's co-serving scheduler (``planners/coserving/``,
``planner.iteration``); for the other modes, and for ``hybrid`` when ``planner.iteration`` is null,
the planner builds a :class:`RetrainingView` from its feedback queue and its placement and calls the
adapter's policy (registry kind ``retraining``, chosen by the adapter's ``mode``), whose granted
samples become whole-pass windows:

- ``hybrid`` (with ``planner.iteration: null``): LEMIX §IV-C queue-level deprioritization (Eq. 4),
  decided by the placement (``RetrainingView.deprioritized``): the step runs unless, placed on its
  node now, it would push the predicted next inference request past τ_R on every node; a bounded
  wait keeps training from starving (the role of MACE §4.1's aging term δ_ft·(t − t_arr)).
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
    queued: int
    """Unconsumed feedback items of this adapter (including items trained into an unpublished version)."""
    oldest_queued_age_s: float | None
    """Seconds since the oldest unconsumed item was accepted (None: queue empty)."""
    last_run_at: float | None
    """When this adapter was last granted a step (any node), None if never."""
    samples_wanted: int
    tokens_wanted: int
    deprioritized: bool = False
    """The placement's verdict on the wanted step (LEMIX §IV-C, Eq. 4): placed on this node now it would
    push the predicted next inference request past τ_R on every node. Only ``placement: lemix`` ever
    says so (``planners/placement/training.py``); the baselines have no Eq. 4."""


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


def _run(view: RetrainingView, samples: int, reason: str) -> RetrainingDecision:
    samples = max(0, min(samples, view.samples_wanted))
    tokens = math.ceil(max(0, view.tokens_wanted) * samples / view.samples_wanted) if view.samples_wanted else 0
    return RetrainingDecision("run", samples=samples, tokens=tokens, reason=reason)


def _wait(seconds: float, reason: str) -> RetrainingDecision:
    return RetrainingDecision("wait", wait_s=max(0.0, seconds), reason=reason)


@register("retraining", "hybrid")
class Hybrid:
    """LEMIX §IV-C queue-level deprioritization (Eq. 4) as a grant, bounded so training never starves.

    The verdict is the placement's, one implementation of Eq. 4 for the simulator, the routers and
    this grant path: ``view.deprioritized`` says whether the wanted step, planned on the asking node
    now, would push the predicted next inference request past τ_R on every node
    (``LemixPlacement.deprioritizes``; τ_R is ``training.slo_ttft_s``). Not deprioritized: the whole
    step runs. Deprioritized: wait ``recheck_s`` and ask again, until the oldest queued item has
    waited ``max_wait_s``; then ``min_samples`` run anyway, the role of MACE §4.1's aging term
    δ_ft·(t − t_arr), so under sustained overload training goes on slowly instead of stopping.

    Params: ``max_wait_s`` (30.0), ``min_samples`` (1), ``recheck_s`` (0.1).
    """

    def __init__(self, max_wait_s: float = 30.0, min_samples: int = 1, recheck_s: float = 0.1) -> None:
        if max_wait_s < 0 or recheck_s <= 0 or min_samples < 1:
            raise ValueError("need max_wait_s >= 0, recheck_s > 0, min_samples >= 1")
        self.max_wait_s = max_wait_s
        self.min_samples = min_samples
        self.recheck_s = recheck_s

    def starved(self, view: RetrainingView) -> bool:
        return view.oldest_queued_age_s is not None and view.oldest_queued_age_s >= self.max_wait_s

    def decide(self, view: RetrainingView) -> RetrainingDecision:
        if view.samples_wanted <= 0:
            return _wait(self.recheck_s, "nothing to train")
        if not view.deprioritized:
            return _run(view, view.samples_wanted, "Eq. 4: the next inference request keeps its SLO")
        if self.starved(view):
            return _run(
                view,
                self.min_samples,
                f"starvation bound: oldest item waited {view.oldest_queued_age_s:.1f}s despite Eq. 4",
            )
        # Ask again soon, but not later than the moment the starvation bound applies.
        left = self.max_wait_s - (view.oldest_queued_age_s or 0.0)
        return _wait(
            min(self.recheck_s, left) if left > 0 else self.recheck_s,
            "Eq. 4: the next inference request would miss its SLO on every node",
        )


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

    def __init__(
        self, every_seconds: float | None = 60.0, every_samples: int | None = None, recheck_s: float = 1.0
    ) -> None:
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


def make_policy(
    mode: str, params: Mapping[str, Any] | None = None, adapter_params: Mapping[str, Any] | None = None
) -> RetrainingPolicy:
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
