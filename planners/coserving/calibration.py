"""Live refits of the co-serving cost model from what ran: the fine-tuning windows' time, the engine's iterations, ρ.

The profile (``app.profile``) fits t_ft on plain LoRA steps of one shape; the trainer's windows
are another thing (DPO runs a reference pass and two sequences per pair, an SFT window pays the
step's fixed cost per window), so the modelled window time can be several times off, and the
FlexLLM §6.2 budget s = max{s : t_iter(c) + ρ·t_ft(s) ≤ SLO} with it. ``WindowCostCalibration``
compares, for each grant, the modelled seconds of the windows it granted with the seconds the
trainer measured running them (reported with its next ask), and keeps a factor that later plans
multiply t_ft by, as LEMIX Alg. 2 (lines 13–17) calibrates planned intervals from what ran. The
node keeps one for the forward terms and one for the backward terms (the trainer times the two
phases of its windows apart), so a window of either phase is priced by its own refit.

``InterferenceCalibration`` refits the other two terms of FlexLLM §6.2's window cost
f(c, s) = t_iter(c) + ρ·t_ft(s) from the engine's own steps (``EngineIteration``): t_iter by the
ratio of the measured time between tokens to the modelled iteration, over the steps no fine-tuning
ran beside; ρ by the inference seconds lost beside the measured windows per second of
fine-tuning (``planners/coserving/measurement.py`` matches them). FlexLLM §6.2 derives f from
offline profiling; here the offline profile only starts the estimate, and each node's next budget
uses what was measured on it (LEMIX Alg. 2 lines 13–17: calibrate the plan by the traces).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from planners.costs import CostModel


@dataclass(frozen=True)
class WindowCostSample:
    """One grant: its windows' modelled seconds under the factor in force then, and the measured seconds."""

    modelled_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Relative error of the model as it stood when it planned: (modelled − measured) / measured."""
        return (self.modelled_s - self.measured_s) / self.measured_s


class WindowCostCalibration:
    """A geometric moving average of measured / modelled window seconds, kept within [``low``, ``high``].

    Geometric, not arithmetic: under symmetric noise an arithmetic mean of ratios drifts upward.
    ``rate`` is the weight of each new grant (0.2: about the last ten grants count). Grants shorter
    than ``min_measured_s`` are timer noise and are skipped.
    """

    def __init__(
        self, rate: float = 0.2, low: float = 0.1, high: float = 20.0, min_measured_s: float = 0.002, kept: int = 64
    ) -> None:
        if not 0.0 < rate <= 1.0 or not 0.0 < low <= 1.0 <= high:
            raise ValueError("need 0 < rate <= 1 and 0 < low <= 1 <= high")
        self.rate, self.low, self.high, self.min_measured_s = rate, low, high, min_measured_s
        self.factor = 1.0
        self.samples: deque[WindowCostSample] = deque(maxlen=kept)

    def observe(self, modelled_s: float, measured_s: float) -> None:
        """The windows modelled at ``modelled_s`` (factor included) took ``measured_s``."""
        if modelled_s <= 0 or measured_s < self.min_measured_s:
            return
        self.samples.append(WindowCostSample(modelled_s, measured_s))
        ratio = measured_s / modelled_s  # what the factor in force should have been, relative to itself
        self.factor = min(max(self.factor * ratio**self.rate, self.low), self.high)

    def median_error(self) -> float | None:
        """Median relative error of the recent grants' modelled time (None before the first)."""
        return statistics.median(s.error for s in self.samples) if self.samples else None

    def median_abs_error(self) -> float | None:
        return statistics.median(abs(s.error) for s in self.samples) if self.samples else None


class InterferenceCalibration:
    """ρ and the iteration-time factor k of one node, as ratios of sums over the recent measurements.

    k = Σ measured gap / Σ modelled t_iter over the last ``kept_steps`` engine steps that decoded
    with no fine-tuning beside them (1 until ``min_steps`` were seen); ρ = Σ inference seconds lost
    / Σ fine-tuning seconds over the last ``kept_windows`` windows that ran beside decoding steps
    (the profile's ρ until ``min_windows`` were measured). Ratios of sums, not means of ratios: a
    window of a few milliseconds beside one 60-ms step says little and weighs little. Both are kept
    within [``low``, ``high``]·their start (ρ: absolute bounds [0, 10], as ``CostModel`` allows).
    """

    def __init__(
        self,
        interference: float,
        kept_steps: int = 512,
        kept_windows: int = 32,
        min_steps: int = 16,
        min_windows: int = 3,
        high: float = 10.0,
        span_s: float = 30.0,
        min_run_s: float = 1.0,
    ) -> None:
        self.profile_interference = float(interference)
        self.min_steps, self.min_windows, self.high = min_steps, min_windows, high
        self.span_s, self.min_run_s = span_s, min_run_s
        self._steps: deque[tuple[float, float]] = deque(maxlen=kept_steps)  # (modelled, measured)
        self._windows: deque[tuple[float, float]] = deque(maxlen=kept_windows)  # (lost, fine-tuning seconds)
        self._active: deque[tuple[float, float]] = deque()  # (at, lost) of steps beside training or its aftermath
        self._runs: deque[tuple[float, float]] = deque()  # (end, seconds) of the trainer's runs

    def observe_step(self, modelled_s: float, measured_s: float) -> None:
        """An engine step that decoded with no fine-tuning beside it: modelled t_iter, measured time between tokens."""
        if modelled_s > 0 and measured_s > 0:
            self._steps.append((modelled_s, measured_s))

    def observe_window(self, lost_s: float, ran_s: float) -> None:
        """A window of ``ran_s`` fine-tuning seconds beside which the decoding steps lost ``lost_s`` seconds."""
        if ran_s > 0:
            self._windows.append((lost_s, ran_s))

    def observe_active_step(self, at: float, lost_s: float) -> None:
        """A decoding step beside fine-tuning or in its aftermath lost ``lost_s`` (gap − k·t_iter, may be < 0)."""
        self._active.append((at, lost_s))

    def observe_run(self, end: float, seconds: float) -> None:
        """The trainer ran windows for ``seconds``, ending at ``end``."""
        if seconds > 0:
            self._runs.append((end, seconds))

    def with_aftermath(self, now: float) -> float | None:
        """ρ counting everything training costs the tenants: Σ lost over the decoding steps beside a run or in its
        aftermath (the optimizer step, saving, publishing and loading the version it trained) / Σ run seconds,
        over the last ``span_s``; None until ``min_run_s`` of runs fell in that span."""
        for q in (self._active, self._runs):
            while q and q[0][0] < now - self.span_s:
                q.popleft()
        ran = sum(s for _, s in self._runs)
        if ran < self.min_run_s:
            return None
        return min(max(0.0, sum(lost for _, lost in self._active)) / ran, 10.0)

    @property
    def iteration_factor(self) -> float:
        """k: measured / modelled time of an engine step without fine-tuning beside it."""
        if len(self._steps) < self.min_steps:
            return 1.0
        k = sum(m for _, m in self._steps) / sum(p for p, _ in self._steps)
        return min(max(k, 1.0 / self.high), self.high)

    @property
    def interference(self) -> float:
        """ρ: inference seconds lost per second of fine-tuning beside it (the profile's until measured)."""
        if len(self._windows) < self.min_windows:
            return self.profile_interference
        rho = max(0.0, sum(lost for lost, _ in self._windows)) / sum(ran for _, ran in self._windows)
        return min(rho, 10.0)

    @property
    def windows_measured(self) -> int:
        return len(self._windows)

    @property
    def steps_measured(self) -> int:
        return len(self._steps)


def calibrated(
    cost: CostModel,
    forward: float = 1.0,
    backward: float = 1.0,
    iteration: float = 1.0,
    interference: float | None = None,
) -> CostModel:
    """``cost`` with its forward, backward and iteration terms scaled and ρ replaced (None: kept)."""
    it = cost.iteration
    return replace(
        cost,
        forward=cost.forward.scaled(forward),
        backward=cost.backward.scaled(backward),
        iteration=replace(
            it,
            base=it.base * iteration,
            per_prefill_token=it.per_prefill_token * iteration,
            per_decode_seq=it.per_decode_seq * iteration,
            per_context_token=it.per_context_token * iteration,
        ),
        ft_interference=cost.ft_interference if interference is None else min(max(interference, 0.0), 10.0),
    )
