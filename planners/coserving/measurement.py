"""Each granted fine-tuning window measured against its prediction, and the SLO attainment of the inference beside it.

FlexLLM §6.2 sizes a window so that the iteration beside it meets the SLO, f(c, s) = t_iter(c) +
ρ·t_ft(s) ≤ SLO, with f "derived via offline profiling". Nothing in FlexLLM checks f afterwards;
LEMIX Alg. 2 (lines 13–17) does, for its own plans: "calibrate ⟨start, end⟩ by the execution
traces". Here every grant is checked, on the two clocks the node has:

- the trainer's: when its windows ran and how long each phase took (:class:`WindowRun`);
- the engine's: each step's tokens and the time since the previous step's
  (``EngineIteration.gap_s``, the time between tokens of every request that decoded in it).

:func:`measure_window` pairs a grant's :class:`WindowPrediction` with its run and the engine steps
that overlapped it. The model's own terms then read as measurements: the run's seconds against
the modelled t_ft; the worst time between tokens beside it against f(c, s); the inference
seconds lost beside it, Σ (gap − k·t_iter(c_step)) over the steps whose time between tokens
overlaps the run, against ρ·t_ft. lost / ran is the ρ this window showed
(``planners/coserving/calibration.py`` keeps the node's running estimate).

:class:`TrainingTimeline` says whether fine-tuning ran during an interval (measured runs, and a
grant not reported yet), and :class:`SloAttainment` counts the time between tokens against the TBT
SLO and the first tokens against the TTFT SLO, with fine-tuning beside them and without: the
figure a tenant meets, per node.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from planners.coserving.work import EngineIteration


@dataclass(frozen=True)
class WindowPrediction:
    """What the cost model said of a grant when it was made (FlexLLM §6.2's f(c, s), split in its terms)."""

    granted_at: float
    forward_s: float
    """Modelled seconds of the grant's forward windows (t_ft's forward terms, refit included)."""
    backward_s: float
    """Modelled seconds of its backward work."""
    iteration_s: float
    """t_iter(c) of the inference the plan counted beside it (k included); 0 on an idle engine."""
    interference: float
    """ρ in force."""
    context_per_seq: float = 0.0
    """Mean context tokens of the decoding requests the plan saw: prices the steps beside the window."""

    @property
    def run_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def delay_s(self) -> float:
        """ρ·t_ft: the inference seconds the grant was expected to cost."""
        return self.interference * self.run_s

    @property
    def worst_gap_s(self) -> float:
        """f(c, s) = t_iter(c) + ρ·t_ft(s): the longest time between tokens expected beside the grant."""
        return self.iteration_s + self.delay_s


@dataclass(frozen=True)
class WindowRun:
    """When the trainer ran a grant's windows (its wall clock) and how long each phase took."""

    ran_at: float
    ran_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0

    @property
    def end(self) -> float:
        return self.ran_at + self.ran_s


@dataclass(frozen=True)
class WindowMeasurement:
    """One grant: its prediction, its run, and what the engine's steps beside it showed."""

    prediction: WindowPrediction
    run: WindowRun
    steps: int
    """Decoding engine steps whose time between tokens overlapped the run."""
    worst_gap_s: float | None
    """The longest of their times between tokens (None: no decoding step beside it)."""
    lost_s: float
    """Σ (gap − k·t_iter) over those steps."""

    @property
    def duration_error(self) -> float | None:
        """(modelled − measured) / measured seconds of the run."""
        return None if self.run.ran_s <= 0 else (self.prediction.run_s - self.run.ran_s) / self.run.ran_s

    @property
    def worst_gap_error(self) -> float | None:
        """(f(c, s) − measured worst time between tokens) / measured; negative: the model promised too little."""
        if self.worst_gap_s is None or self.worst_gap_s <= 0:
            return None
        return (self.prediction.worst_gap_s - self.worst_gap_s) / self.worst_gap_s

    @property
    def delay_error_s(self) -> float | None:
        """ρ·t_ft − lost, in seconds (lost is often near 0, so no ratio)."""
        return None if self.steps == 0 else self.prediction.delay_s - self.lost_s

    @property
    def interference(self) -> float | None:
        """ρ this window showed: inference seconds lost per second of fine-tuning."""
        return None if self.steps == 0 or self.run.ran_s <= 0 else self.lost_s / self.run.ran_s

    def as_json(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "at": round(self.run.ran_at, 3),
            "ran_s": round(self.run.ran_s, 4),
            "modelled_s": round(p.run_s, 4),
            "forward_s": round(self.run.forward_s, 4),
            "backward_s": round(self.run.backward_s, 4),
            "steps_beside": self.steps,
            "worst_gap_s": _r(self.worst_gap_s),
            "predicted_worst_gap_s": round(p.worst_gap_s, 4),
            "lost_s": round(self.lost_s, 4),
            "predicted_delay_s": round(p.delay_s, 4),
            "interference": _r(self.interference),
        }


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Seconds [a0, a1] and [b0, b1] share."""
    return max(0.0, min(a1, b1) - max(a0, b0))


def measure_window(
    prediction: WindowPrediction,
    run: WindowRun,
    steps: Iterable[EngineIteration],
    modelled_step: Callable[[EngineIteration], float],
) -> WindowMeasurement:
    """The engine steps beside ``run`` against ``prediction``; ``modelled_step`` is k·t_iter of a step."""
    count, worst, lost = 0, None, 0.0
    for st in steps:
        if st.decode_seqs <= 0 or not st.gap_s:
            continue
        shared = overlap(st.at - st.gap_s, st.at, run.ran_at, run.end)
        if shared <= 0:
            continue
        count += 1
        worst = st.gap_s if worst is None else max(worst, st.gap_s)
        # Whole, not by the share the run covers: when the two take turns (FlexLLM's GPU case, ρ = 1) a step that
        # overlaps the run at all waits for the part of it inside the step, and its whole excess is that wait.
        lost += st.gap_s - modelled_step(st)
    return WindowMeasurement(prediction, run, count, worst, lost)


class TrainingTimeline:
    """When fine-tuning ran on one node: the measured runs, and the grant made but not reported yet.

    One trainer rank per node asks for one grant at a time, so at most one grant is open. An open
    grant not reported within ``stale_s`` (its rank died) is taken as having run for its modelled
    seconds.
    """

    def __init__(self, kept: int = 512, stale_s: float = 10.0) -> None:
        self.runs: deque[tuple[float, float]] = deque(maxlen=kept)
        self.open_since: float | None = None
        self._open_run_s = 0.0
        self.stale_s = stale_s

    def granted(self, at: float, modelled_s: float) -> None:
        if self.open_since is not None:  # the previous grant was never reported: assume it ran as modelled
            self.runs.append((self.open_since, self.open_since + self._open_run_s))
        self.open_since, self._open_run_s = at, modelled_s

    def ran(self, start: float, end: float) -> None:
        self.runs.append((start, end))
        self.open_since = None

    def expire(self, now: float) -> None:
        if self.open_since is not None and now - self.open_since > self.stale_s:
            self.granted(now, 0.0)
            self.open_since = None

    def training(self, t0: float, t1: float) -> bool | None:
        """Did fine-tuning run during [t0, t1]? None: not known yet (a grant made before t1 is not reported)."""
        if any(overlap(t0, t1, a, b) > 0 for a, b in reversed(self.runs)):
            return True
        if self.open_since is not None and self.open_since <= t1:
            return None
        return False


@dataclass
class _Count:
    within: int = 0
    total: int = 0

    def share(self) -> float | None:
        return None if self.total == 0 else self.within / self.total


class SloAttainment:
    """The share of times between tokens within the TBT SLO and of first tokens within the TTFT SLO, with
    fine-tuning beside them (``training``) and without. A step's time between tokens counts once per
    request that decoded in it."""

    KINDS = ("tbt", "ttft")

    def __init__(self, tbt_s: float, ttft_s: float) -> None:
        self.tbt_s, self.ttft_s = tbt_s, ttft_s
        self.counts = {(kind, training): _Count() for kind in self.KINDS for training in (True, False)}
        self._gaps: dict[bool, deque[float]] = {True: deque(maxlen=4096), False: deque(maxlen=4096)}

    def gap(self, seconds: float, requests: int, training: bool) -> None:
        c = self.counts[("tbt", training)]
        c.total += requests
        c.within += requests if seconds <= self.tbt_s else 0
        self._gaps[training].append(seconds)

    def first_token(self, seconds: float, training: bool) -> None:
        c = self.counts[("ttft", training)]
        c.total += 1
        c.within += seconds <= self.ttft_s

    def share(self, kind: str, training: bool) -> float | None:
        return self.counts[(kind, training)].share()

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tbt_slo_s": round(self.tbt_s, 4), "ttft_slo_s": self.ttft_s}
        for kind in self.KINDS:
            for training in (True, False):
                c = self.counts[(kind, training)]
                out[f"{kind}_{'training' if training else 'no_training'}"] = {
                    "share": _r(c.share()),
                    "within": c.within,
                    "total": c.total,
                }
        for training in (True, False):
            gaps = sorted(self._gaps[training])
            out[f"gap_p99_s_{'training' if training else 'no_training'}"] = (
                round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 4) if gaps else None
            )
        return out


def median(xs: Iterable[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None
